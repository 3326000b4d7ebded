"""transformers' models with our layer inside: the same logits and the same greedy tokens.

The blocks' fixture that every backend reads is checked here against what
transformers computes now; then a whole ``LlamaForCausalLM`` whose every
``self_attn`` is a thin adapter around our layer (converted by
:func:`mha_multi.interop.llama.from_llama`) must give the model's logits,
and greedy decoding with our cache the tokens of transformers' own
``generate``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi.interop.llama import from_llama
from mha_multi.torch import MultiHeadAttention, set_weights

transformers = pytest.importorskip("transformers")
from transformers_blocks import MODELS, block_results, converted, llama3_rope, load  # noqa: E402

NEW_TOKENS = 64


@pytest.mark.parametrize("model", list(MODELS))
def test_fixture_holds_what_transformers_computes(model):
    stored = load()[model]
    weights, kwargs = converted(model)
    assert kwargs == stored["kwargs"]
    for name, value in weights.items():
        np.testing.assert_array_equal(np.asarray(value, np.float64), stored["weights"][name])
    for name, value in block_results(model).items():
        np.testing.assert_allclose(value, stored[name], rtol=0, atol=1e-12)


class OurAttention(torch.nn.Module):
    """A decoder layer's ``self_attn`` computed by our layer, with our cache while generating."""

    def __init__(self, attention: torch.nn.Module, hidden_size: int, max_length: int) -> None:
        super().__init__()
        weights, kwargs = from_llama(attention)
        self.layer = set_weights(MultiHeadAttention(hidden_size, **kwargs), weights)
        self.max_length = max_length
        self.cache = None

    def forward(self, hidden_states, position_ids=None, **_):
        x = hidden_states
        if self.cache is None:  # a whole sequence, no cache
            return self.layer(x, x, x, causal=True, positions=position_ids), None
        output, self.cache = self.layer(x, x, x, causal=True, cache=self.cache)
        return output, None


def llama_model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rope_parameters=llama3_rope(16),
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def with_our_attention(model, max_length):
    ours = [OurAttention(layer.self_attn, 32, max_length) for layer in model.model.layers]
    for layer, attention in zip(model.model.layers, ours, strict=True):
        layer.self_attn = attention.to(model.dtype)
    return ours


def test_llama_logits_with_our_attention():
    model = llama_model(torch.float32)
    input_ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids).logits
        with_our_attention(model, 12)
        logits = model(input_ids).logits
    error = (logits - expected).abs().max().item()
    assert error <= 5e-5, error  # logits of order 1 through two layers, float32


def test_greedy_generation_with_our_cache_gives_transformers_tokens():
    model = llama_model(torch.float64)
    prompt = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(
            prompt, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS
        )[:, prompt.shape[1] :]
        ours = with_our_attention(model, prompt.shape[1] + NEW_TOKENS)
        for attention in ours:
            attention.cache = attention.layer.init_cache(2, prompt.shape[1] + NEW_TOKENS)
        tokens, step_input, generated = prompt.shape[1], prompt, []
        for _ in range(NEW_TOKENS):
            # Our cache holds the positions: each call rotates at lengths[b] + i.
            position_ids = torch.arange(tokens - step_input.shape[1], tokens).expand(2, -1)
            logits = model(step_input, position_ids=position_ids, use_cache=False).logits
            step_input = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(step_input)
            tokens += 1
    agree = (torch.cat(generated, dim=1) == expected).sum().item()
    assert agree == expected.numel(), f"{agree} of {expected.numel()} tokens agree"
