"""Pictures of a run (matplotlib is optional: `pip install meshtrain[plots]`).

Figures are drawn on their own Agg canvas, not through pyplot: no global figure state or backend
switch, and a third less import time (pyplot loads its backends).
"""

from __future__ import annotations

from pathlib import Path


def _figure(width: float, height: float):
    """A figure on an Agg canvas, or None when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_loss_curve(rows: list[dict], out_file: Path) -> bool:
    """Training (and eval) loss against step; returns False when matplotlib is missing."""
    fig = _figure(7, 4)
    if fig is None:
        return False
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("meshtrain loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_file)
    return True


def plot_pipeline_timeline(stages: list[list[tuple]], out_file: Path, *, title: str) -> bool:
    """One row per pipeline stage, one box per forward/backward (or input- and weight-gradient
    half of a split backward) labelled with its micro-batch;
    white is idle. `stages` holds (kind, micro, chunk, start s, end s) events per stage.
    Returns False when matplotlib is missing."""
    fig = _figure(10, 0.7 * len(stages) + 1.3)
    if fig is None:
        return False
    from matplotlib.patches import Patch

    colours = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#c4a35a"}
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    shown = {kind for stage in stages for kind, *_ in stage if kind in colours}
    ax = fig.subplots()
    for s, stage in enumerate(stages):
        for kind, micro, chunk, start, end in stage:
            if kind not in colours:
                continue
            ax.barh(s, 1e3 * (end - start), left=1e3 * start, height=0.8, color=colours[kind],
                    edgecolor="white", linewidth=0.5)
            label = str(micro) if chunk == 0 else f"{micro}.{chunk}"
            ax.text(1e3 * (start + end) / 2, s, label, ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))])
    ax.invert_yaxis()  # stage 0 on top, as in the papers' figures
    ax.set_xlabel("time since the step's start (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=colours[kind], label=names[kind])
                       for kind in colours if kind in shown],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_file)
    return True
