"""The report's progress on stderr (:class:`Progress`)."""
from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """The report's progress on stderr, drawn by tqdm (the ``report`` extra).

    On a terminal: tqdm's bar, redrawn in place, with what runs now.  Otherwise (a log file,
    CI): one line per finished step, ``tqdm.format_meter``'s bar and counts followed by the
    step's label, so that the log shows where a long run is.  Without tqdm: the same log lines
    with the counts alone.
    """

    def __init__(self, total: int, *, stream: Any = None, enabled: bool = True) -> None:
        self.total = max(int(total), 0)
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.t0 = time.perf_counter()
        try:
            tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            tty = False
        try:
            import tqdm
        except ImportError:  # the light install: no bar
            tqdm = None
        self._tqdm = tqdm
        self._live = enabled and tty and tqdm is not None  # a bar redrawn in place
        self._bar = None

    def _ensure_bar(self):
        """The terminal bar (a new one, from the current count, after :meth:`close`)."""
        if self._bar is None:
            self._bar = self._tqdm.tqdm(total=self.total or None, initial=self.done,
                                        file=self.stream, leave=True, dynamic_ncols=True)
        return self._bar

    def _line(self, label: str) -> str:
        if self._tqdm is None:
            return f"{self.done}/{self.total}  {label}"
        meter = self._tqdm.tqdm.format_meter(self.done, self.total or None,
                                             time.perf_counter() - self.t0, ncols=60)
        return f"{meter}  {label}"

    def update(self, label: str = "", advance: int = 1) -> None:
        """Count ``advance`` steps done and show ``label`` (what runs next or just ran)."""
        self.done = min(self.done + advance, self.total) if self.total else self.done + advance
        if not self.enabled:
            return
        if self._live:
            bar = self._ensure_bar()
            bar.set_description_str(label, refresh=False)
            bar.update(advance)
        else:  # a log: one line per finished step, not per start
            self.stream.write(self._line(label) + "\n")
            self.stream.flush()

    def show(self, label: str = "") -> None:
        """Show what runs now (on a terminal; nothing in a log)."""
        if self._live:
            self._ensure_bar().set_description_str(label)

    def close(self) -> None:
        """End the terminal bar's line (a later step starts a new bar)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
