"""A call's checks, in the order every backend runs them: inputs, cache, gates, options.

The checks that read no values, from the framework's arrays through its
:class:`~mha_multi.call.facts.Facts` into :mod:`mha_multi.spec`'s shape and
dtype rules, so the same mistake raises the same error in every backend; and
the one read of a cached call's lengths where they can be read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.call.contract import INPUT_NAMES, Array, Projections
from mha_multi.call.decisions import once_per_signature
from mha_multi.call.facts import Facts


def check_call(
    facts: Facts,
    layer: Projections,
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    *,
    causal: Any,
    dtype: Any = None,
) -> tuple[Array, Array, Array, Array | None]:
    """Every check of a call without a cache that reads no values.

    Args:
        facts: the framework's facts.
        layer: the layer's projections (for its input sizes).
        queries: ``(B, Q, query_size)``; keys, values ``(B, K, ·)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
        causal: the call's flag, which must be a bool.
        dtype: the dtype the inputs must have, or ``None`` for any floating.

    Returns:
        ``(queries, keys, values, valid_lens)`` as the framework's arrays.

    Raises:
        TypeError: an input that is no floating array (of ``dtype``),
            non-numeric lengths, a ``causal`` that is not a bool.
        ValueError: shapes that do not fit together or the layer, named
            (:func:`mha_multi.spec.check_inputs`); arrays on other devices.
    """
    queries = facts.check_input("queries", queries, like=None, dtype=dtype)
    # Self-attention's keys and values are the queries, checked already. (Spelled out, not
    # a generator: a small call's cost is such work.)
    if keys is not queries:
        keys = facts.check_input(INPUT_NAMES[1], keys, like=queries, dtype=dtype)
    if values is not queries:
        values = facts.check_input(INPUT_NAMES[2], values, like=queries, dtype=dtype)
    lens = facts.as_lens(valid_lens, queries)
    sizes = layer.input_sizes()
    lens_shape = None if lens is None else tuple(lens.shape)
    # (Kept by what it reads; the flag's type too: 1 is no bool, though it hashes as True.)
    key = (queries.shape, keys.shape, values.shape, lens_shape, *sizes.values(), causal)
    once_per_signature(
        facts,
        spec.check_inputs,
        (*key, type(causal)),
        queries.shape,
        keys.shape,
        values.shape,
        lens_shape,
        **sizes,
        causal=causal,
    )
    return queries, keys, values, lens


def check_cached_call(
    facts: Facts,
    layer: Projections,
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    cache: Any,
    *,
    causal: Any,
    dtype: Any = None,
) -> tuple[Array, Array | None, Array | None, Array | None, spec.KVCache]:
    """Every check of a cached call that reads no values (docs: "Generating with a cache").

    As :func:`check_call`; ``keys`` and ``values`` may both be ``None`` (the
    call appends nothing), ``valid_lens`` counts each example's new
    positions, and the cache is checked against the layer's heads.

    Returns:
        ``(queries, keys, values, valid_lens, cache)`` as the framework's arrays.

    Raises:
        TypeError, ValueError: as :func:`mha_multi.spec.check_cached_call`,
            and those of :meth:`Facts.as_cache`.
    """
    queries = facts.check_input("queries", queries, like=None, dtype=dtype)
    keys, values = (
        # Self-attention's keys and values are the queries, checked already.
        x if x is None or x is queries else facts.check_input(name, x, like=queries, dtype=dtype)
        for name, x in zip(INPUT_NAMES[1:], (keys, values), strict=True)
    )
    cache = facts.as_cache(cache, queries)
    lens = facts.as_lens(valid_lens, queries)
    heads, sizes = layer.heads, layer.input_sizes()
    # (What its shapes and dtypes checks read: the arrays' shapes and the lengths' dtypes.)
    key = [facts, heads, *sizes.values(), causal, type(causal)]
    for x in (queries, keys, values, lens, *cache):
        key.append(None if x is None else x.shape)
    key += (cache.lengths.dtype, None if lens is None else lens.dtype)
    once_per_signature(
        facts,
        spec.check_cached_call,
        tuple(key),
        queries,
        keys,
        values,
        lens,
        cache,
        heads=heads,
        dtype_kind=facts.dtype_kind,
        itemsize=facts.ops(queries).itemsize,
        causal=causal,
        **sizes,
    )
    return queries, keys, values, lens, cache


def check_gates(facts: Facts, head_mask: Any, *, num_heads: int, like: Array) -> Array | None:
    """``head_mask`` checked (docs: "Heads"): ``(num_heads,)`` or ``(B, num_heads)``, floating.

    Args:
        num_heads: the heads the gates are for (a sharded layer's whole count).
        like: the queries, whose batch a ``(B, num_heads)`` mask must have.

    Raises:
        TypeError: not an array, or not floating.
        ValueError: another shape, or another device.
    """
    if head_mask is None:
        return None
    gates = facts.as_gates(head_mask, like)
    spec.check_head_mask(
        tuple(gates.shape),
        facts.dtype_kind(gates.dtype),
        num_heads=num_heads,
        batch=like.shape[0],
    )
    return gates


def check_cache_values(
    facts: Facts, cache: spec.KVCache, valid_lens: Array | None, num_new: int
) -> spec.CacheFill | None:
    """:func:`mha_multi.spec.check_cache_values` where the lengths can be read.

    One read of ``cache.lengths`` and ``valid_lens`` in an eager call;
    nothing in a traced one, where :func:`mha_multi.spec.update_cache` drops
    what would overflow instead.

    Returns:
        The lengths read (and so checked), or ``None`` where they cannot be.
    """
    read = facts.read(cache.lengths, valid_lens)
    if read is None:
        return None
    return spec.check_cache_values(read[0], read[1], num_new, cache.keys.shape[2])


def check_options(
    facts: Facts,
    positions: Any,
    bias: Any,
    *,
    num_heads: int,
    like: Array,
    num_keys: int,
    cached: bool,
) -> tuple[Array | None, Array | None]:
    """A call's ``positions`` and ``bias`` checked (docs: "Positions and biases").

    Args:
        num_heads: the heads ``bias`` is for (a sharded layer's whole count).
        like: the checked queries ``(B, Q, ·)``.
        num_keys: ``K`` of an uncached call, ``max_length`` of a cached one.
        cached: whether the call has a cache (its new keys are its queries'
            sequence, so ``positions`` need no ``K == Q``).

    Returns:
        ``(positions, bias)`` as the framework's arrays (``None`` stays ``None``).

    Raises:
        TypeError, ValueError: as :func:`mha_multi.spec.check_positions` and
            :func:`mha_multi.spec.check_bias`.
    """
    if positions is not None:
        positions = facts.as_positions(positions, like)
        _check_call_array(
            facts, spec.check_positions, positions, like, num_keys=None if cached else num_keys
        )
    if bias is not None:
        bias = facts.as_bias(bias, like)
        _check_call_array(
            facts, spec.check_bias, bias, like, num_heads=num_heads, num_keys=num_keys
        )
    return positions, bias


def check_segment_ids(
    facts: Facts, segment_ids: Any, *, like: Array, num_keys: int, cached: bool
) -> tuple[Array, Array] | None:
    """A call's ``segment_ids`` as the framework's ``(query_ids, key_ids)``, checked.

    One array serves both sides (self-attention); a tuple of two arrays
    gives the keys their own (docs: "Packed sequences").

    Args:
        like: the checked queries ``(B, Q, ·)``.
        num_keys: ``K``.
        cached: whether the call has a cache (refused: a cache keeps no ids).

    Raises:
        TypeError: ids that are not integers, or not arrays.
        ValueError: ids of another shape than ``(B, Q)`` and ``(B, K)``, a
            call with a cache, or as :func:`host_segment_ids`.
    """
    if segment_ids is None:
        return None
    if cached:
        raise ValueError(
            "segment_ids are not supported with a cache: a cache keeps no segment ids "
            "(decode each packed sequence in a row of its own)"
        )
    sides: list[Any] = []
    query_ids, key_ids = spec.split_segment_ids(host_segment_ids(segment_ids))
    given = zip((query_ids, key_ids), (like.shape[1], num_keys), ("queries", "keys"), strict=True)
    for ids, length, which in given:
        if sides and key_ids is query_ids and length == like.shape[1]:
            break  # self-attention: one array serves both sides
        if _on_host(ids):
            try:
                ids = np.asarray(ids)
            except (TypeError, ValueError) as error:
                raise TypeError(f"segment_ids must be an integer array; got {ids!r}") from error
            kind = ids.dtype.kind
        else:
            kind = facts.dtype_kind(ids.dtype)
        sizes = {"batch": like.shape[0], "length": length, "which": which}
        spec.check_segment_ids(tuple(ids.shape), kind, **sizes)
        sides.append(facts.as_positions(ids, like))
    return sides[0], sides[-1]


def host_segment_ids(segment_ids: Any) -> Any:
    """``segment_ids`` whose integer ids given on the host (numpy arrays, lists) are int32
    arrays of the same segments (:func:`mha_multi.spec.int32_segment_ids`: both sides
    together, whose ids are compared), which every framework holds as they are; the
    framework's own arrays, and what is no array (which :func:`check_segment_ids`
    refuses), as they are.

    Raises:
        TypeError: ids on the host that are not integers, refused here as
            :func:`check_segment_ids` refuses them, before a framework's
            conversion (Keras') meets them.
        ValueError: ids beyond int32 on the host beside the other side's tensor.
    """
    query_ids, key_ids = spec.split_segment_ids(segment_ids)
    sides = [query_ids] if key_ids is query_ids else [query_ids, key_ids]
    host = {}
    for index, ids in enumerate(sides):
        if _on_host(ids):
            try:
                ids = np.asarray(ids)
            except (TypeError, ValueError):
                return segment_ids
            spec.check_segment_ids_kind(ids.dtype.kind, ("queries", "keys")[index])
            host[index] = ids
    if not host:
        return segment_ids
    converted = dict(zip(host, spec.int32_segment_ids(list(host.values())), strict=True))
    if len(host) < len(sides) and any(not np.array_equal(converted[i], host[i]) for i in host):
        raise ValueError(
            "segment_ids beyond int32 on the host beside a tensor of the other side's: "
            "give both sides as numpy arrays"
        )
    sides = [converted.get(index, ids) for index, ids in enumerate(sides)]
    return sides[0] if len(sides) == 1 else (sides[0], sides[1])


def host_positions(positions: Any, index: Any = np.int64) -> Any:
    """``positions`` given on the host (numpy arrays, lists) as an integer numpy array that
    every framework holds (:func:`mha_multi.spec.positions_on_host`, ``index`` the widest
    integers the framework holds); the framework's own arrays, and what is no array, as
    they are.

    Raises:
        TypeError: positions on the host that are not integers, refused as
            :func:`mha_multi.spec.check_positions` refuses them, before a framework's
            conversion (Keras') meets them.
        ValueError: positions beyond ``index``, which a conversion would wrap.
    """
    if not _on_host(positions):
        return positions
    try:
        np.asarray(positions)
    except (TypeError, ValueError):
        return positions
    return spec.positions_on_host(positions, index)


def host_bias(bias: Any) -> None:
    """Refuses a ``bias`` numpy array that is not floating-point, as
    :func:`mha_multi.spec.check_bias` refuses it, before a framework's conversion
    (Keras', which would cast it) meets it.

    Raises:
        TypeError: such an array.
    """
    if isinstance(bias, np.ndarray):
        spec.check_bias_kind(bias.dtype.kind)


def _on_host(ids: Any) -> bool:
    """Whether ``ids`` were given on the host: a numpy array, or what numpy makes one of."""
    return isinstance(ids, np.ndarray) or not (hasattr(ids, "shape") and hasattr(ids, "dtype"))


def _check_call_array(
    facts: Facts, check: Callable[..., None], x: Array, like: Array, **sizes: Any
) -> None:
    """``check`` (:func:`mha_multi.spec.check_positions` or
    :func:`mha_multi.spec.check_bias`) of an argument of the call whose
    leading axes are the queries' ``(B, Q)``."""
    check(
        tuple(x.shape),
        facts.dtype_kind(x.dtype),
        batch=like.shape[0],
        num_queries=like.shape[1],
        **sizes,
    )
