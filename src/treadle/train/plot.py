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
