"""`treadle bench gateway`: the latency the harness gateway adds to a call, over
calling the engine directly, side by side in one run.

    treadle bench gateway --sessions 1,64 --calls 12 --round-calls 192 --rounds 6 \\
        --time-scale 0.01 --json --out benchmarks/gateway.json

One emulated engine process (`treadle engine emulate`, Qwen3-14B on an H100 from
the cost model) and one `treadle serve` registered to it (`--engine URL
--engine-kind emulated --policy verl`, a fresh SQLite file), each its own process
so that /proc gives each one's CPU. This process is the client of both, with httpx
(a new `AsyncClient` per arm run, its connections opened before the clocks start).

- **direct**: `POST /v1/completions` on the engine with the body the service's
  engine client sends (`engines.vllm.completion_body`: the context as token ids,
  `max_tokens`, the stop id, logprobs); the context is the Hermes template's, as
  the gateway renders it, kept by the client outside the timed part;
- **gateway**: a harness on a session (made before the clocks start, ended after)
  calling `POST {base_url}/chat/completions` with the whole conversation: system
  prompt, one tool, a task, then per call the reply as returned and a short user
  message (the extension path), the same `max_tokens`.

A session is `--calls` calls in both arms; a level of `--sessions` concurrent
clients runs sessions back to back until each arm has made `--round-calls` calls
at least. Every round runs every level, the arms' order alternating, so noise on
the shared machine falls on both; `--warmup` rounds are dropped. The tokenizer is
a byte-level BPE built here (no download, the same every run) with the emulator's
151,936 ids, so a reply decodes to words and its JSON is of a real size.

Per level and arm: a call's wall latency (request sent to reply parsed) p50 and
p99 over all rounds; service, engine and client CPU per call (/proc ticks over the
arm's run; the service's in the direct arm is its idle cost); the mean prompt
tokens (equal in both arms: the same contexts); how busy the machine was. Added
latency two ways: `*_paired`, the median over rounds of the round's gateway minus
direct percentile; `*_pooled`, the difference of the percentiles of all calls.
`aim.met` compares the paired p50 at the largest level with `--aim-ms`.

Limits: Linux (/proc). Client, service and engine share the cores; at 64
closed-loop sessions the added latency is mostly calls queueing behind the
service's CPU. The emulator's tokens are random (never a tool call).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from treadle.bench.service import _cpu_s, _machine_ticks
from treadle.reports import log, write_report

_TOKEN = "bench-token"
_ARMS = ("direct", "gateway")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = "You are a data analyst. Answer with the number of rows, calling tools as needed."
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "run a Python program and return what it prints",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]


def build_tokenizer(directory: Path) -> Path:
    """A byte-level BPE with `VOCAB` ids (the emulator samples from all of them), made
    from merges built here: every 2- and 3-letter piece, every word of up to 3
    letters, and a seeded sample of 4-letter words; the chat special tokens last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from treadle.engines.emulated import VOCAB

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    letters = "abcdefghijklmnopqrstuvwxyz"

    def add(left: str, right: str) -> None:
        vocab[left + right] = len(vocab)
        merges.append((left, right))

    for n in (2, 3):
        for t in itertools.product(letters, repeat=n):
            add("".join(t[:-1]), t[-1])
    for n in (1, 2, 3):
        for t in itertools.product(letters, repeat=n):
            add("Ġ" + "".join(t[:-1]), t[-1])  # Ġ: the byte-level space
    for k in sorted(random.Random(0).sample(range(26 ** 4), VOCAB - len(SPECIAL) - len(vocab))):
        word = "".join(letters[k // 26 ** i % 26] for i in (3, 2, 1, 0))
        add("Ġ" + word[:3], word[3])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


# -- measurements --------------------------------------------------------------------------


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return 1000.0 * s[min(len(s) - 1, int(q * len(s)))]


@dataclass(slots=True)
class ArmRun:
    """One arm at one level in one round: latencies and what it cost."""

    latencies: list[float] = field(default_factory=list)  # seconds, one per good call
    failures: int = 0  # calls answered badly or not at all
    errors: dict[str, int] = field(default_factory=dict)  # failures by reason
    prompt_tokens: int = 0  # of the good calls (the context each sent the engine)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # service, engine, client
    busy: tuple[int, int] = (0, 0)  # machine (busy, total) jiffies over the run


@dataclass(slots=True)
class Plan:
    """What a level runs: `clients` concurrent loops of `sessions` sessions each."""

    clients: int
    sessions: int
    calls: int  # per session
    max_tokens: int
    tag: str  # makes this run's prompts its own (no prefix-cache hits across runs)


# The Qwen/Hermes template as the gateway renders this conversation (its `hermes`
# format; the text is agent.chat's): the direct arm sends the same token ids, and
# the report's prompt_tokens_mean of the two arms says so.
TOOL_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def _prompt(tag: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}{TOOL_BLOCK}<|im_end|>\n<|im_start|>user\n"
            f"{_task(tag)}<|im_end|>\n<|im_start|>assistant\n")


def _continuation(turn: int, closed: bool) -> str:
    """What follows a reply: the next user message (the reply closed if it was not)."""
    return (f"{'' if closed else '<|im_end|>'}\n<|im_start|>user\n{_user(turn)}<|im_end|>\n"
            "<|im_start|>assistant\n")


def _user(k: int) -> str:
    return f"step {k}: the program printed {k * 7 + 3} rows; check the next table"


def _task(tag: str) -> str:
    return f"Task {tag}: how many rows does the table sales_{tag} have?"


# -- the two arms --------------------------------------------------------------------------


async def _timed(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                 headers: dict[str, str], out: ArmRun) -> Any:
    """POST `body`; the reply's JSON (its latency kept), or None (the failure counted,
    by reason)."""
    started = time.perf_counter()
    try:
        reply = await http.post(url, json=body, headers=headers)
        data = reply.json() if reply.status_code == 200 else None
        reason = f"HTTP {reply.status_code}: {reply.text[:120]}"
    except (httpx.HTTPError, ValueError) as e:
        data, reason = None, f"{type(e).__name__}: {str(e)[:120]}"
    took = time.perf_counter() - started
    if data is None:
        out.failures += 1
        out.errors[reason] = out.errors.get(reason, 0) + 1
    else:
        out.latencies.append(took)
    return data


async def _direct_session(http: httpx.AsyncClient, tokenizer: Any, model: str, plan: Plan,
                          tag: str, out: ArmRun) -> None:
    from treadle.engines.base import GenerateRequest
    from treadle.engines.vllm import completion_body

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    stop = tokenizer.token_to_id("<|im_end|>")
    context = encode(_prompt(tag))
    for turn in range(plan.calls):
        rid = f"{tag}:{turn}"
        body = completion_body(GenerateRequest(rid, list(context), plan.max_tokens,
                                               stop_token_ids=[stop]), model)
        data = await _timed(http, "/v1/completions", body, {"x-request-id": rid}, out)
        if data is None:
            return
        out.prompt_tokens += len(context)
        ids = data["choices"][0]["token_ids"]
        context += ids + encode(_continuation(turn, bool(ids) and ids[-1] == stop))


async def _gateway_session(http: httpx.AsyncClient, base_url: str, plan: Plan, tag: str,
                           out: ArmRun) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": _task(tag)}]
    url = f"{base_url}/chat/completions"
    for turn in range(plan.calls):
        body = {"model": "policy", "messages": messages, "tools": TOOLS,
                "max_tokens": plan.max_tokens}
        data = await _timed(http, url, body, {}, out)
        if data is None:
            return
        out.prompt_tokens += data["usage"]["prompt_tokens"]
        messages += [{"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                     {"role": "user", "content": _user(turn)}]


@dataclass(slots=True)
class Rig:
    """The running processes: where they answer, their pids."""

    engine_url: str
    engine_pid: int
    service_url: str
    service_pid: int
    model: str  # the engine's served name
    tokenizer: Any
    control: httpx.AsyncClient  # the service's, for sessions (never timed)

    def cpu(self) -> dict[str, float]:
        return {"service": _cpu_s(self.service_pid), "engine": _cpu_s(self.engine_pid),
                "client": time.process_time()}

    def client(self, arm: str, connections: int) -> httpx.AsyncClient:
        """A new client of the arm's door, as many connections as it has sessions."""
        # Idle connections expire before the servers' 5 s keep-alive (uvicorn's) does,
        # so that none is reused as the server closes it (a ReadError, not a latency).
        limits = httpx.Limits(max_connections=connections,
                              max_keepalive_connections=connections, keepalive_expiry=1.0)
        url, headers = (self.engine_url, {}) if arm == "direct" else (
            self.service_url, {"authorization": f"Bearer {_TOKEN}"})
        return httpx.AsyncClient(base_url=url, timeout=60, limits=limits, headers=headers)


async def run_arm(rig: Rig, arm: str, plan: Plan) -> ArmRun:
    """One arm of one level: `plan.clients` loops, clocks around the calls only. The
    sessions are made, and the client's connections opened, before the clocks start."""
    out = ArmRun()
    tags = [[f"{plan.tag}-{arm[0]}{c}-{s}" for s in range(plan.sessions)]
            for c in range(plan.clients)]
    bases: dict[str, str] = {}
    if arm == "gateway":
        for tag in itertools.chain.from_iterable(tags):
            made = await rig.control.post("/v1/sessions", json={
                "metadata": {"bench": tag},
                # the context bound is the engine's own (a larger one is refused)
                "limits": {"max_turns": plan.calls, "max_tokens_per_turn": plan.max_tokens}})
            made.raise_for_status()
            bases[tag] = made.json()["base_url"]
    async with rig.client(arm, plan.clients) as http:
        ping = "/health" if arm == "direct" else "/healthz"
        await asyncio.gather(*(http.get(ping) for _ in range(plan.clients)))

        async def client(mine: list[str]) -> None:
            for tag in mine:
                if arm == "gateway":
                    await _gateway_session(http, bases[tag], plan, tag, out)
                else:
                    await _direct_session(http, rig.tokenizer, rig.model, plan, tag, out)

        before, ticks, started = rig.cpu(), _machine_ticks(), time.perf_counter()
        await asyncio.gather(*(client(mine) for mine in tags))
        out.wall_s = time.perf_counter() - started
        after, now = rig.cpu(), _machine_ticks()
    out.cpu_s = {k: after[k] - before[k] for k in before}
    out.busy = (now[0] - ticks[0], now[1] - ticks[1])
    for base in bases.values():  # stored after the clocks stopped
        session = base.split("/v1/sessions/")[1].split("/")[0]
        await rig.control.post(f"/v1/sessions/{session}/end", json={"reward": 0.0})
    return out


# -- the report ----------------------------------------------------------------------------


def summarise(runs: list[ArmRun], expected: int) -> dict[str, Any]:
    """One arm at one level over all its rounds."""
    samples = [x for r in runs for x in r.latencies]
    calls = len(samples)
    busy = sum(r.busy[0] for r in runs), sum(r.busy[1] for r in runs)
    out: dict[str, Any] = {"calls": calls, "expected_calls": expected,
                           "failures": sum(r.failures for r in runs)}
    errors = sum((Counter(r.errors) for r in runs), Counter[str]())
    if errors:
        out["errors"] = dict(errors)
    if calls:
        out.update({"p50_ms": round(_pct(samples, 0.5), 3), "p99_ms": round(_pct(samples, 0.99), 3),
                    "mean_ms": round(1000.0 * statistics.fmean(samples), 3),
                    "prompt_tokens_mean": round(sum(r.prompt_tokens for r in runs) / calls, 2),
                    "calls_per_s": round(calls / sum(r.wall_s for r in runs), 1)})
        out.update({f"{who}_cpu_ms_per_call": round(1000 * sum(r.cpu_s[who] for r in runs)
                                                    / calls, 3)
                    for who in ("service", "engine", "client")})
    out["machine_busy_pct"] = round(100.0 * busy[0] / max(1, busy[1]), 1)
    return out


def level_report(sessions: int, plan: Plan, rounds: list[dict[str, ArmRun]]) -> dict[str, Any]:
    expected = plan.clients * plan.sessions * plan.calls * len(rounds)
    arms = {arm: summarise([r[arm] for r in rounds], expected) for arm in _ARMS}
    per_round: list[dict[str, Any]] = []
    for k, r in enumerate(rounds):
        d, g = r["direct"].latencies, r["gateway"].latencies
        if d and g:  # "first": the arm run first that round
            per_round.append({"round": k, "first": next(iter(r)), **{
                f"{arm}_{q}_ms": round(_pct(r[arm].latencies, x), 3)
                for q, x in (("p50", 0.5), ("p99", 0.99)) for arm in _ARMS}})
    added: dict[str, Any] = {}
    if per_round:
        for q in ("p50", "p99"):
            added[f"{q}_ms_paired"] = round(statistics.median(
                x[f"gateway_{q}_ms"] - x[f"direct_{q}_ms"] for x in per_round), 3)
            added[f"{q}_ms_pooled"] = round(arms["gateway"][f"{q}_ms"]
                                            - arms["direct"][f"{q}_ms"], 3)
        cpu = [arms[arm]["service_cpu_ms_per_call"] for arm in ("gateway", "direct")]
        added["service_cpu_ms_per_call"] = round(cpu[0] - cpu[1], 3)
    return {"sessions": sessions, "calls_per_session": plan.calls,
            "sessions_per_client_per_round": plan.sessions, **arms, "added": added,
            "rounds": per_round}


@contextlib.contextmanager
def _engine(model: str, gpu: str, time_scale: float, log_path: Path) -> Any:
    from treadle.runtime.launcher import EmulatedProcess, free_port, stop_process_group

    cmd = EmulatedProcess(model, gpu, time_scale=time_scale).command(1, port := free_port(), 0)
    with log_path.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start: {log_path.read_text()[-800:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url, proc
    finally:
        stop_process_group(proc)


def run_gateway_bench(*, sessions: list[int], calls: int, round_calls: int, rounds: int,
                      warmup: int, max_tokens: int, time_scale: float, model: str, gpu: str,
                      aim_ms: float, log: Callable[[str], None]) -> dict[str, Any]:
    """The report (see the module docstring)."""
    from tokenizers import Tokenizer

    from treadle.bench.faults import ServiceProcess
    from treadle.engines.emulated import VOCAB

    plans = {n: Plan(n, max(1, -(-round_calls // (n * calls))), calls, max_tokens, "")
             for n in sessions}
    results: dict[int, list[dict[str, ArmRun]]] = {n: [] for n in sessions}
    with tempfile.TemporaryDirectory(prefix="treadle-bench-gateway-") as tmp_dir:
        tmp = Path(tmp_dir)
        tok_dir = build_tokenizer(tmp / "tok")
        served = f"{model}-emulated"
        with _engine(model, gpu, time_scale, tmp / "engine.log") as (engine_url, engine):
            service = ServiceProcess(tmp / "bench.db", tmp / "serve.log", _TOKEN, [
                "--engine", engine_url, "--engine-kind", "emulated", "--served-model", served,
                "--tokenizer", str(tok_dir), "--time-scale", repr(time_scale),
                "--policy", "verl", "--model", model, "--gpu", gpu])
            service.start()
            try:
                assert service.proc is not None
                log(f"engine pid {engine.pid} at {engine_url}, service pid "
                    f"{service.proc.pid} at {service.url}")

                async def main(service_pid: int) -> None:
                    async with httpx.AsyncClient(base_url=service.url, timeout=60, headers={
                            "authorization": f"Bearer {_TOKEN}"}, limits=httpx.Limits(
                                keepalive_expiry=1.0)) as control:
                        rig = Rig(engine_url, engine.pid, service.url, service_pid, served,
                                  Tokenizer.from_file(str(tok_dir / "tokenizer.json")), control)
                        for r in range(warmup + rounds):
                            for n in sessions:
                                plan = plans[n]
                                plan.tag = f"r{r}n{n}"
                                order = _ARMS if r % 2 == 0 else _ARMS[::-1]
                                done = {arm: await run_arm(rig, arm, plan) for arm in order}
                                if r >= warmup:
                                    results[n].append(done)
                                log(f"  round {r}{' (warm-up)' if r < warmup else ''}, {n} "
                                    f"sessions: " + ", ".join(
                                        f"{arm} p50 {_pct(done[arm].latencies, 0.5):.2f} ms"
                                        for arm in _ARMS if done[arm].latencies))

                asyncio.run(main(service.proc.pid))
            finally:
                service.stop()
    levels = [level_report(n, plans[n], results[n]) for n in sessions]
    top = max(levels, key=lambda level: int(level["sessions"]))
    added = top["added"].get("p50_ms_paired")
    return {
        "setup": {"sessions": sessions, "calls_per_session": calls,
                  "min_calls_per_arm_per_round": round_calls, "rounds": rounds,
                  "warmup_rounds": warmup, "max_tokens": max_tokens, "time_scale": time_scale,
                  "model": model, "gpu": gpu, "engine": "one emulated engine process, TP 1",
                  "policy": "verl", "chat_format": "hermes",
                  "client": f"httpx {httpx.__version__} AsyncClient, keep-alive",
                  "tokenizer": f"byte-level BPE built in code, {VOCAB} ids",
                  "cores": os.cpu_count(), "python": platform.python_version(),
                  "latency": "request sent to reply parsed, per call",
                  "added_paired": "median over rounds of the round's gateway - direct",
                  "added_pooled": "gateway - direct percentile of all rounds' calls"},
        "levels": levels,
        "aim": {"aim_p50_added_ms": aim_ms, "at_sessions": top["sessions"],
                "added_p50_ms": added, "met": added is not None and added < aim_ms},
    }


def add_gateway_bench_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench gateway` on the `treadle bench` subparsers; handler in `args.func`."""
    p = bench_subparsers.add_parser("gateway", help="latency the gateway adds per call, "
                                                    "against calling the engine directly")
    p.add_argument("--sessions", default="1,64",
                   help="concurrency levels, comma-separated (default 1,64)")
    p.add_argument("--calls", type=int, default=12, help="calls per session (default 12)")
    p.add_argument("--round-calls", type=int, default=192, metavar="N",
                   help="calls at least per arm, level and round (default 192)")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run and dropped (default 1)")
    p.add_argument("--max-tokens", type=int, default=16, help="per call (default 16)")
    p.add_argument("--time-scale", type=float, default=0.01, metavar="X",
                   help="of the emulated engine's modelled time (default 0.01)")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--aim-ms", type=float, default=2.0,
                   help="the aim for the added p50 at the largest level (default 2.0)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/gateway.json",
                   help="where to write the report (default out/gateway.json; the committed "
                        "one is benchmarks/gateway.json)")
    p.set_defaults(func=run_gateway_bench_command)


def run_gateway_bench_command(args: argparse.Namespace) -> int:
    """Handler of `bench gateway`; 2 with one line on stderr for bad input."""
    try:
        sessions = [int(s) for s in args.sessions.split(",") if s.strip()]
    except ValueError:
        sessions = []
    from treadle.core.cost_model import CostModel

    problems = [msg for bad, msg in (
        (not sessions or min(sessions) < 1 or max(sessions) > 1024,
         "--sessions must be integers from 1 to 1024, comma-separated"),
        (args.calls < 1, "--calls must be >= 1"),
        (args.round_calls < 1, "--round-calls must be >= 1"),
        (args.rounds < 1 or args.warmup < 0, "--rounds must be >= 1 and --warmup >= 0"),
        (not 1 <= args.max_tokens <= 4096, "--max-tokens must be from 1 to 4096"),
        (not args.time_scale > 0, "--time-scale must be > 0"),
        (not Path("/proc/self/stat").exists(), "needs Linux (/proc)")) if bad]
    if problems:
        print(f"treadle bench gateway: {problems[0]}", file=sys.stderr)
        return 2
    try:
        CostModel.named(args.model, args.gpu)
        report = run_gateway_bench(
            sessions=sessions, calls=args.calls, round_calls=args.round_calls,
            rounds=args.rounds, warmup=args.warmup, max_tokens=args.max_tokens,
            time_scale=args.time_scale, model=args.model, gpu=args.gpu, aim_ms=args.aim_ms,
            log=log)
    except (KeyError, ValueError) as e:
        print(f"treadle bench gateway: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    write_report(report, args.out, name="gateway bench", echo=args.json)
    return 0
