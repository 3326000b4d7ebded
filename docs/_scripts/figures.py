"""Figures of the spec, drawn from ``mha_multi.spec`` itself at build time.

``write_all(directory)`` writes ``head_layout.png`` (what ``transpose_qkv``
does to a projection), ``head_grouping.png`` (grouped-query heads) and
``masks.png`` (the visibility rule for 1-D lengths, 2-D lengths and the
causal mask), ``cache_visibility.png`` (one cached call on a ragged
batch) and, from :mod:`head_exercise`, ``head_pruning.png`` with its tables
``head_pruning_*.inc``. Every coloured cell is computed by
the spec's own functions on the numpy adapter, so the pictures cannot drift
from the code.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import head_exercise
import numpy as np
from matplotlib import pyplot as plt
from matplotlib.colors import ListedColormap

from mha_multi import spec

OPS = spec.NumpyOps()
HEAD_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def _draw_grid(
    axis, colors, labels, *, title: str, row_labels, column_labels, aspect: str = "equal"
) -> None:
    rows, columns = len(labels), len(labels[0])
    for r in range(rows):
        for c in range(columns):
            axis.add_patch(
                plt.Rectangle((c, rows - 1 - r), 1, 1, facecolor=colors[r][c], edgecolor="white")
            )
            axis.text(
                c + 0.5,
                rows - 0.5 - r,
                labels[r][c],
                ha="center",
                va="center",
                fontsize=6.5,
                color="white",
            )
    axis.set_xlim(0, columns)
    axis.set_ylim(0, rows)
    axis.set_xticks(np.arange(columns) + 0.5, column_labels, fontsize=7)
    axis.set_yticks(np.arange(rows) + 0.5, list(reversed(row_labels)), fontsize=7)
    axis.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        axis.spines[side].set_visible(False)
    axis.set_title(title, fontsize=9)
    axis.set_aspect(aspect)


def _saved(figure, path: Path) -> Path:
    """Writes ``figure`` to ``path`` and frees it (the docs build draws several in one process)."""
    figure.savefig(path, dpi=140)
    plt.close(figure)
    return path


def head_layout(path: Path, batch: int = 2, length: int = 3, num_heads: int = 3) -> Path:
    """``(B, T, H*dh) -> (B*H, T, dh)``: each cell keeps its (example, position, head)."""
    head_dim = 2
    shape = (batch, length, num_heads * head_dim)
    b, t, f = np.indices(shape)
    head = f // head_dim
    # The spec moves index arrays exactly as it moves a projection.
    moved = {
        name: OPS.cast(spec.transpose_qkv(OPS, index, num_heads), np.int64)
        for name, index in (("b", b), ("t", t), ("h", head), ("f", f % head_dim))
    }
    assert moved["b"].shape == (batch * num_heads, length, head_dim)

    figure, (left, right) = plt.subplots(
        1, 2, figsize=(8.6, 4.6), gridspec_kw={"width_ratios": [3.0, 1.9]}, layout="constrained"
    )
    colors = [
        [HEAD_COLORS[head[i, j, k]] for k in range(shape[2])]
        for i in range(batch)
        for j in range(length)
    ]
    labels = [[f"b{i} t{j}" for _ in range(shape[2])] for i in range(batch) for j in range(length)]
    _draw_grid(
        left,
        colors,
        labels,
        title=f"projection (B, T, H*dh) = {shape}\nrows b, t; columns grouped by head",
        row_labels=[f"b={i}, t={j}" for i in range(batch) for j in range(length)],
        column_labels=[f"h{k // head_dim}:{k % head_dim}" for k in range(shape[2])],
    )
    rows = batch * num_heads
    colors = [
        [HEAD_COLORS[moved["h"][r, j, k]] for k in range(head_dim)]
        for r in range(rows)
        for j in range(length)
    ]
    labels = [
        [f"b{moved['b'][r, j, k]} t{moved['t'][r, j, k]}" for k in range(head_dim)]
        for r in range(rows)
        for j in range(length)
    ]
    _draw_grid(
        right,
        colors,
        labels,
        title=f"transpose_qkv: (B*H, T, dh) = {moved['b'].shape}\nflat row = b*H + h",
        row_labels=[
            f"row {r} (b{r // num_heads} h{r % num_heads}), t={j}"
            for r in range(rows)
            for j in range(length)
        ],
        column_labels=[f"d{k}" for k in range(head_dim)],
        aspect="auto",
    )
    for r in range(1, rows):
        right.axhline(r * length, color="black", lw=1.2)
    return _saved(figure, path)


def head_grouping(
    path: Path, length: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 2
) -> Path:
    """Grouped-query attention: which key/value head each query head reads, and
    the grouped layout :func:`mha_multi.spec.transpose_grouped_queries` builds."""
    group = num_heads // num_kv_heads
    shape = (1, length, num_heads * head_dim)
    _, t, f = np.indices(shape)
    moved = {
        name: OPS.cast(spec.transpose_grouped_queries(OPS, index, num_kv_heads, group), np.int64)
        for name, index in (("t", t), ("h", f // head_dim))
    }
    rows, grouped_length, _ = moved["h"].shape  # (B*H_kv, G*Q, dh)

    figure, (left, middle, right) = plt.subplots(
        1,
        3,
        figsize=(9.6, 3.4),
        gridspec_kw={"width_ratios": [num_heads * head_dim, num_kv_heads * head_dim, 4.0]},
        layout="constrained",
    )
    _draw_grid(
        left,
        [[HEAD_COLORS[(k // head_dim) // group] for k in range(shape[2])] for _ in range(length)],
        [[f"h{k // head_dim}" for k in range(shape[2])] for _ in range(length)],
        title=f"queries: {num_heads} heads\n(colour: the key/value head read)",
        row_labels=[f"t={j}" for j in range(length)],
        column_labels=[f"h{k // head_dim}:{k % head_dim}" for k in range(shape[2])],
    )
    _draw_grid(
        middle,
        [[HEAD_COLORS[k // head_dim] for k in range(num_kv_heads * head_dim)] for _ in range(3)],
        [[f"kv{k // head_dim}" for k in range(num_kv_heads * head_dim)] for _ in range(3)],
        title=f"keys, values:\n{num_kv_heads} heads",
        row_labels=[f"key {j}" for j in range(3)],
        column_labels=[f"kv{k // head_dim}:{k % head_dim}" for k in range(num_kv_heads * head_dim)],
    )
    _draw_grid(
        right,
        [
            [HEAD_COLORS[moved["h"][r, i, 0] // group] for _ in range(head_dim)]
            for r in range(rows)
            for i in range(grouped_length)
        ],
        [
            [f"h{moved['h'][r, i, 0]} t{moved['t'][r, i, 0]}" for _ in range(head_dim)]
            for r in range(rows)
            for i in range(grouped_length)
        ],
        title=f"grouped queries\n(B*H_kv, G*Q, dh) = {moved['h'].shape}",
        row_labels=[f"kv{r} row {i}" for r in range(rows) for i in range(grouped_length)],
        column_labels=[f"d{k}" for k in range(head_dim)],
        aspect="auto",
    )
    for r in range(1, rows):
        right.axhline(r * grouped_length, color="black", lw=1.2)
    return _saved(figure, path)


def _visible(num_queries: int, num_keys: int, valid_lens, causal: bool = False) -> np.ndarray:
    """``(B, Q, K)`` booleans from :func:`mha_multi.spec.visibility`."""
    batch = 1 if valid_lens is None else len(valid_lens)
    lens = None if valid_lens is None else np.asarray(valid_lens)
    visible = spec.visibility(OPS, num_queries, num_keys, lens, causal=causal)
    if visible is None:
        return np.ones((batch, num_queries, num_keys), bool)
    return np.broadcast_to(visible, (batch, 1, num_queries, num_keys))[:, 0]


def masks(path: Path) -> Path:
    """Which key each query sees, for the three ways of hiding keys and their AND."""
    panels = [
        ("1-D valid_lens = [3, 2]\nexample 0 (len 3)", _visible(4, 6, [3, 2])[0]),
        ("1-D valid_lens = [3, 2]\nexample 1 (len 2)", _visible(4, 6, [3, 2])[1]),
        ("2-D valid_lens[b] =\n[1, 4, 0, 6]", _visible(4, 6, [[1, 4, 0, 6]])[0]),
        ("causal, Q = K = 4", _visible(4, 4, None, causal=True)[0]),
        (
            "causal, Q = 4, K = 6\n(bottom-right aligned)",
            _visible(4, 6, None, causal=True)[0],
        ),
        ("causal AND\nvalid_lens = [4]", _visible(4, 6, [4], causal=True)[0]),
    ]
    # Every panel must agree with the rule written out by hand.
    q, k = np.indices((4, 6))
    assert (panels[0][1] == (k < 3)).all() and (panels[4][1] == (k <= q + 2)).all()
    figure, axes = plt.subplots(1, len(panels), figsize=(13.5, 3.0), layout="constrained")
    cmap = ListedColormap(["#e8e8e8", "#4c72b0"])
    for axis, (title, visible) in zip(axes, panels, strict=True):
        axis.imshow(visible, cmap=cmap, vmin=0, vmax=1)
        num_queries, num_keys = visible.shape
        axis.set_xticks(range(num_keys))
        axis.set_yticks(range(num_queries))
        axis.set_xticks(np.arange(num_keys + 1) - 0.5, minor=True)
        axis.set_yticks(np.arange(num_queries + 1) - 0.5, minor=True)
        axis.grid(which="minor", color="white", lw=1.5)
        axis.tick_params(which="both", length=0, labelsize=7)
        axis.set_xlabel("key j", fontsize=8)
        axis.set_title(title, fontsize=8.5)
        for i in range(num_queries):
            if not visible[i].any():
                axis.text(
                    num_keys / 2 - 0.5,
                    i,
                    "all hidden: 1/K each",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="#c44e52",
                )
    axes[0].set_ylabel("query i", fontsize=8)
    figure.suptitle(
        "Visible keys (blue) per query; hidden scores are replaced by -1e6", fontsize=10
    )
    return _saved(figure, path)


def cache_visibility(
    path: Path,
    held: tuple[int, ...] = (3, 0, 5),
    new: tuple[int, ...] = (2, 3, 1),
    num_new: int = 3,
    max_length: int = 8,
) -> Path:
    """One cached call on a ragged batch: what each example's queries see of its cache.

    The lengths come from :func:`mha_multi.spec.update_cache` and the cells
    from :func:`mha_multi.spec.visibility`, as every backend computes them.
    """
    batch, kv_heads = len(held), 1
    cache = spec.KVCache(
        np.zeros((batch, kv_heads, max_length, 1)),
        np.zeros((batch, kv_heads, max_length, 1)),
        np.array(held, np.int32),
    )
    rows = np.ones((batch, num_new, 1))
    updated, lens = spec.update_cache(
        OPS, cache, rows, rows, np.array(new), head_dim=1, causal=True
    )
    visible = np.broadcast_to(
        spec.visibility(OPS, num_new, max_length, lens), (batch, 1, num_new, max_length)
    )[:, 0]
    # The rule of the docs, by hand: j < L + n and j <= L + i.
    i, j = np.indices((num_new, max_length))
    for b in range(batch):
        expected = (j < held[b] + new[b]) & (j <= held[b] + np.minimum(i, new[b] - 1))
        real = i < new[b]
        assert (visible[b][real[:, 0]] == expected[real[:, 0]]).all()
    assert updated.lengths.tolist() == [h + n for h, n in zip(held, new, strict=True)]
    figure, axes = plt.subplots(1, batch, figsize=(12.5, 2.6), layout="constrained")
    for b, axis in enumerate(axes):
        colors, labels = [], []
        for query in range(num_new):
            row_colors, row_labels = [], []
            for key in range(max_length):
                old = key < held[b]
                written = held[b] <= key < held[b] + new[b]
                if visible[b, query, key]:
                    row_colors.append(HEAD_COLORS[0] if old else HEAD_COLORS[2])
                    row_labels.append("held" if old else "new")
                else:
                    row_colors.append("#d0d0d0" if (old or written) else "#eeeeee")
                    row_labels.append("")
            if query >= new[b]:
                row_colors = ["#c9a66b"] * max_length
                row_labels = [""] * max_length
                row_labels[max_length // 2] = "padding: output unused, key not kept"
            colors.append(row_colors)
            labels.append(row_labels)
        _draw_grid(
            axis,
            colors,
            labels,
            title=(
                f"example {b}: lengths {held[b]}, valid_lens {new[b]}\n"
                f"writes positions {held[b]}..{held[b] + new[b] - 1}"
                if new[b]
                else f"example {b}: lengths {held[b]}, nothing new"
            ),
            row_labels=[
                f"query {q} (pos {held[b] + q})" if q < new[b] else f"query {q}"
                for q in range(num_new)
            ],
            column_labels=[str(k) for k in range(max_length)],
        )
        axis.set_xlabel("cache position j", fontsize=8)
    figure.suptitle(
        f"One cached call (T = {num_new}, causal): held keys (blue), the call's new keys "
        "(green); grey is hidden",
        fontsize=10,
    )
    return _saved(figure, path)


def positions_and_biases(path: Path, length: int = 6, window: int = 3) -> Path:
    """What each option does to one head's scores (docs: "Positions and biases")."""
    causal = _visible(length, length, None, causal=True)[0]
    windowed = spec.visibility(OPS, length, length, None, causal=True, window=window)
    windowed = np.broadcast_to(windowed, (length, length))
    q, k = np.indices((length, length))
    assert (windowed == ((k <= q) & (q - k < window))).all()  # the rule written out
    slopes = spec.alibi_slopes(8)
    options = spec.ScoreOptions(alibi_slopes=slopes)
    alibi = spec.score_bias(OPS, options, length, length, np.zeros((1,)))  # (H, Q, K)
    assert np.allclose(alibi[0], slopes[0] * (k - q))
    figure, axes = plt.subplots(1, 4, figsize=(13.5, 3.2), layout="constrained")
    cmap = ListedColormap(["#e8e8e8", "#4c72b0"])
    panels = [("causal", causal), (f"causal, window={window}", windowed)]
    for axis, (title, visible) in zip(axes[:2], panels, strict=True):
        axis.imshow(visible, cmap=cmap, vmin=0, vmax=1)
        axis.set_title(title, fontsize=8.5)
    for axis, head in zip(axes[2:3], (0,), strict=True):
        shown = np.where(causal, alibi[head], np.nan)
        image = axis.imshow(shown, cmap="magma")
        figure.colorbar(image, ax=axis, shrink=0.8)
        axis.set_title(
            f"alibi: bias of head {head} (slope {slopes[head]:g})\nadded where visible",
            fontsize=8.5,
        )
    for axis in axes[:3]:
        axis.set_xlabel("key j", fontsize=8)
        axis.tick_params(labelsize=7)
    axes[0].set_ylabel("query i", fontsize=8)
    scores = np.linspace(-6, 6, 200)
    for cap in (1.0, 3.0):
        capped = spec.adjust_scores(OPS, scores[None, None, None], spec.ScoreOptions(softcap=cap))
        axes[3].plot(scores, capped[0, 0, 0], label=f"softcap={cap:g}")
    axes[3].plot(scores, scores, color="#999999", lw=0.8, ls="--", label="none")
    axes[3].set_xlabel("scaled score", fontsize=8)
    axes[3].set_title("softcap * tanh(score / softcap)", fontsize=8.5)
    axes[3].legend(fontsize=7)
    figure.suptitle(
        "Visible keys (blue), the ALiBi bias and the soft cap: options of one head's scores",
        fontsize=10,
    )
    return _saved(figure, path)


def write_all(directory: str | Path) -> list[Path]:
    """Writes every figure into ``directory`` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        head_layout(directory / "head_layout.png"),
        head_grouping(directory / "head_grouping.png"),
        masks(directory / "masks.png"),
        cache_visibility(directory / "cache_visibility.png"),
        positions_and_biases(directory / "positions_and_biases.png"),
        # d2l's exercise on head importance, run at build time (docs: "Heads").
        *head_exercise.write_all(directory),
    ]


if __name__ == "__main__":
    import sys

    for written in write_all(sys.argv[1] if len(sys.argv) > 1 else "_generated"):
        print(written)
