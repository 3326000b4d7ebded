"""The PyTorch layer's input projections: packed W_q, W_k, W_v, one product, every change followed.

Calls without gradients project shared inputs with the weights stacked;
calls recording gradients take a view of the packed parameters. Each result
is the float64 reference's, and the gradients those of a layer that stacks
its weights anew at every call, to the bit.
"""

from __future__ import annotations

import copy
import pickle
from unittest import mock

import numpy as np
import pytest
import torch
from torch_support import runner as runner

from mha_multi import spec
from mha_multi.interop.torch import to_torch_d2l
from mha_multi.torch import MultiHeadAttention, _projections, get_weights, set_weights
from mha_multi.weights import init_weights


@pytest.mark.parametrize("name", ["bias", "gqa"])  # gqa: queries projected wider than keys
@pytest.mark.parametrize("shared", ["qkv", "kv", "qk"])
def test_shared_inputs_project_in_one_product(runner, cases, shared, name):
    case = cases[name]
    num_heads = case.config.num_heads
    layer = runner.layer_for(case).eval()
    x = runner.to_native(case.inputs["queries"][:, :5])
    lens = torch.tensor([3, 5, 0])
    q, k, v = {"qkv": (x, x, x), "kv": (x[:, :2], x, x), "qk": (x, x, x[:, :5] * 2)}[shared]
    expected, _ = spec.reference_forward(case.weights, q, k, v, lens, num_heads=num_heads)
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
        num_heads=num_heads,
        output_gradient=np.ones(expected.shape),
    )
    np.testing.assert_allclose(grads[0].T.numpy(), reference["W_k"], atol=5e-5)


@pytest.mark.parametrize(
    "change",
    [
        "set_weights",
        "optimizer",
        "data",
        "data transposed",
        "data in place",
        "bias data",
        "replaced",
        "converted",
    ],
)
def test_stacked_weights_follow_every_change_of_the_parameters(runner, cases, change):
    # Calls without gradients project with W_q/W_k/W_v stacked: after any change of
    # the parameters (loaded, stepped in place, through .data, replaced, converted
    # and back) the next call uses the new ones.
    case = cases["bias"]
    num_heads = case.config.num_heads
    layer = runner.layer_for(case).eval()
    x = runner.to_native(case.inputs["queries"])
    with torch.inference_mode():
        layer(x, x, x)  # stacks the weights
    with torch.no_grad():
        layer(x, x, x)  # stacks them outside inference mode
    if change == "set_weights":
        weights = init_weights(x.shape[-1], bias=True, seed=11)
        set_weights(layer, weights)
    else:
        if change == "optimizer":
            optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
            layer(x, x, x).square().sum().backward()
            optimizer.step()
        elif change == "data":
            layer.W_v.weight.data = torch.randn_like(layer.W_v.weight)
        elif change == "data transposed":  # (the same memory, of other strides)
            layer.W_v.weight.data = layer.W_v.weight.data.t()
        elif change == "data in place":
            layer.W_v.weight.data.mul_(2)
        elif change == "bias data":
            layer.W_v.bias.data = torch.randn_like(layer.W_v.bias)
        elif change == "replaced":
            layer.W_v.weight = torch.nn.Parameter(torch.randn_like(layer.W_v.weight))
        else:
            with torch.no_grad():
                layer.W_v.weight.mul_(2)
            layer.double().float()
        weights = get_weights(layer)
    changed = "b_v" if change == "bias data" else "W_v"
    assert not np.array_equal(weights[changed], case.weights[changed])
    expected, _ = spec.reference_forward(weights, x, x, x, None, num_heads=num_heads)
    # (Keys and values alone sharing their input: their two projections stacked.)
    shared, _ = spec.reference_forward(weights, x[:, :2], x, x, None, num_heads=num_heads)
    for mode in (torch.no_grad, torch.inference_mode):  # no_grad first: as the last call
        with mode():
            np.testing.assert_allclose(layer(x, x, x).numpy(), expected, atol=5e-6)
            np.testing.assert_allclose(layer(x[:, :2], x, x).numpy(), shared, atol=5e-6)


