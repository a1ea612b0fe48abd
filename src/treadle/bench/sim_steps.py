"""`treadle bench sim --steps K`: the multi-step benchmark behind the claims of
docs/sim-steps.md.

For every workload (the four suites and the seeded shapes) and every mode (sync,
overprovision, async, partial) it runs K RL steps of `trajectories` a step on 64
H100s serving Qwen3-14B: the paper-configured baselines (slime, verl at TP 1), the
same on every homogeneous TP degree, heddle, treadle and the oracle (treadle's
mechanisms told every trajectory's true length: what prediction error costs across
steps); and reports each one's
trained tokens per GPU-second, utilisation, staleness, tokens discarded and ratio to
the mode's multi-step lower bound (`core.steps_bound`). Per workload it names the
best TP-tuned baseline in its best mode, treadle's best mode and the ratio of the
two, and measures what per-prompt history adds: the predictor's accuracy over the
steps with and without earlier epochs of each prompt, and treadle's run without it.
Runs are independent and deterministic; `--jobs` runs them in parallel processes
(only the wall-clock fields change), and `--merge` puts a few policies' rows into a
report of the same settings without running the others again.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from treadle.core.cost_model import CostModel
from treadle.core.predictor import Outcome, Predictor
from treadle.core.predictor_eval import evaluate
from treadle.errors import UsageError
from treadle.sim.runner import history_for
from treadle.sim.steps import Mode
from treadle.sim.steps_runner import (
    EPOCH_BATCHES,
    StepsPlan,
    StepsReport,
    epoch_source,
    simulate_steps,
)
from treadle.sim.stream import PromptStream

GPUS, MODEL, GPU, GROUP = 64, "qwen3-14b", "h100", 16
BASELINES = ("slime", "verl", *(f"{p}@tp{tp}" for p in ("slime", "verl") for tp in (2, 4, 8)))
POLICIES = (*BASELINES, "heddle", "treadle", "oracle")
MODES = tuple(m.value for m in Mode)
GOAL = 1.3  # treadle's best mode over the best TP-tuned baseline's, long-tailed workloads
ABLATION_MODES = ("sync", "partial")  # where treadle also runs without per-prompt history
LONG_TAIL_RATIO = 4.0  # p99/p50 of output tokens at or above this: long-tailed


@dataclass(frozen=True, slots=True)
class _Task:
    """One run, everything a worker process needs to repeat it."""

    workload: str
    mode: str
    policy: str
    steps: int
    trajectories: int
    seed: int
    train_fraction: float
    max_staleness: int
    per_prompt: bool = True


def _stream(workload: str, trajectories: int, seed: int, per_prompt: bool,
            cost: CostModel) -> PromptStream:
    prompts = EPOCH_BATCHES * trajectories // GROUP
    return PromptStream(workload, epoch_source(workload, prompts, GROUP, seed,
                                               cost.model.max_context),
                        prompts, GROUP, per_prompt=per_prompt)


# Per process, the plans of the streams its runs share (a worker runs many runs of a
# workload): the training step's length and the group costs are computed once.
_PLANS: dict[tuple[object, ...], StepsPlan] = {}


def _run(task: _Task) -> dict[str, Any]:
    """One policy through one mode (in a worker process)."""
    cost = CostModel.named(MODEL, GPU)
    key = (task.workload, task.trajectories, task.seed, task.per_prompt, task.steps,
           task.train_fraction, task.max_staleness)
    if key not in _PLANS:
        stream = _stream(task.workload, task.trajectories, task.seed, task.per_prompt, cost)
        _PLANS[key] = StepsPlan(stream, cost, GPUS, steps=task.steps,
                                batch_groups=task.trajectories // GROUP,
                                train_fraction=task.train_fraction,
                                max_staleness=task.max_staleness)
    plan = _PLANS[key]
    config = plan.config(Mode(task.mode))
    bound = plan.bound(config)
    history = history_for(task.workload, task.trajectories, task.seed,
                          max_context=cost.model.max_context)
    row = simulate_steps(task.policy, plan.stream, cost, GPUS, config, bound,
                         history=history, seed=task.seed)
    return {"task": asdict(task), "row": asdict(row), "train_s": plan.train_s,
            "bound": {"makespan_s": bound.makespan_s,
                      "tokens_per_gpu_s_ceiling": bound.tokens_per_gpu_s_ceiling,
                      **asdict(bound)}}


def prompt_history_accuracy(workload: str, trajectories: int, steps: int, seed: int,
                            history: Sequence[Outcome], cost: CostModel) -> dict[str, Any]:
    """The predictor through the run's batches in order, learning as it goes (each
    batch replayed by `core.predictor_eval.evaluate`), with each prompt's earlier
    epochs (per-prompt) and without (group ids new every epoch). Scores of the
    steps after the first epoch, where prompts recur, at arrival and after turn 1:
    mean over steps of the top-20% recall, Spearman and mean relative error."""
    groups = trajectories // GROUP
    out: dict[str, Any] = {}
    for label, per_prompt in (("per_prompt", True), ("siblings_only", False)):
        stream = _stream(workload, trajectories, seed, per_prompt, cost)
        predictor = Predictor(history, max_tokens=cost.model.max_context)
        scores: list[dict[int, dict[str, float]]] = []
        for step in range(steps):
            batch = [(s.traj_id, s.group_id, s.prompt_tokens,
                      [(t.output_tokens, t.tool_latency_s) for t in s.turns])
                     for i in range(step * groups, (step + 1) * groups)
                     for s in stream.group(i).specs]
            scored = evaluate(batch, (), (0, 1), make_predictor=_same(predictor))
            if step >= EPOCH_BATCHES:
                scores.append(scored)
        out[label] = {f"after_turn_{k}": {m: statistics.fmean(s[k][m] for s in scores)
                                          for m in ("recall_top20", "spearman", "mape")}
                      for k in (0, 1)} if scores else {}
    return out


def _same(predictor: Predictor) -> Callable[[Sequence[Outcome]], Predictor]:
    """`evaluate`'s factory that hands back one predictor: it learns across batches."""
    def make(_history: Sequence[Outcome]) -> Predictor:
        return predictor
    return make


