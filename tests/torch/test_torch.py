"""What only the PyTorch backend has: autograd checks, torch.compile, lazy sizes, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import gpu_required
from mha_multi import spec
from mha_multi.parity.cases import CASES, build_case
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.weights import init_weights


def layer_for(case, **kwargs):
    layer = MultiHeadAttention(
        case.config.num_hiddens, case.config.num_heads, bias=case.config.bias, **kwargs
    )
    return set_weights(layer, case.weights)


def tensors(case, dtype=torch.float32, device="cpu"):
    return [
        torch.tensor(case.inputs[n], dtype=dtype, device=device)
        for n in ("queries", "keys", "values")
    ]


def lens(case, device="cpu"):
    return None if case.valid_lens is None else torch.tensor(case.valid_lens, device=device)


@pytest.mark.parametrize("name", ["lens_2d", "causal_cross", "cross_sizes", "lens_zero"])
def test_gradcheck_float64(name):
    case = build_case(next(c for c in CASES if c.name == name))
    layer = layer_for(case).double()
    inputs = [t.requires_grad_(True) for t in tensors(case, torch.float64)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: layer(q, k, v, lens(case), causal=case.config.causal), inputs
    )


def test_lazy_sizes_are_inferred_on_first_call():
    layer = MultiHeadAttention(12, 3)
    with pytest.raises(ValueError, match="query_size, key_size, value_size not known yet"):
        get_weights(layer)
    q, k, v = (torch.randn(2, 3, 7), torch.randn(2, 5, 4), torch.randn(2, 5, 6))
    assert layer(q, k, v).shape == (2, 3, 12)
    assert layer.input_sizes() == {"query_size": 7, "key_size": 4, "value_size": 6}
    assert get_weights(layer)["W_v"].shape == (6, 12)
    with pytest.raises(ValueError, match="queries last dimension must be query_size=7"):
        layer(torch.randn(2, 3, 8), k, v)


def test_set_weights_fixes_lazy_sizes():
    case = build_case(next(c for c in CASES if c.name == "cross_sizes"))
    layer = layer_for(case)  # lazy, sizes come from the weights
    assert layer.input_sizes() == {"query_size": 7, "key_size": 5, "value_size": 3}
    out = layer(*tensors(case), lens(case))
    np.testing.assert_allclose(out.detach().numpy(), case.reference["output"], atol=5e-6)


def test_state_dict_uses_d2l_names():
    layer = MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    assert sorted(layer.state_dict()) == sorted(
        f"W_{p}.{t}" for p in "qkvo" for t in ("weight", "bias")
    )
    weights = get_weights(layer)
    np.testing.assert_array_equal(weights["W_q"], layer.W_q.weight.detach().numpy().T)


def test_dtype_mismatch_is_a_clear_error():
    layer = MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    x = torch.randn(1, 2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="queries dtype torch.float64 differs from the layer's"):
        layer(x, x.float(), x.float())
    with pytest.raises(TypeError, match="keys must be a floating-point tensor"):
        layer(x.float(), x.long(), x.float())


def test_valid_lens_accepts_lists_and_numpy():
    case = build_case(next(c for c in CASES if c.name == "lens_1d"))
    layer = layer_for(case)
    expected = case.reference["output"]
    for valid_lens in (case.valid_lens.tolist(), case.valid_lens, lens(case)):
        out = layer(*tensors(case), valid_lens)
        np.testing.assert_allclose(out.detach().numpy(), expected, atol=5e-6)


@pytest.mark.parametrize("name", ["book", "causal_lens_2d", "lens_1d_float"])
def test_torch_compile_matches_reference(name):
    case = build_case(next(c for c in CASES if c.name == name))
    layer = layer_for(case)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        out, weights = compiled(
            *tensors(case), lens(case), causal=case.config.causal, return_attention_weights=True
        )
    np.testing.assert_allclose(out.numpy(), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(weights.numpy(), case.reference["attention_weights"], atol=5e-6)


def test_autocast_bfloat16_softmax_is_float32_safe():
    layer = MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    weights = get_weights(layer)
    q, k, v = (torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8))
    valid_lens = torch.tensor([0, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(q, k, v, valid_lens)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    expected, _ = spec.reference_forward(weights, q, k, v, valid_lens.numpy(), num_heads=2)
    np.testing.assert_allclose(out.detach().float().numpy(), expected, atol=2e-2)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        if gpu_required():
            pytest.fail("no CUDA device, and MHA_MULTI_REQUIRE_GPU is set")
        pytest.skip("no CUDA device")
    return torch.device("cuda")


def test_cuda_with_valid_lens_on_either_device(cuda):
    case = build_case(next(c for c in CASES if c.name == "lens_2d"))
    layer = layer_for(case, device=cuda)
    for valid_lens in (lens(case), lens(case, cuda)):
        out = layer(*tensors(case, device=cuda), valid_lens)
        assert out.device.type == "cuda"
        np.testing.assert_allclose(out.detach().cpu().numpy(), case.reference["output"], atol=5e-6)


def test_weights_round_trip_on_cuda(cuda):
    weights = init_weights(8, bias=True, seed=2)
    layer = set_weights(MultiHeadAttention(8, 2, bias=True, device=cuda), weights)
    assert layer.W_q.weight.device.type == "cuda"
    got = get_weights(layer)
    assert all(got[k].tobytes() == weights[k].tobytes() for k in weights)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records the keyword arguments of every scaled_dot_product_attention call."""
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize(
    ("name", "mask", "is_causal"),
    [
        ("lens_none", False, False),
        ("lens_overlong", False, False),  # every length >= K: no mask, flash may run
        ("lens_1d", True, False),
        ("lens_zero", True, False),
        ("causal", False, True),  # Q == K: SDPA's own causal flag
        ("causal_cross", True, False),  # bottom-right alignment needs a mask
    ],
)
def test_default_call_takes_the_fused_path(sdpa_calls, name, mask, is_causal):
    case = build_case(next(c for c in CASES if c.name == name))
    layer = layer_for(case).eval()
    out = layer(*tensors(case), lens(case), causal=case.config.causal)
    assert len(sdpa_calls) == 1
    assert (sdpa_calls[0]["attn_mask"] is not None) == mask
    assert sdpa_calls[0]["is_causal"] == is_causal
    np.testing.assert_allclose(out.detach().numpy(), case.reference["output"], atol=5e-6)
    layer(*tensors(case), lens(case), causal=case.config.causal, return_attention_weights=True)
    assert len(sdpa_calls) == 1  # the weights come from the generic path


