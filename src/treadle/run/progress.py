"""What `treadle run` shows while a batch runs and when it ends.

`Tally` (`treadle.page.trajectories`) counts finished trajectories by status, with
their rewards, turns, tokens and tool time. `Progress` draws it on stderr: on a
terminal one line redrawn a few times a second (done/total, a bar, counts by status,
tokens/s, elapsed), otherwise a plain line at every tenth of the batch, for a
trajectory finishing `plain_every_s` or more after the last line, and at the end: a
log file gets a readable record. Tokens/s is the output tokens of the finished
trajectories over the elapsed time (a trajectory's tokens count when
it finishes, so the rate is lumpy at first). `summary_table` is the end's table.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from treadle.page.trajectories import Tally, summary_rows, trajectory_row
from treadle.types import Trajectory


def summary_table(tally: Tally) -> str:
    rows = summary_rows(tally)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


class Progress:
    """The live progress display on `stream` (see the module docstring).

    Use as a context manager around the run; `add` each finished trajectory. Log
    records sent to `log_handler()` are printed above the bar instead of through it.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, tty: bool | None = None,
                 plain_every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 redraw_s: float = 0.25) -> None:
        self.total = total
        self.tally = Tally()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.plain_every_s = plain_every_s
        self._clock = clock
        self._redraw_s = redraw_s
        self._started = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._last_plain = self._started  # when the last plain line was written
        self._printed_tenth = 0  # tenths of the batch done at the last plain line
        self._printed_done = -1  # trajectories done at the last plain line

    def __enter__(self) -> Progress:
        if self.tty:
            self._ticker = threading.Thread(target=self._tick, name="treadle-run-progress",
                                            daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self.tty:
                self.stream.write("\r\033[K" + self.line() + "\n")
                self.stream.flush()
            elif self._printed_done != self.tally.done:
                self._plain()

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started

    def add(self, t: Trajectory) -> None:
        with self._lock:
            self.tally.add(trajectory_row(t))
            if self.tty:
                return  # the ticker redraws
            tenth = self.tally.done * 10 // max(self.total, 1)
            if tenth > self._printed_tenth or \
                    self._clock() - self._last_plain >= self.plain_every_s:
                self._plain()
                self._printed_tenth = tenth

    def _plain(self) -> None:
        self.stream.write(f"treadle run: {self.line()}\n")
        self.stream.flush()
        self._last_plain = self._clock()
        self._printed_done = self.tally.done

    def message(self, text: str) -> None:
        """A line above the bar (or just a line, without a terminal)."""
        with self._lock:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            if self.tty:
                self.stream.write(self.line())
            self.stream.flush()

    def line(self) -> str:
        """done/total, by status, tokens/s, elapsed (a bar too on a terminal)."""
        done, total = self.tally.done, self.total
        elapsed = self.elapsed_s
        rate = self.tally.tokens / elapsed if elapsed > 0 else 0.0
        statuses = ", ".join(f"{s} {n}" for s, n in self.tally.counts()) or "none finished"
        text = (f"{done}/{total} done ({statuses}) · {rate:,.0f} tokens/s · "
                f"{_clock_text(elapsed)}")
        if not self.tty:
            return text
        width = 24
        filled = round(width * done / total) if total else width
        return f"[{'#' * filled}{'.' * (width - filled)}] {text}"

    def log_handler(self) -> logging.Handler:
        """A logging handler that prints through `message`."""
        progress = self

        class _Above(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                progress.message(self.format(record))

        handler = _Above()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        return handler

    def _tick(self) -> None:
        while not self._stop.wait(self._redraw_s):
            with self._lock:
                self.stream.write("\r\033[K" + self.line())
                self.stream.flush()


def _clock_text(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


__all__ = ["Progress", "summary_table"]
