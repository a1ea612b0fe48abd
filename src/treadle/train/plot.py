"""The RL run's plot, drawn from its report (`rl.json`): `plot_report(report, png)`.

Three panels over the steps: the rollouts' mean reward with the held-out success
rate and share of episodes that called the python tool (the evaluations), the
rollout throughput (sampled tokens per second of the step's rollout phase), and the
largest |engine − trainer| logprob gap of a sampled token (log scale, with the 1e-3
line). Needs matplotlib (the ``train`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_report(report: Mapping[str, Any], png: str | Path) -> Path:
    """Write the plot of `report` (GRPOReport.to_dict()) to `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    evals = report["evals"]
    x = [s["step"] + 1 for s in steps]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    top.plot(x, [s["reward"] for s in steps], color="#999999", lw=1,
             label="rollout reward (training tasks)")
    top.plot([e["step"] for e in evals], [e["success"] for e in evals], "o-",
             color="#d62728", lw=2, label="held-out success rate")
    if evals and "tool_use" in evals[0]:  # reports before the field have no such line
        top.plot([e["step"] for e in evals], [e["tool_use"] for e in evals], "s--",
                 color="#ff7f0e", lw=1, label="held-out python tool use")
    top.set_ylabel("reward / success")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    summary = report.get("summary", {})
    if summary.get("start_success") is not None:
        top.set_title(f"GRPO through treadle: held-out success "
                      f"{summary['start_success']:.0%} → {summary['final_success']:.0%} in "
                      f"{summary['rl_minutes']:.1f} min ({summary['steps']} steps)")
    mid.plot(x, [s["tokens_per_s"] for s in steps], color="#1f77b4")
    mid.set_ylabel("rollout tokens/s")
    low.semilogy(x, [max(s["logprob_gap_max"], 1e-9) for s in steps], color="#2ca02c",
                 label="max |Δ logprob|, engine vs trainer")
    low.axhline(1e-3, color="#999999", ls="--", lw=1, label="1e-3")
    low.set_ylabel("|Δ logprob|")
    low.set_xlabel("RL step")
    low.legend(loc="upper right")
    fig.tight_layout()
    out = Path(png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_async_vs_sync(report: Mapping[str, Any], png: str | Path) -> Path:
    """Write the plot of a synchronous and an asynchronous run side by side
    (`grpo.async_vs_sync`) to `png`: held-out success against wall-clock minutes,
    each step's staleness (the oldest trained token's lag, and the share of stale
    tokens), and each step's logprob gaps (parity on the trainer's own version, and
    the drift on older tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = (("sync", "#1f77b4"), ("async", "#d62728"))
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 10))
    for name, color in runs:
        evals = report[name]["evals"]
        top.plot([e["minutes"] for e in evals], [e["success"] for e in evals], "o-",
                 color=color, lw=2, label=f"{name}: held-out success")
    top.set_xlabel("RL wall clock (minutes, evaluations included)")
    top.set_ylabel("held-out success")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    summary = report["summary"]
    top.set_title(f"GRPO through treadle, synchronous vs max staleness "
                  f"{report['async']['config']['max_staleness']}: "
                  f"{summary['sync']['steps']} vs {summary['async']['steps']} steps")
    steps = report["async"]["steps"]
    x = [s["step"] + 1 for s in steps]
    mid.bar(x, [s["staleness_max"] for s in steps], color="#d62728", alpha=0.4,
            label="async: oldest trained token's lag (versions)")
    share = mid.twinx()
    share.plot(x, [s["stale_tokens"] / max(1, s["tokens"]) for s in steps], color="#d62728",
               label="async: share of stale tokens")
    share.set_ylim(0, 1)
    mid.set_ylabel("staleness (versions)")
    share.set_ylabel("stale token share")
    mid.legend(loc="upper left")
    share.legend(loc="upper right")
    for name, color in runs:
        rows = report[name]["steps"]
        low.semilogy([s["step"] + 1 for s in rows],
                     [max(s["logprob_gap_max"], 1e-9) for s in rows], color=color, lw=1,
                     label=f"{name}: max |Δ logprob| on its own version (parity)")
    low.semilogy(x, [max(s["stale_gap_mean"], 1e-9) for s in steps], color="#d62728",
                 ls="--", label="async: mean |Δ logprob| on stale tokens (drift)")
    low.set_xlabel("RL step")
    low.set_ylabel("|Δ logprob|")
    low.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
