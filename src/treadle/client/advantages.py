"""GRPO group-normalised advantages, in plain Python.

For the members of one group (the n samples of one task) with rewards r_1..r_n:

    A_i = r_i - mean(r)                          normalize_std=False (Dr. GRPO)
    A_i = (r_i - mean(r)) / (std(r) + epsilon)   normalize_std=True  (GRPO)

with ``std`` the sample standard deviation (n - 1 in the denominator), the one
verl, SkyRL and TRL use (``torch.std``); ``epsilon`` defaults to verl's and SkyRL's
1e-6 (TRL adds 1e-4).

Two cases are decided explicitly rather than left to the arithmetic:

- A group with one member gets advantage 0.0: there is no baseline to compare it
  with. (verl and SkyRL return the raw reward there, which pushes a lone sample by
  the reward's absolute scale; here a lone sample carries no signal.)
- A group whose rewards are all equal gets 0.0 for every member, exactly: there is
  no relative signal, and a mean computed in floating point would otherwise leave
  ±1e-17 residues that ``/ epsilon`` blows up to ±1e-11 instead of 0.

Infrastructure failures never reach this function: `treadle.client.samples` drops
them (or the whole group) first, so the baseline is the mean over real samples.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable], *,
                     normalize_std: bool = True, epsilon: float = 1e-6) -> list[float]:
    """The advantage of each reward within its group (`groups[i]` is reward i's group).

    Groups need not be contiguous. Raises ValueError for unequal lengths, a
    non-finite reward or a negative epsilon.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    if epsilon < 0:
        raise ValueError("epsilon must be >= 0")
    members: dict[Hashable, list[int]] = {}
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        if not math.isfinite(r):
            raise ValueError(f"reward {i} is {r}; rewards must be finite")
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        values = [float(rewards[i]) for i in idx]
        if len(values) == 1 or min(values) == max(values):
            continue  # no baseline, or no spread: 0.0 (see the module docstring)
        mean = math.fsum(values) / len(values)
        scale = 1.0
        if normalize_std:
            var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
            scale = math.sqrt(var) + epsilon
        for i, v in zip(idx, values, strict=True):
            out[i] = (v - mean) / scale
    return out
