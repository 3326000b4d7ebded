"""What only the PyTorch backend has: autograd checks, torch.compile, lazy sizes, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import gpu_required
from mha_multi import spec
from mha_multi.parity.cases import CASES, build_case
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.torch._ops import OPS
from mha_multi.torch.layer import _linear
from mha_multi.weights import init_weights


@pytest.fixture
def compiler():
    """``torch.compile`` with dynamo's caches emptied.

    Every layer shares ``forward``'s code object, whose compilations are
    limited per process; the tests here compile it for many shapes.
    """
    torch._dynamo.reset()
    yield torch.compile
    torch._dynamo.reset()


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
def test_torch_compile_matches_reference(name, compiler):
    case = build_case(next(c for c in CASES if c.name == name))
    layer = layer_for(case)
    compiled = compiler(layer, fullgraph=True)
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
        calls.append({**kwargs, "dtypes": [x.dtype for x in args]})
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
def test_torch_compile_default_call_matches_reference(name, compiler):
    case = build_case(next(c for c in CASES if c.name == name))
    compiled = compiler(layer_for(case).eval(), fullgraph=True)
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


# -- edge inputs beyond tests/backends/test_edges.py --------------------------


def edge_layer():
    weights = init_weights(8, bias=True, seed=4)
    return weights, set_weights(MultiHeadAttention(8, 2, bias=True), weights).eval()


def edge_inputs(num_queries=3, num_keys=5, batch=2):
    rng = np.random.default_rng(4)
    return [rng.standard_normal((batch, n, 8)) for n in (num_queries, num_keys, num_keys)]


def assert_same_nonfinite_pattern(got, expected):
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=5e-6)


@pytest.mark.parametrize("where", ["query", "W_q", "hidden_key"])
def test_nonfinite_projections_take_the_generic_path(sdpa_calls, where):
    """Without lengths SDPA's CPU kernel returned zeros for a NaN query row."""
    weights, layer = edge_layer()
    queries, keys, values = edge_inputs()
    valid_lens = None
    if where == "query":
        queries[0, 1, 2] = np.nan
    elif where == "W_q":
        weights = {**weights, "W_q": weights["W_q"].copy()}
        weights["W_q"][3, 0] = np.inf
        set_weights(layer, weights)
    else:
        keys[0, 4, 1] = np.inf
        valid_lens = np.array([3, 5])
    expected, _ = spec.reference_forward(weights, queries, keys, values, valid_lens, num_heads=2)
    with torch.no_grad():
        out = layer(
            *(torch.tensor(x, dtype=torch.float32) for x in (queries, keys, values)), valid_lens
        )
    assert sdpa_calls == []
    assert_same_nonfinite_pattern(out.numpy(), expected)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_empty_axes_take_the_generic_path(sdpa_calls, shape):
    batch, num_queries, num_keys = shape
    weights, layer = edge_layer()
    inputs = edge_inputs(num_queries, num_keys, batch)
    expected, _ = spec.reference_forward(weights, *inputs, np.ones(batch), num_heads=2)
    with torch.no_grad():
        out = layer(*(torch.tensor(x, dtype=torch.float32) for x in inputs), torch.ones(batch))
    assert sdpa_calls == []
    assert out.shape == expected.shape
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_products_accumulate_in_float32_by_construction(dtype):
    """On CPU every 16-bit product is the float32 product of the same numbers, rounded once."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 64, 256, generator=generator).to(dtype) for _ in range(2))
    weight, bias = torch.randn(32, 256, generator=generator).to(dtype), torch.randn(32).to(dtype)
    product = OPS.matmul(a, b.transpose(1, 2))
    assert product.dtype == dtype
    assert torch.equal(product, (a.float() @ b.float().transpose(1, 2)).to(dtype))
    linear = _linear(a, weight, bias)
    assert torch.equal(
        linear, torch.nn.functional.linear(a.float(), weight.float(), bias.float()).to(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_fused_path_runs_sdpa_on_float32_copies_on_cpu(sdpa_calls, dtype):
    case = build_case(next(c for c in CASES if c.name == "lens_1d"))
    layer = layer_for(case).to(dtype).eval()
    with torch.no_grad():
        out = layer(*tensors(case, dtype), lens(case))
    assert len(sdpa_calls) == 1 and sdpa_calls[0]["dtypes"] == 3 * [torch.float32]
    assert out.dtype == dtype
    np.testing.assert_allclose(out.float().numpy(), case.reference["output"], atol=2e-2)


def test_autocast_rounds_operands_once_and_keeps_float32_scores():
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(4, 5, 64, generator=generator), torch.randn(16, 64, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        projected = _linear(x, weight, None)
        scores = OPS.matmul(x, x.transpose(1, 2))
    expected = torch.nn.functional.linear(x.bfloat16().float(), weight.bfloat16().float())
    assert torch.equal(projected, expected.bfloat16())
    assert scores.dtype == torch.float32  # the spec's float32 scores, not lowered
    assert torch.equal(scores, x @ x.transpose(1, 2))


@pytest.mark.parametrize(
    "valid_lens",
    [
        np.array([100, 250], np.uint8),
        torch.tensor([100, -3], dtype=torch.int8),
        torch.tensor([2**63 + 5, 150], dtype=torch.uint64),
        np.array([2**63 + 5, 150], np.uint64),
        [2**63 + 5, 150],
    ],
    ids=["uint8", "int8", "uint64_tensor", "uint64_numpy", "list"],
)
def test_integer_lengths_are_compared_in_int64(valid_lens):
    """Narrow lengths are widened before meeting key positions up to 199 (int8 wraps at 128)."""
    weights, layer = edge_layer()
    inputs = edge_inputs(2, 200)
    as_int64 = np.array(
        valid_lens.tolist() if hasattr(valid_lens, "tolist") else valid_lens, dtype=object
    )
    as_int64 = np.clip(as_int64, -1, 200).astype(np.int64)
    expected, expected_weights = spec.reference_forward(weights, *inputs, as_int64, num_heads=2)
    tensors_ = [torch.tensor(x, dtype=torch.float32) for x in inputs]
    with torch.no_grad():
        out = layer(*tensors_, valid_lens)
        generic, attention_weights = layer(*tensors_, valid_lens, return_attention_weights=True)
    for got in (out, generic):
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(attention_weights.numpy(), expected_weights, rtol=0, atol=5e-6)


COMPILED_EDGES = {
    "nan_query": (lambda q, k, v: q.__setitem__((0, 1, 2), np.nan), None),
    "inf_in_hidden_key": (lambda q, k, v: k.__setitem__((0, 4, 1), np.inf), np.array([3, 5])),
    "nan_lengths": (lambda q, k, v: None, np.array([np.nan, 0.0])),
    "uint64_lengths": (lambda q, k, v: None, np.array([2**63 + 5, 2], np.uint64)),
}


@pytest.mark.parametrize("name", sorted(COMPILED_EDGES))
def test_torch_compile_edge_inputs_match_reference(name, compiler):
    """Compiled graphs cannot branch on values; the path they take must be exact for any."""
    edit, valid_lens = COMPILED_EDGES[name]
    weights, layer = edge_layer()
    inputs = edge_inputs()
    edit(*inputs)
    reference_lens = None if valid_lens is None else np.clip(valid_lens, None, 5)
    compiled = compiler(layer, fullgraph=True)
    tensors_ = [torch.tensor(x, dtype=torch.float32) for x in inputs]
    for causal in (False, True):
        expected, _ = spec.reference_forward(
            weights, *inputs, reference_lens, num_heads=2, causal=causal
        )
        with torch.no_grad():
            lens_ = None if valid_lens is None else torch.from_numpy(valid_lens.copy())
            out = compiled(*tensors_, lens_, causal=causal)
        assert_same_nonfinite_pattern(out.numpy(), expected)


def test_torch_compile_empty_keys_and_gradients(compiler):
    weights, layer = edge_layer()
    inputs = edge_inputs(num_keys=0)
    output_gradient = np.ones((2, 3, 8))
    expected = spec.reference_gradients(
        weights, *inputs, np.array([1, 2]), num_heads=2, output_gradient=output_gradient
    )
    compiled = compiler(layer, fullgraph=True)
    tensors_ = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in inputs]
    out = compiled(*tensors_, torch.tensor([1, 2]))
    np.testing.assert_allclose(
        out.detach().numpy(), np.broadcast_to(weights["b_o"], (2, 3, 8)), rtol=0, atol=5e-6
    )
    out.backward(torch.tensor(output_gradient, dtype=torch.float32))
    np.testing.assert_allclose(layer.W_o.bias.grad.numpy(), expected["b_o"], atol=5e-5)
    np.testing.assert_allclose(tensors_[0].grad.numpy(), expected["queries"], atol=5e-5)
    assert tensors_[1].grad.shape == (2, 0, 8)
