"""The prompts of a multi-step run, in the order a trainer's data loader hands them
out: `prompts` GRPO groups an epoch, epoch after epoch, the same prompts each epoch
(`PromptStream.group(i)`: the i-th group launched, whatever the step).

A generated workload (a suite or a shape) samples every epoch anew (`sample=epoch`:
the same prompts and difficulties, other trajectories); a trace replays its episodes
unchanged every epoch. Ids: a prompt is ``{workload}-p{prompt:04d}``, a trajectory
``{prompt}-e{epoch}-r{sibling:02d}-a{attempt}`` (an attempt is a restart from the
prompt). The group id a scheduler sees is the prompt's, so a predictor that keys
on it meets the prompt's earlier epochs; `per_prompt=False` makes it
``{prompt}-e{epoch}`` instead, a group no earlier epoch has seen (the ablation of
per-prompt history).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from treadle.workloads import TrajectorySpec, Workload

EpochSource = Callable[[int], Workload]  # epoch -> the workload of that epoch's samples


@dataclass(frozen=True, slots=True)
class GroupDraw:
    """The i-th group of the stream: which prompt, which epoch, its trajectories."""

    index: int  # position in the stream
    prompt: str  # prompt id (stable across epochs)
    epoch: int
    specs: tuple[TrajectorySpec, ...]  # ids of attempt 0 (`PromptStream.attempt`)


_ATTEMPT = re.compile(r"-a\d+$")  # the suffix `PromptStream.attempt` adds


class PromptStream:
    """`prompts` groups an epoch from `source(epoch)`, which must give the same
    groups (prompts) in the same order every epoch; `group_size` is their nominal
    size (a trace's groups may differ). ValueError when an epoch has too few."""

    def __init__(self, name: str, source: EpochSource, prompts: int, group_size: int, *,
                 per_prompt: bool = True) -> None:
        if prompts < 1 or group_size < 1:
            raise ValueError(f"prompts ({prompts}) and group_size ({group_size}) must be >= 1")
        self.name = name
        self.prompts = prompts
        self.group_size = group_size
        self.per_prompt = per_prompt
        self._source = source
        self._epochs: dict[int, list[tuple[TrajectorySpec, ...]]] = {}

    def group(self, index: int) -> GroupDraw:
        epoch, p = divmod(index, self.prompts)
        groups = self._epoch(epoch)
        prompt = f"{self.name}-p{p:04d}"
        gid = prompt if self.per_prompt else f"{prompt}-e{epoch}"
        specs = tuple(replace(s, traj_id=f"{prompt}-e{epoch}-r{r:02d}", group_id=gid)
                      for r, s in enumerate(groups[p]))
        return GroupDraw(index, prompt, epoch, specs)

    @staticmethod
    def attempt(spec: TrajectorySpec, attempt: int) -> TrajectorySpec:
        """The spec of a restart from the prompt: same episode, its own id."""
        return replace(spec, traj_id=f"{spec.traj_id}-a{attempt}")

    @staticmethod
    def episode_of(traj_id: str) -> str:
        """The id of the trajectory an attempt's id (`attempt`) replays."""
        return _ATTEMPT.sub("", traj_id)

    def _epoch(self, epoch: int) -> list[tuple[TrajectorySpec, ...]]:
        cached = self._epochs.get(epoch)
        if cached is not None:
            return cached
        workload = self._source(epoch)
        by_group: dict[str, list[TrajectorySpec]] = {}
        for spec in workload.trajectories:
            by_group.setdefault(spec.group_id, []).append(spec)
        groups = [tuple(members) for members in by_group.values()]
        if len(groups) < self.prompts:
            raise ValueError(f"{self.name}: epoch {epoch} needs {self.prompts} groups, the "
                             f"workload has {len(groups)}")
        self._epochs[epoch] = groups[:self.prompts]
        return self._epochs[epoch]