def summarise(rows: Sequence[dict[str, Any]], long_tailed: bool,
              ceilings: dict[str, float]) -> dict[str, Any]:
    """Per mode: the best TP-tuned baseline and treadle; over modes: each one's best
    mode, the ratio the goal is about, and the lower bound's verdict on it.
    `ceilings`: per mode, the most trained tokens per GPU-second any schedule
    reaches (`StepsBound.tokens_per_gpu_s_ceiling`)."""
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], {})[r["policy"]] = r
    per_mode = {}
    for mode, pols in by_mode.items():
        base = max((p for p in BASELINES if p in pols),
                   key=lambda p: (pols[p]["trained_tokens_per_gpu_s"], p))
        per_mode[mode] = {
            "best_tp_tuned": base,
            "best_tp_tuned_tokens_per_gpu_s": pols[base]["trained_tokens_per_gpu_s"],
            "treadle_tokens_per_gpu_s": pols["treadle"]["trained_tokens_per_gpu_s"],
            "treadle_over_best_tp_tuned": pols["treadle"]["trained_tokens_per_gpu_s"]
            / pols[base]["trained_tokens_per_gpu_s"],
            "heddle_over_best_tp_tuned": pols["heddle"]["trained_tokens_per_gpu_s"]
            / pols[base]["trained_tokens_per_gpu_s"] if "heddle" in pols else None,
            "oracle_over_best_tp_tuned": pols["oracle"]["trained_tokens_per_gpu_s"]
            / pols[base]["trained_tokens_per_gpu_s"] if "oracle" in pols else None,
            "lower_bound_s": pols["treadle"]["lower_bound_s"],
            "ceiling_tokens_per_gpu_s": ceilings[mode],
        }
    best_base_mode = max(per_mode, key=lambda m: per_mode[m]["best_tp_tuned_tokens_per_gpu_s"])
    best_treadle_mode = max(per_mode, key=lambda m: per_mode[m]["treadle_tokens_per_gpu_s"])
    base_row = by_mode[best_base_mode][per_mode[best_base_mode]["best_tp_tuned"]]
    treadle_row = by_mode[best_treadle_mode]["treadle"]
    ratio = treadle_row["trained_tokens_per_gpu_s"] / base_row["trained_tokens_per_gpu_s"]
    # No schedule delivers its tokens faster than the bound allows: treadle can beat
    # the baseline by at most the baseline's own distance from the bound (for the same
    # tokens; delivered sets differ a little between runs, see length_bias).
    headroom = base_row["ratio_to_lower_bound"]
    # The strict form: the most tokens per GPU-second any schedule trains in any
    # mode, over the best baseline's. Below the goal, no scheduler can meet it.
    reach = max(ceilings[m] for m in per_mode) / base_row["trained_tokens_per_gpu_s"]
    # The oracle in its best mode: how far perfect length prediction takes treadle.
    oracle = max((by_mode[m]["oracle"] for m in by_mode if "oracle" in by_mode[m]),
                 key=lambda r: r["trained_tokens_per_gpu_s"], default=None)
    return {
        "long_tailed": long_tailed, "per_mode": per_mode,
        "best_tp_tuned": {"mode": best_base_mode, "policy": base_row["policy"],
                          "tokens_per_gpu_s": base_row["trained_tokens_per_gpu_s"],
                          "staleness_max": base_row["staleness_max"]},
        "treadle_best": {"mode": best_treadle_mode,
                         "tokens_per_gpu_s": treadle_row["trained_tokens_per_gpu_s"],
                         "staleness_max": treadle_row["staleness_max"]},
        "treadle_best_over_best_tp_tuned": ratio,
        "oracle_best": None if oracle is None else {
            "mode": oracle["mode"], "tokens_per_gpu_s": oracle["trained_tokens_per_gpu_s"],
            "staleness_max": oracle["staleness_max"],
            "over_best_tp_tuned": oracle["trained_tokens_per_gpu_s"]
            / base_row["trained_tokens_per_gpu_s"]},
        "bound_headroom_over_best_tp_tuned": headroom,
        "ceiling_over_best_tp_tuned": reach,
        "goal_met": (ratio >= GOAL and treadle_row["staleness_max"] <= 1)
        if long_tailed else None,
        "goal_reachable": reach >= GOAL if long_tailed else None,
    }


