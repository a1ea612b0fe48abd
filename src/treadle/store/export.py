"""Export a job's results: JSONL (the records) and Parquet (one row per segment).

JSONL: one trajectory record (`treadle.store.record`) per line, in delivery order;
line n holds seq n. `trajectory_from_record(json.loads(line))` reads a line back.
The records are written as stored: a job stored before record version 2 keeps its
version 1 lines (the reader reads both).

Parquet: one row per *token segment*, so that each row is one training sequence
(most trajectories have one segment; an edited context gives several). A
trajectory without segments (simulated, or failed before its first token) still
gets one row, with ``segment_index`` null and empty token lists, so every delivered
trajectory is in the file. Rows are in delivery order, a trajectory's rows together
in segment order. Columns:

    seq              int64    delivery number of the trajectory
    trajectory_id    string   (and group_id, task_id: string; repetition: int64)
    status           string   TrajectoryStatus value; reason, failure_stage: string?
    infra_failure    bool     status == "error": drop it from training
    reward           double?  null when unscored and for every "error"
    reward_source    string?  what scored it (verifier, exit_code, reward_file, owner)
    metrics          map<string, double>
    attempt, prompt_tokens, output_tokens, num_turns          int64
    llm_s, tool_s, queue_s  double; started_at, finished_at  double?
    turns_json       string   the record's "turns" array as JSON
    parent_id        string?  the trajectory it is a sub-agent of; null for none
    children         list<string>  the sub-agent trajectories it started
    trainable        bool     false for a frozen sub-agent (never trained)
    metadata_json    string   the record's "metadata" object as JSON
    policy_span      list<int64>?  [oldest, newest] version that sampled its tokens
    kv_across_updates string  recompute | keep: its KV after a weight update
    rewards          map<string, double?>  a rubric's reward vector (null: no verdict)
    judgements_json  string   the record's "judgements" array as JSON
    flagged          bool     a required judged dimension has no verdict: unscored,
                              left out of training
    resumed_json     string   the record's "resumed" array as JSON (the restarts it
                              survived and where each resumed)
    segment_index    int32?   0-based; null for a trajectory without segments
    num_segments     int32    segments of the trajectory
    segment_start_turn    int32?   the turn whose context the segment begins
    segment_start_reason  string?  why it began ("start" for the first); both null
                                   for a trajectory without segments
    prompt_ids       list<int32>   the segment's token lists, as in the record
    response_ids     list<int32>
    loss_mask        list<int8>
    logprobs         list<double>  (double, not float: the engine's values exactly)
    policy_versions  list<int64>

Every row is of record version 6 (the file's ``treadle.record_version``): an older
record is read and written again first, so its new columns hold the defaults.
`read_parquet` turns a file back into `Trajectory` objects (through the strict
record reader), so an export can be checked against the store; a file written
before version 6 (without `resumed_json`), version 5 (without `rewards`,
`judgements_json` and `flagged` either), version 4
(without `policy_span` and `kv_across_updates` either), version 3
(without `reward_source` either) or version 2 (without the sub-agent and
segment-start columns either) reads too.
`write_parquet` writes the same file from (seq, record) pairs, e.g. a client's
stream of a job (`treadle run` does). Both exports read the store a page at a time
and Parquet writes a row group per page: memory is one page, whatever the job's
size. pyarrow is needed for Parquet only (extra
``treadle[store]``); it is imported when a Parquet function is called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from treadle.store.db import Store
from treadle.store.errors import RecordError
from treadle.store.record import (
    RECORD_VERSION,
    SEGMENT_FIELDS,
    TIMING_FIELDS,
    trajectory_from_record,
    trajectory_to_record,
)
from treadle.types import Trajectory

if TYPE_CHECKING:
    import pyarrow as pa

# Columns copied as they are from the record's top level.
_COPIED = ("trajectory_id", "group_id", "repetition", "task_id", "status", "reason",
           "failure_stage", "infra_failure", "reward", "attempt", "prompt_tokens",
           "output_tokens")  # (and, from version 3, reward_source)
# Columns a file exported before record version 2 lacks.
_V2_COLUMNS = ("parent_id", "children", "trainable", "metadata_json", "segment_start_turn",
               "segment_start_reason")
_V3_COLUMNS = ("reward_source",)  # and before version 3
_V4_COLUMNS = ("policy_span", "kv_across_updates")  # and before version 4
_V5_COLUMNS = ("rewards", "judgements_json", "flagged")  # and before version 5
_V6_COLUMNS = ("resumed_json",)  # and before version 6


def export_jsonl(store: Store, job_id: str, path: str | os.PathLike[str],
                 page_size: int = 256) -> int:
    """Write the job's results to `path`, one record per line; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for delivery in store.iter_results(job_id, page_size=page_size):
            f.write(delivery.record_json + "\n")
            n += 1
    return n