def test_dropout_with_possibly_hidden_rows_takes_the_generic_path(sdpa_calls):
    case = build_case(next(c for c in CASES if c.name == "lens_zero"))
    layer = layer_for(case, dropout=0.5).train()
    layer(*tensors(case), lens(case))
    assert sdpa_calls == []
    layer(*tensors(case))
    assert len(sdpa_calls) == 1 and sdpa_calls[0]["dropout_p"] == 0.5


@pytest.mark.parametrize("name", ["lens_zero", "causal_more_queries", "lens_overlong"])
def test_torch_compile_fused_path_matches_reference(name):
    case = build_case(next(c for c in CASES if c.name == name))
    compiled = torch.compile(layer_for(case).eval(), fullgraph=True)
    with torch.no_grad():
        out = compiled(*tensors(case), lens(case), causal=case.config.causal)
    np.testing.assert_allclose(out.numpy(), case.reference["output"], atol=5e-6)


@pytest.mark.parametrize("shared", ["qkv", "kv", "qk"])
def test_shared_inputs_project_in_one_product(shared):
    case = build_case(next(c for c in CASES if c.name == "bias"))
    layer = layer_for(case).eval()
    x = torch.tensor(case.inputs["queries"][:, :5])
    lens = torch.tensor([3, 5, 0])
    q, k, v = {"qkv": (x, x, x), "kv": (x[:, :2], x, x), "qk": (x, x, x[:, :5] * 2)}[shared]
    expected, _ = spec.reference_forward(case.weights, q, k, v, lens, num_heads=4)
    with torch.no_grad():
        out = layer(q, k, v, lens)
    np.testing.assert_allclose(out.numpy(), expected, atol=5e-6)
    grads = torch.autograd.grad(layer(q.requires_grad_(), k, v, lens).sum(), layer.W_k.weight)
    reference = spec.reference_gradients(
        case.weights,
        q.detach(),
        k.detach(),
        v.detach(),
        lens,
        num_heads=4,
        output_gradient=np.ones(expected.shape),
    )
    np.testing.assert_allclose(grads[0].T.numpy(), reference["W_k"], atol=5e-5)
