"""MXNet's side of the edge inputs (tests/backends/test_edges.py has the shared ones).

Empty axes reach no MXNet kernel (several crash the process on them), 16-bit
products are taken in float32 by construction on every device, and weights
may come as MXNet's own arrays.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mha_multi import spec
from mha_multi.mxnet import MultiHeadAttention, get_weights, set_weights
from mha_multi.mxnet._ops import MXNetOps
from mha_multi.weights import KERNEL_NAMES, init_weights

INPUT_NAMES = ("queries", "keys", "values")


def inputs(shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return [mx.np.array(rng.standard_normal(s), dtype=dtype) for s in shapes]


@pytest.mark.parametrize("hybridize", [False, True])
def test_empty_call_with_deferred_sizes_fixes_them(hybridize):
    layer = MultiHeadAttention(8, 2, bias=True)
    layer.initialize()
    if hybridize:
        layer.hybridize()
    queries, keys, values = inputs([(2, 3, 5), (2, 0, 6), (2, 0, 7)])
    output, weights = layer(queries, keys, values, return_attention_weights=True)
    assert output.shape == (2, 3, 8) and weights.shape == (2, 2, 3, 0)
    b_o = layer.W_o.bias.data().asnumpy()
    np.testing.assert_array_equal(output.asnumpy(), np.broadcast_to(b_o, (2, 3, 8)))
    assert layer.input_sizes() == {"query_size": 5, "key_size": 6, "value_size": 7}
    # The sizes fixed by the empty call serve the graphs of later calls.
    queries, keys, values = inputs([(2, 3, 5), (2, 4, 6), (2, 4, 7)], seed=1)
    expected, _ = spec.reference_forward(
        get_weights(layer), *(x.asnumpy() for x in (queries, keys, values)), num_heads=2
    )
    np.testing.assert_allclose(layer(queries, keys, values).asnumpy(), expected, atol=5e-6)


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 0), (2, 0, 4), (0, 3, 4)])
def test_empty_call_overwrites_earlier_gradients(hybridize, shape):
    # Gluon parameters keep their last gradient unless a backward pass
    # reaches them: an empty call must write the reference's zeros.
    batch, num_queries, num_keys = shape
    weights = init_weights(8, bias=True, seed=2)
    layer = set_weights(MultiHeadAttention(8, 2, bias=True), weights)
    if hybridize:
        layer.hybridize()
    for shapes in (
        [(2, 3, 8), (2, 4, 8), (2, 4, 8)],
        [(batch, num_queries, 8)] + [(batch, num_keys, 8)] * 2,
    ):
        arrays = inputs(shapes, seed=3)
        for array in arrays:
            array.attach_grad()
        with autograd.record(train_mode=True):
            output = layer(*arrays, mx.np.ones(shapes[0][0]), causal=True)
        output.backward(mx.np.ones(output.shape))
    for name in KERNEL_NAMES:
        dense = getattr(layer, name)
        np.testing.assert_array_equal(dense.weight.grad().asnumpy(), 0, err_msg=name)
    for name in "qkv":
        np.testing.assert_array_equal(getattr(layer, f"W_{name}").bias.grad().asnumpy(), 0)
    np.testing.assert_array_equal(layer.W_o.bias.grad().asnumpy(), batch * num_queries)
    for name, array in zip(INPUT_NAMES, arrays, strict=True):
        assert array.grad.shape == array.shape, name
        np.testing.assert_array_equal(array.grad.asnumpy(), 0, err_msg=name)


def test_empty_keys_ignore_non_finite_queries():
    # With no key there is no score: the output is b_o whatever the queries hold.
    weights = init_weights(8, bias=True, seed=4)
    layer = set_weights(MultiHeadAttention(8, 2, bias=True), weights)
    queries = mx.np.full((2, 3, 8), np.nan)
    empty = mx.np.zeros((2, 0, 8))
    expected = np.broadcast_to(weights["b_o"].astype(np.float32), (2, 3, 8))
    np.testing.assert_array_equal(layer(queries, empty, empty).asnumpy(), expected)


@pytest.fixture
def product_dtypes(monkeypatch):
    """Operand dtypes of every matrix product the layer asks MXNet for."""
    seen = []
    targets = [
        (mx.ndarray.numpy_extension, ("batch_dot", "fully_connected")),
        (mx.symbol.numpy_extension, ("batch_dot", "fully_connected")),
        (mx.ndarray.numpy, ("matmul",)),
        (mx.symbol.numpy, ("matmul",)),
    ]
    ops = MXNetOps(mx.nd)
    for module, names in targets:
        for name in names:
            original = getattr(module, name)

            def recording(a, b, *args, _original=original, **kwargs):
                if isinstance(a, mx.nd.NDArray):
                    seen.append((ops.dtype(a).name, ops.dtype(b).name))
                else:  # a symbol: its dtype is known only to the graph
                    seen.append(("symbol", "symbol"))
                return _original(a, b, *args, **kwargs)

            monkeypatch.setattr(module, name, recording)
    return seen


@pytest.mark.parametrize("return_attention_weights", [False, True])
def test_float16_products_are_taken_in_float32(product_dtypes, return_attention_weights):
    # By construction, not by what MXNet's kernels of one device do: the
    # operands of every product are float32, and only the results are float16.
    weights = init_weights(8, bias=True, seed=5)
    layer = set_weights(MultiHeadAttention(8, 2, bias=True, dtype="float16"), weights)
    arrays = inputs([(2, 3, 8), (2, 4, 8), (2, 4, 8)], dtype="float16", seed=5)
    result = layer(*arrays, mx.np.array([1, 4]), return_attention_weights=return_attention_weights)
    output = result[0] if return_attention_weights else result
    assert output.dtype == np.float16
    assert len(product_dtypes) == 6  # four projections, scores, weights @ values
    assert set(product_dtypes) == {("float32", "float32")}


@pytest.mark.parametrize("make", [mx.np.array, mx.nd.array], ids=["mx.np", "mx.nd"])
def test_set_weights_reads_mxnet_arrays(make):
    weights = init_weights(8, bias=True, seed=6)
    layer = MultiHeadAttention(8, 2, bias=True)
    set_weights(layer, {name: make(w) for name, w in weights.items()})
    for name, array in get_weights(layer).items():
        np.testing.assert_array_equal(array, weights[name].astype(np.float32), err_msg=name)


def test_set_weights_rejects_mismatched_mxnet_arrays():
    weights = {name: mx.np.array(w) for name, w in init_weights(8, seed=7).items()}
    weights["W_k"] = mx.np.zeros((8, 9))
    with pytest.raises(ValueError, match="W_k"):
        set_weights(MultiHeadAttention(8, 2), weights)


@pytest.mark.parametrize("hybridize", [False, True])
def test_causal_is_checked_before_a_graph_is_chosen(hybridize):
    layer = set_weights(MultiHeadAttention(8, 2), init_weights(8, seed=8))
    if hybridize:
        layer.hybridize()
    arrays = inputs([(1, 2, 8), (1, 2, 8), (1, 2, 8)])
    for causal in ("False", mx.np.array(True), None):
        with pytest.raises(TypeError, match="causal must be a bool"):
            layer(*arrays, causal=causal)
    assert not layer._graphs.by_config  # no graph was built for a bad flag


def test_lengths_beyond_int32_and_unsigned_mean_what_they_say():
    weights = init_weights(8, seed=9)
    layer = set_weights(MultiHeadAttention(8, 2), weights)
    arrays = inputs([(2, 3, 8), (2, 4, 8), (2, 4, 8)], seed=9)
    numpy_inputs = [x.asnumpy() for x in arrays]
    for lens in (
        np.array([2**63 + 5, 3], np.uint64),
        np.array([2**40, -(2**40)], np.int64),
        np.array([[2**33, 0, 1], [2**31, -(2**31) - 1, 5]], np.int64),
        [2**62, 2],
    ):
        expected, _ = spec.reference_forward(weights, *numpy_inputs, lens, num_heads=2)
        np.testing.assert_allclose(layer(*arrays, lens).asnumpy(), expected, atol=5e-6)
    # Beyond int64 numpy makes an object array of a list: not a number.
    with pytest.raises(TypeError, match="valid_lens"):
        layer(*arrays, [2**70, 1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_softmax_rows_with_non_finite_scores_are_nan_as_in_numpy(dtype):
    scores = np.array(
        [[1.0, np.nan, 3.0], [1.0, np.inf, 2.0], [-np.inf, 0.0, 2.0], [-np.inf] * 3, [0.5, 1, 2]]
    )
    with np.errstate(invalid="ignore"):
        expected = spec.NumpyOps().softmax(scores)
    got = MXNetOps(mx.nd).softmax(mx.np.array(scores, dtype=dtype)).asnumpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6)


@pytest.mark.parametrize("value", [np.float32(2.5), np.arange(12.0).reshape(3, 4)[:, ::2]])
def test_host_constants_reach_the_device_as_they_are(value):
    """A constant made on the host (a 0-d fill, a strided block) keeps its shape, values
    and the adapter's dtype on the device (one copy into an empty array)."""
    like = mx.np.zeros((2, 3), dtype=np.float64)
    made = MXNetOps(mx.nd).constant(np.asarray(value), like)
    assert made.shape == np.shape(value) and made.dtype == np.asarray(value).dtype
    np.testing.assert_array_equal(made.asnumpy(), value)
