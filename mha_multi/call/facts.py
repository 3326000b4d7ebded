"""The framework's side of the call's contract: :class:`Facts`, one subclass per framework.

Each framework's facts module (``mha_multi/<framework>/_facts.py``) subclasses
it: how its arrays are checked and converted, which values can be read on the
host and when, its array-ops adapter, and its fused kernel. Eager and
compiled execution differ only in what :meth:`Facts.read` can read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.call.contract import Array, Projections, Result

#: What every framework's facts module (``mha_multi/<framework>/_facts.py``)
#: defines and exports besides its :class:`Facts` subclass: its dtypes by
#: name, devices, exact-float32 settings and conversions, which the parity
#: harness and the benchmarks read through it (docs: "Adding a backend").
FACTS_MODULE_NAMES = (
    "DTYPES",
    "device_description",
    "exact_float32",
    "gpu_available",
    "host_array",
    "lens_to_native",
    "sync",
    "to_native",
    "to_numpy",
)


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
        rows_of_one_table: the cosine and sine of an angle give the same
            numbers whatever the array they are in, so that a cached call's
            rotary tables may be rows of a table kept of every position of its
            cache (:meth:`first_rows`, and for a ragged batch :meth:`rows_at`);
            ``False`` where a kernel's vectorized
            and scalar forms differ (TensorFlow's CPU kernels, by an ulp).
        map_pieces: ``map_pieces(function, stacked)``, ``function`` of each
            piece of a batch in turn (:func:`mha_multi.spec.in_pieces`), for a
            framework whose generic path may take its batch in pieces
            (:meth:`batch_pieces`); ``None`` where it takes the whole batch.
        tracing: ``None``, or a function telling whether a tracer that must
            see a call's checks and plan run is tracing now (``torch.compile``'s
            would guard on the table of decisions): they are then made anew,
            never looked up as their signature's first call made them
            (:mod:`mha_multi.call.decisions`). ``None``: the framework's traces
            run Python as it is.
    """

    kernel: spec.FusedKernel | None = None
    vmap: Callable[..., Callable[..., Any]] | None = None
    passes_options: bool = False
    attends_filled: bool = False
    rows_of_one_table: bool = False
    map_pieces: Callable[[Callable[[Any], Any], Any], Any] | None = None
    tracing: Callable[[], bool] | None = None

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

    def constants_key(self, like: Array) -> Any:
        """Where constants made for an eager call on ``like`` land and are computed,
        as a hashable (its device, and any mode that limits what they may serve), or
        ``None``: ``like`` is traced, or the framework keeps nothing between calls
        (the default).

        What a call makes from constants alone, its rotary tables at the default
        positions, is then made once per such key and reused by later calls
        (:mod:`mha_multi.call.rotary_tables`; docs: "Fast paths"). Nothing traced
        is ever kept.
        """
        return None

    def first_rows(self, x: Array, start: int, stop: int) -> Array:
        """``x[start:stop]``, rows of the first axis of a kept table; only frameworks
        whose :meth:`constants_key` answers and :attr:`rows_of_one_table` holds are asked."""
        raise NotImplementedError

    def rows_at(self, x: Array, index: np.ndarray) -> Array | None:
        """``x[index]``: rows of the first axis of a kept table picked by integers on the
        host (any shape, each below ``x``'s first size), or ``None`` where the framework
        picks none (the call then makes its own tables); asked as :meth:`first_rows` is."""
        return None

    # -- the fused kernel ---------------------------------------------------

    def kernel_serves(self, q: Array) -> bool:
        """Whether :attr:`kernel` serves the dtype and precision of ``q``."""
        return True

    def kernel_takes_grouped(self, q: Array, num_queries: Any, head_dim: int) -> bool:
        """Whether grouped key/value heads are best given to :attr:`kernel` as they are,
        for ``num_queries`` queries ``q`` of ``head_dim`` (where it takes them at all);
        ``False`` has the plan repeat them once (:attr:`mha_multi.spec.KernelPlan.repeat_kv`)."""
        return True

    def kernel_takes_mask(self, q: Array, num_queries: Any, num_keys: Any) -> bool:
        """Whether :attr:`kernel` is to take an explicit mask or bias for ``num_queries``
        queries ``q`` over ``num_keys`` keys, where a call needs one; ``False`` has such a
        call take the generic path, the faster there (:func:`mha_multi.spec.plan_kernel`'s
        ``mask_taken``)."""
        return True

    def on_host(self, q: Array) -> bool:
        """Whether ``q`` lives on the host, where :meth:`plan_values` waits for nothing
        (elsewhere the plan reads only where :func:`mha_multi.spec.reads_values` says)."""
        return True

    def reads_values(
        self, q: Array, num_queries: Any, num_keys: Any, *, total_scores: int | None
    ) -> bool:
        """Whether :func:`~mha_multi.call.plan` reads a call's values (:meth:`plan_values`),
        to take the kernel where they allow it: :func:`mha_multi.spec.reads_values`
        (on a device only where the wait pays). ``total_scores``: the call's scores
        in all, or ``None`` where it records a gradient."""
        return spec.reads_values(self.on_host(q), num_queries, num_keys, total_scores=total_scores)

    def records_gradient(self, q: Array) -> bool:
        """Whether a gradient is recorded through the projection ``q``, so that the
        generic path keeps its ``(B, H, Q, K)`` weights for the backward pass
        (:func:`mha_multi.spec.reads_values`); ``True`` where the framework
        cannot tell."""
        return True

    def plan_signature(self, q: Array) -> Any:
        """What of the projected queries ``q``, besides their shape, :meth:`kernel_serves`,
        :meth:`kernel_takes_grouped` and :meth:`kernel_takes_mask` read, hashable: the
        part of a call's kernel plan that its shapes and flags decide
        (:func:`mha_multi.call.plan`) is then made once per signature and looked up
        (docs: "Fast paths").

        ``None`` (the default, and what a framework answers while its tracer
        runs) plans every call anew.
        """
        return None

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

    def cache_prefix(
        self, keys: Array, values: Array, span: int, first: int = 0
    ) -> tuple[Array, Array]:
        """The first ``span`` positions of a cache's ``(B, H_kv, max_length, dh)`` arrays
        (from position ``first`` on, where :meth:`finite_before` said so).

        Only frameworks that set :attr:`attends_filled` are asked.
        """
        raise NotImplementedError

    def finite_before(self, keys: Array, values: Array, first: int) -> bool:
        """Whether every value of a cache before position ``first`` is known finite.

        A call may then leave out the positions before its queries' window
        (:func:`mha_multi.call.attended_positions`): a hidden value's weight
        is 0, and 0 times a NaN is NaN. The default, ``False``, attends from
        position 0.
        """
        return False

    def lengths_from(self, ops: spec.ArrayOps, valid_lens: Array, first: int) -> Array:
        """A cached call's lengths (what the cache's write returned) counted from cache
        position ``first``: the visibility of the keys from there on."""
        return valid_lens - first

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
        self,
        layer: Projections,
        queries: Any,
        cache: Any,
        *,
        causal: bool,
        dtype: Any,
        valid_lens: Any = None,
        options: spec.LayerOptions | None = None,
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
            options: the layer's checked options, or ``None`` for none: a
                framework answers the layers whose options it takes (rotary
                positions rotate at their defaults).
            valid_lens: the call's lengths, unchecked, or ``None``: a
                framework answers the lengths it takes.
        """
        return None

    def cross_attention(
        self, layer: Projections, queries: Any, keys: Any, values: Any, **flags: Any
    ) -> Result | None:
        """Plain attention to keys and values of the call's own
        (:func:`plain_cross_attention`, without a cache) run in few operations, or
        ``None``: as :meth:`plain_attention`, the generic flow's operations on the
        same arrays or ``None``. ``flags``: ``causal``, ``dtype``, ``options`` and
        ``valid_lens``, as :meth:`plain_attention` takes them. The default answers
        none.
        """
        return None

    # -- the generic path ---------------------------------------------------

    def batch_pieces(self, q: Array, example_bytes: int) -> int:
        """How many pieces of the batch the generic path of a call of queries ``q``
        takes one after another (:func:`mha_multi.spec.batch_pieces`;
        ``example_bytes``: one example's float32 scores ``(H, Q, K)``), asked only
        where there is :attr:`map_pieces` and the sizes are known ints. The default,
        1: the whole batch."""
        return 1

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
        """:func:`mha_multi.spec.attention`, head by head where the heads are split, or
        in pieces of the batch where the framework takes them.

        With ``head_parallel`` (and no dropout, whose mask is drawn for the
        whole ``(B*H, Q, K)`` weights, nor score options) the attention is
        mapped over the key/value heads
        (:func:`mha_multi.spec.attention_by_kv_heads`), so that sharded heads
        are computed where they live. Otherwise, where the framework has
        :attr:`map_pieces` and :meth:`batch_pieces` answers more than 1, the
        batch is taken in pieces (:func:`mha_multi.spec.in_pieces`): examples
        never mix, so the pieces compute the function of the whole batch, and
        every argument has the batch first (a cache's split keys and values
        ``(B, H_kv, M, dh)``, ``kv_split``, included). Dropout draws one mask
        for the whole batch and score options may hold arrays with a batch
        axis of their own, so with either the batch is one piece; so is a batch
        whose sizes a trace leaves unknown or symbolic (TensorFlow's graphs,
        ``jax.export``).
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
        pieces = 1
        if self.map_pieces is not None and dropout is None and plain and not head_parallel:
            # (Sizes asked only here: MXNet's hybridized symbols have none.)
            batch, num_queries, num_keys = q.shape[0], q.shape[1], k.shape[2 if kv_split else 1]
            if type(batch) is int and type(num_queries) is int and type(num_keys) is int:
                pieces = self.batch_pieces(q, heads.num_heads * num_queries * num_keys * 4)
        if pieces == 1:
            return spec.attention(ops, q, k, v, valid_lens, dropout=dropout, **settings)

        def attention(q: Array, k: Array, v: Array, lens: Any) -> tuple[Array, Any]:
            context, weights = spec.attention(ops, q, k, v, lens, **settings)
            return context, weights if return_attention_weights else None  # (pieces stack both)

        return spec.in_pieces(attention, (q, k, v, valid_lens), pieces, self.map_pieces)


def read_all(arrays: Sequence[Any], read_one: Callable[[Any], np.ndarray]) -> list[Any]:
    """``read_one`` of each array, ``None`` entries kept: a helper of :meth:`Facts.read`."""
    return [None if x is None else read_one(x) for x in arrays]
