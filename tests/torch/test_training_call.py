"""A PyTorch call that records gradients: its numbers against the float64 spec, and its host work.

Self-attention in ``train()`` mode projects through the view of the packed
weights (``StackedView``) and plans once per signature; every call, the
first and the repeated, must give the spec's output and gradients. On the
host the fast route answers it, with every option of the layer, to the
generic flow's output and gradients to the bit (docs: "Fast paths").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from route_support import answered_calls, generic_only
from torch_support import draw_norm_weights

from conftest import recording_host_moves
from mha_multi import spec
from mha_multi.bench.host import counted
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

FORWARD, GRADIENT = 5e-6, 5e-5  # the spec's float32 tolerances (docs: "Parity")


def tiny_layer(
    num_heads: int = 2, **options: object
) -> tuple[dict[str, np.ndarray], MultiHeadAttention]:
    """A 16-hidden layer with canonical weights (query/key norms' scales away from 1), in
    training mode."""
    weights = init_weights(
        16,
        seed=2,
        num_heads=num_heads,
        num_kv_heads=options.get("num_kv_heads"),  # type: ignore[arg-type]
        bias=bool(options.get("bias")),
        sinks=bool(options.get("sinks")),
    )
    layer = MultiHeadAttention(16, num_heads, **options)
    if "qk_norm" in options:
        draw_norm_weights(weights, layer, np.random.default_rng(3))
    return weights, set_weights(layer, weights).train()


def assert_reference_gradients(
    layer: MultiHeadAttention,
    inputs: torch.Tensor,
    reference: dict[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Every parameter's gradient and the input's (self-attention: the sum of the three
    inputs') are the float64 reference's, within the dtype's tolerance."""
    gradient = GRADIENT if dtype == torch.float32 else 1e-10
    queries = reference["queries"] + reference["keys"] + reference["values"]
    np.testing.assert_allclose(inputs.grad.double().numpy(), queries, atol=gradient, rtol=0)
    for name, parameter in layer.named_parameters():
        module, _, kind = name.partition(".")
        if kind == "weight":
            key, want = module, reference[module].T
        elif kind == "bias":
            key = f"b_{module[-1]}"
            want = reference[key]
        else:  # (the norms' scales, the sinks)
            want = reference[module]
        np.testing.assert_allclose(
            parameter.grad.double().numpy(), want, atol=gradient, rtol=0, err_msg=name
        )


@pytest.mark.parametrize(
    ("options", "length", "causal"),
    [({}, 1, False), ({"bias": True, "num_kv_heads": 1}, 3, True)],
)
def test_a_training_call_gives_the_spec_output_and_gradients(options, length, causal):
    """The output and the gradient of every parameter and of the input, at the first
    call and at the next ones (whose plan is looked up), are the float64 reference's."""
    weights, layer = tiny_layer(**options)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, length, 16)).astype(np.float32)
    output_gradient = rng.standard_normal((1, length, 16))
    heads = {"num_heads": 2, "num_kv_heads": options.get("num_kv_heads")}
    expected, _ = spec.reference_forward(weights, x, x, x, None, **heads, causal=causal)
    reference = spec.reference_gradients(
        weights, x, x, x, None, **heads, causal=causal, output_gradient=output_gradient
    )
    for _ in range(3):
        layer.zero_grad(set_to_none=True)
        inputs = torch.from_numpy(x).requires_grad_(True)
        output = layer(inputs, inputs, inputs, causal=causal)
        output.backward(torch.from_numpy(output_gradient).float())
        np.testing.assert_allclose(output.detach().numpy(), expected, atol=FORWARD, rtol=0)
        assert len(dict(layer.named_parameters())) == (8 if options.get("bias") else 4)
        assert_reference_gradients(layer, inputs, reference)


#: Layers of today's families without a cache, each option on the route's plans: SDPA's
#: flag, mask or bias, or the generic path's operations written out (a cap, sinks).
FAMILY_OPTIONS = {
    "rotary-gqa": {"rotary": {"theta": 100.0}, "num_kv_heads": 2},
    "window-sinks": {"window": 2, "sinks": True},
    "gemma2": {"rotary": {"theta": 100.0}, "window": 3, "softcap": 3.0, "num_kv_heads": 1},
    "alibi": {"alibi": True, "bias": True},
    "qwen3": {"rotary": {"theta": 100.0}, "qk_norm": {"eps": 1e-6}, "num_kv_heads": 2},
    "olmo2": {"qk_norm": {"scope": "whole"}},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("options", FAMILY_OPTIONS.values(), ids=FAMILY_OPTIONS.keys())
def test_a_training_call_on_the_host_takes_the_route_to_the_generic_numbers(options, length, dtype):
    """A causal call recording gradients, of a layer with any option: the route answers,
    its output and every gradient the generic flow's to the bit, and the float64
    reference's."""
    weights, layer = tiny_layer(num_heads=4, **options)
    layer = layer.to(dtype)
    heads = {"num_heads": 4, "num_kv_heads": options.get("num_kv_heads")}
    layer_options = {k: v for k, v in options.items() if k not in ("num_kv_heads", "bias")}
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, length, 16))
    output_gradient = rng.standard_normal((2, length, 16))
    expected, _ = spec.reference_forward(
        weights, x, x, x, None, **heads, causal=True, **layer_options
    )
    reference = spec.reference_gradients(
        weights,
        x,
        x,
        x,
        None,
        **heads,
        causal=True,
        output_gradient=output_gradient,
        **layer_options,
    )
    runs = []
    for route in (answered_calls, generic_only):
        layer.zero_grad(set_to_none=True)
        inputs = torch.from_numpy(x).to(dtype).requires_grad_(True)
        with route() as answers:
            output = layer(inputs, inputs, inputs, causal=True)
        output.backward(torch.from_numpy(output_gradient).to(dtype))
        gradients = [p.grad for p in layer.parameters()]
        runs.append((answers, output.detach(), inputs.grad, gradients))
    (answers, output, inputs_gradient, gradients), (_, *generic) = runs
    assert answers == [True]
    assert torch.equal(output, generic[0]) and torch.equal(inputs_gradient, generic[1])
    assert all(torch.equal(a, b) for a, b in zip(gradients, generic[2], strict=True))
    forward = FORWARD if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(output.double().numpy(), expected, atol=forward, rtol=0)
    inputs.grad = inputs_gradient
    for parameter, gradient in zip(layer.parameters(), gradients, strict=True):
        parameter.grad = gradient
    assert_reference_gradients(layer, inputs, reference, dtype)