def test_the_input_projections_are_packed_and_stay_packed(runner, cases):
    """W_q, W_k and W_v lie back to back (their stack a view, no copy) from the
    constructor, after a conversion, and after share_memory(), which keeps them
    in the shared memory it moved them to."""
    layer = runner.layer_for(cases["bias"]).eval()
    modules = [layer.W_q, layer.W_k, layer.W_v]

    def packed():
        with torch.no_grad():
            weight, bias = layer._stacks(modules)
        return weight.data_ptr() == layer.W_q.weight.data_ptr() and (
            bias.data_ptr() == layer.W_q.bias.data_ptr()
        )

    assert packed()
    layer.double()
    assert packed() and layer.W_k.weight.dtype == torch.float64
    layer.float().share_memory()
    assert packed() and all(m.weight.is_shared() for m in modules)
    layer.W_k.weight = torch.nn.Parameter(layer.W_k.weight.detach().clone())
    assert not packed()  # stacked at every call instead


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copy_of_the_layer_is_packed_and_computes_its_numbers(runner, cases, copy_of):
    """A deep copy and an unpickled layer (``torch.save`` of the module) have their input
    projections packed again, and give the layer's numbers to the bit: on inputs whose
    product a stack made at every call rounds otherwise (a non-contiguous batch)."""
    layer = runner.layer_for(cases["bias"]).eval()
    copies = {"deepcopy": copy.deepcopy, "pickle": lambda x: pickle.loads(pickle.dumps(x))}
    copied = copies[copy_of](layer)
    modules = [copied.W_q, copied.W_k, copied.W_v]
    with torch.no_grad():
        weight, bias = copied._stacks(modules)
    assert weight.data_ptr() == copied.W_q.weight.data_ptr() != layer.W_q.weight.data_ptr()
    assert bias.data_ptr() == copied.W_q.bias.data_ptr()
    x = torch.randn(9, 7, layer.W_q.weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.transpose(0, 1)  # (7, 9, D), examples apart in memory
    with torch.no_grad():
        expected, out = layer(x, x, x), copied(x, x, x)
    assert torch.equal(out, expected)
    reference, _ = spec.reference_forward(
        cases["bias"].weights, x.numpy(), x.numpy(), x.numpy(), None, num_heads=copied.num_heads
    )
    np.testing.assert_allclose(out.numpy(), reference, atol=5e-6)


@pytest.mark.parametrize("name", ["bias", "gqa"])
def test_a_call_recording_gradients_projects_with_the_packed_weights_uncopied(runner, cases, name):
    """Self-attention recording gradients takes the view of the packed weights
    (``StackedView``: nothing is stacked anew) and gives, to the bit, the output and the
    gradients of a layer whose weights are stacked anew at every call (one replaced by
    a parameter of its own), and the float64 reference's."""
    case = cases[name]
    packed, copied = runner.layer_for(case).eval(), runner.layer_for(case).eval()
    copied.W_k.weight = torch.nn.Parameter(copied.W_k.weight.detach().clone())
    x = case.inputs["queries"]
    lens = torch.tensor([3, 4, 0])
    output_gradient = np.random.default_rng(3).standard_normal((*x.shape[:2], x.shape[-1]))

    def gradients(layer):
        inputs = runner.to_native(x).requires_grad_(True)
        output = layer(inputs, inputs, inputs, lens)
        output.backward(torch.from_numpy(output_gradient).float())
        named = {
            f"{kind}_{n}": getattr(getattr(layer, f"W_{n}"), attribute).grad
            for n in "qkvo"
            for kind, attribute in (("W", "weight"), ("b", "bias"))
        }
        return output.detach(), inputs.grad, {k: v for k, v in named.items() if v is not None}

    with mock.patch.object(_projections, "_stack", side_effect=AssertionError("stacked anew")):
        output, input_gradient, ours = gradients(packed)
    copied_output, copied_input_gradient, theirs = gradients(copied)
    assert torch.equal(output, copied_output) and torch.equal(input_gradient, copied_input_gradient)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    heads = {"num_heads": case.config.num_heads, "num_kv_heads": case.config.num_kv_heads}
    reference = spec.reference_gradients(
        case.weights, x, x, x, lens.numpy(), **heads, output_gradient=output_gradient
    )
    queries = reference["queries"] + reference["keys"] + reference["values"]
    np.testing.assert_allclose(input_gradient.numpy(), queries, atol=5e-5)
    for k, gradient in ours.items():
        expected = reference[k].T if k.startswith("W") else reference[k]
        np.testing.assert_allclose(gradient.numpy(), expected, atol=5e-5)


def test_a_parameter_changed_in_place_before_the_backward_pass_raises():
    """The stack a call recording gradients saves is a view of the packed parameters:
    a change of one of them in place between the forward and the backward pass raises
    PyTorch's error, as it does for ``nn.Linear``'s weight, instead of giving the
    gradients of other weights."""
    layer = MultiHeadAttention(8, 2, bias=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    for parameter in (layer.W_v.weight, layer.W_k.bias, layer.W_q.weight):
        output = layer(x, x, x)
        with torch.no_grad():
            parameter.mul_(2)
        with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace"):
            output.sum().backward()


def test_training_steps_with_the_packed_weights_are_those_with_a_stack_made_anew():
    """Adam's steps, which change the parameters in place between calls, train a layer
    whose self-attention projects with the view of its packed weights to the parameters
    of a layer that stacks them anew at every call, to the bit."""
    layers = [MultiHeadAttention(16, 4, num_kv_heads=2, bias=True) for _ in range(2)]
    z = torch.zeros(1, 1, 16)
    with torch.no_grad():
        layers[0](z, z, z)  # (sizes learnt)
        layers[1](z, z, z)
    layers[1].load_state_dict(layers[0].state_dict())
    copied = layers[1].W_k
    copied.weight = torch.nn.Parameter(copied.weight.detach().clone())
    optimizers = [torch.optim.Adam(layer.parameters(), 1e-2) for layer in layers]
    initial = layers[0].W_v.weight.detach().clone()
    generator = torch.Generator().manual_seed(5)
    for _ in range(4):
        x = torch.randn(3, 5, 16, generator=generator)
        for layer, optimizer in zip(layers, optimizers, strict=True):
            optimizer.zero_grad()
            layer(x, x, x, torch.tensor([5, 2, 3]), causal=True).square().mean().backward()
            optimizer.step()
    packed, anew = (dict(layer.named_parameters()) for layer in layers)
    assert all(torch.equal(packed[name], anew[name]) for name in packed)
    assert not torch.equal(packed["W_v.weight"], initial)  # (trained)


@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_a_lazy_layer_refuses_a_state_dict_of_other_heads(num_kv_heads):
    """A layer without its input sizes took the shapes of the ``W_k``/``W_v`` it loaded
    (``nn.LazyLinear``'s rule): another ``num_kv_heads``' state dict loaded, and the
    first call failed deep inside. It is refused as a built layer refuses it (PyTorch's
    size mismatch), and so is a bias of other rows; ``to_torch_d2l`` says so in a
    ``ValueError``. The same layer's state loads."""
    source = MultiHeadAttention(12, 4, num_kv_heads=2, head_dim=8, bias=True)
    x = torch.randn(1, 3, 12)
    with torch.no_grad():
        expected = source(x, x, x)
    state = source.state_dict()
    other = MultiHeadAttention(12, 4, num_kv_heads=num_kv_heads, head_dim=8, bias=True)
    with pytest.raises(RuntimeError, match=r"size mismatch for W_k.weight: .*\[16, 12\]"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="size mismatch for W_k.weight"):
        to_torch_d2l(get_weights(source), other)
    same = MultiHeadAttention(12, 4, num_kv_heads=2, head_dim=8, bias=True)
    with pytest.raises(RuntimeError, match=r"size mismatch for W_v.bias: .*\[5\]"):
        same.load_state_dict({**state, "W_v.bias": torch.zeros(5)})
    same = MultiHeadAttention(12, 4, num_kv_heads=2, head_dim=8, bias=True)
    same.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(same(x, x, x), expected)
