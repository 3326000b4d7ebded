"""transformers' models with our layer inside: the same logits and the same greedy tokens.

The blocks' fixture that every backend reads is checked here against what
transformers computes now; then tiny random causal LMs of each family in
:data:`CAUSAL_LMS` get every ``self_attn`` replaced by our layer
(:func:`mha_multi.interop.transformers_models.replace_attention`) and must
give the logits of the untouched model, left padding included, and
``generate`` with our cache the tokens of transformers' own ``generate``.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from mha_multi.interop.transformers_models import OurAttention, replace_attention

transformers = pytest.importorskip("transformers")
from transformers_blocks import MODELS, block_results, converted, llama3_rope, load  # noqa: E402

NEW_TOKENS = 64

#: Two layers of each kind where a family has kinds (a window of 6 within the 12 tokens).
TWO_KINDS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
#: family -> (transformers model type, config class, model class, config options): a
#: family is one line.
CAUSAL_LMS = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {"rope_parameters": llama3_rope(16)}),
    "phi3": (
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        {"partial_rotary_factor": 0.5, "sliding_window": 6},
    ),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", TWO_KINDS),
    "gpt_oss": (
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **TWO_KINDS,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            # Its own YaRN, from a context of 4: the 12 tokens reach past it.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4,
            },
        },
    ),
}


#: Families whose config fields below their models do not read as they say, beside
#: :data:`CAUSAL_LMS`: each model type's causal LM class.
FIELD_LMS = {
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", {}),
    "olmo2": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}),
    "cohere": ("cohere", "CohereConfig", "CohereForCausalLM", {}),
}
#: (family, config options): fields a family's model reads otherwise than they say.
#: Llama's, OLMo 2's and Cohere's models have no window whatever sliding_window says;
#: Mistral's and Phi-3's slide on every layer whatever layer_types say; the default
#: rotary type of every family but Phi-3 rotates whole heads whatever
#: partial_rotary_factor says.
UNREAD_FIELDS = {
    "llama, sliding_window": ("llama", {"sliding_window": 4}),
    "olmo2, sliding_window": ("olmo2", {"sliding_window": 4}),
    "cohere, sliding_window": ("cohere", {"sliding_window": 4}),
    "mistral, layer_types": (
        "mistral",
        {"sliding_window": 4, "layer_types": ["full_attention"] * 2},
    ),
    "phi3, layer_types": ("phi3", {"sliding_window": 4, "layer_types": ["full_attention"] * 2}),
    "qwen3, partial_rotary_factor": (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            }
        },
    ),
}


@pytest.mark.parametrize("name", list(UNREAD_FIELDS))
def test_fields_a_model_does_not_read_convert_as_it_reads_them(name):
    family, options = UNREAD_FIELDS[name]
    model = causal_lm(family, torch.float64, **options)
    ids, mask = left_padded(3, 12, seed=1)
    real = mask.bool()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        replace_attention(model, max_length=12)
        logits = model(ids, attention_mask=mask).logits
    # (Rotary angles in float32, as transformers computes them.)
    assert (logits - expected)[real].abs().max().item() <= 1e-6


@pytest.mark.parametrize("model", list(MODELS))
def test_fixture_holds_what_transformers_computes(model):
    stored = load()[model]
    weights, kwargs = converted(model)
    assert kwargs == stored["kwargs"]
    for name, value in weights.items():
        np.testing.assert_array_equal(np.asarray(value, np.float64), stored["weights"][name])
    for name, value in block_results(model).items():
        np.testing.assert_allclose(value, stored[name], rtol=0, atol=1e-12)


def causal_lm(family: str, dtype: torch.dtype, **extra):
    """A tiny random causal LM of ``family`` (two layers, grouped heads), eval, with
    the config options ``extra`` beside the family's."""
    model_type, config_class, model_class, options = CAUSAL_LMS.get(family) or FIELD_LMS[family]
    options = {**options, **extra}
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config = getattr(module, config_class)(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **options,
    )
    # (transformers' SDPA attention takes no sink: gpt-oss runs its eager one, and its
    # experts' eager loop, which takes float64 as the grouped products do not.)
    config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    if family == "gpt_oss":
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    return getattr(module, model_class)(config).to(dtype).eval()


