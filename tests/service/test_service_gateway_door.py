"""`routes.openai.ChatDoor`, the chat route's way past FastAPI's routing, answers as
the route itself does. A request with its bearer header twice is one the door leaves
to the route (the gate and the route read the key alike either way), so the same
calls are made both ways on twin sessions and their answers compared."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_service_gateway import TOKEN, TOOLS, Gateway
from test_service_gateway import gateway as gateway  # the fixture, a scripted engine

pytestmark = [pytest.mark.integration]
KEY = ("authorization", f"Bearer {TOKEN}")


def _answer(http: httpx.Client, base: str, body: bytes, twice: bool) -> tuple[int, str, Any]:
    headers = [KEY, KEY] if twice else [KEY]
    reply = http.post(f"{base}/chat/completions", content=body,
                      headers=[*headers, ("content-type", "application/json")])
    data = reply.json()
    if isinstance(data, dict):  # what names the session or the time differs by right
        data.pop("id", None)
        data.pop("created", None)
    return reply.status_code, reply.headers["content-type"], data


def test_the_door_answers_every_call_as_the_route_does(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "what is 1 + 2?"}]
    good = httpx.Request("POST", "/", json={"model": "policy", "messages": messages,
                                            "tools": TOOLS, "max_tokens": 8}).content
    bodies = [good, b"{not json", b'{"model": "policy", "messages": [], "n": 2}',
              b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}]}']
    answers: dict[bool, list[tuple[int, str, Any]]] = {}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for twice in (False, True):
            info, _ = gateway.session()
            base = "/" + info["base_url"].split("/", 3)[3]
            gateway.reply("three")
            answers[twice] = [_answer(http, base, body, twice) for body in bodies]
            answers[twice].append(_answer(http, base.replace(info["session_id"], "nope"),
                                          good, twice))
    assert answers[False] == answers[True]
    assert [status for status, _, _ in answers[False]] == [200, 400, 400, 400, 404]
    assert answers[False][0][2]["choices"][0]["message"]["content"] == "three"
