"""What only the PyTorch backend has: autograd checks, torch.compile, lazy sizes, devices."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from route_support import answered_calls, generic_only

from conftest import (
    device_or_skip,
    record_sdpa_key_heads,
    recording_host_moves,
    without_synchronisation,
)
from mha_multi import spec
from mha_multi.parity.cases import CASES, INPUT_NAMES
from mha_multi.parity.harness import torch as backend
from mha_multi.parity.runners import get_runner
from mha_multi.torch import MultiHeadAttention, _projections, get_weights, set_weights
from mha_multi.torch._facts import FACTS
from mha_multi.torch._guard import GUARDED_KERNEL_SCORES
from mha_multi.torch._kernel import SDPA
from mha_multi.torch._ops import OPS
from mha_multi.torch._ops import linear as _linear
from mha_multi.weights import init_weights
from tests.backends import test_edges as edges


@pytest.fixture(scope="module")
def runner():
    return get_runner("torch")


@pytest.fixture
def compiler():
    """``torch.compile`` with dynamo's caches emptied.

    Every layer shares ``forward``'s code object, whose compilations are
    limited per process; the tests here compile it for many shapes.
    """
    torch._dynamo.reset()
    yield torch.compile
    torch._dynamo.reset()


@pytest.fixture
def gpu():
    return device_or_skip("gpu", backend.gpu_available(), "no CUDA device")


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
    assert torch.autograd.gradcheck(
        lambda q, k, v: layer(q, k, v, lens, causal=case.config.causal), inputs
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


@pytest.mark.parametrize("argument", ["positions", "head_mask", "lens_1d", "lens_2d", "bias"])
def test_a_compiled_layer_takes_valid_arguments_once_lengths_vary(compiler, argument):
    """Once the queries' length has varied, ``torch.compile`` traces it as a symbol;
    a call's argument of a matching shape (positions ``(B, Q)``, gates ``(B, H)``,
    lengths ``(B,)`` or ``(B, Q)``, a bias ``(1, H, Q, K)``) must still be taken,
    with the reference's numbers (the shape checks compare sizes one by one)."""
    weights = init_weights(8, seed=31)
    layer = set_weights(MultiHeadAttention(8, 2, rotary={"theta": 100.0}), weights).eval()
    compiled = compiler(layer, fullgraph=True)
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


def _kernel_ran(run):
    """``run()``, and whether SDPA ran in it, as PyTorch's profiler records its ops."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = run()
    return result, any("scaled_dot_product" in event.key for event in profile.key_averages())


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
            out, ran = _kernel_ran(lambda args=args: compiled(*args, causal=True))
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
        out, ran = _kernel_ran(lambda: compiled(*args, causal=True))
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
            (out, cache), ran = _kernel_ran(
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
    out, ran = _kernel_ran(lambda: compiled(*tensors, torch.from_numpy(lens), causal=True))
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


def test_gpu_with_valid_lens_on_either_device(runner, cases, gpu):
    case = cases["lens_2d"]
    layer = runner.layer_for(case, device=gpu)
    tensors = [runner.to_native(case.inputs[n], gpu) for n in INPUT_NAMES]
    for lens_device in ("cpu", gpu):
        out = runner.forward(layer, *tensors, runner.native_lens(case.valid_lens, lens_device))
        assert out.device.type == backend.device(gpu).type
        np.testing.assert_allclose(runner.to_numpy(out), case.reference["output"], atol=5e-6)


def _synchronisations(run):
    """``run()`` and the host synchronisations it made, counted by PyTorch."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return result, sum("synchronizing CUDA operation" in str(w.message) for w in caught)


