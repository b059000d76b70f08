"""Pictures of a run (matplotlib is optional: `pip install meshtrain[plots]`)."""

from __future__ import annotations

from pathlib import Path


def plot_loss_curve(rows: list[dict], out_file: Path) -> bool:
    """Training (and eval) loss against step; returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
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
    plt.close(fig)
    return True
