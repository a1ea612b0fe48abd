"""A rubric: the dimensions a trajectory is scored on, and how they add up.

    rubric = Rubric(
        verified=(VerifiedDimension("correct", weight=0.7, metric="reward", gate=1.0),),
        judged=(JudgedDimension("clarity", weight=0.3, template=CLARITY, scale=Scale(1, 5)),))

- A *verified* dimension is the suite's own measurement: its reward (``metric
  "reward"``) or one of its metrics (``passed``, ``exact_match``), as measured.
- A *judged* dimension is a judge model's verdict on a `Scale`, read from its reply
  as `VerdictKind` says, and mapped to [0, 1] (low → 0, high → 1). Its prompt is a
  `string.Template` over `JudgeInput`'s fields ($task, $answer, $trajectory, $diff)
  and the scale ($low, $high); any other ``$name`` is refused when the rubric is made.
- An *agentic* judged dimension (`AgentSpec`) is judged by an agent with tools in a
  sandbox holding the trajectory's work tree (it can run the tests, read the diff);
  its rendered template is the agent's task, its verdict the JSON of its answer.
- A *gate* on a verified dimension (``gate=1.0``: tests must pass): below it, the
  reward is `Rubric.gated_reward` and the judges are not asked (their dimensions are
  SKIPPED, which is no failure).
- The aggregate is the weighted sum of the values. A required judged dimension
  without a verdict leaves the trajectory unscored (reward None, flagged); an
  optional one without a verdict is left out and the others' weights are scaled up
  to the whole weight (so the reward stays on the same scale).
"""

from __future__ import annotations

import enum
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from treadle.types import Judgement, JudgementStatus

FIELDS = ("task", "answer", "trajectory", "diff")  # what a judge's prompt may show
SCALE_FIELDS = ("low", "high", "dimension")  # and what it may say of the scale


class VerdictKind(enum.Enum):
    """How a judge's reply is read."""

    JSON = "json"  # a JSON object {"score": n, "reason": "..."} in the reply
    LOGPROBS = "logprobs"  # the expected score under the top logprobs of the score token


@dataclass(frozen=True, slots=True)
class Scale:
    """Integer scores from `low` to `high` (both included)."""

    low: int = 1
    high: int = 5

    def __post_init__(self) -> None:
        if self.high <= self.low:
            raise ValueError(f"scale: high ({self.high}) must be above low ({self.low})")

    def value(self, score: float) -> float:
        """`score` mapped to [0, 1]."""
        return (score - self.low) / (self.high - self.low)

    def holds(self, score: float) -> bool:
        return self.low <= score <= self.high


@dataclass(frozen=True, slots=True)
class JudgeInput:
    """What a judge's prompt can show of one trajectory."""

    task: str  # the task's prompt as the policy saw it
    answer: str  # the policy's final assistant text ("" when it gave none)
    trajectory: str  # the whole conversation, or a summary of it
    diff: str = ""  # the change the policy made (SWE, code tasks: `envs.worktree`), else ""
    # The work tree the policy left (path -> text; SWE, code tasks): what an agentic
    # judge's sandbox holds. Empty where the suite has none.
    files: Mapping[str, str] = field(default_factory=dict)


JUDGE_TOOLS = ("bash", "python", "read_file", "write_file", "apply_patch")  # an agent's


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """A judge that is an agent: the rendered template is its task, it works with
    `tools` (names of `JUDGE_TOOLS`, and always ``submit_answer``) in a sandbox
    holding the trajectory's work tree, within the limits, and its final answer (the
    submitted one, else its last reply) holds the verdict."""

    tools: tuple[str, ...] = ("bash", "read_file")
    max_turns: int = 8
    max_total_tokens: int = 16_384  # its whole context
    max_tokens_per_turn: int | None = None  # None: the judge's max_tokens

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tools) - set(JUDGE_TOOLS))
        if unknown:
            raise ValueError(f"agent tools {unknown} are not among {list(JUDGE_TOOLS)}")
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"agent tools must be unique: {list(self.tools)}")
        if self.max_turns < 1 or self.max_total_tokens < 2 or (
                self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1):
            raise ValueError("an agent needs max_turns >= 1, max_total_tokens >= 2 and "
                             "max_tokens_per_turn >= 1")

    @property
    def identity(self) -> str:
        """What of it decides the answers (a part of the cache key)."""
        return (f"agent tools {','.join(self.tools)}, max_turns {self.max_turns}, "
                f"max_total_tokens {self.max_total_tokens}, "
                f"max_tokens_per_turn {self.max_tokens_per_turn}")


