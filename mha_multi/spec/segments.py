"""Packed sequences: which keys a segment id lets a query see, restarting positions, converters.

A row of ``segment_ids`` holds several sequences one after another: query
``i`` sees key ``j`` only when their ids are equal, and a negative id is
padding, which sees and is seen by nothing (its row is fully hidden: the
spec's uniform weights). Rotary positions restart at each sequence. The
converters (numpy) go to and from FlashAttention's ``cu_seqlens``,
transformers' restarting position ids and lists of lengths (docs: "Packed
sequences").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mha_multi.spec.ops import Array, ArrayOps

#: The id of a padding position in what the converters write.
PADDING_ID = -1


def split_segment_ids(segment_ids: Any) -> tuple[Any, Any]:
    """``(query_ids, key_ids)`` of a call's ``segment_ids``.

    One array (or nested lists) serves the queries and the keys of
    self-attention; a tuple of two arrays ``(query_ids, key_ids)`` gives the
    keys their own, as cross-attention needs.
    """
    if (
        isinstance(segment_ids, tuple)
        and len(segment_ids) == 2
        and all(hasattr(ids, "shape") for ids in segment_ids)
    ):
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


def check_segment_ids(
    ids_shape: Sequence[int],
    ids_kind: str,
    *,
    batch: int,
    length: int,
    which: str = "queries",
) -> None:
    """Validates one side of ``segment_ids``: integer ``(B, N)``.

    Args:
        ids_shape: the ids' shape.
        ids_kind: their numpy dtype kind.
        batch: ``B``.
        length: ``N``: the queries ``Q`` or the keys ``K``.
        which: ``"queries"`` or ``"keys"``, for the message.

    Raises:
        TypeError: the ids are not integers (floating or boolean ids).
        ValueError: another shape.
    """
    check_segment_ids_kind(ids_kind, which)
    shape = tuple(ids_shape)
    if shape != (batch, length):
        hint = ""
        if which == "queries":
            hint = " (give (query_ids, key_ids) where the keys have ids of their own)"
        raise ValueError(
            f"segment_ids of the {which} must have shape (batch, {which}) = "
            f"({batch}, {length}); got {shape}{hint}"
        )


def check_segment_ids_kind(ids_kind: str, which: str = "queries") -> None:
    """Raises ``TypeError`` unless one side's ids (``which``) are integers, whose numpy
    dtype kind is ``ids_kind`` (:func:`check_segment_ids`' first check)."""
    if ids_kind not in "iu":
        raise TypeError(
            f"segment_ids must be integers (an id per position, negative for padding); "
            f"got dtype kind {ids_kind!r} for the {which}"
        )


def _equal(ops: ArrayOps, a: Array, b: Array) -> Array:
    return ops.logical_and(ops.greater_equal(a, b), ops.greater_equal(b, a))


def segment_visibility(ops: ArrayOps, query_ids: Array, key_ids: Array) -> Array:
    """Which keys each query may see by its segment: boolean ``(B, 1, Q, K)``.

    Key ``j`` is visible to query ``i`` iff ``query_ids[b, i] ==
    key_ids[b, j]`` and that id is not negative (padding sees nothing).
    """
    key_ids = ops.cast(key_ids, ops.dtype(query_ids))
    same = _equal(ops, ops.expand_dims(query_ids, -1), ops.expand_dims(key_ids, 1))  # (B, Q, K)
    real = ops.greater_equal(query_ids, query_ids * 0)  # (B, Q)
    return ops.expand_dims(ops.logical_and(same, ops.expand_dims(real, -1)), 1)


def segment_positions(ops: ArrayOps, ids: Array) -> Array:
    """Positions that restart at each sequence: ``(B, N)`` integers.

    Position ``i`` counts the earlier positions of its row with its id, so
    a sequence's positions are ``0, 1, ...`` wherever it starts (for ids
    that run contiguously, as every converter writes them); padding's
    (negative ids) are 0, as :func:`restarting_positions` gives them, so that
    a call's length is its longest sequence's, however long its padding
    (a rotary type of the call's length reads it). Counted in float32, exact
    for rows of up to ``2**24`` positions.
    """
    steps = ops.arange(ops.size(ids, 1))
    same = _equal(ops, ops.expand_dims(ids, -1), ops.expand_dims(ids, 1))  # (B, N, N)
    earlier = ops.less(ops.expand_dims(steps, 0), ops.expand_dims(steps, -1))  # j < i
    counted = ops.cast(ops.logical_and(same, earlier), ops.float32())
    # A column of ones from the steps themselves: no host constant of a size
    # that a graph may not know.
    ones = ops.expand_dims(ops.cast(ops.greater_equal(steps, steps), ops.float32()), -1)
    counts = ops.merge_axes(ops.swap_last(ops.matmul(counted, ones)), 1)  # (B, N)
    real = ops.greater_equal(ids, ids * 0)
    return ops.cast(ops.where(real, counts, counts * 0.0), ops.dtype(steps))


def segment_runs(segment_ids: Any) -> list[list[tuple[int, int]]]:
    """Each row's sequences as ``(start, stop)`` index ranges, in order.

    Raises:
        TypeError: the ids are not integers.
        ValueError: not ``(B, N)``, or an id that is not one contiguous run
            of its row (``[0, 1, 0]``).
    """
    ids = np.asarray(segment_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"segment_ids must be integers; got dtype kind {ids.dtype.kind!r}")
    if ids.ndim != 2:
        raise ValueError(f"segment_ids must have shape (batch, length); got {ids.shape}")
    rows = []
    for b, row in enumerate(ids):
        runs: list[tuple[int, int]] = []
        seen: set[int] = set()
        start = 0
        for i in range(1, len(row) + 1):
            if i < len(row) and row[i] == row[start]:
                continue
            value = int(row[start])
            if value >= 0:
                if value in seen:
                    raise ValueError(
                        f"segment_ids must hold each sequence as one contiguous run; id "
                        f"{value} of row {b} runs again from position {start}"
                    )
                seen.add(value)
                runs.append((start, i))
            start = i
        rows.append(runs)
    return rows


def segment_ids_from_lengths(
    lengths: Sequence[Sequence[int]], length: int | None = None
) -> np.ndarray:
    """``(B, N)`` int32 ids of rows packed from lists of sequence lengths.

    Row ``b`` holds ``len(lengths[b])`` sequences, numbered from 0, one after
    another, and padding (:data:`PADDING_ID`) up to ``length`` (default: the
    longest row's total).

    Raises:
        ValueError: a negative length, or a row longer than ``length``.
    """
    totals = [sum(int(n) for n in row) for row in lengths]
    length = max(totals, default=0) if length is None else int(length)
    ids = np.full((len(lengths), length), PADDING_ID, dtype=np.int32)
    for b, row in enumerate(lengths):
        if any(int(n) < 0 for n in row):
            raise ValueError(f"sequence lengths must not be negative; got {list(row)}")
        if totals[b] > length:
            raise ValueError(f"row {b} holds {totals[b]} positions, more than {length}")
        ids[b, : totals[b]] = np.repeat(np.arange(len(row)), [int(n) for n in row])
    return ids


def segment_ids_from_cu_seqlens(cu_seqlens: Any, length: int | None = None) -> np.ndarray:
    """``(1, N)`` ids of FlashAttention's varlen layout: every sequence in one row.

    ``cu_seqlens`` is ``(n + 1,)``: ``0``, then the cumulative lengths;
    positions past ``cu_seqlens[-1]`` (up to ``length``) are padding.

    Raises:
        ValueError: not 1-D, not starting at 0, or decreasing.
    """
    bounds = np.asarray(cu_seqlens)
    if bounds.ndim != 1 or bounds.size == 0 or bounds[0] != 0 or np.any(np.diff(bounds) < 0):
        raise ValueError(
            f"cu_seqlens must be 1-D, start at 0 and not decrease; got {bounds.tolist()}"
        )
    return segment_ids_from_lengths([np.diff(bounds).tolist()], length)


def cu_seqlens_from_segment_ids(segment_ids: Any) -> np.ndarray:
    """FlashAttention's ``cu_seqlens`` (int32 ``(n + 1,)``) of the sequences of ``segment_ids``.

    The sequences of every row, row by row, as the varlen layout holds them
    once the padding is dropped.

    Raises:
        TypeError, ValueError: as :func:`segment_runs`.
    """
    lengths = [stop - start for row in segment_runs(segment_ids) for start, stop in row]
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def segment_ids_from_position_ids(position_ids: Any) -> np.ndarray:
    """``(B, N)`` int32 ids from transformers' restarting position ids.

    transformers' rule (``DataCollatorWithFlattening`` writes ``0, 1, ...,
    0, 1, ...``): a sequence starts wherever a position is not the one
    before it plus 1, and at the start of each row.

    Raises:
        TypeError: not integers.
        ValueError: not ``(B, N)``.
    """
    positions = np.asarray(position_ids)
    if positions.dtype.kind not in "iu":
        raise TypeError(f"position_ids must be integers; got dtype kind {positions.dtype.kind!r}")
    if positions.ndim != 2:
        raise ValueError(f"position_ids must have shape (batch, length); got {positions.shape}")
    positions = positions.astype(np.int64)
    starts = np.ones(positions.shape, dtype=bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return (np.cumsum(starts, axis=1) - 1).astype(np.int32)


def restarting_positions(segment_ids: Any) -> np.ndarray:
    """The restarting position ids of ``segment_ids`` (transformers' packed batches).

    Padding positions get 0.

    Raises:
        TypeError, ValueError: as :func:`segment_runs`.
    """
    ids = np.asarray(segment_ids)
    positions = np.zeros(ids.shape, dtype=np.int64)
    for b, row in enumerate(segment_runs(ids)):
        for start, stop in row:
            positions[b, start:stop] = np.arange(stop - start)
    return positions


#: The range of int32 ids, which :func:`int32_segment_ids` keeps as they are.
_INT32 = np.iinfo(np.int32)


def int32_segment_ids(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Integer ids given on the host (every array of one call's ids: the queries' and
    the keys' where given apart) as int32 arrays of the same segments.

    What every framework's integers hold (JAX's are int32 without x64, MXNet
    has no int16 or uint32 arrays), with the same meaning: ids within int32
    as they are; otherwise padding (negative ids) as -1 and every other id as
    its rank among the call's ids, so that ids equal before are equal after
    and others differ (uint64's ``2**64 - 1`` is an id, not padding; int64's
    ``2**32`` stays apart from 0).
    """
    if all(array.dtype == np.int32 for array in arrays):
        return list(arrays)
    filled = [array for array in arrays if array.size]
    if all(_INT32.min <= array.min() and array.max() <= _INT32.max for array in filled):
        return [array.astype(np.int32) for array in arrays]
    # (Python integers: numpy would compare uint64 with int64 as float64.)
    exact = [array.astype(object) for array in arrays]
    ranks = {
        value: rank
        for rank, value in enumerate(sorted({v for a in exact for v in a.ravel() if v >= 0}))
    }
    return [
        np.array([ranks.get(v, PADDING_ID) for v in a.ravel()], np.int32).reshape(a.shape)
        for a in exact
    ]


def checked_segment_ids(
    segment_ids: Any, *, batch: int, num_queries: int, num_keys: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """A call's ``segment_ids`` as numpy ``(query_ids, key_ids)`` of Python integers,
    checked: every integer dtype's ids compared exactly (uint64's ``2**64 - 1`` is an
    id, not padding).

    Raises:
        TypeError, ValueError: as :func:`check_segment_ids`.
    """
    if segment_ids is None:
        return None
    pair = []
    for ids, length, which in zip(
        split_segment_ids(segment_ids), (num_queries, num_keys), ("queries", "keys"), strict=True
    ):
        array = np.asarray(ids)
        check_segment_ids(array.shape, array.dtype.kind, batch=batch, length=length, which=which)
        pair.append(array.astype(object))
    return pair[0], pair[1]


def counted_positions(ids: np.ndarray) -> np.ndarray:
    """Restarting positions counted one by one: the earlier positions of each id's row with
    it; padding's 0."""
    positions = np.zeros(ids.shape, dtype=np.int64)
    for b, i in np.ndindex(*ids.shape):
        if ids[b, i] >= 0:
            positions[b, i] = np.count_nonzero(ids[b, :i] == ids[b, i])
    return positions


def reference_segments(
    ids: tuple[np.ndarray, np.ndarray] | None, positions: Any, rotated: bool
) -> tuple[Any, np.ndarray | None]:
    """What the float64 reference reads of checked ids (:func:`checked_segment_ids`).

    Returns:
        ``(positions, segments)``: the call's ``positions`` as given, or,
        for a rotated call with none, the pair of restarting positions of
        the queries and the keys (:func:`counted_positions`); and the
        boolean ``(B, 1, Q, K)`` visibility, written from the rule (equal
        ids, neither negative), or ``None`` without ids.
    """
    if ids is None:
        return positions, None
    query_ids, key_ids = ids
    if positions is None and rotated:
        positions = (counted_positions(query_ids), counted_positions(key_ids))
    same = (query_ids[:, :, None] == key_ids[:, None, :]).astype(bool)
    return positions, (same & (query_ids[:, :, None] >= 0).astype(bool))[:, None]
