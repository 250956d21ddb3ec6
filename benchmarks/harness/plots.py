"""PNG plots: step time over eager's against measured peak, one figure per model.

Every measured configuration is a point (x: measured peak as a share of
eager's, y: median time ratio); the budgets are dashed vertical lines. A
method that reaches further left at a lower height is better.
"""
from __future__ import annotations

from pathlib import Path

from benchmarks.harness.runner import ModelResult

_MARKERS = "osD^vP*X"


def plot_model(res: ModelResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for i, method in enumerate(res.methods):
        seen: list[int] = []
        xs, ys = [], []
        for cell in res.cells:
            cand = cell.candidate
            if cell.method != method or cand is None or cand.peak is None or cand.time_ratio is None:
                continue
            if id(cand) in seen:
                continue
            seen.append(id(cand))
            xs.append(cand.peak / res.eager_peak)
            ys.append(cand.time_ratio)
        if xs:
            pts = sorted(zip(xs, ys))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=_MARKERS[i % len(_MARKERS)],
                    linestyle="-" if len(pts) > 1 else "none", label=method, alpha=0.85)
    for label, b in res.budgets:
        ax.axvline(b / res.eager_peak, color="grey", linestyle="--", linewidth=0.8)
        ax.text(b / res.eager_peak, 1.0, f" {label}", color="grey", fontsize=7, va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("measured peak / eager's measured peak")
    ax.set_ylabel("step time / eager's (median)")
    ax.set_title(f"{res.spec.label}: eager peak {res.eager_peak / 1e6:.0f} MB", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
