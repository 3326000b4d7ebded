"""The PyTorch layer on a GPU: where a call reads from the device, and where it never waits for it.

Tests of a real device skip without CUDA (and fail without it where
``MHA_MULTI_REQUIRE_GPU`` is set); the others tell the facts that every tensor
is on a GPU (docs: "Fast paths", "Generating with a cache"). The numbers are
the float64 reference's.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
from route_support import answered_calls, generic_only
from torch_support import kernel_ran
from torch_support import runner as runner

from conftest import (
    device_or_skip,
    record_sdpa_key_heads,
    recording_host_moves,
    without_synchronisation,
)
from mha_multi import spec
from mha_multi.parity.cases import CASES, INPUT_NAMES
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.weights import init_weights


@pytest.fixture
def gpu():
    return device_or_skip("gpu", backend.gpu_available(), "no CUDA device")


def test_gpu_with_valid_lens_on_either_device(runner, cases, gpu):
    case = cases["lens_2d"]
    layer = runner.layer_for(case, device=gpu)
    tensors = [runner.to_native(case.inputs[n], gpu) for n in INPUT_NAMES]
    for lens_device in ("cpu", gpu):
        out = runner.forward(layer, *tensors, runner.native_lens(case.valid_lens, lens_device))
        assert out.device.type == backend.device(gpu).type
        np.testing.assert_allclose(runner.to_numpy(out), case.reference["output"], atol=5e-6)


def test_weights_round_trip_on_gpu(gpu):
    weights = init_weights(8, bias=True, seed=2)
    layer = set_weights(backend.make_layer(8, 2, bias=True, device=gpu), weights)
    assert layer.W_q.weight.device.type == backend.device(gpu).type
    got = get_weights(layer)
    assert all(got[k].tobytes() == weights[k].tobytes() for k in weights)


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
        (out, ran), syncs = _synchronisations(lambda: kernel_ran(lambda: layer(*args, causal=True)))
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
                (out, cache), ran = kernel_ran(
                    lambda x=x, y=y, cache=cache: layer(x, y, y, causal=True, cache=cache)
                )
            expected, _, held = spec.reference_cached_forward(
                weights, chunk, chunk, chunk, held, num_heads=4, num_kv_heads=2, causal=True
            )
            assert not ran, (first, end)
            np.testing.assert_array_equal(np.isnan(out.numpy()), np.isnan(expected))
            np.testing.assert_allclose(out.numpy(), expected, atol=5e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"window": 3, "alibi": True},
        {"rotary": {"theta": 100.0}, "window": 2, "softcap": 5.0, "sinks": True},
    ],
)
def test_a_ragged_step_with_options_on_gpu_is_the_generic_flows(gpu, options):
    """A ragged step whose window hides keys, with ALiBi, a soft cap or sinks, takes the
    route on a GPU (the generic path's attention, its mask and bias made on the device)
    and synchronises nothing: the generic flow's outputs and cache to the bit."""
    device = backend.device(gpu)
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, device=device, **options).eval()
    prompt = torch.randn(3, 6, 16, device=device)
    tokens = [torch.randn(3, 1, 16, device=device) for _ in range(4)]
    lengths = torch.tensor([6, 2, 4], device=device)

    def decode(step):
        outputs = []
        with torch.no_grad():
            _, cache = layer(
                prompt, prompt, prompt, lengths, causal=True, cache=layer.init_cache(3, 16)
            )
            for token in tokens:
                out, cache = step(
                    lambda token=token, cache=cache: layer(
                        token, token, token, causal=True, cache=cache
                    )
                )
                outputs.append(out)
        return (*outputs, cache.keys, cache.values, cache.lengths)

    with answered_calls() as answers:
        route = decode(without_synchronisation)
    with generic_only():
        generic = decode(lambda call: call())
    assert answers[-4:] == [True] * 4, answers
    for ours, theirs in zip(route, generic, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
