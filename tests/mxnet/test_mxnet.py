"""What only the MXNet backend has: hybridize, export, deferred sizes, Gluon training, devices."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from conftest import device_or_skip
from mha_multi import spec
from mha_multi.mxnet import MultiHeadAttention, _facts, get_weights, set_weights
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.parity.harness import mxnet as backend
from mha_multi.parity.runners import get_runner
from mha_multi.weights import init_weights

IMPERATIVE = get_runner("mxnet")
HYBRID = get_runner("mxnet-hybrid")


@pytest.fixture(params=["mxnet", "mxnet-hybrid"])
def mxnet_runner(request):
    """The imperative layer's runner, then the hybridized one's."""
    return get_runner(request.param)


def assert_reference(case, output, weights=None, atol=5e-6):
    """``output`` (and ``weights``), MXNet arrays or float64 numpy, against the case's reference."""
    np.testing.assert_allclose(
        backend.to_numpy(output), case.reference["output"], rtol=0, atol=atol
    )
    if weights is not None:
        np.testing.assert_allclose(
            backend.to_numpy(weights), case.reference["attention_weights"], rtol=0, atol=atol
        )


@pytest.mark.parametrize(
    "name", ["book", "causal_lens_2d", "lens_1d_float", "cross_sizes", "gqa", "head_dim"]
)
def test_hybridized_equals_imperative(cases, name):
    case = cases[name]
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    kwargs = {"causal": case.config.causal, "return_attention_weights": True}
    eager = IMPERATIVE.call(IMPERATIVE.layer_for(case), *inputs, case.valid_lens, **kwargs)
    hybrid_layer = HYBRID.layer_for(case)
    for _ in range(2):  # the first call builds the graph, the second runs the cached one
        hybrid = HYBRID.call(hybrid_layer, *inputs, case.valid_lens, **kwargs)
        for got, want in zip(hybrid, eager, strict=True):
            np.testing.assert_array_equal(got, want)
    assert_reference(case, *hybrid)


def test_alternating_configurations_share_parameters(cases):
    # One hybridized layer, four graphs: each keeps its own cache, all read
    # the same parameters.
    case = cases["causal_cross"]
    layer = HYBRID.layer_for(case)
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    weights = case.weights
    for _ in range(2):
        for valid_lens in (None, case.valid_lens):
            for causal in (False, True):
                out = HYBRID.call(layer, *inputs, valid_lens, causal=causal)
                expected, _ = spec.reference_forward(
                    weights,
                    *inputs,
                    valid_lens,
                    num_heads=case.config.num_heads,
                    causal=causal,
                )
                np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)
    assert len(list(layer.collect_params().keys())) == 4
    # New weights are seen by every cached graph.
    weights = init_weights(16, seed=5)
    set_weights(layer, weights)
    expected, _ = spec.reference_forward(weights, *inputs, num_heads=4)
    np.testing.assert_allclose(HYBRID.call(layer, *inputs), expected, rtol=0, atol=5e-6)


# SymbolBlock.imports warns that it cannot tell the inputs' dtypes before a call.
@pytest.mark.filterwarnings("ignore:Cannot decide type")
@pytest.mark.parametrize("name", ["causal_lens_2d", "lens_none", "cross_sizes", "mqa"])
def test_export_and_symbolblock_imports(tmp_path, cases, name):
    case = cases[name]
    layer = HYBRID.layer_for(case)
    inputs = [HYBRID.to_native(case.inputs[n]) for n in INPUT_NAMES]
    valid_lens = HYBRID.native_lens(case.valid_lens)
    output, weights = HYBRID.forward(
        layer, *inputs, valid_lens, causal=case.config.causal, return_attention_weights=True
    )
    prefix = str(tmp_path / "mha")
    layer.export(prefix)
    names = ["data0", "data1", "data2"] + ([] if valid_lens is None else ["data3"])
    imported = gluon.SymbolBlock.imports(f"{prefix}-symbol.json", names, f"{prefix}-0000.params")
    args = inputs if valid_lens is None else [*inputs, valid_lens]
    got_output, got_weights = imported(*args)
    np.testing.assert_array_equal(got_output.asnumpy(), output.asnumpy())
    np.testing.assert_array_equal(got_weights.asnumpy(), weights.asnumpy())
    assert_reference(case, got_output, got_weights)


