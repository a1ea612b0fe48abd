"""A small agent harness for math tasks, written against the OpenAI API only.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python -m treadle.examples.math_harness < task.json

It is what any harness is to treadle: a program that reads a task, calls
``chat.completions`` with tools until the model answers, and runs the tools itself.
It imports nothing of treadle. It reads the task (``{"prompt", "tools"?}``) from
stdin, offers the model a ``python`` tool (each program run in bubblewrap, with
nothing of the host but the system's and the interpreter's directories) and a
``submit_answer`` tool,
and ends when the model submits, answers without a tool, or after `MAX_CALLS`
calls. It writes the answer to ``$TREADLE_ANSWER_FILE`` when treadle runs it (else
prints it), and exits 0: how good the answer is, the suite's verifier decides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

from openai import OpenAI

MAX_CALLS = 4
TOOLS = [
    {"type": "function", "function": {
        "name": "python", "description": "Run a Python program; returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "submit_answer", "description": "Submit the final answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                       "required": ["answer"]}}},
]


def run_python(code: str) -> str:
    """The program's output (10 s at most), run in bubblewrap: no network, no
    environment, only the system's and the interpreter's directories (read-only) —
    not the host's other files. Without bwrap it is refused, not run unsandboxed."""
    if not shutil.which("bwrap"):
        return "error: no sandbox (bubblewrap) on this machine to run programs in"
    # The fresh /tmp first, the binds after: bwrap mounts in order, so an interpreter
    # under /tmp (a checkout or a virtualenv there) is bound on top of it, not hidden.
    argv = ["bwrap", "--tmpfs", "/tmp", "--dev", "/dev", "--proc", "/proc"]
    for path in dict.fromkeys(["/usr", "/lib", "/lib64", "/bin", "/etc/alternatives",
                               sys.base_prefix, sys.prefix]):
        argv += ["--ro-bind-try", path, path]
    argv += ["--clearenv", "--unshare-all", "--die-with-parent", "--new-session",
             sys.executable, "-I", "-c", code]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "error: the program ran for more than 10 s"
    # Without the trailing newline print() leaves, as treadle's own python tool shows
    # output: the demo's model learnt from such transcripts, and a stray blank line
    # after the number is enough to garble the answer it copies from it.
    return (done.stdout + done.stderr).rstrip("\n")[-2000:] or "(no output)"


def solve(client: OpenAI, prompt: str, tools: list[dict[str, Any]]) -> str | None:
    """The model's answer to `prompt`, or None if it gave none."""
    messages: list[Any] = [{"role": "user", "content": prompt}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages,
                                               tools=tools)  # type: ignore[arg-type]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        calls = [c for c in message.tool_calls or [] if c.type == "function"]
        if not calls:
            return message.content
        for call in calls:
            name = call.function.name
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                args = {}
            if name == "submit_answer":
                return str(args.get("answer", ""))
            result = (run_python(str(args.get("code", ""))) if name == "python"
                      else f"error: there is no tool {name!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def main() -> int:
    task = json.loads(sys.stdin.read() or os.environ.get("TREADLE_TASK", "{}"))
    client = OpenAI(max_retries=2)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    answer = solve(client, task["prompt"], task.get("tools") or TOOLS)
    out = os.environ.get("TREADLE_ANSWER_FILE")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(answer or "")
    else:
        print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
