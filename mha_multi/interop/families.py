"""The transformers attention blocks the converters know, and the config fields they read.

A block converts only when its class is known, with its own model's config,
and no config field is set to what the layer does not compute (docs:
"Porting weights"); otherwise the converters raise rather than return a
layer that computes something else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the checks of a config (a checkpoint's) need no PyTorch
    import torch

__all__ = [
    "EVERY_LAYER_SLIDES",
    "KNOWN_BLOCKS",
    "QK_NORMS",
    "SINK_BLOCKS",
    "SOFTCAPPED",
    "WINDOWLESS",
    "check_config_fields",
    "check_known",
    "layer_window",
    "qk_norm_of",
    "window_of",
]


def window_of(module: torch.nn.Module) -> int | None:
    """The block's sliding window: its own (Gemma 2's layers), else its model's (Mistral's)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return layer_window(module.config, module.layer_idx)


#: Model types whose blocks and masks have no window, whatever the config's
#: ``sliding_window`` says.
WINDOWLESS = frozenset({"llama", "cohere", "olmo2"})
#: Model types whose every layer slides where the config has a ``sliding_window``,
#: whatever its ``layer_types`` say (Mistral's and Phi-3's masks and blocks).
EVERY_LAYER_SLIDES = frozenset({"mistral", "phi3"})


