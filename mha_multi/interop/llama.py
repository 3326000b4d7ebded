"""Llama-style attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.

The layout of transformers' ``LlamaAttention`` and of the models that copy
it (Mistral, Qwen2, Gemma...): four ``torch.nn.Linear`` projections, grouped
query heads (``num_key_value_heads``) and an explicit ``head_dim``. Query head
``h`` reads key/value head ``h // (num_heads // num_kv_heads)``
(transformers' ``repeat_kv``), the rule of the canonical layer, so the
weights port as they are: ``W_q = q_proj.weight.T`` and so on.

What is not ported: a Llama model rotates the projected queries and keys by
their positions (rotary embeddings) before attending; the canonical layer
attends to the projections it computes. The two give the same numbers where
the rotation is the identity (``cos = 1``, ``sin = 0``); a model that needs
rotary embeddings applies them around the layer. Models with biases on the
query, key and value projections only (Qwen2) convert with ``b_o = 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mha_multi import spec
from mha_multi.torch._backend import host_array
from mha_multi.weights import check_weights

__all__ = ["from_llama", "from_llama_state", "llama_config", "to_llama", "to_llama_state"]

#: Canonical projection -> the Llama module's attribute.
PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


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
            only (then ``b_o`` is zero), or none.
        num_heads: ``num_attention_heads`` (the state dict does not say).
        num_kv_heads: ``num_key_value_heads``; ``None`` reads it from
            ``k_proj``'s rows.
        prefix: the attention module's prefix in a model's state dict
            (``"model.layers.0.self_attn."``); other entries are ignored then.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named, or shapes no
            head layout of ``num_heads`` heads explains.
    """
    entries = {
        name[len(prefix) :]: value for name, value in state_dict.items() if name.startswith(prefix)
    }
    expected = {
        f"{module}.{kind}" for module in PROJECTIONS.values() for kind in ("weight", "bias")
    }
    unexpected = sorted(set(entries) - expected)
    if unexpected:
        raise ValueError(f"unexpected Llama attention entries {unexpected}")
    weights: dict[str, np.ndarray] = {}
    for name, module in PROJECTIONS.items():
        key = f"{module}.weight"
        if key not in entries:
            raise ValueError(f"the Llama attention state dict is missing {prefix + key!r}")
        weights[f"W_{name}"] = np.asarray(host_array(entries[key])).T.copy()
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
        weights[f"b_{name}"] = np.asarray(host_array(entries[f"{PROJECTIONS[name]}.bias"]))
    heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=num_kv_heads)
    arrays, _ = check_weights(
        weights,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
    )
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
    heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=num_kv_heads)
    _, config = check_weights(
        weights,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
    )
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


def to_llama_state(
    weights: Mapping[str, Any], *, num_heads: int, num_kv_heads: int | None = None
) -> dict[str, torch.Tensor]:
    """A Llama-style attention ``state_dict`` from canonical weights.

    Biases, when present, go on all four projections (``attention_bias=True``).

    Raises:
        ValueError: as :func:`llama_config`.
    """
    llama_config(weights, num_heads=num_heads, num_kv_heads=num_kv_heads)
    state = {}
    for name, module in PROJECTIONS.items():
        state[f"{module}.weight"] = torch.from_numpy(np.array(weights[f"W_{name}"]).T.copy())
        if f"b_{name}" in weights:
            state[f"{module}.bias"] = torch.from_numpy(np.array(weights[f"b_{name}"], copy=True))
    return state


def from_llama(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Canonical weights and the head configuration of a ``LlamaAttention``-style module.

    Returns:
        ``(weights, heads)`` with ``heads`` the keyword arguments of every
        backend's constructor: ``num_heads``, ``num_kv_heads``, ``head_dim``.
    """
    config = module.config
    num_heads = config.num_attention_heads
    weights = from_llama_state(
        module.state_dict(), num_heads=num_heads, num_kv_heads=config.num_key_value_heads
    )
    heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=config.num_key_value_heads)
    return weights, {
        "num_heads": heads.num_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
    }


def to_llama(weights: Mapping[str, Any], module: torch.nn.Module) -> torch.nn.Module:
    """Loads canonical weights into a ``LlamaAttention``-style module (strict) and returns it.

    Raises:
        ValueError: the module's configuration differs from the weights'.
    """
    config = module.config
    num_heads = config.num_attention_heads
    expected = llama_config(weights, num_heads=num_heads, num_kv_heads=config.num_key_value_heads)
    for field, value in expected.items():
        actual = getattr(config, field, None)
        if actual != value:
            raise ValueError(f"the module's config has {field}={actual}; the weights need {value}")
    state = to_llama_state(weights, num_heads=num_heads, num_kv_heads=config.num_key_value_heads)
    reference = module.state_dict()
    state = {name: tensor.to(reference[name].dtype) for name, tensor in state.items()}
    module.load_state_dict(state, strict=True)
    return module
