"""Multi-head attention as a pure function of (canonical weights, inputs).

Both Flax modules (:class:`mha_multi.jax.MultiHeadAttention` on NNX and
:class:`mha_multi.jax.linen.MultiHeadAttention`) only gather their parameters
and call :func:`multi_head_attention`, so for the same weights they trace the
very same operations and give bit-identical results.

Every check here reads static shapes and dtypes only, so it runs (and raises)
while a ``jax.jit``-ed call is being traced, before any array operation.

Two paths compute the attention. The generic one is :func:`mha_multi.spec.attention`
on :class:`~mha_multi.jax._ops.JaxOps`; it materialises the weights and is
the only one that can return them or apply dropout. The fused one is
:func:`jax.nn.dot_product_attention` with the spec's masking rules translated
into its arguments and its fully hidden rows given the spec's value; it can
run when neither the weights nor dropout are needed, as
:func:`mha_multi.spec.plan_kernel` decides for every backend (with the
kernel's facts in :data:`DOT_PRODUCT_ATTENTION`). Which kernel runs is
``implementation``:

* ``None`` (the default): cuDNN's flash attention for 16-bit inputs on a
  GPU, which never materialises the ``(B, H, Q, K)`` scores; the generic path
  everywhere else, and wherever cuDNN declines the shapes. XLA's kernel is
  the generic path's own arithmetic and measured no faster (slower
  forward+backward on CPU; see ``python -m mha_multi.bench``), so it is not
  chosen automatically.
* ``"xla"`` or ``"cudnn"``: that kernel, wherever the fused path is exact
  (and no axis is empty).
* ``"generic"``: always the generic path.

On a CPU the generic path takes a batch whose ``(B, H, Q, K)`` scores outgrow
the caches in pieces of examples, one after another, and recomputes a
piece's scores in its backward pass (see :func:`_generic_attention`); the
projections read their kernels with a heads axis (see :func:`_linear`). Both
change which kernels XLA runs, not the function: the numbers agree to
float32 rounding.

With a ``cache`` (:class:`mha_multi.spec.KVCache`, docs: "Generating with a
cache") a call is one step of incremental decoding: the new keys and values
are projected and written into the cache by :func:`mha_multi.spec.update_cache`
(a gather and a select over the cache's static ``max_length``, so one
compilation serves every step of the same length), and the queries attend to
the cache's keys and values through the same kernel plan as an ordinary call.
Eager calls read the lengths and raise on a cache overflow; traced calls
cannot, and drop the positions that do not fit (see :func:`multi_head_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from mha_multi import spec
from mha_multi.jax._ops import JaxOps, PrecisionLike, dtype_kind, is_16_bit
from mha_multi.weights import WeightsConfig, check_weights

__all__ = [
    "as_valid_lens",
    "batch_pieces",
    "check_cached_call",
    "check_call",
    "check_head_mask",
    "check_implementation",
    "check_params",
    "fused_dtype_supported",
    "init_cache",
    "multi_head_attention",
]

INPUT_NAMES = ("queries", "keys", "values")

#: The values of ``implementation``; ``None`` chooses (see the module notes).
IMPLEMENTATIONS = (None, "generic", "xla", "cudnn")

#: Dtypes the fused path serves. Its softmax always runs in float32, which is
#: the spec's rule for 16-bit inputs and exact for float32, but would cost
#: float64 its precision.
#: (Names, not dtype objects: resolving them is left to call time.)
FUSED_DTYPES = frozenset({"float32", "bfloat16", "float16"})


def _stand_in(name: str, value: Any) -> np.ndarray:
    """A zero-strided numpy array with ``value``'s shape, for shape-only checks.

    Tracers cannot become numpy arrays, and ``bfloat16`` is of numpy kind
    ``'V'``; the stand-in is ``float32`` for any floating dtype and keeps
    other dtypes, so :func:`~mha_multi.weights.check_weights` still rejects
    integer weights with its own message.
    """
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        try:
            value = np.asarray(value)
        except Exception as error:
            raise TypeError(f"weights[{name!r}] is not convertible to a numpy array") from error
    dtype = np.float32 if dtype_kind(value.dtype) == "f" else value.dtype
    return np.broadcast_to(np.zeros((), dtype), tuple(value.shape))


def check_params(
    params: Mapping[str, Any],
    *,
    num_hiddens: int | None = None,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    bias: bool | None = None,
) -> WeightsConfig:
    """Validates canonical weights by their shapes and dtypes (traceable).

    Args:
        params: canonical weights (``W_q``... and, with biases, ``b_q``...);
            arrays, tracers or array-likes.
        num_hiddens, query_size, key_size, value_size, bias: what the weights
            must describe, where known.

    Returns:
        The sizes the weights describe.

    Raises:
        TypeError: ``params`` is not a mapping, or an entry is not floating.
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"weights must be a mapping of names to arrays; got {type(params)}")
    stand_ins = {name: _stand_in(name, value) for name, value in params.items()}
    _, config = check_weights(
        stand_ins,
        num_hiddens=num_hiddens,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        bias=bias,
    )
    return config