def parquet_schema() -> pa.Schema:
    """The Parquet export's schema (see the module docstring)."""
    import pyarrow as pa

    opt_str, f64, i64 = pa.string(), pa.float64(), pa.int64()
    fields: list[pa.Field[Any]] = [
        pa.field("seq", i64, nullable=False),
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("repetition", i64, nullable=False),
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("reason", opt_str),
        pa.field("failure_stage", opt_str),
        pa.field("infra_failure", pa.bool_(), nullable=False),
        pa.field("reward", f64),
        pa.field("reward_source", opt_str),
        pa.field("metrics", pa.map_(pa.string(), f64), nullable=False),
        pa.field("attempt", i64, nullable=False),
        pa.field("prompt_tokens", i64, nullable=False),
        pa.field("output_tokens", i64, nullable=False),
        pa.field("num_turns", i64, nullable=False),
        pa.field("llm_s", f64, nullable=False),
        pa.field("tool_s", f64, nullable=False),
        pa.field("queue_s", f64, nullable=False),
        pa.field("started_at", f64),
        pa.field("finished_at", f64),
        pa.field("turns_json", pa.string(), nullable=False),
        pa.field("parent_id", opt_str),
        pa.field("children", pa.list_(pa.string()), nullable=False),
        pa.field("trainable", pa.bool_(), nullable=False),
        pa.field("metadata_json", pa.string(), nullable=False),
        pa.field("policy_span", pa.list_(i64)),
        pa.field("kv_across_updates", pa.string(), nullable=False),
        pa.field("rewards", pa.map_(pa.string(), f64), nullable=False),
        pa.field("judgements_json", pa.string(), nullable=False),
        pa.field("flagged", pa.bool_(), nullable=False),
        pa.field("resumed_json", pa.string(), nullable=False),
        pa.field("segment_index", pa.int32()),
        pa.field("num_segments", pa.int32(), nullable=False),
        pa.field("segment_start_turn", pa.int32()),
        pa.field("segment_start_reason", opt_str),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("logprobs", pa.list_(f64), nullable=False),
        pa.field("policy_versions", pa.list_(i64), nullable=False),
    ]
    return pa.schema(fields, metadata={
        "treadle.record_version": str(RECORD_VERSION),
        "treadle.layout": "one row per token segment"})


def export_parquet(store: Store, job_id: str, path: str | os.PathLike[str],
                   page_size: int = 256) -> int:
    """Write the job's results to `path` as Parquet; returns how many trajectories."""
    return write_parquet(((d.seq, d.record()) for d in
                          store.iter_results(job_id, page_size=page_size)), path, page_size)


