"""JAX's fused kernel, :func:`jax.nn.dot_product_attention`: which one runs, and how.

The values of ``implementation``, the dtypes and precisions the kernel
serves, the default choice of kernel, and the call of the kernel with the
spec's masking semantics (docs: "Fast paths").
:class:`mha_multi.jax._facts.JaxFacts` plans with :data:`DOT_PRODUCT_ATTENTION`
and calls :func:`fused_attention`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from mha_multi import spec
from mha_multi.jax._ops import JaxOps, PrecisionLike, is_16_bit

__all__ = [
    "DOT_PRODUCT_ATTENTION",
    "FUSED_DTYPES",
    "IMPLEMENTATIONS",
    "check_implementation",
    "chosen_kernel",
    "fused_attention",
    "fused_dtype_supported",
    "platform",
]

#: The values of ``implementation``; ``None`` chooses (:func:`chosen_kernel`).
IMPLEMENTATIONS = (None, "generic", "xla", "cudnn")

#: Dtypes the fused path serves. Its softmax always runs in float32, which is
#: the spec's rule for 16-bit inputs and exact for float32, but would cost
#: float64 its precision.
#: (Names, not dtype objects: resolving them is left to call time.)
FUSED_DTYPES = frozenset({"float32", "bfloat16", "float16"})

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


def check_implementation(implementation: Any) -> None:
    """Raises ``ValueError`` unless ``implementation`` is one of :data:`IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be None, 'generic', 'xla' or 'cudnn'; got {implementation!r}"
        )


def platform(x: jax.Array) -> str:
    """The platform ``x`` lives on; the default backend for tracers under ``jit``
    and for arrays of other libraries (numpy), which JAX puts there."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return jax.default_backend()
    return next(iter(x.devices())).platform


def chosen_kernel(implementation: str | None, q: jax.Array, on: str) -> str:
    """The kernel a call of ``implementation`` runs for projected queries ``q``
    on platform ``on`` (``"cpu"``, ``"gpu"``...).

    ``None`` chooses cuDNN's flash attention for 16-bit inputs on a GPU and
    the generic path everywhere else: XLA's kernel is the generic path's own
    arithmetic and measured no faster (docs: "Fast paths").

    Returns:
        ``"generic"``, ``"xla"`` or ``"cudnn"``.
    """
    if implementation is not None:
        return implementation
    dtype = np.dtype(q.dtype)
    half = dtype.name in FUSED_DTYPES and dtype.itemsize == 2
    return "cudnn" if half and on == "gpu" else "generic"


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


def fused_attention(
    ops: JaxOps,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid_lens: jax.Array | None,
    plan: spec.KernelPlan,
    *,
    heads: spec.Heads,
    kv_split: bool,
    dropout_rate: float = 0.0,
    precision: PrecisionLike,
    implementation: str,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> jax.Array:
    """:func:`jax.nn.dot_product_attention` with the spec's masking semantics.

    Args:
        ops: the :class:`~mha_multi.jax._ops.JaxOps` of ``precision``.
        q: projected queries ``(B, Q, num_heads*head_dim)``; ``k``, ``v``
            ``(B, K, num_kv_heads*head_dim)``, or with ``kv_split`` a
            cache's ``(B, num_kv_heads, K, head_dim)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
        plan: what :func:`mha_multi.call.plan` decided the kernel is given.
        heads: the head layout; the kernel takes grouped key/value heads as
            they are.
        kv_split: ``k`` and ``v`` are a cache's, split into heads.
        dropout_rate: 0: the kernel takes no dropout
            (:data:`DOT_PRODUCT_ATTENTION`), so no plan gives it any.
        precision: of the kernel's products.
        implementation: ``"xla"`` or ``"cudnn"``.
        options: the call's score options where they are packed sequences'
            alone (:attr:`~mha_multi.spec.ScoreOptions.only_segments`): the
            mask holds their rule.

    Returns:
        The concatenated heads ``(B, Q, num_heads*head_dim)``.
    """
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
    mask = plan.mask(ops, num_queries, num_keys, valid_lens, options)
    if implementation == "cudnn" and mask is not None:
        # cuDNN turns the mask into a bias, which must span every query.
        mask = jnp.asarray(mask)
        mask = mask if mask.ndim == 4 else mask[None, None]
        mask = jnp.broadcast_to(mask, (mask.shape[0], 1, num_queries, num_keys))
    setting = _precision_setting(precision)
    with contextlib.nullcontext() if setting is None else jax.default_matmul_precision(setting):
        output = _dot_product_attention(q, k, v, mask, plan.is_causal, seq_lengths, implementation)
    visible = plan.fix_visibility(ops, num_queries, num_keys, valid_lens, options)
    output = spec.fix_fully_hidden_rows(
        ops, output, v, visible, heads_axis=2, group_size=heads.group_size
    )
    return ops.merge_axes(output, 2).astype(dtype)