@dataclass(frozen=True, slots=True)
class VerifiedDimension:
    """A part of the reward the suite measured."""

    name: str
    weight: float
    metric: str = "reward"  # "reward": the suite's reward; else a name in its metrics
    gate: float | None = None  # below this, the reward is the rubric's gated_reward


@dataclass(frozen=True, slots=True)
class JudgedDimension:
    """A part of the reward a judge gives (module docstring)."""

    name: str
    weight: float
    template: str  # string.Template over FIELDS and SCALE_FIELDS
    scale: Scale = Scale()
    verdict: VerdictKind = VerdictKind.JSON
    optional: bool = False  # train without it when its judge fails
    agent: AgentSpec | None = None  # a judge with tools in a sandbox (`AgentSpec`)

    def __post_init__(self) -> None:
        if self.agent is not None and self.verdict is not VerdictKind.JSON:
            raise ValueError(f"dimension {self.name!r}: an agentic judge's verdict is read "
                             "from the JSON of its final answer (verdict json)")
        allowed = set(FIELDS) | set(SCALE_FIELDS)
        template = string.Template(self.template)
        if not template.is_valid():
            raise ValueError(f"dimension {self.name!r}: the template has a '$' that names "
                             "nothing (write '$$' for a dollar sign)")
        unknown = sorted(set(template.get_identifiers()) - allowed)
        if unknown:
            raise ValueError(f"dimension {self.name!r}: the template names "
                             f"{', '.join('$' + u for u in unknown)}; it may name "
                             f"{', '.join('$' + a for a in sorted(allowed))}")

    def render(self, seen: JudgeInput) -> str:
        """The judge's prompt for one trajectory (exactly the template, filled)."""
        return string.Template(self.template).substitute(
            task=seen.task, answer=seen.answer, trajectory=seen.trajectory, diff=seen.diff,
            low=self.scale.low, high=self.scale.high, dimension=self.name)


@dataclass(frozen=True, slots=True)
class Rubric:
    """Dimensions, weights and gates (module docstring)."""

    verified: tuple[VerifiedDimension, ...] = ()
    judged: tuple[JudgedDimension, ...] = ()
    gated_reward: float = 0.0  # the reward when a gate is not passed

    @property
    def needs_work_tree(self) -> bool:
        """Whether a judge is shown the trajectory's change (a template names $diff)
        or works in its work tree (an agentic judge)."""
        return any(d.agent is not None
                   or "diff" in string.Template(d.template).get_identifiers()
                   for d in self.judged)

    def __post_init__(self) -> None:
        names = [d.name for d in self.verified] + [d.name for d in self.judged]
        if not names:
            raise ValueError("a rubric needs at least one dimension")
        if len(set(names)) != len(names):
            raise ValueError(f"dimension names must be unique: {names}")

    def measured(self, reward: float | None, metrics: Mapping[str, float]
                 ) -> dict[str, float | None]:
        """The verified dimensions' values from a suite's reward and metrics (None
        where the suite did not measure it)."""
        return {d.name: reward if d.metric == "reward" else metrics.get(d.metric)
                for d in self.verified}

    def gate_failed(self, measured: Mapping[str, float | None]) -> str | None:
        """Why a gate is not passed (a verified value below its gate, or missing), or
        None: every gate passes and the judges are asked."""
        for d in self.verified:
            if d.gate is None:
                continue
            value = measured.get(d.name)
            if value is None or value < d.gate:
                return f"gate {d.name} not passed ({value} < {d.gate})"
        return None


def aggregate(rubric: Rubric, measured: Mapping[str, float | None],
              judgements: Sequence[Judgement]) -> float | None:
    """The scalar reward (module docstring); None when it cannot be computed: a
    required judged dimension without a verdict, or a verified one not measured."""
    if rubric.gate_failed(measured) is not None:
        return rubric.gated_reward
    if any(j.missing for j in judgements):
        return None
    weights = {d.name: d.weight for d in rubric.verified}
    weights.update({d.name: d.weight for d in rubric.judged})
    values: dict[str, float] = {}
    for name, value in measured.items():
        if value is None:
            return None
        values[name] = value
    for j in judgements:
        if j.status is JudgementStatus.JUDGED and j.value is not None:
            values[j.dimension] = j.value
    present = sum(weights[name] for name in values)
    if present == 0:
        return None
    scale = sum(weights.values()) / present
    total: float = sum(weights[name] * value for name, value in values.items()) * scale
    return total
