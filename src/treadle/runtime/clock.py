"""The runtime's clock is `treadle.clock`'s; these names stay importable from here."""

from treadle.clock import Clock, ScaledClock, WallClock

__all__ = ["Clock", "ScaledClock", "WallClock"]