def as_valid_lens(valid_lens: Any) -> jax.Array | None:
    """``valid_lens`` as a JAX array (or tracer), its dtype checked.

    Accepts ``None``, JAX arrays, numpy arrays and nested sequences. Integer
    and floating dtypes are accepted (the rule is ``j < valid_lens``).
    Integer lengths that JAX cannot hold (beyond 32 bits without
    ``jax_enable_x64``, ``uint64`` beyond ``int64`` with it) are clipped,
    not wrapped: ``2**62`` still hides nothing instead of everything. JAX
    arrays are already within JAX's range and are taken as they are.

    Args:
        valid_lens: ``None`` or the lengths.

    Returns:
        ``None`` or the lengths as a JAX array.

    Raises:
        TypeError: a boolean, string or otherwise non-numeric ``valid_lens``.
    """
    if valid_lens is None:
        return None
    if isinstance(valid_lens, jax.Array):
        spec.check_valid_lens_dtype(dtype_kind(valid_lens.dtype))
        return valid_lens
    return jnp.asarray(spec.lens_as_numpy(valid_lens, jax.dtypes.canonicalize_dtype(np.int64)))


def _check_input(name: str, x: Any) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if dtype_kind(x.dtype) != "f":
        raise TypeError(f"{name} must be a floating-point array; got {x.dtype}")
    return x


def check_call(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    causal: Any = False,
) -> tuple[Any, Any, Any, jax.Array | None]:
    """Validates the arguments of a call (traceable) and converts ``valid_lens``.

    Args:
        queries: ``(B, Q, query_size)`` floating array.
        keys: ``(B, K, key_size)`` floating array.
        values: ``(B, K, value_size)`` floating array.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
        query_size, key_size, value_size: the layer's input sizes, or
            ``None`` where not known yet.
        causal: the call's ``causal`` flag, which must be a bool.

    Returns:
        ``(queries, keys, values, valid_lens)`` with ``valid_lens`` a JAX array.

    Raises:
        TypeError: an input is not a floating array, ``valid_lens`` is not
            numeric, or ``causal`` is not a bool.
        ValueError: inconsistent shapes, named (see
            :func:`mha_multi.spec.check_inputs`).
    """
    queries, keys, values = (
        _check_input(name, x) for name, x in zip(INPUT_NAMES, (queries, keys, values), strict=True)
    )
    lens = as_valid_lens(valid_lens)
    spec.check_inputs(
        queries.shape,
        keys.shape,
        values.shape,
        None if lens is None else lens.shape,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        causal=causal,
    )
    return queries, keys, values, lens


def check_cached_call(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    cache: Any,
    *,
    heads: spec.Heads,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    causal: Any = False,
) -> tuple[Any, Any, Any, jax.Array | None, spec.KVCache]:
    """Validates the arguments of a cached call (traceable) and converts ``valid_lens``.

    Shapes and dtypes only; the lengths are read by the call itself, where
    they can be (eager calls).

    Args:
        queries: ``(B, T, query_size)`` floating array: ``T`` new positions.
        keys: ``(B, T, key_size)`` floating array, or ``None`` (with
            ``values``) to attend to the cache without appending.
        values: ``(B, T, value_size)`` floating array, or ``None``.
        valid_lens: ``None`` or ``(B,)`` integers: the real new positions of
            each example.
        cache: a :class:`mha_multi.spec.KVCache` of the layer's layout.
        heads: the layer's head layout.
        query_size, key_size, value_size: the layer's input sizes, or
            ``None`` where not known yet.
        causal: the call's ``causal`` flag, which must be a bool.

    Returns:
        ``(queries, keys, values, valid_lens, cache)``, ``valid_lens`` a JAX
        array and the cache's entries JAX arrays.

    Raises:
        TypeError: ``cache`` is not a ``KVCache``, an input is not a floating
            array, or ``valid_lens`` or ``cache.lengths`` are not integers.
        ValueError: inconsistent shapes, named (see
            :func:`mha_multi.spec.check_cached_inputs`).
    """
    if not isinstance(cache, spec.KVCache):
        raise TypeError(
            f"cache must be a KVCache (from the layer's init_cache); got {type(cache).__name__}"
        )
    cache = spec.KVCache(*(jnp.asarray(x) for x in cache))
    queries = _check_input("queries", queries)
    keys, values = (
        None if x is None else _check_input(name, x)
        for name, x in zip(INPUT_NAMES[1:], (keys, values), strict=True)
    )
    lens = as_valid_lens(valid_lens)
    spec.check_cached_call(
        queries,
        keys,
        values,
        lens,
        cache,
        heads=heads,
        dtype_kind=dtype_kind,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        causal=causal,
    )
    return queries, keys, values, lens, cache