def left_padded(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their 2-D ``attention_mask``: example ``b`` has ``2 b`` pads at the start."""
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(length)[None, :] >= 2 * torch.arange(batch)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", list(CAUSAL_LMS))
def test_logits_with_our_attention(family):
    model = causal_lm(family, torch.float32)
    ids, mask = left_padded(3, 12, seed=1)
    real = mask.bool()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        unpadded = model(ids).logits
        replace_attention(model, max_length=12)
        logits = model(ids, attention_mask=mask).logits
        # A prompt, then the rest continuing our cache (past_key_values).
        first = model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True)
        rest = model(ids[:, 9:], attention_mask=mask, past_key_values=first.past_key_values)
        unpadded_ours = model(ids).logits
    # Logits of order 1 through two layers, float32; padded positions mean nothing.
    assert (logits - expected)[real].abs().max().item() <= 1e-6
    chunked = torch.cat([first.logits, rest.logits], dim=1)
    assert (chunked - expected)[real].abs().max().item() <= 1e-6
    assert (unpadded_ours - unpadded).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", list(CAUSAL_LMS))
def test_greedy_generation_with_our_cache_gives_transformers_tokens(family):
    model = causal_lm(family, torch.float64)
    # 64 tokens after ragged prompts; then a new sequence (another batch size), shorter.
    prompts = [(*left_padded(2, 9, seed=2), NEW_TOKENS), (*left_padded(3, 5, seed=3), 8)]

    def generate(ids, mask, tokens):
        greedy = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens}
        return model.generate(ids, attention_mask=mask, **greedy)

    with torch.no_grad():
        expected = [generate(*prompt) for prompt in prompts]
        replace_attention(model, max_length=9 + NEW_TOKENS)
        generated = [generate(*prompt) for prompt in prompts]
    for ours, theirs in zip(generated, expected, strict=True):
        agree = (ours == theirs).sum().item()
        assert agree == theirs.numel(), f"{agree} of {theirs.numel()} tokens agree"
    # Our caches, emptied when the second sequence began, held its tokens (not its padding):
    # the prompt and every generated token but the last, which no call read.
    _, mask, tokens = prompts[-1]
    for layer in model.model.layers:
        assert isinstance(layer.self_attn, OurAttention)
        lengths = layer.self_attn.cache.lengths.tolist()
        assert lengths == (mask.sum(dim=1) + tokens - 1).tolist()


def test_phi3_generation_that_crosses_its_original_context_gives_transformers_logits():
    """Phi-3's LongRoPE rotates by its long factors past its original context: its
    generate recomputes the sequence where it crosses it, whose past_key_values are
    true then (the adapter's were false, and the cached keys kept the short factors:
    logits off by 1.4e-3)."""
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 100.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5],
        "long_factor": [2.0, 5.0],
    }
    model = causal_lm(
        "phi3", torch.float64, rope_parameters=longrope, original_max_position_embeddings=8
    )
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    greedy = {"do_sample": False, "max_new_tokens": 8, "min_new_tokens": 8}
    scores = {"output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        expected = model.generate(ids, **greedy, **scores).scores
        replace_attention(model, max_length=16)
        got = model.generate(ids, **greedy, **scores).scores
    for step, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        finite = theirs.isfinite()  # (the end token's -inf before min_new_tokens)
        assert torch.equal(ours.isfinite(), finite), f"step {step}"
        assert (ours - theirs)[finite].abs().max().item() <= 1e-7, f"step {step}"


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_float64_models_layers_hold_its_float64_weights(family):
    """Weights that float32 cannot hold (norms, sinks and biases drawn in float64) are
    our layers' own, to the bit: none passes through float32 on the way in."""
    from mha_multi.interop.llama import from_llama
    from mha_multi.torch import get_weights

    model = causal_lm(family, torch.float64)
    blocks = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():
        for block in blocks:
            for parameter in block.parameters():
                parameter.add_(torch.randn_like(parameter) * 1e-3)
    expected = [from_llama(block)[0] for block in blocks]
    replace_attention(model, max_length=12)
    for layer, weights in zip(model.model.layers, expected, strict=True):
        held = get_weights(layer.self_attn.layer)
        assert set(held) == set(weights)
        for name, value in weights.items():
            value = np.asarray(value)
            assert value.dtype == np.float64, name
            # (Not float32's: a pass through float32 would change them.)
            assert np.any(value.astype(np.float32).astype(np.float64) != value), name
            np.testing.assert_array_equal(np.asarray(held[name]), value, err_msg=name)


def test_what_the_adapter_does_not_support_is_refused():
    model = causal_lm("llama", torch.float64)
    blocks = [layer.self_attn for layer in model.model.layers]
    # An entry from_llama does not know, in the last layer: nothing is swapped.
    blocks[-1].register_parameter("head_scale", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(ValueError, match=r"unexpected Llama attention entries \['head_scale'\]"):
        replace_attention(model, max_length=16)
    assert [layer.self_attn for layer in model.model.layers] == blocks
    model = replace_attention(causal_lm("llama", torch.float64), max_length=16)
    ids, mask = left_padded(2, 5, seed=4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="beam search"):
            model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=3)
        with pytest.raises(ValueError, match="past_key_values is a StaticCache"):
            model.generate(ids, attention_mask=mask, cache_implementation="static")
        with pytest.raises(ValueError, match="output_attentions is not supported"):
            model(ids, attention_mask=mask, output_attentions=True)
        with pytest.raises(ValueError, match="2-D mask of the whole sequence"):
            model(ids, attention_mask=mask[:, :3])
        # Only the latest sequence continues: our caches hold no other.
        earlier = model(ids, attention_mask=mask).past_key_values
        model(ids, attention_mask=mask)
        longer = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        with pytest.raises(ValueError, match="stands for an earlier sequence"):
            model(ids[:, :1], attention_mask=longer, past_key_values=earlier)
        with pytest.raises(ValueError, match="cannot write|max_length"):
            model(torch.zeros(1, 17, dtype=torch.long))


def test_packed_sequences_give_transformers_logits():
    """A packed batch (restarting position ids, the block-causal mask) through Llama (eager)."""
    model = causal_lm("llama", torch.float32)
    model.config._attn_implementation = "eager"
    lengths = [[5, 4, 3], [7, 5]]
    positions = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    ids = torch.randint(3, 97, positions.shape, generator=torch.Generator().manual_seed(5))
    segments = torch.tensor([[s for s, n in enumerate(row) for _ in range(n)] for row in lengths])
    # The block-causal mask: a sequence's own positions up to the query's.
    causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))
    block = (segments[:, :, None] == segments[:, None, :]) & causal
    additive = torch.zeros(block.shape).masked_fill(~block, torch.finfo(torch.float32).min)
    with torch.no_grad():
        masked = model(ids, attention_mask=additive[:, None], position_ids=positions).logits
        packed = model(ids, position_ids=positions, use_cache=False).logits
        alone = [
            model(ids[b : b + 1, start : start + n]).logits[0]
            for b, row in enumerate(lengths)
            for start, n in zip(np.cumsum([0, *row[:-1]]), row, strict=True)
        ]
        replace_attention(model, max_length=12)
        ours = model(ids, position_ids=positions, use_cache=False).logits
    assert (ours - masked).abs().max().item() <= 1e-6
    assert (ours - packed).abs().max().item() <= 1e-6
    assert (ours.reshape(-1, ours.shape[-1]) - torch.cat(alone)).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    ("family", "cache"), [("gpt_oss", False), ("llama", True)], ids=["gpt_oss", "empty_cache"]
)
def test_rows_transformers_reads_as_one_sequence_stay_one(family, cache):
    """Restarting position ids pack sequences only where transformers packs them: not in
    gpt-oss' model (it builds its masks without the positions), nor beside a
    ``past_key_values``, even an empty one (transformers looks for packing without one
    alone). The layer packed both (off by 0.2)."""
    from transformers import DynamicCache

    model = causal_lm(family, torch.float32)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]] * 2)
    ids = torch.randint(3, 97, positions.shape, generator=torch.Generator().manual_seed(7))
    given = {"position_ids": positions, "use_cache": False}
    with torch.no_grad():
        if cache:
            given["past_key_values"] = DynamicCache(config=model.config)
        theirs = model(ids, **given).logits
        replace_attention(model, max_length=12)
        if cache:
            given["past_key_values"] = DynamicCache(config=model.config)
        ours = model(ids, **given).logits
    assert (ours - theirs).abs().max().item() <= 2e-5
