"""The records verl's agent loop should get for a step, built without treadle's converter.

tests/trainers/verl_script.py batches these with verl's own agent loop worker and
compares the result with `TreadleAgentLoopManager`'s DataProto, tensor by tensor. They
are built here from the job's trajectory records as the service streams them (plain
JSON, read with httpx: docs/service.md, docs/store.md), following the rules that
docs/trainers.md and the `treadle.client.verl` docstring state — never through
`treadle.client` (`step_records`, `to_verl`, `training_sequences`), which is the code
under test:

- the rows of one verl ``uid`` are the samples of group ``{job}/{uid}``, repetition
  0, 1, ... in row order;
- a row gives a record per segment of its trajectory ("all") or its last only
  ("last"); a response is cut at verl's ``response_length``;
- a frozen sub-agent, an infrastructure failure and an aborted run train nothing:
  mask and logprobs all 0, reward the mean of its group's trained rewards (0.0 when
  none trained), ``treadle_excluded`` saying why; one without tokens is one empty
  record;
- a trajectory its rubric's judges gave no verdict on a required dimension (a
  "failed" judgement that is not optional) trains nothing either, its reason
  ``unjudged: <dimension>: <the judgement's reason>``;
- ``reward_extra_info`` has the reward parts of the trained rows and their rubric's
  dimensions (a dimension's value over a metric of its name), NaN where a row lacks
  one or its judge gave no verdict.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any
from urllib.parse import quote

import httpx


def wire_records(url: str, token: str | None, job_id: str) -> list[dict[str, Any]]:
    """The job's trajectory records, as the service streams them (the job has ended)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(f"{url}/v1/jobs/{quote(job_id, safe='')}/trajectories",
                      params={"follow": "false"}, headers=headers, timeout=60)
    reply.raise_for_status()
    lines = [json.loads(line) for line in reply.text.splitlines() if line.strip()]
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    return [line["trajectory"] for line in lines]


def why_excluded(record: dict[str, Any]) -> str | None:
    """Why a trajectory trains nothing, in the words docs/client.md gives, or None."""
    if not record["trainable"]:
        parent = record["parent_id"]
        return "frozen" if parent is None else f"frozen sub-agent (of {parent})"
    if record["status"] == "error":
        return f"infra_failure ({record['failure_stage']}): {record['reason']}"
    if record["status"] == "aborted":
        return f"aborted: {record['reason']}"
    missing = [j for j in record["judgements"] if j["status"] == "failed" and not j["optional"]]
    if missing:
        return "unjudged: " + "; ".join(f"{j['dimension']}: {j['reason']}" for j in missing)
    return None


def expected_records(job_id: str, uids: list[str], trajectories: list[dict[str, Any]],
                     segments: str, response_length: int
                     ) -> tuple[list[dict[str, Any]], list[int]]:
    """(AgentLoopOutput fields per record, the input row of each) for a step whose
    rows have these `uids`, from the job's trajectory records."""
    by_slot = {(t["group_id"], t["repetition"]): t for t in trajectories}
    taken: Counter[str] = Counter()
    rows = []
    for uid in uids:
        rows.append(by_slot[(f"{job_id}/{uid}", taken[uid])])
        taken[uid] += 1
    trained: dict[str, list[float]] = {}
    for t in rows:
        if why_excluded(t) is None:
            trained.setdefault(t["group_id"], []).append(t["reward"])
    parts = sorted({name for t in rows if why_excluded(t) is None
                    for name in (*t["metrics"], *t["rewards"])})
    records, where = [], []
    for row, t in enumerate(rows):
        why = why_excluded(t)
        empty = {"prompt_ids": [], "response_ids": [], "loss_mask": [], "logprobs": [],
                 "policy_versions": []}
        kept = t["segments"] or [empty]
        chosen = range(len(kept)) if segments == "all" else [len(kept) - 1]
        scores = trained.get(t["group_id"], [])
        for index in chosen:
            s = kept[index]
            response = s["response_ids"][:response_length]
            n = len(response)
            records.append({
                "prompt_ids": s["prompt_ids"],
                "response_ids": response,
                "response_mask": s["loss_mask"][:n] if why is None else [0] * n,
                "response_logprobs": s["logprobs"][:n] if why is None else [0.0] * n,
                "reward_score": t["reward"] if why is None else
                sum(scores) / len(scores) if scores else 0.0,
                "num_turns": 1 + len(t["turns"]) + sum(
                    1 for turn in t["turns"] if turn["tool_call"] is not None),
                "metrics": {"generate_sequences": t["timings"]["llm_s"],
                            "tool_calls": t["timings"]["tool_s"], "num_preempted": -1},
                "extra_fields": {
                    "reward_extra_info": {name: _part(t, name) for name in parts},
                    "treadle_trajectory_id": t["trajectory_id"],
                    "treadle_group_id": t["group_id"],
                    "treadle_task_id": t["task_id"],
                    "treadle_repetition": t["repetition"],
                    "treadle_status": t["status"],
                    "treadle_segment_index": index,
                    "treadle_num_segments": len(kept),
                    "treadle_policy_versions": s["policy_versions"][:n],
                    # as the record (v4) states them
                    "treadle_policy_span": t["policy_span"],
                    "treadle_kv_across_updates": t["kv_across_updates"],
                    "treadle_excluded": why,
                },
            })
            where.append(row)
    return records, where


def _part(t: dict[str, Any], name: str) -> float:
    value = t["rewards"][name] if name in t["rewards"] else t["metrics"].get(name)
    return math.nan if value is None else value