def check_head_mask(head_mask: Any, *, num_heads: int, batch: int) -> Any:
    """Validates a ``head_mask`` by its shape and dtype (traceable; docs: "Heads").

    Args:
        head_mask: ``None``, or the heads' gates ``(num_heads,)`` or
            ``(batch, num_heads)``: a floating JAX or numpy array (or tracer).
        num_heads: the layer's (query) heads.
        batch: the call's batch size.

    Returns:
        ``None`` or the gates as they were given (their dtype is cast where
        they are applied, :func:`mha_multi.spec.apply_head_mask`).

    Raises:
        TypeError: ``head_mask`` is not an array (a list, say) or not floating.
        ValueError: another shape.
    """
    if head_mask is None:
        return None
    if not (hasattr(head_mask, "shape") and hasattr(head_mask, "dtype")):
        raise TypeError(
            "head_mask must be a floating-point array of shape (num_heads,) or "
            f"(batch, num_heads); got {type(head_mask).__name__}"
        )
    spec.check_head_mask(
        tuple(head_mask.shape), dtype_kind(head_mask.dtype), num_heads=num_heads, batch=batch
    )
    return head_mask


def _check_cache_values(cache: spec.KVCache, valid_lens: jax.Array | None, num_new: int) -> None:
    """:func:`mha_multi.spec.check_cache_values` where the lengths are concrete.

    One transfer to the host in an eager call; nothing while traced, where
    :func:`mha_multi.spec.update_cache` drops what would overflow instead.
    """
    if any(isinstance(x, jax.core.Tracer) for x in (cache.lengths, valid_lens)):
        return
    lengths, valid_lens = jax.device_get((cache.lengths, valid_lens))
    spec.check_cache_values(lengths, valid_lens, num_new, cache.keys.shape[2])


def init_cache(
    heads: spec.Heads,
    batch_size: int,
    max_length: int,
    dtype: DTypeLike,
    *,
    device: jax.Device | None = None,
) -> spec.KVCache:
    """An empty key/value cache for ``heads`` (what the layers' ``init_cache`` return).

    Args:
        heads: the layer's head layout.
        batch_size: ``B``, the examples decoded together.
        max_length: the positions each example can hold.
        dtype: the dtype of the keys and values, floating.
        device: where the arrays live; ``None`` for JAX's default device.

    Returns:
        ``KVCache(keys, values, lengths)``: zero keys and values
        ``(B, num_kv_heads, max_length, head_dim)`` and zero lengths ``(B,)``
        int32.

    Raises:
        TypeError: ``batch_size`` or ``max_length`` not an int, or ``dtype``
            not floating.
        ValueError: ``batch_size`` or ``max_length`` negative.
    """
    shape = spec.cache_shape(batch_size, max_length, heads)
    if dtype_kind(dtype) != "f":
        raise TypeError(f"the cache's dtype must be floating; got {np.dtype(dtype)}")
    # Two buffers, not one shared: a jit step may donate keys and values.
    keys, values = (jnp.zeros(shape, dtype, device=device) for _ in range(2))
    return spec.KVCache(keys, values, jnp.zeros(shape[:1], jnp.int32, device=device))


