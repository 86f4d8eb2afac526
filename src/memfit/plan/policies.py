"""Baseline policies (`none`, `all`, `sqrt`, `every:K`) and plan fingerprints."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from torch import nn

from memfit.capture.chain import Chain, discover_chain
from memfit.errors import PlanMismatchError, SpecError
from memfit.plan.types import Action, BlockDecision, Plan, Segment
from memfit.workload import Batch, batch_signature, signature_digest

POLICY_HELP = (
    "'none' (keep everything), 'all' (recompute every block, as HF gradient checkpointing does), "
    "'sqrt' (checkpoint_sequential-style segments of about sqrt(N) blocks, recomputed as one unit) or 'every:K' (recompute every K-th block)"
)


def parse_policy(text: str) -> str:
    """Normalise a policy name; raise :class:`SpecError` with the valid forms otherwise."""
    t = text.strip().lower()
    if t in ("none", "all", "sqrt"):
        return t
    if t.startswith("every:"):
        try:
            k = int(t.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return f"every:{k}"
    raise SpecError(f"memfit.plan: unknown policy {text!r}. Use {POLICY_HELP}.")


def policy_plan(
    model: nn.Module, policy: str, *, chain: Chain | None = None, batch: Batch | None = None
) -> Plan:
    """The plan a baseline policy gives for this model.

    Args:
        model: the model (its chain is discovered unless ``chain`` is given).
        policy: ``none``, ``all``, ``sqrt`` or ``every:K``.
        chain: the model's chain, if already known.
        batch: an example batch, recorded in the fingerprint (shapes and dtypes only).

    Raises:
        SpecError: unknown policy.
    """
    policy = parse_policy(policy)
    chain = chain or discover_chain(model)
    n = len(chain)
    recompute: set[int] = set()
    segments: list[Segment] = []
    if policy == "all":
        recompute = set(range(n))
    elif policy.startswith("every:"):
        k = int(policy.split(":")[1])
        recompute = set(range(0, n, k))
    elif policy == "sqrt":
        # torch.utils.checkpoint.checkpoint_sequential: equal segments, all but the last recomputed;
        # on a chain of several containers the segments stop at each container's end.
        n_seg = max(1, math.ceil(math.sqrt(n)))
        size = max(1, n // n_seg)
        pieces = [(a, min(a + size, stop)) for start, stop in chain.spans for a in range(start, stop, size)]
        for a, b in pieces[:-1]:
            if b - a == 1:
                recompute.add(a)
            else:
                segments.append(Segment(start=a, stop=b))
    return Plan(
        policy=policy,
        chain_path=chain.path,
        blocks=tuple(
            BlockDecision(name=name, action=Action.RECOMPUTE if i in recompute else Action.KEEP)
            for i, name in enumerate(chain.names)
        ),
        segments=tuple(segments),
        fingerprint=make_fingerprint(model, chain, batch),
    )


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
            diffs.append(f"blocks: plan has {len(names)} ({_short(names)}), model has {len(chain)} ({_short(chain.names)})")
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


def _short(names: tuple[str, ...]) -> str:
    return ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")


def _shapes(sig: list[dict[str, Any]]) -> str:
    return " ".join(f"{s['dtype']}{s['shape']}" for s in sig)
