"""Reading a judge's reply: a score on a scale, or a `VerdictError` saying why not.

- `parse_json_verdict`: the last JSON object in the reply that has a ``score`` (a
  fenced ```json block or bare braces; surrounding prose is allowed); the score must
  be a number on the scale; ``reason`` (a string) is kept when given.
- `expected_score`: the expected score under the judge's own distribution at the
  score token: the first reply position whose sampled token is an integer of the
  scale; the probabilities of that position's top alternatives that are integers of
  the scale, renormalised over those integers (`LogprobVerdict.mass` is how much of
  the whole distribution they held). A reply without such a token is unparseable.

`verdict_schema` is the JSON schema a judge's reply is decoded under where its lane
can (structured output): an object with ``score``, one of the scale's integers, and
a short ``reason``; the score's token is then one of the scale's.

Never a default: what cannot be read raises, and the caller retries or gives up.
Limit: a logprob verdict reads one token, so its scale's integers must be single
digits (0..9): a tokenizer may split "10".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.rewards.errors import VerdictError
from treadle.rewards.rubric import Scale

REASON_CHARS = 300  # the longest reason a decoded verdict may give


def verdict_schema(scale: Scale) -> dict[str, Any]:
    """The JSON schema of a verdict on `scale` (module docstring)."""
    return {"type": "object", "additionalProperties": False, "required": ["score", "reason"],
            "properties": {"score": {"enum": list(range(scale.low, scale.high + 1))},
                           "reason": {"type": "string", "maxLength": REASON_CHARS}}}


@dataclass(frozen=True, slots=True)
class Verdict:
    score: float  # on the scale
    reason: str  # the judge's own words ("" when it gave none)


def parse_json_verdict(text: str, scale: Scale) -> Verdict:
    """The verdict of a reply that ends with a JSON object (module docstring)."""
    decoder = json.JSONDecoder()
    found: dict[str, object] | None = None
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and "score" in value:
            found = value
    if found is None:
        raise VerdictError(f"no JSON object with a score in the reply: {text[-200:]!r}")
    score = found["score"]
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise VerdictError(f"score {score!r:.40} is not a number")
    if not scale.holds(score):
        raise VerdictError(f"score {score} is off the scale {scale.low}..{scale.high}")
    reason = found.get("reason", "")
    return Verdict(float(score), reason if isinstance(reason, str) else json.dumps(reason))


@dataclass(frozen=True, slots=True)
class LogprobVerdict:
    score: float  # the expected score
    position: int  # the reply position of the score token
    mass: float  # probability the scale's integers held there (0..1)


def _integer(token: str, scale: Scale) -> int | None:
    text = token.strip()
    if not text.isdigit() or not text.isascii():
        return None
    value = int(text)
    return value if scale.holds(value) else None


def expected_score(tokens: Sequence[str], top: Sequence[Mapping[str, float]],
                   scale: Scale) -> LogprobVerdict:
    """The expected score at the first score token (module docstring). `tokens`: the
    reply's tokens as text; `top`: each position's top alternatives, text -> logprob."""
    if len(top) != len(tokens):
        raise VerdictError(f"{len(top)} positions of top logprobs for {len(tokens)} tokens")
    for position, token in enumerate(tokens):
        if _integer(token, scale) is None:
            continue
        probs: dict[int, float] = {}
        for alt, logprob in top[position].items():
            value = _integer(alt, scale)
            if value is not None and math.isfinite(logprob):
                # Tokens that strip to one integer (" 4" and "4") add up.
                probs[value] = probs.get(value, 0.0) + math.exp(logprob)
        mass = sum(probs.values())
        if mass <= 0.0:
            raise VerdictError(f"position {position}: no top logprob of a score token "
                               f"(top: {list(top[position])[:8]})")
        return LogprobVerdict(sum(v * p for v, p in probs.items()) / mass, position,
                              min(mass, 1.0))
    raise VerdictError(f"no score token ({scale.low}..{scale.high}) in the reply: "
                       f"{''.join(tokens)[-200:]!r}")
