"""A small agent harness that works in the task's sandbox through treadle's served tools.

    python -m treadle.examples.tools_harness < task.json   # run by treadle

Where treadle serves a task's tools to a harness (a task whose suite needs a sandbox,
e.g. a ``swe-images`` instance in its image), it says where in
``$TREADLE_TOOLS_URL``. This harness lists them there (``GET``: OpenAI function
specs), offers them to the model, and runs each call the model writes there
(``POST <url>/<name>``, the arguments as the JSON body, the session's key as
bearer): the commands run in the task's sandbox, not on this machine. A call's
answer holds ``observation``, the text to show the model. It stops when a call ends
the episode (``submit_answer``), when the model answers without a call, or after
`MAX_CALLS` model calls; it writes the answer to ``$TREADLE_ANSWER_FILE`` and exits
0: how good the work is, the suite's verifier decides, in that same sandbox.

It imports nothing of treadle: the OpenAI SDK for the model, httpx for the tools.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
from openai import OpenAI

MAX_CALLS = 16


def call_tool(tools: httpx.Client, url: str, name: str, arguments: str) -> dict[str, Any]:
    """Run one tool call as the model wrote it: its arguments go as they are (what
    the tool cannot read is its error result, for the model to see)."""
    reply = tools.post(f"{url}/{name}", content=arguments.encode(),
                       headers={"content-type": "application/json"})
    if reply.status_code == 404:  # a tool the task does not have
        return {"observation": f"[error] no tool {name!r}", "done": False}
    reply.raise_for_status()
    answer: dict[str, Any] = reply.json()
    return answer


def solve(model: OpenAI, tools: httpx.Client, url: str, prompt: str) -> str | None:
    """The model's work on `prompt` with the tools served at `url`; its final answer."""
    specs = tools.get(url).raise_for_status().json()
    print("tools:", ", ".join(s["function"]["name"] for s in specs), file=sys.stderr)
    messages: list[Any] = [{"role": "user", "content": prompt}]
    for _ in range(MAX_CALLS):
        reply = model.chat.completions.create(model="policy", messages=messages,
                                              tools=specs)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        calls = [c for c in message.tool_calls or [] if c.type == "function"]
        if not calls:
            return message.content
        for call in calls:
            result = call_tool(tools, url, call.function.name,
                               call.function.arguments or "{}")
            if result.get("done"):
                return str(result.get("final_answer") or "")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": result["observation"]})
    return None


def main() -> int:
    task = json.loads(sys.stdin.read() or os.environ.get("TREADLE_TASK", "{}"))
    url = os.environ.get("TREADLE_TOOLS_URL")
    if url is None:
        print("no tools are served for this task (TREADLE_TOOLS_URL is not set)",
              file=sys.stderr)
        return 2
    model = OpenAI(max_retries=2)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    key = os.environ["OPENAI_API_KEY"]  # the session's key opens its tools too
    with httpx.Client(headers={"authorization": f"Bearer {key}"}, timeout=600) as tools:
        answer = solve(model, tools, url, task["prompt"])
    out = os.environ.get("TREADLE_ANSWER_FILE")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(answer or "")
    else:
        print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
