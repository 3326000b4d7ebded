"""Llama-style attention: ``q_proj``, ``k_proj``, ``v_proj`` (or a fused ``qkv_proj``), ``o_proj``.

The layout of transformers' ``LlamaAttention`` and of the models that copy
it (Mistral, Qwen2, Gemma 2, Cohere, gpt-oss, Phi-3; with RMSNorms of the
projected queries and keys, ``q_norm`` and ``k_norm``, Qwen 3, Gemma 3 and
OLMo 2): four ``torch.nn.Linear`` projections, grouped
query heads (``num_key_value_heads``) and an explicit ``head_dim``. Query head
``h`` reads key/value head ``h // (num_heads // num_kv_heads)``
(transformers' ``repeat_kv``), the rule of the canonical layer, so the
weights port as they are: ``W_q = q_proj.weight.T`` and so on. Families
that fuse the query, key and value projections into one module (Phi-3's
``qkv_proj``, :data:`FUSED_PROJECTIONS`) have them split on the way in,
wherever a state dict is read, and joined on the way out where the caller
(``layout=``) or the target module asks for that layout.

:func:`from_llama` reads the module's configuration too and returns the
constructor arguments under which every backend's layer *is* that
attention block (docs: "Positions and biases"). It converts only the blocks
it knows completely (:data:`KNOWN_BLOCKS`), and refuses any other class, or
a config field it does not compute, rather than return a layer that computes
something else: the rotary embedding (``rope_theta``, the rotary type and
its parameters, ``partial_rotary_factor``, the pairing of the rotated entries),
the sliding window (Mistral's ``sliding_window``, Gemma 2's on its sliding
layers), the soft cap of the scores (Gemma 2's
``attn_logit_softcapping``), the query/key norms (``qk_norm``), gpt-oss'
sink logit of each head (its ``sinks`` parameter, the canonical ``sinks``).
A scale of the scores other than ``1/sqrt(head_dim)`` (Gemma 2's and Gemma
3's ``query_pre_attn_scalar``) is folded into ``W_q`` and ``b_q``, or, where
the queries are normalised after their projection, into ``q_norm``. Models
with biases on the query, key and value projections only (Qwen2) convert
with ``b_o = 0``. State dicts and files
hold weights only: their layers get the positions options from
:func:`rotary_of` and the model's config. Reading a state dict of numpy
arrays needs no PyTorch: :func:`from_llama_state` lives in
:mod:`mha_multi.interop.llama_state`, which imports no framework.

Files (:func:`load_llama`, :func:`save_llama`; the ``llama`` format of
``python -m mha_multi convert``) hold one attention block's state dict,
written by ``torch.save`` (``.pt``, ``.pth``, ``.bin``) or as
``.safetensors``. Its entries may sit under one common prefix ending in
``.``, as in a decoder layer's (``self_attn.``) or a model's
(``model.layers.0.self_attn.``) state dict; entries outside the prefix are
ignored, and a file holding several blocks (a whole model) is refused:
:func:`from_llama_state` with ``prefix=`` picks one. Files are written
without a prefix. A state dict does not record its heads, so reading and
writing take the head layout (any one of ``num_heads``, ``num_kv_heads``,
``head_dim`` fixes it, the shapes giving the rest).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mha_multi import spec
from mha_multi.interop.families import (
    KNOWN_BLOCKS,
    SINK_BLOCKS,
    check_known,
    qk_norm_of,
    window_of,
)
from mha_multi.interop.formats import check_heads_given, llama_prefixes, resolve_heads
from mha_multi.interop.fused_projections import FUSED_PROJECTIONS, fused_layout_of
from mha_multi.interop.llama_state import (
    PROJECTIONS,
    _canonical_arrays,
    _checked,
    block_arguments,
    fold_scale,
    from_llama_state,
    llama_arrays,
    llama_config,
    score_factor,
)
from mha_multi.interop.rotary_config import INTERLEAVED_ROTARY, rotary_of
from mha_multi.interop.torch import _load_state_dict, _save_state_dict
from mha_multi.weights import SINKS_NAME, check_weights

__all__ = [
    "FUSED_PROJECTIONS",
    "INTERLEAVED_ROTARY",
    "KNOWN_BLOCKS",
    "from_llama",
    "from_llama_state",
    "llama_config",
    "load_llama",
    "rotary_of",
    "save_llama",
    "to_llama",
    "to_llama_state",
]


def to_llama_state(
    weights: Mapping[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    layout: str | None = None,
) -> dict[str, torch.Tensor]:
    """A Llama-style attention ``state_dict`` from canonical weights.

    Biases, when present, go on all four projections (``attention_bias=True``);
    ``q_norm`` and ``k_norm``, when present, are ``q_norm.weight`` and ``k_norm.weight``;
    the heads' sink logits, when present, are the entry ``sinks`` (gpt-oss).

    Args:
        weights: canonical weights of self-attention.
        num_heads, num_kv_heads: the head layout (``num_kv_heads`` from the
            widths when ``None``).
        layout: ``None`` for separate ``q_proj``, ``k_proj``, ``v_proj``;
            or a model type of :data:`FUSED_PROJECTIONS` (``"phi3"``) whose
            fused module (``qkv_proj``) then holds their rows, in its order.

    Raises:
        ValueError: as :func:`llama_config`, or an unknown ``layout``.
    """
    state = llama_arrays(weights, num_heads, num_kv_heads, layout)
    return {name: torch.from_numpy(array) for name, array in state.items()}


def from_llama(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical weights and the constructor arguments of a ``LlamaAttention``-style module.

    The attention blocks of :data:`KNOWN_BLOCKS`: Llama's, Mistral's,
    Qwen2's, Gemma 2's, Cohere's, Qwen 3's, Gemma 3's (a local or a global
    layer: its own rotary settings and window), OLMo 2's, gpt-oss' and
    Phi-3's (its fused ``qkv_proj`` split). ``MultiHeadAttention(hidden_size,
    **kwargs)`` in any backend, loaded with the weights, computes what the
    block computes for the same inputs and ``positions`` (its
    ``position_ids``), with ``causal=True`` as the block's own mask: rotary
    embeddings (their pairing taken from the block), window, soft cap and
    attention dropout included.

    Returns:
        ``(weights, kwargs)``: ``kwargs`` holds plain Python values:
        ``num_heads``, ``num_kv_heads``, ``head_dim`` and, where the block
        has them, ``rotary``, ``window``, ``softcap``, ``qk_norm``, ``bias``, ``sinks``,
        ``dropout``.

    Raises:
        ValueError: a block of another class, a config field the layer does
            not compute, or a rotary type that is not supported
            (:func:`rotary_of`); nothing is returned then.
    """
    check_known(module)
    config = module.config
    num_heads = config.num_attention_heads
    state = _canonical_arrays(module.state_dict(), "", sinks=type(module).__name__ in SINK_BLOCKS)
    _, weights, _ = _checked(state, num_heads, config.num_key_value_heads)
    heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=config.num_key_value_heads)
    kwargs = block_arguments(
        weights,
        config,
        heads,
        block=type(module).__name__,
        qk_norm=qk_norm_of(module),
        window=window_of(module),
        scaling=float(module.scaling),
        layer_type=getattr(module, "layer_type", None),
    )
    return weights, kwargs


