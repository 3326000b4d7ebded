"""The PyTorch layer under ``torch.compile``: the reference's numbers, SDPA only behind its guard.

One graph (``fullgraph=True``) per call: the parity cases, arguments taken
once the queries' length is a symbol, long calls whose kernel a guard admits
only for exact values, a cached prefill, and the backward pass. Compiled edge
inputs are ``test_torch_edges.py``'s, compiled grouped heads
``test_torch_grouped_heads.py``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from option_cases import LENGTH_DEPENDENT_ROTARY
from torch_support import TRACED, kernel_ran
from torch_support import compiler as compiler
from torch_support import runner as runner

from mha_multi import spec
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.torch._guard import GUARDED_KERNEL_SCORES
from mha_multi.weights import init_weights
from tests.backends import test_edges as edges


@pytest.mark.parametrize("name", ["book", "causal_lens_2d", "lens_1d_float"])
def test_torch_compile_matches_reference(runner, cases, name, compiler):
    case = cases[name]
    compiled = compiler(runner.layer_for(case), fullgraph=True)
    out, weights = runner.call(
        compiled,
        *(case.inputs[n] for n in INPUT_NAMES),
        case.valid_lens,
        causal=case.config.causal,
        return_attention_weights=True,
    )
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(weights, case.reference["attention_weights"], atol=5e-6)


@pytest.mark.parametrize("name", ["lens_zero", "causal_more_queries", "lens_overlong"])
def test_torch_compile_default_call_matches_reference(runner, cases, name, compiler):
    case = cases[name]
    compiled = compiler(runner.layer_for(case), fullgraph=True)
    out = runner.call(
        compiled,
        *(case.inputs[n] for n in INPUT_NAMES),
        case.valid_lens,
        causal=case.config.causal,
    )
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)


@pytest.mark.parametrize("argument", ["positions", "head_mask", "lens_1d", "lens_2d", "bias"])
def test_a_compiled_layer_takes_valid_arguments_once_lengths_vary(compiler, argument):
    """Once the queries' length has varied, ``torch.compile`` traces it as a symbol;
    a call's argument of a matching shape (positions ``(B, Q)``, gates ``(B, H)``,
    lengths ``(B,)`` or ``(B, Q)``, a bias ``(1, H, Q, K)``) must still be taken,
    with the reference's numbers (the shape checks compare sizes one by one). What is
    checked is the trace (:data:`torch_support.TRACED`); inductor's numbers are the
    tests' above."""
    weights = init_weights(8, seed=31)
    layer = set_weights(MultiHeadAttention(8, 2, rotary={"theta": 100.0}), weights).eval()
    compiled = compiler(layer, fullgraph=True, backend=TRACED)
    rng = np.random.default_rng(31)
    for length in (2, 3):  # (the queries' length is a symbol from here on)
        x = torch.from_numpy(rng.standard_normal((3, length, 8)).astype(np.float32))
        with torch.no_grad():
            compiled(x, x, x)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    given = {
        "positions": {"positions": np.array([[4, 5], [0, 1], [7, 9]])},
        "head_mask": {"head_mask": rng.random((3, 2)).astype(np.float32)},
        "lens_1d": {"valid_lens": np.array([1, 2, 0])},
        "lens_2d": {"valid_lens": np.array([[1, 2], [0, 1], [2, 2]])},
        "bias": {"bias": rng.standard_normal((1, 2, 2, 2)).astype(np.float32)},
    }[argument]
    expected, _ = spec.reference_forward(
        weights, x, x, x, num_heads=2, rotary={"theta": 100.0}, **given
    )
    t = torch.from_numpy(x)
    with torch.no_grad():
        out = compiled(t, t, t, **{name: torch.from_numpy(a) for name, a in given.items()})
    np.testing.assert_allclose(out.numpy(), expected, atol=5e-6)


@pytest.mark.parametrize("scaling", sorted(LENGTH_DEPENDENT_ROTARY))
def test_a_call_rotated_by_its_length_is_one_graph(compiler, scaling):
    """Dynamic NTK and LongRoPE frequencies depend on a call's length, a number on the
    host where shapes are static: computed in Python's numbers, which the trace
    evaluates (numpy's 0-d arrays broke ``fullgraph``), within and beyond the original
    context, to the reference's numbers."""
    rotary = {"theta": 100.0, "scaling": LENGTH_DEPENDENT_ROTARY[scaling]}
    weights = init_weights(8, seed=5)
    layer = set_weights(MultiHeadAttention(8, 2, rotary=rotary), weights).eval()
    compiled = compiler(layer, fullgraph=True, dynamic=False, backend="eager")
    rng = np.random.default_rng(5)
    for length in (3, 7):
        x = rng.standard_normal((2, length, 8)).astype(np.float32)
        expected, _ = spec.reference_forward(
            weights, x, x, x, num_heads=2, rotary=rotary, causal=True
        )
        t = torch.from_numpy(x)
        with torch.no_grad():
            out = compiled(t, t, t, causal=True)
        np.testing.assert_allclose(out.numpy(), expected, atol=5e-6)


# -- long calls: SDPA behind a guard on the device -----------------------------


