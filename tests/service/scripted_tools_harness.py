"""Test double for a harness that works in the task's sandbox through treadle's served
tools (`TREADLE_TOOLS_URL`), with no model deciding anything: one chat call (a tool
call belongs to a reply), then a fixed script of tool calls.

    python scripted_tools_harness.py   # run by treadle as a harness command

Environment (the test's `Harness.env`): ``SCRIPT_PATCH`` a file whose patch it
applies with `apply_patch` (none: it edits nothing), ``SCRIPT_REPORT`` a directory
where it writes what it saw (``report.json``), ``SCRIPT_THEN`` what it does after:
``exit`` (exit 0, the default), ``crash`` (exit 3 after its calls) or ``hang``
(tell ``SCRIPT_REPORT/ready``, a FIFO, then wait to be killed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import httpx
from openai import OpenAI


def main() -> int:
    report: dict[str, object] = {}
    tools_url = os.environ.get("TREADLE_TOOLS_URL")
    report["tools_url"] = tools_url
    headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    with httpx.Client(headers=headers, timeout=300) as http:
        if tools_url is not None:
            report["before_reply"] = http.post(f"{tools_url}/bash",
                                               json={"command": "true"}).status_code
        reply = OpenAI(max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "fix the issue"}])
        report["reply"] = reply.choices[0].message.content
        if tools_url is not None:
            report["tools"] = [t["function"]["name"] for t in http.get(tools_url).json()]
            patch = os.environ.get("SCRIPT_PATCH")
            if patch:
                applied = http.post(f"{tools_url}/apply_patch",
                                    json={"patch": Path(patch).read_text()}).json()
                report["applied"] = applied
            # What an earlier attempt left in the sandbox, if anything; then a mark.
            report["mark"] = http.post(f"{tools_url}/bash", json={
                "command": "cat .attempt 2>/dev/null || echo fresh; echo worked > .attempt"}
                ).json()["output"].strip()
            ran = http.post(f"{tools_url}/bash",
                            json={"command": "cat /etc/os-release; pwd"}).json()
            report["ran"] = ran
            report["bad_arguments"] = http.post(f"{tools_url}/bash", json={}).json()
            report["not_json"] = http.post(f"{tools_url}/bash", content=b"{nope").json()
            unknown = http.post(f"{tools_url}/no_such_tool", json={})
            report["unknown"] = [unknown.status_code, unknown.json()]
    out = Path(os.environ["SCRIPT_REPORT"])
    (out / "report.json").write_text(json.dumps(report))
    then = os.environ.get("SCRIPT_THEN", "exit")
    if then == "crash":
        sys.stderr.write("scripted crash")
        return 3
    if then == "hang":
        with open(out / "ready", "w") as fifo:  # the test reads it: the run is under way
            fifo.write("ready")
        while True:
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