def to_llama(weights: Mapping[str, Any], module: torch.nn.Module) -> torch.nn.Module:
    """Loads canonical weights into a ``LlamaAttention``-style module (strict) and returns it.

    The module tells its layout: separate ``q_proj``, ``k_proj``, ``v_proj``,
    or a fused projection of :data:`FUSED_PROJECTIONS` (Phi-3's ``qkv_proj``),
    which then gets their rows joined; and its score scale, which
    :func:`from_llama` folds into the weights (Gemma's
    ``query_pre_attn_scalar``): it is taken out of them here.

    Raises:
        ValueError: the module's configuration, entries or shapes differ
            from the weights'.
    """
    config = module.config
    num_heads = config.num_attention_heads
    expected = llama_config(weights, num_heads=num_heads, num_kv_heads=config.num_key_value_heads)
    for field, value in expected.items():
        # A field the config lacks is not the model's setting (Phi-3 has no attention_bias):
        # the entries and shapes below check what it would.
        actual = getattr(config, field, None)
        if hasattr(config, field) and actual != value:
            raise ValueError(f"the module's config has {field}={actual}; the weights need {value}")
    # The block scales its scores by its own factor (Gemma's query_pre_attn_scalar),
    # which from_llama folded into the weights: taken out again, as a checkpoint's
    # layers are written back.
    heads, arrays, _ = _checked(weights, num_heads, config.num_key_value_heads)
    factor = score_factor(float(module.scaling), heads.head_dim)
    if factor != 1.0:
        fold_scale(arrays, 1.0 / factor, qk_norm_of(module))
    reference = module.state_dict()
    state = to_llama_state(
        arrays,
        num_heads=num_heads,
        num_kv_heads=config.num_key_value_heads,
        layout=fused_layout_of(reference),
    )
    output_bias = f"{PROJECTIONS['o']}.bias"
    if output_bias in state and set(state) - {output_bias} == set(reference):
        # (A block whose output alone has no bias, Qwen2's, converts with b_o = 0.)
        if torch.any(state[output_bias] != 0):
            raise ValueError(
                f"{type(module).__name__} has no {output_bias}; the weights' b_o is not zero"
            )
        del state[output_bias]
    if (SINKS_NAME in state) != (SINKS_NAME in reference):
        has = "has" if SINKS_NAME in reference else "has no"
        raise ValueError(
            f"{type(module).__name__} {has} sink logits ('sinks'); the weights need the other"
        )
    if set(state) != set(reference):
        raise ValueError(
            f"the module has the entries {sorted(reference)}; the weights give {sorted(state)}"
        )
    for name, tensor in state.items():
        if tensor.shape != reference[name].shape:
            raise ValueError(
                f"the module's {name} has shape {tuple(reference[name].shape)}; the weights "
                f"give {tuple(tensor.shape)}"
            )
    state = {name: tensor.to(reference[name].dtype) for name, tensor in state.items()}
    module.load_state_dict(state, strict=True)
    return module


