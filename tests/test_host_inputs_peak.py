"""Host-held inputs at the end of the backward: every copy back is freed once its block's backward is done.

References, each independent of the code under test:
- the tracker's count with no input held (zero bytes once every tensor is gone);
- the same plan with plain ``recompute``: at the end of the backward no kept input is alive in either
  plan, so the step's bytes after the first block's backward (embeddings, optimizer) are the same, on
  fake tensors (an estimate) and in the real CPU step under the tracker.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from memfit import StepSpec
from memfit.apply.engine import plan_applied
from memfit.apply.host_inputs import HostInputs
from memfit.capture.chain import discover_chain
from memfit.capture.passes import memory_pass
from memfit.capture.step import make_optimizer
from memfit.capture.tracker import MemoryTracker
from memfit.estimation import estimate_stats
from memfit.estimation.fake import fake_mode
from memfit.models.registry import load_workload
from memfit.plan.policies import policy_plan
from memfit.plan.types import Option, Plan

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=256"
)  # at 2 x 256 tokens a layer's input is 128 KiB, over the 64 KiB below which inputs stay
SEQ, BATCH = 256, 2


def _held(plan: Plan) -> Plan:
    return plan.with_(
        blocks=tuple(dataclasses.replace(b, host_input=b.option is Option.RECOMPUTE) for b in plan.blocks)
    )


def test_a_fake_copy_back_is_freed_with_its_last_user() -> None:
    """On fake tensors the copy back is a device allocation the tracker counts until the recompute's
    tensors that use it are gone (FakeTensorMode's dispatch cache must not keep it alive)."""
    mode = fake_mode()
    with mode:
        base = torch.empty(3 * 1024, 64, dtype=torch.bfloat16)  # 384 KiB, made before the tracker: not counted
        tracker = MemoryTracker(device=torch.device("cpu"))
        with tracker:
            state = HostInputs(min_bytes=1024)
            x = base * 2
            view = x[1024:2048].t()  # an offset, transposed view: its storage is what moves
            packed = state.pack(view)
            del x, view
            assert tracker.current_bytes == 0  # the storage left the device
            back = state.unpack(packed)
            assert back.shape == (64, 1024) and back.stride() == (1, 64) and back.storage_offset() == 1024 * 64
            assert back.dtype == torch.bfloat16 and tracker.current_bytes == 3 * 1024 * 64 * 2  # the whole storage
            y = back.sum()
            del back, y, packed
            gc.collect()
            assert tracker.current_bytes == 0


@pytest.mark.slow  # three fake-tensor calibration steps and two more: about 3 s on 2 shared cores
def test_the_estimate_after_the_backward_is_the_same_with_inputs_held() -> None:
    """The estimate's peak after the first block's backward (embeddings backward, optimizer step)
    is the largest over its calibration steps; adding ``recompute:host`` (every block held) must not
    raise it: no copy back is alive then."""
    wl = load_workload(LLAMA, seq_len=SEQ, seed=0)
    step = StepSpec(batch_size=BATCH, optimizer="sgd")

    def post_peak(options: tuple[str, ...]) -> int:
        st = estimate_stats(
            wl, device="h100-sxm", gpu_kernels=False, step=step, options=options, heads=False, tiling=False,
            host_inputs=False,
        )  # fmt: skip
        return st.post_peak_bytes

    with_host = post_peak(("keep", "recompute", "recompute:host"))
    assert with_host == post_peak(("keep", "recompute"))


def test_the_cpu_step_after_the_backward_is_the_same_with_inputs_held() -> None:
    """The real CPU step under the tracker: the live bytes at the end of the backward and the peak after
    it are those of plain recompute."""
    wl = load_workload(LLAMA, seq_len=SEQ, seed=0)
    chain, batch = discover_chain(wl.model), wl.make_batch(BATCH)
    plan = policy_plan(wl.model, "all", chain=chain)

    def after_backward(p: Plan) -> tuple[int, int]:
        with plan_applied(wl.model, p, batch=batch):
            got = memory_pass(wl.model, chain, batch, wl, make_optimizer(wl.model, "sgd"), seed=0)
        end = next(e.live_bytes for e in got.events if e.label == "end:backward")
        return end, got.derive(len(chain)).post_peak

    assert after_backward(_held(plan)) == after_backward(plan)
