"""Progress off a terminal: one line per phase on stderr where rich's spinner would draw nothing.

rich draws ``console.status(...)`` only on a terminal; a command whose output is piped or redirected
(``memfit fit ... 2>&1 | tee log``) ran silent for minutes. :class:`LineConsole` is the CLI's console:
on a terminal its ``status`` is rich's spinner, elsewhere each phase it names (the opening message and
each new ``update``) is one line ``memfit: <phase> ...`` on stderr. Quiet consoles (``--json``) print
nothing, so stderr stays empty for scripts that read the JSON.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from rich.console import Console, RenderableType


class _LineStatus:
    """What ``console.status`` returns off a terminal: ``update`` writes a line when the phase changes."""

    def __init__(self, message: str) -> None:
        self._last = ""
        self.update(message)

    def update(self, status: RenderableType | None = None, **_: Any) -> None:
        text = " ".join(str(status or "").split())
        if text and text != self._last:
            self._last = text
            print(f"memfit: {text}", file=sys.stderr, flush=True)

    def __enter__(self) -> _LineStatus:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


class LineConsole(Console):
    """rich's Console whose ``status`` falls back to one stderr line per phase off a terminal."""

    def status(self, status: RenderableType, **kw: Any) -> Any:  # noqa: D102 (rich's, documented above)
        if self.quiet or self.is_terminal:
            return super().status(status, **kw)
        return _LineStatus(str(status))
