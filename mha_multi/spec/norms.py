"""Query/key normalisation (``qk_norm=``): the option's value, the RMSNorm and its gradient.

Docs: "Positions and biases" (section "Query and key norms"). The RMSNorm of
the projected queries and keys is applied after the projections (and their
biases) and before rotary embeddings, in float32 (float64 for float64
inputs), in the order of operations of the model families' own norms
(transformers' ``Qwen3RMSNorm``, ``Gemma3RMSNorm``, ``Olmo2RMSNorm``). It is
written once against the array-ops adapter; its gradient (:func:`rms_norm_backward`)
is the float64 reference's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mha_multi.spec.checks import Heads, check_positive_real
from mha_multi.spec.ops import Array, ArrayOps

#: The canonical weight entries of the norms (docs: "Canonical weights").
QK_NORM_NAMES = ("q_norm", "k_norm")
#: ``"heads"``: each head's ``head_dim`` entries; ``"whole"``: the whole projection.
QK_NORM_SCOPES = ("heads", "whole")
#: Where the weight's product is taken: ``"input"`` (the normalised values cast back
#: to the input dtype first), or ``"float32"`` (the product cast once).
QK_NORM_PRODUCTS = ("input", "float32")
_SMALLEST_NORMAL = 2.0**-126  # float32's
_QK_NORM_KEYS = ("scope", "eps", "unit_offset", "product")


@dataclass(frozen=True)
class QKNorm:
    """RMSNorm of the projected queries and keys (Qwen 3, Gemma 3, OLMo 2).

    ``y = g * x / sqrt(mean(x ** 2) + eps)`` over the last axis of ``x``,
    with ``g = w`` or, with ``unit_offset``, ``g = 1 + w``, where ``w`` is the
    learned weight (canonical entries ``q_norm`` and ``k_norm``).

    Attributes:
        scope: ``"heads"``: the norm of each head's ``head_dim`` entries, one
            ``(head_dim,)`` weight shared by all heads (Qwen 3, Gemma 3);
            ``"whole"``: the norm of the whole projected query
            (``num_heads * head_dim`` entries) and key (``num_kv_heads *
            head_dim``), before the heads are split (OLMo 2).
        eps: added to the mean square (the model's ``rms_norm_eps``).
        unit_offset: ``g = 1 + w`` (Gemma 3, whose weights start at 0)
            rather than ``g = w`` (weights starting at 1).
        product: ``"input"``: the normalised values are cast back to the
            input dtype and then multiplied by the weight (Qwen 3, Llama's
            norm); ``"float32"``: the product is taken in float32 and cast
            once (Gemma 3, OLMo 2). The same for 32- and 64-bit inputs.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range, named.
    """

    scope: str = "heads"
    eps: float = 1e-6
    unit_offset: bool = False
    product: str = "input"

    def __post_init__(self) -> None:
        if self.scope not in QK_NORM_SCOPES:
            raise ValueError(
                f"qk_norm.scope must be one of {', '.join(QK_NORM_SCOPES)}; got {self.scope!r}"
            )
        eps = check_positive_real("qk_norm.eps", self.eps)
        if eps < _SMALLEST_NORMAL:
            # (The norms compute in float32 at least: XLA and TensorFlow flush a smaller eps
            # to zero, and float32 holds none below 2**-149.)
            raise ValueError(
                "qk_norm.eps must be at least 2**-126 (float32's smallest normal number, in "
                f"which the norms compute); got {self.eps!r}"
            )
        object.__setattr__(self, "eps", eps)
        if not isinstance(self.unit_offset, (bool, np.bool_)):
            raise TypeError(f"qk_norm.unit_offset must be a bool; got {self.unit_offset!r}")
        object.__setattr__(self, "unit_offset", bool(self.unit_offset))
        if self.product not in QK_NORM_PRODUCTS:
            raise ValueError(
                f"qk_norm.product must be one of {', '.join(QK_NORM_PRODUCTS)}; "
                f"got {self.product!r}"
            )

    @property
    def initial_value(self) -> float:
        """The weights' initial value: 1 for ``g = w``, 0 for ``g = 1 + w`` (as the models)."""
        return 0.0 if self.unit_offset else 1.0

    def shapes(self, heads: Heads) -> dict[str, tuple[int]]:
        """The canonical ``q_norm`` and ``k_norm`` shapes of a layer of ``heads``."""
        if self.scope == "heads":
            return {"q_norm": (heads.head_dim,), "k_norm": (heads.head_dim,)}
        return {"q_norm": (heads.query_features,), "k_norm": (heads.kv_features,)}


def check_qk_norm(qk_norm: Any) -> QKNorm | None:
    """``qk_norm=`` as layers keep it: ``None``, or a :class:`QKNorm` (made of a dict of its
    fields where one is given).

    Raises:
        TypeError: neither ``None``, a :class:`QKNorm` nor a dict, or a field of the wrong type.
        ValueError: a key that is no field, or a field out of range.
    """
    if qk_norm is None or isinstance(qk_norm, QKNorm):
        return qk_norm
    keys = ", ".join(_QK_NORM_KEYS)
    if not isinstance(qk_norm, Mapping):
        raise TypeError(f"qk_norm must be None, a mha_multi.spec.QKNorm or a dict with keys {keys}")
    if set(qk_norm) - set(_QK_NORM_KEYS):
        raise ValueError(f"qk_norm has unknown keys {sorted(set(qk_norm) - set(_QK_NORM_KEYS))}")
    return QKNorm(**qk_norm)


def qk_norm_shapes(
    shapes: Mapping[str, tuple[int, ...]],
    qk_norm: str | bool | None,
    *,
    query_features: int,
    kv_features: int,
    head_dim: int | None,
) -> tuple[str | bool, dict[str, tuple[int, ...]]]:
    """The norms' scope and the shapes canonical ``q_norm`` and ``k_norm`` must have.

    Args:
        shapes: the shapes of the ``q_norm`` and ``k_norm`` entries given.
        qk_norm: ``False`` (no norms), a scope (``"heads"``, ``"whole"``), or
            ``None`` for the scope the entries have (``False`` without them).
        query_features, kv_features: the projections' widths.
        head_dim: the head size, or ``None`` where no head layout is known
            (a per-head norm then has the size its entries have, if both
            widths hold it).

    Returns:
        ``(scope, shapes)``; ``shapes`` empty for ``False``.

    Raises:
        ValueError: one entry without the other, or a head size of neither
            width, named.
    """
    if qk_norm is None:
        if len(shapes) == 1:
            (present,) = shapes
            missing = next(name for name in QK_NORM_NAMES if name != present)
            raise ValueError(f"weights has {present!r} but is missing {missing!r}")
        whole = (shapes.get("q_norm"), shapes.get("k_norm")) == ((query_features,), (kv_features,))
        qk_norm = False if not shapes else "whole" if whole else "heads"
    if not qk_norm:
        return qk_norm, {}
    if qk_norm == "whole":
        return qk_norm, {"q_norm": (query_features,), "k_norm": (kv_features,)}
    size = (head_dim,) if head_dim is not None else tuple(shapes.get("q_norm", (query_features,)))
    if len(size) != 1 or not size[0] or query_features % size[0] or kv_features % size[0]:
        raise ValueError(
            f"weights['q_norm'] must have shape (head_dim,) of a head size that divides "
            f"{query_features} and {kv_features}, or ({query_features},) with "
            f"weights['k_norm'] ({kv_features},); got {size}"
        )
    return qk_norm, {"q_norm": size, "k_norm": size}


def refuse_whole_norm(qk_norm: QKNorm | None, action: str) -> None:
    """Raises a ``ValueError`` where ``action`` (on heads) meets a whole-projection norm.

    The mean square of a ``"whole"`` norm couples every head, so the heads
    kept by pruning, or held by one device, would change their numbers
    without the others (docs: "Heads", "Sharding heads").
    """
    if qk_norm is not None and qk_norm.scope == "whole":
        raise ValueError(
            f"{action} is not possible with qk_norm of scope 'whole': its mean square "
            "spans every head, so no head can be computed without the others"
        )


def rms_norm(
    ops: ArrayOps, x: Array, weight: Array, norm: QKNorm, num_heads: int, head_dim: int
) -> Array:
    """The RMSNorm of projected queries or keys ``(B, T, F)``, same shape and dtype.

    In the families' order of operations: ``x`` in float32 (float64 stays
    float64), ``x * rsqrt(mean(x * x) + eps)``, then the weight's product as
    :attr:`QKNorm.product` says: :func:`rms_normalized`, then :func:`rms_gain`.

    Args:
        ops: the array-ops adapter.
        x: projected ``(B, T, F)``.
        weight: ``(head_dim,)`` for scope ``"heads"``, else ``(F,)``; of
            ``x``'s dtype.
        norm: the option.
        num_heads: the heads of ``x`` (key/value heads for keys).
        head_dim: the size of each head.
    """
    normed = rms_normalized(ops, x, norm, num_heads, head_dim)
    out = rms_gain(ops, normed, weight, norm, ops.dtype(x))
    return ops.merge_axes(out, 2) if norm.scope == "heads" else out


def rms_normalized(ops: ArrayOps, x: Array, norm: QKNorm, num_heads: int, head_dim: int) -> Array:
    """``x * rsqrt(mean(x * x) + eps)`` of projected ``(B, T, F)``, in float32 (float64
    stays float64): ``(B, T, num_heads, head_dim)`` for scope ``"heads"`` (each head's
    own mean: heads of queries and keys stacked on that axis are normalised in one
    pass, each as :func:`rms_norm` alone), else ``(B, T, F)``."""
    values = ops.split_axis(x, 2, (num_heads, head_dim)) if norm.scope == "heads" else x
    wide = ops.itemsize(ops.dtype(x)) >= 4
    computed = values if wide else ops.cast(values, ops.float32())
    return computed * ops.rsqrt(ops.mean(computed * computed, -1) + norm.eps)


def rms_gain(ops: ArrayOps, normed: Array, weight: Array, norm: QKNorm, dtype: Any) -> Array:
    """:func:`rms_normalized`'s ``normed`` times the norm's gain (``weight``, or ``1 +
    weight`` with :attr:`QKNorm.unit_offset`), in ``dtype`` (the projections'), the
    product taken as :attr:`QKNorm.product` says."""
    wide = ops.itemsize(dtype) >= 4
    if norm.product == "input":
        normed = normed if wide else ops.cast(normed, dtype)
        gain = weight + 1.0 if norm.unit_offset else weight
        # (A wider gain than the input, a float32 layer's under autocast, widens the
        # product: it is rounded back, so that the keys keep the values' dtype.)
        out = normed * gain
        return out if wide else ops.cast(out, dtype)
    gain = weight if wide else ops.cast(weight, ops.dtype(normed))
    gain = gain + 1.0 if norm.unit_offset else gain
    out = normed * gain
    return out if wide else ops.cast(out, dtype)


def normalize_qk(
    ops: ArrayOps,
    q: Array,
    k: Array | None,
    weights: tuple[Array, Array],
    norm: QKNorm,
    heads: Heads,
) -> tuple[Array, Array | None]:
    """``q`` and ``k`` (where given) through :func:`rms_norm`, with ``(q_norm, k_norm)``."""
    q = rms_norm(ops, q, weights[0], norm, heads.num_heads, heads.head_dim)
    if k is not None:
        k = rms_norm(ops, k, weights[1], norm, heads.num_kv_heads, heads.head_dim)
    return q, k


def rms_norm_backward(
    x: np.ndarray, weight: np.ndarray, norm: QKNorm, head_dim: int, grad_y: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The float64 vector-Jacobian product of :func:`rms_norm`: ``(grad_x, grad_weight)``.

    With ``r = (mean(x ** 2) + eps) ** -1/2``, ``n = x r`` and ``u = g dy``:
    ``dx = r (u - n mean(u n))`` and ``dw = sum(dy n)`` over every axis but
    the normalised one (all heads share a per-head weight).

    Args:
        x: the projected values ``(B, T, F)`` before the norm, float64.
        weight: the norm's weight.
        norm: the option.
        head_dim: the size of each head.
        grad_y: the cotangent of the norm's output ``(B, T, F)``.
    """
    shape = x.shape
    if norm.scope == "heads":
        x = x.reshape(*shape[:2], shape[2] // head_dim, head_dim)  # (no -1: B, T may be 0)
        grad_y = grad_y.reshape(x.shape)
    rms = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + norm.eps)
    normed = x * rms
    gain = weight + 1.0 if norm.unit_offset else weight
    u = grad_y * gain
    grad_x = rms * (u - normed * (u * normed).mean(axis=-1, keepdims=True))
    grad_weight = (grad_y * normed).reshape(-1, weight.shape[0]).sum(axis=0)
    return grad_x.reshape(shape), grad_weight
