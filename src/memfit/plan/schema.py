"""The plan file's schema: the keys each of its objects may have and the values its fields take.

:meth:`memfit.plan.types.Plan.from_dict` (every reader of a plan file: ``plan``, ``verify``,
``train``, ``explain --plan``, ``estimate --plan``, the integrations) checks a file's JSON here
before reading it, so that a file is either a plan this version writes or refused with one line:
an unknown key (a typo such as ``"tile"`` would otherwise be dropped without a word), a
``"version"`` that is not the integer 1 (``true`` equals 1 in Python), a ``"fingerprint"`` that is
not an object (``null`` would skip the check that the plan is this model's), more tiles than a row
has tokens, or a planner detail out of its range (a negative ``margin`` or ``min_budget_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memfit.errors import PlanFileError

Bad = Callable[[str], PlanFileError]

PLAN_KEYS = frozenset(
    {
        "format", "version", "policy", "chain_path", "blocks", "segments", "head", "activations", "states",
        "workload", "fingerprint", "budget_bytes", "predicted_peak_bytes", "predicted_step_s", "extra",
        "model_states",
    }
)  # fmt: skip
"""The top-level keys of a plan file (``Plan.to_dict``; ``"model_states"``: where each part of the model
states lives, written by ``plan --out`` and ``fit --out`` for readers, :func:`memfit.cli.states.save_plan`)."""
MODEL_STATES_PARTS = frozenset({"parameters", "gradients", "optimizer_state"})
"""``"model_states"``' keys, each ``{"device_bytes": int, "host_bytes": int}``."""
BLOCK_KEYS = frozenset({"name", "option", "action", "policy", "tiles", "tiled", "host_input"})
"""A block's keys (``"action"``: the name of ``"option"`` in files before the rename)."""
SEGMENT_KEYS = frozenset({"start", "stop"})
FINGERPRINT_KEYS = frozenset({"model", "batch"})
MODEL_KEYS = frozenset({"class", "chain_path", "n_blocks", "block_types", "n_params", "dtype", "params_digest"})
"""The model fingerprint's keys (:func:`memfit.plan.policies.model_signature`)."""
TENSOR_KEYS = frozenset({"shape", "dtype"})
"""A batch tensor's keys (:func:`memfit.workload.batch_signature`)."""

# "extra" numbers and the least each takes (the types are checked by memfit.plan.details).
_AT_LEAST = {
    "predicted_peak_with_margin_bytes": 1,
    "min_budget_bytes": 1,
    "baseline_peak_bytes": 1,
    "baseline_step_s": 0,
    "micro_batch": 1,
    "accumulation_steps": 1,
}


def check_plan_json(data: Mapping[str, Any], bad: Bad) -> None:
    """Refuse what :meth:`~memfit.plan.types.Plan.from_dict`'s field checks would let through.

    Args:
        data: a plan file's JSON object (its ``"format"`` already checked).
        bad: makes the error of one fact (the file's name and the fix are added there).

    Raises:
        PlanFileError: an unknown key, a version that is not the integer 1, a fingerprint that is
            not an object of known keys, more tiles than tokens, an ``"extra"`` number out of range.
    """
    _known(data, PLAN_KEYS, "the plan", bad)
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise bad(f'"version" is {version!r}; this memfit writes and reads the integer 1')
    blocks = data.get("blocks")
    for i, b in enumerate(blocks if isinstance(blocks, list) else []):
        if isinstance(b, dict):
            _known(b, BLOCK_KEYS, f"block {i}", bad)
    segments = data.get("segments")
    if segments is not None and not isinstance(segments, list):
        raise bad(f'"segments" is {segments!r}; it is a list of {{"start": i, "stop": j}}')
    for s in segments or []:
        if isinstance(s, dict):
            _known(s, SEGMENT_KEYS, "a segment", bad)
            if any(isinstance(s.get(k), bool) for k in SEGMENT_KEYS):
                raise bad(f"segment {s!r} needs integer start and stop")
    for key in ("budget_bytes", "predicted_peak_bytes"):
        v = data.get(key)
        if isinstance(v, float) and not v.is_integer():
            raise bad(f'"{key}" is {v!r}; it is a whole number of bytes')
    if "fingerprint" in data:
        _check_fingerprint(data["fingerprint"], bad)
    _check_extra(data.get("extra"), bad)
    _check_tiles(blocks, data.get("fingerprint"), bad)
    if "model_states" in data:
        _check_model_states(data["model_states"], bad)


