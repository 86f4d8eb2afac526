"""`memfit profile`: per-block measured stats of one training step."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.coverage import coverage_lines
from memfit.cli.common import (
    Output,
    attention_json,
    mib,
    step_from_args,
    workload_from_args,
)
from memfit.cli.device import settle  # noqa: F401  (memfit.cli.main calls it before run)
from memfit.profiling.blocks import profile
from memfit.profiling.parts import parts_line, step_parts
from memfit.report.memviz import snapshot_line, write_snapshot


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    wl = workload_from_args(args)
    kept: dict[str, Any] = {}  # the tracked step with every block kept: --snapshot writes its allocations

    def on_pass(option: str, memory: Any) -> None:
        if option == "keep" and args.snapshot:
            kept["allocations"] = memory.allocations

    with out.console.status("profiling ...") as status:
        stats = profile(
            wl,
            step=step_from_args(args),
            progress=lambda s: status.update(f"profiling: {s}"),
            on_memory_pass=on_pass,
        )
    out.table(
        f"{wl.name}: {len(stats.blocks)} blocks in {stats.chain_path or 'the model'!r}, batch {stats.batch_size}, {stats.dtype}",
        ["block", "fwd ms", "bwd ms", "saved", "output", "fwd temp", "bwd temp"],
        [
            (
                b.name,
                f"{b.fwd_s * 1e3:.1f}",
                f"{b.bwd_s * 1e3:.1f}",
                mib(b.saved_bytes),
                mib(b.output_bytes),
                mib(b.fwd_temp_bytes),
                mib(b.bwd_temp_bytes),
            )
            for b in stats.blocks
        ],
    )
    out.print(
        f"step peak {mib(stats.peak_bytes)} (params {mib(stats.params_bytes)}, grads {mib(stats.grads_bytes)}, "
        f"optimizer {mib(stats.optimizer_bytes)}, activations and temporaries {mib(stats.activations_peak_bytes)}); "
        f"step {stats.step_s * 1e3:.0f} ms (median of {args.repeats})"
        + (f"; model states {stats.states}: grads freed as the backward steps" if stats.states != "device" else "")
    )
    parts = step_parts(stats)
    out.print(parts_line(parts))
    snapshot = None
    if args.snapshot:
        snapshot = write_snapshot(args.snapshot, kept.get("allocations", []), device=stats.device)
        out.print(snapshot_line(snapshot))
    chain, *left_out = coverage_lines(
        stats.chain_path,
        len(stats.blocks),
        stats.chain_coverage,
        stats.chain_left_out,
        stats.lists_as_run,
        stats.suggested_blocks,
    ) or [None]
    if chain is not None:
        out.print(chain)
    for line in left_out:
        out.warn(line)
    return (
        stats.to_dict()
        | {"step_parts_s": parts.to_dict(), "snapshot": snapshot}
        | attention_json(out, wl, batch_size=stats.batch_size, seed=args.seed, peak_bytes=stats.peak_bytes)
    )