@pytest.mark.parametrize("name", [config.name for config in CASES])
def test_a_short_forward_on_gpu_never_synchronizes(runner, cases, gpu, name):
    """A call whose heads hold fewer than ``spec.DEVICE_READ_SCORES`` scores reads
    nothing on a GPU and takes the generic path (docs: "Fast paths").

    Every argument is on the GPU already; constants such as rotary
    frequencies are copied to the device once. Any synchronisation raises.
    """
    case = cases[name]
    assert case.inputs["queries"].shape[1] * case.inputs["keys"].shape[1] < spec.DEVICE_READ_SCORES
    layer = runner.layer_for(case, device=gpu).eval()
    tensors = [runner.to_native(case.inputs[n], gpu) for n in INPUT_NAMES]
    lens = runner.native_lens(case.valid_lens, gpu)
    options = runner.case_options(case, device=gpu)
    for weights in (False, True):
        layer(*tensors, lens, return_attention_weights=weights, **options)  # lazy state made
        out = without_synchronisation(
            lambda weights=weights: layer(
                *tensors, lens, return_attention_weights=weights, **options
            )
        )
        out = out[0] if weights else out
        np.testing.assert_allclose(runner.to_numpy(out), case.reference["output"], atol=5e-6)


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["2 heads", "1 key/value head"])
@pytest.mark.parametrize("edit", [None, "nan_query", "inf_key", "nan_value"])
def test_a_long_forward_on_gpu_reads_once_for_the_kernel(gpu, edit, num_kv_heads, monkeypatch):
    """Where a head's scores reach ``spec.DEVICE_READ_SCORES`` an eager call on a GPU
    reads once (whether the projections are finite, with the shortest length):
    SDPA for finite values, with the spec's fully hidden rows (example 0's
    lengths hide every key); the generic path and the float64 reference's
    non-finite pattern for any NaN or inf. A float32 key/value head shared by
    both query heads reaches SDPA repeated (``repeats_grouped_heads``)."""
    heads = {"num_heads": 2, "num_kv_heads": num_kv_heads}
    # A call that records no gradient reads from these scores in all (B * H * Q * K).
    monkeypatch.setattr("mha_multi.spec.plan.DEVICE_READ_TOTAL_SCORES", 2 * 2 * 256 * 256)
    weights = init_weights(8, **heads, seed=24)
    layer = MultiHeadAttention(8, 2, num_kv_heads=num_kv_heads, device=backend.device(gpu))
    layer = set_weights(layer, weights).eval()
    rng = np.random.default_rng(24)
    q, k, v = (rng.standard_normal((2, 256, 8)).astype(np.float32) for _ in range(3))
    if edit is not None:
        special = np.nan if edit.startswith("nan") else np.inf
        {"query": q, "key": k, "value": v}[edit.split("_")[1]][1, 7, 3] = special
    lens = np.array([0, 200])
    args = [torch.from_numpy(x).to(backend.device(gpu)) for x in (q, k, v, lens)]
    layer(*args, causal=True)  # lazy state made
    seen = record_sdpa_key_heads(monkeypatch)
    with torch.no_grad():
        (out, ran), syncs = _synchronisations(
            lambda: _kernel_ran(lambda: layer(*args, causal=True))
        )
    assert syncs == 1
    assert ran == (edit is None), edit
    assert seen == ([(2, False)] if ran else [])
    expected, _ = spec.reference_forward(weights, q, k, v, lens, **heads, causal=True)
    got = backend.to_numpy(out)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=str(edit))
    np.testing.assert_allclose(got, expected, atol=5e-6, err_msg=str(edit))


