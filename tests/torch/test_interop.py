"""Weights to and from torch.nn.MultiheadAttention and d2l's torch layer."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch_support import runner as runner

from mha_multi import spec
from mha_multi.interop.torch import (
    from_torch_d2l,
    from_torch_d2l_state,
    from_torch_mha,
    from_torch_mha_state,
    key_padding_mask,
    to_torch_d2l,
    to_torch_d2l_state,
    to_torch_mha,
    to_torch_mha_state,
)
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.weights import init_weights


def native_output(runner, case):
    """``torch.nn.MultiheadAttention`` holding the case's weights, on its inputs and padding."""
    module = backend.native_layer(case.weights, case.config.num_heads)
    kwargs = {}
    if case.valid_lens is not None:
        kwargs["key_padding_mask"] = key_padding_mask(case.valid_lens, case.config.num_keys)
    with torch.no_grad():
        out, _ = module(
            *(runner.to_native(case.inputs[n]) for n in INPUT_NAMES), need_weights=False, **kwargs
        )
    return runner.to_numpy(out)


@pytest.mark.parametrize("name", ["book", "bias", "lens_1d", "lens_none", "one_head"])
def test_native_layer_matches_reference(runner, cases, name):
    case = cases[name]
    np.testing.assert_allclose(
        native_output(runner, case), case.reference["output"], rtol=0, atol=5e-6
    )


