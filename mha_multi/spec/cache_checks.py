"""A cached call checked: its cache's shapes and dtypes, and its lengths where they can be read.

What an eager call learns from one read of the lengths (:class:`CacheFill`)
also tells it how many cache positions to attend over (:meth:`CacheFill.span`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from mha_multi.spec.cache import KVCache, cached_visibility
from mha_multi.spec.checks import Heads, check_causal, check_inputs
from mha_multi.spec.ops import NumpyOps


def check_cached_inputs(
    queries_shape: Sequence[int],
    keys_shape: Sequence[int] | None,
    values_shape: Sequence[int] | None,
    valid_lens_shape: Sequence[int] | None,
    cache_shapes: KVCache,
    *,
    heads: Heads,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    causal: Any = False,
) -> None:
    """Validates the shapes of a cached call (docs: "Generating with a cache").

    Args:
        queries_shape: ``(B, T, query_size)``: ``T`` new positions.
        keys_shape: ``(B, T, key_size)``, or ``None`` (then ``values_shape``
            is ``None`` too) to attend to the cache without appending.
        values_shape: ``(B, T, value_size)`` or ``None``.
        valid_lens_shape: ``None`` or ``(B,)``: the real new positions of
            each example.
        cache_shapes: the shapes of the cache's ``keys``, ``values`` and
            ``lengths``.
        heads: the layer's head layout.
        query_size, key_size, value_size: the layer's input sizes, or
            ``None`` where not yet known.
        causal: the call's ``causal`` flag.

    Raises:
        ValueError: naming the offending argument and the expected shape.
        TypeError: ``causal`` is not a bool.
    """
    queries_shape = tuple(queries_shape)
    if (keys_shape is None) != (values_shape is None):
        raise ValueError(
            "keys and values must both be given (new positions to append) or both be "
            "None (attend to the cache as it is)"
        )
    if keys_shape is None:
        check_causal(causal)
        if len(queries_shape) != 3:
            raise ValueError(
                f"queries must be 3-D (batch, length, features); got shape {queries_shape}"
            )
        if query_size is not None and queries_shape[2] != query_size:
            raise ValueError(
                f"queries last dimension must be query_size={query_size}; got shape {queries_shape}"
            )
        if valid_lens_shape is not None:
            raise ValueError(
                "valid_lens counts new positions, and a call without keys and values appends "
                "none: pass valid_lens=None"
            )
    else:
        # (valid_lens of another rank: the cached call's own message below, after the
        # inputs' checks, which would name the shapes of a call without a cache.)
        one_per_example = valid_lens_shape is None or len(tuple(valid_lens_shape)) == 1
        check_inputs(
            queries_shape,
            keys_shape,
            values_shape,
            valid_lens_shape if one_per_example else None,
            query_size=query_size,
            key_size=key_size,
            value_size=value_size,
            causal=causal,
        )
        if tuple(keys_shape)[1] != queries_shape[1]:
            raise ValueError(
                f"keys and values of a cached call are the queries' new positions and must "
                f"have their length {queries_shape[1]}; got {tuple(keys_shape)[1]}"
            )
        if not one_per_example:
            raise ValueError(
                f"valid_lens of a cached call must have shape (batch,) = ({queries_shape[0]},): "
                f"the number of new positions of each example; got {tuple(valid_lens_shape)}"
            )
    batch = queries_shape[0]
    keys, values, lengths = (tuple(shape) for shape in cache_shapes)
    expected = (batch, heads.num_kv_heads, "max_length", heads.head_dim)
    for name, shape in (("cache.keys", keys), ("cache.values", values)):
        if len(shape) != 4 or shape[:2] != expected[:2] or shape[3] != heads.head_dim:
            raise ValueError(
                f"{name} must have shape (batch, num_kv_heads, max_length, head_dim) = "
                f"({batch}, {heads.num_kv_heads}, max_length, {heads.head_dim}); got {shape}"
            )
    if values != keys:
        raise ValueError(f"cache.values must have the shape of cache.keys {keys}; got {values}")
    if lengths != (batch,):
        raise ValueError(f"cache.lengths must have shape (batch,) = ({batch},); got {lengths}")


def as_kv_cache(cache: Any) -> KVCache:
    """``cache`` as a :class:`KVCache`: the layer's own, or any tuple of its three arrays
    (a framework may hand a named tuple on as a plain one).

    Raises:
        TypeError: anything else, named (every backend's message).
    """
    if type(cache) is KVCache:
        return cache
    if not isinstance(cache, tuple) or len(cache) != 3:
        raise TypeError(
            "cache must be a KVCache(keys, values, lengths), as the layer's init_cache "
            f"makes it; got {type(cache).__name__}"
        )
    return KVCache(*cache)


def check_cache_dtypes(
    lengths_kind: str, valid_lens_kind: str | None, lengths_itemsize: int = 4
) -> None:
    """Raises ``TypeError`` unless the cache's lengths are int32 or int64 and the new
    lengths integers.

    Narrower lengths would wrap around before they count a cache's positions (an
    int8's 127), and the returned lengths would then name positions a call
    overwrites; unsigned ones mix with no framework's signed positions alike.

    Args:
        lengths_kind: numpy dtype kind of ``cache.lengths``.
        valid_lens_kind: numpy dtype kind of the call's ``valid_lens``, or
            ``None`` without them.
        lengths_itemsize: the bytes of each of ``cache.lengths``.
    """
    if lengths_kind not in "iu":
        raise TypeError(f"cache.lengths must be integers; got dtype kind {lengths_kind!r}")
    if lengths_kind != "i" or lengths_itemsize not in (4, 8):
        name = f"{'u' if lengths_kind == 'u' else ''}int{8 * lengths_itemsize}"
        raise TypeError(
            f"cache.lengths must be int32 or int64 (init_cache makes int32); got {name}"
        )
    if valid_lens_kind is not None and valid_lens_kind not in "iu":
        raise TypeError(
            "valid_lens of a cached call counts new positions and must be integers; "
            f"got dtype kind {valid_lens_kind!r}"
        )


def check_cached_call(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    cache: KVCache,
    *,
    heads: Heads,
    dtype_kind: Callable[[Any], str],
    itemsize: Callable[[Any], int],
    causal: Any = False,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
) -> None:
    """Every check of a cached call that reads no values: shapes, then dtypes.

    :func:`check_cached_inputs` on the arrays' shapes and
    :func:`check_cache_dtypes` on their dtypes, for any framework's arrays
    (each has ``.shape`` and ``.dtype``); ``dtype_kind`` maps the framework's
    dtypes to numpy kinds (``"f"``, ``"i"``...), ``itemsize`` to their bytes.
    """

    def shape(x: Any) -> tuple[int, ...] | None:
        return None if x is None else tuple(x.shape)

    check_cached_inputs(
        shape(queries),  # type: ignore[arg-type]
        shape(keys),
        shape(values),
        shape(valid_lens),
        KVCache(*(shape(x) for x in cache)),
        heads=heads,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        causal=causal,
    )
    check_cache_dtypes(
        dtype_kind(cache.lengths.dtype),
        None if valid_lens is None else dtype_kind(valid_lens.dtype),
        itemsize(cache.lengths.dtype),
    )


#: An eager cached call attends over a multiple of this many cache positions
#: (docs: "Generating with a cache"): few distinct shapes, little wasted work.
SPAN_BUCKET = 64


class CacheFill(NamedTuple):
    """A cached call's lengths as an eager call reads them (:func:`check_cache_values`).

    ``lengths`` is ``cache.lengths`` before the call and ``new`` the
    positions each example appends, both numpy ``(B,)`` int64; ``held`` is
    their sum, what each example holds after the call, and ``least`` and
    ``most`` its smallest and largest entries (0 for an empty batch).
    """

    lengths: np.ndarray
    new: np.ndarray
    held: np.ndarray
    least: int
    most: int

    def visibility(self, num_new: int, *, causal: bool) -> np.ndarray:
        """:func:`cached_visibility` computed on the host: ``(B,)``, or ``(B, T)`` when causal.

        A causal call of one new position is ``(B,)`` too: its one query
        sees its own key and all before it, as without the causal rule.
        """
        if num_new == 1:
            causal = False
        return cached_visibility(NumpyOps(), self.lengths, self.new, num_new, causal=causal)

    def hides_none(self, num_new: int, num_keys: int, *, causal: bool, first: int = 0) -> bool:
        """Whether every query of the call sees all ``num_keys`` keys from cache position
        ``first`` on (:meth:`visibility`, not computed): each sees its example's length
        after the call, but for a causal call of several new positions, whose first
        queries see fewer."""
        if causal and num_new > 1:
            return False
        return self.least - first >= num_keys

    def uniform_start(self, num_new: int) -> int | None:
        """The position every example writes its ``num_new`` rows from, where they share one.

        ``None`` where the examples hold different lengths or append
        different counts (a ragged batch).
        """
        starts, counts = set(self.lengths.tolist()), set(self.new.tolist())
        if len(starts) != 1 or counts != {num_new}:
            return None
        return starts.pop()

    def span(
        self,
        num_queries: int,
        max_length: int,
        *,
        window: int | None = None,
        bucket: int = SPAN_BUCKET,
    ) -> int:
        """How many leading cache positions the call must attend over for the spec's numbers.

        Keys from ``lengths[b] + new[b]`` on are hidden from every query of
        example ``b``, and a hidden score (-1e6) adds exactly nothing to a
        softmax whose row has a visible score: attending over the filled
        positions, rounded up to ``bucket``, gives the numbers of all
        ``max_length``, where the values past them are finite (a hidden
        value's weight is 0, which a NaN or an infinity makes NaN: the
        caller checks, :func:`mha_multi.call.attended_positions`). A fully
        hidden row is the exception (uniform over all ``max_length`` keys):
        an example that holds nothing, or, with a ``window``, a padding query
        further than the window past its example's last key. Then the whole
        cache is attended over.

        Args:
            num_queries: ``T``, the call's new positions.
            max_length: the cache's capacity.
            window: the layer's window, or ``None``.
            bucket: the span is a multiple of it (or ``max_length``).
        """
        if self.held.size == 0 or self.least <= 0:
            return max_length
        if window is not None and num_queries - int(self.new.min()) >= window:
            return max_length
        return rounded_span(self.most, max_length, bucket)

    def window_start(
        self, num_queries: int, window: int | None, *, bucket: int = SPAN_BUCKET
    ) -> int:
        """The first cache position a query of the call can see through the ``window``,
        rounded down to ``bucket``: the keys before it are hidden from every query.

        Query ``i`` of example ``b`` sits at ``lengths[b] + i`` and sees no
        key ``window`` or more positions behind it. 0 without a window, and
        where a row may be fully hidden (an example that holds nothing, a
        padding query further than the window past its example's last key),
        which the spec makes uniform over all ``max_length`` keys
        (:meth:`span`). A caller leaves out the positions before it only where
        their values are known finite (a hidden value's weight is 0, which a
        NaN or an infinity turns into NaN: :func:`mha_multi.call.attended_positions`).
        """
        if window is None or self.held.size == 0 or self.least <= 0:
            return 0
        if num_queries - int(self.new.min()) >= window:
            return 0
        return window_first(int(self.lengths.min()), window, bucket)


def window_first(length: int, window: int, bucket: int) -> int:
    """The first cache position a query at ``length`` (the fewest positions an example
    held before the call) sees through ``window``, rounded down to ``bucket``; 0 while
    the window reaches the first position."""
    return max(0, (length - window + 1) // bucket * bucket)


def rounded_span(filled: int, max_length: int, bucket: int) -> int:
    """``filled`` leading cache positions rounded up to a multiple of ``bucket``, at most
    ``max_length``: the span a call attends over (:meth:`CacheFill.span`)."""
    return min(max_length, -(-filled // bucket) * bucket)


def check_cache_values(lengths: Any, valid_lens: Any, num_new: int, max_length: int) -> CacheFill:
    """Validates a cached call's lengths where they can be read (eager mode).

    Args:
        lengths: ``cache.lengths`` as numpy, ``(B,)``.
        valid_lens: the call's new positions per example as numpy ``(B,)``,
            or ``None`` (every example appends ``num_new``; ``0`` for a call
            without keys and values).
        num_new: ``T``, the new positions of the call.
        max_length: the cache's capacity.

    Returns:
        The lengths read, for :meth:`CacheFill.span` and in-place writes.

    Raises:
        ValueError: a negative length, a new length outside ``[0, T]``, or an
            example that would hold more than ``max_length`` positions.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"cache.lengths must be >= 0; got {lengths.tolist()}")
    if valid_lens is None:
        new = np.full_like(lengths, num_new)
    else:
        new = np.asarray(valid_lens, dtype=np.int64)
        if new.size and (new.min() < 0 or new.max() > num_new):
            raise ValueError(
                f"valid_lens of a cached call must be in [0, {num_new}] (the new positions of "
                f"each example); got {new.tolist()}"
            )
    held = lengths + new
    least, most = (int(held.min()), int(held.max())) if held.size else (0, 0)
    if most > max_length:
        b = int(held.argmax())
        raise ValueError(
            f"the cache overflows: example {b} would hold {int(held[b])} positions "
            f"(cache.lengths {int(lengths[b])} + {int(new[b])} new); max_length is {max_length}"
        )
    return CacheFill(lengths, new, held, least, most)