def run_steps_bench(args: Any, log: Callable[[str], None]) -> dict[str, Any]:
    cost = CostModel.named(MODEL, GPU)
    workloads = [w for w in str(args.workloads).split(",") if w]
    modes = [m for m in str(getattr(args, "modes", ",".join(MODES))).split(",") if m]
    policies = [p for p in str(getattr(args, "policies", ",".join(POLICIES))).split(",") if p]
    n = int(str(args.sizes).split(",")[0])
    common = {"steps": args.steps, "trajectories": n, "seed": args.seed,
              "train_fraction": args.train_fraction, "max_staleness": args.max_staleness}
    merge = getattr(args, "merge", None)
    base = _mergeable(Path(merge), common, workloads, modes) if merge else None
    tasks = [_Task(w, m, p, **common) for w in workloads for m in modes for p in policies]
    ablations = [_Task(w, m, "treadle", per_prompt=False, **common)
                 for w in workloads for m in modes
                 if "treadle" in policies and m in ABLATION_MODES and base is None]
    started = time.perf_counter()
    log(f"{len(tasks) + len(ablations)} runs of {args.steps} steps, {args.jobs} at a time")
    results = _map([*tasks, *ablations], args.jobs, log, started)
    if base is not None:
        results = _merged(base, results, set(policies))
    report: dict[str, Any] = {
        "gpus": GPUS, "model": MODEL, "gpu": GPU, "seed": args.seed, **common,
        "group_size": GROUP, "prompts_per_epoch": EPOCH_BATCHES * n // GROUP,
        "overprovision": 0.25, "machine": {"python": platform.python_version(),
                                           "processor": platform.machine(), "jobs": args.jobs},
        "workloads": [],
    }
    for w in workloads:
        mine = [r for r in results if r["task"]["workload"] == w]
        rows = sorted((r["row"] for r in mine if r["task"]["per_prompt"]), key=_row_order)
        bounds = {r["task"]["mode"]: r["bound"] for r in mine}
        history = history_for(w, n, args.seed, max_context=cost.model.max_context)
        stats = _stream(w, n, args.seed, True, cost)
        totals = sorted(s.output_tokens for i in range(n // GROUP)
                        for s in stats.group(i).specs)
        p50, p99 = totals[len(totals) // 2], totals[min(len(totals) - 1, len(totals) * 99 // 100)]
        report["workloads"].append({
            "workload": w, "p50_p99_output_tokens": [p50, p99],
            "train_s": mine[0]["train_s"],
            "lower_bounds": bounds,
            "summary": summarise(rows, p99 / max(1, p50) >= LONG_TAIL_RATIO,
                                 {m: b["tokens_per_gpu_s_ceiling"] for m, b in bounds.items()}),
            "prompt_history": {
                "predictor": prompt_history_accuracy(w, n, args.steps, args.seed, history, cost),
                "treadle_without": [r["row"] for r in mine if not r["task"]["per_prompt"]],
            },
            "results": rows,
        })
    report["wall_s"] = time.perf_counter() - started
    if base is not None:  # the report's own provenance kept, this merge added to it
        merged = {"policies": policies, "runs": len(tasks), "wall_s": report["wall_s"],
                  "machine": report["machine"]}
        report.update({k: v for k, v in base.items() if k != "workloads"})
        report["merges"] = [*base.get("merges", []), merged]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown_report(report))
    log(f"report written to {out} and {out.with_suffix('.md')} ({report['wall_s']:.0f}s)")
    return report


def _row_order(row: dict[str, Any]) -> tuple[int, int, str]:
    """Mode, then the policy's place in `POLICIES` (others after, by name)."""
    p = row["policy"]
    return (MODES.index(row["mode"]), POLICIES.index(p) if p in POLICIES else len(POLICIES), p)


def _mergeable(path: Path, common: dict[str, Any], workloads: Sequence[str],
               modes: Sequence[str]) -> dict[str, Any]:
    """The report `--merge` adds rows to; UsageError (the command refuses the
    `--merge`) unless it reads and was run with the same settings, workloads and
    modes (its rows and the new ones must compare)."""
    try:
        report: dict[str, Any] = json.loads(path.read_text())
        have = {w["workload"]: {r["mode"] for r in w["results"]}
                for w in report["workloads"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a multi-step report ({type(e).__name__}: {e})"
                           ) from e
    for key, value in common.items():
        if report.get(key) != value:
            raise UsageError(f"{path}: {key} is {report.get(key)!r}, this run's {value!r}")
    for w in workloads:
        if w not in have or not set(modes) <= have[w]:
            raise UsageError(f"{path} has no run of {w} in every mode of {list(modes)}")
    return report


def _merged(report: dict[str, Any], results: list[dict[str, Any]],
            policies: set[str]) -> list[dict[str, Any]]:
    """The report's runs as `_run` results, the new policies' rows in place of theirs."""
    out = list(results)
    seen = {(r["task"]["workload"], r["task"]["mode"]) for r in results}
    for w in report["workloads"]:
        for row in w["results"]:
            if row["policy"] in policies and (w["workload"], row["mode"]) in seen:
                continue
            out.append(_kept(w, row, per_prompt=True))
        for row in w["prompt_history"]["treadle_without"]:
            out.append(_kept(w, row, per_prompt=False))
    return out


def _kept(w: dict[str, Any], row: dict[str, Any], *, per_prompt: bool) -> dict[str, Any]:
    """A kept row, as `_run` gives it."""
    return {"task": {"workload": w["workload"], "mode": row["mode"], "policy": row["policy"],
                     "per_prompt": per_prompt},
            "row": row, "train_s": w["train_s"], "bound": w["lower_bounds"][row["mode"]]}


def _map(tasks: Sequence[_Task], jobs: int, log: Callable[[str], None],
         started: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if jobs <= 1:
        for i, t in enumerate(tasks):
            out.append(_run(t))
            _progress(log, i + 1, len(tasks), t, started)
        return out
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for i, (t, r) in enumerate(zip(tasks, pool.map(_run, tasks), strict=True)):
            out.append(r)
            _progress(log, i + 1, len(tasks), t, started)
    return out


def _progress(log: Callable[[str], None], done: int, total: int, t: _Task,
              started: float) -> None:
    log(f"{done}/{total} {t.workload} {t.mode} {t.policy}"
        f"{'' if t.per_prompt else ' (no per-prompt history)'} "
        f"({time.perf_counter() - started:.0f}s)")


def markdown_report(report: dict[str, Any]) -> str:
    """The report's tables, for people."""
    lines = [
        f"# Multi-step benchmark: {report['gpus']} x {report['gpu']}, {report['model']}, "
        f"{report['steps']} steps of {report['trajectories']} trajectories",
        "",
        "Generated by `treadle bench sim --steps` from the JSON beside this file. Trained "
        "tokens per GPU-second over all GPUs (the trainer's too); staleness in versions; "
        "`x LB`: makespan over the mode's multi-step lower bound. `bound allows`: the "
        "best baseline's makespan over its mode's bound; `ceiling / best`: the most "
        "trained tokens per GPU-second the bound leaves any schedule in any mode, over the "
        "best baseline's (below 1.3, no scheduler meets the goal); `oracle / best`: "
        "treadle told every trajectory's true length, in its best mode, over the best "
        "baseline.",
        "",
        "| workload | best TP-tuned (mode) | tok/GPU-s | treadle best mode | tok/GPU-s "
        "| staleness p50/max | discarded M | treadle / best | oracle / best | bound allows "
        "| ceiling / best | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in report["workloads"]:
        s = w["summary"]
        b, t = s["best_tp_tuned"], s["treadle_best"]
        ours = next(r for r in w["results"]
                    if r["policy"] == "treadle" and r["mode"] == t["mode"])
        goal = "n/a" if s["goal_met"] is None else ("met" if s["goal_met"] else (
            "not met" if s["goal_reachable"] else "out of reach"))
        lines.append(
            f"| {w['workload']}{' (long-tailed)' if s['long_tailed'] else ''} "
            f"| {b['policy']} ({b['mode']}) | {b['tokens_per_gpu_s']:,.0f} | {t['mode']} "
            f"| {t['tokens_per_gpu_s']:,.0f} "
            f"| {ours['staleness_p50']:g}/{ours['staleness_max']} "
            f"| {ours['tokens_discarded'] / 1e6:.2f} "
            f"| {s['treadle_best_over_best_tp_tuned']:.3f} "
            f"| {_oracle_cell(s.get('oracle_best'))} "
            f"| {s['bound_headroom_over_best_tp_tuned']:.2f} "
            f"| {s['ceiling_over_best_tp_tuned']:.2f} | {goal} |")
    lines += ["", "## Per mode: treadle / heddle / oracle over the mode's best TP-tuned "
              "baseline (which), and the mode's ceiling (tok/GPU-s)", "",
              "| workload | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for w in report["workloads"]:
        pm = w["summary"]["per_mode"]
        cells = [f"{pm[m]['treadle_over_best_tp_tuned']:.3f} / "
                 f"{pm[m]['heddle_over_best_tp_tuned'] or 0:.2f} / "
                 f"{_ratio(pm[m].get('oracle_over_best_tp_tuned'))} ({pm[m]['best_tp_tuned']}); "
                 f"{pm[m]['ceiling_tokens_per_gpu_s']:,.0f}"
                 if m in pm else "" for m in MODES]
        lines.append(f"| {w['workload']} | " + " | ".join(cells) + " |")
    lines += ["", "## Per-prompt history (treadle's predictor, steps after the first epoch)",
              "", "| workload | recall top-20% at arrival: per-prompt / siblings only "
              "| error at arrival | treadle tok/GPU-s per mode: with / without |",
              "|---|---|---|---|"]
    for w in report["workloads"]:
        pred = w["prompt_history"]["predictor"]
        if not pred.get("per_prompt"):
            continue
        a, b = pred["per_prompt"]["after_turn_0"], pred["siblings_only"]["after_turn_0"]
        with_rows = {r["mode"]: r for r in w["results"] if r["policy"] == "treadle"}
        runs = ", ".join(
            f"{r['mode']} {with_rows[r['mode']]['trained_tokens_per_gpu_s']:,.0f}/"
            f"{r['trained_tokens_per_gpu_s']:,.0f}"
            for r in w["prompt_history"]["treadle_without"])
        lines.append(f"| {w['workload']} | {a['recall_top20']:.2f} / {b['recall_top20']:.2f} "
                     f"| {a['mape']:.2f} / {b['mape']:.2f} | {runs} |")
    lines += ["", "## Every run", ""]
    for w in report["workloads"]:
        lines += [f"### {w['workload']} (training step {w['train_s']:.1f} s on all GPUs)", "",
                  "| mode | policy | tok/GPU-s | makespan s | x LB | util | staleness p50/max "
                  "| discarded M | restarts | length bias | layout | choice s | sim s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in w["results"]:
            split = f" + {r['train_gpus']} train" if r["train_gpus"] else ""
            lines.append(
                f"| {r['mode']} | {r['policy']} | {r['trained_tokens_per_gpu_s']:,.1f} "
                f"| {r['makespan_s']:.0f} | {r['ratio_to_lower_bound']:.2f} "
                f"| {r['utilisation']:.0%} | {r['staleness_p50']:g}/{r['staleness_max']} "
                f"| {r['tokens_discarded'] / 1e6:.2f} | {r['groups_restarted']} "
                f"| {r['length_bias']:.2f} | {r['layout']}{split} | {r['layout_choice_s']:.1f} "
                f"| {r['sim_wall_s']:.0f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _oracle_cell(best: dict[str, Any] | None) -> str:
    return "-" if best is None else f"{best['over_best_tp_tuned']:.3f} ({best['mode']})"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report_rows(report: dict[str, Any]) -> list[StepsReport]:
    """The rows of a report, as the runner's records (for tests and tables)."""
    return [StepsReport(**{**r, "step_ends_s": tuple(r["step_ends_s"])})
            for w in report["workloads"] for r in w["results"]]
