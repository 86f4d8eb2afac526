"""Watching a run: measured peak and step time against the fit's predictions, and a per-step log.

NOTE [ Watching a run ]
With a budget the auto-fit predicts the peak of a step and its seconds (global batch share /
predicted samples/s). Peak memory is measured by the tracker on the first two steps on CPU (the
optimizer state exists from the second on; every step under ``guard``) and by
``torch.cuda.max_memory_allocated`` per step on CUDA; step time is the median over steps that ran
without the tracker (all but the first under ``guard``), leaving out the first step and steps that
replanned. A drift of more than 10 % either way is warned about (the time only after 3 timed
steps, and not under ``guard``, whose cost the prediction does not include). A replan starts a new
comparison (:meth:`DriftWatch.new_choice`): its prediction is for another micro-batch and plan.

``progress_jsonl`` (:class:`ProgressLog`) adds one line per step (loss, skip reason, the
tracker's peak when it ran, the process's RSS), for soak runs (``benchmarks/soak.py``). The log
serves the run, not the reverse: a write that fails (its disk full, while the checkpoint's has
room) is warned about once and ends the log; training and saving go on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from memfit.accumulate import StepResult
from memfit.errors import SpecError
from memfit.training.guard import Choice
from memfit.units import format_bytes

DRIFT_WARN = 0.10
"""Relative drift of measured peak or step time from the prediction that is warned about."""
TIME_CHECK_STEPS = 3
"""Timed steps before the time drift is checked."""


class DriftWatch:
    """Measured peak and step time against the current choice's predictions (NOTE [ Watching a run ]).

    Args:
        choice: the micro-batch and plan the run starts with, and their predictions.
        guard: every step runs under the tracker (its time is not compared).
        device: where the run measures (CUDA: the allocator; CPU: the tracker).
    """

    def __init__(self, choice: Choice, *, guard: bool, device: torch.device) -> None:
        self.guard = guard
        self.device = device
        self.peak_bytes: int | None = None  # over the whole run
        self.ops: int | None = None
        self.all_step_s: list[float] = []
        self.new_choice(choice)

    def new_choice(self, choice: Choice) -> None:
        """Compare from now on against ``choice`` (after a replan): its peak and times start afresh."""
        self.choice = choice
        self.choice_peak: int | None = None
        self.choice_peak_held: int | None = None  # of choice_peak, held by a collective's thread
        self.n_peaks = 0
        self.step_s: list[float] = []
        self.warned_peak = self.warned_time = False

    def observe(
        self, peak_bytes: int | None, step_s: float | None, ops: int | None, held_bytes: int | None = None
    ) -> list[str]:
        """Record a step (its measured peak, its seconds when timed, the tracker's op count, the part of
        the peak a collective's thread held: :class:`memfit.training.distributed.Fsdp2Peak`); the warnings it raises."""
        if ops is not None:
            self.ops = ops
        if peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, peak_bytes)
            if self.choice_peak is None or peak_bytes > self.choice_peak:
                self.choice_peak, self.choice_peak_held = peak_bytes, held_bytes
            self.n_peaks += 1
        if step_s is not None:
            self.step_s.append(step_s)
            self.all_step_s.append(step_s)
        messages = self._peak_message()
        if len(self.step_s) >= TIME_CHECK_STEPS:
            messages += self._time_message()
        return messages

    def finish(self) -> list[str]:
        """The warnings not yet given at the end of the run (a time drift over fewer than 3 steps)."""
        return self._peak_message() + (self._time_message() if self.step_s else [])

    def _peak_message(self) -> list[str]:
        d = self.peak_drift()
        if d is None or abs(d) <= DRIFT_WARN or self.warned_peak:
            return []
        self.warned_peak = True
        held = (
            f"; {format_bytes(self.choice_peak_held)} of it were collective buffers gloo's threads freed late, which no prediction counts"
            if self.choice_peak_held
            else ""
        )
        return [
            f"measured peak {format_bytes(self.choice_peak)} is {d:+.0%} off the predicted {format_bytes(self.choice.predicted_peak_bytes)} "
            f"(micro-batch {self.choice.micro_batch}): the fit's memory model does not match this run{held}"
        ]

    def _time_message(self) -> list[str]:
        d = self.time_drift()
        if d is None or abs(d) <= DRIFT_WARN or self.warned_time or self.guard:
            return []
        self.warned_time = True
        return [
            f"measured step time {statistics.median(self.step_s) * 1e3:.0f} ms is {d:+.0%} off the predicted "
            f"{self.choice.predicted_window_s * 1e3:.0f} ms (median of {len(self.step_s)} steps; a shared machine adds noise)"
        ]

    def peak_drift(self) -> float | None:
        """Measured / predicted peak - 1 under the current choice (None: either is unknown, or only the
        first step was measured: it creates the optimizer state, so its peak is not the steady one)."""
        p = self.choice.predicted_peak_bytes
        if not p or self.choice_peak is None or self.n_peaks < 2:
            return None
        return self.choice_peak / p - 1.0

    def time_drift(self) -> float | None:
        """Median measured / predicted step seconds - 1 under the current choice."""
        p = self.choice.predicted_window_s
        if not p or not self.step_s:
            return None
        return statistics.median(self.step_s) / p - 1.0

    def samples_per_s(self, global_batch: int) -> float | None:
        """Global batch / median seconds of every timed step of the run."""
        return global_batch / statistics.median(self.all_step_s) if self.all_step_s else None

    def report(self, global_batch: int) -> dict[str, Any]:
        """The measured-against-predicted fields of :class:`~memfit.training.config.TrainResult`."""
        how = (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else ("MemoryTracker, every step" if self.guard else "MemoryTracker, first two steps")
        )
        step_s = statistics.median(self.all_step_s) if self.all_step_s else None
        return {
            "samples_per_s": self.samples_per_s(global_batch),
            "step_s": step_s,
            "peak_bytes": self.peak_bytes,
            "peak_measured_by": how if self.peak_bytes is not None else "none",
            "predicted_peak_bytes": self.choice.predicted_peak_bytes,
            "measured_peak_bytes": self.choice_peak,
            "peak_drift": self.peak_drift(),
            "predicted_step_s": self.choice.predicted_window_s,
            "measured_step_s": statistics.median(self.step_s) if self.step_s else None,
            "time_drift": self.time_drift(),
            "guard_ops_per_step": self.ops if self.guard else None,
        }


