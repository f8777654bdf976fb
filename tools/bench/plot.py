"""``epd bench plot``: latency against request rate, one line per label (topology), from results JSON files.

A file holds one run (``epd bench --out``) or ``{"runs": [...]}`` (a sweep). Runs sent all at once (no
rate) are placed at the request throughput they achieved. Runs that name a ``workload`` get a row each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

PANELS = (("ttft_ms", "time to first token (ms)"), ("tpot_ms", "time per output token (ms)"),
          ("e2e_ms", "end-to-end latency (ms)"))


def load_runs(files: list[str]) -> list[dict]:
    runs = []
    for name in files:
        data = json.loads(Path(name).read_text())
        runs.extend(data["runs"] if "runs" in data else [data])
    return runs


def rate_of(run: dict) -> float:
    return run["request_rate"] if run.get("request_rate") else run["summary"]["request_throughput"]


def series(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by label, each group sorted by rate."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        groups[run.get("label") or "endpoint"].append(run)
    return {label: sorted(group, key=rate_of) for label, group in groups.items()}


def plot(runs: list[dict], out: str, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(run.get("workload", "") for run in runs))
    fig, axes = plt.subplots(len(workloads), len(PANELS), figsize=(5 * len(PANELS), 4 * len(workloads)),
                             constrained_layout=True, squeeze=False)
    for row, workload in zip(axes, workloads):
        draw_row(row, [r for r in runs if r.get("workload", "") == workload], workload)
    if title:
        fig.suptitle(title)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_row(axes, runs: list[dict], workload: str) -> None:
    for label, group in series(runs).items():
        rates = [rate_of(r) for r in group]
        for ax, (metric, _) in zip(axes, PANELS):
            line, = ax.plot(rates, [r["summary"][metric]["mean"] for r in group], marker="o", label=f"{label} mean")
            ax.plot(rates, [r["summary"][metric]["p99"] for r in group], linestyle="--", color=line.get_color(),
                    alpha=0.6, label=f"{label} p99")
    floors = [r["floor_ms"]["floor_ms"] for r in runs if r.get("floor_ms", {}).get("floor_ms")]
    if floors:  # the requests' own compute (bench/epd_vs_aggregated.py): what TTFT cannot beat
        axes[0].axhline(sum(floors) / len(floors), color="black", linestyle=":", label="floor")
    for ax, (_, name) in zip(axes, PANELS):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if workload:
            ax.set_title(workload, fontsize=10)
    axes[0].legend(fontsize=8)


def main(settings) -> int:
    runs = load_runs(settings.files)
    if not runs:
        raise SystemExit("epd bench plot: no runs in the given files")
    print(plot(runs, settings.out))
    return 0
