"""`treadle bench chaos`: a service under seeded faults, and what its clients got.

    treadle bench chaos --seed 0 --jobs 3 --trajectories 128 --faults 8 --json \\
        --out benchmarks/chaos.json

A `treadle serve` process (emulated engines on `--gpus`, a SQLite file) runs
replayed jobs while clients read them through a faulty network (`faults.FaultyProxy`:
resets, clean cuts mid-line, stalls, half-open connections) and a seeded schedule
of `--faults` process faults lands on it: the service killed -9 and restarted on its
database (also right after a submit, a cancel or during a weight update), the
service stopped and continued (SIGSTOP/SIGCONT), an engine killed or stopped. While
it runs, followers of every job hang up and reconnect again and again, and a weight
update comes now and then; the last job is cancelled halfway.

Afterwards, with the network clean, every invariant is checked and counted:

- lost / duplicated: per reader (`chaos_readers.Follower`, `RawReader`), each of a
  job's planned trajectories handed out once, seqs dense from 1;
- unstable: a seq whose bytes differ between a read during the faults and the final
  one, or between the final stream and the store's own record;
- hung: readers not done by `--deadline`, jobs not terminal, trajectories still
  running or queued, `treadle_trajectories_active` not back to 0;
- misclassified: an error without a failure stage or with treadle's own ("runtime"),
  an aborted trajectory in a job nobody cancelled;
- unexpected log lines: a traceback or an ERROR in the service's log;
- the store: SQLite's integrity_check.

All of them must be 0 (and integrity "ok"). The report also counts the faults
injected by kind and the GPU work redone: tokens the engines sampled (their
`vllm:generation_tokens_total`, read every half second and before each kill) beyond
those delivered in the trajectories (`tokens.regenerated`: the cancelled job's and
the lost attempts'). What restarts cost, beside it:

- `in_flight_at_restarts`: at each kill of the service, the tokens a crash then
  throws away, read just before it: the service's sampled but not yet journaled
  (`treadle_tokens_unjournaled`) and the engines' requests still running
  (`treadle:generation_tokens_in_flight`);
- `discarded_by_resumes`: journaled tokens a resume did not keep (the records'
  `resumed`; all of them with `--resume-from prompt`);
- `regenerated_by_restart`: with restarts the only faults (`--kinds` of kills only,
  one job: nothing cancelled) every regenerated token is theirs, so it is
  `regenerated`, measured apart from the two above; otherwise what restarts threw
  away, `in_flight_at_restarts + discarded_by_resumes`.

Turn-level resume's promise is `regenerated_by_restart <= in_flight_at_restarts`.
Same seed, same schedule of faults; their effects depend on timing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import random
import re
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from treadle.bench.chaos_readers import PATIENT, Follower, HangUps, RawReader
from treadle.bench.chaos_tokens import TOKEN as _TOKEN
from treadle.bench.chaos_tokens import TokenMeter
from treadle.bench.faults import FaultyProxy, ServiceProcess
from treadle.client import RolloutClient, replay_tasks
from treadle.client.errors import ServiceError, ServiceUnavailable
from treadle.reports import log, write_report

Log = Callable[[str], None]
PROCESS_FAULTS = ("service_kill", "service_pause", "engine_kill", "engine_pause",
                  "kill_after_submit", "kill_after_cancel", "kill_during_update")
# Faults after which every regenerated token is a restart's (with nothing cancelled).
_RESTARTS = frozenset({"service_kill", "kill_after_submit", "kill_during_update"})
_EXTRA_TRAJECTORIES = 16  # of each job a fault submits
_UNEXPECTED = re.compile(r"Traceback|\bERROR\b")


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """One chaos run; see the module docstring."""

    seed: int = 0
    jobs: int = 3  # replayed jobs of `trajectories` each (the last one is cancelled)
    trajectories: int = 128  # per job, in groups of 16
    workload: str = "math"
    gpus: int = 2  # of emulated engines
    time_scale: float = 0.05
    policy: str = "treadle"
    followers: int = 2  # Follower readers per job (and as many RawReaders)
    hang_ups: int = 4  # threads of followers that hang up and reconnect
    faults: int = 7  # process faults, spread over the run (7: each kind once)
    fault_gap_s: float = 2.0  # mean real seconds between two process faults
    proxy_fault_share: float = 0.3  # of the readers' connections
    deadline_s: float = 600.0  # readers not done by then are hung
    kinds: tuple[str, ...] = PROCESS_FAULTS  # the process faults drawn from
    resume_from: str = "turn"  # the service's --resume-from

    @property
    def restarts_only(self) -> bool:
        """Every fault is a restart and no job is cancelled (module docstring)."""
        return set(self.kinds) <= _RESTARTS and self.jobs == 1


def run_chaos(config: ChaosConfig, work: Path, say: Log = log) -> dict[str, Any]:
    """Run it in `work` (database, log); the report. See the module docstring."""
    started = time.monotonic()
    rng = random.Random(config.seed)
    # The readers' retries are the point of the run, not news: one line each is noise.
    logging.getLogger("treadle.client").setLevel(logging.ERROR)
    service = ServiceProcess(work / "chaos.db", work / "service.log", _TOKEN,
                             ["--emulate", str(config.gpus), "--time-scale",
                              str(config.time_scale), "--policy", config.policy,
                              "--resume-from", config.resume_from])
    service.start()
    injected: collections.Counter[str] = collections.Counter()
    tokens = TokenMeter(service)
    stop = threading.Event()
    jobs = [f"chaos-{config.seed}-{k}" for k in range(config.jobs)]
    cancelled = {jobs[-1]} if config.jobs > 1 else set()
    with FaultyProxy(service.port, random.Random(rng.random()),
                     fault_share=config.proxy_fault_share) as proxy:
        for k, job in enumerate(jobs):
            _submit(service.url, job, config, seed=config.seed * 100 + k)
        readers: list[Follower | RawReader] = []
        for job in jobs:
            for _ in range(config.followers):
                readers.append(Follower(proxy.url, _TOKEN, job))
                readers.append(RawReader(proxy.url, _TOKEN, job, config.trajectories))
        hang_ups = [HangUps(service.url, _TOKEN, jobs, random.Random(rng.random()))
                    for _ in range(config.hang_ups)]
        threads = [_thread(r.run, stop) for r in [*readers, *hang_ups]]
        threads.append(_thread(tokens.run, stop))
        say(f"chaos: {len(jobs)} jobs x {config.trajectories}, {len(readers)} readers, "
            f"{config.faults} process faults (seed {config.seed})")
        schedule = [(rng.expovariate(1.0 / config.fault_gap_s), kind)
                    for kind in _kinds(config.faults, config.kinds, rng)]
        for n, (gap, kind) in enumerate(schedule):
            time.sleep(gap)  # the schedule's own spacing, not a wait for an event
            extra = _inject(kind, service, tokens, rng, cancelled, config,
                            f"chaos-{config.seed}-extra-{n}")
            jobs += [extra] if extra else []
            injected[kind] += 1
            say(f"chaos: {kind} ({sum(injected.values())}/{config.faults})")
        _cancel(service.url, cancelled)
        deadline = time.monotonic() + config.deadline_s
        for thread in threads[:len(readers)]:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung_readers = sum(t.is_alive() for t in threads[:len(readers)])
        _until_ended(service.url, jobs, deadline)  # the jobs the faults submitted too
        stop.set()
        for thread in threads:
            thread.join(30)
        proxy_faults = dict(proxy.faults)
        connections = proxy.connections
    tokens.read()
    report = _check(config, service, jobs, cancelled, readers, hung_readers)
    service.stop()
    report["integrity_check"] = _integrity(service.db)
    report["unexpected_log_lines"] = _unexpected(service.log)
    report["faults"] = {"process": dict(injected), "network": proxy_faults,
                        "connections": connections,
                        "hang_ups": sum(h.count for h in hang_ups),
                        "service_starts": service.starts}
    report["tokens"] = tokens.summary(report.pop("delivered_tokens"),
                                      report.pop("discarded_tokens"), config.restarts_only)
    report["config"] = asdict(config)
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["ok"] = _ok(report)
    return report


def _kinds(n: int, kinds: tuple[str, ...], rng: random.Random) -> list[str]:
    """`n` process faults: every kind once per round of len(kinds), in a seeded
    order, so that a run of at least that many faults has each kind."""
    out: list[str] = []
    while len(out) < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        out += round_
    return out[:n]


def _thread(target: Callable[[threading.Event], None], stop: threading.Event
            ) -> threading.Thread:
    thread = threading.Thread(target=target, args=(stop,), daemon=True)
    thread.start()
    return thread


def _client(url: str) -> RolloutClient:
    return RolloutClient(url, token=_TOKEN, retry=PATIENT)


def _submit(url: str, job: str, config: ChaosConfig, seed: int,
            trajectories: int | None = None) -> None:
    """Submit until stored: a submit lost with the service is sent again (a 409 then
    says the first one was stored)."""
    with _client(url) as client:
        for _ in range(20):
            try:
                client.submit(tasks=replay_tasks(config.workload,
                                                 trajectories=trajectories or config.trajectories,
                                                 seed=seed), job_id=job)
                return
            except ServiceError as e:
                if e.status == 409:
                    return
                raise
            except ServiceUnavailable:
                continue
    raise RuntimeError(f"job {job} could not be submitted")


def _cancel(url: str, jobs: set[str]) -> None:
    with _client(url) as client:
        for job in jobs:
            for _ in range(20):
                with contextlib.suppress(ServiceUnavailable):
                    client.cancel(job)
                    break


def _inject(kind: str, service: ServiceProcess, tokens: TokenMeter, rng: random.Random,
            cancelled: set[str], config: ChaosConfig, new_job: str) -> str | None:
    """Carry out one process fault; the id of a job it submitted, if it did."""
    submitted = None
    if kind == "service_pause":
        service.pause(rng.uniform(0.5, 3.0))
    elif kind in ("engine_kill", "engine_pause"):
        engines = service.engines()
        if engines:
            pid = rng.choice(engines)
            if kind == "engine_kill":
                tokens.read()
                service.kill_engine(pid)
            else:
                service.pause_engine(pid, rng.uniform(0.5, 3.0))
    else:
        if kind == "kill_after_submit":
            # A small job: its last trajectories must not be what the run waits for.
            _submit(service.url, new_job, config, seed=rng.randrange(1 << 30),
                    trajectories=_EXTRA_TRAJECTORIES)
            submitted = new_job
        elif kind == "kill_after_cancel":
            _cancel(service.url, cancelled)
        elif kind == "kill_during_update":
            version = rng.randrange(1, 1 << 20)
            threading.Thread(target=_update, args=(service.url, version), daemon=True).start()
        with tokens.killing():
            service.kill()
        time.sleep(rng.uniform(0.0, 2.0))  # down for a while, then back on its database
        service.start()
    return submitted


def _until_ended(url: str, jobs: list[str], deadline: float) -> None:
    """Poll until every job has ended with nothing running, or the deadline."""
    headers = {"authorization": f"Bearer {_TOKEN}"}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            views = [httpx.get(f"{url}/v1/jobs/{job}", headers=headers, timeout=10).json()
                     for job in jobs]
            if all(v["status"] in ("completed", "cancelled", "failed") and not v["running"]
                   for v in views):
                return
        time.sleep(0.2)


def _update(url: str, version: int) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/v1/weights/update", json={"weights_path": "/tmp",
                                                     "policy_version": version},
                   headers={"authorization": f"Bearer {_TOKEN}"}, timeout=60)


def _check(config: ChaosConfig, service: ServiceProcess, jobs: list[str],
           cancelled: set[str], readers: list[Follower | RawReader],
           hung_readers: int) -> dict[str, Any]:
    lost = duplicated = unstable = misclassified = 0
    errors: collections.Counter[str] = collections.Counter()
    not_ended = 0
    delivered_tokens = discarded_tokens = 0
    reader_errors = [r.error for r in readers if isinstance(r, Follower) and r.error]
    headers = {"authorization": f"Bearer {_TOKEN}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as http:
        final: dict[str, dict[int, bytes]] = {}
        planned: dict[str, int] = {}
        views = {}
        for job in jobs:
            view = http.get(f"/v1/jobs/{job}").json()
            views[job] = {k: view[k] for k in ("status", "delivered", "running", "queued",
                                               "counts")}
            not_ended += (view["status"] not in ("completed", "cancelled", "failed")) + \
                view["running"] + view["queued"]
            body = http.get(f"/v1/jobs/{job}/trajectories").content
            lines = {int(json.loads(x)["seq"]): x for x in body.split(b"\n") if x.strip()}
            final[job] = lines
            planned[job] = int(view["planned"])
            lost += max(0, planned[job] - len(lines))
            records = [json.loads(x)["trajectory"] for x in lines.values()]
            for t in records:
                delivered_tokens += int(t.get("output_tokens") or 0)
                discarded_tokens += sum(p["discarded_tokens"] for p in t["resumed"])
                stage = t.get("failure_stage")
                if t["status"] == "error":
                    errors[str(stage)] += 1
                    misclassified += stage in (None, "runtime")
                if t["status"] == "aborted" and job not in cancelled:
                    misclassified += 1
        metrics = http.get("/metrics").text
    active = sum(float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("treadle_trajectories_active "))
    for r in readers:
        if isinstance(r, Follower):
            lost += max(0, planned[r.job_id] - len(set(r.seqs)))
            duplicated += len(r.seqs) - len(set(r.seqs)) + len(r.ids) - len(set(r.ids))
            if r.seqs and r.seqs != list(range(1, len(r.seqs) + 1)):
                duplicated += 1  # out of order or with a gap
        else:
            lost += max(0, planned[r.job_id] - len(r.lines))
            duplicated += r.duplicates
            unstable += sum(line != final[r.job_id].get(seq) for seq, line in r.lines.items())
    unstable += _against_the_store(service.db, final)
    return {"jobs": len(jobs), "planned": sum(planned.values()), "lost": lost,
            "duplicated": duplicated, "unstable": unstable, "misclassified": misclassified,
            "hung": hung_readers + not_ended + int(active), "reader_errors": reader_errors,
            "errors_by_stage": dict(errors), "job_views": views,
            "delivered_tokens": delivered_tokens, "discarded_tokens": discarded_tokens}


def _against_the_store(db: Path, final: dict[str, dict[int, bytes]]) -> int:
    """Lines of the final streams whose record is not byte for byte the store's."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        differ = 0
        for job, lines in final.items():
            stored = dict(conn.execute("SELECT seq, record FROM trajectories WHERE job_id = ? "
                                       "AND seq IS NOT NULL", (job,)))
            for seq, line in lines.items():
                expected = f'{{"seq":{seq},"trajectory":{stored.get(seq)}}}'.encode()
                differ += line != expected
        return differ
    finally:
        conn.close()