class ProgressLog:
    """``--progress-jsonl``: one JSON line per step (rank 0), for soak tests and dashboards."""

    def __init__(self, f: Any, path: str = "", warn: Callable[[str], None] | None = None) -> None:
        self._f: Any = f
        self._path = path
        self._warn = warn
        self._t0 = time.perf_counter()

    @classmethod
    def open(cls, path: str | None, *, warn: Callable[[str], None] | None = None) -> ProgressLog | None:
        """The log appending to ``path`` (None: no log); ``warn`` is told once if a write fails.

        Raises:
            SpecError: ``path`` cannot be opened for writing.
        """
        if path is None:
            return None
        try:
            return cls(open(path, "a", buffering=1), path, warn)  # noqa: SIM115  (line-buffered, closed by close())
        except OSError as err:
            raise SpecError(
                f"memfit.training: cannot write --progress-jsonl {path!r} ({err.strerror}). Give a writable path."
            ) from None

    def write(self, step: int, result: StepResult, peak_bytes: int | None) -> None:
        """One line for window ``step`` (1-based)."""
        record = {
            "step": step,
            "loss": result.loss if math.isfinite(result.loss) else None,
            "skip_reason": result.skip_reason.value if result.skip_reason is not None else None,
            "tracked_peak_bytes": peak_bytes,
            "rss_bytes": _rss_bytes(),
            "elapsed_s": time.perf_counter() - self._t0,
        }
        if self._f is None:
            return
        try:
            self._f.write(json.dumps(record) + "\n")
        except OSError as err:
            self._give_up(step, err)

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):  # the buffered tail of a full disk
                self._f.close()
            self._f = None

    def _give_up(self, step: int, err: OSError) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        self._f = None
        if self._warn is not None:
            self._warn(
                f"--progress-jsonl {self._path}: writing step {step} failed ({err.strerror or err}); the log stops "
                "there and training goes on (free space on its disk, or give another path next time)"
            )


def _rss_bytes() -> int | None:
    """Resident set size of this process now (Linux ``/proc/self/statm``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
