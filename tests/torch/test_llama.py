"""Llama-style attention (transformers) to and from canonical weights, against its own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.interop.llama import (
    from_llama,
    from_llama_state,
    llama_config,
    to_llama,
    to_llama_state,
)
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import set_weights
from mha_multi.weights import init_weights

transformers = pytest.importorskip("transformers")
from llama_support import llama_attention, llama_output  # noqa: E402
from transformers_blocks import MODELS  # noqa: E402
from transformers_blocks import block as transformers_block  # noqa: E402

# (num_heads, num_kv_heads, head_dim): GQA with a head size of its own, MQA, MHA. (transformers
# wants an even head_dim and a hidden_size that num_heads divides.)
HEADS = [(4, 2, 6), (4, 1, 8), (4, 4, 4)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
def test_llama_weights_give_the_module_output(num_heads, num_kv_heads, head_dim, bias, causal):
    module = llama_attention(num_heads, num_kv_heads, head_dim, bias=bias)
    weights, kwargs = from_llama(module)
    heads = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    assert {name: kwargs[name] for name in heads} == heads
    assert kwargs["rotary"] == {"theta": 10000.0, "fraction": 1.0}
    # The rotation is off in llama_output: the layer is built without it.
    x = np.random.default_rng(1).standard_normal((2, 5, 16))
    expected = llama_output(module, torch.from_numpy(x), causal=causal)
    output, _ = spec.reference_forward(
        weights, x, x, x, None, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal
    )
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-12)
    # Our layer, built with the module's heads, holds the converted weights as they are.
    layer = set_weights(backend.make_layer(16, dtype="float64", bias=bias, **heads), weights)
    ours = backend.forward(layer, *(3 * [torch.from_numpy(x)]), None, causal=causal)
    np.testing.assert_allclose(backend.to_numpy(ours), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
def test_canonical_weights_load_into_llama_and_back(num_heads, num_kv_heads, head_dim):
    weights = init_weights(
        16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=True, seed=3
    )
    weights = {name: value.astype(np.float64) for name, value in weights.items()}
    module = to_llama(weights, llama_attention(num_heads, num_kv_heads, head_dim, bias=True))
    x = np.random.default_rng(2).standard_normal((2, 4, 16))
    expected, _ = spec.reference_forward(weights, x, x, x, None, num_heads=num_heads)
    np.testing.assert_allclose(
        llama_output(module, torch.from_numpy(x), causal=False), expected, rtol=0, atol=1e-12
    )
    back = from_llama_state(to_llama_state(weights, num_heads=num_heads), num_heads=num_heads)
    assert all(back[name].tobytes() == weights[name].tobytes() for name in weights)


def test_query_key_value_biases_only_convert_with_a_zero_output_bias():
    module = llama_attention(4, 2, 6, bias=True)
    state = {k: v for k, v in module.state_dict().items() if k != "o_proj.bias"}
    weights = from_llama_state(state, num_heads=4)
    np.testing.assert_array_equal(weights["b_o"], 0.0)
    np.testing.assert_array_equal(weights["b_q"], module.q_proj.bias.detach().numpy())


def test_prefixed_model_state_dict():
    module = llama_attention(4, 2, 6, bias=False)
    prefix = "model.layers.3.self_attn."
    state = {prefix + k: v for k, v in module.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.zeros(3, 16)
    weights = from_llama_state(state, num_heads=4, prefix=prefix)
    np.testing.assert_array_equal(weights["W_k"], module.k_proj.weight.detach().numpy().T)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.pop("v_proj.weight"), "missing 'v_proj.weight'"),
        (
            lambda s: s.update(extra=torch.zeros(1)),
            r"unexpected Llama attention entries \['extra'\]",
        ),
        (lambda s: s.pop("q_proj.bias"), r"on \['k', 'o', 'v'\]"),
        (lambda s: s.update({"k_proj.weight": torch.zeros(5, 16)}), "not a multiple of head_dim"),
    ],
)
def test_bad_state_dicts_are_named(change, match):
    state = dict(llama_attention(4, 2, 6, bias=True).state_dict())
    change(state)
    with pytest.raises(ValueError, match=match):
        from_llama_state(state, num_heads=4)


def test_cross_attention_weights_have_no_llama_form():
    weights = init_weights(16, query_size=8, num_heads=4)
    with pytest.raises(ValueError, match="query_size, key_size, value_size and num_hiddens"):
        llama_config(weights, num_heads=4)


#: The sizes of :func:`small_block`'s blocks.
SMALL = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4}


def small_block(family: str, **options):
    """transformers' attention block of ``family`` (layer 0), small, random, float64, eval."""
    import importlib

    module = importlib.import_module(
        f"transformers.models.{family.lower()}.modeling_{family.lower()}"
    )
    config = getattr(module, f"{family}Config")(**SMALL, **options)
    # SDPA: the eager implementation takes no causal rule without a mask.
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = getattr(module, f"{family}Attention")(config, layer_idx=0).double().eval()
    return module, block