def test_a_compiled_long_call_takes_the_kernel_only_where_the_values_are_exact(compiler):
    """``torch.compile(fullgraph=True)``: one graph, SDPA behind a guard on the device.

    Finite projections take the kernel, with the spec's fully hidden rows
    (example 0's lengths hide every key); any NaN or inf takes the generic
    branch, with the float64 reference's non-finite pattern. ``Q * K`` is
    ``GUARDED_KERNEL_SCORES``, where a compiled call starts to guard.
    """
    weights = init_weights(8, seed=21)
    layer = set_weights(MultiHeadAttention(8, 2), weights).eval()
    compiled = compiler(layer, fullgraph=True)
    assert GUARDED_KERNEL_SCORES == 256 * 256
    lens = np.array([0, 200])
    for edit in (None, "nan_query", "inf_key", "nan_value", "inf_value"):
        rng = np.random.default_rng(21)
        q, k, v = (rng.standard_normal((2, 256, 8)).astype(np.float32) for _ in range(3))
        if edit is not None:
            special = np.nan if edit.startswith("nan") else np.inf
            {"query": q, "key": k, "value": v}[edit.split("_")[1]][1, 7, 3] = special
        args = [torch.from_numpy(x) for x in (q, k, v, lens)]
        with torch.no_grad():
            out, ran = kernel_ran(lambda args=args: compiled(*args, causal=True))
        assert ran == (edit is None), edit
        expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=2, causal=True)
        assert (edit is None) == bool(np.isfinite(expected).all())
        np.testing.assert_allclose(out.numpy(), expected, atol=5e-6, err_msg=str(edit))


def test_a_compiled_long_call_takes_the_generic_branch_for_scores_below_the_mask_value(
    compiler,
):
    """Every visible score ``-4.5e6``, below the ``-1e6`` the spec gives hidden keys:
    the guard's bound on ``max|q| * max|k|`` sends the call to the generic branch,
    whose rows average their hidden keys' values as the reference's do."""
    weights, x = edges.scores_below_the_mask_value(2, 256)
    layer = set_weights(MultiHeadAttention(4, 1), weights).eval()
    compiled = compiler(layer, fullgraph=True)
    lens = np.array([100, 200])
    args = [torch.from_numpy(a) for a in (x, x, x, lens)]
    with torch.no_grad():
        compiled(*args, causal=True)  # (compiling runs the kernel once)
        out, ran = kernel_ran(lambda: compiled(*args, causal=True))
    assert not ran
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=1, causal=True)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-3)


def test_a_compiled_cached_prefill_takes_the_kernel_only_where_the_values_are_exact(compiler):
    """A prompt written into a cache in one compiled call: grouped heads over the
    cache's ``max_length`` keys (``Q * K`` past the threshold), the float64
    cached reference's numbers and cache, SDPA only for finite values."""
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=23)
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2), weights).eval()
    compiled = compiler(layer, fullgraph=True)
    empty = spec.KVCache(np.zeros((2, 2, 320, 4)), np.zeros((2, 2, 320, 4)), np.zeros(2, np.int64))
    for special in (None, np.inf):
        prompt = np.random.default_rng(23).standard_normal((2, 256, 16)).astype(np.float32)
        if special is not None:
            prompt[1, 9, 5] = special
        x = torch.from_numpy(prompt)
        with torch.no_grad():
            (out, cache), ran = kernel_ran(
                lambda x=x: compiled(x, x, x, causal=True, cache=layer.init_cache(2, 320))
            )
        assert ran == (special is None)
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, prompt, prompt, prompt, empty, num_heads=4, num_kv_heads=2, causal=True
        )
        np.testing.assert_allclose(out.numpy(), expected, atol=5e-6)
        for got, want in zip(cache, expected_cache, strict=True):
            np.testing.assert_allclose(got.numpy(), want, atol=5e-6)


def test_a_compiled_long_call_differentiates_through_the_guarded_kernel(compiler):
    """The backward pass of the guarded graph compiles and gives the reference's gradients."""
    weights = init_weights(8, seed=22)
    layer = set_weights(MultiHeadAttention(8, 2), weights)
    rng = np.random.default_rng(22)
    inputs = [rng.standard_normal((2, 256, 8)) for _ in range(3)]
    lens = np.array([0, 200])
    output_gradient = rng.standard_normal((2, 256, 8))
    tensors = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in inputs]
    compiled = compiler(layer, fullgraph=True)
    out, ran = kernel_ran(lambda: compiled(*tensors, torch.from_numpy(lens), causal=True))
    out.backward(torch.tensor(output_gradient, dtype=torch.float32))
    assert ran
    expected = spec.reference_gradients(
        weights, *inputs, lens, num_heads=2, causal=True, output_gradient=output_gradient
    )
    for name, tensor in zip(INPUT_NAMES, tensors, strict=True):
        np.testing.assert_allclose(tensor.grad.numpy(), expected[name], atol=2e-5, err_msg=name)
    np.testing.assert_allclose(
        layer.W_k.weight.grad.numpy().T, expected["W_k"], atol=2e-4, err_msg="W_k"
    )
