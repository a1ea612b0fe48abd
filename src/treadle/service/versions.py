"""Which policy a job's trajectories may be sampled from.

A trainer that pushes weights names its run (`trainer_run`) and the version (its
step); the service remembers what its policy engines serve as a `ServedPolicy`. A
job states the weights it is for as a `PolicyWindow`: a version range (exactly one
version when ``min == max``) and, optionally, the trainer run. Against what is
served, a window says:

- **run**: the served version is in the range and belongs to the job's run (or the
  engines still serve their initial weights, version 0 pushed by no one, and the
  range includes 0);
- **wait**: the served version is below the range — the trainer submits the next
  step's job before its weights are live (the update will come);
- **mismatch**, with a message: the served version is past the range, or the
  weights are another run's. Training on those tokens would be silently off-policy
  (a restarted trainer on a long-lived service: the engines still serve the
  previous run's weights), so the job is refused at submission, and a job waiting
  when the engines move to weights it cannot take ends its queued trajectories as
  engine failures (excluded from training, never rewards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from treadle.errors import TreadleError


class PolicyMismatch(TreadleError):
    """The engines serve weights a job cannot be sampled from (a 409)."""


@dataclass(frozen=True, slots=True)
class ServedPolicy:
    """What the policy's engines serve now."""

    version: int = 0  # the last weight update's (0: the engines' initial weights)
    trainer_run: str | None = None  # the run that pushed them (None: unnamed, or none)


@dataclass(frozen=True, slots=True)
class PolicyWindow:
    """The weights a job is for."""

    min_version: int = 0  # start nothing before the engines serve this version
    max_version: int | None = None  # a served version past this is a mismatch
    trainer_run: str | None = None  # only weights this run pushed (None: any)

    @property
    def bounded(self) -> bool:
        """Whether a weight update can put the served weights outside the window."""
        return (self.min_version > 0 or self.max_version is not None
                or self.trainer_run is not None)

    def verdict(self, served: ServedPolicy) -> Literal["run", "wait"] | str:
        """"run", "wait", or the mismatch's message (module docstring)."""
        initial = served.version == 0 and served.trainer_run is None
        if self.trainer_run is not None and served.trainer_run != self.trainer_run \
                and not initial:
            pushed = (f"trainer run {served.trainer_run!r}" if served.trainer_run
                      else "an unnamed trainer run")
            return (f"the engines serve policy version {served.version} of {pushed}, not "
                    f"of trainer run {self.trainer_run!r}: push this run's weights first "
                    "(POST /v1/weights/update with its trainer_run)")
        if self.max_version is not None and served.version > self.max_version:
            return (f"the engines serve policy version {served.version}, past this job's "
                    f"max_policy_version {self.max_version}: its tokens would be "
                    "off-policy")
        if served.version < self.min_version:
            return "wait"
        return "run"


__all__ = ["PolicyMismatch", "PolicyWindow", "ServedPolicy"]
