"""Accelerators memfit can estimate for: memory, peak FLOP/s, memory bandwidth, and a time model.

Every number is the vendor's published peak, cited next to it. Tensor-core rates are *dense*
(the spec sheets' headline numbers are often "with sparsity", twice as high) and, for GeForce
cards, *with FP32 accumulate*, which is what PyTorch's bf16/fp16 matmuls use. The fp32 rate is
the non-tensor FP32 rate: PyTorch leaves TF32 off for matmuls by default
(``torch.backends.cuda.matmul.allow_tf32 = False``).

Memory sizes are the nominal capacities (``80GB`` HBM is 80 GiB of DRAM). The memory a training
process can use is somewhat lower: the driver keeps some, the CUDA context takes a few hundred
MiB, and ``torch.cuda.get_device_properties(0).total_memory`` reports, for example, 79.3 GiB on
an 80 GB A100.

Size: about 560 lines, over the ~500 of other modules: the table is a third of it, each entry with
its datasheet citation beside it, and the time model, the links and the utilisation fitted to published
runs (:data:`PUBLISHED_MFU`) read that table.

The time model (:func:`step_seconds`) is a roofline in two parts: the matmul/attention FLOPs of
forward and backward at ``peak x mfu``, plus the optimizer step as a memory-bound pass over
parameters, gradients and optimizer state at the memory bandwidth.

Links (for the communication time of ``--world-size N --parallel``, :mod:`memfit.plan.comm`):
``intra_node_bytes_per_s`` is the GPU-to-GPU rate per direction inside a node (NVLink on SXM
boards: half the datasheet's bidirectional figure; a PCIe card's PCIe rate, also per direction),
``inter_node_bytes_per_s`` the network per GPU between nodes of the reference system named in the
comment (DGX-style: one NIC per GPU); None where no such system is standard for the card.

Known limitations:
    - Peak numbers are boost-clock numbers; sustained clocks under load are often lower, which
      the ``mfu`` factor has to absorb.
    - ``cpu`` has no entry for FLOP/s, bandwidth or memory: memfit does not guess this
      machine's speed, so an estimate for ``cpu`` gives memory only.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memfit.errors import SpecError
from memfit.plan.comm import Interconnect, Link

__all__ = [
    "DEFAULT_MFU",
    "DEVICES",
    "PUBLISHED_MFU",
    "DeviceSpec",
    "PublishedMfu",
    "StepTime",
    "get_device",
    "interconnect",
    "published_mfu",
    "resolve_mfu",
    "step_seconds",
]

DEFAULT_MFU = 0.4
"""Assumed fraction of the peak FLOP/s a training step achieves on the FLOPs it executes
(recomputed ones included), a typical value for well-tuned transformer training on one GPU."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedMfu:
    """The utilisation with which memfit's time model matches a published run of a device class.

    Attributes:
        mfu: the fraction of the table's peak, on the FLOPs memfit counts (recompute included).
        run: the run it was fitted on.
        on: what the fit matched (compute and exposed communication, or compute alone).
        source: where the run and the fit are written down.
    """

    mfu: float
    run: str
    on: str
    source: str


PUBLISHED_MFU: dict[str, PublishedMfu] = {
    # benchmarks/results/published_runs.json (benchmarks/published_runs.py, 2026-12-03): the mfu with which
    # memfit's predicted step of torchtitan's Llama 3.1 8B, FSDP over 8 H100, local batch 2 x 8192, selective op
    # AC, bf16 / fp32 reduce, equals the published 5,762 tokens/s per GPU (pytorch/torchtitan
    # benchmarks/llama3_h100_202412_torchtitan.md, commit 31a17bfd, Table 1). torchtitan's H100s ran at 500 W
    # with HBM2e (peak between SXM and NVL), so this is against the SXM peak, as torchtitan's own MFU note is.
    # Checked on the 128-GPU row of Table 3: -3.1 %.
    "h100": PublishedMfu(
        mfu=0.387,
        run="torchtitan Llama 3.1 8B, FSDP 8 x H100, local batch 2 x 8192, selective op AC",
        on="compute + exposed communication",
        source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (31a17bfd), Table 1; "
        "benchmarks/results/published_runs.json",
    ),
    # The same fit on torchtitan's Llama 3 8B, FSDP over 64 A100 80GB, local batch 1 x 8192, selective op AC:
    # 2,973 tokens/s per GPU (pytorch/torchtitan docs/performance.md, commit 04133643). With memfit's network
    # (DGX A100: 200 Gb/s per GPU) the modelled communication alone is longer than the published step, so the fit
    # is on compute alone (communication hidden). Checked on the other 64-GPU rows (Llama 3 8B selective layer,
    # Llama 2 13B without AC, selective layer, selective op): -0.8 % to +2.9 % on compute alone, -18 % to -28 %
    # with the modelled network: that term, not the mfu, is what is off there.
    "a100": PublishedMfu(
        mfu=0.634,
        run="torchtitan Llama 3 8B, FSDP 64 x A100 80GB, local batch 1 x 8192, selective op AC",
        on="compute only",
        source="pytorch/torchtitan docs/performance.md (04133643); benchmarks/results/published_runs.json",
    ),
}
"""Utilisation fitted to published runs, per device class (the device name's first part:
``h100-sxm`` and ``h100-pcie`` are ``h100``): :func:`published_mfu`. How close it then predicts the
class's other published runs: benchmarks/reports/published_runs_*.md."""