def _linear(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    precision: PrecisionLike,
    num_heads: int,
) -> jax.Array:
    """``x @ kernel + bias``, the kernel's columns read as ``num_heads`` groups.

    The same matrix product as with the 2-D kernel; XLA:CPU then takes the
    weight gradient as a fast ``g^T x`` product and a small transpose, where
    for a 2-D kernel it takes ``x^T g`` on a slower path (the layer's
    forward+backward measured about 10% faster at ``B = 8``, ``N = 128``,
    512 hiddens, on 2 cores). For ``W_q``, ``W_k`` and ``W_v`` the groups are
    the heads, as Flax holds them.

    16-bit operands accumulate in float32, and the bias joins the
    accumulator, so ``x @ W + b`` is rounded once.
    """
    features, width = kernel.shape
    wide = is_16_bit(x.dtype)
    y = jnp.einsum(
        "...d,dhe->...he",
        x,
        kernel.reshape(features, num_heads, width // num_heads),
        precision=precision,
        preferred_element_type=jnp.float32 if wide else None,
    ).reshape(*x.shape[:-1], width)
    if bias is not None:
        y = y + (bias.astype(jnp.float32) if wide else bias)
    return y.astype(x.dtype) if wide else y


def _dropout(rng: jax.Array, rate: float, x: jax.Array) -> jax.Array:
    # The same draw as flax's Dropout: keep with probability 1 - rate, scale up.
    keep = 1.0 - rate
    mask = jax.random.bernoulli(rng, keep, x.shape)
    return lax.select(mask, x / keep, jnp.zeros_like(x))


def _precision_setting(precision: PrecisionLike) -> str | None:
    """``precision`` as a ``jax.default_matmul_precision`` value.

    :func:`jax.nn.dot_product_attention` takes no precision argument; its
    products follow ``jax_default_matmul_precision``, so the fused path sets
    that for the duration of the call.

    Returns:
        ``None`` for ``None`` (keep the ambient setting), else the setting.

    Raises:
        ValueError: a precision no single setting expresses (two different
            operand precisions, a custom ``DotAlgorithm``).
    """
    if precision is None:
        return None
    if isinstance(precision, (list, tuple)):
        if len(precision) == 2 and precision[0] == precision[1]:
            return _precision_setting(precision[0])
        raise ValueError(f"no single matmul precision setting for {precision!r}")
    if isinstance(precision, lax.Precision):
        return precision.name.lower()
    if isinstance(precision, lax.DotAlgorithmPreset):
        return precision.name
    if isinstance(precision, str):
        lax_precision = getattr(lax.Precision, precision.upper(), None)
        if lax_precision is not None or precision in lax.DotAlgorithmPreset.__members__:
            return precision
        # Legacy aliases such as "float32" or "bfloat16".
        return lax.Precision(precision).name.lower()
    raise ValueError(f"no single matmul precision setting for {precision!r}")


def check_implementation(implementation: Any) -> None:
    """Raises ``ValueError`` unless ``implementation`` is one of :data:`IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be None, 'generic', 'xla' or 'cudnn'; got {implementation!r}"
        )


def fused_dtype_supported(dtype: DTypeLike, precision: PrecisionLike = None) -> bool:
    """Whether :func:`jax.nn.dot_product_attention` serves ``dtype`` and ``precision``.

    Its softmax is float32, so float64 stays on the generic path, and a
    precision it cannot be given does too. (It returns no weights and has no
    dropout: :func:`mha_multi.spec.plan_kernel` decides those for every
    backend alike.)
    """
    if np.dtype(dtype).name not in FUSED_DTYPES:
        return False
    try:
        _precision_setting(precision)
    except ValueError:
        return False
    return True


def _platform(x: jax.Array) -> str:
    """The platform ``x`` lives on; the default backend for tracers under ``jit``."""
    if isinstance(x, jax.core.Tracer):
        return jax.default_backend()
    return next(iter(x.devices())).platform


def _dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    is_causal: bool,
    seq_lengths: jax.Array | None,
    implementation: str,
) -> jax.Array:
    """One :func:`jax.nn.dot_product_attention` call (looked up at call time)."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=is_causal,
        key_value_seq_lengths=seq_lengths,
        implementation=implementation,
    )


#: The most bytes of float32 scores ``(b, H, Q, K)`` that one piece of the
#: batch holds on a CPU (see :func:`batch_pieces`).
CPU_PIECE_BYTES = 8 << 20


def batch_pieces(batch: int, example_bytes: int) -> int:
    """How many pieces of the batch the generic path takes one after another on a CPU.

    There the generic path is bound by memory once its ``(B, H, Q, K)``
    arrays (scores, masked scores, weights) outgrow the caches: each kernel
    writes them out and the next reads them back. Pieces whose scores stay
    within :data:`CPU_PIECE_BYTES` are read back from the cache. (A GPU runs
    one large batched kernel best: there the batch is one piece.)

    Args:
        batch: ``B``.
        example_bytes: the bytes of one example's float32 scores, ``H*Q*K*4``.

    Returns:
        1 where the whole batch fits, else the smallest divisor of ``B``
        whose pieces fit (``B`` where none does).
    """
    if batch * example_bytes <= CPU_PIECE_BYTES:
        return 1
    for pieces in range(2, batch):
        if batch % pieces == 0 and batch // pieces * example_bytes <= CPU_PIECE_BYTES:
            return pieces
    return batch


