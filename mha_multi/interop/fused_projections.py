"""The fused projections of transformers' attention blocks: which entry holds which of q, k, v.

Some families compute their query, key and value projections with one
``Linear`` whose output rows are the projections' rows one after the other
(Phi-3's ``qkv_proj``: the query's ``num_heads * head_dim`` rows, then the
key's and the value's ``num_kv_heads * head_dim``). :data:`FUSED_PROJECTIONS`
lists them by model type, once; the Llama-style converters
(:mod:`mha_multi.interop.llama`) split such an entry into the canonical
``W_q``, ``W_k``, ``W_v`` (and biases) on the way in and join them on the
way out (docs: "Porting weights"). Another family that fuses its projections
so is one more entry of the table.

Works on any arrays that slice by rows (numpy arrays, torch tensors);
joining takes numpy arrays. Imports no framework.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = [
    "FUSED_PROJECTIONS",
    "FusedProjection",
    "fused_layout_of",
    "fused_projection",
    "join_fused",
    "split_fused",
]


@dataclass(frozen=True)
class FusedProjection:
    """One module of a state dict whose output rows hold several projections, one after the other.

    Attributes:
        module: the fused module's name (``"qkv_proj"``); its ``weight`` (and
            ``bias``, where the family has one) are split.
        parts: the canonical projections its rows hold, in order
            (``("q", "k", "v")``). The query's part has ``num_heads *
            head_dim`` rows (as many as the output projection has columns),
            a key's or a value's ``num_kv_heads * head_dim``.
    """

    module: str
    parts: tuple[str, ...]


#: Model type -> its fused projection: the families whose attention state
#: dicts fuse projections, and in which order. Their other projections keep
#: Llama's names (``o_proj``).
FUSED_PROJECTIONS: Mapping[str, FusedProjection] = MappingProxyType(
    {
        # Phi-3 (and Phi-4 mini, of the same model type): query, key, value rows.
        "phi3": FusedProjection("qkv_proj", ("q", "k", "v")),
    }
)


def fused_projection(layout: str) -> FusedProjection:
    """The fused projection of model type ``layout``.

    Raises:
        ValueError: no family of :data:`FUSED_PROJECTIONS` is called so.
    """
    try:
        return FUSED_PROJECTIONS[layout]
    except KeyError:
        raise ValueError(
            f"unknown fused layout {layout!r}; the fused layouts are {', '.join(FUSED_PROJECTIONS)}"
        ) from None


def fused_layout_of(names: Iterable[str]) -> str | None:
    """The model type whose fused module's ``weight`` is among ``names`` (entries without prefix).

    Returns:
        A key of :data:`FUSED_PROJECTIONS`, or ``None`` for separate projections.
    """
    present = set(names)
    return next(
        (
            layout
            for layout, fused in FUSED_PROJECTIONS.items()
            if f"{fused.module}.weight" in present
        ),
        None,
    )


def _split_rows(fused: FusedProjection, array: Any, query_rows: int, name: str) -> dict[str, Any]:
    """The rows of a fused weight or bias, by canonical projection.

    Raises:
        ValueError: rows that a query part of ``query_rows`` rows and equal
            key/value parts do not fill.
    """
    rows = int(array.shape[0])
    queries = fused.parts.count("q")
    others = len(fused.parts) - queries
    rest = rows - queries * query_rows
    if rest <= 0 or rest % others:
        raise ValueError(
            f"{name} has {rows} rows, which a query part of {query_rows} rows (the output "
            f"projection's columns) and {others} equal key/value parts cannot fill"
        )
    sizes = [query_rows if part == "q" else rest // others for part in fused.parts]
    starts = np.cumsum([0, *sizes])
    return {
        part: array[int(start) : int(start) + size]
        for part, start, size in zip(fused.parts, starts, sizes, strict=False)
    }


def split_fused(
    entries: Mapping[str, Any], modules: Mapping[str, str], *, prefix: str = ""
) -> dict[str, Any]:
    """``entries`` with a fused projection's ``weight`` and ``bias`` split into separate modules'.

    The query part's rows are counted by the output projection's columns,
    so no head layout is needed: its weight is ``(hidden, num_heads *
    head_dim)``.

    Args:
        entries: one block's state dict, its entry names without prefix.
        modules: canonical projection -> its separate module's name
            (``{"q": "q_proj", ..., "o": "o_proj"}``).
        prefix: the block's prefix, for messages.

    Returns:
        The entries, the fused ones replaced by the separate modules'
        (views of the same arrays); ``entries`` as they are when no module
        of :data:`FUSED_PROJECTIONS` is among them. Other entries of the
        fused module stay, for the caller to refuse.

    Raises:
        ValueError: a fused entry beside a separate entry of one of its
            parts, no output projection, or rows that do not split.
    """
    layout = fused_layout_of(entries)
    if layout is None:
        return dict(entries)
    fused = FUSED_PROJECTIONS[layout]
    kinds = ("weight", "bias")
    clashes = sorted(
        prefix + f"{modules[part]}.{kind}"
        for part in fused.parts
        for kind in kinds
        if f"{modules[part]}.{kind}" in entries
    )
    if clashes:
        raise ValueError(
            f"{prefix}{fused.module}.weight holds the projections {list(fused.parts)} ({layout}'s "
            f"layout); the state dict also has {clashes}"
        )
    output = entries.get(f"{modules['o']}.weight")
    if output is None or len(output.shape) != 2:
        raise ValueError(
            f"the fused {prefix}{fused.module}.weight is split by the columns of "
            f"{prefix}{modules['o']}.weight, a matrix, which the state dict "
            + ("is missing" if output is None else f"has of shape {tuple(output.shape)}")
        )
    split = {name: value for name, value in entries.items()}
    for kind in kinds:
        name = f"{fused.module}.{kind}"
        if name in split:
            parts = _split_rows(fused, split.pop(name), int(output.shape[1]), prefix + name)
            split.update({f"{modules[part]}.{kind}": rows for part, rows in parts.items()})
    return split


def join_fused(
    state: Mapping[str, np.ndarray], modules: Mapping[str, str], layout: str
) -> dict[str, np.ndarray]:
    """A state dict of separate projections with the parts of ``layout``'s fused module joined.

    Args:
        state: numpy arrays under the separate modules' names.
        modules: canonical projection -> its separate module's name.
        layout: a key of :data:`FUSED_PROJECTIONS`.

    Returns:
        The state dict of ``layout``: the fused module's ``weight`` (and its
        ``bias`` where every part has one) in place of its parts'.

    Raises:
        ValueError: an unknown layout, or biases on some of its parts only.
    """
    fused = fused_projection(layout)
    joined = dict(state)
    for kind in ("weight", "bias"):
        names = [f"{modules[part]}.{kind}" for part in fused.parts]
        present = [name for name in names if name in joined]
        if not present:
            continue
        if len(present) != len(names):
            raise ValueError(
                f"{layout}'s {fused.module} fuses {list(fused.parts)}: a {kind} on "
                f"{present} only cannot be joined"
            )
        joined[f"{fused.module}.{kind}"] = np.concatenate([joined.pop(n) for n in names])
    return joined
