"""Fused projections (Phi-3's ``qkv_proj``) split into canonical weights and joined back.

The rows of ``qkv_proj.weight`` are the query's ``num_heads * head_dim``,
then the key's and the value's ``num_kv_heads * head_dim`` (transformers'
``Phi3Attention.forward`` slices them so); the tests take those slices by
hand, run transformers' own block in float64, and check that every way in
and out (module, state dict, file, command line) is bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.__main__ import main
from mha_multi.interop import load
from mha_multi.interop.llama import (
    from_llama,
    from_llama_state,
    load_llama,
    save_llama,
    to_llama,
    to_llama_state,
)
from mha_multi.weights import init_weights, load_weights

transformers = pytest.importorskip("transformers")
from transformers.models.phi3 import modeling_phi3  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 4


def phi3_block(*, seed: int = 0, **options) -> torch.nn.Module:
    """transformers' ``Phi3Attention``, small, random, float64, eval."""
    config = modeling_phi3.Phi3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        **options,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return modeling_phi3.Phi3Attention(config, layer_idx=0).double().eval()


def fused_state(*, bias: bool) -> dict[str, torch.Tensor]:
    """A Phi-3 block's state dict; with ``bias``, as a family with biases would have it."""
    state = dict(phi3_block().state_dict())
    if bias:
        generator = torch.Generator().manual_seed(4)
        rows = state["qkv_proj.weight"].shape[0]
        state["qkv_proj.bias"] = torch.randn(rows, generator=generator, dtype=torch.float64)
        state["o_proj.bias"] = torch.randn(HIDDEN, generator=generator, dtype=torch.float64)
    return state


def test_a_phi3_block_converts_and_gives_its_output():
    block = phi3_block(partial_rotary_factor=0.5, sliding_window=3)
    weights, kwargs = from_llama(block)
    assert kwargs == {
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rotary": {"theta": 10000.0, "fraction": 0.5},
        "window": 3,
    }
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 6, HIDDEN)))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    mask = torch.from_numpy(np.where((j <= i) & (i - j < 3), 0.0, -1e30))[None, None]
    rotary = modeling_phi3.Phi3RotaryEmbedding(block.config).double()
    with torch.no_grad():
        expected, _ = block(x, rotary(x, positions), attention_mask=mask.expand(2, 1, 6, 6))
    heads = {name: kwargs[name] for name in ("num_heads", "num_kv_heads")}
    output, _ = spec.reference_forward(
        weights,
        x.numpy(),
        x.numpy(),
        x.numpy(),
        causal=True,
        positions=positions.numpy(),
        rotary=kwargs["rotary"],
        window=kwargs["window"],
        **heads,
    )
    # The block rotates in float32 (its rotary embedding), the reference in float64.
    np.testing.assert_allclose(output, expected.numpy(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_state_dict_to_canonical_and_back_is_bit_exact(bias):
    state = fused_state(bias=bias)
    weights = from_llama_state(state, num_heads=HEADS)
    query, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    rows = state["qkv_proj.weight"].numpy()
    parts = (rows[:query], rows[query : query + kv], rows[query + kv :])
    for name, part in zip("qkv", parts, strict=True):
        assert weights[f"W_{name}"].tobytes() == part.T.copy().tobytes()
    if bias:
        np.testing.assert_array_equal(weights["b_k"], state["qkv_proj.bias"][query : query + kv])
    back = to_llama_state(weights, num_heads=HEADS, layout="phi3")
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_canonical_weights_load_into_a_phi3_block():
    weights = init_weights(
        HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, bias=False, seed=2
    )
    block = to_llama(weights, phi3_block(seed=7))
    assert set(block.state_dict()) == {"qkv_proj.weight", "o_proj.weight"}
    back = from_llama_state(block.state_dict(), num_heads=HEADS)
    # float32 weights into a float64 block, and back: the same values.
    assert all(np.array_equal(back[name], weights[name]) for name in weights)
    # Phi-3 has no biases: weights that have them are refused, the block untouched.
    biased = init_weights(
        HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, bias=True, seed=2
    )
    before = {name: tensor.clone() for name, tensor in block.state_dict().items()}
    with pytest.raises(ValueError, match=r"the weights give \['o_proj.bias', 'o_proj.weight', "):
        to_llama(biased, block)
    assert all(torch.equal(block.state_dict()[name], before[name]) for name in before)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_fused_files_read_by_load_llama_and_the_command_line(tmp_path, suffix):
    state = fused_state(bias=False)
    prefix = "model.layers.0.self_attn."
    checkpoint = tmp_path / f"phi3{suffix}"
    if suffix == ".pt":
        torch.save({prefix + name: tensor for name, tensor in state.items()}, checkpoint)
    else:
        from safetensors.torch import save_file

        save_file({prefix + name: tensor for name, tensor in state.items()}, checkpoint)
    expected = from_llama_state(state, num_heads=HEADS)
    # Any one head option fixes the layout; the fused rows split by o_proj's columns.
    for options in ({"num_heads": HEADS}, {"num_kv_heads": KV_HEADS}, {"head_dim": HEAD_DIM}):
        weights = load_llama(checkpoint, **options)
        assert all(weights[name].tobytes() == expected[name].tobytes() for name in expected)
    assert load(checkpoint, num_heads=HEADS).keys() == expected.keys()
    canonical = tmp_path / "canonical.npz"
    assert main(["convert", str(checkpoint), str(canonical), "--head-dim", str(HEAD_DIM)]) == 0
    converted = load_weights(canonical)
    assert all(converted[name].tobytes() == expected[name].tobytes() for name in expected)
    # Written back in Phi-3's layout: the block's own state dict, bit for bit.
    written = tmp_path / f"written{suffix}"
    save_llama(written, converted, num_heads=HEADS, layout="phi3")
    if suffix == ".pt":
        back = torch.load(written, weights_only=True)
    else:
        from safetensors.torch import load_file

        back = load_file(written)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], state[name]) for name in state)


