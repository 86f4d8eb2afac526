"""The attention line names a reason and a fix for every quadratic call, fused kernels included."""

from __future__ import annotations

import re

import pytest
import torch

from memfit.capture.attention import AttentionCall, AttentionKernel, AttentionReport, _Call, _why


@pytest.mark.parametrize("kernel", list(AttentionKernel))
@pytest.mark.parametrize("mask", [None, "bool (2, 1, 8, 8)"])
def test_every_quadratic_call_has_a_reason_and_a_fix(kernel: AttentionKernel, mask: str | None) -> None:
    call = _Call(kernel=kernel, seq_len=8, kv_len=8, heads=2, head_dim=4, dtype=torch.float32, mask=mask, dropout_p=0.0)
    reasons, fixes = _why(call, impl=None, device=torch.device("cpu"))
    assert reasons and fixes and all(r.strip() for r in reasons) and all(f.strip() for f in fixes)


def test_a_fused_kernel_with_quadratic_bytes_prints_no_empty_placeholder() -> None:
    # A fused kernel takes the call, yet (T, T) bytes were kept (a bias the model builds itself): the
    # line said "...): . To make it linear: " with nothing in either place.
    call = _Call(
        kernel=AttentionKernel.CPU_FLASH, seq_len=8, kv_len=8, heads=2, head_dim=4, dtype=torch.float32,
        mask=None, dropout_p=0.0, quadratic_bytes=256,
    )  # fmt: skip
    reasons, fixes = _why(call, impl=None, device=torch.device("cpu"))
    rep = AttentionReport(
        calls=(
            AttentionCall(
                kernel=call.kernel, memory="quadratic", calls=2, seq_len=8, heads=2, head_dim=4, dtype="float32",
                mask=None, dropout_p=0.0, quadratic_bytes=256, reasons=reasons, fixes=fixes,
            ),
        )
    )  # fmt: skip
    line = rep.summary()
    assert not re.search(r":\s*\.|linear:\s*$", line), line
    assert "memfit explain" in line
