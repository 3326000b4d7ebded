"""Canonical weights to and from Flax's attention layers and d2l's JAX layer.

Flax's ``flax.nnx.MultiHeadAttention`` and Linen's
``flax.linen.MultiHeadDotProductAttention`` compute the same function as the
spec with ``normalize_qk=False``, their default ``attention_fn`` and no
products of their own (``qkv_dot_general``... ``None``): modules with any
other are refused either way (``qkv_features`` is ``num_heads *
head_dim``, ``out_features`` is ``num_hiddens``). Their parameters are one
tree (NNX state and Linen ``params`` alike)::

    query/kernel (query_size, H, head_dim)      query/bias (H, head_dim)
    key/kernel   (key_size, H_kv, head_dim)     key/bias   (H_kv, head_dim)
    value/kernel (value_size, H_kv, head_dim)   value/bias (H_kv, head_dim)
    out/kernel   (H, head_dim, num_hiddens)     out/bias   (num_hiddens,)

``H_kv`` is NNX's ``num_kv_heads`` (grouped-query attention; Linen's layer
has none). Head ``h`` owns the same columns ``[h*head_dim, (h+1)*head_dim)``
as in the spec, and NNX's query head ``h`` reads key/value head
``h // (H // H_kv)`` as the spec's does, so the conversion is a reshape.
Differences callers must mind:

* masks: Flax's boolean ``mask`` is ``True`` where a key takes part, the
  spec's visibility polarity (PyTorch's masks are the opposite). It has the
  shape ``(B, H|1, Q|1, K)``; :func:`attention_mask` builds it from
  ``valid_lens`` and ``causal`` with the spec's own rule;
* fully hidden rows: Flax replaces hidden scores by a large finite negative
  (``finfo(dtype).min``, or ``-0.7 * finfo(float32).max`` inside
  :func:`jax.nn.dot_product_attention`) rather than ``-inf``, so a query
  that sees no key gets uniform weights and the mean of all values, as in
  the spec (PyTorch gives NaN or zeros there);
* dtypes: like ours, Flax promotes inputs and parameters to a common dtype
  unless ``dtype`` is given. For 16-bit inputs, NNX's layer without
  dropout calls :func:`jax.nn.dot_product_attention`, whose softmax runs in
  float32 as the spec's does; Linen's layer, and NNX's with dropout or
  ``sow_weights``, run the softmax in the 16-bit dtype itself;
* Flax scales the queries by ``1/sqrt(head_dim)`` before the product, the
  spec scales the scores after it: the results differ by rounding only;
* NNX's layer has one ``in_kv_features`` for keys and values, so
  ``key_size`` must equal ``value_size`` there (Linen infers each).

d2l's JAX ``MultiHeadAttention`` ("Dive into Deep Learning", Flax Linen) holds
four ``nn.Dense(num_hiddens, use_bias=bias)`` projections named ``W_q``,
``W_k``, ``W_v`` and ``W_o`` (``bias=False`` by default) and a parameter-free
``attention`` submodule, so its variables are
``{'params': {'W_q': {'kernel': (query_size, num_hiddens), 'bias': ...}, ...}}``:
the canonical orientation and the layout of :mod:`mha_multi.jax.linen`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from mha_multi import spec
from mha_multi.jax._facts import check_held_dtype, host_array, weight_array
from mha_multi.weights import KERNEL_NAMES, check_weights

__all__ = [
    "FLAX_NAMES",
    "attention_mask",
    "from_flax_linen",
    "from_flax_nnx",
    "from_flax_nnx_state",
    "from_jax_d2l",
    "to_flax_linen",
    "to_flax_nnx",
    "to_flax_nnx_state",
    "to_jax_d2l",
]

#: Flax's projection names, in the canonical order q, k, v, o.
FLAX_NAMES = {"query": "q", "key": "k", "value": "v", "out": "o"}

_UNSUPPORTED = {
    "query_ln": "normalize_qk=True (LayerNorm on queries and keys)",
    "key_ln": "normalize_qk=True (LayerNorm on queries and keys)",
    "cached_key": "decode=True (an autoregressive cache)",
    "cached_value": "decode=True (an autoregressive cache)",
    "cache_index": "decode=True (an autoregressive cache)",
}


def _params_tree(tree: Any) -> dict[str, Any]:
    """The ``params`` collection of Linen variables, an NNX state or a plain tree."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    if not isinstance(tree, Mapping):
        raise TypeError(f"expected a mapping of parameters; got {type(tree).__name__}")
    tree = linen.meta.unbox(dict(tree))
    if "params" in tree and isinstance(tree["params"], Mapping):
        extra = sorted(set(tree) - {"params"})
        if extra:
            raise ValueError(f"unsupported variable collections besides 'params': {extra}")
        tree = linen.meta.unbox(dict(tree["params"]))
    return tree