def test_a_block_of_interleaved_rotary_pairs_converts_with_them():
    """Cohere rotates entries ``2 i`` and ``2 i + 1`` together (its ``rotate_half``);
    the conversion takes the pairing from the block, and the layer gives the
    block's output at ragged positions. Read as Llama's half-split pairs, the
    same weights give another function."""
    module, block = small_block("Cohere", use_qk_norm=False)
    weights, kwargs = from_llama(block)
    assert kwargs["rotary"]["interleaved"] is True
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 5, 16)))
    positions = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    cos, sin = module.CohereRotaryEmbedding(block.config)(x, positions)
    with torch.no_grad():
        expected, _ = block(x, position_embeddings=(cos, sin), attention_mask=None)
    heads = {name: kwargs[name] for name in ("num_heads", "num_kv_heads")}

    def ours(rotary):
        output, _ = spec.reference_forward(
            weights, x, x, x, causal=True, positions=positions.numpy(), rotary=rotary, **heads
        )
        return output

    # The block rotates in float32 (its apply_rotary_pos_emb), the reference in float64.
    np.testing.assert_allclose(ours(kwargs["rotary"]), expected.numpy(), rtol=0, atol=2e-6)
    half_split = {**kwargs["rotary"], "interleaved": False}
    assert np.abs(ours(half_split) - expected.numpy()).max() > 1e-2


class _OwnLlamaAttention(torch.nn.Module):
    """A block of Llama's layout whose class transformers does not define."""

    def __init__(self) -> None:
        super().__init__()
        _, llama = small_block("Llama")
        self.config, self.scaling = llama.config, llama.scaling
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, getattr(llama, name))


def _llama_block_of_cohere_config():
    _, cohere = small_block("Cohere", use_qk_norm=False)
    _, llama = small_block("Llama")
    return type(llama)(cohere.config, layer_idx=0).double()


def _with_sinks():
    _, block = small_block("Llama")
    block.register_parameter("sinks", torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)))
    return block


def _gemma3_yarn_by_layer_type(truncate: bool):
    """Gemma 3's global block whose YaRN (its rotary settings by layer type) says
    ``truncate``, which transformers reads from the settings' top level alone."""
    from transformers.models.gemma3 import modeling_gemma3

    yarn = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0}
    config = modeling_gemma3.Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=2,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {
                **yarn,
                "original_max_position_embeddings": 64,
                "truncate": truncate,
            },
        },
    )
    return modeling_gemma3.Gemma3Attention(config, layer_idx=1).double()


