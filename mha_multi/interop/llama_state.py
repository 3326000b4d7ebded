"""Llama-style attention state dicts read into canonical weights, with numpy alone.

The reading half of :mod:`mha_multi.interop.llama` that needs no PyTorch:
a state dict of numpy arrays (``safetensors.numpy.load_file`` of a
checkpoint, in a JAX, Keras or MXNet environment) converts as one of torch
tensors does. Fused projections (:data:`~mha_multi.interop.fused_projections.FUSED_PROJECTIONS`)
are split. :mod:`mha_multi.interop.llama` re-exports :func:`from_llama_state`
(docs: "Porting weights").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.interop.families import SOFTCAPPED
from mha_multi.interop.fused_projections import join_fused, split_fused
from mha_multi.interop.rotary_config import rotary_of
from mha_multi.weights import SINKS_NAME, WeightsConfig, check_weights

__all__ = [
    "NORMS",
    "PROJECTIONS",
    "block_arguments",
    "from_llama_state",
    "llama_arrays",
    "llama_config",
]


def _host(value: Any) -> np.ndarray:
    """An entry as a numpy array: torch tensors (bfloat16 ones as float32) read on the host."""
    if hasattr(value, "detach"):  # a torch tensor: PyTorch is installed, since it made one
        from mha_multi.torch._facts import host_array

        value = host_array(value)
    return np.asarray(value)


#: Canonical projection -> the Llama module's attribute.
PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
#: The query/key norms' state-dict entries -> their canonical names.
NORMS = {"q_norm.weight": "q_norm", "k_norm.weight": "k_norm"}


def from_llama_state(
    state_dict: Mapping[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    prefix: str = "",
) -> dict[str, np.ndarray]:
    """Canonical weights from a Llama-style attention ``state_dict``.

    Args:
        state_dict: ``q_proj.weight`` ``(num_heads*head_dim, hidden_size)``,
            ``k_proj.weight``/``v_proj.weight`` ``(num_kv_heads*head_dim,
            hidden_size)``, ``o_proj.weight`` ``(hidden_size,
            num_heads*head_dim)``, and biases: all four, or ``q``/``k``/``v``
            only (then ``b_o`` is zero), or none. A fused module of
            :data:`FUSED_PROJECTIONS` (``qkv_proj.weight``, its rows the
            three projections' in turn) may stand for ``q_proj``, ``k_proj``
            and ``v_proj``; it is split by ``o_proj``'s columns. The
            query/key norms' ``q_norm.weight`` and ``k_norm.weight`` (both or
            neither), and gpt-oss' ``sinks``, where present.
        num_heads: ``num_attention_heads`` (the state dict does not say).
        num_kv_heads: ``num_key_value_heads``; ``None`` reads it from
            ``k_proj``'s rows.
        prefix: the attention module's prefix in a model's state dict
            (``"model.layers.0.self_attn."``); other entries are ignored then.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named (a fused
            entry whose rows do not split, or beside a separate one of its
            parts, included), or shapes no head layout of ``num_heads`` heads
            explains.
    """
    _, arrays, _ = _checked(_canonical_arrays(state_dict, prefix), num_heads, num_kv_heads)
    return arrays


def llama_config(
    weights: Mapping[str, Any], *, num_heads: int, num_kv_heads: int | None = None
) -> dict[str, Any]:
    """The ``LlamaConfig`` attention fields that canonical weights describe.

    Returns:
        ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim`` and ``attention_bias``.

    Raises:
        ValueError: the weights are not self-attention (Llama projects one
            ``hidden_states`` of ``hidden_size`` features), or do not fit the heads.
    """
    heads, _, config = _checked(weights, num_heads, num_kv_heads)
    sizes = {config.query_size, config.key_size, config.value_size, config.num_hiddens}
    if len(sizes) != 1:
        raise ValueError(
            "Llama attention projects one hidden_states of hidden_size features: "
            f"query_size, key_size, value_size and num_hiddens must be equal; got "
            f"{config.query_size}, {config.key_size}, {config.value_size}, {config.num_hiddens}"
        )
    return {
        "hidden_size": config.num_hiddens,
        "num_attention_heads": heads.num_heads,
        "num_key_value_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
        "attention_bias": config.bias,
    }


def llama_arrays(
    weights: Mapping[str, Any], num_heads: int, num_kv_heads: int | None, layout: str | None
) -> dict[str, np.ndarray]:
    """A Llama-style attention state dict of numpy arrays from canonical weights.

    What :func:`mha_multi.interop.llama.to_llama_state` gives, before torch
    holds it (its arguments and errors).
    """
    llama_config(weights, num_heads=num_heads, num_kv_heads=num_kv_heads)
    state = {}
    for name, module in PROJECTIONS.items():
        state[f"{module}.weight"] = np.array(weights[f"W_{name}"]).T.copy()
        if f"b_{name}" in weights:
            state[f"{module}.bias"] = np.array(weights[f"b_{name}"], copy=True)
    for key, name in NORMS.items():
        if name in weights:
            state[key] = np.array(weights[name], copy=True)
    if SINKS_NAME in weights:
        state[SINKS_NAME] = np.array(weights[SINKS_NAME], copy=True)
    if layout is not None:
        state = join_fused(state, PROJECTIONS, layout)
    return state


def block_arguments(
    weights: dict[str, np.ndarray],
    config: Any,
    heads: spec.Heads,
    *,
    block: str,
    qk_norm: dict[str, Any] | None,
    window: int | None,
    scaling: float,
    layer_type: str | None,
) -> dict[str, Any]:
    """The layer's constructor arguments for a known block; folds its score scale into ``weights``.

    What :func:`mha_multi.interop.llama.from_llama` returns as ``kwargs``,
    from the block's model config and what the block (or, for a checkpoint,
    the config alone) says of its layer.

    Args:
        weights: the block's canonical weights (checked for ``heads``); a
            score scale other than ``1/sqrt(head_dim)`` is folded into them.
        config: the model's config (attributes).
        heads: the block's head layout.
        block: the block's class name, for messages.
        qk_norm: the ``qk_norm=`` of its query/key norms, ``None`` without.
        window: its sliding window, ``None`` without.
        scaling: the factor of its scores (``head_dim ** -0.5``, or Gemma's
            ``query_pre_attn_scalar ** -0.5``).
        layer_type: its layer type, for a config of rotary settings by type.

    Raises:
        ValueError: norms in the weights where the model type has none, or
            the other way round, or of the wrong shapes; rotary settings that
            are not supported (:func:`~mha_multi.interop.rotary_config.rotary_of`),
            or that rotate an odd number of each head's entries.
    """
    if (qk_norm is None) != ("q_norm" not in weights):
        raise ValueError(
            f"{block}'s state dict has query/key norms where its model type "
            f"{config.model_type!r} has none, or none where it has them"
        )
    if qk_norm is not None:
        # The norms' shapes as the model type's scope has them (docs: "Canonical weights").
        check_weights(
            weights,
            qk_norm=qk_norm["scope"],
            sinks=None,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=heads.head_dim,
        )
    # Our scores are scaled by 1/sqrt(head_dim): another scale goes into W_q, or
    # into the queries' norm where it follows W_q.
    factor = score_factor(scaling, heads.head_dim)
    if factor != 1.0:
        fold_scale(weights, factor, qk_norm)
    rotary = rotary_of(config, layer_type)
    rotated = int(heads.head_dim * rotary["fraction"])  # (transformers' and the spec's count)
    if rotated % 2:
        raise ValueError(
            f"{block}'s partial_rotary_factor {rotary['fraction']} of head_dim "
            f"{heads.head_dim} rotates {rotated} entries, an odd number: transformers then "
            f"rotates {rotated + 1} entries by the frequencies of {rotated}, which the layer "
            "does not compute"
        )
    kwargs: dict[str, Any] = {
        "num_heads": heads.num_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
        "rotary": rotary,
    }
    if qk_norm is not None:
        kwargs["qk_norm"] = qk_norm
    if window is not None:
        kwargs["window"] = int(window)
    # (Another model type's config sets none: check_config_fields refuses it.)
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and config.model_type in SOFTCAPPED:
        kwargs["softcap"] = float(softcap)
    if "b_q" in weights:
        kwargs["bias"] = True
    if SINKS_NAME in weights:
        kwargs["sinks"] = True
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout:
        kwargs["dropout"] = dropout
    # The layer's own checks of its options, here: settings it refuses (a rotary
    # attention_factor of 0) are refused before any arguments are given or written.
    options = {name: kwargs[name] for name in ("window", "softcap", "qk_norm") if name in kwargs}
    try:
        spec.LayerOptions(rotary=rotary, **options).check(heads.head_dim)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{block}'s settings are not the layer's: {error}") from error
    return kwargs


def score_factor(scaling: float, head_dim: int) -> float:
    """The factor a block's score scale ``scaling`` puts on its queries against the
    layer's ``1 / sqrt(head_dim)``, which :func:`fold_scale` folds into the weights.

    1.0 where ``scaling`` is transformers' own ``head_dim ** -0.5`` (Llama's,
    Mistral's...): that scale is the layer's, though its product with
    ``sqrt(head_dim)`` rounds to ``1 + 2**-52`` for some sizes (8, 32, 128...),
    and a fold of it would return ``W_q`` in float64, off its block's by that
    factor (docs: "Porting weights").
    """
    if scaling == head_dim**-0.5:
        return 1.0
    return scaling * float(np.sqrt(head_dim))


def fold_scale(weights: dict[str, np.ndarray], factor: float, qk_norm: Any) -> None:
    """Multiplies the queries by ``factor`` through their weights, in float64.

    Without norms ``W_q`` and ``b_q`` scale; with them the norm's gain does:
    ``factor * w``, or for a ``(1 + w)`` gain ``factor * (1 + w) - 1``.
    """
    if qk_norm is None:
        for name in ("W_q", "b_q"):
            if name in weights:
                weights[name] = weights[name].astype(np.float64) * factor
        return
    offset = 1.0 if qk_norm["unit_offset"] else 0.0
    weights["q_norm"] = (weights["q_norm"].astype(np.float64) + offset) * factor - offset


def _checked(
    weights: Mapping[str, Any], num_heads: int, num_kv_heads: int | None
) -> tuple[spec.Heads, dict[str, np.ndarray], WeightsConfig]:
    """The head layout the shapes give ``num_heads`` heads, and the weights checked against it.

    Raises:
        ValueError: shapes no head layout of ``num_heads`` heads explains, or
            weights that are not canonical.
    """
    heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=num_kv_heads)
    arrays, config = check_weights(
        weights,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        qk_norm=None,
        sinks=None,
    )
    return heads, arrays, config


def _canonical_arrays(
    state_dict: Mapping[str, Any], prefix: str, *, sinks: bool = True
) -> dict[str, np.ndarray]:
    """The canonical arrays of a Llama-style state dict, their shapes not yet checked.

    ``sinks``: the entry ``sinks`` (gpt-oss') is taken; a block of a class
    without sinks refuses it.

    Raises:
        ValueError: a missing or extra entry, or biases the canonical layer
            cannot hold.
    """
    entries = {
        name[len(prefix) :]: value for name, value in state_dict.items() if name.startswith(prefix)
    }
    entries = split_fused(entries, PROJECTIONS, prefix=prefix)
    expected = {
        f"{module}.{kind}" for module in PROJECTIONS.values() for kind in ("weight", "bias")
    }
    if sinks:
        expected.add(SINKS_NAME)  # gpt-oss' sink logit of each head
    unexpected = sorted(set(entries) - expected - set(NORMS))
    if unexpected:
        raise ValueError(f"unexpected Llama attention entries {unexpected}")
    weights: dict[str, np.ndarray] = {}
    for name, module in PROJECTIONS.items():
        key = f"{module}.weight"
        if key not in entries:
            raise ValueError(f"the Llama attention state dict is missing {prefix + key!r}")
        weights[f"W_{name}"] = _host(entries[key]).T.copy()
    biases = {name for name, module in PROJECTIONS.items() if f"{module}.bias" in entries}
    if biases == set("qkv"):
        biases.add("o")
        weights["b_o"] = np.zeros(weights["W_o"].shape[1], weights["W_o"].dtype)
    elif biases and biases != set("qkvo"):
        raise ValueError(
            "the canonical layer has biases on all four projections, or on q, k and v (b_o = 0), "
            f"or none; this state dict has them on {sorted(biases)}"
        )
    for name in sorted(biases & set("qkv")) + (["o"] if "o_proj.bias" in entries else []):
        weights[f"b_{name}"] = _host(entries[f"{PROJECTIONS[name]}.bias"])
    for key, name in NORMS.items():
        if key in entries:
            weights[name] = _host(entries[key])
    if SINKS_NAME in entries:
        weights[SINKS_NAME] = _host(entries[SINKS_NAME])
    return weights