def layer_window(config: Any, layer_index: int) -> int | None:
    """The sliding window of layer ``layer_index`` by its model's config alone.

    None for a model type without windows (:data:`WINDOWLESS`); the
    config's ``sliding_window`` on every layer of a model type whose
    layers all slide (:data:`EVERY_LAYER_SLIDES`); else None on a layer
    whose type (``layer_types``) is not ``sliding_attention``, and the
    config's ``sliding_window`` on the others.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in WINDOWLESS:
        return None
    layer_types = getattr(config, "layer_types", None)
    if (
        model_type not in EVERY_LAYER_SLIDES
        and layer_types is not None
        and layer_types[layer_index] != "sliding_attention"
    ):
        return None
    return getattr(config, "sliding_window", None)


#: The attention blocks :func:`from_llama` knows, by transformers' class name,
#: each with the model type of the config it reads its numbers from; a block
#: of another class is refused rather than read as one of these.
KNOWN_BLOCKS: dict[str, str] = {
    "LlamaAttention": "llama",
    "MistralAttention": "mistral",
    "Qwen2Attention": "qwen2",
    "Gemma2Attention": "gemma2",
    "CohereAttention": "cohere",
    "Qwen3Attention": "qwen3",
    "Gemma3Attention": "gemma3_text",
    "Olmo2Attention": "olmo2",
    # Sinks, biases on all four projections, a window on its sliding layers.
    "GptOssAttention": "gpt_oss",
    # One fused qkv_proj (mha_multi.interop.fused_projections), split on the way in. Its
    # config's resid_pdrop and embd_pdrop act outside the block, in the decoder layer.
    "Phi3Attention": "phi3",
}

#: The query/key norms of the known blocks that have them, by model type: the
#: class of the block's ``q_norm`` and ``k_norm`` and the :class:`mha_multi.spec.QKNorm`
#: fields of its computation (docs: "Positions and biases"): Qwen 3 casts the
#: normalised values back before the weight multiplies them, Gemma 3 and OLMo 2
#: multiply in float32; Gemma 3's weight is ``1 + w``; OLMo 2 normalises the
#: whole projection.
QK_NORMS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3RMSNorm", {"scope": "heads", "unit_offset": False, "product": "input"}),
    "gemma3_text": (
        "Gemma3RMSNorm",
        {"scope": "heads", "unit_offset": True, "product": "float32"},
    ),
    "olmo2": ("Olmo2RMSNorm", {"scope": "whole", "unit_offset": False, "product": "float32"}),
}

#: The known blocks whose state dict holds each head's sink logit (``sinks``);
#: another block with such an entry is refused.
SINK_BLOCKS = frozenset({"GptOssAttention"})

#: Config fields of a known block that change its numbers in a way the layer
#: does not express (yet): a block whose field is set otherwise is refused.
_UNSUPPORTED_FIELDS = {
    # Cohere's LayerNorm of each head's query and key.
    "use_qk_norm": False,
    # Gemma 2 and 3 without the causal rule (the window then looks both ways).
    "use_bidirectional_attention": False,
}
#: The model types whose blocks soft-cap their scores by the config's
#: ``attn_logit_softcapping`` (Gemma 2's).
SOFTCAPPED = frozenset({"gemma2"})
#: Fields some model types' blocks read, by those model types: the other known blocks
#: ignore the field whatever the config says (transformers' Gemma3Attention and
#: LlamaAttention do not soft-cap), so a config of theirs that sets it would be read one
#: way or the other, and is refused.
_READ_ONLY_BY = {"attn_logit_softcapping": SOFTCAPPED}


def qk_norm_of(module: torch.nn.Module) -> dict[str, Any] | None:
    """The ``qk_norm=`` argument of a known block's query/key norms; ``None`` without them.

    Raises:
        ValueError: norms of another class than the model type's, or with
            different epsilons.
    """
    known = QK_NORMS.get(module.config.model_type)
    if known is None:
        return None
    name, fields = known
    norms = (module.q_norm, module.k_norm)
    for norm in norms:
        if type(norm).__name__ != name:
            raise ValueError(
                f"{type(module).__name__}'s query/key norm is a {type(norm).__name__}, "
                f"not the {name} it converts"
            )
    eps = [float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0))) for norm in norms]
    if eps[0] != eps[1]:
        raise ValueError(
            f"{type(module).__name__}'s q_norm and k_norm have different eps ({eps[0]}, "
            f"{eps[1]}); the layer's qk_norm has one"
        )
    return {**fields, "eps": eps[0]}


def check_known(module: torch.nn.Module) -> None:
    """Raises unless the block is one of :data:`KNOWN_BLOCKS` with its own model's config.

    Raises:
        ValueError: another class or config, or a config field set to what
            the layer does not compute; naming the class and the field.
    """
    name = type(module).__name__
    if name not in KNOWN_BLOCKS or not type(module).__module__.startswith("transformers."):
        raise ValueError(
            f"{type(module).__module__}.{name} is not an attention block from_llama knows: "
            f"it converts transformers' {', '.join(KNOWN_BLOCKS)} only, and refuses others "
            "rather than read them as one of these"
        )
    model_type = getattr(module.config, "model_type", None)
    if model_type != KNOWN_BLOCKS[name]:
        raise ValueError(
            f"{name} with a config of model_type {model_type!r} is not known: "
            f"it reads a {KNOWN_BLOCKS[name]!r} config"
        )
    check_config_fields(module.config, name)


def check_config_fields(config: Any, name: str) -> None:
    """Raises where a known model type's config sets a field to what the layer does not compute.

    Args:
        config: the config (attributes) of a model type of :data:`KNOWN_BLOCKS`.
        name: what the message names (the block's class).

    Raises:
        ValueError: naming ``name``, the field and its value.
    """
    for field, supported in _UNSUPPORTED_FIELDS.items():
        value = getattr(config, field, supported)
        if bool(value) != supported:  # transformers reads them as truth values (None: off)
            raise ValueError(
                f"{name} with config {field}={value!r} is not supported: the layer computes "
                f"the block with {field}={supported!r} only"
            )
    model_type = getattr(config, "model_type", None)
    for field, readers in _READ_ONLY_BY.items():
        value = getattr(config, field, None)
        if value and model_type not in readers:
            raise ValueError(
                f"{name} with config {field}={value!r} is not supported: transformers' "
                f"{model_type!r} blocks do not read it (those of {', '.join(sorted(readers))} "
                "do), so the config means one thing to it and another to its writer; leave "
                "it out"
            )