def from_flax_nnx_state(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights from a Flax attention parameter tree (NNX state or Linen params).

    Args:
        state: an ``nnx.State`` or its pure dict ``{'query': {'kernel': ...,
            'bias': ...}, 'key': ..., 'value': ..., 'out': ...}``, or Linen
            variables ``{'params': {...}}`` (the same tree). ``num_heads`` is
            ``state['query']['kernel'].shape[1]``, ``num_kv_heads``
            ``state['key']['kernel'].shape[1]`` (grouped-query attention when
            fewer), ``head_dim`` their last axis.

    Returns:
        The canonical mapping (validated), numpy arrays; bfloat16 becomes float32.

    Raises:
        ValueError: what the canonical layer cannot express (``normalize_qk``,
            an autoregressive cache, biases on some projections only), a
            missing or unexpected entry, or inconsistent shapes.
    """
    tree = _params_tree(state)
    for name, reason in _UNSUPPORTED.items():
        if name in tree:
            raise ValueError(f"unsupported Flax attention option: {reason}")
    extra = sorted(set(tree) - set(FLAX_NAMES))
    if extra:
        raise ValueError(f"unexpected entries in Flax attention parameters: {extra}")
    missing = [name for name in FLAX_NAMES if name not in tree]
    if missing:
        raise ValueError(f"Flax attention parameters are missing {missing}")
    for name in FLAX_NAMES:
        unexpected = sorted(set(tree[name]) - {"kernel", "bias"})
        if unexpected or "kernel" not in tree[name]:
            raise ValueError(
                f"Flax attention parameters {name!r} must hold 'kernel' (and 'bias'); "
                f"got {sorted(tree[name])}"
            )
    kernels = {name: host_array(tree[name]["kernel"]) for name in FLAX_NAMES}
    for name in ("query", "key", "value"):
        if kernels[name].ndim != 3:
            raise ValueError(
                f"{name}/kernel must have shape (features, num_heads, head_dim); "
                f"got {kernels[name].shape}"
            )
    _, num_heads, head_dim = kernels["query"].shape
    num_kv_heads = kernels["key"].shape[1]
    for name in ("key", "value"):
        heads, dim = kernels[name].shape[1:]
        if heads != num_kv_heads or num_heads % heads:
            raise ValueError(
                f"{name} has {heads} heads: key and value need the same number of heads, "
                f"which must divide the query's {num_heads}"
            )
        if dim != head_dim:
            raise ValueError(
                f"unsupported: {name} head size {dim} differs from the query head size {head_dim}"
            )
    out = kernels["out"]
    if out.ndim != 3 or out.shape[:2] != (num_heads, head_dim):
        raise ValueError(
            f"out/kernel must have shape ({num_heads}, {head_dim}, out_features); got {out.shape}"
        )
    with_bias = [name for name in FLAX_NAMES if tree[name].get("bias") is not None]
    if with_bias and len(with_bias) != len(FLAX_NAMES):
        raise ValueError(f"unsupported: biases on some projections only ({with_bias})")
    weights = {}
    for name, short in FLAX_NAMES.items():
        kernel = kernels[name]
        # (in, heads, head_dim) -> (in, heads*head_dim); out: (H, dh, out) -> (H*dh, out).
        weights[f"W_{short}"] = (
            kernel.reshape(kernel.shape[0], -1)
            if short != "o"
            else kernel.reshape(num_heads * head_dim, -1)
        )
        if with_bias:
            bias = host_array(tree[name]["bias"])
            # Flax's shapes alone: a flat or transposed bias would reshape to other heads.
            shape = (out.shape[2],) if short == "o" else kernel.shape[1:]
            if bias.shape != shape:
                raise ValueError(f"{name}/bias must have shape {shape}; got {bias.shape}")
            weights[f"b_{short}"] = bias.reshape(-1)
    weights = {name: np.ascontiguousarray(array) for name, array in weights.items()}
    return check_weights(weights)[0]


def to_flax_nnx_state(
    weights: Mapping[str, Any], num_heads: int, *, num_kv_heads: int | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """The Flax attention parameter tree (NNX state and Linen ``params`` alike).

    Args:
        weights: canonical weights (validated strictly).
        num_heads: ``H``; must divide ``W_q``'s width.
        num_kv_heads: key/value heads; ``None`` reads them from ``W_k``'s width.

    Returns:
        The tree of numpy arrays, ``query``, ``key``, ``value`` and ``out``
        each holding a ``kernel`` and (if the weights have biases) a
        ``bias``: ``query/kernel`` ``(query_size, H, head_dim)``,
        ``query/bias`` ``(H, head_dim)`` ... ``out/kernel``
        ``(H, head_dim, num_hiddens)``, ``out/bias`` ``(num_hiddens,)``.

    Raises:
        ValueError: invalid weights, or widths no head layout of ``num_heads``
            heads explains.
    """
    arrays, config = check_weights(weights)
    heads = spec.heads_of_weights(arrays, num_heads, num_kv_heads=num_kv_heads)
    head_dim = heads.head_dim
    params: dict[str, dict[str, np.ndarray]] = {}
    for name, short in FLAX_NAMES.items():
        kernel = arrays[f"W_{short}"]
        count = heads.num_heads if short in "qo" else heads.num_kv_heads
        if short == "o":
            entry = {"kernel": kernel.reshape(count, head_dim, -1)}
        else:
            entry = {"kernel": kernel.reshape(-1, count, head_dim)}
        if config.bias:
            bias = arrays[f"b_{short}"]
            entry["bias"] = bias if short == "o" else bias.reshape(count, head_dim)
        params[name] = {k: np.ascontiguousarray(v) for k, v in entry.items()}
    return params


#: The Flax modules the converters read and make, by API.
_FLAX_MODULES = {"nnx": nnx.MultiHeadAttention, "linen": linen.MultiHeadDotProductAttention}

#: Options of Flax's attention that change what it computes, each ``None`` unless given:
#: products of other precision or kind (a quantized ``dot_general``), other einsums.
_FLAX_PRODUCT_OPTIONS = (
    "qkv_dot_general",
    "out_dot_general",
    "qkv_dot_general_cls",
    "out_dot_general_cls",
    "qk_attn_weights_einsum_cls",
    "attn_weights_value_einsum_cls",
)


def _default_attention_fn(api: str) -> Any:
    """The ``attention_fn`` a Flax module of ``api`` has unless given one."""
    if api == "nnx":
        return inspect.signature(nnx.MultiHeadAttention.__init__).parameters["attention_fn"].default
    fields = dataclasses.fields(linen.MultiHeadDotProductAttention)
    return next(f.default for f in fields if f.name == "attention_fn")


def _check_flax_module(module: Any, api: str) -> None:
    """Refuses what is no Flax attention module of ``api``, and one whose options the
    canonical layer cannot express (its normalized queries and keys, an attention
    function or products of its own), which would convert to another computation."""
    kind = _FLAX_MODULES[api]
    if not isinstance(module, kind):
        raise TypeError(f"module must be a flax.{api}.{kind.__name__}; got {type(module).__name__}")
    if getattr(module, "normalize_qk", False):
        raise ValueError(f"unsupported Flax attention option: {_UNSUPPORTED['query_ln']}")
    attention_fn = getattr(module, "attention_fn", None)
    if attention_fn is not None and attention_fn is not _default_attention_fn(api):
        raise ValueError(
            f"unsupported Flax attention option: attention_fn={attention_fn!r} (the "
            "canonical layer's attention is Flax's default dot_product_attention)"
        )
    for option in _FLAX_PRODUCT_OPTIONS:
        value = getattr(module, option, None)
        if value is not None:
            raise ValueError(f"unsupported Flax attention option: {option}={value!r}")


def from_flax_nnx(module: nnx.MultiHeadAttention) -> dict[str, np.ndarray]:
    """Canonical weights of a ``flax.nnx.MultiHeadAttention`` (see the module notes).

    Raises:
        TypeError: ``module`` is no ``flax.nnx.MultiHeadAttention``.
        ValueError: an option the canonical layer cannot express (see the
            module notes and :func:`from_flax_nnx_state`).
    """
    _check_flax_module(module, "nnx")
    return from_flax_nnx_state(nnx.state(module, nnx.Param))


def to_flax_nnx(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    rngs: nnx.Rngs | None = None,
    **kwargs: Any,
) -> nnx.MultiHeadAttention:
    """A new ``flax.nnx.MultiHeadAttention`` holding canonical weights.

    Args:
        weights: canonical weights (validated strictly).
        num_heads: ``H``; must divide ``W_q``'s width.
        num_kv_heads: key/value heads (grouped-query attention); ``None``
            reads them from ``W_k``'s width.
        rngs: for the layer's construction (and its dropout stream);
            ``nnx.Rngs(0)`` by default.
        **kwargs: further constructor arguments (``dtype``, ``param_dtype``,
            ``dropout_rate``, ``precision``...); the sizes, ``use_bias``,
            ``decode=False`` and ``normalize_qk=False`` are set here.

    Returns:
        The layer; its parameters have ``param_dtype`` (float32 by default).

    Raises:
        ValueError: invalid weights, ``key_size != value_size`` (NNX has one
            ``in_kv_features``), a size option in ``kwargs``, or one the
            canonical layer cannot express (see the module notes).
    """
    arrays, config = check_weights(weights)
    if config.key_size != config.value_size:
        raise ValueError(
            f"flax.nnx.MultiHeadAttention has one in_kv_features for keys and values; "
            f"got key_size {config.key_size} and value_size {config.value_size}"
        )
    fixed = {"in_features", "qkv_features", "out_features", "in_kv_features", "use_bias"}
    fixed |= {"num_kv_heads", "normalize_qk", "decode"}
    clashes = sorted(fixed & set(kwargs))
    if clashes:
        raise ValueError(f"{clashes} follow from the weights; do not pass them")
    heads = spec.heads_of_weights(arrays, num_heads, num_kv_heads=num_kv_heads)
    # (JAX without x64 holds float64 as float32: the weights would change.)
    check_held_dtype("param_dtype", kwargs.get("param_dtype", jnp.float32))
    module = nnx.MultiHeadAttention(
        num_heads,
        config.query_size,
        qkv_features=heads.query_features,
        out_features=config.num_hiddens,
        num_kv_heads=heads.num_kv_heads,
        in_kv_features=config.key_size,
        use_bias=config.bias,
        decode=False,
        rngs=nnx.Rngs(0) if rngs is None else rngs,
        **kwargs,
    )
    state = nnx.state(module, nnx.Param)
    params = to_flax_nnx_state(arrays, num_heads, num_kv_heads=heads.num_kv_heads)
    current = nnx.to_pure_dict(state)
    typed = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), params, current)
    nnx.replace_by_pure_dict(state, typed)
    nnx.update(module, state)
    _check_flax_module(module, "nnx")  # (what the other way refuses, in kwargs)
    return module


def from_flax_linen(
    variables: Mapping[str, Any], module: linen.MultiHeadDotProductAttention | None = None
) -> dict[str, np.ndarray]:
    """Canonical weights from ``flax.linen.MultiHeadDotProductAttention`` variables.

    Args:
        variables: ``{'params': {...}}`` as ``init`` returns, or the params.
        module: if given, its options are checked too.

    Raises:
        TypeError: a ``module`` that is no ``flax.linen.MultiHeadDotProductAttention``.
        ValueError: an option the canonical layer cannot express (see the
            module notes and :func:`from_flax_nnx_state`).
    """
    if module is not None:
        _check_flax_module(module, "linen")
    return from_flax_nnx_state(variables)


def to_flax_linen(
    weights: Mapping[str, Any], num_heads: int, **kwargs: Any
) -> tuple[linen.MultiHeadDotProductAttention, dict[str, Any]]:
    """A ``flax.linen.MultiHeadDotProductAttention`` and its variables, holding the weights.

    Args:
        weights: canonical weights (validated strictly).
        num_heads: ``H``; must divide ``W_q``'s width.
        **kwargs: further module attributes (``dtype``, ``dropout_rate``...);
            the sizes, ``use_bias`` and ``normalize_qk=False`` are set here.

    Returns:
        ``(module, variables)`` for ``module.apply(variables, q, k, v, mask=...)``;
        the variables are JAX arrays of the weights' dtype.

    Raises:
        ValueError: invalid weights, grouped heads, sizes given twice, an option
            the canonical layer cannot express (see the module notes), or float64
            weights without JAX's x64 (which would hold them as float32).
    """
    arrays, config = check_weights(weights)
    fixed = {"qkv_features", "out_features", "use_bias", "normalize_qk"}
    clashes = sorted(fixed & set(kwargs))
    if clashes:
        raise ValueError(f"{clashes} follow from the weights; do not pass them")
    heads = spec.heads_of_weights(arrays, num_heads)
    if heads.grouped:
        raise ValueError(
            "flax.linen.MultiHeadDotProductAttention has no grouped key/value heads "
            f"(these weights have {heads.num_kv_heads} for {heads.num_heads} query heads); "
            "flax.nnx.MultiHeadAttention has: use to_flax_nnx"
        )
    module = linen.MultiHeadDotProductAttention(
        num_heads=num_heads,
        qkv_features=heads.query_features,
        out_features=config.num_hiddens,
        use_bias=config.bias,
        **kwargs,
    )
    _check_flax_module(module, "linen")  # (what the other way refuses, in kwargs)
    params = jax.tree.map(weight_array, to_flax_nnx_state(arrays, num_heads))
    return module, {"params": params}


def from_jax_d2l(variables: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights from d2l's JAX ``MultiHeadAttention`` variables (or ours).

    Args:
        variables: ``{'params': {'W_q': {'kernel': ...}, ...}}`` or the params.

    Raises:
        ValueError: an unexpected entry (d2l's ``attention`` submodule has no
            parameters), a missing one or inconsistent shapes, named.
    """
    tree = _params_tree(variables)
    weights = {}
    for layer, entries in tree.items():
        if layer not in KERNEL_NAMES or not isinstance(entries, Mapping):
            raise ValueError(f"unexpected entry {layer!r} in d2l MultiHeadAttention params")
        for kind, value in entries.items():
            if kind not in ("kernel", "bias"):
                raise ValueError(
                    f"unexpected entry '{layer}/{kind}' in d2l MultiHeadAttention params"
                )
            weights[layer if kind == "kernel" else f"b_{layer[-1]}"] = host_array(value)
    return check_weights(weights)[0]


def to_jax_d2l(weights: Mapping[str, Any]) -> dict[str, Any]:
    """d2l's JAX ``MultiHeadAttention`` variables (also :mod:`mha_multi.jax.linen`'s).

    Returns:
        ``{'params': {'W_q': {'kernel': ..., 'bias': ...}, ...}}`` as JAX
        arrays of the weights' dtype.

    Raises:
        ValueError: invalid weights, or float64 ones without JAX's x64.
    """
    arrays, _ = check_weights(weights)
    params: dict[str, dict[str, jax.Array]] = {}
    for name, array in arrays.items():
        entry = "kernel" if name in KERNEL_NAMES else "bias"
        params.setdefault(f"W_{name[-1]}", {})[entry] = weight_array(array)
    return {"params": params}


def attention_mask(
    valid_lens: Any, num_queries: int, num_keys: int, *, causal: bool = False
) -> jax.Array | None:
    """Flax's boolean ``mask`` for the spec's ``valid_lens`` and ``causal`` rules.

    Args:
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
        num_queries: ``Q``.
        num_keys: ``K``.
        causal: the spec's bottom-right aligned causal rule.

    Returns:
        ``None`` when every key is visible, else a boolean array, ``True``
        where key ``j`` is visible to query ``i``: ``(B, 1, 1|Q, K)``, or
        ``(1, 1, Q, K)`` for ``causal`` alone.

    Raises:
        TypeError: lengths that are neither integer nor floating.
        ValueError: lengths of another shape.
    """
    lens = None if valid_lens is None else np.asarray(valid_lens)
    if lens is not None:  # (their dtype: spec.visibility checks it)
        spec.check_valid_lens_shape(lens.shape, lens.shape[0] if lens.ndim else 1, num_queries)
    visible = spec.visibility(spec.NumpyOps(), num_queries, num_keys, lens, causal=causal)
    if visible is None:
        return None
    visible = np.asarray(visible)
    return jnp.asarray(visible if visible.ndim == 4 else visible[None, None])