def _is_safetensors(path: str) -> bool:
    return path.lower().endswith(".safetensors")


def _read_state(path: str) -> dict[str, Any]:
    """The tensors of a ``.safetensors`` file, or the ``state_dict`` of a torch checkpoint."""
    if not _is_safetensors(path):
        return _load_state_dict(path)
    from safetensors import SafetensorError
    from safetensors.torch import load

    with open(path, "rb") as file:  # so that a missing file stays a FileNotFoundError
        data = file.read()
    try:
        # Read as torch tensors: checkpoints are often bfloat16, which numpy lacks.
        return load(data)
    except SafetensorError as error:
        raise ValueError(
            f"{path!r} is not a valid .safetensors file (truncated or corrupt): {error}"
        ) from error


def load_llama(
    path: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """Canonical weights from a file of one Llama-style attention block's state dict.

    The file is a ``.safetensors`` file or a ``torch.save`` checkpoint (read
    with ``torch.load(weights_only=True)``: nothing in it runs); its entries
    may sit under one prefix (see the module notes). The state dict does not
    record its heads: one of ``num_heads``, ``num_kv_heads`` and ``head_dim``
    is needed, the shapes give the others, and those given too are checked
    (:func:`mha_multi.interop.formats.resolve_heads`).

    Args:
        path: the file.
        num_heads: ``num_attention_heads``.
        num_kv_heads: ``num_key_value_heads``.
        head_dim: the size of each head.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: no head option; a damaged file, one that is not a state
            dict, or one holding no or several attention blocks; entries
            that are not a Llama attention's (see :func:`from_llama_state`);
            or head options that do not fit the shapes.
    """
    path = os.fspath(path)
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    check_heads_given("llama", reading=True, **options)
    state = _read_state(path)
    prefixes = llama_prefixes(state)
    if len(prefixes) != 1:
        shown = ", ".join(repr(p) for p in prefixes[:3]) + (", ..." if len(prefixes) > 3 else "")
        found = f"{len(prefixes)} ({shown})" if prefixes else "none (no 'q_proj.weight' entry)"
        raise ValueError(
            f"{path!r} must hold the state dict of one Llama-style attention block; found {found}"
        )
    try:
        weights, _ = check_weights(_canonical_arrays(state, prefixes[0]), qk_norm=None, sinks=None)
    except ValueError as error:
        raise ValueError(f"{path!r}: {error}") from error
    heads = resolve_heads(weights, source=path, **options)
    assert heads is not None  # check_heads_given
    return from_llama_state(
        state, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads, prefix=prefixes[0]
    )


def save_llama(
    path: str | os.PathLike[str],
    weights: Mapping[str, Any],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    layout: str | None = None,
) -> None:
    """Writes canonical weights as a Llama-style attention block's state dict.

    ``.safetensors`` files are written with safetensors, any other name with
    ``torch.save``; entries have no prefix (:func:`to_llama_state`).

    Args:
        path: the destination.
        weights: canonical weights of self-attention (every size ``hidden_size``).
        num_heads, num_kv_heads, head_dim: the head layout; one is needed,
            the widths give the others, and those given too are checked.
        layout: ``None`` for separate ``q_proj``, ``k_proj``, ``v_proj``, or
            a model type of :data:`FUSED_PROJECTIONS` whose fused module
            holds them (:func:`to_llama_state`).

    Raises:
        ValueError: no head option, head options that do not fit the
            weights, or weights Llama's layout cannot hold (see
            :func:`llama_config`).
        OSError: the file cannot be written.
    """
    path = os.fspath(path)
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    check_heads_given("llama", reading=False, **options)
    heads = resolve_heads(weights, **options)
    assert heads is not None  # check_heads_given
    state = to_llama_state(
        weights, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads, layout=layout
    )
    if not _is_safetensors(path):
        _save_state_dict(path, state)
        return
    from safetensors.torch import save

    # Serialised in memory and written by Python so that an unwritable path
    # raises the usual OSError rather than safetensors' own error.
    data = save(state)
    with open(path, "wb") as file:
        file.write(data)
