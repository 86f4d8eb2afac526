"""Save policies: what a selective block saves, parsed from its text into sets of op calls.

Save policies are written as text (a plan is JSON):

- a named preset whose name says what is saved (as JAX's ``dots_saveable``):
  ``save_matmuls`` (matmuls and convolutions), ``save_attention`` (fused attention kernels, on CPU
  ``aten._scaled_dot_product_flash_attention_for_cpu``, on CUDA flash, memory-efficient and cuDNN
  attention), ``save_matmuls_and_attention``; ``torchtitan``, torchtitan's op-level default
  (NOTE [ torchtitan's selective policy ]);
- an explicit list ``save:OP[,OP...]`` of op overloads, each either every call of that op in the
  block (``aten.mm.default``) or one call (``aten.addmm.default@2``: the third ``addmm`` of the
  block's forward, counted as torch's selective checkpointing counts them).

A selective block (:mod:`memfit.apply.selective`) caches, while it runs forward, the outputs its
:class:`SavePolicy` names (:meth:`SavePolicy.policy_fn` is the policy torch's
``create_selective_checkpoint_contexts`` takes) and recomputes the rest in backward. Planning reads
the same policies against a block's captured op calls (:func:`cached_calls`,
:func:`uncacheable_calls`) and writes them (:func:`policy_text`, the MILP's choice in
:mod:`memfit.plan.milp`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy

from memfit.capture.opstats import ATTENTION_OPS, MATMUL_OPS, BlockOps
from memfit.plan.policies import Selective
from memfit.plan.types import SAVE_PREFIX

__all__ = [
    "PRESET_OPS",
    "TORCHTITAN_EVERY_OTHER_OPS",
    "TORCHTITAN_SAVE_OPS",
    "SavePolicy",
    "cached_calls",
    "parse_save_policy",
    "policy_text",
    "uncacheable_calls",
]

# What each preset saves: op overload packets (every overload of the packet is saved).
PRESET_OPS: dict[str, frozenset[str]] = {
    "save_matmuls": MATMUL_OPS,
    "save_attention": ATTENTION_OPS,
    "save_matmuls_and_attention": MATMUL_OPS | ATTENTION_OPS,
    "torchtitan": ATTENTION_OPS,  # and TORCHTITAN_SAVE_OPS, TORCHTITAN_EVERY_OTHER_OPS
}

# NOTE [ torchtitan's selective policy ]
# torchtitan's op-level selective checkpointing (``activation_checkpoint.mode = "selective"``,
# ``selective_ac_option = "op"``, the setting of its published Llama 3.1 runs) saves the outputs of
# the ops in ``_op_sac_save_list`` (pytorch/torchtitan ``torchtitan/models/llama3/infra/parallelize.py``,
# commit 018740b7aae7846d24954539244c78215dbd181f): ``aten.mm.default``, the scaled-dot-product
# attention kernels (flash, memory-efficient, cuDNN, math, fused-overrideable), ``aten.max.default``
# (for Float8 scaling), ``_c10d_functional.reduce_scatter_tensor.default`` (tensor parallelism) and
# flex / varlen attention; and of the mm calls it saves only every other one: its policy counts a
# block's mm calls and recomputes the 2nd, 4th, ... ("Saves output of all compute ops, except every
# second mm", ``_apply_op_sac`` in ``torchtitan/distributed/activation_checkpoint.py``, commit
# cfb93265153094f99736547f26b5346410181102). In memfit's counting from 0 those are calls 1, 3, 5...:
# the preset saves mm calls 0, 2, 4, ... of each block (a Llama block runs 7: q, k, v, o, gate, up,
# down; q, v, gate and down are saved). The attention packets are memfit's ATTENTION_OPS, which also
# name the CPU flash kernel a fake step on this machine runs (it saves what CUDA's flash kernel saves).
TORCHTITAN_SAVE_OPS = frozenset(
    {
        "aten.max.default",
        "aten._scaled_dot_product_attention_math.default",
        "_c10d_functional.reduce_scatter_tensor.default",
    }
)
TORCHTITAN_EVERY_OTHER_OPS = frozenset({"aten.mm.default"})


@dataclass(frozen=True, slots=True)
class SavePolicy:
    """What a selective block saves, parsed from its policy text.

    Attributes:
        text: the policy as written in the plan.
        packets: op overload packets saved at every call (``aten.mm``; from presets).
        ops: op overloads saved at every call (``aten.mm.default``).
        calls: single calls saved: ``(overload name, index)``.
        every_other: op overloads of which calls 0, 2, 4, ... are saved (NOTE [ torchtitan's
            selective policy ]).
    """

    text: str
    packets: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()
    calls: frozenset[tuple[str, int]] = frozenset()
    every_other: frozenset[str] = frozenset()
    _rules: dict[Any, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def saves(self, op: str, index: int) -> bool:
        """Whether the ``index``-th call of overload ``op`` (``"aten.mm.default"``) is saved."""
        if op in self.every_other:
            return index % 2 == 0
        return op in self.ops or (op, index) in self.calls or op.rsplit(".", 1)[0] in self.packets

    def _rule(self, op: Any) -> bool | str | frozenset[int]:
        """For one op overload: True (every call saved), False (none), ``"even"`` (calls 0, 2, 4, ...)
        or the saved call indices."""
        rule = self._rules.get(op)
        if rule is None:
            name = str(op)
            if name in self.every_other:
                rule = "even"
            elif name in self.ops or name.rsplit(".", 1)[0] in self.packets:
                rule = True
            else:
                idx = frozenset(k for o, k in self.calls if o == name)
                rule = idx if idx else False
            self._rules[op] = rule
        return rule

    def policy_fn(self) -> Callable[..., CheckpointPolicy]:
        """A fresh policy for ``create_selective_checkpoint_contexts`` (one per forward: it counts
        calls per op, as torch's cache does). It runs for every op of the block's forward, so the
        decision per op overload is looked up once and cached."""
        counts: dict[Any, int] = {}
        save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

        def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
            rule = self._rule(op)
            if rule is True:
                return save
            if rule is False:
                return recompute
            k = counts.get(op, 0)
            counts[op] = k + 1
            if rule == "even":
                return save if k % 2 == 0 else recompute
            return save if k in rule else recompute

        return policy

    def __deepcopy__(self, memo: dict) -> SavePolicy:  # immutable: a copied model shares it
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # pickled without the op lookups (op overloads do not pickle)
        return (SavePolicy, (self.text, self.packets, self.ops, self.calls, self.every_other))


@functools.lru_cache(maxsize=256)
def parse_save_policy(text: str) -> SavePolicy:
    """Parse a selective block's policy: a preset name or ``save:OP[@K],...``
    (:meth:`memfit.plan.policies.Selective.from_save_text`), into what its wrapper looks up.

    Raises:
        SpecError: unknown preset, malformed entry, or an op this torch does not have.
    """
    sel = Selective.from_save_text(text)
    if sel.preset == "torchtitan":
        return SavePolicy(
            text=text.strip(),
            packets=PRESET_OPS["torchtitan"],
            ops=TORCHTITAN_SAVE_OPS,
            every_other=TORCHTITAN_EVERY_OTHER_OPS,
        )
    if sel.preset is not None:
        return SavePolicy(text=text.strip(), packets=PRESET_OPS[sel.preset])
    ops: set[str] = set()
    calls: set[tuple[str, int]] = set()
    for entry in sel.ops:
        op, _, index = entry.partition("@")
        if index:
            calls.add((op, int(index)))
        else:
            ops.add(op)
    return SavePolicy(text=text.strip(), ops=frozenset(ops), calls=frozenset(calls))


def policy_text(block: BlockOps, chosen: Sequence[int]) -> str:
    """A ``save:`` policy caching exactly the calls ``chosen`` (indices in ``block.calls``): an op
    named alone when every one of its calls is chosen, else ``op@index`` per call."""
    by_op: dict[str, list[int]] = {}
    for c in block.calls:
        by_op.setdefault(c.op, []).append(c.index)
    picked: dict[str, list[int]] = {}
    for j in sorted(chosen):
        c = block.calls[j]
        picked.setdefault(c.op, []).append(c.index)
    parts = []
    for op, idx in picked.items():
        if sorted(idx) == sorted(by_op[op]):
            parts.append(op)
        else:
            parts.extend(f"{op}@{k}" for k in sorted(idx))
    return SAVE_PREFIX + ",".join(parts)


def cached_calls(block: BlockOps, policy: SavePolicy) -> tuple[int, ...]:
    """Indices of the block's calls whose outputs the policy caches (views included: torch caches
    whatever the policy names; caching a view keeps its base alive)."""
    return tuple(j for j, c in enumerate(block.calls) if policy.saves(c.op, c.index))


def uncacheable_calls(block: BlockOps, policy: SavePolicy) -> list[str]:
    """Calls the policy caches whose output the block mutates afterwards (torch raises on those
    during backward): their names; empty when the policy is safe for this block."""
    return [
        block.calls[j].name
        for j in cached_calls(block, policy)
        if block.calls[j].out_bytes > 0 and not block.calls[j].cacheable
    ]
