"""`CallPacer`: how far apart a runner stream's Ray calls start.

    pacer = CallPacer(gap_s=0.03)
    while True:
        await have_messages.wait()
        await pacer.wait()      # at once after a quiet spell, else the gap's rest
        send(everything_gathered_so_far)

A Ray call costs the service and the actor far more CPU than a message in it
(`treadle bench service --runners`), so under load the calls, not the messages, set
the data path's CPU. The pacer bounds a stream at one call per `gap_s` while
messages keep coming (each call carrying what gathered meanwhile: at most `gap_s`
of delay), and adds none to the first call after a quiet spell (only one loop turn,
for the messages of the same step to join it). A fixed window before every call
delays every message by it, busy or not, and still makes a call per window.

Its clock is real seconds (`MONOTONIC` unless a test gives another): it paces a
process's calls, not the modelled time of the work.
"""

from __future__ import annotations

import math

from treadle.clock import MONOTONIC, Clock


class CallPacer:
    """Starts of one stream's calls, at least `gap_s` real seconds apart (module
    docstring)."""

    def __init__(self, gap_s: float, clock: Clock = MONOTONIC) -> None:
        if gap_s < 0:
            raise ValueError("gap_s must be >= 0")
        self.gap_s = gap_s
        self._clock = clock
        self._last = -math.inf  # when the last call started

    async def wait(self) -> None:
        """Return when the next call may start (after one loop turn at least); counts
        it as started then."""
        await self._clock.sleep(max(0.0, self._last + self.gap_s - self._clock.now()))
        self._last = self._clock.now()


__all__ = ["CallPacer"]