@pytest.mark.parametrize("recording", [True, False], ids=["recording", "no gradient"])
def test_a_call_on_a_gpu_recording_no_gradient_reads_only_where_its_scores_in_all_are_many(
    recording,
):
    """On a GPU (here the facts are told every tensor is on one) a call with lengths
    whose heads hold 256 x 256 scores reads once and runs SDPA while it records a
    gradient: its generic path would keep the weights for the backward pass. Under
    ``torch.no_grad()`` its 2 x 2 x 256 x 256 scores in all are fewer than
    ``spec.DEVICE_READ_TOTAL_SCORES``: the generic path, nothing read. The float64
    reference's numbers either way."""
    weights = init_weights(8, num_heads=2, seed=27)
    layer = set_weights(MultiHeadAttention(8, 2), weights).eval()
    x = np.random.default_rng(27).standard_normal((2, 256, 8)).astype(np.float32)
    lens = np.array([256, 100])
    assert spec.DEVICE_READ_TOTAL_SCORES > 2 * 2 * 256 * 256
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=2, causal=True)
    args = [torch.from_numpy(a) for a in (x, lens)]
    layer(args[0], args[0], args[0], args[1], causal=True)  # (lazy state made)
    recorded = contextlib.nullcontext() if recording else torch.no_grad()
    spies = backend.kernel_spy(), recording_host_moves()
    with backend.as_if_on_a_gpu(), recorded, spies[0] as calls, spies[1] as moved:
        out = layer(args[0], args[0], args[0], args[1], causal=True)
    assert len(calls) == int(recording)
    assert moved == (["tolist"] if recording else [])
    np.testing.assert_allclose(out.detach().double().numpy(), expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize("prompt_lens", [None, [2, 1]], ids=["even", "ragged"])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_a_decoding_step_on_gpu_never_synchronizes(gpu, num_kv_heads, prompt_lens):
    """A step reads no sum and no lengths (docs: "Generating with a cache").

    The new lengths are computed on the device and known on the host; a
    step's scores are few, so the generic path runs without reading the
    values. After a ragged prompt each example writes at its own position,
    with indices copied from pinned host memory, which waits for nothing.
    The outputs are the float64 cached reference's; any synchronisation
    raises.
    """
    device = backend.device(gpu)
    weights = init_weights(16, num_heads=4, num_kv_heads=num_kv_heads, seed=3)
    layer = set_weights(
        MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, device=device), weights
    ).eval()
    heads = {"num_heads": 4, "num_kv_heads": num_kv_heads}
    rng = np.random.default_rng(4)
    tokens = rng.standard_normal((2, 8, 16)).astype(np.float32)
    held = spec.KVCache(
        np.zeros((2, num_kv_heads, 10, 4)),
        np.zeros((2, num_kv_heads, 10, 4)),
        np.zeros(2, np.int64),
    )
    start = 0
    with torch.no_grad():
        cache = layer.init_cache(2, 10)
        if prompt_lens is not None:
            start, lens = 2, np.array(prompt_lens)
            x = torch.from_numpy(tokens[:, :start]).to(device)
            _, cache = layer(x, x, x, torch.from_numpy(lens).to(device), causal=True, cache=cache)
            prompt = tokens[:, :start]
            _, _, held = spec.reference_cached_forward(
                weights, prompt, prompt, prompt, held, lens, **heads, causal=True
            )
        for step in range(start, start + 6):
            x = torch.from_numpy(tokens[:, step : step + 1]).to(device)
            out, cache = without_synchronisation(
                lambda x=x, cache=cache: layer(x, x, x, causal=True, cache=cache)
            )
            row = tokens[:, step : step + 1]
            expected, _, held = spec.reference_cached_forward(
                weights, row, row, row, held, **heads, causal=True
            )
            np.testing.assert_allclose(backend.to_numpy(out), expected, atol=5e-6)


def test_rows_written_by_a_call_that_reads_nothing_reach_a_later_read(monkeypatch):
    """A cached call that reads nothing (a GPU's decoding step: ``spec.reads_values``
    false, here on the CPU) leaves its new rows to be summed on the device at the
    next write: a later call that reads sees the NaN one of them holds, and takes
    the generic path, to the float64 cached reference's numbers."""
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=26)
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2), weights).eval()
    tokens = np.random.default_rng(26).standard_normal((2, 5, 16)).astype(np.float32)
    tokens[1, 1, 3] = np.nan  # a key and a value row of example 1
    held = spec.KVCache(np.zeros((2, 2, 8, 4)), np.zeros((2, 2, 8, 4)), np.zeros(2, np.int64))
    steps = [(0, 1), (1, 2), (2, 3), (3, 5)]  # the last reads: two queries
    with torch.no_grad():
        cache = layer.init_cache(2, 8)
        for first, end in steps:
            chunk = tokens[:, first:end]
            # Distinct arrays: the generic flow, whose plan is the one that reads.
            x, y = torch.from_numpy(chunk), torch.from_numpy(chunk.copy())
            with monkeypatch.context() as patch:
                if end < 5:
                    patch.setattr(spec, "reads_values", lambda *sizes, **scores: False)
                (out, cache), ran = _kernel_ran(
                    lambda x=x, y=y, cache=cache: layer(x, y, y, causal=True, cache=cache)
                )
            expected, _, held = spec.reference_cached_forward(
                weights, chunk, chunk, chunk, held, num_heads=4, num_kv_heads=2, causal=True
            )
            assert not ran, (first, end)
            np.testing.assert_array_equal(np.isnan(out.numpy()), np.isnan(expected))
            np.testing.assert_allclose(out.numpy(), expected, atol=5e-6)


