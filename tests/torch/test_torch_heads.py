"""The PyTorch layer's heads: ``head_mask``, ``head_importance`` and pruned layers.

Every result is checked against the float64 reference of :mod:`mha_multi.spec`
(the gates' gradient included), never against the layer itself; the
generic parity checks of the head-mask cases run through the runners.
"""

from __future__ import annotations

import contextlib

import heads_cases as hc
import numpy as np
import pytest
import torch
from torch_support import TRACED
from torch_support import compiler as compiler

from conftest import gpu_required
from mha_multi import spec
from mha_multi.parity.cases import HEAD_MASK_CASES, INPUT_NAMES, build_case
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, head_importance, set_weights
from mha_multi.torch._kernel import SDPA
from mha_multi.weights import init_weights

FLOAT32_ATOL, FLOAT32_GRAD_ATOL, SIXTEEN_BIT_ATOL = 5e-6, 5e-5, 2e-2
#: Grouped heads, biases and input sizes of their own.
LAYOUT = {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def cases():
    return {config.name: build_case(config) for config in HEAD_MASK_CASES}


def tensor(x, dtype=torch.float32):
    return torch.from_numpy(np.array(x, copy=True)).to(dtype)


def case_layer(case, dtype=torch.float32):
    config = case.config
    layer = MultiHeadAttention(
        config.num_hiddens, config.num_heads, bias=config.bias, dtype=dtype, **config.heads()
    )
    return set_weights(layer, case.weights).eval()


def case_arguments(case, dtype=torch.float32):
    inputs = [tensor(case.inputs[name], dtype) for name in INPUT_NAMES]
    lens = None if case.valid_lens is None else torch.from_numpy(case.valid_lens)
    return (*inputs, lens), {"causal": case.config.causal}


def case_gates(case):
    return np.asarray(case.config.head_mask, np.float32)


def make(seed, *, num_heads=4, num_kv_heads=2, head_dim=None, dtype=torch.float32):
    """A layer of random weights and the float64 copy of them, and random inputs."""
    layout = {**LAYOUT, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    weights = init_weights(**layout, bias=True, seed=seed, **hc.SIZES)
    layer = MultiHeadAttention(**layout, bias=True, dtype=dtype, **hc.SIZES)
    layer = set_weights(layer, weights).eval()
    weights = {name: value.astype(np.float64) for name, value in weights.items()}
    rng = np.random.default_rng(seed)
    return weights, layer, hc.random_inputs(rng), rng


# -- head_mask on every path ---------------------------------------------------------


@pytest.mark.parametrize("name", [config.name for config in HEAD_MASK_CASES])
def test_head_mask_keeps_the_fused_path_and_gives_the_references_numbers(cases, name):
    """SDPA runs as the plan says for the case (the gates act after it); the weights' call too."""
    case = cases[name]
    layer = case_layer(case)
    args, kwargs = case_arguments(case)
    lens = case.valid_lens
    plan = spec.plan_kernel(
        SDPA,
        sizes=(case.config.batch, case.config.num_queries, case.config.num_keys),
        lens_ndim=None if lens is None else lens.ndim,
        lens_integer=True,
        causal=case.config.causal,
        values_exact=True,
        shortest_length=None if lens is None else float(lens.min()),
        grouped=case.config.num_kv_heads is not None,
    )
    assert plan.fused, plan.reason
    gates = tensor(case_gates(case))
    with backend.kernel_spy() as calls, torch.no_grad():
        output = layer(*args, **kwargs, head_mask=gates)
    assert [(call.mask, call.is_causal) for call in calls] == [(plan.needs_mask, plan.is_causal)]
    np.testing.assert_allclose(output.numpy(), case.reference["output"], rtol=0, atol=FLOAT32_ATOL)

    with backend.kernel_spy() as calls, torch.no_grad():
        output, weights = layer(*args, **kwargs, head_mask=gates, return_attention_weights=True)
    assert calls == []
    np.testing.assert_allclose(output.numpy(), case.reference["output"], rtol=0, atol=FLOAT32_ATOL)
    # The gates act on the context: the attention weights are the ungated ones.
    np.testing.assert_allclose(
        weights.numpy(), case.reference["attention_weights"], rtol=0, atol=FLOAT32_ATOL
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", [config.name for config in HEAD_MASK_CASES])
def test_gradients_with_a_head_mask_are_the_references(cases, name, dtype):
    """Every gradient, the gates' included, through the facts module's vjp."""
    case = cases[name]
    layer = case_layer(case, dtype)
    (*inputs, lens), kwargs = case_arguments(case, dtype)
    grads = backend.vjp(
        layer,
        *inputs,
        lens,
        **kwargs,
        output_gradient=tensor(case.output_gradient, dtype),
        head_mask=tensor(case_gates(case), dtype),
    )
    assert grads["head_mask"].shape == case_gates(case).shape
    assert set(grads) == {name[len("grad.") :] for name in case.reference if "grad." in name}
    atol = FLOAT32_GRAD_ATOL if dtype == torch.float32 else 1e-12
    for key, value in grads.items():
        expected = case.reference[f"grad.{key}"]
        np.testing.assert_allclose(value.numpy(), expected, rtol=0, atol=atol, err_msg=key)


def test_a_cached_call_gates_its_heads_on_sdpa_as_the_reference_does():
    """A ragged prefill with (B, H) gates and a step with (H,) ones; the fused kernel runs."""
    weights, layer, (queries, keys, values), rng = make(1)
    cache = layer.init_cache(3, 8)
    reference_cache = spec.KVCache(*(x.numpy() for x in cache))
    schedule = [
        (slice(0, 4), np.array([4, 2, 1]), rng.uniform(-1, 2, (3, 4))),
        (slice(4, 5), np.array([1, 1, 0]), np.array([0.0, 1.0, 0.5, -1.0])),
    ]
    for rows, new_lens, gates in schedule:
        chunk = [x[:, rows] for x in (queries, keys, values)]
        expected, _, reference_cache = spec.reference_cached_forward(
            weights,
            *chunk,
            reference_cache,
            new_lens,
            num_heads=4,
            causal=True,
            head_mask=gates.astype(np.float32),
        )
        arguments = [tensor(x) for x in chunk]
        with backend.kernel_spy() as calls, torch.no_grad():
            output, cache = layer(
                *arguments,
                torch.from_numpy(new_lens),
                causal=True,
                cache=cache,
                head_mask=tensor(gates),
            )
        assert len(calls) == 1
        np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
        assert cache.lengths.tolist() == reference_cache.lengths.tolist()


def test_gradients_of_a_cached_call_with_a_head_mask_are_the_full_forwards():
    """From an empty cache, a cached call is one causal forward of ``valid_lens`` lengths."""
    weights, layer, inputs, rng = make(2)
    inputs = [x[:, :5] for x in inputs]
    lens = np.array([5, 2, 3])
    gates = rng.uniform(-1, 2, (3, 4))
    output_gradient = rng.standard_normal((3, 5, 16)) / np.sqrt(15)
    grads = backend.vjp(
        layer,
        *(tensor(x) for x in inputs),
        torch.from_numpy(lens),
        causal=True,
        output_gradient=tensor(output_gradient),
        cache=layer.init_cache(3, 7),
        head_mask=tensor(gates),
    )
    expected = spec.reference_gradients(
        weights,
        *inputs,
        lens,
        num_heads=4,
        causal=True,
        output_gradient=output_gradient,
        head_mask=gates.astype(np.float32),
    )
    for key in ("head_mask", "queries", "values", "W_k", "W_o", "b_v"):
        np.testing.assert_allclose(
            grads[key].numpy(), expected[key], rtol=0, atol=FLOAT32_GRAD_ATOL, err_msg=key
        )


def test_torch_compile_with_a_head_mask(compiler):
    """One graph: forward, the gates' gradient and a cached call, against the reference.
    What is checked is the trace of the gates (:data:`torch_support.TRACED`: one
    broadcast product with each head's context); inductor's numbers of the layer's
    graphs are ``test_torch_compile.py``'s."""
    weights, layer, inputs, rng = make(3)
    compiled = compiler(layer, fullgraph=True, dynamic=False, backend=TRACED)
    lens = np.array([6, 1, 4])
    gates = rng.uniform(-1, 2, (3, 4))
    output_gradient = rng.standard_normal((3, 5, 16))
    mask = tensor(gates).requires_grad_(True)
    output = compiled(*(tensor(x) for x in inputs), torch.from_numpy(lens), head_mask=mask)
    (output * tensor(output_gradient)).sum().backward()
    reference = {"num_heads": 4, "head_mask": gates.astype(np.float32)}
    expected, _ = spec.reference_forward(weights, *inputs, lens, **reference)
    np.testing.assert_allclose(output.detach().numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
    expected_grads = spec.reference_gradients(
        weights, *inputs, lens, output_gradient=output_gradient, **reference
    )
    np.testing.assert_allclose(
        mask.grad.numpy(), expected_grads["head_mask"], rtol=0, atol=FLOAT32_GRAD_ATOL
    )

    queries, keys, values = (x[:, :2] for x in inputs)
    empty = layer.init_cache(3, 4)
    with torch.no_grad():
        output, _ = compiled(
            *(tensor(x) for x in (queries, keys, values)),
            None,
            causal=True,
            cache=empty,
            head_mask=tensor(gates),
        )
    expected, _, _ = spec.reference_cached_forward(
        weights,
        queries,
        keys,
        values,
        spec.KVCache(*(x.numpy() for x in empty)),
        causal=True,
        **reference,
    )
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)


@pytest.mark.parametrize("mask_dtype", [torch.float32, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_layers_take_gates_of_any_floating_dtype(dtype, mask_dtype):
    """The gates are cast to the context's dtype; their gradient comes back in their own."""
    weights, layer, inputs, rng = make(4, dtype=dtype)
    mask_dtype = mask_dtype or dtype
    gates = rng.uniform(0, 1.5, 4)
    rounded = tensor(gates, mask_dtype).double().numpy()
    mask = tensor(gates, mask_dtype).requires_grad_(True)
    lens = np.array([2, 6, 5])
    output = layer(*(tensor(x, dtype) for x in inputs), torch.from_numpy(lens), head_mask=mask)
    output_gradient = rng.standard_normal(output.shape) / np.sqrt(15)
    (output * tensor(output_gradient, dtype)).sum().backward()
    assert output.dtype == dtype and mask.grad.dtype == mask_dtype
    # The reference from the inputs and weights as the layer holds them.
    held = {name: tensor(w, dtype).double().numpy() for name, w in weights.items()}
    inputs = [tensor(x, dtype).double().numpy() for x in inputs]
    expected, _ = spec.reference_forward(held, *inputs, lens, num_heads=4, head_mask=rounded)
    np.testing.assert_allclose(
        output.detach().double().numpy(), expected, rtol=0, atol=SIXTEEN_BIT_ATOL
    )
    expected = spec.reference_gradients(
        held, *inputs, lens, num_heads=4, output_gradient=output_gradient, head_mask=rounded
    )["head_mask"]
    np.testing.assert_allclose(mask.grad.double().numpy(), expected, rtol=0, atol=SIXTEEN_BIT_ATOL)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(3), ValueError, r"\(num_heads,\) = \(4,\) or \(batch, num_heads\) = \(3, 4\)"),
        (torch.ones(2, 4), ValueError, r"head_mask must have shape .* got \(2, 4\)"),
        (torch.ones(3, 4, 1), ValueError, "head_mask must have shape"),
        (torch.ones(4, dtype=torch.int64), TypeError, "head_mask must be a floating-point"),
        (torch.ones(4, dtype=torch.bool), TypeError, "head_mask must be a floating-point"),
        ([1.0, 1.0, 0.0, 1.0], TypeError, "head_mask must be a floating-point torch.Tensor"),
        (np.ones(4, np.float32), TypeError, "head_mask must be .* got ndarray"),
    ],
)
@pytest.mark.parametrize("cached", [False, True])
def test_bad_head_masks_are_the_specs_errors(mask, error, match, cached):
    _, layer, inputs, _ = make(5)
    inputs = [tensor(x[:, :2]) for x in inputs]
    options = {"cache": layer.init_cache(3, 4)} if cached else {}
    with pytest.raises(error, match=match):
        layer(*inputs, head_mask=mask, **options)


@pytest.mark.skipif(not backend.gpu_available() and not gpu_required(), reason="no CUDA device")
def test_gates_on_the_cpu_gate_a_gpu_layer():
    weights, layer, inputs, rng = make(6)
    gates = rng.uniform(-1, 1, 4)
    with torch.no_grad():
        output = layer.cuda()(*(tensor(x).cuda() for x in inputs), head_mask=tensor(gates))
    expected, _ = spec.reference_forward(
        weights, *inputs, num_heads=4, head_mask=gates.astype(np.float32)
    )
    np.testing.assert_allclose(output.cpu().numpy(), expected, rtol=0, atol=FLOAT32_ATOL)


# -- head_importance -------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, "inference"])
@pytest.mark.parametrize("normalize", [True, False])
def test_head_importance_is_the_references(normalize, mode):
    """In eval mode whatever the layer's, which is restored; no parameter gets a ``.grad``.
    Under ``torch.inference_mode``, of its tensors, too (it was zeros: nothing recorded
    the gates' gradient)."""
    weights, layer, _, rng = make(7, num_heads=6, num_kv_heads=3, head_dim=3)
    layer.dropout.p = 0.5
    layer.train()
    batches = hc.importance_batches(rng)
    losses = iter([tensor(g) for _, _, g in batches])

    def loss_fn(output):
        return (output * next(losses)).sum()

    context = torch.inference_mode() if mode == "inference" else contextlib.nullcontext()
    with context:  # (the batches' tensors made in it)
        importance = head_importance(
            layer,
            [(*(tensor(x) for x in arrays), torch.from_numpy(lens)) for arrays, lens, _ in batches],
            loss_fn,
            normalize=normalize,
        )
    expected = hc.reference_importance(weights, batches, num_heads=6, normalize=normalize)
    assert importance.shape == (6,) and importance.dtype == np.float64
    np.testing.assert_allclose(importance, expected, rtol=0, atol=FLOAT32_GRAD_ATOL)
    if normalize:
        assert np.linalg.norm(importance) == pytest.approx(1.0)
    assert layer.training
    assert all(parameter.grad is None for parameter in layer.parameters())


# -- pruned layers ---------------------------------------------------------------------


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "removed"), [*hc.PRUNING_CASES, (4, 1, [])])
def test_a_pruned_layer_is_the_full_one_with_those_heads_masked(num_heads, num_kv_heads, removed):
    head_dim = 3 if num_heads == 6 else None
    weights, layer, inputs, _ = make(
        9, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    gates, pruned, config = hc.prune_with_gates(
        weights, removed, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    small = set_weights(MultiHeadAttention(**config.kwargs()), pruned).eval()
    assert (small.num_heads, small.num_kv_heads) == (config.num_heads, config.num_kv_heads)
    arguments = (*(tensor(x) for x in inputs), torch.tensor([2, 6, 0]))
    with torch.no_grad():
        masked = layer(*arguments, causal=True, head_mask=tensor(gates))
        output = small(*arguments, causal=True)
    expected, _ = spec.reference_forward(
        weights, *inputs, np.array([2, 6, 0]), num_heads=num_heads, causal=True, head_mask=gates
    )
    np.testing.assert_allclose(output.numpy(), masked.numpy(), rtol=0, atol=FLOAT32_ATOL)
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
