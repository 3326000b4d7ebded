"""The MXNet layer's fast route: the spec's numbers on every mask, in every dtype.

That the default call takes it, as the kernel plan says, is
tests/backends/test_fused_path.py's.
"""

from __future__ import annotations

import json
from unittest import mock

import mxnet as mx
import numpy as np
import pytest

from mha_multi import spec
from mha_multi.mxnet._ops import MXNetOps
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.parity.harness import mxnet as backend
from mha_multi.parity.runners import get_runner

#: Cases with rows that see no key (lengths <= 0, causal with Q > K) or
#: per-query masks: where a fast kernel would most likely depart from the spec.
HIDDEN_ROW_CASES = ("lens_zero", "lens_2d", "causal_more_queries", "causal_lens_2d", "one_key")
#: Grouped key/value heads (each case also hides whole rows): the fast route's
#: grouped layout must line every row's mask length up with its head.
GROUPED_CASES = ("gqa", "mqa", "head_dim")
HYBRID = get_runner("mxnet-hybrid")
IMPERATIVE = get_runner("mxnet")


@pytest.fixture(params=["mxnet", "mxnet-hybrid"])
def mxnet_runner(request):
    """The imperative layer's runner, then the hybridized one's."""
    return get_runner(request.param)


def exported_graph(tmp_path, layer, case, **kwargs):
    """The nodes and parameter shapes of ``layer``'s graph for one call on ``case``."""
    HYBRID.call(
        layer,
        *(case.inputs[n] for n in INPUT_NAMES),
        case.valid_lens,
        causal=case.config.causal,
        **kwargs,
    )
    prefix = str(tmp_path / "mha")
    layer.export(prefix)
    with open(f"{prefix}-symbol.json") as file:
        nodes = json.load(file)["nodes"]
    loaded = mx.npx.load(f"{prefix}-0000.params")  # "arg:<prefix>W_q_weight"...
    params = {"W_" + name.rsplit("_W_", 1)[-1]: value.shape for name, value in loaded.items()}
    return nodes, params


@pytest.mark.parametrize("name", GROUPED_CASES)
def test_exported_grouped_graphs_repeat_no_key_or_value(tmp_path, cases, name):
    case, config = cases[name], cases[name].config
    layer = HYBRID.layer_for(case)
    for return_attention_weights in (False, True):
        nodes, params = exported_graph(
            tmp_path, layer, case, return_attention_weights=return_attention_weights
        )
        ops = {node["op"] for node in nodes}
        assert not [op for op in ops if "repeat" in op or "tile" in op or "broadcast_to" in op]
        head_dim = params["W_q_weight"][0] // config.num_heads
        assert params["W_k_weight"][0] == params["W_v_weight"][0] == config.num_kv_heads * head_dim
        if not return_attention_weights:
            assert {"SequenceMask", "batch_dot"} <= ops and "_npi_where" not in ops


