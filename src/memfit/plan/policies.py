"""Named checkpoint policies as typed values, the plans they give, and plan fingerprints.

A policy names one plan for any model: ``KeepAll`` (plain training), ``RecomputeAll`` (every block
recomputed, as HF gradient checkpointing does), ``EveryNth(k)``, ``Sqrt`` (checkpoint_sequential's
segments), ``Selective`` (every block keeps the op outputs a preset or an op list names) and
``Offload`` (what every block saves waits in host memory). Library functions take these values;
text (``--policy every:2``) is parsed only at the edges by :func:`parse_policy`, and ``str(policy)``
gives that text back (``parse_policy(str(p)) == p``).

Example:
    >>> from torch import nn
    >>> m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    >>> [b.option.value for b in policy_plan(m, EveryNth(2)).blocks]
    ['recompute', 'keep', 'recompute', 'keep']
    >>> parse_policy("selective:save_matmuls") == Selective(preset="save_matmuls")
    True
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.capture.chain import Chain, discover_chain
from memfit.capture.snapshot import RngSnapshot
from memfit.errors import PlanMismatchError, SpecError
from memfit.plan.types import (
    SAVE_ENTRY,
    SAVE_PREFIX,
    SAVE_PRESETS,
    BlockDecision,
    Option,
    Plan,
    Segment,
)
from memfit.workload import Batch, batch_signature, signature_digest

__all__ = [
    "POLICY_HELP",
    "EveryNth",
    "KeepAll",
    "Offload",
    "Policy",
    "RecomputeAll",
    "Selective",
    "Sqrt",
    "check_batch_kind",
    "check_param_dtype",
    "check_plan_for_run",
    "check_fingerprint",
    "make_fingerprint",
    "model_signature",
    "parse_policy",
    "policy_plan",
    "resolve_op",
]

POLICY_HELP = (
    "'none' (keep everything), 'all' (recompute every block, as HF gradient checkpointing does), "
    "'sqrt' (checkpoint_sequential-style segments of about sqrt(N) blocks, each recomputed as one "
    "unit), 'every:K' (recompute every K-th block), 'selective:PRESET' "
    f"({', '.join(SAVE_PRESETS)}), 'selective:save:OP[@K],...' (op overloads whose outputs every "
    "block keeps, e.g. selective:save:aten.addmm.default@1) or 'offload' (what every block saves "
    "waits in host memory)"
)


class Policy:
    """A named checkpoint policy (base of :class:`KeepAll`, :class:`RecomputeAll`,
    :class:`EveryNth`, :class:`Sqrt`, :class:`Selective`, :class:`Offload`).

    ``str(policy)`` is its text, as ``--policy`` takes it and as a plan's ``policy`` field records it.
    """

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class KeepAll(Policy):
    """Keep every activation (plain training). Text: ``none``."""

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True, slots=True)
class RecomputeAll(Policy):
    """Recompute every block in backward (HF gradient checkpointing). Text: ``all``."""

    def __str__(self) -> str:
        return "all"


@dataclass(frozen=True, slots=True)
class EveryNth(Policy):
    """Recompute blocks ``0, k, 2k, ...``. Text: ``every:K``.

    Raises:
        SpecError: ``k`` is not a whole number of at least 1.
    """

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise SpecError(
                f"memfit.plan: unknown policy 'every:{self.k}' (K must be a whole number of at least 1). Use {POLICY_HELP}."
            )

    def __str__(self) -> str:
        return f"every:{self.k}"


@dataclass(frozen=True, slots=True)
class Sqrt(Policy):
    """``torch.utils.checkpoint.checkpoint_sequential``'s segments: about sqrt(N) equal segments, all
    but the last recomputed, each as one unit. Text: ``sqrt``."""

    def __str__(self) -> str:
        return "sqrt"


@dataclass(frozen=True, slots=True)
class Selective(Policy):
    """Every block selective: its recompute returns the outputs of the ops the policy saves.

    Give a preset (``save_matmuls``, ``save_attention``, ``save_matmuls_and_attention``,
    ``torchtitan``; what each saves: :data:`memfit.plan.savepolicy.PRESET_OPS`) or op overloads (``aten.mm.default``: every call;
    ``aten.addmm.default@2``: the block's third call of it), not both; neither saves nothing (a
    slower ``RecomputeAll``). Text: ``selective:PRESET`` or ``selective:save:OP[@K],...``.

    Attributes:
        preset: a preset name, or None.
        ops: op overloads saved, ``namespace.op.overload`` with an optional ``@K``, in order.

    Raises:
        SpecError: an unknown preset, a malformed entry, an op this torch does not have, or both
            a preset and ops.
    """

    preset: str | None = None
    ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if self.preset is not None and self.ops:
            raise SpecError(
                f"memfit.selective: give a preset or ops, not both (preset {self.preset!r}, ops {list(self.ops)}); "
                f"e.g. Selective(preset='save_matmuls') or Selective(ops=('aten.addmm.default',))."
            )
        if self.preset is not None and self.preset not in SAVE_PRESETS:
            raise SpecError(_unknown_save_policy(self.preset))
        for entry in self.ops:
            m = SAVE_ENTRY.match(entry) if isinstance(entry, str) else None
            if m is None:
                raise SpecError(
                    f"memfit.selective: {entry!r} in policy {self.save_text!r} is not 'namespace.op.overload' or "
                    "'namespace.op.overload@K', e.g. aten.addmm.default@2."
                )
            resolve_op(m["op"])

    @classmethod
    def from_save_text(cls, text: str) -> Selective:
        """The policy of a selective block's save text: a preset name or ``save:OP[@K],...``
        (what a plan file's ``policy`` field of a selective block holds).

        Raises:
            SpecError: unknown preset, malformed entry, or an op this torch does not have.
        """
        t = text.strip()
        if t in SAVE_PRESETS:
            return cls(preset=t)
        if not t.startswith(SAVE_PREFIX):
            raise SpecError(_unknown_save_policy(text))
        return cls(ops=tuple(filter(None, (e.strip() for e in t[len(SAVE_PREFIX) :].split(",")))))

    @property
    def save_text(self) -> str:
        """What each block's decision records as its policy: the preset, or ``save:OP,...``."""
        return self.preset if self.preset is not None else SAVE_PREFIX + ",".join(self.ops)

    def __str__(self) -> str:
        return f"selective:{self.save_text}"


@dataclass(frozen=True, slots=True)
class Offload(Policy):
    """Every block offloaded: what it saves for backward waits in host memory (nothing is
    recomputed; see :mod:`memfit.apply.offload`). Text: ``offload``."""

    def __str__(self) -> str:
        return "offload"


def parse_policy(text: str | Policy) -> Policy:
    """The policy a text names (``none``, ``all``, ``sqrt``, ``every:K``, ``selective:PRESET``,
    ``selective:save:OP[@K],...``, ``offload``); a :class:`Policy` is returned as it is.

    Keywords are case-insensitive; op names are not.

    Raises:
        SpecError: any other text (the message lists the accepted forms).
    """
    if isinstance(text, Policy):
        return text
    t = str(text).strip()
    head, sep, rest = t.partition(":")
    head = head.lower()
    if not sep and head in _SIMPLE:
        return _SIMPLE[head]
    if sep and head == "every" and rest.strip().isdigit() and int(rest) >= 1:
        return EveryNth(int(rest))
    if sep and head == "selective":
        return Selective.from_save_text(rest)
    why = " (K must be a whole number of at least 1)" if sep and head == "every" else ""
    raise SpecError(f"memfit.plan: unknown policy {text!r}{why}. Use {POLICY_HELP}.")


_SIMPLE: dict[str, Policy] = {"none": KeepAll(), "all": RecomputeAll(), "sqrt": Sqrt(), "offload": Offload()}


def _unknown_save_policy(text: str) -> str:
    return (
        f"memfit.selective: unknown selective policy {text!r}. Use a preset "
        f"({', '.join(SAVE_PRESETS)}) or an op list such as "
        "'save:aten.addmm.default,aten.bmm.default@0'."
    )


def resolve_op(name: str) -> Any:
    """The op overload named ``namespace.op.overload`` (``"aten.addmm.default"``).

    Raises:
        SpecError: no such op in this torch.
    """
    try:
        ns, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (ValueError, AttributeError, RuntimeError):
        raise SpecError(
            f"memfit.selective: {name!r} is not an op overload of this torch ({torch.__version__}). "
            "Name ops as namespace.op.overload, e.g. aten.addmm.default (see `memfit explain` for "
            "the ops a block runs)."
        ) from None


def policy_plan(
    model: nn.Module,
    policy: Policy | str,
    *,
    chain: Chain | None = None,
    batch: Batch | None = None,
    segment_spans: tuple[tuple[int, int], ...] | None = None,
) -> Plan:
    """The plan a named policy gives for this model.

    Args:
        model: the model (its chain is discovered unless ``chain`` is given).
        policy: a :class:`Policy`, or its text (parsed by :func:`parse_policy`).
        chain: the model's chain, if already known.
        batch: an example batch, recorded in the fingerprint (shapes and dtypes only).
        segment_spans: where a profile found that segments may lie (``Stats.segment_spans``); ``sqrt``
            then recomputes one by one the blocks of a segment outside them. None: the chain's
            containers (each block taking the one before's output is assumed).

    Returns:
        The plan; its ``policy`` field is ``str(policy)``.

    Raises:
        SpecError: unknown policy.
    """
    policy = parse_policy(policy)
    chain = chain or discover_chain(model)
    n = len(chain)
    actions = dict.fromkeys(range(n), Option.KEEP)
    segments: list[Segment] = []
    save: str | None = None
    match policy:
        case KeepAll():
            pass
        case RecomputeAll():
            actions = dict.fromkeys(range(n), Option.RECOMPUTE)
        case EveryNth(k=k):
            actions.update(dict.fromkeys(range(0, n, k), Option.RECOMPUTE))
        case Sqrt():
            allowed = chain.segment_spans if segment_spans is None else segment_spans
            for a, b in _sqrt_segments(model, chain, allowed):
                if b - a == 1:
                    actions[a] = Option.RECOMPUTE
                else:
                    segments.append(Segment(start=a, stop=b))
        case Selective():
            actions, save = dict.fromkeys(range(n), Option.SELECTIVE), policy.save_text
        case Offload():
            actions = dict.fromkeys(range(n), Option.OFFLOAD)
        case _:
            raise SpecError(
                f"memfit.plan: {policy!r} is not one of memfit's policies; use KeepAll(), RecomputeAll(), "
                "EveryNth(k), Sqrt(), Selective(...) or Offload() (memfit.plan.policies)."
            )
    return Plan(
        policy=str(policy),
        chain_path=chain.path,
        blocks=tuple(
            BlockDecision(name=name, option=actions[i], policy=save if actions[i] is Option.SELECTIVE else None)
            for i, name in enumerate(chain.names)
        ),
        segments=tuple(segments),
        fingerprint=make_fingerprint(model, chain, batch),
    )


def _sqrt_segments(model: nn.Module, chain: Chain, allowed: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """``torch.utils.checkpoint.checkpoint_sequential``: equal segments of about sqrt(N) blocks, all
    but the last recomputed; on a chain of several containers the segments stop at each container's
    end. A segment's blocks outside the ``allowed`` spans (where a profile saw a block take what the
    forward computed besides the block before's output: a DenseNet's earlier features) are recomputed
    one by one. Returns the recomputed ``(start, stop)`` pieces (any block list: :mod:`memfit.apply.segments`)."""
    n_seg = max(1, math.ceil(math.sqrt(len(chain))))
    size = max(1, len(chain) // n_seg)
    pieces = [(a, min(a + size, stop)) for start, stop in chain.spans for a in range(start, stop, size)]
    out: list[tuple[int, int]] = []
    for a, b in pieces[:-1]:
        i = a
        while i < b:
            span = next(((s, e) for s, e in allowed if s <= i < e), None)
            stop = min(b, span[1]) if span is not None else i + 1
            out.append((i, stop))
            i = stop
    return out


def model_signature(model: nn.Module, chain: Chain) -> dict[str, Any]:
    """What a plan's model fingerprint records: structure and parameter shapes (checked), and the
    parameters' dtype (recorded only: a plan applied in another dtype trains the same, but its
    memory predictions no longer hold)."""
    params = [(n, list(p.shape)) for n, p in model.named_parameters()]
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())
    return {
        "class": type(model).__name__,
        "chain_path": chain.path,
        "n_blocks": len(chain),
        "block_types": [type(b).__name__ for b in chain.blocks],
        "n_params": sum(math.prod(s) for _, s in params),
        "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
        "params_digest": signature_digest(params),
    }


def make_fingerprint(model: nn.Module, chain: Chain, batch: Batch | None = None) -> dict[str, Any]:
    return {
        "model": model_signature(model, chain),
        "batch": batch_signature(batch) if batch is not None else None,
    }


def check_fingerprint(plan: Plan, model: nn.Module, chain: Chain, batch: Batch | None = None) -> None:
    """Refuse a plan made for another model or batch shape, saying what differs.

    Raises:
        PlanMismatchError: the plan's fingerprint or block list does not match.
    """
    want = plan.fingerprint.get("model") if plan.fingerprint else None
    have = model_signature(model, chain)
    diffs: list[str] = []
    if want:
        labels = {
            "class": "model class",
            "chain_path": "block container",
            "n_blocks": "number of blocks",
            "n_params": "number of parameters",
        }
        for key, label in labels.items():
            if key in want and want[key] != have[key]:
                diffs.append(f"{label}: plan {want[key]!r}, model {have[key]!r}")
        if not diffs and want.get("block_types") not in (None, have["block_types"]):
            diffs.append("block types differ")
        if not diffs and want.get("params_digest") not in (None, have["params_digest"]):
            diffs.append("parameter names or shapes differ")
    if not diffs:
        names = tuple(b.name for b in plan.blocks)
        if names != chain.names:
            diffs.append(
                f"blocks: plan has {len(names)} ({_short(names)}), model has {len(chain)} ({_short(chain.names)})"
            )
    want_batch = plan.fingerprint.get("batch") if plan.fingerprint else None
    if batch is not None and want_batch is not None:
        have_batch = batch_signature(batch)
        if have_batch != want_batch:
            diffs.append(f"batch: plan {_shapes(want_batch)}, now {_shapes(have_batch)}")
    if diffs:
        raise PlanMismatchError(
            f"memfit.plan: this plan was made for another model or batch shape ({'; '.join(diffs)}). "
            "Make a plan for this model and batch: `memfit plan --model SPEC --budget SIZE --batch-size B --out PLAN.json`."
        )


def check_batch_kind(plan: Plan, make_batch: Callable[[int], Batch], batch_size: int) -> None:
    """Refuse a plan whose batch fingerprint is of other tensors than ``make_batch(batch_size)``'s:
    their number, dtypes or sizes beyond the first (batch) dimension. :func:`check_fingerprint`
    compares the whole shape; a training run may use another micro-batch than the plan's, and gets
    this check instead. The batch is drawn with every generator put back after (the data a run
    draws next is unchanged).

    Raises:
        PlanMismatchError: the tensors differ, said as ``check_fingerprint`` says it.
    """
    want = plan.fingerprint.get("batch") if plan.fingerprint else None
    if want is None:
        return
    rng = RngSnapshot.take()
    try:
        have = batch_signature(make_batch(batch_size))
    finally:
        rng.restore()

    def kind(sig: list[dict[str, Any]]) -> list[tuple[Any, list[Any]]]:
        return [(t.get("dtype"), list(t.get("shape") or [])[1:]) for t in sig]

    if kind(want) != kind(have):
        raise PlanMismatchError(
            f"memfit.plan: this plan was made for another model or batch shape (batch: plan {_shapes(want)}, now "
            f"{_shapes(have)}; only the first, batch dimension may differ). Make a plan for this model and batch: "
            "`memfit plan --model SPEC --budget SIZE --batch-size B --out PLAN.json`."
        )


def check_param_dtype(plan: Plan, model: nn.Module) -> None:
    """Refuse, for a training run, a plan whose memory was predicted for parameters of another dtype
    than ``model``'s. The fingerprint records the dtype without checking it (:func:`model_signature`:
    verify applies a float32 plan to its float64 reference on purpose), but a run trains against the
    plan's predicted peak, which holds only in the dtype it was predicted for.

    A per-rank plan is not checked: under FSDP2's mixed precision its stats, and so its fingerprint,
    are made in ``param_dtype`` while the model's shards keep theirs.

    Raises:
        PlanMismatchError: the dtypes differ and the plan carries a predicted peak.
    """
    want = ((plan.fingerprint or {}).get("model") or {}).get("dtype")
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())
    have = dtypes.most_common(1)[0][0] if dtypes else None
    if want is None or have is None or want == have or plan.predicted_peak_bytes is None:
        return
    if plan.parallel is not None:  # a rank's stats are made in FSDP2's param_dtype (NOTE in memfit.plan.parallel)
        return
    raise PlanMismatchError(
        f"memfit.plan: this plan's peak was predicted for {want} parameters and the model's are {have}, so "
        f"its memory predictions do not hold here. Train in {want} (--dtype {want}), or make the plan in {have}: "
        f"`memfit plan --model SPEC --dtype {have} --budget SIZE --out PLAN.json`."
    )


def check_plan_for_run(plan: Plan, model: nn.Module, make_batch: Callable[[int], Batch], batch_size: int) -> None:
    """What a training run checks of the plan it is given, before any step: the batch's tensors
    (:func:`check_batch_kind`, as verify checks them) and the parameters' dtype its peak was
    predicted for (:func:`check_param_dtype`)."""
    check_batch_kind(plan, make_batch, batch_size)
    check_param_dtype(plan, model)


def _short(names: tuple[str, ...]) -> str:
    return ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")


def _shapes(sig: list[dict[str, Any]]) -> str:
    return " ".join(f"{s['dtype']}{s['shape']}" for s in sig)
