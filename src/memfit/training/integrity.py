"""Checks of a saved training state before a run resumes from it: checksum, types, ranges, options.

NOTE [ Checked resume files ]
torch does not check the CRCs of the zip archive it writes, and a state that loads is not yet a
state that can be trained from: a flipped bit in an ``exp_avg`` turns 0.0 into 2.0 and the run goes
on silently. So every save carries a checksum and every resume checks it, then the state's values:

- **Checksum**: :func:`seal` adds ``checksum = {"algorithm": "sha256", "digest": ...}``, the
  SHA-256 of the state's content walked in a fixed order (keys, types, tensor dtypes, shapes and
  bytes, numbers), not of the file's bytes: the file can be read back and checked without
  re-serialising it, and a byte that changes nothing loaded (zip padding) changes nothing checked.
  :func:`check_seal` refuses a state whose content does not give its digest (any change to a
  weight, an optimizer moment, a counter, an RNG state or the digest itself). The zip's own CRCs
  are checked first (:func:`check_archive`), which names the damaged record. A state without a
  checksum (``torch.save(acc.state_dict(), path)`` in Python, or an older memfit) loads with a
  warning.
- **Values** (:func:`check_values`): counters are non-negative ints; weights, buffers and optimizer
  moments are finite; ``exp_avg_sq`` is >= 0; every tensor has the dtype of the model's tensor of
  the same name (optimizer moments: one of the parameters' dtypes); the RNG states have the types
  and sizes torch, Python and NumPy give them; ``micro_batch`` is an int >= 1.
- **Options** (:func:`changed_options`): the options a run was saved with (``extra.options``) are
  compared with the resumed run's: a change that cannot continue the run (a GradScaler's state to
  a run without one, or the reverse) is refused; every other change is one warning line each
  (``--seed``: the saved random streams continue, the new seed is not used).
"""

from __future__ import annotations

import hashlib
import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from memfit.training.savepath import TrainStateError

__all__ = ["changed_options", "check_archive", "check_seal", "check_values", "seal", "state_digest"]

CHECKSUM_KEY = "checksum"
_ALGORITHM = "sha256"
_FIX = "Resume from another saved state, or start without --resume."


# -- checksum ---------------------------------------------------------------------------------------


