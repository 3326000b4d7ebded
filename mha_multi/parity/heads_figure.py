"""``heads.png``: the book example's attention weights, one heatmap per head and backend."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mha_multi.parity.cases import Case


def plot_heads(
    results_dir: str | os.PathLike[str], book: Case, path: str | os.PathLike[str]
) -> Path | None:
    """Draws every backend's float32 CPU attention weights for the book example.

    One row per backend, one column per (example, head); a dashed line marks
    each example's ``valid_lens``. Returns the path, or ``None`` when there is
    nothing to draw.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    results = Path(results_dir)
    rows = []
    for backend_dir in sorted(p for p in results.iterdir() if p.is_dir()):
        result = backend_dir / "cpu__float32__book.npz"
        if result.exists():
            with np.load(result, allow_pickle=False) as file:
                rows.append((backend_dir.name, file["attention_weights"]))
    if not rows:
        return None
    rows.insert(0, ("reference (float64)", book.reference["attention_weights"]))
    batch, num_heads, num_queries, num_keys = rows[0][1].shape
    lens = book.valid_lens
    figure, axes = plt.subplots(
        len(rows),
        batch * num_heads,
        figsize=(1.3 * batch * num_heads + 1.5, 1.0 * len(rows) + 0.8),
        squeeze=False,
        sharex=True,
        sharey=True,
        layout="constrained",
    )
    image = None
    for row, (name, weights) in enumerate(rows):
        for b in range(batch):
            for h in range(num_heads):
                axis = axes[row, b * num_heads + h]
                image = axis.imshow(weights[b, h], vmin=0.0, vmax=1.0, cmap="Reds")
                if lens is not None and lens.ndim == 1:
                    axis.axvline(float(lens[b]) - 0.5, color="tab:blue", linestyle="--", lw=1)
                if row == 0:
                    length = "" if lens is None else f", len {lens[b]}"
                    axis.set_title(f"example {b}{length}\nhead {h}", fontsize=7)
                axis.set_xticks(range(num_keys))
                axis.set_yticks(range(num_queries))
                axis.tick_params(labelsize=5)
            axes[row, 0].set_ylabel(name, fontsize=7)
    figure.suptitle(
        "Attention weights of d2l's example (keys right of the dashed line are hidden)",
        fontsize=9,
    )
    figure.colorbar(image, ax=axes, shrink=0.8, pad=0.01)
    path = Path(path)
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return path