def _with(change):
    state = fused_state(bias=False)
    change(state)
    return state


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            _with(lambda s: s.update({"qkv_proj.lora_A": torch.zeros(2, HIDDEN)})),
            r"unexpected Llama attention entries \['qkv_proj.lora_A'\]",
        ),
        (
            _with(lambda s: s.update(extra=torch.zeros(1))),
            r"unexpected Llama attention entries \['extra'\]",
        ),
        (
            _with(lambda s: s.update({"qkv_proj.weight": s["qkv_proj.weight"][:-1]})),
            "qkv_proj.weight has 31 rows, which a query part of 16 rows",
        ),
        (
            _with(lambda s: s.update({"qkv_proj.weight": s["qkv_proj.weight"][:12]})),
            "qkv_proj.weight has 12 rows, which a query part of 16 rows",
        ),
        (
            _with(lambda s: s.update({"qkv_proj.bias": torch.zeros(31)})),
            "qkv_proj.bias has 31 rows",
        ),
        (
            _with(lambda s: s.update({"k_proj.weight": torch.zeros(8, HIDDEN)})),
            r"also has \['k_proj.weight'\]",
        ),
        (_with(lambda s: s.pop("o_proj.weight")), "which the state dict is missing"),
    ],
    ids=[
        "extra entry of qkv_proj",
        "extra entry",
        "odd rows",
        "too few rows",
        "bias",
        "both",
        "no o",
    ],
)
def test_a_fused_state_dict_that_does_not_split_is_refused(state, match):
    weights = None
    with pytest.raises(ValueError, match=match):
        weights = from_llama_state(state, num_heads=HEADS)
    assert weights is None


def test_a_phi3_block_with_an_unknown_entry_or_layout_is_refused():
    block = phi3_block()
    block.register_parameter(
        "head_scale", torch.nn.Parameter(torch.ones(HEADS, dtype=torch.float64))
    )
    converted = None
    with pytest.raises(ValueError, match=r"unexpected Llama attention entries \[.head_scale.\]"):
        converted = from_llama(block)
    assert converted is None
    weights = from_llama_state(fused_state(bias=False), num_heads=HEADS)
    with pytest.raises(ValueError, match="unknown fused layout 'gpt2'; the fused layouts are phi3"):
        to_llama_state(weights, num_heads=HEADS, layout="gpt2")
