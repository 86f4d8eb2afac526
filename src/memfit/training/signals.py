"""SIGINT and SIGTERM during training, and why a run stopped before its last step.

NOTE [ Stopping a run ]
The first SIGINT or SIGTERM lets the current window finish, saves (with ``save``) and stops with
exit code 130 or 143 and one line that ends in ``--resume PATH``; a second one leaves at once (a
save in progress removes its temporary file; ``PATH`` keeps the last complete save). Under
``torchrun`` the ranks agree on the window to stop after (one all-reduce of a flag per step).
After ``max_skips`` consecutive non-finite windows the run stops with exit code 3 (1 is "verify
found a difference", 2 a user error), saving the last finite state; a state holding NaN or inf is
never written.

Under ``torchrun``, a rank that stops answering ends the run after ``collective_timeout_s`` (NOTE [
Bounded collectives ] in :mod:`memfit.training.distributed`), and a signal while a rank waits for
the others ends it after a short grace: exit 75 (or 130 / 143 for the signal), no save (it would
need the lost rank), and the line names the last complete one.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.accumulate import Accumulator
from memfit.errors import Interrupted
from memfit.training.config import TrainConfig

EXIT_DIVERGED = 3
"""Exit code of a run that diverged (``max_skips`` consecutive non-finite windows)."""
EXIT_RANKS_LOST = 75
"""Exit code of a ``torchrun`` run stopped because another rank stopped answering (75 is
``EX_TEMPFAIL`` of sysexits.h: restart the ranks and resume)."""


class Abort(Interrupted):
    """A second SIGINT/SIGTERM: leave at once (a KeyboardInterrupt, so that no ``except Exception``
    in user code swallows it, and an :class:`~memfit.errors.Interrupted`, so that the workload's
    code is not blamed for it; a save in progress removes its temporary file)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum, signal.Signals(signum).name)


class Interrupts:
    """SIGINT and SIGTERM while training: the first asks the loop to stop after the current window,
    the second raises :class:`Abort` (NOTE [ Stopping a run ]). Handlers are restored on exit;
    outside the main thread (where Python cannot set handlers) signals keep their default behaviour.

    Args:
        on_signal: called from the handler with the signal and a one-line message on the first
            signal (it should only write the line).
    """

    def __init__(self, on_signal: Callable[[int, str], None] | None = None) -> None:
        self.signum: int | None = None
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise Abort(signum)
        self.signum = signum
        if self._on_signal is not None:
            self._on_signal(
                signum,
                f"memfit train: {signal.Signals(signum).name} received: finishing the current window, then saving "
                "and stopping (send it again to stop at once)",
            )

    # A KeyboardInterrupt under this handler was raised by code, not by a signal (memfit.workload.call_user).
    _handle._memfit_signal_handler = True  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True, slots=True)
class Stop:
    """Why the loop stopped before ``steps``: a signal, a second signal, or divergence."""

    kind: str  # signal | abort | diverged | nonfinite_state | ranks_lost
    step: int
    signum: int | None = None
    message: str | None = None

    def exit_code(self) -> int:
        """130 for SIGINT, 143 for SIGTERM (128 + the signal), 3 for a diverged run."""
        if self.kind in ("signal", "abort") or (self.kind == "ranks_lost" and self.signum is not None):
            return 128 + int(self.signum or signal.SIGTERM)  # 130 for SIGINT, 143 for SIGTERM
        if self.kind == "ranks_lost":
            return EXIT_RANKS_LOST
        return EXIT_DIVERGED

    def describe(self, config: TrainConfig, saved_at: int | None, acc: Accumulator) -> str:
        """The one line that says why the run stopped and how to continue it."""
        if config.save and saved_at is not None:
            resume = f"state of step {saved_at} saved to {config.save}; continue with the same command and --resume {config.save}"
        elif config.save and not os.path.exists(config.save):
            resume = f"nothing was saved ({config.save} was not written); run the same command again to start over"
        elif config.save:
            resume = (
                f"{config.save} keeps its last complete save; continue with the same command and --resume {config.save}"
            )
        else:
            resume = "nothing was saved (no --save); give --save PATH to be able to resume"
        if self.kind == "signal":
            return f"memfit train: stopped by {signal.Signals(self.signum or signal.SIGTERM).name} after step {self.step} of {config.steps}; {resume}"
        if self.kind == "abort":
            return f"memfit train: aborted at once by a second {signal.Signals(self.signum or signal.SIGTERM).name} during step {self.step + 1}; {resume}"
        if self.kind == "nonfinite_state":
            return f"{self.message}"
        if self.kind == "ranks_lost":
            why = (self.message or "").removeprefix("memfit.training: ")
            return f"memfit train: stopped during step {self.step + 1} of {config.steps}: {why}; {resume.replace('continue with the same command', 'restart every rank with the same command')}"
        last = (
            acc.last_result.skip_reason.value
            if acc.last_result is not None and acc.last_result.skip_reason is not None
            else "?"
        )
        return (
            f"memfit train: {acc.consecutive_skips} consecutive windows skipped for a NaN or infinite loss or gradient "
            f"(--max-skips {config.max_skips}; last: {last}) at step {self.step}: the run diverged. {resume[0].upper() + resume[1:]} "
            "after lowering --lr or setting --max-grad-norm."
        )


def startup_stop_line(config: TrainConfig, signum: int) -> str:
    """The line of a run that a signal stopped before its first step (loading, resuming, the auto-fit)."""
    name = signal.Signals(signum).name
    stage = "loading the workload" + (" and fitting it to the budget" if config.budget_bytes is not None else "")
    if config.resume:
        then = f"{config.resume} is unchanged; run the same command again to continue from it"
    elif config.save and os.path.exists(config.save):
        then = f"{config.save} is unchanged; run the same command again"
    else:
        then = "run the same command again to start"
    return f"memfit train: stopped by {name} during start-up ({stage}), before the first step; nothing was trained or saved. {then[0].upper()}{then[1:]}."