def write_parquet(deliveries: Iterable[tuple[int, Mapping[str, Any]]],
                  path: str | os.PathLike[str], page_size: int = 256) -> int:
    """Write (seq, trajectory record) pairs to `path` as Parquet, the layout above, a
    row group per `page_size` trajectories; returns how many. `deliveries` is read
    lazily (a client's stream can feed it as trajectories arrive)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    n = 0
    page: list[tuple[int, Mapping[str, Any]]] = []

    def flush() -> None:
        columns: dict[str, list[Any]] = {name: [] for name in schema.names}
        for seq, record in page:
            _add_rows(columns, seq, record)
        writer.write_table(pa.table(columns, schema=schema))
        page.clear()

    with pq.ParquetWriter(str(path), schema) as writer:
        for delivery in deliveries:
            page.append(delivery)
            n += 1
            if len(page) >= page_size:
                flush()
        if page or n == 0:
            flush()
    return n


def read_parquet(path: str | os.PathLike[str]) -> Iterator[tuple[int, Trajectory]]:
    """(seq, trajectory) for every trajectory in an export, in file order.

    Reads a row group at a time; a trajectory's rows must be adjacent (as written).
    """
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for batch in pq.ParquetFile(str(path)).iter_batches():
        for row in batch.to_pylist():
            if rows and row["seq"] != rows[0]["seq"]:
                yield rows[0]["seq"], _trajectory(rows)
                rows = []
            rows.append(row)
    if rows:
        yield rows[0]["seq"], _trajectory(rows)


def _add_rows(columns: dict[str, list[Any]], seq: int, record: Mapping[str, Any]) -> None:
    if record.get("version") != RECORD_VERSION:
        # An older record (a job stored before this version) lacks columns the file
        # has; the reader knows its defaults, so it is upgraded through the reader.
        record = trajectory_to_record(trajectory_from_record(record))
    per_trajectory: dict[str, Any] = {
        name: record[name] for name in (*_COPIED, *_V3_COLUMNS, *_V4_COLUMNS)}
    per_trajectory.update(record["timings"])
    per_trajectory.update({
        "seq": seq,
        "metrics": list(record["metrics"].items()),
        "num_turns": len(record["turns"]),
        "turns_json": _json(record["turns"]),
        "parent_id": record["parent_id"],
        "children": list(record["children"]),
        "trainable": record["trainable"],
        "metadata_json": _json(record["metadata"]),
        "rewards": list(record["rewards"].items()),
        "judgements_json": _json(record["judgements"]),
        "flagged": any(j["status"] == "failed" and not j["optional"]
                       for j in record["judgements"]),
        "num_segments": len(record["segments"]),
        "resumed_json": _json(record["resumed"]),
    })
    for index, segment in enumerate(record["segments"] or [None]):
        for name, value in per_trajectory.items():
            columns[name].append(value)
        columns["segment_index"].append(None if segment is None else index)
        columns["segment_start_turn"].append(None if segment is None else segment["start_turn"])
        columns["segment_start_reason"].append(
            None if segment is None else segment["start_reason"])
        for name in SEGMENT_FIELDS:
            columns[name].append([] if segment is None else segment[name])


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _trajectory(rows: list[dict[str, Any]]) -> Trajectory:
    first = rows[0]
    # A file from before version 2 has none of its columns: its rows are version 1
    # records, which the reader fills with the defaults.
    missing = [name for name in _V2_COLUMNS if name not in first]
    if missing and len(missing) < len(_V2_COLUMNS):
        raise RecordError(f"parquet export: has some of the version 2 columns but not "
                          f"{', '.join(missing)}")
    v2 = not missing
    v3 = v2 and all(name in first for name in _V3_COLUMNS)
    v4 = v3 and all(name in first for name in _V4_COLUMNS)
    v5 = v4 and all(name in first for name in _V5_COLUMNS)
    v6 = v5 and all(name in first for name in _V6_COLUMNS)
    segment_rows = sorted((r for r in rows if r["segment_index"] is not None),
                          key=lambda r: int(r["segment_index"]))
    segments = []
    for r in segment_rows:
        segment = {name: r[name] for name in SEGMENT_FIELDS}
        if v2:
            segment.update(start_turn=r["segment_start_turn"],
                           start_reason=r["segment_start_reason"])
        segments.append(segment)
    record: dict[str, Any] = {name: first[name] for name in _COPIED}
    record.update({
        "version": RECORD_VERSION if v6 else 5 if v5 else 4 if v4 else 3 if v3 else 2 if v2
        else 1,
        "metrics": dict(first["metrics"]),
        "turns": json.loads(first["turns_json"]),
        "timings": {name: first[name] for name in TIMING_FIELDS},
        "segments": segments,
    })
    if v2:
        record.update(parent_id=first["parent_id"], children=first["children"],
                      trainable=first["trainable"],
                      metadata=json.loads(first["metadata_json"]))
    if v3:
        record.update({name: first[name] for name in _V3_COLUMNS})
    if v4:
        record.update({name: first[name] for name in _V4_COLUMNS})
    if v5:
        record.update(rewards=dict(first["rewards"]),
                      judgements=json.loads(first["judgements_json"]))
    if v6:
        record.update(resumed=json.loads(first["resumed_json"]))
    return trajectory_from_record(record)
