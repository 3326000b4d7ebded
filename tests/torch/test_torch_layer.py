"""The PyTorch layer's own contract: gradcheck, lazy sizes, d2l's names, dtypes, 16 bits, autocast.

What only the PyTorch backend has; the numbers are the parity cases' float64
reference or the spec's (:mod:`mha_multi.spec`), the 16-bit products a float32
product rounded once.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from torch_support import runner as runner

from mha_multi import spec
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.torch._ops import OPS
from mha_multi.torch._ops import linear as _linear
from mha_multi.weights import init_weights


# head_dim: grouped heads, and rows that lengths of 0 hide entirely.
@pytest.mark.parametrize(
    "name", ["lens_2d", "causal_cross", "cross_sizes", "lens_zero", "head_dim"]
)
def test_gradcheck_float64(runner, cases, name):
    case = cases[name]
    layer = runner.layer_for(case, dtype="float64")
    inputs = [
        runner.to_native(case.inputs[n], dtype="float64").requires_grad_(True) for n in INPUT_NAMES
    ]
    lens = runner.native_lens(case.valid_lens)
    # fast_mode: the Jacobian's product with random vectors against its finite
    # differences (the full Jacobian, a forward pass per input entry, took 32 s for these
    # cases), within float64's tolerances: one entry of the gradient off by 0.1% fails.
    torch.manual_seed(0)  # (the random vectors)
    assert torch.autograd.gradcheck(
        lambda q, k, v: layer(q, k, v, lens, causal=case.config.causal),
        inputs,
        fast_mode=True,
        atol=1e-8,
        rtol=1e-6,
    )


def test_lazy_sizes_are_inferred_on_first_call(runner):
    rng = np.random.default_rng(0)
    layer = MultiHeadAttention(12, 3)
    with pytest.raises(ValueError, match="query_size, key_size, value_size not known yet"):
        get_weights(layer)
    q, k, v = (runner.to_native(rng.standard_normal(s)) for s in [(2, 3, 7), (2, 5, 4), (2, 5, 6)])
    assert layer(q, k, v).shape == (2, 3, 12)
    assert layer.input_sizes() == {"query_size": 7, "key_size": 4, "value_size": 6}
    assert get_weights(layer)["W_v"].shape == (6, 12)
    with pytest.raises(ValueError, match="queries last dimension must be query_size=7"):
        layer(runner.to_native(rng.standard_normal((2, 3, 8))), k, v)


def test_a_lazy_layer_first_called_under_inference_mode_trains_later():
    # Its sizes, learnt under inference mode, make ordinary parameters, packed as such.
    x_np = np.random.default_rng(1).standard_normal((2, 3, 8))
    x = torch.tensor(x_np, dtype=torch.float32)
    layer = MultiHeadAttention(8, 2, bias=True)
    with torch.inference_mode():
        layer(x, x, x)
    assert not any(parameter.is_inference() for parameter in layer.parameters())
    output = layer(x, x, x, causal=True)
    output.sum().backward()
    weights = get_weights(layer)
    expected = spec.reference_forward(weights, x_np, x_np, x_np, num_heads=2, causal=True)[0]
    np.testing.assert_allclose(output.detach().numpy(), expected, atol=5e-6, rtol=0)
    assert all(parameter.grad is not None for parameter in layer.parameters())


def test_set_weights_fixes_lazy_sizes(runner, cases):
    case = cases["cross_sizes"]
    config = case.config
    layer = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=config.bias)
    layer = set_weights(layer, case.weights)  # the layer is lazy: the sizes come from the weights
    assert layer.input_sizes() == {"query_size": 7, "key_size": 5, "value_size": 3}
    out = runner.call(layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)


def test_state_dict_uses_d2l_names():
    layer = MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    assert sorted(layer.state_dict()) == sorted(
        f"W_{p}.{t}" for p in "qkvo" for t in ("weight", "bias")
    )
    weights = get_weights(layer)
    np.testing.assert_array_equal(weights["W_q"], layer.W_q.weight.detach().numpy().T)


def test_dtype_mismatch_is_a_clear_error(runner):
    layer = MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    x = runner.to_native(np.random.default_rng(0).standard_normal((1, 2, 8)), dtype="float64")
    with pytest.raises(TypeError, match="queries dtype torch.float64 differs from the layer's"):
        layer(x, x.float(), x.float())
    with pytest.raises(TypeError, match="keys must be a floating-point tensor"):
        layer(x.float(), x.long(), x.float())


# -- 16 bits and autocast ------------------------------------------------------


def test_autocast_bfloat16_softmax_is_float32_safe(runner):
    weights = init_weights(8, seed=1)
    layer = set_weights(MultiHeadAttention(8, 2), weights)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 8), (2, 4, 8), (2, 4, 8)]]
    valid_lens = np.array([0, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(*map(runner.to_native, inputs), runner.native_lens(valid_lens))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    expected, _ = spec.reference_forward(weights, *inputs, valid_lens, num_heads=2)
    np.testing.assert_allclose(runner.to_numpy(out), expected, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_products_accumulate_in_float32_by_construction(dtype):
    """On CPU every 16-bit product is the float32 product of the same numbers, rounded once."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 64, 256, generator=generator).to(dtype) for _ in range(2))
    weight, bias = (
        torch.randn(32, 256, generator=generator).to(dtype),
        torch.randn(32, generator=generator).to(dtype),
    )
    product = OPS.matmul(a, b.transpose(1, 2))
    assert product.dtype == dtype
    assert torch.equal(product, (a.float() @ b.float().transpose(1, 2)).to(dtype))
    linear = _linear(a, weight, bias)
    assert torch.equal(
        linear, torch.nn.functional.linear(a.float(), weight.float(), bias.float()).to(dtype)
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_fused_path_runs_sdpa_on_float32_copies_on_cpu(runner, cases, dtype):
    case = cases["lens_1d"]
    layer = runner.layer_for(case, dtype=dtype)
    tensors = [runner.to_native(case.inputs[n], dtype=dtype) for n in INPUT_NAMES]
    # The operands' dtypes are not a KernelCall's: the kernel itself is wrapped.
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", wraps=sdpa) as spy:
        out = runner.forward(layer, *tensors, runner.native_lens(case.valid_lens))
    spy.assert_called_once()
    assert [x.dtype for x in spy.call_args.args] == 3 * [torch.float32]
    assert out.dtype == backend.DTYPES[dtype]
    np.testing.assert_allclose(runner.to_numpy(out), case.reference["output"], atol=2e-2)


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


@pytest.mark.parametrize("name", ["W_q", "W_k", "W_o"])
def test_a_parametrized_projection_is_refused_naming_it(name):
    """A weight a parametrization computes is no parameter of the module: every path
    (the route, the generic flow, cross-attention) refuses it with one TypeError,
    where each failed with a KeyError of its own."""
    layer = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16)
    x, y = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    layer(x, x, x)
    torch.nn.utils.parametrizations.weight_norm(getattr(layer, name))
    for call in (
        lambda: layer(x, x, x),
        lambda: layer(x, x, x, return_attention_weights=True),
        lambda: layer(x, y, y),
    ):
        with pytest.raises(TypeError, match=f"the layer's {name}: a weight computed by a"):
            call()
    torch.nn.utils.parametrize.remove_parametrizations(getattr(layer, name), "weight")
    assert layer(x, x, x).shape == (2, 3, 16)