def _integrity(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


def _unexpected(log_path: Path) -> list[str]:
    lines = log_path.read_text(errors="replace").splitlines()
    return [line[:300] for line in lines if _UNEXPECTED.search(line)][:20]


def _ok(report: dict[str, Any]) -> bool:
    return (all(report[k] == 0 for k in ("lost", "duplicated", "unstable", "misclassified",
                                          "hung"))
            and report["integrity_check"] == "ok" and not report["unexpected_log_lines"]
            and not report["reader_errors"])


# -- command line ------------------------------------------------------------------------


def add_chaos_bench_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench chaos`; handler in `args.func`."""
    p = subparsers.add_parser("chaos", help="the service under seeded faults: lost, "
                                            "duplicated, hung and misclassified counts")
    defaults = ChaosConfig()
    for name in ("seed", "jobs", "trajectories", "gpus", "faults", "followers", "hang_ups"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("time_scale", "fault_gap_s", "deadline_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float,
                       default=getattr(defaults, name))
    p.add_argument("--policy", default=defaults.policy)
    p.add_argument("--kinds", default=",".join(defaults.kinds),
                   help="the process faults drawn from, comma-separated (default: all: "
                        f"{', '.join(PROCESS_FAULTS)})")
    p.add_argument("--resume-from", choices=("turn", "prompt", "both"),
                   default=defaults.resume_from,
                   help="the service's --resume-from (prompt: how restarts cost before "
                        "turn journals; both: the two side by side, same seed)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="run in DIR and keep its database and service log")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/chaos.json",
                   help="where to write the report (default out/chaos.json; the committed "
                        "one is benchmarks/chaos.json)")
    p.set_defaults(func=run_chaos_bench)


def run_chaos_bench(args: argparse.Namespace) -> int:
    from treadle.errors import UsageError

    if args.jobs < 1 or args.trajectories < 16 or args.trajectories % 16 or args.gpus < 1:
        raise UsageError("--jobs >= 1, --trajectories a multiple of 16, --gpus >= 1")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(PROCESS_FAULTS):
        raise UsageError(f"--kinds: some of {', '.join(PROCESS_FAULTS)}, got {args.kinds!r}")
    modes = ("turn", "prompt") if args.resume_from == "both" else (args.resume_from,)
    config = ChaosConfig(seed=args.seed, jobs=args.jobs, trajectories=args.trajectories,
                         gpus=args.gpus, time_scale=args.time_scale, policy=args.policy,
                         followers=args.followers, hang_ups=args.hang_ups,
                         faults=args.faults, fault_gap_s=args.fault_gap_s,
                         deadline_s=args.deadline_s, kinds=kinds)
    reports = {}
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="treadle-chaos-")))
        for mode in modes:
            work = root / mode if len(modes) > 1 else root
            work.mkdir(parents=True, exist_ok=True)
            reports[mode] = run_chaos(dataclasses.replace(config, resume_from=mode), work)
    report = reports[modes[0]] if len(modes) == 1 else {
        "arms": reports, "ok": all(r["ok"] for r in reports.values()),
        "tokens": {mode: r["tokens"] for mode, r in reports.items()}}
    write_report(report, args.out, name="bench chaos", echo=args.json)
    return 0 if report["ok"] else 1


__all__ = ["PROCESS_FAULTS", "ChaosConfig", "add_chaos_bench_parser", "run_chaos"]
