"""A harness that tries to get more than its session (run by the service for
test_service_harness_privilege.py, through the gateway; httpx only, nothing of
treadle).

With only what its environment holds (OPENAI_API_KEY, OPENAI_BASE_URL and what
else it inherits) it tries every route of the service it was handed a list of
($PROBE_ROUTES: method, path, body), and `end` of another session; then it asks
the model, and runs the command the model writes (it runs this script with `probe`,
as $PROBE_PYTHON and $PROBE_SCRIPT say) — in its own environment like
mini-swe-agent's local environment ($PROBE_SANDBOX=none), or in bubblewrap
without network or any of the host but the system's and the interpreter's
directories (=bwrap). The command tries the routes again and writes a reward of
its own where the reward file is. Every attempt's answer goes to $PROBE_REPORT
(one JSON object a line).

With $PROBE_HOLD it waits, after its attempts and before it asks the model, until
that file exists. Where the job scores by its reward file ($PROBE_OWN_REWARD set), the harness
writes its own reward before it runs the model's command: a command that could
reach the file would overwrite it. Its answer is the model's second reply.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import httpx

COMMAND_REWARD = 0.75  # what a model-written command writes as its own reward


def report(entry: dict[str, Any]) -> None:
    with open(os.environ["PROBE_REPORT"], "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def attempts(who: str) -> None:
    """Every route, with the key this process's environment holds."""
    key = os.environ.get("OPENAI_API_KEY", "")
    base = os.environ.get("OPENAI_BASE_URL", "")
    root = base.split("/v1/sessions/")[0]
    with open(os.environ["PROBE_ROUTES"], encoding="utf-8") as f:
        routes = json.load(f)
    own = os.environ.get("TREADLE_SESSION_ID", "")
    # trust_env off: a sandbox without /etc/ssl must not stop it before it tries.
    with httpx.Client(base_url=root, timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {key}"}) as client:
        for method, template, body in routes:
            path = template.replace("{own_session}", own)
            try:
                status: int | str = client.request(method, path, json=body).status_code
            except httpx.TransportError as e:  # no network (a sandboxed command)
                status = f"unreachable: {type(e).__name__}"
            report({"who": who, "route": f"{method} {template}", "status": status})


def reward_file_attempt(who: str) -> None:
    """Write a reward of its own where the harness's reward file is (and where
    treadle read one before it asked the job)."""
    for path in {os.environ.get("PROBE_REWARD_PATH", ""), "reward.json"} - {""}:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"reward": COMMAND_REWARD}))
            outcome = "written"
        except OSError as e:
            outcome = f"refused: {e.strerror}"
        report({"who": who, "reward_file": path, "outcome": outcome})


def probe() -> int:
    """The model-written command's part."""
    report({"who": "command", "environ": dict(os.environ)})
    attempts("command")
    reward_file_attempt("command")
    return 0


def run_command(command: str) -> None:
    """The model's command: in this environment, or in bubblewrap."""
    env = {**os.environ, "PROBE_REWARD_PATH": os.environ.get("TREADLE_REWARD_FILE", "")}
    argv = ["sh", "-c", command]
    if os.environ["PROBE_SANDBOX"] == "bwrap":
        # A fresh /tmp, then the system, the interpreter and this script read-only;
        # the report's folder is the one place it may write (the test reads it).
        # Never the harness's work dir, where the reward file is.
        binds = ["--tmpfs", "/tmp"]
        for path in dict.fromkeys(["/usr", "/lib", "/lib64", "/bin", "/etc/alternatives",
                                   sys.base_prefix, sys.prefix,
                                   os.path.dirname(os.path.abspath(__file__))]):
            binds += ["--ro-bind-try", path, path]
        reports = os.path.dirname(os.environ["PROBE_REPORT"])
        binds += ["--bind", reports, reports]
        setenv = [a for k, v in env.items() for a in ("--setenv", k, v)]
        argv = ["bwrap", *binds, "--dev", "/dev", "--proc", "/proc", "--clearenv", *setenv,
                "--unshare-all", "--die-with-parent", "--new-session", "--chdir", "/tmp",
                *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    report({"who": "harness", "command_exit": done.returncode,
            "command_stderr": done.stderr[-2000:]})


def main() -> int:
    if sys.argv[1:] == ["probe"]:
        return probe()
    task = json.loads(sys.stdin.read())
    report({"who": "harness", "environ": dict(os.environ)})
    attempts("harness")
    hold = os.environ.get("PROBE_HOLD")
    while hold and not os.path.exists(hold):  # the test looks at the open session
        time.sleep(0.05)
    if os.environ["PROBE_SANDBOX"] == "bwrap" and not shutil.which("bwrap"):
        return 3  # no sandbox: refuse to run the model's command
    own = os.environ.get("PROBE_OWN_REWARD")
    if own is not None:
        with open(os.environ["TREADLE_REWARD_FILE"], "w", encoding="utf-8") as f:
            f.write(json.dumps({"reward": float(own)}))
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    tools = [{"type": "function", "function": {
        "name": "bash", "parameters": {"type": "object",
                                       "properties": {"command": {"type": "string"}}}}}]
    with httpx.Client(base_url=os.environ["OPENAI_BASE_URL"], timeout=60, headers={
            "authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}) as client:
        first = client.post("/chat/completions", json={
            "model": "policy", "messages": messages, "tools": tools})
        first.raise_for_status()
        message = first.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        run_command(json.loads(call["function"]["arguments"])["command"])
        messages += [message, {"role": "tool", "tool_call_id": call["id"],
                               "content": "done"}]
        second = client.post("/chat/completions", json={
            "model": "policy", "messages": messages, "tools": tools})
        second.raise_for_status()
        answer = second.json()["choices"][0]["message"]["content"]
    with open(os.environ["TREADLE_ANSWER_FILE"], "w", encoding="utf-8") as f:
        f.write(answer or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