def state_digest(state: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of ``state``'s content, its ``checksum`` entry left out (NOTE [ Checked resume files ])."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != CHECKSUM_KEY})
    return h.hexdigest()


def seal(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with its checksum added (a new dict; ``state`` is not changed)."""
    return {**state, CHECKSUM_KEY: {"algorithm": _ALGORITHM, "digest": state_digest(state)}}


def check_seal(path: str | Path, state: Mapping[str, Any]) -> str | None:
    """Refuse ``state`` when its content does not give its checksum; a warning when it has none.

    Raises:
        TrainStateError: the checksum is malformed or does not match.
    """
    seal_ = state.get(CHECKSUM_KEY)
    if seal_ is None:
        return (
            f"memfit.trainstate: {str(path)!r} has no checksum (written by torch.save or an older memfit): "
            "its content could not be checked; memfit train --save writes one."
        )
    if (
        not isinstance(seal_, Mapping)
        or seal_.get("algorithm") != _ALGORITHM
        or not isinstance(seal_.get("digest"), str)
    ):
        raise TrainStateError(f"memfit.trainstate: {str(path)!r} has a damaged checksum entry. {_FIX}")
    if state_digest(state) != seal_["digest"]:
        raise TrainStateError(
            f"memfit.trainstate: {str(path)!r} fails its checksum (SHA-256 of its content): the file was changed or "
            f"damaged after it was saved. {_FIX}"
        )
    return None


def check_archive(path: str | Path) -> None:
    """Check the CRC-32 of every record of the zip archive torch wrote (torch reads without checking).

    Raises:
        TrainStateError: a record's data does not match its CRC, or the archive cannot be read.
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as err:
        raise TrainStateError(f"memfit.trainstate: {str(path)!r} is a damaged torch archive ({err}). {_FIX}") from None
    if bad is not None:
        raise TrainStateError(
            f"memfit.trainstate: {str(path)!r} is damaged: record {bad!r} does not match its CRC-32. {_FIX}"
        )


def _feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` by type and content, in an order that does not depend on how it was built."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's bytes, not a copy
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)};".encode())
        for key in sorted(obj, key=lambda k: (type(k).__name__, repr(k))):
            _feed(h, key)
            _feed(h, obj[key])
    elif isinstance(obj, list | tuple):
        h.update(f"{type(obj).__name__[0]}{len(obj)};".encode())
        for item in obj:
            _feed(h, item)
    else:  # str, int, float, bool, None, torch.dtype / torch.Size and the other types torch loads
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


# -- values -----------------------------------------------------------------------------------------

_COUNTERS = ("optimizer_steps", "skipped_steps", "consecutive_skips", "windows", "samples_seen")


def check_values(path: str | Path, state: Mapping[str, Any], model: torch.nn.Module) -> None:
    """Refuse a state whose counters, tensors or RNG states no run can continue from (NOTE [ Checked resume files ]).

    Raises:
        TrainStateError: the first bad value, named with its place in the state.
    """
    where = f"memfit.trainstate: {str(path)!r} holds"
    counters = state.get("counters")
    if not isinstance(counters, Mapping):
        raise TrainStateError(f"{where} no step counters (a {type(counters).__name__}). {_FIX}")
    for name in _COUNTERS:
        value = counters.get(name, 0 if name == "consecutive_skips" else None)
        if type(value) is not int or value < 0:
            raise TrainStateError(f"{where} counters.{name} = {value!r}; it must be an int >= 0. {_FIX}")
    config = state.get("config") or {}
    micro = config.get("micro_batch") if isinstance(config, Mapping) else None
    if micro is not None and (type(micro) is not int or micro < 1):
        raise TrainStateError(f"{where} config.micro_batch = {micro!r}; it must be an int >= 1. {_FIX}")
    model_dtypes = {k: v.dtype for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for key, value in (state.get("model") or {}).items():
        _check_tensor(where, f"model.{key}", value, model_dtypes.get(key))
    _check_optimizer(where, state.get("optimizer"), {p.dtype for p in model.parameters()})
    _check_rng(where, "rng", state.get("rng"))
    for i, rng in enumerate(state.get("rng_per_rank") or []):
        _check_rng(where, f"rng_per_rank[{i}]", rng)
    data_rng = (state.get("extra") or {}).get("data_rng")
    if data_rng is not None:
        _check_torch_rng(where, "extra.data_rng", data_rng)


def _check_tensor(where: str, name: str, value: Any, dtype: torch.dtype | None, *, nonneg: bool = False) -> None:
    if not isinstance(value, torch.Tensor):
        raise TrainStateError(f"{where} {name} = a {type(value).__name__}, not a tensor. {_FIX}")
    if dtype is not None and value.dtype != dtype:
        raise TrainStateError(
            f"{where} {name} in {str(value.dtype).removeprefix('torch.')} and this run's is "
            f"{str(dtype).removeprefix('torch.')}. Resume with the --dtype it was saved with, or another saved state."
        )
    if value.is_floating_point() or value.is_complex():
        if not bool(torch.isfinite(value).all()):
            raise TrainStateError(f"{where} NaN or infinite values in {name}; no step can continue from them. {_FIX}")
        if nonneg and bool((value < 0).any()):
            raise TrainStateError(
                f"{where} negative values in {name} (a running mean of squares, >= 0 in any real run). {_FIX}"
            )


def _check_optimizer(where: str, opt: Any, dtypes: set[torch.dtype]) -> None:
    if opt is None:
        return
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping):
        raise TrainStateError(f"{where} an optimizer state of the wrong form. {_FIX}")
    for index, entry in opt["state"].items():
        if not isinstance(entry, Mapping):
            raise TrainStateError(f"{where} optimizer.state[{index!r}] = a {type(entry).__name__}. {_FIX}")
        for key, value in entry.items():
            name = f"optimizer.state[{index!r}].{key}"
            if key == "step":
                step = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step) or step < 0:
                    raise TrainStateError(f"{where} {name} = {step!r}; it must be a number >= 0. {_FIX}")
                continue
            if not isinstance(value, torch.Tensor):  # SGD's None momentum buffer, another optimizer's numbers
                if isinstance(value, float) and not math.isfinite(value):
                    raise TrainStateError(f"{where} {name} = {value}; no step can continue from it. {_FIX}")
                continue
            if value.is_floating_point() and value.dtype not in dtypes:
                allowed = " or ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                raise TrainStateError(
                    f"{where} {name} in {str(value.dtype).removeprefix('torch.')} and this run's parameters are in "
                    f"{allowed}. Resume with the --dtype it was saved with, or another saved state."
                )
            _check_tensor(where, name, value, None, nonneg=key == "exp_avg_sq")


def _check_torch_rng(where: str, name: str, value: Any) -> None:
    ref = torch.get_rng_state()
    if not isinstance(value, torch.Tensor) or value.dtype != ref.dtype or value.shape != ref.shape:
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise TrainStateError(
            f"{where} {name} = {got}; a torch CPU generator state is a uint8 tensor of {ref.numel()} bytes. {_FIX}"
        )


def _check_rng(where: str, name: str, rng: Any) -> None:
    """The RNG part of an Accumulator state (memfit.capture.snapshot.RngSnapshot.to_dict)."""
    if not isinstance(rng, Mapping):
        raise TrainStateError(f"{where} {name} = a {type(rng).__name__}, not the random generators' states. {_FIX}")
    _check_torch_rng(where, f"{name}.torch", rng.get("torch"))
    py = rng.get("python")
    internal = py.get("internal") if isinstance(py, Mapping) else None
    if (
        not isinstance(py, Mapping)
        or type(py.get("version")) is not int
        or not isinstance(internal, list | tuple)
        or len(internal) != 625
        or not all(type(x) is int and 0 <= x < 2**32 for x in internal[:-1])
        or not isinstance(py.get("gauss_next"), float | type(None))
    ):
        raise TrainStateError(f"{where} {name}.python, not a state of Python's random (625 ints). {_FIX}")
    np_state = rng.get("numpy")
    if np_state is not None:
        keys = np_state.get("keys") if isinstance(np_state, Mapping) else None
        if (
            not isinstance(keys, torch.Tensor)
            or tuple(keys.shape) != (624,)
            or not bool(((keys >= 0) & (keys < 2**32)).all())
            or type(np_state.get("pos")) is not int
            or not 0 <= np_state["pos"] <= 624
        ):
            raise TrainStateError(f"{where} {name}.numpy, not a state of NumPy's MT19937 (624 keys). {_FIX}")
    for i, cuda in enumerate(rng.get("cuda") or []):
        if not isinstance(cuda, torch.Tensor) or cuda.dtype != torch.uint8:
            raise TrainStateError(f"{where} {name}.cuda[{i}], not a CUDA generator state (uint8 tensor). {_FIX}")


# -- options ----------------------------------------------------------------------------------------

# option key -> (the command line's flag, what a change does to the resumed run)
_EFFECTS = {
    "seed": ("--seed", "the saved random streams continue; the new seed is not used"),
    "normalize": (
        "--normalize",
        "the loss is normalised differently: the resumed steps differ from an uninterrupted run",
    ),
    "amp": ("--amp", "the forward runs in another precision: the resumed steps differ from an uninterrupted run"),
    "max_grad_norm": (
        "--max-grad-norm",
        "gradients are clipped differently: the resumed steps differ from an uninterrupted run",
    ),
    "micro_batch": ("--micro-batch", "gradients are equal up to rounding, not bitwise"),
    "device": ("--device", "another device rounds differently and draws dropout from its own generator"),
}


def run_options(
    *, seed: int, normalize: str, amp: str | None, max_grad_norm: float | None, micro_batch: int, device: str
) -> dict[str, Any]:
    """The options a save records, for :func:`changed_options` to compare on resume."""
    return {
        "seed": seed,
        "normalize": normalize,
        "amp": amp,
        "max_grad_norm": max_grad_norm,
        "micro_batch": micro_batch,
        "device": device,
    }


def changed_options(path: str | Path, saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """One warning line per option that differs from the saved run's; raise where the run cannot continue.

    Raises:
        TrainStateError: ``--amp fp16`` (a GradScaler's state) on one side only.
    """
    if not saved:
        return []
    if (saved.get("amp") == "fp16") != (now.get("amp") == "fp16"):
        was = "--amp fp16" if saved.get("amp") == "fp16" else f"--amp {saved.get('amp') or 'off'}"
        raise TrainStateError(
            f"memfit.trainstate: {str(path)!r} was saved with {was} and this run uses --amp {now.get('amp') or 'off'}; "
            "a GradScaler's state (fp16 only) cannot be carried to or from a run without one. "
            f"Resume with {was if saved.get('amp') else 'no --amp'}."
        )
    notes = []
    for key, (flag, effect) in _EFFECTS.items():
        if key in saved and saved[key] != now.get(key):
            notes.append(
                f"resuming {str(path)!r} {_with(flag, now.get(key))}, saved {_with(flag, saved[key])}: {effect}."
            )
    return notes


def _with(flag: str, value: Any) -> str:
    return f"without {flag}" if value is None else f"with {flag} {value}"