def test_weights_round_trip_on_gpu(gpu):
    weights = init_weights(8, bias=True, seed=2)
    layer = set_weights(backend.make_layer(8, 2, bias=True, device=gpu), weights)
    assert layer.W_q.weight.device.type == backend.device(gpu).type
    got = get_weights(layer)
    assert all(got[k].tobytes() == weights[k].tobytes() for k in weights)


def test_dropout_with_possibly_hidden_rows_takes_the_generic_path(runner, cases):
    case = cases["lens_zero"]
    config = case.config
    layer = runner.make_layer(config.num_hiddens, config.num_heads, dropout=0.5, **config.sizes())
    layer = runner.set_weights(layer, case.weights)
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    with backend.kernel_spy() as calls:
        runner.call(layer, *inputs, case.valid_lens, training=True)
    assert calls == []
    with backend.kernel_spy() as calls:
        runner.call(layer, *inputs, training=True)
    assert len(calls) == 1 and calls[0].dropout == 0.5  # SDPA applies the dropout itself


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
    "change", ["set_weights", "optimizer", "data", "data in place", "replaced", "converted"]
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
        elif change == "data in place":
            layer.W_v.weight.data.mul_(2)
        elif change == "replaced":
            layer.W_v.weight = torch.nn.Parameter(torch.randn_like(layer.W_v.weight))
        else:
            with torch.no_grad():
                layer.W_v.weight.mul_(2)
            layer.double().float()
        weights = get_weights(layer)
    assert not np.array_equal(weights["W_v"], case.weights["W_v"])
    expected, _ = spec.reference_forward(weights, x, x, x, None, num_heads=num_heads)
    for mode in (torch.no_grad, torch.inference_mode):  # no_grad first: as the last call
        with mode():
            np.testing.assert_allclose(layer(x, x, x).numpy(), expected, atol=5e-6)


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


# -- grouped key/value heads ----------------------------------------------------


def sdpa_spy():
    """``scaled_dot_product_attention`` wrapped, so that its operands can be read."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", wraps=sdpa)


@pytest.mark.parametrize("name", ["gqa", "mqa", "head_dim"])
def test_sdpa_takes_grouped_heads_unrepeated(runner, cases, name):
    case, config = cases[name], cases[name].config
    with sdpa_spy() as spy:
        out = runner.call(
            runner.layer_for(case),
            *(case.inputs[n] for n in INPUT_NAMES),
            case.valid_lens,
            causal=config.causal,
        )
    spy.assert_called_once()
    query, key, value = spy.call_args.args[:3]
    head_dim = query.shape[-1]
    assert query.shape == (config.batch, config.num_heads, config.num_queries, head_dim)
    kv_shape = (config.batch, config.num_kv_heads, config.num_keys, head_dim)
    assert key.shape == value.shape == kv_shape
    assert spy.call_args.kwargs["enable_gqa"] is True
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


def test_sdpa_gets_no_grouping_argument_for_multi_head_attention(runner, cases):
    case = cases["lens_1d"]
    with sdpa_spy() as spy:
        runner.call(runner.layer_for(case), *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    spy.assert_called_once()
    assert "enable_gqa" not in spy.call_args.kwargs  # PyTorch before 2.5 has no such argument


@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_sdpa_without_grouped_heads_gets_them_repeated_once(runner, cases, name):
    """The route of a PyTorch whose SDPA has no ``enable_gqa``: the plan's ``repeat_kv``."""
    case, config = cases[name], cases[name].config
    without_groups = dataclasses.replace(SDPA, takes_grouped_heads=False)
    with mock.patch.object(FACTS, "kernel", without_groups), sdpa_spy() as spy:
        out = runner.call(
            runner.layer_for(case),
            *(case.inputs[n] for n in INPUT_NAMES),
            case.valid_lens,
            causal=config.causal,
        )
    spy.assert_called_once()
    query, key = spy.call_args.args[:2]
    assert key.shape[1] == query.shape[1] == config.num_heads
    assert "enable_gqa" not in spy.call_args.kwargs
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


