"""Plain self-attention's fast route in PyTorch (docs: "Fast paths"): the generic flow's numbers.

``layer(x, x, x)`` under ``no_grad`` is answered by the facts' route, on the
host and as on a GPU, with the generic flow's output to the bit and the
float64 reference's numbers; what the route does not take (NaN inputs,
autocast, errors) is the generic flow's.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from route_support import answered_calls, generic_only
from torch_support import assert_same_nonfinite_pattern, draw_norm_weights

from conftest import recording_host_moves
from mha_multi import spec
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "num_kv_heads, options",
    [
        (4, {}),
        (2, {}),
        (2, {"rotary": {"theta": 100.0}}),
        (4, {"rotary": {"interleaved": True}}),
        (
            2,
            {
                "rotary": {
                    "scaling": {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 3}
                }
            },
        ),
        (2, {"rotary": {"theta": 100.0}, "qk_norm": {"eps": 1e-6}}),
        (4, {"qk_norm": {"scope": "whole", "unit_offset": True}}),
        (2, {"window": 2}),
        (2, {"rotary": {"theta": 100.0}, "window": 3, "alibi": True}),
    ],
    ids=[
        "mha",
        "gqa",
        "gqa-rotary",
        "mha-interleaved",
        "gqa-dynamic",
        "gqa-rotary-norms",
        "norms",
        "gqa-window",
        "gqa-rotary-window-alibi",
    ],
)
def test_plain_self_attention_takes_the_fast_route_to_the_generic_numbers(
    num_kv_heads, options, causal, dtype
):
    """``layer(x, x, x)`` under ``no_grad``: one answer of the facts' route, SDPA with the
    causal flag and no mask (a window's and ALiBi's where the layer has them), the
    generic flow's output to the bit and the reference's; a layer with rotary positions
    (at ``arange(Q)``) and query/key norms too."""
    heads = {"num_heads": 4, "num_kv_heads": num_kv_heads}
    weights = init_weights(16, bias=True, seed=21, **heads)
    layer = MultiHeadAttention(16, bias=True, dtype=dtype, **options, **heads)
    rng = np.random.default_rng(21)
    if "qk_norm" in options:
        draw_norm_weights(weights, layer, rng)
    layer = set_weights(layer, weights).eval()
    x = torch.from_numpy(rng.standard_normal((3, 5, 16))).to(dtype)
    expected, _ = spec.reference_forward(
        weights, *(x.double().numpy(),) * 3, causal=causal, **options, **heads
    )
    with answered_calls() as answers, backend.kernel_spy() as calls, torch.no_grad():
        out = layer(x, x, x, causal=causal)
    assert answers == [True]
    masked = "window" in options or "alibi" in options
    assert len(calls) == 1 and bool(calls[0].mask) == masked
    assert calls[0].is_causal == (causal and not masked)
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


#: Options a call without a cache takes on the route: SDPA's mask and bias, or (a cap,
#: sinks) the generic path's operations.
CALL_OPTIONS = {
    "softcap": {"softcap": 2.0},
    "window-sinks": {"window": 2, "sinks": True},
    "rotary-window-softcap": {"rotary": {"theta": 100.0}, "window": 3, "softcap": 3.0},
    "alibi": {"alibi": True},
}


@pytest.mark.parametrize("on_a_gpu", [False, True], ids=["host", "gpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", CALL_OPTIONS.values(), ids=CALL_OPTIONS.keys())
def test_calls_with_score_options_take_the_route_to_the_generic_numbers(options, dtype, on_a_gpu):
    """A causal call without a cache of a layer with a soft cap, sinks, a window or ALiBi:
    the route answers (on the host SDPA where it takes the options, with no 16-bit
    products; the generic path's operations where it does not, and on a GPU), with the
    generic flow's output to the bit, and in float32 and float64 the reference's."""
    heads = {"num_heads": 4, "num_kv_heads": 2}
    weights = init_weights(16, bias=True, seed=25, sinks=bool(options.get("sinks")), **heads)
    layer = MultiHeadAttention(16, bias=True, dtype=dtype, **options, **heads)
    layer = set_weights(layer, weights).eval()
    x = np.random.default_rng(25).standard_normal((2, 6, 16))
    expected, _ = spec.reference_forward(weights, x, x, x, causal=True, **options, **heads)
    x = torch.from_numpy(x).to(dtype)
    place = backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext()
    with place, torch.no_grad():
        with answered_calls() as answers:
            out = layer(x, x, x, causal=True)
        with generic_only():
            generic = layer(x, x, x, causal=True)
    generic_path = on_a_gpu or "softcap" in options or "sinks" in options
    assert answers == [generic_path or dtype != torch.bfloat16]
    assert torch.equal(out, generic)
    if dtype != torch.bfloat16:
        atol = 5e-6 if dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(out.double().numpy(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("on_a_gpu", [False, True], ids=["host", "gpu"])
@pytest.mark.parametrize("options", CALL_OPTIONS.values(), ids=CALL_OPTIONS.keys())
def test_a_call_under_inference_mode_leaves_no_plan_to_a_call_that_records(options, on_a_gpu):
    """The tables and masks a plan makes under torch.inference_mode are inference tensors,
    which a call recording gradients may not save: it makes a plan of its own, and its
    gradients are the reference's."""
    heads = {"num_heads": 4, "num_kv_heads": 2}
    weights = init_weights(16, seed=26, sinks=bool(options.get("sinks")), **heads)
    layer = set_weights(MultiHeadAttention(16, **options, **heads), weights).eval()
    x = np.random.default_rng(26).standard_normal((2, 6, 16))
    gradient = np.random.default_rng(27).standard_normal((2, 6, 16))
    expected = spec.reference_gradients(
        weights, x, x, x, causal=True, output_gradient=gradient, **options, **heads
    )
    queries = torch.from_numpy(x).float()
    place = backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext()
    with place:
        with torch.inference_mode():
            layer(queries, queries, queries, causal=True)
        queries.requires_grad_(True)
        output = layer(queries, queries, queries, causal=True)
        output.backward(torch.from_numpy(gradient).float())
    grad = queries.grad.double().numpy()
    total = expected["queries"] + expected["keys"] + expected["values"]
    np.testing.assert_allclose(grad, total, rtol=0, atol=1e-5)


def test_plain_self_attention_leaves_the_rest_to_the_generic_flow():
    """A NaN input (recording gradients or not) and autocast are not the route's: the
    reference's numbers, NaN rows where it has them; its errors are the generic flow's.
    (Calls recording gradients: ``test_training_call.py``.)"""
    weights = init_weights(16, bias=True, seed=22, num_heads=4)
    layer = set_weights(MultiHeadAttention(16, 4, bias=True), weights).eval()
    x = torch.from_numpy(np.random.default_rng(22).standard_normal((3, 5, 16)).astype(np.float32))
    x[1, 2, 7] = np.nan
    expected, _ = spec.reference_forward(weights, *(x.double().numpy(),) * 3, num_heads=4)
    with answered_calls() as answers, torch.no_grad():
        out = layer(x, x, x)
    assert answers == [False]
    assert_same_nonfinite_pattern(out.numpy(), expected)
    finite = torch.nan_to_num(x)
    with answered_calls() as answers:
        layer(x, x, x)  # records gradients, NaN read
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            layer(finite, finite, finite)
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


@pytest.mark.parametrize("recording", [False, True], ids=["no_grad", "gradients"])
@pytest.mark.parametrize("on_a_gpu", [False, True], ids=["host", "gpu"])
@pytest.mark.parametrize("options", [{}, *CALL_OPTIONS.values()], ids=["plain", *CALL_OPTIONS])
@pytest.mark.parametrize("shape", [(0, 3, 16), (2, 0, 16)], ids=["no examples", "no positions"])
def test_calls_with_an_empty_axis_are_the_generic_flows(shape, options, on_a_gpu, recording):
    """An empty batch or an empty call, recording gradients or not, is left to the generic
    flow (whose empty axes are the spec's): an empty output, and an empty gradient."""
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, **options)
    x = torch.zeros(2, 3, 16)
    layer(x, x, x)  # (sizes the lazy projections)
    x = torch.zeros(shape, requires_grad=recording)
    place = backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext()
    grad = contextlib.nullcontext() if recording else torch.no_grad()
    with place, grad, answered_calls() as answers:
        out = layer(x, x, x, causal=True)
    assert answers == [False] and out.shape == shape
    if recording:
        out.sum().backward()
        assert x.grad.shape == shape