def test_a_layer_types_yarn_truncate_transformers_reads_converts():
    """A layer type's ``truncate=True`` is what transformers computes anyway."""
    _, kwargs = from_llama(_gemma3_yarn_by_layer_type(True))
    assert kwargs["rotary"]["scaling"]["rope_type"] == "yarn"
    assert "truncate" not in kwargs["rotary"]["scaling"]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            # Granite's Llama-shaped block scales its scores by attention_multiplier.
            lambda: small_block("Granite")[1],
            "GraniteAttention is not an attention block from_llama knows",
        ),
        (_OwnLlamaAttention, "_OwnLlamaAttention is not an attention block from_llama knows"),
        (lambda: small_block("Cohere", use_qk_norm=True)[1], "use_qk_norm=True is not supported"),
        (
            lambda: small_block(
                "Llama",
                rope_parameters={"rope_type": "ntk_by_parts", "factor": 2.0, "rope_theta": 1e4},
            )[1],
            "rope_type 'ntk_by_parts' is not supported",
        ),
        (
            lambda: small_block(
                "Llama",
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 64,
                    "ramp_power": 2.0,
                },
            )[1],
            r"rope_parameters field\(s\) \['ramp_power'\] of rope_type 'yarn'",
        ),
        (
            # Llama's block rotates whole heads: a scaled rotary type's fewer frequencies
            # fail its forward.
            lambda: small_block(
                "Llama",
                rope_parameters={
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                },
            )[1],
            "partial_rotary_factor 0.5 with rope_type 'linear' is not supported",
        ),
        (
            lambda: _gemma3_yarn_by_layer_type(False),
            r"rope_parameters\['full_attention'\] sets truncate=False",
        ),
        (_with_sinks, r"unexpected Llama attention entries \['sinks'\]"),
        (
            # Only Gemma 2's blocks soft-cap: Llama's ignores the field.
            lambda: small_block("Llama", attn_logit_softcapping=0.5)[1],
            "attn_logit_softcapping=0.5 is not supported: transformers' 'llama' blocks do not "
            "read it",
        ),
        (
            # transformers rotates 4 entries by the frequencies of 3.
            lambda: small_block("Phi3", partial_rotary_factor=0.75)[1],
            "partial_rotary_factor 0.75 of head_dim 4 rotates 3 entries, an odd number",
        ),
        (_llama_block_of_cohere_config, "LlamaAttention with a config of model_type 'cohere'"),
    ],
    ids=[
        "unknown class",
        "not transformers' class",
        "qk norm",
        "unknown rotary type",
        "unknown field of a rotary type",
        "part of whole heads, scaled",
        "a layer type's truncate",
        "extra entry",
        "a field its block ignores",
        "odd rotated entries",
        "another model's config",
    ],
)
def test_a_block_from_llama_does_not_know_is_refused(make, match):
    """A block of a class, or with a config field or a state-dict entry, that the
    converter does not know raises a ValueError naming it: no conversion is returned."""
    block = make()
    converted = None
    with pytest.raises(ValueError, match=match):
        converted = from_llama(block)
    assert converted is None


@pytest.mark.parametrize("layout", [None, "phi3"])
@pytest.mark.parametrize("head_dim", [8, 32])
def test_a_block_of_the_layers_own_scale_converts_its_weights_as_they_are(head_dim, layout):
    """``head_dim ** -0.5 * sqrt(head_dim)`` rounds to ``1 + 2**-52`` for these sizes:
    the block's scale is still the layer's, nothing is folded, and its weights convert
    as they are, dtype included, both ways (a fold returned ``W_q`` in float64, scaled)."""
    module = llama_attention(2, 1, head_dim, bias=False, hidden_size=16).float()
    assert module.scaling * np.sqrt(head_dim) != 1.0
    weights, _ = from_llama(module)
    native = module.q_proj.weight.detach().numpy().T
    assert weights["W_q"].dtype == np.float32 and weights["W_q"].tobytes() == native.tobytes()
    from_state = from_llama_state(module.state_dict(), num_heads=2)
    assert all(from_state[name].tobytes() == weights[name].tobytes() for name in weights)
    state = to_llama_state(weights, num_heads=2, layout=layout)
    entry = "qkv_proj.weight" if layout else "q_proj.weight"
    assert state[entry].dtype == torch.float32
    if layout is None:
        assert torch.equal(state[entry], module.q_proj.weight.detach())


@pytest.mark.parametrize("model", [name for name in MODELS if name != "bloom"])
def test_every_known_block_takes_its_weights_back(model):
    """``to_llama(from_llama(block)[0], fresh)`` gives ``block``'s state: what the way in
    folds into the weights (Gemma's score scale, into ``W_q`` or ``q_norm``) the way
    back takes out (it was loaded folded: Gemma 2's queries scaled twice)."""
    block, _ = transformers_block(model)
    weights, _ = from_llama(block)
    fresh, _ = transformers_block(model, seed=1)
    assert not all(torch.equal(fresh.state_dict()[n], t) for n, t in block.state_dict().items())
    to_llama(weights, fresh)
    for name, tensor in block.state_dict().items():
        np.testing.assert_allclose(
            fresh.state_dict()[name].numpy(), tensor.numpy(), rtol=1e-15, atol=1e-15, err_msg=name
        )