@pytest.mark.parametrize("name", ["gqa", "mqa", "head_dim"])
def test_torch_compile_grouped_heads_match_reference(runner, cases, name, compiler):
    case = cases[name]
    layer = runner.layer_for(case)
    compiled = compiler(layer, fullgraph=True)
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    kwargs = {"causal": case.config.causal}
    out = runner.call(compiled, *inputs, case.valid_lens, **kwargs)
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)
    out, weights = runner.call(
        compiled, *inputs, case.valid_lens, return_attention_weights=True, **kwargs
    )
    np.testing.assert_allclose(weights, case.reference["attention_weights"], rtol=0, atol=5e-6)
    tensors = [runner.to_native(x).requires_grad_(True) for x in inputs]
    compiled(*tensors, runner.native_lens(case.valid_lens), **kwargs).backward(
        runner.to_native(case.output_gradient)
    )
    np.testing.assert_allclose(
        tensors[1].grad.numpy(), case.reference["grad.keys"], rtol=0, atol=5e-5
    )
    np.testing.assert_allclose(
        layer.W_v.weight.grad.T.numpy(), case.reference["grad.W_v"], rtol=0, atol=5e-5
    )


def test_lazy_sizes_with_grouped_heads_and_head_dim(runner):
    rng = np.random.default_rng(0)
    layer = MultiHeadAttention(10, 4, num_kv_heads=2, head_dim=3)
    assert (layer.num_kv_heads, layer.head_dim) == (2, 3)
    assert "num_kv_heads=2, head_dim=3" in repr(layer)
    q, k, v = (runner.to_native(rng.standard_normal(s)) for s in [(2, 3, 7), (2, 5, 4), (2, 5, 6)])
    assert layer(q, k, v).shape == (2, 3, 10)
    shapes = {name: array.shape for name, array in get_weights(layer).items()}
    assert shapes == {"W_q": (7, 12), "W_k": (4, 6), "W_v": (6, 6), "W_o": (12, 10)}


def test_set_weights_fixes_lazy_sizes_with_grouped_heads(runner, cases):
    case = cases["head_dim"]
    config = case.config
    layer = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=True, **config.heads())
    layer = set_weights(layer, case.weights)
    assert layer.input_sizes() == {"query_size": 6, "key_size": 10, "value_size": 10}
    out = runner.call(layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


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


# -- plain self-attention's fast route (docs: "Fast paths") -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "num_kv_heads, rotary",
    [
        (4, None),
        (2, None),
        (2, {"theta": 100.0}),
        (4, {"interleaved": True}),
        (2, {"scaling": {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 3}}),
    ],
    ids=["mha", "gqa", "gqa-rotary", "mha-interleaved", "gqa-dynamic"],
)
def test_plain_self_attention_takes_the_fast_route_to_the_generic_numbers(
    num_kv_heads, rotary, causal, dtype
):
    """``layer(x, x, x)`` under ``no_grad``: one answer of the facts' route, SDPA with the
    causal flag and no mask, the generic flow's output to the bit and the reference's;
    a layer whose one option is rotary too (at ``arange(Q)``)."""
    heads = {"num_heads": 4, "num_kv_heads": num_kv_heads}
    weights = init_weights(16, bias=True, seed=21, **heads)
    layer = MultiHeadAttention(16, bias=True, dtype=dtype, rotary=rotary, **heads)
    layer = set_weights(layer, weights).eval()
    x = torch.from_numpy(np.random.default_rng(21).standard_normal((3, 5, 16))).to(dtype)
    expected, _ = spec.reference_forward(
        weights, *(x.double().numpy(),) * 3, causal=causal, rotary=rotary, **heads
    )
    with answered_calls() as answers, backend.kernel_spy() as calls, torch.no_grad():
        out = layer(x, x, x, causal=causal)
    assert answers == [True]
    assert len(calls) == 1 and not calls[0].mask and calls[0].is_causal == causal
    atol = 5e-6 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=0, atol=atol)
    with generic_only(), torch.no_grad():
        assert torch.equal(out, layer(x, x, x, causal=causal))