def resolve_mfu(device: DeviceSpec | None, mfu: float | None) -> float:
    """``mfu`` when given, else the utilisation fitted to a published run of ``device``'s class
    (:func:`published_mfu`), else :data:`DEFAULT_MFU`.

    Example:
        >>> resolve_mfu(get_device("a100-80gb"), None), resolve_mfu(get_device("h100-sxm"), 0.5)
        (0.634, 0.5)
    """
    if mfu is not None:
        return mfu
    pub = published_mfu(device) if device is not None else None
    return pub.mfu if pub is not None else DEFAULT_MFU


def published_mfu(device: DeviceSpec) -> PublishedMfu | None:
    """The utilisation fitted to a published run of ``device``'s class, or None (then
    :data:`DEFAULT_MFU` is the assumption).

    Example:
        >>> published_mfu(get_device("h100-sxm")).mfu
        0.387
    """
    return PUBLISHED_MFU.get(device.name.split("-")[0])


_GiB = 1024**3
_TF = 1e12  # FLOP/s
_GBs = 1e9  # bytes/s


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator's published peaks.

    Attributes:
        name: the key ``--device`` takes, e.g. ``"h100-sxm"``.
        description: the product name.
        memory_bytes: device memory (nominal capacity), or None when unknown.
        bf16_flops_per_s: dense bf16 tensor-core peak (FP32 accumulate); None when the device
            has no bf16 tensor cores.
        fp16_flops_per_s: dense fp16 tensor-core peak (FP32 accumulate).
        fp32_flops_per_s: non-tensor FP32 peak.
        memory_bandwidth_bytes_per_s: DRAM bandwidth.
        source: where the numbers come from.
        intra_node_link: ``nvlink`` or ``pcie`` (None: unknown).
        intra_node_bytes_per_s: GPU-to-GPU rate per direction inside a node.
        inter_node_bytes_per_s: network rate per GPU and direction between nodes (None: unknown).
        host_bytes_per_s: the GPU's link to host memory, per direction (its PCIe generation x16, the
            datasheet's figure halved where it is bidirectional): what a host-held checkpoint input
            crosses (:mod:`memfit.apply.host_inputs`). None: unknown.
    """

    name: str
    description: str
    memory_bytes: int | None
    bf16_flops_per_s: float | None
    fp16_flops_per_s: float | None
    fp32_flops_per_s: float | None
    memory_bandwidth_bytes_per_s: float | None
    source: str
    intra_node_link: str | None = None
    intra_node_bytes_per_s: float | None = None
    inter_node_bytes_per_s: float | None = None
    host_bytes_per_s: float | None = None

    def peak_flops_per_s(self, dtype: torch.dtype) -> float | None:
        """The peak FLOP/s for matmuls in ``dtype`` (None when unknown or not supported)."""
        return {
            torch.bfloat16: self.bf16_flops_per_s,
            torch.float16: self.fp16_flops_per_s,
            torch.float32: self.fp32_flops_per_s,
        }.get(dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _spec(
    name: str,
    description: str,
    *,
    memory_gib: float | None,
    bf16_tflops: float | None,
    fp16_tflops: float | None,
    fp32_tflops: float | None,
    bandwidth_gb_s: float | None,
    source: str,
    link: tuple[str, float] | None = None,
    network_gb_s: float | None = None,
    host: tuple[str, float] | None = None,
) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        description=description,
        memory_bytes=None if memory_gib is None else int(memory_gib * _GiB),
        bf16_flops_per_s=None if bf16_tflops is None else bf16_tflops * _TF,
        fp16_flops_per_s=None if fp16_tflops is None else fp16_tflops * _TF,
        fp32_flops_per_s=None if fp32_tflops is None else fp32_tflops * _TF,
        memory_bandwidth_bytes_per_s=None if bandwidth_gb_s is None else bandwidth_gb_s * _GBs,
        source=source,
        intra_node_link=link[0] if link else None,
        intra_node_bytes_per_s=link[1] * _GBs if link else None,
        inter_node_bytes_per_s=None if network_gb_s is None else network_gb_s * _GBs,
        host_bytes_per_s=host[1] * _GBs if host else (link[1] * _GBs if link and link[0] == "pcie" else None),
    )


# Links: NVLink 3 (A100 SXM) 600 GB/s and NVLink 4 (H100/H200 SXM) 900 GB/s bidirectional per GPU
# (the datasheets), i.e. 300 and 450 GB/s per direction; PCIe 5.0 x16 64 GB/s, 4.0 x16 32 GB/s,
# 3.0 x16 16 GB/s per direction; V100 SXM2 NVLink 2 300 GB/s bidirectional. Networks: DGX A100 one
# 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s), DGX H100/H200 one 400 Gb/s NDR NIC per GPU (50 GB/s).
# Host links (host=; a PCIe card's is its link): the datasheets' "PCIe Gen5: 128 GB/s" (H100 SXM, H200 SXM),
# "PCIe Gen4: 64 GB/s" (A100 SXM) and "PCIe Gen3: 32 GB/s" (V100 SXM2) are bidirectional x16 figures: 64, 32
# and 16 GB/s per direction. These are link rates; a pinned copy reaches somewhat less.
_NVLINK3, _NVLINK4 = ("nvlink", 300), ("nvlink", 450)
_PCIE5, _PCIE4, _PCIE3 = ("pcie", 64), ("pcie", 32), ("pcie", 16)

_TABLE = (
    # NVIDIA A100 Tensor Core GPU datasheet (2021), "A100 40GB SXM" column: FP32 19.5 TFLOPS,
    # BF16/FP16 Tensor Core 312 TFLOPS (624 with sparsity), 40 GB HBM2, 1,555 GB/s.
    _spec(
        "a100-40gb",
        "NVIDIA A100 SXM4 40GB",
        memory_gib=40,
        bf16_tflops=312,
        fp16_tflops=312,
        fp32_tflops=19.5,
        bandwidth_gb_s=1555,
        source="NVIDIA A100 datasheet, 40GB SXM",
        link=_NVLINK3,
        network_gb_s=25,
        host=_PCIE4,
    ),
    # Same datasheet, "A100 80GB SXM": same compute, 80 GB HBM2e, 2,039 GB/s.
    _spec(
        "a100-80gb",
        "NVIDIA A100 SXM4 80GB",
        memory_gib=80,
        bf16_tflops=312,
        fp16_tflops=312,
        fp32_tflops=19.5,
        bandwidth_gb_s=2039,
        source="NVIDIA A100 datasheet, 80GB SXM",
        link=_NVLINK3,
        network_gb_s=25,
        host=_PCIE4,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM": FP32 67 TFLOPS, BF16/FP16 Tensor Core
    # 1,979 TFLOPS with sparsity (989.4 dense), 80 GB HBM3, 3.35 TB/s.
    _spec(
        "h100-sxm",
        "NVIDIA H100 SXM5 80GB",
        memory_gib=80,
        bf16_tflops=989.4,
        fp16_tflops=989.4,
        fp32_tflops=67,
        bandwidth_gb_s=3350,
        source="NVIDIA H100 datasheet, H100 SXM",
        link=_NVLINK4,
        network_gb_s=50,
        host=_PCIE5,
    ),
    # Same datasheet, "H100 PCIe" (80 GB): FP32 51 TFLOPS, BF16/FP16 Tensor Core 1,513 TFLOPS
    # with sparsity (756.5 dense), 80 GB HBM2e, 2 TB/s.
    _spec(
        "h100-pcie",
        "NVIDIA H100 PCIe 80GB",
        memory_gib=80,
        bf16_tflops=756.5,
        fp16_tflops=756.5,
        fp32_tflops=51,
        bandwidth_gb_s=2000,
        source="NVIDIA H100 datasheet, H100 PCIe",
        link=_PCIE5,
        network_gb_s=50,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM": FP32 67 TFLOPS, BF16/FP16 Tensor Core
    # 1,979 TFLOPS with sparsity (989.4 dense), 141 GB HBM3e, 4.8 TB/s. (On an H200 lent to
    # this project, torch reported total_memory 150,109,880,320 B = 139.8 GiB.)
    _spec(
        "h200",
        "NVIDIA H200 SXM 141GB",
        memory_gib=141,
        bf16_tflops=989.4,
        fp16_tflops=989.4,
        fp32_tflops=67,
        bandwidth_gb_s=4800,
        source="NVIDIA H200 datasheet, H200 SXM",
        link=_NVLINK4,
        network_gb_s=50,
        host=_PCIE5,
    ),
    # NVIDIA L4 datasheet: FP32 30.3 TFLOPS, BF16/FP16 Tensor Core 242 TFLOPS with sparsity
    # (121 dense), 24 GB GDDR6, 300 GB/s.
    _spec(
        "l4",
        "NVIDIA L4 24GB",
        memory_gib=24,
        bf16_tflops=121,
        fp16_tflops=121,
        fp32_tflops=30.3,
        bandwidth_gb_s=300,
        source="NVIDIA L4 datasheet",
        link=_PCIE4,
    ),
    # NVIDIA L40S datasheet: FP32 91.6 TFLOPS, BF16/FP16 Tensor Core 362.05 TFLOPS dense
    # (733 with sparsity), 48 GB GDDR6, 864 GB/s.
    _spec(
        "l40s",
        "NVIDIA L40S 48GB",
        memory_gib=48,
        bf16_tflops=362.05,
        fp16_tflops=362.05,
        fp32_tflops=91.6,
        bandwidth_gb_s=864,
        source="NVIDIA L40S datasheet",
        link=_PCIE4,
    ),
    # NVIDIA Ada Lovelace GPU architecture whitepaper (v2.1), GeForce RTX 4090: FP32 82.6
    # TFLOPS, FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense (330.4 with sparsity;
    # twice that with FP16 accumulate, which PyTorch does not use), 24 GB GDDR6X, 1,008 GB/s.
    _spec(
        "rtx4090",
        "NVIDIA GeForce RTX 4090 24GB",
        memory_gib=24,
        bf16_tflops=165.2,
        fp16_tflops=165.2,
        fp32_tflops=82.6,
        bandwidth_gb_s=1008,
        source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090",
        link=_PCIE4,
    ),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (v2.0), GeForce RTX 3090: FP32 35.6
    # TFLOPS, FP16/BF16 Tensor with FP32 accumulate 71 TFLOPS dense (142 with sparsity),
    # 24 GB GDDR6X, 936 GB/s.
    _spec(
        "rtx3090",
        "NVIDIA GeForce RTX 3090 24GB",
        memory_gib=24,
        bf16_tflops=71,
        fp16_tflops=71,
        fp32_tflops=35.6,
        bandwidth_gb_s=936,
        source="NVIDIA GA102 architecture whitepaper, RTX 3090",
        link=_PCIE4,
    ),
    # A10G: AWS's variant of the A10 (EC2 G5); NVIDIA publishes no datasheet for it. AWS and
    # third-party listings give 80 SMs, FP32 35 TFLOPS, BF16/FP16 Tensor 70 TFLOPS dense (the
    # A10's datasheet 125 TFLOPS does not apply), 24 GB GDDR6 at 600 GB/s (same as the A10).
    _spec(
        "a10g",
        "NVIDIA A10G 24GB (AWS)",
        memory_gib=24,
        bf16_tflops=70,
        fp16_tflops=70,
        fp32_tflops=35,
        bandwidth_gb_s=600,
        source="AWS EC2 G5 / third-party listings (no NVIDIA datasheet)",
        link=_PCIE4,
    ),
    # NVIDIA V100 Tensor Core GPU datasheet, "V100 SXM2": FP32 15.7 TFLOPS, Tensor (FP16)
    # 125 TFLOPS, no bf16 tensor cores, 32 GB HBM2, 900 GB/s.
    _spec(
        "v100-32gb",
        "NVIDIA V100 SXM2 32GB",
        memory_gib=32,
        bf16_tflops=None,
        fp16_tflops=125,
        fp32_tflops=15.7,
        bandwidth_gb_s=900,
        source="NVIDIA V100 datasheet, V100 SXM2",
        link=("nvlink", 150),
        host=_PCIE3,
    ),
    # NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed-precision FP16/FP32 65 TFLOPS, no bf16 tensor
    # cores, 16 GB GDDR6, 320 GB/s.
    _spec(
        "t4",
        "NVIDIA T4 16GB",
        memory_gib=16,
        bf16_tflops=None,
        fp16_tflops=65,
        fp32_tflops=8.1,
        bandwidth_gb_s=320,
        source="NVIDIA T4 datasheet",
        link=_PCIE3,
    ),
    # This machine's CPU: nothing is measured or assumed.
    _spec(
        "cpu",
        "CPU (this machine; speed and memory not modelled)",
        memory_gib=None,
        bf16_tflops=None,
        fp16_tflops=None,
        fp32_tflops=None,
        bandwidth_gb_s=None,
        source="unknown",
    ),
)

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in _TABLE}
"""The device table, by ``--device`` name."""

_ALIASES = {
    "a100": "a100-80gb",
    "a10040gb": "a100-40gb",
    "a10080gb": "a100-80gb",
    "h100": "h100-sxm",
    "h100sxm": "h100-sxm",
    "h100sxm5": "h100-sxm",
    "h100pcie": "h100-pcie",
    "h200sxm": "h200",
    "4090": "rtx4090",
    "3090": "rtx3090",
    "v100": "v100-32gb",
    "v10032gb": "v100-32gb",
}


def get_device(name: str) -> DeviceSpec:
    """The table entry for a ``--device`` name (case, spaces, ``-`` and ``_`` do not matter).

    Raises:
        SpecError: no such device; the message lists the names.

    Example:
        >>> get_device("H100").name
        'h100-sxm'
    """
    key = "".join(ch for ch in str(name).lower() if ch.isalnum())
    for spec in _TABLE:
        if key == "".join(ch for ch in spec.name if ch.isalnum()):
            return spec
    if key in _ALIASES:
        return DEVICES[_ALIASES[key]]
    close = difflib.get_close_matches(str(name).lower(), list(DEVICES), n=2)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise SpecError(
        f"memfit.estimate: unknown device {name!r}.{hint} Use one of: {', '.join(DEVICES)} "
        "(e.g. --device h100-sxm), or leave --device out for memory only."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Predicted seconds of one training step on a device, and how they were obtained.

    Attributes:
        step_s: ``compute_s + optimizer_s``, or None when the device lacks a needed number.
        compute_s: forward and backward FLOPs / (peak FLOP/s x mfu).
        optimizer_s: bytes the optimizer step reads and writes / memory bandwidth.
        peak_flops_per_s: the peak used for ``compute_s``.
        mfu: the assumed utilisation of that peak.
        reason: why ``step_s`` is None (empty otherwise).
    """

    step_s: float | None
    compute_s: float | None
    optimizer_s: float | None
    peak_flops_per_s: float | None
    mfu: float
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_seconds(
    device: DeviceSpec,
    *,
    dtype: torch.dtype,
    flops: int,
    optimizer_traffic_bytes: int,
    mfu: float | None = None,
) -> StepTime:
    """Seconds of one training step from its FLOPs and the optimizer's memory traffic.

    Args:
        device: the device's peaks.
        dtype: the dtype the matmuls run in (selects the bf16, fp16 or fp32 peak).
        flops: FLOPs of forward and backward (recompute included).
        optimizer_traffic_bytes: bytes the optimizer step reads plus writes.
        mfu: assumed fraction of the peak achieved, in ``(0, 1]``; None: :func:`resolve_mfu`.

    Raises:
        SpecError: ``mfu`` is outside ``(0, 1]``.
    """
    mfu = resolve_mfu(device, mfu)
    if not 0 < mfu <= 1:
        raise SpecError(f"memfit.estimate: mfu={mfu} must be in (0, 1], e.g. 0.4 (40 % of peak FLOP/s).")
    peak = device.peak_flops_per_s(dtype)
    bandwidth = device.memory_bandwidth_bytes_per_s
    if peak is None or bandwidth is None:
        what = str(dtype).removeprefix("torch.")
        reason = (
            f"{device.name} has no published {what} peak"
            + (" or memory bandwidth" if bandwidth is None else "")
            + " in memfit's table"
        )
        return StepTime(step_s=None, compute_s=None, optimizer_s=None, peak_flops_per_s=peak, mfu=mfu, reason=reason)
    compute_s = flops / (peak * mfu)
    optimizer_s = optimizer_traffic_bytes / bandwidth
    return StepTime(
        step_s=compute_s + optimizer_s,
        compute_s=compute_s,
        optimizer_s=optimizer_s,
        peak_flops_per_s=peak,
        mfu=mfu,
    )


