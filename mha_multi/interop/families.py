"""The transformers attention blocks the converters know, and the config fields they read.

A block converts only when its class is known, with its own model's config,
and no config field is set to what the layer does not compute (docs:
"Porting weights"); otherwise the converters raise rather than return a
layer that computes something else.
"""

from __future__ import annotations

import torch

__all__ = ["KNOWN_BLOCKS", "check_known", "window_of"]


def window_of(module: torch.nn.Module) -> int | None:
    """The block's sliding window: its own (Gemma 2's layers), else its model's (Mistral's)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    config = module.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[module.layer_idx] != "sliding_attention":
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
    # One fused qkv_proj (mha_multi.interop.fused_projections), split on the way in. Its
    # config's resid_pdrop and embd_pdrop act outside the block, in the decoder layer.
    "Phi3Attention": "phi3",
}

#: Config fields of a known block that change its numbers in a way the layer
#: does not express (yet): a block whose field is set otherwise is refused.
_UNSUPPORTED_FIELDS = {
    # Cohere's LayerNorm of each head's query and key.
    "use_qk_norm": False,
    # Gemma 2 without the causal rule (its window then looks both ways).
    "use_bidirectional_attention": False,
}


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
    for field, supported in _UNSUPPORTED_FIELDS.items():
        value = getattr(module.config, field, supported)
        if bool(value) != supported:  # transformers reads them as truth values (None: off)
            raise ValueError(
                f"{name} with config {field}={value!r} is not supported: the layer computes "
                f"the block with {field}={supported!r} only"
            )