@pytest.mark.parametrize(
    "num_queries, nan, many_in_all",
    [(5, False, True), (5, True, True), (256, False, True), (256, False, False)],
    ids=["short", "NaN", "long", "long, few in all"],
)
@pytest.mark.parametrize("causal", [False, True])
def test_plain_self_attention_on_a_gpu_reads_only_where_scores_are_many(
    num_queries, nan, many_in_all, causal, monkeypatch
):
    """On a GPU a call whose heads hold fewer than ``spec.DEVICE_READ_SCORES`` scores,
    or (recording no gradient) fewer than ``spec.DEVICE_READ_TOTAL_SCORES`` in all,
    takes the route's generic path, reading nothing and making no tensor of host data
    (a NaN input too: the reference's NaN rows); a longer one reads once and runs SDPA
    (``many_in_all``: the scores in all read from set to this call's). The generic
    flow's output to the bit, and the reference's numbers."""
    if many_in_all:
        monkeypatch.setattr("mha_multi.spec.plan.DEVICE_READ_TOTAL_SCORES", 2 * 4 * num_queries**2)
    heads = {"num_heads": 4, "num_kv_heads": 2}
    weights = init_weights(16, bias=True, seed=23, **heads)
    layer = set_weights(MultiHeadAttention(16, bias=True, **heads), weights).eval()
    x = np.random.default_rng(23).standard_normal((2, num_queries, 16)).astype(np.float32)
    if nan:
        x[1, 2, 7] = np.nan
    expected, _ = spec.reference_forward(
        weights, *(x.astype(np.float64),) * 3, causal=causal, **heads
    )
    x = torch.from_numpy(x)
    short = not spec.reads_values(
        False, num_queries, num_queries, total_scores=2 * 4 * num_queries**2
    )
    assert short == (num_queries == 5 or not many_in_all)
    with backend.as_if_on_a_gpu(), torch.no_grad():
        layer(x, x, x, causal=causal)  # (the first call of a shape runs the checks)
        spies = answered_calls(), backend.kernel_spy(), recording_host_moves()
        with spies[0] as answers, spies[1] as calls, spies[2] as moved:
            out = layer(x, x, x, causal=causal)
        with generic_only():
            generic = layer(x, x, x, causal=causal)
        torch.testing.assert_close(out, generic, rtol=0, atol=0, equal_nan=True)
    assert answers == [not nan or short]
    if short:
        assert calls == [] and moved == []
    else:
        # The one read (with the largest query and key where the causal flag hides
        # keys), then SDPA.
        assert len(calls) == 1 and moved == ["tolist" if causal else "item"]
    assert_same_nonfinite_pattern(out.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    "heads", [{"num_heads": 4}, {"num_heads": 4, "num_kv_heads": 1}], ids=["mha", "gqa"]
)
def test_plain_calls_on_a_gpu_in_other_dtypes_give_the_generic_flows_numbers(dtype, heads):
    """A GPU's plain call (the generic path's attention, nothing read) in 16 and 64 bits,
    rotary and causal: the generic flow's numbers to the bit, and in float64 the
    reference's."""
    rotary = {"theta": 100.0}
    weights = init_weights(16, bias=True, seed=24, **heads)
    layer = MultiHeadAttention(16, bias=True, dtype=dtype, rotary=rotary, **heads)
    layer = set_weights(layer, weights).eval()
    x = np.random.default_rng(24).standard_normal((2, 6, 16))
    expected, _ = spec.reference_forward(weights, x, x, x, causal=True, rotary=rotary, **heads)
    x = torch.from_numpy(x).to(dtype)
    with backend.as_if_on_a_gpu(), torch.no_grad():
        with answered_calls() as answers:
            out = layer(x, x, x, causal=True)
        with generic_only():
            generic = layer(x, x, x, causal=True)
    assert answers == [True]
    assert torch.equal(out, generic)
    if dtype == torch.float64:
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_plain_self_attention_leaves_the_rest_to_the_generic_flow():
    """A NaN input, gradients and autocast are not the route's: the reference's numbers,
    NaN rows where it has them; its errors are the generic flow's."""
    weights = init_weights(16, bias=True, seed=22, num_heads=4)
    layer = set_weights(MultiHeadAttention(16, 4, bias=True), weights).eval()
    x = torch.from_numpy(np.random.default_rng(22).standard_normal((3, 5, 16)).astype(np.float32))
    x[1, 2, 7] = np.nan
    expected, _ = spec.reference_forward(weights, *(x.double().numpy(),) * 3, num_heads=4)
    with answered_calls() as answers, torch.no_grad():
        out = layer(x, x, x)
    assert answers == [False]
    assert_same_nonfinite_pattern(out.numpy(), expected)
    with answered_calls() as answers:
        layer(x, x, x)  # records gradients
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            layer(x, x, x)
    assert answers == [False, False]
    for kind, wrong in (
        (TypeError, x.double()),
        (ValueError, torch.zeros(3, 5, 17)),
        (TypeError, x.numpy()),
    ):
        messages = []
        for route in (generic_only(), answered_calls()):
            with route, pytest.raises(kind) as error, torch.no_grad():
                layer(wrong, wrong, wrong)
            messages.append(str(error.value))
        assert messages[0] == messages[1]


