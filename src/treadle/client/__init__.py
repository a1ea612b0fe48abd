"""The trainer's side of treadle: the HTTP client of the rollout service, converters
of trajectories to verl, SkyRL and TRL, and GRPO advantages. See docs/client.md.

The converters and advantages are pure Python (no torch); the HTTP clients
(`RolloutClient`, `AsyncRolloutClient` and what they return) need httpx (extra
``treadle[client]``) and are imported on first use, so the converters work
without it. The policy all converters share (what is excluded, how segments and
rewards map to rows) is in `treadle.client.samples`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treadle.client.advantages import group_advantages
from treadle.client.errors import (
    ClientError,
    ConversionError,
    GroupError,
    ServiceError,
    ServiceProtocolError,
    ServiceUnavailable,
)
from treadle.client.samples import (
    Batch,
    Converted,
    Exclusion,
    TrainingSequence,
    exclusion_reason,
    exclusions,
    in_group_order,
    training_sequences,
)
from treadle.client.skyrl import SkyRLTrajectoryID, to_skyrl
from treadle.client.trl import to_trl, treadle_reward
from treadle.client.verl import to_verl

if TYPE_CHECKING:
    from treadle.client.aio import AsyncRolloutClient
    from treadle.client.groups import Group
    from treadle.client.http import RolloutClient
    from treadle.client.stream import RetryPolicy
    from treadle.client.wire import (
        Delivered,
        EngineState,
        Health,
        JobState,
        SubmittedJob,
        WeightsState,
        replay_tasks,
        suite_tasks,
    )

# Names of the HTTP client, by the module that defines them (imported on first use).
_LAZY = {
    "AsyncRolloutClient": "aio", "Group": "groups", "RolloutClient": "http",
    "RetryPolicy": "stream", "Delivered": "wire", "EngineState": "wire", "Health": "wire",
    "JobState": "wire", "SubmittedJob": "wire", "WeightsState": "wire",
    "replay_tasks": "wire", "suite_tasks": "wire",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle.client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"treadle.client.{module}"), name)


__all__ = [
    "AsyncRolloutClient",
    "Batch",
    "ClientError",
    "ConversionError",
    "Converted",
    "Delivered",
    "EngineState",
    "Exclusion",
    "Group",
    "GroupError",
    "Health",
    "JobState",
    "RetryPolicy",
    "RolloutClient",
    "ServiceError",
    "ServiceProtocolError",
    "ServiceUnavailable",
    "SkyRLTrajectoryID",
    "SubmittedJob",
    "TrainingSequence",
    "WeightsState",
    "exclusion_reason",
    "exclusions",
    "group_advantages",
    "in_group_order",
    "replay_tasks",
    "suite_tasks",
    "to_skyrl",
    "to_trl",
    "to_verl",
    "training_sequences",
    "treadle_reward",
]
