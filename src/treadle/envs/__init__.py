"""Task suites with verifiable rewards, the tools agents use on them, and adapters.

    from treadle.envs import get_suite, open_episode
    from treadle.sandbox import BwrapBackend

    suite = get_suite("swe")
    task = suite.tasks(1, seed=0)[0]
    async with open_episode(suite, task, BwrapBackend()) as episode:
        episode.tool_specs                      # function specs for the chat template
        await episode.call("bash", '{"command": "python3 -m unittest"}')
        reward = await episode.score()          # RewardResult(reward, metrics, detail)

- `base`: `Suite` (task format, generator, tools, setup, reward), `Episode`,
  `RewardResult`, `open_episode`.
- `tools/`: python, bash, read_file, write_file, apply_patch, search,
  submit_answer; tool errors are observations, never exceptions.
- `suites/`: math, code, swe, search, stem. `adapters/`: NeMo Gym resources
  servers, gymnasium-style text envs. `registry`: `get_suite`, `register_suite`.
- `scoring`, `units`: answer normalisation, EM/F1, quantities with units.

Task formats and how to add a suite: docs/suites.md.
"""

from treadle.envs.base import Episode, RewardResult, Suite, open_episode
from treadle.envs.errors import EnvConfigError, EnvError, ResourcesServerError, TaskFormatError
from treadle.envs.registry import get_suite, register_suite, suite_names, unregister_suite
from treadle.envs.tools import Tool, ToolContext, ToolInputError, ToolRecord, ToolResult

__all__ = [
    "EnvConfigError",
    "EnvError",
    "Episode",
    "ResourcesServerError",
    "RewardResult",
    "Suite",
    "TaskFormatError",
    "Tool",
    "ToolContext",
    "ToolInputError",
    "ToolRecord",
    "ToolResult",
    "get_suite",
    "open_episode",
    "register_suite",
    "suite_names",
    "unregister_suite",
]