# A non-finite key that lengths hide is tests/backends/test_fused_path.py's.
@pytest.mark.parametrize("where", ["query", "W_q"])
def test_nonfinite_projections_take_the_generic_path(runner, where):
    """Without lengths SDPA's CPU kernel returned zeros for a NaN query row."""
    weights, layer = edge_layer()
    queries, keys, values = edge_inputs()
    if where == "query":
        queries[0, 1, 2] = np.nan
    else:
        weights = {**weights, "W_q": weights["W_q"].copy()}
        weights["W_q"][3, 0] = np.inf
        set_weights(layer, weights)
    expected, _ = spec.reference_forward(weights, queries, keys, values, num_heads=2)
    with backend.kernel_spy() as calls:
        out = runner.call(layer, queries, keys, values)
    assert calls == []
    assert_same_nonfinite_pattern(out, expected)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_empty_axes_take_the_generic_path(runner, shape):
    batch, num_queries, num_keys = shape
    weights, layer = edge_layer()
    inputs = edge_inputs(num_queries, num_keys, batch)
    expected, _ = spec.reference_forward(weights, *inputs, np.ones(batch), num_heads=2)
    with backend.kernel_spy() as calls:
        out = runner.call(layer, *inputs, np.ones(batch, np.float32))
    assert calls == []
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)


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
def test_integer_lengths_are_compared_in_int64(runner, valid_lens):
    """Narrow lengths are widened before meeting key positions up to 199 (int8 wraps at 128)."""
    weights, layer = edge_layer()
    inputs = edge_inputs(2, 200)
    as_int64 = np.array(
        valid_lens.tolist() if hasattr(valid_lens, "tolist") else valid_lens, dtype=object
    )
    as_int64 = np.clip(as_int64, -1, 200).astype(np.int64)
    expected, expected_weights = spec.reference_forward(weights, *inputs, as_int64, num_heads=2)
    tensors = [runner.to_native(x) for x in inputs]
    out = runner.forward(layer, *tensors, valid_lens)
    generic, attention_weights = runner.forward(
        layer, *tensors, valid_lens, return_attention_weights=True
    )
    for got in (out, generic):
        np.testing.assert_allclose(runner.to_numpy(got), expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(
        runner.to_numpy(attention_weights), expected_weights, rtol=0, atol=5e-6
    )


COMPILED_EDGES = {
    "nan_query": (lambda q, k, v: q.__setitem__((0, 1, 2), np.nan), None),
    "inf_in_hidden_key": (lambda q, k, v: k.__setitem__((0, 4, 1), np.inf), np.array([3, 5])),
    "nan_lengths": (lambda q, k, v: None, np.array([np.nan, 0.0])),
    "uint64_lengths": (lambda q, k, v: None, np.array([2**63 + 5, 2], np.uint64)),
}


@pytest.mark.parametrize("name", sorted(COMPILED_EDGES))
def test_torch_compile_edge_inputs_match_reference(runner, name, compiler):
    """Compiled graphs cannot branch on values; the path they take must be exact for any."""
    edit, valid_lens = COMPILED_EDGES[name]
    weights, layer = edge_layer()
    inputs = edge_inputs()
    edit(*inputs)
    reference_lens = None if valid_lens is None else np.clip(valid_lens, None, 5)
    compiled = compiler(layer, fullgraph=True)
    for causal in (False, True):
        expected, _ = spec.reference_forward(
            weights, *inputs, reference_lens, num_heads=2, causal=causal
        )
        out = runner.call(compiled, *inputs, valid_lens, causal=causal)
        assert_same_nonfinite_pattern(out, expected)


def test_torch_compile_empty_keys_and_gradients(runner, compiler):
    weights, layer = edge_layer()
    inputs = edge_inputs(num_keys=0)
    output_gradient = np.ones((2, 3, 8))
    expected = spec.reference_gradients(
        weights, *inputs, np.array([1, 2]), num_heads=2, output_gradient=output_gradient
    )
    compiled = compiler(layer, fullgraph=True)
    tensors = [runner.to_native(x).requires_grad_(True) for x in inputs]
    out = compiled(*tensors, torch.tensor([1, 2]))
    np.testing.assert_allclose(
        out.detach().numpy(), np.broadcast_to(weights["b_o"], (2, 3, 8)), rtol=0, atol=5e-6
    )
    out.backward(runner.to_native(output_gradient))
    np.testing.assert_allclose(layer.W_o.bias.grad.numpy(), expected["b_o"], atol=5e-5)
    np.testing.assert_allclose(tensors[0].grad.numpy(), expected["queries"], atol=5e-5)
    assert tensors[1].grad.shape == (2, 0, 8)


@pytest.mark.parametrize("call", ["self-attention", "prefill", "step"])
def test_float32_grouped_heads_on_cuda_reach_sdpa_repeated(monkeypatch, call):
    """On CUDA the one SDPA kernel that takes float32 grouped heads holds every score:
    grouped heads of more queries than ``head_dim`` reach SDPA repeated
    (``repeats_grouped_heads``, told here that the CPU is CUDA), a decoding step's
    as they are; the numbers are the float64 reference's either way."""
    import mha_multi.torch._facts as facts_module

    def as_on_cuda(q, num_queries, head_dim, dtype=None):
        return (dtype or q.dtype) == torch.float32 and num_queries > head_dim

    monkeypatch.setattr(facts_module, "repeats_grouped_heads", as_on_cuda)
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=31)
    heads = {"num_heads": 4, "num_kv_heads": 2}
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2), weights).eval()
    x = np.random.default_rng(31).standard_normal((2, 7, 16)).astype(np.float32)
    seen = record_sdpa_key_heads(monkeypatch)
    prompt, row = x[:, :6], x[:, 6:]
    with torch.no_grad():
        if call == "self-attention":
            tensor = torch.from_numpy(prompt)
            output = layer(tensor, tensor, tensor, causal=True)
            expected, _ = spec.reference_forward(
                weights, prompt, prompt, prompt, **heads, causal=True
            )
        else:
            cache = layer.init_cache(2, 8)
            tensor = torch.from_numpy(prompt)
            output, cache = layer(tensor, tensor, tensor, causal=True, cache=cache)
            expected, _, held = spec.reference_cached_forward(
                weights,
                prompt,
                prompt,
                prompt,
                spec.KVCache(np.zeros((2, 2, 8, 4)), np.zeros((2, 2, 8, 4)), np.zeros(2, np.int64)),
                **heads,
                causal=True,
            )
            if call == "step":
                seen.clear()
                tensor = torch.from_numpy(row)
                output, _ = layer(tensor, tensor, tensor, causal=True, cache=cache)
                expected, _, _ = spec.reference_cached_forward(
                    weights, row, row, row, held, **heads, causal=True
                )
    # Six queries of four dimensions: repeated to the query heads; one query: grouped.
    assert seen == ([(2, True)] if call == "step" else [(4, False)])
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=5e-6)
