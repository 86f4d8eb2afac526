"""Selective (op-level) checkpointing: inside a block, save some op outputs and recompute the rest.

A block in option ``selective`` runs under non-reentrant ``torch.utils.checkpoint`` with torch's
``create_selective_checkpoint_contexts``: during the forward, each op's output is cached when the
block's *save policy* says ``MUST_SAVE``; during backward the block's forward runs again and every
op whose output was cached returns it instead of computing. The policy is composed with memfit's
buffer contexts (NOTE [ Buffers are updated once ] in :mod:`memfit.apply.engine`): both the forward
and the recompute context managers are entered, and the recompute runs the same ops, so autograd
sees the same saved tensors.

Which ops a policy saves is plan data (:mod:`memfit.plan.savepolicy`); which ones the MILP picks for
a byte allotment is planning (:mod:`memfit.plan.milp`). This module holds the wrapper side: the
checkpoint contexts a selective block runs under.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from memfit.plan.savepolicy import SavePolicy, parse_save_policy

__all__ = ["selective_contexts"]


def selective_contexts(
    block: nn.Module, policy: SavePolicy, buffer_contexts: Callable[[Sequence[nn.Module]], tuple[Any, Any]]
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for a selective block: torch's selective-checkpoint contexts, each inside
    memfit's buffer contexts (forward: note mutated buffers; recompute: restore them)."""
    fwd_sac, rec_sac = create_selective_checkpoint_contexts(policy.policy_fn())
    fwd_buf, rec_buf = buffer_contexts((block,))
    # The buffer contexts go outside: their snapshot and restore copies must not run under the
    # selective-checkpoint modes (the recompute's mode would look them up in its cache).
    return _both(fwd_buf, fwd_sac), _both(rec_buf, rec_sac)


def compiled_selective_contexts(policy_text: str) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for a selective block under ``torch.compile``: torch's selective-checkpoint
    contexts alone (NOTE [ Compiled plans ] in :mod:`memfit.apply.engine`).

    torch.compile calls it while tracing, to tag which ops of the checkpointed region the partitioner
    saves; it takes the policy as text because torch.compile accepts a ``context_fn`` only as a
    function or a ``functools.partial`` of constants.
    """
    return create_selective_checkpoint_contexts(_parsed(policy_text).policy_fn())


@functools.lru_cache(maxsize=64)
def _parsed(policy_text: str) -> SavePolicy:
    return parse_save_policy(policy_text)


@contextmanager
def _both(a: AbstractContextManager, b: AbstractContextManager) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(a)
        stack.enter_context(b)
        yield