def tokens_per_row(batch: Any) -> int | None:
    """The sequence length of a batch fingerprint: the second dimension of its first tensor of two
    or more dimensions (a token batch ``(B, T)``), or None."""
    for t in batch if isinstance(batch, list) else []:
        shape = t.get("shape") if isinstance(t, dict) else None
        if isinstance(shape, list) and len(shape) >= 2 and isinstance(shape[1], int):
            return shape[1]
    return None


def _known(obj: Mapping[str, Any], keys: frozenset[str], what: str, bad: Bad) -> None:
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise bad(
            f"{what} has unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(keys))}); remove them"
        )


def _check_fingerprint(fingerprint: Any, bad: Bad) -> None:
    if not isinstance(fingerprint, dict):
        raise bad(f'"fingerprint" is {fingerprint!r}; it is the object that says which model and batch the plan is for')
    _known(fingerprint, FINGERPRINT_KEYS, '"fingerprint"', bad)
    model = fingerprint.get("model")
    if model is not None:
        if not isinstance(model, dict):
            raise bad(f'"fingerprint.model" is {model!r}; it is an object (class, blocks, parameters, dtype)')
        _known(model, MODEL_KEYS, '"fingerprint.model"', bad)
        for key in ("n_blocks", "n_params"):
            v = model.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise bad(f'"fingerprint.model.{key}" is {v!r}; it is a count')
        for key in ("class", "chain_path", "dtype", "params_digest"):
            if model.get(key) is not None and not isinstance(model[key], str):
                raise bad(f'"fingerprint.model.{key}" is {model[key]!r}; it is a string')
    batch = fingerprint.get("batch")
    if batch is None:
        return
    if not isinstance(batch, list):
        raise bad(f'"fingerprint.batch" is {batch!r}; it is a list of tensors (shape and dtype) or null')
    for t in batch:
        if not isinstance(t, dict):
            raise bad(f'"fingerprint.batch" holds {t!r}; each tensor is {{"shape": [...], "dtype": "..."}}')
        _known(t, TENSOR_KEYS, "a batch tensor", bad)
        shape, dtype = t.get("shape"), t.get("dtype")
        if not (
            isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        ):
            raise bad(f'a batch tensor\'s "shape" is {shape!r}; it is a list of sizes')
        if not isinstance(dtype, str):
            raise bad(f'a batch tensor\'s "dtype" is {dtype!r}; it is a dtype name such as "int64"')


def _check_extra(extra: Any, bad: Bad) -> None:
    if not isinstance(extra, dict):
        return  # memfit.plan.details says what an "extra" must be
    margin = extra.get("margin")
    if isinstance(margin, int | float) and not isinstance(margin, bool) and not 0 <= margin < 1:
        raise bad(
            f'"extra.margin" is {margin!r}; it is a fraction of the predicted peak, from 0 to below 1 (0.02 = 2 %)'
        )
    for key, least in _AT_LEAST.items():
        v = extra.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and v < least:
            raise bad(f'"extra.{key}" is {v!r}; it is at least {least}')


def _check_tiles(blocks: Any, fingerprint: Any, bad: Bad) -> None:
    tokens = tokens_per_row(fingerprint.get("batch")) if isinstance(fingerprint, dict) else None
    if tokens is None:
        return
    for b in blocks if isinstance(blocks, list) else []:
        tiles = b.get("tiles") if isinstance(b, dict) else None
        if isinstance(tiles, int) and not isinstance(tiles, bool) and tiles > tokens:
            raise bad(
                f"block {b.get('name')!r} has {tiles} tiles and a row of its batch has {tokens} tokens: a tile holds "
                f"at least one token, so at most {tokens} tiles"
            )


def _check_model_states(parts: Any, bad: Bad) -> None:
    """``"model_states"``: the three parts, each with whole, non-negative device and host bytes."""
    if not isinstance(parts, dict):
        raise bad('"model_states" must be an object of parameters, gradients and optimizer_state')
    _known(parts, MODEL_STATES_PARTS, '"model_states"', bad)
    for name, part in parts.items():
        if not isinstance(part, dict):
            raise bad(f'"model_states.{name}" must be an object with device_bytes and host_bytes')
        _known(part, frozenset({"device_bytes", "host_bytes"}), f'"model_states.{name}"', bad)
        for key, v in part.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f'"model_states.{name}.{key}" is {v!r}; it is a whole number of bytes, 0 or more')