def _generic_attention(
    ops: JaxOps,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid_lens: jax.Array | None,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    causal: bool,
    dropout: Callable[[jax.Array], jax.Array] | None,
    return_attention_weights: bool,
    kv_split: bool = False,
    head_parallel: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`mha_multi.spec.attention`, on the whole batch or piece by piece.

    Examples never mix, so the pieces compute the same function as the whole
    batch; every argument has the batch first, a cache's split keys and
    values ``(B, H_kv, M, dh)`` (``kv_split``) included, so cached calls
    are taken in pieces alike. A piece's backward pass computes its scores
    and weights again rather than storing them for every piece: it reads
    them from the cache instead of memory, and training holds one piece's
    ``(b, H, Q, K)`` arrays rather than the batch's. Dropout draws one mask
    for the whole batch, as Flax's does, so with dropout the batch is one
    piece.

    With ``head_parallel`` (and no dropout, whose mask must stay the one
    drawn for the whole ``(B*H, Q, K)`` weights) the attention is mapped
    over the key/value heads (:func:`mha_multi.spec.attention_by_kv_heads`), so that sharded
    heads are computed where they live.

    Returns:
        ``(context, weights)``, the weights ``None`` unless asked for.
    """

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        options = {
            "num_heads": num_heads,
            "head_dim": head_dim,
            "num_kv_heads": num_kv_heads,
            "causal": causal,
            "kv_split": kv_split,
        }
        if head_parallel and dropout is None:
            context, weights = spec.attention_by_kv_heads(
                ops, q, k, v, lens, vmap=jax.vmap, **options
            )
        else:
            context, weights = spec.attention(ops, q, k, v, lens, dropout=dropout, **options)
        return context, weights if return_attention_weights else None

    batch = q.shape[0]
    pieces = 1
    if dropout is None and _platform(q) == "cpu":
        num_keys = k.shape[2 if kv_split else 1]
        pieces = batch_pieces(batch, num_heads * q.shape[1] * num_keys * 4)
    if pieces == 1:
        return attention(q, k, v, valid_lens)

    def split(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else x.reshape(pieces, batch // pieces, *x.shape[1:])

    def merge(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else x.reshape(batch, *x.shape[2:])

    # lax.map already keeps XLA from merging the pieces: no CSE barrier needed.
    piece = jax.checkpoint(lambda args: attention(*args), prevent_cse=False)
    context, weights = lax.map(piece, tuple(map(split, (q, k, v, valid_lens))))
    return merge(context), merge(weights)


#: JAX's fused kernel: it takes key lengths and a mask with its own causal
#: flag, and replaces hidden scores (with a large negative number) as the spec
#: does; it has no dropout.
DOT_PRODUCT_ATTENTION = spec.FusedKernel(
    "jax.nn.dot_product_attention",
    takes_key_lengths=True,
    mask_and_causal=True,
    replaces_hidden_scores=True,
    takes_grouped_heads=True,
)


def _fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid_lens: jax.Array | None,
    plan: spec.KernelPlan,
    *,
    heads: spec.Heads,
    precision: PrecisionLike,
    implementation: str,
    kv_split: bool = False,
) -> jax.Array:
    """:func:`jax.nn.dot_product_attention` with the spec's masking semantics.

    Args:
        q: projected queries ``(B, Q, num_heads*head_dim)``; ``k``, ``v``
            ``(B, K, num_kv_heads*head_dim)``, or with ``kv_split`` a
            cache's ``(B, num_kv_heads, K, head_dim)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
        plan: what :func:`mha_multi.spec.plan_kernel` decided the kernel is given.
        heads: the head layout; the kernel takes grouped key/value heads as
            they are.
        implementation: ``"xla"`` or ``"cudnn"``.
        kv_split: ``k`` and ``v`` are a cache's, split into heads.

    Returns:
        The concatenated heads ``(B, Q, num_heads*head_dim)``.
    """
    ops = JaxOps(precision)
    dtype = q.dtype
    if implementation == "xla" and is_16_bit(dtype):
        # XLA's kernel multiplies its 16-bit weights by the 16-bit values with
        # no float32 accumulator; in float32 it gives the spec's products
        # (the products of 16-bit numbers are exact there), rounded once below.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    # (B, T, H*dh) -> (B, T, H, dh) is the kernel's layout: no transposes.
    q = ops.split_axis(q, 2, (heads.num_heads, heads.head_dim))
    if kv_split:
        # The cache keeps the spec's (B, H_kv, M, dh), which the generic path
        # reads with no copy; jax.nn takes only (B, M, H_kv, dh). One swap
        # per call: XLA's kernel folds it into its products' dimension
        # numbers, and for cuDNN's it is one copy of what the kernel reads
        # anyway, where a cache kept in the kernel's layout would cost the
        # generic path (and so every step that returns weights) the copy.
        k, v = (jnp.swapaxes(x, 1, 2) for x in (k, v))
    else:
        k, v = (ops.split_axis(x, 2, (heads.num_kv_heads, heads.head_dim)) for x in (k, v))
    num_queries, num_keys = q.shape[1], k.shape[1]
    seq_lengths = None
    if plan.key_lengths:
        # j < len for integer j and len is what the kernel's key lengths say.
        # A row with len <= 0 is replaced below; a length of at least 1 keeps
        # the kernel's own row well defined there (a flash kernel may leave a
        # row with no key NaN, and NaN would reach the gradients through the
        # replacement).
        seq_lengths = jnp.clip(valid_lens, 1, num_keys).astype(jnp.int32)
    mask = plan.mask(ops, num_queries, num_keys, valid_lens)
    if implementation == "cudnn" and mask is not None:
        # cuDNN turns the mask into a bias, which must span every query.
        mask = jnp.asarray(mask)
        mask = mask if mask.ndim == 4 else mask[None, None]
        mask = jnp.broadcast_to(mask, (mask.shape[0], 1, num_queries, num_keys))
    setting = _precision_setting(precision)
    with contextlib.nullcontext() if setting is None else jax.default_matmul_precision(setting):
        output = _dot_product_attention(q, k, v, mask, plan.is_causal, seq_lengths, implementation)
    visible = plan.fix_visibility(ops, num_queries, num_keys, valid_lens)
    output = spec.fix_fully_hidden_rows(
        ops, output, v, visible, heads_axis=2, group_size=heads.group_size
    )
    return ops.merge_axes(output, 2).astype(dtype)


def multi_head_attention(
    params: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dropout_rng: jax.Array | None = None,
    dtype: DTypeLike | None = None,
    precision: PrecisionLike = None,
    return_attention_weights: bool = True,
    implementation: str | None = None,
    cache: spec.KVCache | None = None,
    head_mask: Any = None,
    head_parallel: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, spec.KVCache]:
    """d2l's multi-head attention, exact to :mod:`mha_multi.spec`, as a pure function.

    Differentiable in ``params`` and the inputs; works under ``jax.jit``
    (``num_heads``, ``num_kv_heads``, ``causal``, ``dropout_rate``, ``deterministic``,
    ``dtype``, ``precision``, ``return_attention_weights``,
    ``implementation`` and ``head_parallel`` static), ``jax.grad`` and ``jax.vmap``.

    With ``return_attention_weights=False`` and no active dropout, float32
    and 16-bit calls may take the fused path (:func:`jax.nn.dot_product_attention`;
    by default cuDNN's for 16-bit inputs on a GPU, see the module notes); its
    result is the spec's, fully hidden rows included.

    With a ``cache`` the call is one step of incremental decoding (docs:
    "Generating with a cache"): example ``b`` appends its first
    ``valid_lens[b]`` new keys and values (all ``T`` by default) at
    positions ``cache.lengths[b]`` on, and query ``i`` sees the cache's
    positions below ``cache.lengths[b] + valid_lens[b]`` and, when causal,
    up to its own position ``cache.lengths[b] + i``. The cache is an
    argument and a result (a pytree), so a ``jax.jit``-ed step is compiled
    once for each ``T``. Eager calls raise ``ValueError`` on a cache that
    would overflow; a traced call cannot read the lengths, and then writes
    no position at or past ``max_length`` and overwrites no kept position:
    what does not fit is dropped, and ``lengths`` still counts it, so
    ``lengths > max_length`` afterwards tells that it happened.

    With a ``head_mask`` (docs: "Heads") head ``h``'s context, its slice of
    ``weights @ v``, is multiplied by ``head_mask[..., h]`` before ``W_o``
    (:func:`mha_multi.spec.apply_head_mask`), on every path: the fused
    kernel's output is that context, so the gates change no kernel plan.
    The call is differentiable in the gates.

    Args:
        params: canonical weights: ``W_q (query_size, num_heads*head_dim)``,
            ``W_k (key_size, num_kv_heads*head_dim)``, ``W_v (value_size,
            num_kv_heads*head_dim)``, ``W_o (num_heads*head_dim, num_hiddens)``
            and optionally all four biases ``b_q``, ``b_k``, ``b_v``, ``b_o``
            of the widths of their kernels' outputs (docs: "Canonical weights").
            ``head_dim`` is ``W_q``'s width over ``num_heads``.
        queries: ``(B, Q, query_size)``.
        keys: ``(B, K, key_size)``; with a cache ``(B, Q, key_size)``, or
            ``None`` to attend to the cache as it is.
        values: ``(B, K, value_size)``, likewise.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating;
            key ``j`` is visible to query ``i`` iff ``j < valid_lens``. With
            a cache ``None`` or ``(B,)`` integers: the new positions of each
            example, in ``[0, Q]``.
        num_heads: number of (query) heads ``H``; must divide ``W_q``'s width.
        num_kv_heads: number of key/value heads; ``None`` reads it from
            ``W_k``'s width. Query head ``h`` reads key/value head
            ``h // (num_heads // num_kv_heads)``.
        causal: also hide key ``j`` from query ``i`` when ``j > i + (K - Q)``
            (with a cache: each example's own positions, see above).
        dropout_rate: dropout rate on the attention weights.
        deterministic: no dropout when ``True``.
        dropout_rng: the PRNG key of the dropout mask; required when
            ``deterministic`` is ``False`` and ``dropout_rate > 0``.
        dtype: the computation dtype; ``None`` promotes the dtypes of the
            inputs and the weights (as Flax layers do). 16-bit softmaxes run
            in float32. A cache must hold this dtype.
        precision: precision of every matrix product (``"highest"`` for IEEE
            float32 products on GPU and TPU).
        return_attention_weights: compute and return the weights; ``False``
            lets the fused path run.
        implementation: ``None`` (choose), ``"generic"``, ``"xla"`` or
            ``"cudnn"`` (see the module notes); a fused kernel runs only
            where :func:`mha_multi.spec.plan_kernel` allows, the generic path elsewhere.
        cache: ``None``, or a :class:`mha_multi.spec.KVCache` (see
            :func:`init_cache`): projected keys and values
            ``(B, num_kv_heads, max_length, head_dim)`` and ``lengths``
            ``(B,)`` int32.
        head_mask: ``None``, or the heads' gates ``(num_heads,)`` or
            ``(B, num_heads)``, a floating array of any floating dtype (cast
            to the computation dtype; its gradient comes back in its own).
        head_parallel: the generic path computes each key/value head's
            group apart (the same numbers), so that XLA can split the heads
            over devices; set for layers whose parameters are sharded by
            heads (docs: "Sharding heads"). Without dropout only.

    Returns:
        ``(output, attention_weights)``: ``(B, Q, num_hiddens)`` and the
        pre-dropout weights ``(B, H, Q, K)`` (``None`` when not requested),
        both of the computation dtype. With a cache
        ``(output, attention_weights, cache)``: the weights are
        ``(B, H, Q, max_length)``, and the cache is the one after the call.

    Raises:
        TypeError: a non-floating input or weight, or non-numeric ``valid_lens``;
            with a cache, non-integer lengths or a cache of another dtype; a
            ``head_mask`` that is no floating array.
        ValueError: a bad configuration, weights or shapes (``head_mask``'s
            included), named; with a cache, in eager calls, lengths out of
            range or an overflow.
    """
    check_implementation(implementation)
    config = check_params(params)
    heads = spec.heads_of_weights(params, num_heads, num_kv_heads=num_kv_heads)
    spec.check_config(
        config.num_hiddens,
        num_heads,
        dropout_rate,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
    )
    sizes = {
        "query_size": config.query_size,
        "key_size": config.key_size,
        "value_size": config.value_size,
    }
    if cache is None:
        queries, keys, values, lens = check_call(
            queries, keys, values, valid_lens, causal=causal, **sizes
        )
    else:
        queries, keys, values, lens, cache = check_cached_call(
            queries, keys, values, valid_lens, cache, heads=heads, causal=causal, **sizes
        )
        _check_cache_values(cache, lens, 0 if keys is None else queries.shape[1])
    head_mask = check_head_mask(head_mask, num_heads=heads.num_heads, batch=queries.shape[0])
    use_dropout = not deterministic and dropout_rate > 0
    if use_dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required when deterministic is False and dropout_rate > 0")
    inputs = (queries, keys, values)
    if dtype is None:
        dtype = jnp.result_type(*(x for x in inputs if x is not None), *params.values())
    if cache is not None and keys is None:
        _check_cache_dtype(cache, dtype)
    weights = {name: jnp.asarray(value, dtype) for name, value in params.items()}
    queries, keys, values = (None if x is None else jnp.asarray(x, dtype) for x in inputs)

    # The groups _linear reads each kernel's columns in: the heads of the
    # projection (any divisor of the width is the same product).
    groups = {
        "q": heads.num_heads,
        "k": heads.num_kv_heads,
        "v": heads.num_kv_heads,
        "o": heads.num_heads if config.num_hiddens % heads.num_heads == 0 else 1,
    }

    def project(x: jax.Array | None, name: str) -> jax.Array | None:
        if x is None:
            return None
        kernel, bias = weights[f"W_{name}"], weights.get(f"b_{name}")
        return _linear(x, kernel, bias, precision, groups[name])

    q, k, v = project(queries, "q"), project(keys, "k"), project(values, "v")
    if cache is not None:
        cache, lens = spec.update_cache(
            JaxOps(precision), cache, k, v, lens, head_dim=heads.head_dim, causal=causal
        )
        # The queries attend to the whole cache; the lengths now hold the
        # causal rule, each example's own.
        k, v, causal = cache.keys, cache.values, False
    kv_split = cache is not None
    kernel = implementation
    if kernel is None:
        half = np.dtype(dtype).name in FUSED_DTYPES and np.dtype(dtype).itemsize == 2
        kernel = "cudnn" if half and _platform(q) == "gpu" else "generic"
    plan = spec.plan_kernel(
        DOT_PRODUCT_ATTENTION,
        sizes=(q.shape[0], q.shape[1], k.shape[2 if kv_split else 1]),
        lens_ndim=None if lens is None else lens.ndim,
        lens_integer=lens is None or dtype_kind(lens.dtype) in "iu",
        causal=causal,
        dropout=use_dropout,
        return_attention_weights=return_attention_weights,
        dtype_supported=kernel != "generic" and fused_dtype_supported(dtype, precision),
        grouped=heads.grouped,
    )
    context = None
    attention_weights = None
    if plan.fused:
        try:
            context = _fused_attention(
                q,
                k,
                v,
                lens,
                plan,
                heads=heads,
                precision=precision,
                implementation=kernel,
                kv_split=kv_split,
            )
        except (NotImplementedError, ValueError, RuntimeError):
            # cuDNN serves some head sizes, sequence lengths and GPUs only,
            # and says so while the call is traced. Asked for by name, that
            # is the caller's error; chosen here, the generic path serves.
            if implementation is not None:
                raise

    if context is None:
        dropout = None
        if use_dropout:

            def dropout(x: jax.Array) -> jax.Array:
                return _dropout(dropout_rng, float(dropout_rate), x)

        context, attention_weights = _generic_attention(
            JaxOps(precision),
            q,
            k,
            v,
            lens,
            num_heads=num_heads,
            head_dim=heads.head_dim,
            num_kv_heads=heads.num_kv_heads,
            causal=causal,
            dropout=dropout,
            return_attention_weights=return_attention_weights,
            kv_split=kv_split,
            head_parallel=head_parallel,
        )
    # Both paths' context is the heads' (B, Q, H*dh): the gates act on it alike.
    context = spec.apply_head_mask(JaxOps(precision), context, head_mask, heads.num_heads)
    output = project(context, "o")
    if cache is None:
        return output, attention_weights
    return output, attention_weights, cache


def _check_cache_dtype(cache: spec.KVCache, dtype: DTypeLike) -> None:
    """Raises ``TypeError`` unless the cache holds the computation dtype.

    A call that appends is checked by :func:`mha_multi.spec.update_cache`
    against the projections it writes; one without keys and values reads
    the cache only, and is checked here.
    """
    for name in ("keys", "values"):
        held = getattr(cache, name).dtype
        if held != dtype:
            raise TypeError(
                f"cache.{name} dtype {held} differs from the layer's computation dtype "
                f"{np.dtype(dtype)}; make the cache with layer.init_cache"
            )
