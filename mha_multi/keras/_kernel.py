"""Keras' fused kernel, ``keras.ops.dot_product_attention``: where it runs, and how.

Which Keras backends and dtypes take it by default, the bound on the scores
below which it gives the spec's weights, and the call of the kernel with the
spec's masking semantics (docs: "Fast paths"). Whether a call's values stay
within that bound is read by :class:`mha_multi.keras._facts.KerasFacts`,
which plans with this kernel.
"""

from __future__ import annotations

import math
from typing import Any

import keras

from mha_multi import spec
from mha_multi.keras._frameworks import active
from mha_multi.keras._ops import OPS, is_16_bit

__all__ = [
    "DOT_PRODUCT_ATTENTION",
    "FUSED_BACKENDS",
    "FUSED_DTYPES",
    "dot_product_attention",
    "fused_attention",
    "serves",
]

#: Keras backends on which the default call goes through
#: ``keras.ops.dot_product_attention``: those where it measured faster than
#: the generic path (the benchmark's ``keras-<backend>`` rows, docs: "Results"; CPU,
#: B=8, D=512, H=8). PyTorch: SDPA, 2.3-2.8x faster at N=512-2048 and
#: O(N) memory. Not TensorFlow: its kernel is einsum + softmax like the
#: generic path, materialises a (B, H, Q, K) boolean mask besides, and was
#: not consistently faster (0.6-1.8x of the generic time eagerly, ~27% more
#: peak memory). Not JAX: 1.0-1.9x slower than the generic path on CPU.
FUSED_BACKENDS: frozenset[str] = frozenset({"torch"})

#: Compute dtypes the fused path takes, per Keras backend. Not float64: the
#: kernels are written for float32 and 16-bit (JAX's runs its softmax in
#: float32, TensorFlow's casts the scale through float32), which would cost
#: float64 its precision. Not float16 on JAX: the kernel asks for a float16
#: product accumulated in float32, which XLA:CPU does not compile. 16-bit
#: inputs run the kernel in float32 (see :func:`fused_attention`).
FUSED_DTYPES: dict[str, frozenset[str]] = {
    "tensorflow": frozenset({"float32", "float16", "bfloat16"}),
    "jax": frozenset({"float32", "bfloat16"}),
    "torch": frozenset({"float32", "float16", "bfloat16"}),
}

#: Keras' fused kernel: no dropout, no key lengths, and an *added* mask, so it
#: runs only on values read as exact (:func:`mha_multi.keras._facts.values_exact`).
#: It takes fewer key/value heads than query heads (``(B, K, H_kv, dh)``;
#: query head ``h`` reads key/value head ``h // G``), except on Keras'
#: TensorFlow backend, whose einsum does not broadcast a single key/value
#: head (multi-query attention): there the heads are repeated before the call.
DOT_PRODUCT_ATTENTION = spec.FusedKernel(
    "keras.ops.dot_product_attention",
    takes_grouped_heads=keras.backend.backend() != "tensorflow",
)


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    mask: Any = None,
    scale: float | None = None,
    is_causal: bool = False,
) -> Any:
    """``keras.ops.dot_product_attention`` of ``(B, T, H, dh)`` arrays, as the layer calls it.

    On Keras' PyTorch backend, PyTorch's ``scaled_dot_product_attention``
    called as Keras calls it (the same additive mask), but on the arrays as
    they are: Keras repeats grouped key/value heads and copies every
    argument into a contiguous array first, which for a cache's filled
    positions (a view) is a cache-sized copy at every decoding step; PyTorch
    takes grouped heads (``enable_gqa``) and strided arrays itself (the plan
    repeats those it serves better repeated:
    :meth:`~mha_multi.keras._facts.KerasFacts.kernel_takes_grouped`); one
    query's grouped heads reach it as the queries of their key/value head
    (:func:`mha_multi.torch._kernel.folds_groups`).
    """
    return active().dot_product_attention(
        query, key, value, mask=mask, scale=scale, is_causal=is_causal
    )