@pytest.mark.parametrize("name", GROUPED_CASES)
def test_fast_route_scores_each_key_value_head_once(cases, name):
    # One batch_dot of queries by keys per key/value head and example, its G
    # query heads stacked as rows; the weights then meet the same values.
    case, config = cases[name], cases[name].config
    inputs = [IMPERATIVE.to_native(case.inputs[n]) for n in INPUT_NAMES]
    seen = []
    original = mx.ndarray.numpy_extension.batch_dot

    def recording(a, b, *args, **kwargs):
        seen.append((a.shape, b.shape))
        return original(a, b, *args, **kwargs)

    layer = IMPERATIVE.layer_for(case)
    lens = IMPERATIVE.native_lens(case.valid_lens)
    # (The generic flow's kernel calls the ndarray operator, the plans mx.npx's name of it.)
    with (
        mock.patch.object(mx.ndarray.numpy_extension, "batch_dot", recording),
        mock.patch.object(mx.npx, "batch_dot", recording),
    ):
        output = IMPERATIVE.forward(layer, *inputs, lens, causal=config.causal)
    head_dim = layer.head_dim
    blocks, rows = config.batch * config.num_kv_heads, config.num_queries * config.num_heads
    kv_shape = (blocks, config.num_keys, head_dim)
    assert seen == [
        ((blocks, rows // config.num_kv_heads, head_dim), kv_shape),
        ((blocks, rows // config.num_kv_heads, config.num_keys), kv_shape),
    ]
    np.testing.assert_allclose(
        IMPERATIVE.to_numpy(output), case.reference["output"], rtol=0, atol=5e-6
    )


def test_exported_default_graph_masks_without_where(tmp_path, cases):
    case = cases["causal_lens_2d"]
    layer = HYBRID.layer_for(case)
    ops = {}
    for return_attention_weights in (False, True):
        HYBRID.call(
            layer,
            *(case.inputs[n] for n in INPUT_NAMES),
            case.valid_lens,
            causal=True,
            return_attention_weights=return_attention_weights,
        )
        prefix = str(tmp_path / f"mha{int(return_attention_weights)}")
        layer.export(prefix)
        with open(f"{prefix}-symbol.json") as file:
            nodes = json.load(file)["nodes"]
        ops[return_attention_weights] = {node["op"] for node in nodes}
    assert {"SequenceMask", "batch_dot"} <= ops[False]
    assert "_npi_where" not in ops[False]
    assert "_npi_where" in ops[True] and "SequenceMask" not in ops[True]


@pytest.mark.parametrize("name", HIDDEN_ROW_CASES + GROUPED_CASES)
def test_fast_route_matches_reference_with_fully_hidden_rows(mxnet_runner, cases, name):
    runner, case = mxnet_runner, cases[name]
    layer = runner.layer_for(case)
    args = (layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    with backend.kernel_spy() as calls:
        output = runner.call(*args, causal=case.config.causal)
    assert len(calls) == 1  # the fast route
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=5e-6)
    grads = runner.gradients(
        *args,
        causal=case.config.causal,
        output_gradient=case.output_gradient,
        device="cpu",
        dtype="float32",
    )
    for key, grad in grads.items():
        np.testing.assert_allclose(
            grad, case.reference[f"grad.{key}"], rtol=0, atol=5e-5, err_msg=key
        )


def test_fully_hidden_rows_are_the_mean_of_the_values(mxnet_runner, cases):
    # Hand-computed expectation: a row that sees no key has uniform weights,
    # so its output is W_o applied to the mean of the projected values.
    runner, case = mxnet_runner, cases["lens_zero"]  # lengths [0, -2, 3]
    layer = runner.layer_for(case, dtype="float64")
    out = runner.call(
        layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens, dtype="float64"
    )
    values = case.inputs["values"].astype(np.float64)
    w = {k: v.astype(np.float64) for k, v in case.weights.items()}
    for b in (0, 1):
        expected = (values[b] @ w["W_v"]).mean(axis=0) @ w["W_o"]
        np.testing.assert_allclose(out[b], np.broadcast_to(expected, out[b].shape), atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "atol", "grad_atol"), [("float64", 1e-12, 1e-12), ("float16", 2e-2, 2e-2)]
)
@pytest.mark.parametrize("name", ["lens_zero", "causal_more_queries", "gqa"])
def test_fast_route_other_dtypes(cases, name, dtype, atol, grad_atol):
    case = cases[name]
    layer = HYBRID.layer_for(case, dtype=dtype)
    arrays = [HYBRID.to_native(case.inputs[n], dtype=dtype) for n in INPUT_NAMES]
    lens = HYBRID.native_lens(case.valid_lens)
    output = HYBRID.forward(layer, *arrays, lens, causal=case.config.causal)
    assert output.dtype == backend.DTYPES[dtype]
    np.testing.assert_allclose(HYBRID.to_numpy(output), case.reference["output"], rtol=0, atol=atol)
    grads = HYBRID.vjp(
        layer,
        *arrays,
        lens,
        causal=case.config.causal,
        output_gradient=HYBRID.to_native(case.output_gradient, dtype=dtype),
    )
    for key in INPUT_NAMES:
        np.testing.assert_allclose(
            HYBRID.to_numpy(grads[key]),
            case.reference[f"grad.{key}"],
            rtol=0,
            atol=grad_atol,
            err_msg=key,
        )


@pytest.mark.parametrize(
    "name", ["book", "lens_1d_float", "causal_cross", "cross_sizes", *GROUPED_CASES]
)
def test_fast_and_generic_routes_agree(cases, name):
    # Closer to each other than to the reference: the fast route differs
    # from the generic one by where the scale is applied, a rounding.
    case = cases[name]
    layer = HYBRID.layer_for(case)
    args = (layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    fast = HYBRID.call(*args, causal=case.config.causal)
    generic, _ = HYBRID.call(*args, causal=case.config.causal, return_attention_weights=True)
    np.testing.assert_allclose(fast, case.reference["output"], rtol=0, atol=5e-6)
    np.testing.assert_allclose(fast, generic, rtol=0, atol=1e-6)


def test_fast_route_dropout_reaches_fully_hidden_rows(mxnet_runner, cases):
    # SequenceMask gives a fully hidden row the spec's uniform weights
    # *before* dropout, so dropout acts there too: the row is the mean of
    # the kept values scaled by 1/(1-p), not the plain mean.
    runner, case = mxnet_runner, cases["lens_zero"]
    config = case.config
    layer = runner.make_layer(config.num_hiddens, config.num_heads, dropout=0.5, **config.sizes())
    layer = runner.set_weights(layer, case.weights)
    args = (layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    with backend.kernel_spy() as calls:
        dropped = runner.call(*args, training=True)
    assert calls[0].mask and calls[0].dropout == 0.5  # the fast route's own dropout
    np.testing.assert_allclose(runner.call(*args), case.reference["output"], rtol=0, atol=5e-6)
    assert not np.allclose(dropped[:2], case.reference["output"][:2], atol=1e-3)


def test_adapter_fixes_fully_hidden_rows_like_numpy():
    # The adapter's fused-path operations (any_last, logical_not, mean and an
    # array fill in where) against the float64 reference adapter.
    rng = np.random.default_rng(0)
    output = rng.standard_normal((2, 3, 4, 5))
    values = rng.standard_normal((2, 3, 6, 5))
    valid_lens = np.array([[0, 2, 6, -1], [1, 0, 3, 9]])
    numpy_ops = spec.NumpyOps()
    scores = np.zeros((2, 3, 4, 6))
    visible = spec.visibility(numpy_ops, 4, 6, valid_lens, causal=True)
    expected = spec.fix_fully_hidden_rows(numpy_ops, output, values, visible, heads_axis=1)
    ops = MXNetOps(mx.nd)
    scores = mx.np.array(scores)
    got_visible = spec.visibility(
        ops, ops.size(scores, 2), ops.size(scores, 3), mx.np.array(valid_lens), causal=True
    )
    got = spec.fix_fully_hidden_rows(
        ops, mx.np.array(output), mx.np.array(values), got_visible, heads_axis=1
    )
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=0, atol=1e-15)
