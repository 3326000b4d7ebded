"""transformers' blocks with query/key norms (Qwen 3, Gemma 3, OLMo 2): conversion both ways,
files, and the refusal of what the converter does not compute."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from mha_multi.interop.llama import (
    from_llama,
    from_llama_state,
    load_llama,
    rotary_of,
    save_llama,
    to_llama,
)

transformers = pytest.importorskip("transformers")

FAMILIES = {"qwen3": "Qwen3", "olmo2": "Olmo2", "gemma3": "Gemma3"}


def norm_block(model: str, layer_idx: int = 0, **options):
    """A small float64 block of ``model`` whose norms are not their identity."""
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    prefix = FAMILIES[model]
    config_class = getattr(module, f"{prefix}TextConfig", None) or getattr(
        module, f"{prefix}Config"
    )
    config = config_class(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, **options
    )
    torch.manual_seed(0)
    block = getattr(module, f"{prefix}Attention")(config, layer_idx=layer_idx).double().eval()
    with torch.no_grad():
        for norm in (block.q_norm, block.k_norm):
            norm.weight.add_(0.5 * torch.randn_like(norm.weight))
    return block


@pytest.mark.parametrize("model", ["qwen3", "olmo2"])
def test_weights_go_to_the_block_and_back_bit_exact(model):
    block = norm_block(model)
    weights, kwargs = from_llama(block)
    assert kwargs["qk_norm"]["scope"] == ("whole" if model == "olmo2" else "heads")
    fresh = norm_block(model)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    to_llama(weights, fresh)
    for name, tensor in block.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_files_carry_the_norms(tmp_path):
    block = norm_block("qwen3")
    weights = from_llama_state(block.state_dict(), num_heads=4)
    for suffix in (".pt", ".safetensors"):
        path = tmp_path / f"block{suffix}"
        save_llama(path, weights, num_heads=4)
        loaded = load_llama(path, num_heads=4)
        assert set(loaded) == set(weights)
        for name, array in weights.items():
            np.testing.assert_array_equal(loaded[name], array)


def test_gemma3_layers_take_their_own_rotary_and_window():
    layers = {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2}
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
    }
    options = {**layers, "rope_parameters": rope, "sliding_window": 3}
    _, local = from_llama(norm_block("gemma3", 0, **options))
    _, global_ = from_llama(norm_block("gemma3", 1, **options))
    assert (local["rotary"]["theta"], local["window"]) == (100.0, 3)
    assert global_["rotary"]["theta"] == 5000.0 and "window" not in global_
    assert local["qk_norm"]["unit_offset"] is True
    with pytest.raises(ValueError, match="given by layer type"):
        rotary_of(norm_block("gemma3", 0, **options).config)


def _extra_norm_entry():
    block = norm_block("qwen3")
    block.q_norm.register_parameter("bias", torch.nn.Parameter(torch.zeros(4)))
    return block


def _other_norm_class():
    block = norm_block("qwen3")
    block.k_norm = torch.nn.RMSNorm(4, eps=1e-6).double()
    return block


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (_extra_norm_entry, r"unexpected Llama attention entries \['q_norm.bias'\]"),
        (_other_norm_class, "query/key norm is a RMSNorm, not the Qwen3RMSNorm"),
        (
            lambda: norm_block("gemma3", attn_logit_softcapping=30.0),
            "attn_logit_softcapping=30.0 is not supported",
        ),
    ],
    ids=["extra entry", "another norm", "gemma3 softcap"],
)
def test_what_the_converter_does_not_compute_is_refused(make, match):
    block = make()
    converted = None
    with pytest.raises(ValueError, match=match):
        converted = from_llama(block)
    assert converted is None