def test_export_needs_a_hybridized_call(tmp_path, cases):
    case = cases["book"]
    layer = IMPERATIVE.layer_for(case)
    IMPERATIVE.call(layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    with pytest.raises(RuntimeError, match="hybridize"):
        layer.export(str(tmp_path / "mha"))


def test_a_call_without_a_graph_has_none_to_export(tmp_path, cases):
    """A call with a bias (positions, segment ids, a layer option) runs on the parameters'
    arrays: export refuses, where it wrote the graph of the call before, which computes
    something else (without the bias)."""
    case = cases["book"]
    layer = HYBRID.layer_for(case)
    inputs = [HYBRID.to_native(case.inputs[n]) for n in INPUT_NAMES]
    HYBRID.forward(layer, *inputs, None)
    layer.export(str(tmp_path / "plain"))  # (the plain call's graph)
    bias = HYBRID.to_native(np.ones((1, 1, 1, inputs[1].shape[1]), np.float32))
    HYBRID.forward(layer, *inputs, None, bias=bias)
    with pytest.raises(RuntimeError, match="most recent call has no graph to export: its pos"):
        layer.export(str(tmp_path / "biased"))
    HYBRID.forward(layer, *inputs, None)
    layer.export(str(tmp_path / "plain-again"))
    windowed = MultiHeadAttention(case.config.num_hiddens, case.config.num_heads, window=2)
    windowed.initialize()
    windowed.hybridize()
    windowed(*inputs, None)
    with pytest.raises(RuntimeError, match="layer options .* run on the parameters' arrays"):
        windowed.export(str(tmp_path / "windowed"))


def test_deferred_sizes_are_inferred_on_first_call(mxnet_runner):
    runner = mxnet_runner
    layer = MultiHeadAttention(12, 3)
    layer.initialize()
    if runner.hybridize:
        layer.hybridize()
    with pytest.raises(ValueError, match="query_size, key_size, value_size not known yet"):
        get_weights(layer)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 7), (2, 5, 4), (2, 5, 6)]]
    q, k, v = (runner.to_native(x) for x in inputs)
    assert layer(q, k, v, [5, 2]).shape == (2, 3, 12)
    assert layer.input_sizes() == {"query_size": 7, "key_size": 4, "value_size": 6}
    weights = get_weights(layer)
    assert weights["W_v"].shape == (6, 12)
    expected, _ = spec.reference_forward(weights, *inputs, np.array([5, 2]), num_heads=3)
    np.testing.assert_allclose(runner.to_numpy(layer(q, k, v, [5, 2])), expected, rtol=0, atol=5e-6)
    with pytest.raises(ValueError, match="queries last dimension must be query_size=7"):
        layer(mx.np.zeros((2, 3, 8)), k, v)


def test_set_weights_without_initialize_fixes_deferred_sizes(cases):
    case = cases["cross_sizes"]
    config = case.config
    layer = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=config.bias)
    layer = set_weights(layer, case.weights)  # never initialized; sizes and values from the weights
    assert layer.input_sizes() == {"query_size": 7, "key_size": 5, "value_size": 3}
    assert_reference(
        case, IMPERATIVE.call(layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    )
    assert all(get_weights(layer)[n].tobytes() == w.tobytes() for n, w in case.weights.items())


def test_deferred_sizes_with_grouped_heads_and_head_dim(mxnet_runner):
    runner = mxnet_runner
    layer = MultiHeadAttention(10, 4, num_kv_heads=2, head_dim=3)
    assert (layer.num_kv_heads, layer.head_dim) == (2, 3)
    assert "num_kv_heads=2, head_dim=3" in repr(layer)
    layer.initialize()
    if runner.hybridize:
        layer.hybridize()
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 7), (2, 5, 4), (2, 5, 6)]]
    q, k, v = (runner.to_native(x) for x in inputs)
    assert layer(q, k, v, [5, 0]).shape == (2, 3, 10)
    weights = get_weights(layer)
    shapes = {name: array.shape for name, array in weights.items()}
    assert shapes == {"W_q": (7, 12), "W_k": (4, 6), "W_v": (6, 6), "W_o": (12, 10)}
    expected, _ = spec.reference_forward(weights, *inputs, np.array([5, 0]), num_heads=4)
    np.testing.assert_allclose(runner.to_numpy(layer(q, k, v, [5, 0])), expected, rtol=0, atol=5e-6)


def test_empty_keys_with_grouped_heads_fix_deferred_sizes(cases):
    case = cases["head_dim"]  # query_size 6, 4 heads of size 3 reading 2 key/value heads
    config = case.config
    layer = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=True, **config.heads())
    layer.initialize()
    queries = mx.np.ones((2, 3, 6))
    keys = mx.np.ones((2, 0, 5))
    output, weights = layer(queries, keys, keys, return_attention_weights=True)
    assert output.shape == (2, 3, 10) and weights.shape == (2, 4, 3, 0)
    assert layer.input_sizes() == {"query_size": 6, "key_size": 5, "value_size": 5}
    assert layer.W_k.weight.shape == (6, 5) and layer.W_o.weight.shape == (10, 12)