def test_forward_hooks_of_the_projections_do_not_run():
    """The layer takes the product of its projections' parameters on every path (as
    ``nn.MultiheadAttention`` takes its ``out_proj``'s): a hook of ``W_q`` or ``W_o``
    changes no output, where it ran on some paths (gates, cross-attention) and not
    on others (outputs off by a factor of 2)."""
    weights = init_weights(16, num_heads=4, bias=True, seed=0)
    layer = set_weights(MultiHeadAttention(16, 4, bias=True), weights).eval()
    x, y = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    gates = torch.ones(4)
    calls = {
        "self": lambda: layer(x, x, x),
        "gated": lambda: layer(x, x, x, head_mask=gates),
        "cross": lambda: layer(x, y, y),
        "cached": lambda: layer(x, x, x, causal=True, cache=layer.init_cache(2, 4))[0],
    }
    with torch.no_grad():
        before = {name: call() for name, call in calls.items()}
        handles = [
            layer.W_q.register_forward_hook(lambda module, args, out: out * 0),
            layer.W_o.register_forward_hook(lambda module, args, out: out * 2),
        ]
        for name, call in calls.items():
            torch.testing.assert_close(call(), before[name], rtol=0, atol=0, msg=name)
    for handle in handles:
        handle.remove()
    # (The gates of ones are the reference's output.)
    expected, _ = spec.reference_forward(weights, *[x.double().numpy()] * 3, None, num_heads=4)
    np.testing.assert_allclose(before["gated"].numpy(), expected, rtol=0, atol=1e-5)
