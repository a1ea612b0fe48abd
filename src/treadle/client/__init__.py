"""Trainer-side converters: treadle trajectories to verl, SkyRL and TRL, and GRPO
advantages. Pure Python (no torch). See docs/client.md.

The policy all converters share (what is excluded, how segments and rewards map to
rows) is in `treadle.client.samples`.
"""

from treadle.client.advantages import group_advantages
from treadle.client.errors import ClientError, ConversionError
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

__all__ = [
    "Batch",
    "ClientError",
    "ConversionError",
    "Converted",
    "Exclusion",
    "SkyRLTrajectoryID",
    "TrainingSequence",
    "exclusion_reason",
    "exclusions",
    "group_advantages",
    "in_group_order",
    "to_skyrl",
    "to_trl",
    "to_verl",
    "training_sequences",
    "treadle_reward",
]
