"""The layer's call, written once: checks, plan, cache, attend, gates, output.

Every backend's layer is a shell around :func:`forward` (docs:
"Architecture"): it owns its parameters and its framework's module protocol,
and hands each call here together with two objects.

* The framework's :class:`Facts` (a subclass in
  ``mha_multi/<framework>/_backend.py``): how its arrays are checked and
  converted, which values can be read on the host and when, its array-ops
  adapter, and its fused kernel. Eager and compiled execution differ only in
  what :meth:`Facts.read` can read.
* The layer's :class:`Projections`: its head layout and input sizes, the
  input projections and the output projection of the gated context.

The math is :mod:`mha_multi.spec`'s; the flow of a call is here and nowhere
else, so a new option of the attention is added to the spec, to this module,
and to those fused kernels that can take it.

Nothing here imports a framework.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from mha_multi import spec

__all__ = [
    "Facts",
    "Projections",
    "Result",
    "attend",
    "attended_positions",
    "check_cache_values",
    "check_cached_call",
    "check_call",
    "check_gates",
    "check_options",
    "forward",
    "kernel_settings",
    "plain_self_attention",
    "plan",
]

Array = Any
INPUT_NAMES = ("queries", "keys", "values")
#: The shapes a call's ``bias`` and ``head_mask`` may have, as the facts' errors word them.
BIAS_SHAPE = "broadcastable to (batch, num_heads, num_queries, num_keys)"
GATES_SHAPE = "of shape (num_heads,) or (batch, num_heads)"


class Projections(Protocol):
    """What the driver asks of a layer: its heads, sizes and projections."""

    @property
    def heads(self) -> spec.Heads:
        """The heads this call computes (a sharded layer's own share)."""

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where not known yet."""

    def project_inputs(
        self, queries: Array, keys: Array | None, values: Array | None
    ) -> tuple[Any, ...]:
        """``(q, k, v)``: the projected inputs; ``k`` and ``v`` ``None`` without keys."""

    def project_output(self, context: Array, gates: Array | None) -> Array:
        """``W_o`` (and ``b_o``) of the heads' context gated by ``gates``.

        The gating is :func:`mha_multi.spec.apply_head_mask`; where a 16-bit
        product is taken and rounded is the layer's fact.
        """


class Facts:
    """A framework's facts, as a call asks for them (docs: "Architecture").

    Subclasses override what their framework does differently; the defaults
    are those of a framework whose arrays have ``.shape`` and ``.dtype``.

    Attributes:
        kernel: the fused kernel a call may plan for, or ``None`` where every
            call takes the generic path.
        vmap: ``jax.vmap`` or a function of its signature, for layers whose
            heads are split over devices (``head_parallel``); ``None`` where
            the framework has none.
        passes_options: :meth:`fused_attention` takes the call's
            :class:`~mha_multi.spec.ScoreOptions` (``options=``) and
            :meth:`plan_values` its ``bias`` (``bias=``); where not, a call
            with a bias, ALiBi, a window, soft-capping or its own query
            positions takes the generic path.
        attends_filled: an eager cached call attends over the cache's filled
            positions (:meth:`mha_multi.spec.CacheFill.span`, through
            :meth:`cache_prefix`) rather than all ``max_length``: for
            frameworks whose kernels take any length at no compile cost.
    """

    kernel: spec.FusedKernel | None = None
    vmap: Callable[..., Callable[..., Any]] | None = None
    passes_options: bool = False
    attends_filled: bool = False

    # -- arrays -----------------------------------------------------------

    def ops(self, like: Array) -> spec.ArrayOps:
        """The array-ops adapter for arrays such as ``like`` (its device, precision)."""
        raise NotImplementedError

    def dtype_kind(self, dtype: Any) -> str:
        """numpy's ``dtype.kind`` of a framework dtype (``"f"``, ``"i"``...)."""
        raise NotImplementedError

    def check_input(self, name: str, x: Any, *, like: Array | None, dtype: Any) -> Array:
        """``x`` as an input of the call: a floating array of the framework.

        Args:
            name: ``"queries"``, ``"keys"`` or ``"values"``.
            x: what the caller passed.
            like: the queries (already checked) for keys and values, where
                they must share its device; ``None`` for the queries.
            dtype: the dtype the layer requires, or ``None`` for any floating one.

        Raises:
            TypeError: not an array of the framework, not floating, or not of
                ``dtype``.
            ValueError: on another device than ``like``.
        """
        raise NotImplementedError

    def as_lens(self, valid_lens: Any, like: Array) -> Array | None:
        """``valid_lens`` as the framework's array beside ``like``, its dtype checked.

        Integer lengths beyond the framework's index type are clipped, never
        wrapped (:func:`mha_multi.spec.lens_as_numpy`).

        Raises:
            TypeError: not numeric.
        """
        raise NotImplementedError

    def as_cache(self, cache: Any, like: Array) -> spec.KVCache:
        """``cache`` as a :class:`~mha_multi.spec.KVCache` of the framework's arrays.

        Raises:
            TypeError: not a ``(keys, values, lengths)`` tuple of arrays.
            ValueError: an array on another device than ``like``.
        """
        raise NotImplementedError

    def as_positions(self, positions: Any, like: Array) -> Array:
        """``positions`` (not ``None``) as the framework's array beside ``like``.

        Arrays of the framework keep their dtype (checked by
        :func:`mha_multi.spec.check_positions`); sequences and numpy arrays
        are converted.

        Raises:
            TypeError: not array-like.
        """
        raise NotImplementedError

    def as_bias(self, bias: Any, like: Array) -> Array:
        """``bias`` (not ``None``) as the framework's array beside ``like``.

        Its shape and dtype are checked by :func:`mha_multi.spec.check_bias`.

        Raises:
            TypeError: not an array of the framework.
            ValueError: on another device than ``like``.
        """
        raise NotImplementedError

    def as_gates(self, head_mask: Any, like: Array) -> Array:
        """``head_mask`` (not ``None``) as the framework's array beside ``like``.

        Its shape and dtype are checked by :func:`check_gates`.

        Raises:
            TypeError: not an array.
            ValueError: on another device than ``like``.
        """
        raise NotImplementedError

    def read(self, *arrays: Array | None) -> list[np.ndarray | None] | None:
        """A few small arrays as numpy, or ``None`` where values cannot be read.

        Eager calls read; traced ones (``torch.compile``, ``jax.jit``,
        ``tf.function``) cannot, and then the call does what the docs say
        compiled code does instead. ``None`` entries stay ``None``.
        """
        raise NotImplementedError

    # -- the fused kernel ---------------------------------------------------

    def kernel_serves(self, q: Array) -> bool:
        """Whether :attr:`kernel` serves the dtype and precision of ``q``."""
        return True

    def kernel_takes_grouped(self, q: Array, num_queries: Any, head_dim: int) -> bool:
        """Whether grouped key/value heads are best given to :attr:`kernel` as they are,
        for ``num_queries`` queries ``q`` of ``head_dim`` (where it takes them at all);
        ``False`` has the plan repeat them once (:attr:`mha_multi.spec.KernelPlan.repeat_kv`)."""
        return True

    def on_host(self, q: Array) -> bool:
        """Whether ``q`` lives on the host, where :meth:`plan_values` waits for nothing
        (elsewhere the plan reads only where :func:`mha_multi.spec.reads_values` says)."""
        return True

    def records_gradient(self, q: Array) -> bool:
        """Whether a gradient is recorded through the projection ``q``, so that the
        generic path keeps its ``(B, H, Q, K)`` weights for the backward pass
        (:func:`mha_multi.spec.reads_values`); ``True`` where the framework
        cannot tell."""
        return True

    def plan_values(
        self,
        q: Array,
        k: Array,
        v: Array,
        valid_lens: Array | None,
        heads: spec.Heads,
        *,
        hides_keys: bool = True,
    ) -> tuple[bool | None, float | None]:
        """What the plan reads of the values: ``(values_exact, shortest_length)``.

        See :func:`mha_multi.spec.plan_kernel`; ``(None, None)`` reads nothing.
        ``hides_keys``: the plan hides keys whatever the lengths (the causal
        rule, a window), so a kernel that adds its mask needs the scores
        bounded (:func:`mha_multi.spec.scores_within_limit`); lengths may
        hide keys too.
        """
        return None, None

    def values_guard(self, q: Array, sizes: tuple[Any, Any, Any]) -> bool:
        """Whether a call whose values cannot be read (:meth:`plan_values`)
        runs the kernel under :meth:`guarded`; ``sizes`` are ``(B, Q, K)``.

        A framework whose compiled graphs branch on the device says where
        that pays (docs: "Fast paths"); the default is the generic path.
        """
        return False

    def guarded(
        self,
        fused: Callable[..., Array],
        generic: Callable[..., Array],
        arrays: Sequence[Array],
        bias: Array | None,
        *,
        head_dim: int,
    ) -> Array:
        """``fused(*arrays)`` where the values are exact, else ``generic(*arrays)``,
        decided on the device.

        The values are exact where ``arrays`` (the projections ``q, k, v``
        the kernel attends over, of heads of ``head_dim``) are finite, their
        scores within :data:`mha_multi.spec.FUSED_SCORE_LIMIT` and ``bias``,
        where given, bounded: what :meth:`plan_values` reads in an eager
        call, here a graph's conditional. Only frameworks whose :meth:`values_guard` is
        true are asked, and their :meth:`fused_attention` never declines
        (both branches give the context).
        """
        raise NotImplementedError

    def fused_attention(
        self,
        ops: spec.ArrayOps,
        q: Array,
        k: Array,
        v: Array,
        valid_lens: Array | None,
        plan: spec.KernelPlan,
        *,
        heads: spec.Heads,
        kv_split: bool,
        dropout_rate: float,
    ) -> Array | None:
        """The heads' context ``(B, Q, H*dh)`` from the fused kernel, to the spec's numbers.

        ``None`` where the kernel declined the call after all (cuDNN's
        shapes): the generic path then serves.
        """
        raise NotImplementedError

    # -- the cache ------------------------------------------------------------

    def write_cache(
        self,
        ops: spec.ArrayOps,
        cache: spec.KVCache,
        k: Array,
        v: Array,
        valid_lens: Array | None,
        *,
        head_dim: int,
        causal: bool,
        fill: spec.CacheFill | None,
    ) -> tuple[spec.KVCache, Array]:
        """:func:`mha_multi.spec.update_cache`: the cache after the call, and what queries see.

        The default is the spec's functional update (static shapes, any
        execution). A framework that can write arrays in place overrides
        it for the calls where that is safe (eager, no gradient through the
        cache), using ``fill``, the lengths read on the host (``None`` in a
        traced call).
        """
        return spec.update_cache(ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal)

    def cache_prefix(self, keys: Array, values: Array, span: int) -> tuple[Array, Array]:
        """The first ``span`` positions of a cache's ``(B, H_kv, max_length, dh)`` arrays.

        Only frameworks that set :attr:`attends_filled` are asked.
        """
        raise NotImplementedError

    def finite_past(self, keys: Array, values: Array, span: int) -> bool:
        """Whether every value of a cache (``keys``, ``values``) past its first ``span``
        positions is finite.

        A call may attend over those first positions only (:attr:`attends_filled`)
        where this holds: the positions past them are hidden from every query,
        and a hidden value takes a weight of 0, which a NaN or an infinity
        turns into NaN (docs: "Generating with a cache"). Frameworks read the
        values, or know them from the calls that wrote the cache; the default,
        ``False``, attends over every position.
        """
        return False

    def span_bucket_of(self, keys: Array) -> int:
        """The attended span of a cache whose keys are ``keys`` is a multiple of it.

        The shapes a compiled kernel is reused for: the spec's bucket by
        default, 1 where kernels take any length at no cost.
        """
        return spec.SPAN_BUCKET

    def plain_attention(
        self, layer: Projections, queries: Any, cache: Any, *, causal: bool, dtype: Any
    ) -> Result | None:
        """Plain self-attention (:func:`plain_self_attention`) run in few operations, or ``None``.

        A framework may answer the calls whose every fact it already holds
        (the checks of these shapes, the plan, and for a decoding step the
        cache its own writes made and its lengths on the host) with the
        generic flow's operations on the same arrays, so with its numbers to
        the bit, and ``None`` for anything else: the generic flow then checks
        and runs the call. The default answers none.

        Args:
            layer: the layer's projections.
            queries: the call's queries, which are its keys and values.
            cache: the call's cache, unchecked, or ``None``.
            causal: the call's flag (a bool).
            dtype: the dtype the inputs must have, or ``None`` for any floating.
        """
        return None

    # -- the generic path ---------------------------------------------------

    def generic_attention(
        self,
        ops: spec.ArrayOps,
        q: Array,
        k: Array,
        v: Array,
        valid_lens: Array | None,
        *,
        heads: spec.Heads,
        causal: bool,
        dropout: Callable[[Array], Array] | None,
        kv_split: bool,
        head_parallel: bool,
        return_attention_weights: bool,
        options: spec.ScoreOptions = spec.NO_OPTIONS,
    ) -> tuple[Array, Array | None]:
        """:func:`mha_multi.spec.attention`, or head by head where the heads are split.

        With ``head_parallel`` (and no dropout, whose mask is drawn for the
        whole ``(B*H, Q, K)`` weights, nor score options) the attention is
        mapped over the key/value heads
        (:func:`mha_multi.spec.attention_by_kv_heads`), so that sharded heads
        are computed where they live.
        """
        settings: dict[str, Any] = {
            "num_heads": heads.num_heads,
            "head_dim": heads.head_dim,
            "num_kv_heads": heads.num_kv_heads,
            "causal": causal,
            "kv_split": kv_split,
        }
        plain = options is spec.NO_OPTIONS
        if head_parallel and dropout is None and plain and self.vmap is not None:
            return spec.attention_by_kv_heads(ops, q, k, v, valid_lens, vmap=self.vmap, **settings)
        if not plain:
            settings["options"] = options
        return spec.attention(ops, q, k, v, valid_lens, dropout=dropout, **settings)


class Result(NamedTuple):
    """What :func:`attend` computes: the output, the weights and the cache."""

    output: Array
    #: ``(B, H, Q, K)`` pre-dropout weights, ``None`` unless asked for (or fused).
    weights: Array | None
    #: The cache after the call; ``None`` for a call without one.
    cache: spec.KVCache | None

    def returned(self, return_attention_weights: bool) -> Any:
        """The layer's return value: the output, then the weights and the cache where given."""
        outputs: tuple[Any, ...] = (self.output,)
        if return_attention_weights:
            outputs += (self.weights,)
        if self.cache is not None:
            outputs += (self.cache,)
        return outputs[0] if len(outputs) == 1 else outputs


# -- checks ---------------------------------------------------------------------


def _shape(x: Array | None) -> tuple[int, ...] | None:
    return None if x is None else tuple(x.shape)


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
    keys, values = (
        # Self-attention's keys and values are the queries, checked already.
        x if x is queries else facts.check_input(name, x, like=queries, dtype=dtype)
        for name, x in zip(INPUT_NAMES[1:], (keys, values), strict=True)
    )
    lens = facts.as_lens(valid_lens, queries)
    spec.check_inputs(
        queries.shape,
        keys.shape,
        values.shape,
        _shape(lens),
        **layer.input_sizes(),
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
    spec.check_cached_call(
        queries,
        keys,
        values,
        lens,
        cache,
        heads=layer.heads,
        dtype_kind=facts.dtype_kind,
        causal=causal,
        **layer.input_sizes(),
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
    batch, num_queries = like.shape[0], like.shape[1]
    if positions is not None:
        positions = facts.as_positions(positions, like)
        spec.check_positions(
            tuple(positions.shape),
            facts.dtype_kind(positions.dtype),
            batch=batch,
            num_queries=num_queries,
            num_keys=None if cached else num_keys,
        )
    if bias is not None:
        bias = facts.as_bias(bias, like)
        spec.check_bias(
            tuple(bias.shape),
            facts.dtype_kind(bias.dtype),
            batch=batch,
            num_heads=num_heads,
            num_queries=num_queries,
            num_keys=num_keys,
        )
    return positions, bias


# -- the kernel plan -----------------------------------------------------------------


def kernel_settings(
    facts: Facts,
    q: Array,
    *,
    sizes: tuple[Any, Any, Any],
    lens_ndim: int | None,
    lens_integer: bool,
    heads: spec.Heads,
    causal: bool,
    dropout: bool,
    return_attention_weights: bool,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> dict[str, Any]:
    """What :func:`mha_multi.spec.plan_kernel` reads of a call, but its values.

    Args:
        q: projected queries (for the dtype the kernel serves).
        sizes: ``(B, Q, K)``.
        lens_ndim, lens_integer: the lengths' rank (``None``: no lengths)
            and whether they are integers.
    """
    return {
        "sizes": sizes,
        "lens_ndim": lens_ndim,
        "lens_integer": lens_integer,
        "causal": causal,
        "dropout": dropout,
        "return_attention_weights": return_attention_weights,
        "grouped": heads.grouped,
        "grouped_taken": not heads.grouped
        or facts.kernel_takes_grouped(q, sizes[1], heads.head_dim),
        "dtype_supported": facts.kernel_serves(q),
        "bias": options.bias is not None or options.alibi_slopes is not None,
        "softcap": options.softcap is not None,
        "window": options.window is not None,
        "query_positions": options.query_positions is not None,
    }


def plan(
    facts: Facts,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    *,
    heads: spec.Heads,
    causal: bool,
    dropout: bool,
    return_attention_weights: bool,
    kv_split: bool,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> spec.KernelPlan:
    """The kernel plan of a call: the framework's kernel only where it gives the spec's numbers.

    :func:`mha_multi.spec.plan_kernel` decides for every backend; the values
    are read (:meth:`Facts.plan_values`) only where they can still change
    the decision.

    Args:
        q: projected queries ``(B, Q, H*dh)``; ``k``, ``v`` ``(B, K,
            H_kv*dh)``, or a cache's ``(B, H_kv, K, dh)`` with ``kv_split``.
        options: the call's score options.
    """
    if facts.kernel is None:
        return spec.KernelPlan(fused=False, reason="the backend has no fused kernel")
    if options is not spec.NO_OPTIONS and not facts.passes_options:
        return spec.KernelPlan(
            fused=False, reason="the backend's kernel call passes no positions or biases"
        )
    lens_kind = None if valid_lens is None else facts.dtype_kind(valid_lens.dtype)
    settings = kernel_settings(
        facts,
        q,
        sizes=(q.shape[0], q.shape[1], k.shape[2 if kv_split else 1]),
        lens_ndim=None if valid_lens is None else len(valid_lens.shape),
        lens_integer=lens_kind is None or lens_kind in "iu",
        heads=heads,
        causal=causal,
        dropout=dropout,
        return_attention_weights=return_attention_weights,
        options=options,
    )
    optimistic = spec.plan_kernel(facts.kernel, **settings, values_exact=True)
    if not optimistic.fused:
        return optimistic
    batch, num_queries, num_keys = settings["sizes"]
    # Keys hidden whatever the lengths.
    hides_keys = (
        optimistic.is_causal
        or optimistic.mask_causal
        or optimistic.window_flag
        or optimistic.mask_window
    )
    total_scores = (
        None if facts.records_gradient(q) else batch * heads.num_heads * num_queries * num_keys
    )
    if not spec.reads_values(facts.on_host(q), num_queries, num_keys, total_scores=total_scores):
        exact, shortest = None, None  # a read would wait for the device
    elif options.bias is None:
        exact, shortest = facts.plan_values(q, k, v, valid_lens, heads, hides_keys=hides_keys)
    else:
        exact, shortest = facts.plan_values(
            q, k, v, valid_lens, heads, bias=options.bias, hides_keys=hides_keys
        )
    if exact is True and shortest is None:
        return optimistic  # what the values were assumed to be
    return spec.plan_kernel(
        facts.kernel,
        **settings,
        values_exact=exact,
        shortest_length=shortest,
        values_guard=exact is None and facts.values_guard(q, settings["sizes"]),
    )


# -- the call ---------------------------------------------------------------------


def _rotated(
    ops: spec.ArrayOps,
    q: Array,
    k: Array | None,
    positions: Array | None,
    rotary: spec.Rotary,
    heads: spec.Heads,
    lengths: Array | None,
) -> tuple[Array, Array | None]:
    """``q`` and ``k`` rotated at the call's positions (:func:`mha_multi.spec.call_positions`)."""
    query_positions, key_positions = spec.call_positions(
        ops,
        positions,
        num_queries=ops.size(q, 1),
        num_keys=None if k is None else ops.size(k, 1),
        lengths=lengths,
    )
    tables = spec.rotary_tables(ops, q, query_positions, rotary, heads.head_dim)
    q = spec.rotate(ops, q, query_positions, rotary, heads.num_heads, heads.head_dim, tables=tables)
    if k is not None:
        shared = tables if key_positions is query_positions else None
        k = spec.rotate(
            ops, k, key_positions, rotary, heads.num_kv_heads, heads.head_dim, tables=shared
        )
    return q, k


def attend(
    facts: Facts,
    layer: Projections,
    ops: spec.ArrayOps,
    queries: Array,
    keys: Array | None,
    values: Array | None,
    valid_lens: Array | None,
    *,
    cache: spec.KVCache | None = None,
    gates: Array | None = None,
    causal: bool = False,
    return_attention_weights: bool = False,
    dropout: Callable[[Array], Array] | None = None,
    dropout_rate: float = 0.0,
    head_parallel: bool = False,
    kernel_plan: spec.KernelPlan | None = None,
    layer_options: spec.LayerOptions | None = None,
    positions: Array | None = None,
    bias: Array | None = None,
    fill: spec.CacheFill | None = None,
) -> Result:
    """Projections, the cache update, attention, gates and the output of checked arguments.

    Args:
        facts: the framework's facts.
        layer: the layer's projections.
        ops: the array-ops adapter of these arrays.
        queries, keys, values, valid_lens: as the checks returned them
            (:func:`check_call`, :func:`check_cached_call`).
        cache: ``None``, or the checked cache: the new keys and values are
            written into it (:func:`mha_multi.spec.update_cache`) and the
            queries attend to all it then holds, the causal rule inside the
            lengths.
        gates: the checked ``head_mask`` (:func:`check_gates`), or ``None``.
        causal: the spec's causal flag.
        return_attention_weights: compute the weights (the generic path).
        dropout: applied to the weights by the generic path, or ``None``.
        dropout_rate: its rate, for a fused kernel that applies dropout.
        head_parallel: the heads are split over devices (see
            :meth:`Facts.generic_attention`).
        kernel_plan: a plan decided before the call (MXNet plans outside its
            graphs, where shapes are known); ``None`` plans here.
        layer_options: the layer's checked constructor options (rotary,
            ALiBi, window, soft-capping); ``None`` for none.
        positions, bias: the call's, checked (:func:`check_options`).
        fill: a cached call's lengths as read on the host
            (:func:`check_cache_values`), for frameworks that write the
            cache in place or attend over its filled positions; ``None``
            keeps the spec's functional update over all ``max_length``.

    Returns:
        The :class:`Result`.
    """
    heads = layer.heads
    q, k, v = layer.project_inputs(queries, keys, values)
    kv_split = cache is not None
    lengths = None if cache is None else cache.lengths  # before the new rows
    options = spec.NO_OPTIONS
    if layer_options is not None and layer_options.rotary is not None:
        # Keys rotate before they enter the cache (docs: "Positions and biases").
        q, k = _rotated(ops, q, k, positions, layer_options.rotary, heads, lengths)
    if cache is not None:
        spec.check_cache_dtype(ops, cache, ops.dtype(q), ops.dtype(q))
        cache, valid_lens = facts.write_cache(
            ops, cache, k, v, valid_lens, head_dim=heads.head_dim, causal=causal, fill=fill
        )
        # The causal rule, each example's own, is in the lengths now.
        k, v, causal = cache.keys, cache.values, False
        if fill is not None and bias is None and not return_attention_weights:
            # Keys past the filled positions add nothing to any row (a user's
            # bias could make them: it keeps all of them).
            window = None if layer_options is None else layer_options.window
            k, v = attended_positions(facts, k, v, fill, q.shape[1], window=window)
    if bias is not None or (layer_options is not None and not layer_options.is_default):
        layer_options = layer_options or spec.LayerOptions()
        # ALiBi and the window see each cached query at its own position.
        frame = lengths is not None and (layer_options.alibi or layer_options.window is not None)
        options = layer_options.score_options(
            num_heads=heads.num_heads,
            bias=bias,
            query_positions=spec.cache_positions(ops, lengths, ops.size(q, 1)) if frame else None,
        )
        if not options.adjusts_scores and options.window is None:
            options = spec.NO_OPTIONS  # rotary only: the scores are d2l's
    if kernel_plan is None:
        kernel_plan = plan(
            facts,
            q,
            k,
            v,
            valid_lens,
            heads=heads,
            causal=causal,
            dropout=dropout is not None,
            return_attention_weights=return_attention_weights,
            kv_split=kv_split,
            options=options,
        )
    context = weights = None
    settings: dict[str, Any] = {"heads": heads, "kv_split": kv_split}
    if kernel_plan.fused:
        fused_settings = {
            **settings,
            "dropout_rate": dropout_rate if dropout is not None else 0.0,
            **({"options": options} if facts.passes_options else {}),
        }

        def fused(q: Array, k: Array, v: Array) -> Array | None:
            return facts.fused_attention(ops, q, k, v, valid_lens, kernel_plan, **fused_settings)

    generic = functools.partial(
        facts.generic_attention,
        ops,
        valid_lens=valid_lens,
        **settings,
        causal=causal,
        dropout=dropout,
        head_parallel=head_parallel,
        return_attention_weights=return_attention_weights,
        options=options,
    )
    if kernel_plan.guarded:
        context = facts.guarded(
            fused,
            lambda *qkv: generic(*qkv)[0],
            (q, k, v),
            options.bias,
            head_dim=heads.head_dim,
        )
    elif kernel_plan.fused:
        context = fused(q, k, v)
    if context is None:
        context, weights = generic(q, k, v)
    # Both paths' context is the heads' (B, Q, H*dh): the gates act on it alike.
    output = layer.project_output(context, gates)
    return Result(output, weights if return_attention_weights else None, cache)


def attended_positions(
    facts: Facts,
    keys: Array,
    values: Array,
    fill: spec.CacheFill,
    num_queries: int,
    *,
    window: int | None = None,
    bucket: int | None = None,
) -> tuple[Array, Array]:
    """What a cached call attends over of a cache's ``(B, H_kv, max_length, dh)`` arrays.

    The leading positions :meth:`mha_multi.spec.CacheFill.span` names for a
    call of ``num_queries`` new positions (``window``: the layer's), rounded
    up to ``bucket`` (``None``: :meth:`Facts.span_bucket_of`), through
    :meth:`Facts.cache_prefix`; all of them where the span reaches
    ``max_length``, or where a value past it is not known finite
    (:meth:`Facts.finite_past`). A fill is read from values: the arrays are
    concrete and their shapes ints.
    """
    max_length = keys.shape[2]
    bucket = facts.span_bucket_of(keys) if bucket is None else bucket
    span = fill.span(num_queries, max_length, window=window, bucket=bucket)
    if span >= max_length or not facts.finite_past(keys, values, span):
        return keys, values
    return facts.cache_prefix(keys, values, span)


def plain_self_attention(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    *,
    causal: Any,
    layer_options: spec.LayerOptions | None,
    others: Sequence[Any],
) -> bool:
    """Whether a call is plain self-attention, which :meth:`Facts.plain_attention` may answer.

    The queries are the keys and values (with a cache: the new positions),
    ``causal`` is a bool, and nothing else is asked: no lengths or layer
    options, and each of ``others``, the call's every other argument
    (returned weights, gates, positions, bias, dropout, heads mapped over
    devices or sharded), ``None`` or ``False``.
    """
    if not (
        keys is queries
        and values is queries
        and valid_lens is None
        and (causal is True or causal is False)
        and (layer_options is None or layer_options.is_default)
    ):
        return False
    # A loop, not all() of a generator: every call of every layer asks.
    for x in others:  # noqa: SIM110
        if x is not None and x is not False:
            return False
    return True


def forward(
    facts: Facts,
    layer: Projections,
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    causal: Any = False,
    return_attention_weights: bool = False,
    cache: Any = None,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    layer_options: spec.LayerOptions | None = None,
    gate_heads: int | None = None,
    dtype: Any = None,
    dropout: Callable[[Array], Array] | None = None,
    dropout_rate: float = 0.0,
    head_parallel: bool = False,
    local_gates: Callable[[Array], Array] | None = None,
    run: Callable[..., Result] = attend,
) -> Result:
    """One call of the layer: the checks, then :func:`attend`.

    Args:
        facts: the framework's facts.
        layer: the layer's projections.
        queries, keys, values, valid_lens: the layer call's arguments (docs: "The spec").
        causal, return_attention_weights, cache, head_mask: the call's options.
        positions, bias: the call's (docs: "Positions and biases").
        layer_options: the layer's checked constructor options
            (:class:`mha_multi.spec.LayerOptions`); ``None`` for none.
        gate_heads: the heads ``head_mask`` is for; ``None`` for the
            layer's (a sharded layer's gates span all its heads).
        dtype: the dtype the inputs must have, or ``None`` for any floating.
        dropout, dropout_rate, head_parallel: as in :func:`attend`.
        local_gates: maps the whole layer's checked gates to the heads this
            process computes (a sharded layer), or ``None``.
        run: what computes the checked call: :func:`attend`, or a function
            of its arguments that runs it elsewhere (MXNet's hybridized
            graphs, planned here where shapes are known and attending inside).

    Returns:
        The :class:`Result`; :meth:`Result.returned` is the layer's return value.

    Raises:
        ValueError: a ``bias`` or ALiBi on a layer whose heads are sharded
            (not supported: each process would need its heads' share).
    """
    # Every other argument of the call: a plain call leaves them unset.
    others = (return_attention_weights, head_mask, positions, bias)
    others += (dropout, head_parallel, local_gates)
    if plain_self_attention(
        queries, keys, values, valid_lens, causal=causal, layer_options=layer_options, others=others
    ):
        result = facts.plain_attention(layer, queries, cache, causal=causal, dtype=dtype)
        if result is not None:
            return result
    heads = layer.heads
    if cache is None:
        queries, keys, values, lens = check_call(
            facts, layer, queries, keys, values, valid_lens, causal=causal, dtype=dtype
        )
    else:
        queries, keys, values, lens, cache = check_cached_call(
            facts, layer, queries, keys, values, valid_lens, cache, causal=causal, dtype=dtype
        )
    all_heads = heads.num_heads if gate_heads is None else gate_heads
    gates = check_gates(facts, head_mask, num_heads=all_heads, like=queries)
    if gates is not None and local_gates is not None:
        gates = local_gates(gates)
    extra: dict[str, Any] = {}
    if (
        positions is not None
        or bias is not None
        or (layer_options is not None and not layer_options.is_default)
    ):
        positions, bias = check_options(
            facts,
            positions,
            bias,
            num_heads=all_heads,
            like=queries,
            num_keys=keys.shape[1] if cache is None else cache.keys.shape[2],
            cached=cache is not None,
        )
        sharded = all_heads != heads.num_heads or local_gates is not None
        if sharded and (bias is not None or (layer_options and layer_options.alibi)):
            raise ValueError("bias and alibi are not supported on a layer whose heads are sharded")
        extra = {"layer_options": layer_options, "positions": positions, "bias": bias}
    if cache is not None:
        fill = check_cache_values(facts, cache, lens, 0 if keys is None else queries.shape[1])
        if fill is not None and facts.attends_filled:
            extra["fill"] = fill
    return run(
        facts,
        layer,
        facts.ops(queries),
        queries,
        keys,
        values,
        lens,
        cache=cache,
        gates=gates,
        causal=bool(causal),
        return_attention_weights=return_attention_weights,
        dropout=dropout,
        dropout_rate=dropout_rate,
        head_parallel=head_parallel,
        **extra,
    )


def read_all(arrays: Sequence[Any], read_one: Callable[[Any], np.ndarray]) -> list[Any]:
    """``read_one`` of each array, ``None`` entries kept: a helper of :meth:`Facts.read`."""
    return [None if x is None else read_one(x) for x in arrays]