def test_set_weights_without_initialize_fixes_grouped_deferred_sizes(mxnet_runner, cases):
    runner, case = mxnet_runner, cases["head_dim"]
    config = case.config
    layer = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=True, **config.heads())
    if runner.hybridize:
        layer.hybridize()
    layer = set_weights(layer, case.weights)
    assert layer.input_sizes() == {"query_size": 6, "key_size": 10, "value_size": 10}
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    assert_reference(case, runner.call(layer, *inputs, case.valid_lens))
    assert all(get_weights(layer)[n].tobytes() == w.tobytes() for n, w in case.weights.items())


def test_parameter_names_are_d2l_names(tmp_path):
    layer = MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    layer.initialize()
    path = str(tmp_path / "mha.params")
    layer.save_parameters(path)
    loaded = mx.npx.load(path)
    assert sorted(loaded) == sorted(f"W_{p}.{t}" for p in "qkvo" for t in ("weight", "bias"))
    np.testing.assert_array_equal(get_weights(layer)["W_q"], loaded["W_q.weight"].asnumpy().T)
    other = MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    other.load_parameters(path)
    assert all(
        get_weights(other)[name].tobytes() == array.tobytes()
        for name, array in get_weights(layer).items()
    )


def test_gluon_trainer_updates_the_shared_parameters(mxnet_runner, cases):
    # One SGD step moves each weight by -lr * gradient, with the reference
    # gradient: the graphs train the very parameters the Trainer holds.
    runner, case = mxnet_runner, cases["bias"]
    layer = runner.layer_for(case, dtype="float64")
    trainer = gluon.Trainer(layer.collect_params(), "sgd", {"learning_rate": 0.5})
    inputs = [runner.to_native(case.inputs[n], dtype="float64") for n in INPUT_NAMES]
    with autograd.record():
        output = layer(*inputs, runner.native_lens(case.valid_lens))
    output.backward(runner.to_native(case.output_gradient, dtype="float64"))
    trainer.step(1)
    updated = get_weights(layer)
    for name, before in case.weights.items():
        expected = before.astype(np.float64) - 0.5 * case.reference[f"grad.{name}"]
        np.testing.assert_allclose(updated[name], expected, rtol=0, atol=1e-12, err_msg=name)


def test_dropout_only_under_autograd_record(mxnet_runner):
    runner = mxnet_runner
    weights = init_weights(8, seed=3)
    layer = runner.make_layer(8, 2, dropout=0.5, query_size=8, key_size=8, value_size=8)
    layer = runner.set_weights(layer, weights)
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    q = runner.to_native(x)
    expected, _ = spec.reference_forward(weights, x, x, x, num_heads=2)
    np.testing.assert_allclose(runner.to_numpy(layer(q, q, q)), expected, rtol=0, atol=5e-6)
    with autograd.record(train_mode=False):
        np.testing.assert_allclose(runner.to_numpy(layer(q, q, q)), expected, rtol=0, atol=5e-6)
    with autograd.record():
        dropped = runner.to_numpy(layer(q, q, q))
    assert not np.allclose(dropped, expected, atol=1e-3)


def test_valid_lens_of_any_mxnet_dtype_or_interface(cases):
    """Lists, numpy and the runner's own arrays: tests/backends/test_api.py."""
    case = cases["lens_1d"]
    layer = HYBRID.layer_for(case)
    inputs = [HYBRID.to_native(case.inputs[n]) for n in INPUT_NAMES]
    for valid_lens in (
        case.valid_lens.astype(np.int32),
        mx.np.array(case.valid_lens),  # MXNet's default dtype: float32
        mx.np.array(case.valid_lens, dtype="float16"),
        mx.np.array(case.valid_lens, dtype="int64"),
        mx.nd.array(case.valid_lens),  # the legacy NDArray interface
    ):
        assert_reference(case, layer(*inputs, valid_lens))


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID], ids=["imperative", "hybrid"])
def test_positions_and_segment_ids_of_the_legacy_interface(runner):
    """Positions and segment ids as legacy NDArrays are taken as the lengths are (they
    were refused naming positions, as objects)."""
    rotary = {"theta": 100.0}
    weights = init_weights(8, num_heads=2, seed=4)
    layer = runner.set_weights(runner.make_layer(8, 2, rotary=rotary), weights)
    queries = np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float32)
    positions, ids = np.array([[4, 1, 7], [0, 2, 9]]), np.array([[0, 0, 1], [0, 1, 1]])
    expected, _ = spec.reference_forward(
        weights, *[queries] * 3, num_heads=2, rotary=rotary, positions=positions, segment_ids=ids
    )
    x = runner.to_native(queries)
    output = layer(
        x,
        x,
        x,
        positions=mx.nd.array(positions, dtype="int32"),
        segment_ids=mx.nd.array(ids, dtype="int32"),
    )
    np.testing.assert_allclose(runner.to_numpy(output), expected, rtol=0, atol=1e-5)