def test_separate_projections_when_key_value_sizes_differ():
    weights = init_weights(12, key_size=5, value_size=3, bias=True, seed=4)
    state = to_torch_mha_state(weights)
    assert {"q_proj_weight", "k_proj_weight", "v_proj_weight"} <= set(state)
    module = to_torch_mha(weights, 3)
    assert not module._qkv_same_embed_dim
    back = from_torch_mha(module)
    assert all(back[k].tobytes() == weights[k].tobytes() for k in weights)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 12)).astype(np.float32)
    k = rng.standard_normal((2, 6, 5)).astype(np.float32)
    v = rng.standard_normal((2, 6, 3)).astype(np.float32)
    ours = set_weights(MultiHeadAttention(12, 3, bias=True), weights).eval()
    with torch.no_grad():
        expected = ours(*map(torch.tensor, (q, k, v)), torch.tensor([6, 2])).numpy()
        native, _ = module(
            *map(torch.tensor, (q, k, v)),
            key_padding_mask=key_padding_mask([6, 2], 6),
            need_weights=False,
        )
    np.testing.assert_allclose(native.numpy(), expected, atol=5e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_round_trip_through_native_module_is_bit_exact(bias):
    module = torch.nn.MultiheadAttention(16, 4, bias=bias, batch_first=False)
    weights = from_torch_mha(module)
    again = to_torch_mha(weights, 4, batch_first=False)
    for name, tensor in module.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_unsupported_native_options_are_refused():
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch_mha(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch_mha(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="query_size == embed_dim"):
        to_torch_mha(init_weights(8, query_size=5), 2)
    state = torch.nn.MultiheadAttention(8, 2).state_dict()
    state["in_proj_weight"] = state["in_proj_weight"][:16]
    with pytest.raises(ValueError, match="in_proj_weight must have shape"):
        from_torch_mha_state(state)
    state = torch.nn.MultiheadAttention(8, 2).state_dict()
    with pytest.raises(ValueError, match=re.escape("in_proj_bias must have shape (24,)")):
        from_torch_mha_state({**state, "in_proj_bias": torch.zeros(25)})
    with pytest.raises(ValueError, match=r"holds in_proj_weight and \['q_proj_weight'\]"):
        from_torch_mha_state({**state, "q_proj_weight": torch.zeros(8, 8)})


def test_what_is_no_state_or_module_is_named():
    with pytest.raises(TypeError, match="state_dict must be a mapping of names to arrays; got"):
        from_torch_mha_state(None)
    with pytest.raises(TypeError, match="state_dict must be a mapping of names to arrays; got"):
        from_torch_d2l_state([1, 2])
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention; got dict"):
        from_torch_mha({})
    with pytest.raises(TypeError, match="^module must be a torch.nn.Module; got NoneType"):
        from_torch_d2l(None)
    with pytest.raises(TypeError, match="^module must be a torch.nn.Module; got NoneType"):
        to_torch_d2l(init_weights(8), None)


def test_separate_projections_of_other_shapes_than_torchs_are_named():
    """torch.nn.MultiheadAttention's q_proj_weight is (embed_dim, embed_dim): one of 6
    rows was blamed on in_proj_bias or W_o, one of 5 columns taken."""
    state = torch.nn.MultiheadAttention(8, 2, kdim=3, vdim=4).state_dict()
    for shape in ((6, 8), (8, 5)):
        wrong = {**state, "q_proj_weight": torch.zeros(shape)}
        expected = re.escape("q_proj_weight must have shape (embed_dim, embed_dim) with ")
        with pytest.raises(ValueError, match=f"^{expected}.*got {re.escape(str(shape))}$"):
            from_torch_mha_state(wrong)


def test_the_native_heads_are_checked_as_the_layer_checks_them():
    """torch's own check is an assert (and takes a bool as 1 head)."""
    weights = init_weights(8, num_heads=2)
    with pytest.raises(ValueError, match=r"num_hiddens \(8\) must be divisible by num_heads"):
        to_torch_mha(weights, 3)
    with pytest.raises(TypeError, match="num_heads must be a positive int; got True"):
        to_torch_mha(weights, True)


def test_fully_hidden_rows_differ_from_native_by_design(runner, cases):
    # The spec: a query that sees no key gets uniform weights (the mean of all
    # values); torch's layer gives NaN or zeros there. Visible rows agree.
    case = cases["lens_zero"]  # valid_lens [0, -2, 3]
    native = native_output(runner, case)
    np.testing.assert_allclose(native[2], case.reference["output"][2], atol=5e-6)
    hidden = native[:2]
    assert np.all(np.isnan(hidden) | (hidden == 0))
    assert np.all(np.isfinite(case.reference["output"][:2]))


def test_torch_d2l_state_round_trip():
    weights = init_weights(10, query_size=3, bias=True, seed=1)
    state = to_torch_d2l_state(weights)
    layer = MultiHeadAttention(10, 2, bias=True)
    layer.load_state_dict(state)  # d2l's names are ours
    got = get_weights(layer)
    assert all(got[k].tobytes() == weights[k].tobytes() for k in weights)
    back = from_torch_d2l_state(layer.state_dict())
    assert all(back[k].tobytes() == weights[k].tobytes() for k in weights)
    with pytest.raises(ValueError, match="unexpected entry 'attention.x'"):
        from_torch_d2l_state({**state, "attention.x": torch.zeros(1)})


def test_torch_d2l_layer_round_trip_and_strict_loading():
    weights = init_weights(10, key_size=4, bias=True, seed=2)
    layer = to_torch_d2l(weights, MultiHeadAttention(10, 2, bias=True).double())
    assert layer.W_k.weight.dtype == torch.float64  # the layer's dtype is kept
    back = from_torch_d2l(layer.float())
    assert all(back[k].tobytes() == weights[k].tobytes() for k in weights)
    with pytest.raises(ValueError, match="do not fit MultiHeadAttention.*Unexpected key"):
        to_torch_d2l(weights, MultiHeadAttention(10, 2, bias=False))
    with pytest.raises(ValueError, match="do not fit MultiHeadAttention.*size mismatch"):
        to_torch_d2l(init_weights(10, key_size=6, bias=True), layer)


@pytest.mark.parametrize(
    ("heads", "match"),
    [
        ({"num_kv_heads": 2}, "has no grouped key/value heads"),
        ({"num_kv_heads": 1}, "has no grouped key/value heads"),
        ({"head_dim": 3}, "has no head size of its own"),
    ],
)
def test_heads_the_native_layer_lacks_are_refused(heads, match):
    weights = init_weights(8, num_heads=4, bias=True, **heads)
    for convert in (to_torch_mha_state, lambda w: to_torch_mha(w, 4)):
        with pytest.raises(ValueError, match=match):
            convert(weights)


def test_grouped_torch_d2l_state_loads_with_the_widths_of_its_weights(cases):
    case = cases["head_dim"]  # 4 query heads of size 3 read 2 key/value heads
    state = to_torch_d2l_state(case.weights)
    assert state["W_k.weight"].shape == (6, 10) and state["W_o.weight"].shape == (10, 12)
    back = from_torch_d2l_state(state)
    assert all(back[k].tobytes() == case.weights[k].tobytes() for k in case.weights)
    layer = MultiHeadAttention(10, 4, bias=True, num_kv_heads=2, head_dim=3)
    layer = to_torch_d2l(case.weights, layer)
    got = get_weights(layer)
    assert all(got[k].tobytes() == case.weights[k].tobytes() for k in case.weights)
    with pytest.raises(ValueError, match="do not fit MultiHeadAttention.*size mismatch"):
        to_torch_d2l(case.weights, MultiHeadAttention(10, 2, bias=True, query_size=6))


def test_the_benchmarks_grouped_baseline_holds_canonical_weights(runner):
    from mha_multi.bench.torch import SDPALayer

    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=5)
    module = to_torch_d2l(weights, SDPALayer(16, 4, 2)).eval()
    x = np.random.default_rng(5).standard_normal((2, 6, 16)).astype(np.float32)
    lens = np.array([6, 3])
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=4)
    with torch.no_grad():
        output = module(runner.to_native(x), key_padding_mask(lens, 6))
    np.testing.assert_allclose(runner.to_numpy(output), expected, rtol=0, atol=5e-6)
