"""Log-bucket histogram of non-negative integers, for `core.predictor`: conditional
log means ``E[ln v | v > x]`` in O(log buckets). Pure: no I/O, no clock."""

from __future__ import annotations

import math

# Histogram resolution: 16 buckets per doubling (~4.4% wide) up to 2^24; larger
# values share the last bucket, whose min/max/mean stay exact.
PER_OCTAVE = 16
N_BUCKETS = 1 + PER_OCTAVE * 24
# Weight of the tail prior `LogHistogram.log_mean_above` mixes in: one observation.
TAIL_PSEUDO = 1.0


def log_len(v: float) -> float:
    """ln of a length, 0 below 1."""
    return math.log(max(v, 1.0))


class LogHistogram:
    """Non-negative integers (token totals, turn counts) in log buckets: per bucket
    the count, sum of logs, min and max, plus Fenwick trees over counts and log sums.

    Suffix sums are total minus prefix; the float residue of that subtraction is
    ~1e-12 of the total and is dropped when nothing lies above.
    """

    __slots__ = ("_cnt", "_cnt_tree", "_hi", "_lo", "_sum", "_sum_tree", "n", "total")

    def __init__(self) -> None:
        self._cnt_tree = [0] * (N_BUCKETS + 1)
        self._sum_tree = [0.0] * (N_BUCKETS + 1)
        self._cnt = [0] * N_BUCKETS
        self._sum = [0.0] * N_BUCKETS
        self._lo = [0] * N_BUCKETS
        self._hi = [0] * N_BUCKETS
        self.n = 0
        self.total = 0.0  # sum of logs

    @staticmethod
    def bucket(v: float) -> int:
        return 0 if v < 1.0 else min(N_BUCKETS - 1, 1 + int(math.log2(v) * PER_OCTAVE))

    def add(self, v: int) -> None:
        b = self.bucket(v)
        if self._cnt[b] == 0:
            self._lo[b] = self._hi[b] = v
        else:
            self._lo[b] = min(self._lo[b], v)
            self._hi[b] = max(self._hi[b], v)
        lv = log_len(v)
        self._cnt[b] += 1
        self._sum[b] += lv
        self.n += 1
        self.total += lv
        i = b + 1
        while i <= N_BUCKETS:
            self._cnt_tree[i] += 1
            self._sum_tree[i] += lv
            i += i & -i

    def log_mean_above(self, x: float, prior: float) -> float:
        """E[ln v | v > x], mixed with one pseudo-observation ln v = prior."""
        b = self.bucket(x)
        c_le = 0
        s_le = 0.0
        i = b + 1
        while i > 0:
            c_le += self._cnt_tree[i]
            s_le += self._sum_tree[i]
            i -= i & -i
        count = float(self.n - c_le)
        total = self.total - s_le if count else 0.0
        cb = self._cnt[b]
        if cb and x < self._lo[b]:
            count += cb
            total += self._sum[b]
        elif cb and x < self._hi[b]:
            # Logs spread evenly over [ln lo, ln hi]: the fraction above x falls
            # linearly and their mean rises linearly from the bucket's mean to ln hi,
            # which keeps the result continuous in x.
            llo, lhi, lx = log_len(self._lo[b]), log_len(self._hi[b]), math.log(x)
            frac = (lhi - lx) / (lhi - llo)
            mean = self._sum[b] / cb
            count += frac * cb
            total += frac * cb * (mean + (lx - llo) / (lhi - llo) * (lhi - mean))
        return (total + TAIL_PSEUDO * prior) / (count + TAIL_PSEUDO)
