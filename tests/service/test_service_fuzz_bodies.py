"""Bodies no schema generator writes, fuzzed with hypothesis over real HTTP: numbers
that are not finite or not doubles at all, lone surrogates, huge arrays and deep
nesting, and every option of every built-in suite given any JSON value.

The schema fuzz (test_service_fuzz.py) writes only JSON its schema can describe;
Python's own parser takes more (``NaN``, ``Infinity``, ``1e400``, ``"\\ud800"``),
and each of those once reached past validation and came back as a 500. Every
answer here must be below 500 and small (an error echoes a bounded part of what it
was sent); a job that gets in is cancelled at once. Examples are derandomized.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from treadle.envs.registry import _BUILTIN
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "fuzz-bodies"
AUTH = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
MAX_REPLY_BYTES = 64 << 10
EXAMPLES = 300


def _suite_options() -> dict[str, list[str]]:
    """Every keyword each built-in suite's constructor takes."""
    out = {}
    for name, target in _BUILTIN.items():
        module, _, attribute = target.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
        out[name] = [p for p in inspect.signature(factory).parameters if p != "self"]
    return out


SUITES = _suite_options()
_numbers = st.one_of(st.integers(min_value=-(1 << 70), max_value=1 << 70),
                     st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([1e308, -1e308, 5e-324]))
# Any code point, surrogates (category Cs) included.
_text = st.text(st.characters(codec=None, categories=None), max_size=40)
_leaves = st.one_of(st.none(), st.booleans(), _numbers, _text)
_json = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(_text, inner, max_size=6)), max_leaves=30)


@st.composite
def _suite_job(draw: st.DrawFn) -> dict[str, Any]:
    suite = draw(st.sampled_from(sorted(SUITES)))
    names = SUITES[suite]
    options = draw(st.dictionaries(st.sampled_from(names) if names else _text, _json,
                                   max_size=4))
    if suite == "nemo_gym" and draw(st.booleans()):
        # A base URL it accepts, so that its rows reach the constructor's checks.
        options["base_url"] = "http://127.0.0.1:9"
    tasks: dict[str, Any] = {"suite": suite, "options": options}
    if draw(st.booleans()):
        tasks["count"] = draw(st.one_of(st.integers(1, 4), _json))
    else:
        tasks["tasks"] = draw(st.lists(st.dictionaries(_text, _json, max_size=4), max_size=3))
    body = {"tasks": tasks, "samples_per_task": draw(st.one_of(st.just(1), _json))}
    if draw(st.booleans()):
        body["sampling"] = {"temperature": draw(_numbers), "seed": draw(_numbers)}
    return body


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


_huge = st.sampled_from([
    {"tasks": {"suite": "math", "count": 1, "options": {"x": _nested(900)}}},
    {"tasks": {"workload": "math", "trajectories": 16}, "job_id": _nested(200)},
    {"tasks": {"trace": [{"id": "t", "group": "g", "prompt_tokens": 1, "turns": []}] * 5000}},
    {"tasks": {"suite": "math", "tasks": [{"id": "q", "question": "?", "answer": "1"}] * 5000}},
    {"tasks": {"workload": "math", "trajectories": 16}, "job_id": "x" * 100_000},
])
_bodies = st.one_of(_suite_job(), _json, _huge,
                    st.builds(lambda depth: "[" * depth + "]" * depth, st.integers(1, 5000)))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    work = tmp_path_factory.mktemp("fuzz-bodies")
    build_tokenizer(work / "tok")
    data = work / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text('{"responses_create_params": {"input": "hi"}}\n')
    config = ServiceConfig(db=str(work / "t.db"), token=TOKEN, policy="verl",
                           tokenizer=str(work / "tok"), data_roots=(str(data),),
                           max_body_bytes=4 << 20, engine_wait_s=0.5)
    with running_service(config) as url, httpx.Client(base_url=url, headers=AUTH,
                                                      timeout=120) as c:
        yield c


def _encode(body: Any) -> bytes:
    if isinstance(body, str) and body.startswith("["):
        return body.encode()  # nesting past any parser's depth, written by hand
    # allow_nan writes NaN/Infinity; ensure_ascii writes a lone surrogate as \\udXXX.
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


@given(body=_bodies, path=st.sampled_from(["/v1/jobs", "/v1/rollouts", "/v1/engines",
                                           "/v1/weights/resume"]))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_body_gets_a_5xx_or_a_large_reply(client: httpx.Client, body: Any,
                                             path: str) -> None:
    r = client.post(path, content=_encode(body))
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert len(r.content) <= MAX_REPLY_BYTES, (path, len(r.content))
    if path == "/v1/jobs" and r.status_code == 201:
        assert client.post(f"/v1/jobs/{r.json()['job_id']}/cancel").status_code == 200