def interconnect(
    device: DeviceSpec, *, gpus_per_node: int = 8, link_bytes_per_s: float | None = None
) -> Interconnect | None:
    """The device's links for :mod:`memfit.plan.comm` (None when its table entry has none and no
    rate is set). Each link says which published rate it assumes (``Link.source``).

    Args:
        device: the GPU.
        gpus_per_node: ranks per node.
        link_bytes_per_s: a rate per GPU and direction set by the user (``--link-gbps``) for the
            link that sets the ring's bandwidth: both links take it (the ring runs at the slower).

    Raises:
        SpecError: ``link_bytes_per_s`` is not positive.

    Example:
        >>> interconnect(get_device("h100-sxm")).intra.bus_bytes_per_s / 1e9
        360.0
        >>> interconnect(get_device("h100-sxm"), link_bytes_per_s=50e9).intra.source
        'set: 50 GB/s (400 Gb/s) per direction (--link-gbps)'
    """
    if link_bytes_per_s is not None:
        if not link_bytes_per_s > 0:
            raise SpecError(f"memfit.plan: link rate {link_bytes_per_s} B/s must be positive, e.g. --link-gbps 400.")
        src = f"set: {link_bytes_per_s / 1e9:.4g} GB/s ({link_bytes_per_s * 8 / 1e9:.4g} Gb/s) per direction (--link-gbps)"
        kind = device.intra_node_link or "network"
        return Interconnect(
            intra=Link(kind=kind, bandwidth_bytes_per_s=link_bytes_per_s, source=src),
            inter=Link(kind="network", bandwidth_bytes_per_s=link_bytes_per_s, source=src),
            gpus_per_node=gpus_per_node,
        )
    if device.intra_node_link is None or device.intra_node_bytes_per_s is None:
        return None
    inter = (
        None
        if device.inter_node_bytes_per_s is None
        else Link(
            kind="network",
            bandwidth_bytes_per_s=device.inter_node_bytes_per_s,
            source=f"{device.inter_node_bytes_per_s / 1e9:.4g} GB/s ({device.inter_node_bytes_per_s * 8 / 1e9:.4g} Gb/s) "
            f"per GPU: {_NETWORK_SOURCE.get(device.name.split('-')[0], 'the reference system of memfit device table')}",
        )
    )
    rate = device.intra_node_bytes_per_s
    return Interconnect(
        intra=Link(
            kind=device.intra_node_link,
            bandwidth_bytes_per_s=rate,
            source=f"{rate / 1e9:.4g} GB/s per direction: {_LINK_SOURCE.get(device.intra_node_link, device.intra_node_link)} "
            f"of the {device.description} ({device.source}; memfit's device table)",
        ),
        inter=inter,
        gpus_per_node=gpus_per_node,
    )


# What the table's link rates are (the comment above _NVLINK3), for Link.source.
_LINK_SOURCE = {
    "nvlink": "NVLink, half the datasheet's bidirectional rate",
    "pcie": "the card's PCIe x16 rate",
}
_NETWORK_SOURCE = {
    "a100": "DGX A100, one 200 Gb/s HDR InfiniBand NIC per GPU",
    "h100": "DGX H100, one 400 Gb/s NDR InfiniBand NIC per GPU",
    "h200": "DGX H200, one 400 Gb/s NDR InfiniBand NIC per GPU",
}