def test_bad_arrays_are_clear_errors():
    layer = MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    layer.initialize()
    x = mx.np.zeros((1, 2, 8))
    with pytest.raises(TypeError, match="queries dtype float64 differs from the layer's"):
        layer(x.astype("float64"), x, x)
    with pytest.raises(TypeError, match="keys must be a floating-point array"):
        layer(x, x.astype("int32"), x)
    with pytest.raises(TypeError, match=r"values must be an mxnet.numpy.ndarray \(use"):
        layer(x, x, x.as_nd_ndarray())
    with pytest.raises(TypeError, match="queries must be an mxnet.numpy.ndarray"):
        layer(x.asnumpy(), x, x)
    with pytest.raises(ValueError, match="keys is on cpu"):
        layer(x, x.as_in_ctx(mx.cpu(1)), x)
    with pytest.raises(TypeError, match="valid_lens must be an integer or floating"):
        layer(x, x, x, mx.np.array([True], dtype=bool))
    symbol = mx.sym.var("x").as_np_ndarray()
    with pytest.raises(TypeError, match="queries is a Symbol"):
        layer(symbol, symbol, symbol)


def test_hybridize_off_again_runs_imperatively(tmp_path, cases):
    case = cases["lens_2d"]
    layer = HYBRID.layer_for(case)
    args = (layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    assert_reference(case, HYBRID.call(*args))
    layer.hybridize(False)
    assert_reference(case, HYBRID.call(*args))
    with pytest.raises(RuntimeError, match="hybridize"):
        layer.export(str(tmp_path / "mha"))


def test_cast_rebuilds_for_the_new_dtype(cases):
    case = cases["book"]
    layer = HYBRID.layer_for(case)
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    assert_reference(case, HYBRID.call(layer, *inputs, case.valid_lens))
    layer.cast("float64")
    assert get_weights(layer)["W_q"].dtype == np.float64
    assert_reference(
        case, HYBRID.call(layer, *inputs, case.valid_lens, dtype="float64"), atol=1e-12
    )


def test_float16_fully_hidden_rows_are_uniform(mxnet_runner, cases):
    runner, case = mxnet_runner, cases["lens_zero"]
    layer = runner.layer_for(case, dtype="float16")
    output, weights = runner.forward(
        layer,
        *(runner.to_native(case.inputs[n], dtype="float16") for n in INPUT_NAMES),
        runner.native_lens(case.valid_lens),
        return_attention_weights=True,
    )
    assert output.dtype == np.float16 and weights.dtype == np.float16
    np.testing.assert_array_equal(weights.asnumpy()[:2], 1 / 7)  # lengths 0 and -2
    assert_reference(case, output, weights, atol=2e-2)


def test_bfloat16_is_not_in_mxnets_numpy_interface():
    assert "bfloat16" not in backend.DTYPES
    for make in (
        lambda: mx.np.zeros(2, dtype="bfloat16"),
        lambda: mx.np.ones(2).astype("bfloat16"),
    ):
        with pytest.raises((TypeError, mx.base.MXNetError), match="bfloat16"):
            make()


@pytest.fixture
def gpu():
    return device_or_skip("gpu", backend.gpu_available(), "no GPU")


def test_gpu_with_valid_lens_on_either_device(mxnet_runner, cases, gpu):
    runner, case = mxnet_runner, cases["lens_2d"]
    layer = runner.layer_for(case, device=gpu)
    inputs = [runner.to_native(case.inputs[n], gpu) for n in INPUT_NAMES]
    for lens_device in ("cpu", gpu):
        out = runner.forward(layer, *inputs, runner.native_lens(case.valid_lens, lens_device))
        assert out.ctx == backend.device(gpu)
        assert_reference(case, out)


def test_the_harness_takes_int64_lengths_of_numpy_s_longlong_type():
    """numpy 1.23 makes some int64 arrays of its ``longlong`` type (``a + 2**40``), which
    MXNet's dtype tables lack: the harness's conversion raised ``KeyError``; the layer
    takes the converted lengths as it takes any int64 ones."""
    lens = np.array([1, 3], dtype=np.longlong)
    converted = _facts.lens_to_native(lens)
    assert converted.dtype == np.int64 and converted.asnumpy().tolist() == [1, 3]
    layer = MultiHeadAttention(8, 2)
    layer.initialize()
    x = mx.np.ones((2, 3, 8))
    expected = layer(x, x, x, mx.np.array([1, 3], dtype=np.int64)).asnumpy()
    np.testing.assert_array_equal(layer(x, x, x, converted).asnumpy(), expected)