@pytest.mark.parametrize("num_queries", [5, 256], ids=["short", "long"])
def test_a_training_call_on_a_gpu_reads_only_where_a_heads_scores_are_many(num_queries):
    """On a GPU (the facts told so) a call recording a gradient takes the route: with
    fewer than ``spec.DEVICE_READ_SCORES`` scores per head the generic path's
    operations, reading nothing; with more (however few in all: a gradient's call)
    one read, then SDPA. Its output and gradients the generic flow's to the bit, and
    the reference's output."""
    weights, layer = tiny_layer(num_heads=4, num_kv_heads=2, bias=True)
    heads = {"num_heads": 4, "num_kv_heads": 2}
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, num_queries, 16)).astype(np.float32)
    expected, _ = spec.reference_forward(weights, x, x, x, None, **heads, causal=True)
    short = not spec.reads_values(False, num_queries, num_queries, total_scores=None)
    assert short == (num_queries == 5)
    # (Recording none, the call would not read: its scores in all are few.)
    assert not spec.reads_values(False, num_queries, num_queries, total_scores=4 * num_queries**2)
    runs = []
    with backend.as_if_on_a_gpu():
        layer(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x), causal=True)
        for route in (answered_calls, generic_only):
            layer.zero_grad(set_to_none=True)
            inputs = torch.from_numpy(x).requires_grad_(True)
            spies = backend.kernel_spy(), recording_host_moves()
            with route() as answers, spies[0] as calls, spies[1] as moved:
                output = layer(inputs, inputs, inputs, causal=True)
            output.sum().backward()
            gradients = [inputs.grad, *(p.grad for p in layer.parameters())]
            runs.append((answers, calls, moved, output.detach(), gradients))
    (answers, calls, moved, output, gradients), generic = runs
    assert answers == [True]
    assert (len(calls), moved) == ((0, []) if short else (1, ["tolist"]))
    assert torch.equal(output, generic[3])
    assert all(torch.equal(a, b) for a, b in zip(gradients, generic[4], strict=True))
    np.testing.assert_allclose(output.numpy(), expected, atol=FORWARD, rtol=0)


def test_training_calls_the_route_leaves_to_the_generic_flow():
    """Recording a gradient, the route takes no call with dropout, with a cache or under
    ``torch.func``'s transforms: the reference's outputs and (``torch.func.grad``)
    gradients all the same."""
    weights, layer = tiny_layer(dropout=0.5)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 3, 16)).astype(np.float32)
    expected, _ = spec.reference_forward(weights, x, x, x, None, num_heads=2, causal=True)
    inputs = torch.from_numpy(x).requires_grad_(True)
    with answered_calls() as answers:
        layer(inputs, inputs, inputs, causal=True)  # dropout: not offered to the route
        layer.eval()
        cache = layer.init_cache(1, 8)
        out, _ = layer(inputs, inputs, inputs, causal=True, cache=cache)
        parameters = {name: p.detach() for name, p in layer.named_parameters()}

        def loss(parameters: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(layer, parameters, (x, x, x), {"causal": True}).sum()

        by_parameter, by_input = torch.func.grad(loss, argnums=(0, 1))(parameters, inputs.detach())
    assert answers == [False, False]
    np.testing.assert_allclose(out.detach().numpy(), expected, atol=FORWARD, rtol=0)
    reference = spec.reference_gradients(
        weights, x, x, x, None, num_heads=2, causal=True, output_gradient=np.ones_like(x)
    )
    for name, gradient in by_parameter.items():
        parameter = layer.get_parameter(name)
        parameter.grad = gradient
    inputs.grad = by_input
    assert_reference_gradients(layer, inputs, reference)


def test_a_one_token_training_call_makes_at_most_90_python_calls():
    """The host work of a one-token call recording gradients (cProfile's count, the
    same on every machine; docs: "Results"): at most 90 function calls."""
    _, layer = tiny_layer()
    token = torch.randn(1, 1, 16)
    assert counted(lambda: layer(token, token, token), calls=10) <= 90