def serves(q: Any) -> bool:
    """Whether the default call may take the kernel for ``q``'s dtype on this Keras backend.

    :data:`FUSED_BACKENDS` and :data:`FUSED_DTYPES`, read at every call.
    """
    backend = keras.backend.backend()
    return OPS.dtype(q) in FUSED_DTYPES.get(backend, ()) and backend in FUSED_BACKENDS


def fused_attention(
    ops: Any,
    q: Any,
    k: Any,
    v: Any,
    valid_lens: Any,
    plan: spec.KernelPlan,
    *,
    heads: spec.Heads,
    kv_split: bool,
    dropout_rate: float = 0.0,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> Any:
    """``keras.ops.dot_product_attention`` with the spec's masking semantics.

    Grouped key/value heads reach the kernel as they are where it takes
    them (query head ``h`` reads key/value head ``h // G`` there too);
    otherwise they are repeated, once, on the projected heads (the
    plan's ``repeat_kv``). :meth:`mha_multi.call.Facts.fused_attention`
    of :class:`~mha_multi.keras._facts.KerasFacts`.

    Args:
        ops: the :mod:`mha_multi.keras._ops` adapter.
        q: projected queries ``(B, Q, num_heads * head_dim)``; k, v
            ``(B, K, num_kv_heads * head_dim)``, or ``(B, num_kv_heads,
            K, head_dim)`` with ``kv_split``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        plan: what :func:`mha_multi.call.plan` decided the kernel is given.
        heads: the layer's heads.
        kv_split: keys and values are a cache's.
        dropout_rate: 0: the kernel takes no dropout
            (:data:`DOT_PRODUCT_ATTENTION`), so no plan gives it any.
        options: the call's score options where they are packed sequences'
            alone (:attr:`~mha_multi.spec.ScoreOptions.only_segments`): the
            mask holds their rule.

    Returns:
        The concatenated heads ``(B, Q, num_heads * head_dim)``.
    """
    dtype = ops.dtype(q)
    if is_16_bit(dtype):
        # In float32 the kernel's products of 16-bit numbers are exact and
        # accumulated in float32, its scores cannot overflow float16, and
        # its additive mask (-0.7 times the dtype's maximum: -45850 in
        # float16) cannot be overcome by a hidden score; the output is
        # rounded once, below.
        q, k, v = (keras.ops.cast(x, "float32") for x in (q, k, v))
    # (B, T, H*dh) -> (B, T, H, dh): the kernel's layout; head h owns
    # columns [h*dh, (h+1)*dh) exactly as in transpose_qkv.
    q = ops.split_axis(q, 2, (heads.num_heads, heads.head_dim))
    if kv_split:
        k, v = (ops.permute(x, (0, 2, 1, 3)) for x in (k, v))
    else:
        k, v = (ops.split_axis(x, 2, (heads.num_kv_heads, heads.head_dim)) for x in (k, v))
    if plan.repeat_kv:
        k, v = (keras.ops.repeat(x, heads.group_size, axis=2) for x in (k, v))
    grouped = heads.grouped and not plan.repeat_kv
    num_queries, num_keys = ops.size(q, 1), ops.size(k, 1)
    mask = plan.mask(ops, num_queries, num_keys, valid_lens, options)
    if mask is not None and ops.ndim(mask) == 2:  # (Q, K) -> (1, 1, Q, K) for every kernel
        mask = ops.expand_dims(ops.expand_dims(mask, 0), 0)
    output = dot_product_attention(
        q, k, v, mask=mask, scale=1.0 / math.sqrt(heads.head_dim), is_causal=plan.is_causal
    )
    visible = plan.fix_visibility(ops, num_queries, num_keys, valid_lens, options)
    output = spec.fix_fully_hidden_rows(
        ops, output, v, visible, heads_axis=2, group_size=heads.group_size if grouped else 1
    )
    return keras.ops.cast(ops.merge_axes(output, 2), dtype)
