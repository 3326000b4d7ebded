"""gpt-oss' attention (transformers) to and from canonical weights: sinks, biases, layer types."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.__main__ import convert
from mha_multi.interop.llama import from_llama, load_llama, save_llama, to_llama
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights, load_weights, save_weights

transformers = pytest.importorskip("transformers")
from llama_support import llama_attention  # noqa: E402

#: A rotary type rotary_of computes: gpt-oss' own default is YaRN.
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 500.0}
#: A small block's sizes: 4 query heads of 4 reading 2 key/value heads.
SIZES = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4}


def gpt_oss_attention(layer_idx=0, rope_parameters=DEFAULT_ROPE, seed=0):
    """transformers' ``GptOssAttention`` from a small config (layer 0 slides, 1 does not)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssConfig

    config = GptOssConfig(**SIZES, sliding_window=3, rope_parameters=rope_parameters)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    module = GptOssAttention(config, layer_idx=layer_idx).double().eval()
    with torch.no_grad():
        module.sinks.normal_()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(module, name).bias.normal_()
    return module


def block_output(module, x):
    """The block's causal output with rotary embeddings off (cos = 1, sin = 0)."""
    length = x.shape[1]
    cos = torch.ones(x.shape[0], length, module.head_dim // 2, dtype=x.dtype)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = j <= i
    if module.sliding_window is not None:
        allowed &= i - j < module.sliding_window
    mask = torch.where(allowed, 0.0, -1e30).to(x.dtype)[None, None]
    with torch.no_grad():
        output, _ = module(x, (cos, torch.zeros_like(cos)), mask)
    return output.numpy()


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding layer", "full layer"])
def test_the_block_converts_with_its_sinks_biases_and_window(layer_idx):
    module = gpt_oss_attention(layer_idx)
    weights, kwargs = from_llama(module)
    assert kwargs["sinks"] is True and kwargs["bias"] is True
    assert kwargs.get("window") == (3 if layer_idx == 0 else None)
    np.testing.assert_array_equal(weights["sinks"], module.sinks.detach().numpy())
    x = np.random.default_rng(1).standard_normal((2, 6, 16))
    expected = block_output(module, torch.from_numpy(x))
    options = {k: v for k, v in kwargs.items() if k != "rotary"}  # rotation off, as above
    layer = set_weights(MultiHeadAttention(16, **options, dtype=torch.float64), weights).eval()
    with torch.no_grad():
        ours = layer(*(3 * [torch.from_numpy(x)]), causal=True).numpy()
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12)


def test_its_own_yarn_rotary_converts():
    """gpt-oss' default rotary is YaRN without truncation (its numbers: the blocks' fixture)."""
    module = gpt_oss_attention(rope_parameters=None)
    _, kwargs = from_llama(module)
    scaling = kwargs["rotary"]["scaling"]
    assert scaling["rope_type"] == "yarn" and scaling["truncate"] is False
    assert scaling["factor"] == module.config.rope_parameters["factor"]


def test_weights_with_sinks_load_into_the_block_and_back():
    weights = init_weights(16, num_heads=4, num_kv_heads=2, head_dim=4, bias=True, sinks=True)
    weights["sinks"] = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    module = to_llama(weights, gpt_oss_attention())
    back, _ = from_llama(module)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value.astype(np.float64))
    with pytest.raises(ValueError, match="sink"):
        to_llama(weights, llama_attention(4, 2, 4, bias=True))  # Llama has no sinks
    without = {name: value for name, value in weights.items() if name != "sinks"}
    with pytest.raises(ValueError, match="sink"):
        to_llama(without, gpt_oss_attention())


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_files_and_the_convert_command_keep_the_sinks(tmp_path, suffix):
    weights, _ = from_llama(gpt_oss_attention())
    path = tmp_path / f"block{suffix}"
    save_llama(path, weights, num_heads=4)
    loaded = load_llama(path, num_heads=4)
    assert all(loaded[name].tobytes() == weights[name].tobytes() for name in weights)
    canonical = tmp_path / "canonical.npz"
    convert(path, canonical, num_heads=4)
    again = load_weights(canonical)
    assert all(again[name].tobytes() == weights[name].tobytes() for name in weights)
    save_weights(tmp_path / "canonical.safetensors", again)
    assert load_weights(tmp_path / "canonical.safetensors")["sinks"].tobytes() == (
        weights["sinks"].tobytes()
    )


def test_a_reference_forward_of_the_converted_weights_is_the_block():
    module = gpt_oss_attention()
    weights, kwargs = from_llama(module)
    x = np.random.default_rng(3).standard_normal((1, 5, 16))
    expected = block_output(module, torch.from_numpy(x))
    output, _ = spec.reference_forward(
        weights, x, x, x, num_heads=4, causal=True, window=kwargs["window"], sinks=True
    )
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-12)
