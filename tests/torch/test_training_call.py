"""A PyTorch call that records gradients: its numbers against the float64 spec, and its host work.

Self-attention in ``train()`` mode projects through the view of the packed
weights (``StackedView``) and plans once per signature; every call, the
first and the repeated, must give the spec's output and gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.bench.host import counted
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

FORWARD, GRADIENT = 5e-6, 5e-5  # the spec's float32 tolerances (docs: "Parity")


def tiny_layer(**options: object) -> tuple[dict[str, np.ndarray], MultiHeadAttention]:
    """A 16-hidden, 2-head layer with canonical weights, in training mode."""
    weights = init_weights(
        16,
        seed=2,
        num_heads=2,
        num_kv_heads=options.get("num_kv_heads"),  # type: ignore[arg-type]
        bias=bool(options.get("bias")),
    )
    return weights, set_weights(MultiHeadAttention(16, 2, **options), weights).train()


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
        queries = reference["queries"] + reference["keys"] + reference["values"]
        np.testing.assert_allclose(inputs.grad.numpy(), queries, atol=GRADIENT, rtol=0)
        named = dict(layer.named_parameters())
        assert len(named) == (8 if options.get("bias") else 4)
        for name, parameter in named.items():
            module, kind = name.split(".")
            key = module if kind == "weight" else f"b_{module[-1]}"
            want = reference[key].T if kind == "weight" else reference[key]
            np.testing.assert_allclose(
                parameter.grad.numpy(), want, atol=GRADIENT, rtol=0, err_msg=name
            )


def test_a_one_token_training_call_makes_at_most_90_python_calls():
    """The host work of a one-token call recording gradients (cProfile's count, the
    same on every machine; docs: "Results"): at most 90 function calls."""
    _, layer = tiny_layer()
    token = torch.randn(1, 1, 16)
    assert counted(lambda: layer(token, token, token), calls=10) <= 90
