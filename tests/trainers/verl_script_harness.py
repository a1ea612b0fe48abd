"""A harness for the verl adapter's tests (run by the service, through its gateway):
it answers with the model's first reply, and how many segments its trajectory gets
depends on the task's question.

- a question containing "edit": a second call whose first message differs from the
  first call's (the harness rewrote its prompt), which the gateway records as a new
  token segment ("system_changed"): the trajectory has two segments;
- one containing "crash": exits 3 before any call (an infrastructure failure);
- any other: two calls of one conversation (the second adds the first reply and a
  user's question), one segment whose response has the question at mask 0.

It writes the last reply's text to $TREADLE_ANSWER_FILE for the suite to score, and
uses httpx only (what the service's environment has).
"""

from __future__ import annotations

import json
import os
import sys

import httpx


def chat(client: httpx.Client, messages: list[dict[str, str]]) -> str:
    reply = client.post("/chat/completions", json={"model": "policy", "messages": messages})
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["message"]["content"] or "")


def main() -> int:
    task = json.loads(sys.stdin.read() or os.environ.get("TREADLE_TASK", "{}"))
    prompt = str(task["prompt"] if isinstance(task["prompt"], str) else
                 task["prompt"][-1]["content"])
    if "crash" in prompt:
        sys.stderr.write("this task crashes the harness\n")
        return 3
    with httpx.Client(base_url=os.environ["OPENAI_BASE_URL"], timeout=60,
                      headers={"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
                      ) as client:
        messages = [{"role": "user", "content": prompt}]
        answer = chat(client, messages)
        if "edit" in prompt:
            answer = chat(client, [{"role": "system", "content": "Answer briefly."},
                                   *messages])
        else:  # the conversation goes on: one segment, the question between at mask 0
            answer = chat(client, [*messages, {"role": "assistant", "content": answer},
                                   {"role": "user", "content": "Are you sure?"}])
    with open(os.environ["TREADLE_ANSWER_FILE"], "w", encoding="utf-8") as f:
        f.write(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
