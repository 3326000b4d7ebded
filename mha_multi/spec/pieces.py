"""The generic path's batch in pieces on a CPU: how many, and the attention piece by piece.

On a CPU the generic path is bound by memory once its ``(B, H, Q, K)``
arrays (scores, masked scores, weights) outgrow the caches: each kernel
writes them out and the next reads them back, and a compiled program holds
several of them at once. Examples never mix, so pieces of the batch, taken
one after another, compute the same function with a piece's arrays held at
a time (docs: "Fast paths"). A GPU runs one large batched kernel best: there
the batch is one piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CPU_PIECE_BYTES", "batch_pieces", "in_pieces"]

#: The most bytes of float32 scores ``(b, H, Q, K)`` that one piece of the
#: batch holds on a CPU (see :func:`batch_pieces`).
CPU_PIECE_BYTES = 8 << 20


def batch_pieces(batch: int, example_bytes: int, budget: int = CPU_PIECE_BYTES) -> int:
    """How many pieces of the batch the generic path takes one after another on a CPU.

    Args:
        batch: ``B``.
        example_bytes: the bytes of one example's float32 scores, ``H*Q*K*4``.
        budget: the most bytes of a piece's scores.

    Returns:
        1 where the whole batch fits, else the smallest divisor of ``B``
        whose pieces fit (``B`` where none does).
    """
    if batch * example_bytes <= budget:
        return 1
    for pieces in range(2, batch):
        if batch % pieces == 0 and batch // pieces * example_bytes <= budget:
            return pieces
    return batch


def in_pieces(
    function: Callable[..., tuple[Any, ...]],
    arrays: Sequence[Any],
    pieces: int,
    map_pieces: Callable[[Callable[[tuple[Any, ...]], Any], tuple[Any, ...]], Any],
) -> tuple[Any, ...]:
    """``function(*arrays)`` on ``pieces`` pieces of the batch, one after another.

    Every array has the batch first (``None`` stays ``None``), and so does
    every output of ``function`` (a tuple; ``None`` entries kept).
    ``map_pieces(f, stacked)`` applies ``f`` to each piece of ``stacked``
    (arrays of ``(pieces, B / pieces, ...)``) and stacks the results: the
    framework's loop (JAX's ``lax.map``). Arrays are split and merged by their
    own ``reshape``.
    """
    batch = arrays[0].shape[0]

    def split(x: Any) -> Any:
        return None if x is None else x.reshape(pieces, batch // pieces, *x.shape[1:])

    def merge(x: Any) -> Any:
        return None if x is None else x.reshape(batch, *x.shape[2:])

    outputs = map_pieces(lambda piece: function(*piece), tuple(map(split, arrays)))
    return tuple(map(merge, outputs))
