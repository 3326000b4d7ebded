"""The public API, identically in every backend: errors, weights, dropout, modes."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from option_cases import LENGTH_DEPENDENT_ROTARY

from mha_multi import call, spec
from mha_multi.weights import init_weights


def inputs(batch=2, num_queries=3, num_keys=4, sizes=(8, 8, 8), seed=0):
    """Seeded here, so a test's inputs do not depend on which tests ran before it."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((batch, num_queries, sizes[0])).astype(np.float32),
        rng.standard_normal((batch, num_keys, sizes[1])).astype(np.float32),
        rng.standard_normal((batch, num_keys, sizes[2])).astype(np.float32),
    )


def built_layer(runner, num_hiddens=8, num_heads=2, sizes=(8, 8, 8), bias=False, **kwargs):
    layer = runner.make_layer(
        num_hiddens,
        num_heads,
        bias=bias,
        query_size=sizes[0],
        key_size=sizes[1],
        value_size=sizes[2],
        **kwargs,
    )
    weights = init_weights(
        num_hiddens, query_size=sizes[0], key_size=sizes[1], value_size=sizes[2], bias=bias
    )
    return runner.set_weights(layer, weights), weights


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4}


@pytest.mark.parametrize(
    ("num_hiddens", "num_heads", "options", "error", "match"),
    [
        (10, 3, {}, ValueError, r"num_hiddens \(10\).*num_heads \(3\)"),
        (8, 0, {}, ValueError, "num_heads must be a positive int"),
        (-8, 2, {}, ValueError, "num_hiddens must be a positive int"),
        (8, 2, {"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\)"),
        (8, 2, {"dropout": -0.5}, ValueError, r"dropout must be in \[0, 1\)"),
        (8, 2, {"query_size": 0}, ValueError, "query_size must be a positive int"),
        (8, 2, {"key_size": 8.0}, TypeError, "key_size must be a positive int"),
        (8, 2, {"value_size": True}, TypeError, "value_size must be a positive int"),
        (8, 4, {"num_kv_heads": 3}, ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
        (8, 4, {"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int"),
        (8, 4, {"num_kv_heads": 2.0}, TypeError, "num_kv_heads must be a positive int"),
        (8, 4, {"head_dim": 0}, ValueError, "head_dim must be a positive int"),
        (10, 4, {"head_dim": "3"}, TypeError, "head_dim must be a positive int"),
        (8, 2, {"rotary": {"theta": -1.0}}, ValueError, "rotary.theta must be a positive"),
        (8, 2, {"rotary": {"fraction": 0.3}}, ValueError, r"rotary.fraction \(0.3\)"),
        (8, 2, {"rotary": {"thetas": 1.0}}, ValueError, "rotary has unknown keys"),
        (8, 2, {"window": 0}, ValueError, "window must be a positive int"),
        (
            8,
            2,
            {"window": 2**31},
            ValueError,
            r"window must be below 2\*\*31 \(None for no window\)",
        ),
        (8, 2, {"softcap": -2.0}, ValueError, "softcap must be a positive finite"),
        # (Past them float32 meets numbers XLA and TensorFlow flush to zero.)
        (8, 2, {"softcap": 3e38}, ValueError, r"softcap must be at most 2\*\*64"),
        (8, 2, {"softcap": 1e-38}, ValueError, r"softcap must be at least 2\*\*-126"),
        (8, 2, {"qk_norm": {"eps": 1e-39}}, ValueError, r"qk_norm.eps must be at least 2\*\*-126"),
        (8, 2, {"window": np.array([2, 3])}, TypeError, "window must be a positive int"),
        (8, 2, {"alibi": np.array([True, False])}, TypeError, "alibi must be a bool"),
        (
            8,
            2,
            {"rotary": {"theta": 1.0, "scaling": YARN}},
            ValueError,
            "rotary.theta must not be 1 with rope_type 'yarn'",
        ),
        (8, 2, {"alibi": "yes"}, TypeError, "alibi must be a bool"),
    ],
)
def test_bad_configuration(runner, num_hiddens, num_heads, options, error, match):
    with pytest.raises(error, match=match):
        runner.make_layer(num_hiddens, num_heads, **options)


def _bad_inputs():
    q, k, v = inputs()
    return [
        ((q[0], k, v, None), ValueError, "queries must be 3-D"),
        ((q, k[..., None], v, None), ValueError, "keys must be 3-D"),
        (
            (q, k[:1], v[:1], None),
            ValueError,
            "keys batch size 1 differs from queries batch size 2",
        ),
        ((q, k, v[:, :3], None), ValueError, "same length; got 4 keys and 3 values"),
        ((q[..., :5], k, v, None), ValueError, "queries last dimension must be query_size=8"),
        ((q, k, v[..., :6], None), ValueError, "values last dimension must be value_size=8"),
        ((q, k, v, np.array([1, 2, 3])), ValueError, r"valid_lens must have shape \(batch,\)"),
        ((q, k, v, np.ones((2, 4))), ValueError, r"\(batch, num_queries\) = \(2, 3\)"),
        ((q, k, v, np.ones((2, 3, 1))), ValueError, "valid_lens must have shape"),
        ((q, k, v, np.array(["1", "2"])), TypeError, "valid_lens must be an integer or floating"),
        (
            (q, k, v, np.array([True, False])),
            TypeError,
            "valid_lens must be an integer or floating",
        ),
    ]


BAD_INPUT_NAMES = (
    "queries_2d",
    "keys_4d",
    "batch_mismatch",
    "length_mismatch",
    "query_size",
    "value_size",
    "lens_wrong_batch",
    "lens_wrong_queries",
    "lens_3d",
    "lens_strings",
    "lens_bools",
)


@pytest.mark.parametrize("case", range(len(BAD_INPUT_NAMES)), ids=BAD_INPUT_NAMES)
def test_bad_inputs(runner, case):
    args, error, match = _bad_inputs()[case]
    layer, _ = built_layer(runner)
    with pytest.raises(error, match=match):
        runner.call(layer, *args)


def test_a_call_that_would_set_an_input_size_of_0_is_refused(runner):
    # A layer whose input sizes its first call sets (NNX's default to num_hiddens) takes
    # none of 0, which no constructor takes either.
    q, k, v = inputs()
    layer = runner.make_layer(8, 2)
    with pytest.raises(ValueError, match="queries last dimension must be (positive|query_size=8)"):
        runner.call(layer, q[..., :0], k, v, None)


def test_valid_lens_may_be_a_list_numpy_or_the_frameworks_array(runner, cases):
    case = cases["lens_1d"]
    layer = runner.layer_for(case)
    arrays = [runner.to_native(case.inputs[name]) for name in ("queries", "keys", "values")]
    for valid_lens in (
        case.valid_lens.tolist(),
        case.valid_lens,
        runner.native_lens(case.valid_lens),
    ):
        output = runner.forward(layer, *arrays, valid_lens)
        np.testing.assert_allclose(runner.to_numpy(output), case.reference["output"], atol=5e-6)


def _bad_options():
    positions = np.arange(3)[None].repeat(2, axis=0)
    return [
        ({"positions": positions.astype(np.float32)}, TypeError, "positions must be integers"),
        ({"positions": positions[:, :2]}, ValueError, r"positions must have shape \(batch"),
        ({"positions": positions}, ValueError, "keys must be as many as the queries"),
        ({"bias": np.zeros((2, 2, 3, 5), np.float32)}, ValueError, "bias must be broadcastable"),
        ({"bias": np.zeros((3, 4), np.int32)}, TypeError, "bias must be a floating-point"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_options())))
def test_bad_positions_and_bias(runner, case):
    options, error, match = _bad_options()[case]
    layer, _ = built_layer(runner, rotary={"theta": 100.0})
    # Native arrays of their own dtype (the lengths' conversion keeps it).
    native = {name: runner.native_lens(value) for name, value in options.items()}
    with pytest.raises(error, match=match):
        runner.call(layer, *inputs(), **native)


def test_a_tuple_where_one_array_belongs_is_refused_naming_its_shape(runner):
    """A tuple of the framework's arrays as lengths, or as segment ids of other than two
    sides, is read as one array and refused naming its shape, in every backend (Flax
    NNX's call plan took such a tuple into its program, and refused it naming the
    tracers it held)."""
    layer, _ = built_layer(runner)
    x = runner.to_native(inputs(num_keys=3)[0])
    lens = runner.native_lens(np.array([2, 1], np.int32))
    ids = runner.native_lens(np.array([[0, 0, 1], [0, 1, 1]], np.int32))
    with pytest.raises(ValueError, match=r"valid_lens must have shape .*; got \(1, 2\)"):
        runner.call_as_given(layer, x, x, x, (lens,))
    for sides in ((ids,), (ids, ids, ids)):
        shape = str((len(sides), 2, 3)).replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(ValueError, match=f"segment_ids of the queries .*; got {shape} "):
            runner.call_as_given(layer, x, x, x, segment_ids=sides)


def test_a_list_of_the_frameworks_arrays_is_the_array_they_stack(runner):
    """Lengths, positions and segment ids given as lists of the framework's own arrays
    are the arrays numpy stacks of them, in every backend (MXNet's arrays, which numpy
    cannot stack, were refused as objects)."""
    rotary = {"theta": 100.0}
    layer, weights = built_layer(runner, rotary=rotary)
    queries = inputs(num_keys=3)[0]
    x = runner.to_native(queries)
    positions, ids = np.array([[4, 1, 7], [0, 2, 9]]), np.array([[0, 0, 1], [0, 1, 1]], np.int32)
    expected, _ = spec.reference_forward(
        weights,
        *[queries] * 3,
        np.array([2, 3]),
        num_heads=2,
        rotary=rotary,
        positions=positions,
        segment_ids=ids,
    )
    native = runner.native_lens
    output = runner.call_as_given(
        layer,
        x,
        x,
        x,
        [native(np.int32(2)), native(np.int32(3))],
        positions=[native(row) for row in positions],
        segment_ids=[native(row) for row in ids],
    )
    np.testing.assert_allclose(runner.to_numpy(output), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("scaling", sorted(LENGTH_DEPENDENT_ROTARY))
def test_narrow_integer_positions_do_not_wrap_a_calls_length(runner, scaling):
    """A rotary type of the call's length (its largest position + 1) given int8 or uint8
    positions: MXNet, JAX and Keras added 1 in their dtype (127 + 1 wrapped to -128, 255
    + 1 to 0), and the call took the unscaled frequencies (off by 0.3 to 1.7)."""
    rotary = {"scaling": LENGTH_DEPENDENT_ROTARY[scaling]}
    layer, weights = built_layer(
        runner, num_hiddens=16, num_heads=4, sizes=(16,) * 3, rotary=rotary
    )
    queries = np.random.default_rng(0).standard_normal((1, 3, 16)) * 3
    for positions in (np.array([[0, 1, 127]], np.int8), np.array([[0, 1, 255]], np.uint8)):
        expected, _ = spec.reference_forward(
            weights, *[queries] * 3, num_heads=4, rotary=rotary, positions=positions, causal=True
        )
        output = runner.call(layer, *[queries] * 3, positions=positions, causal=True)
        np.testing.assert_allclose(output, expected, rtol=0, atol=5e-6, err_msg=str(positions))


def test_positions_and_bias_on_the_host_are_checked_before_any_conversion(runner):
    """Numpy positions of any integer dtype rotate alike; float positions and an integer
    bias are refused with the spec's message as it is (Keras' call wraps errors raised
    inside it in text of its own, and converted such arrays itself)."""
    layer, weights = built_layer(runner, rotary={"theta": 100.0})
    queries = inputs(num_keys=3)[0]
    positions = np.array([[3, 1, 4], [1, 5, 9]])
    expected, _ = spec.reference_forward(
        weights, *[queries] * 3, num_heads=2, rotary={"theta": 100.0}, positions=positions
    )
    for dtype in (np.int64, np.uint64, np.uint8):
        output = runner.call(layer, *[queries] * 3, positions=positions.astype(dtype))
        np.testing.assert_allclose(output, expected, rtol=0, atol=1e-5, err_msg=str(dtype))
    x = runner.to_native(queries)
    with pytest.raises(TypeError, match="^positions must be integers; got dtype kind 'f'"):
        runner.call_as_given(layer, x, x, x, positions=positions.astype(np.float32))
    with pytest.raises(TypeError, match="^positions must be integers; got dtype kind 'b'"):
        runner.call_as_given(layer, x, x, x, positions=positions > 3)
    # Unsigned positions past int64 would wrap to negative ones: refused, as the
    # reference refuses them.
    beyond = positions.astype(np.uint64) + np.uint64(2**63)
    refused = r"^positions must fit in int64, the integers the framework holds here; got 922"
    with pytest.raises(ValueError, match=refused):
        runner.call_as_given(layer, x, x, x, positions=beyond)
    with pytest.raises(ValueError, match=refused):
        spec.reference_forward(
            weights, *[queries] * 3, num_heads=2, rotary={"theta": 100.0}, positions=beyond
        )
    with pytest.raises(TypeError, match="^bias must be "):  # (MXNet: an mxnet array)
        runner.call_as_given(layer, x, x, x, bias=np.zeros((3, 3), np.int32))


@pytest.mark.parametrize("shape", [(), (1,), (4,), (1, 4)], ids=str)
def test_a_bias_of_fewer_axes_broadcasts(runner, shape):
    """Broadcastable to (B, H, Q, K) as numpy broadcasts: a key's bias alone, or one number
    (the fused kernel's mask, where no other mask joins it, included)."""
    layer, weights = built_layer(runner)
    bias = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    expected, _ = spec.reference_forward(weights, *inputs(), num_heads=2, bias=bias)
    output = runner.call(layer, *inputs(), bias=runner.to_native(bias))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda w: w.pop("W_v"), "missing 'W_v'"),
        (lambda w: w.update(b_o=np.zeros(8, np.float32)), "unexpected entry 'b_o'"),
        (lambda w: w.update(W_q=np.zeros((8, 6), np.float32)), r"W_q'\] must have shape \(8, 8\)"),
        (lambda w: w.update(W_o=np.zeros((8, 6), np.float32)), r"W_o'\] must have shape \(8, 8\)"),
    ],
)
def test_bad_weights(runner, edit, match):
    layer, weights = built_layer(runner)
    edit(weights)
    with pytest.raises(ValueError, match=match):
        runner.set_weights(layer, weights)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_weights_round_trip_bit_exact(runner, bias, dtype):
    sizes = (5, 6, 7)
    layer = runner.make_layer(12, 3, bias=bias, query_size=5, key_size=6, value_size=7, dtype=dtype)
    weights = init_weights(
        12, query_size=5, key_size=6, value_size=7, bias=bias, seed=9, dtype=np.dtype(dtype)
    )
    got = runner.get_weights(runner.set_weights(layer, weights))
    assert got.keys() == weights.keys()
    for name, array in weights.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].tobytes() == array.tobytes(), name
    q, k, v = inputs(sizes=sizes)
    expected, _ = spec.reference_forward(weights, q, k, v, num_heads=3)
    np.testing.assert_allclose(runner.call(layer, q, k, v, dtype=dtype), expected, atol=5e-6)


def test_big_endian_weights_load_as_their_numbers(runner):
    """Arrays of the other byte order (a file's, which numpy keeps so) load as the same
    numbers in every backend (PyTorch refused them with its own error)."""
    weights = init_weights(8, bias=True, seed=9)
    swapped = {name: array.astype(array.dtype.newbyteorder(">")) for name, array in weights.items()}
    layer, _ = built_layer(runner, bias=True)
    got = runner.get_weights(runner.set_weights(layer, swapped))
    for name, array in weights.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    q, k, v = inputs()
    expected, _ = spec.reference_forward(weights, q, k, v, num_heads=2)
    np.testing.assert_allclose(runner.call(layer, q, k, v), expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_weights_round_trip_and_load_strictly(runner, bias):
    heads = {"num_kv_heads": 2, "head_dim": 3}
    layer = runner.make_layer(10, 4, bias=bias, query_size=5, key_size=6, value_size=7, **heads)
    weights = init_weights(
        10, num_heads=4, query_size=5, key_size=6, value_size=7, bias=bias, seed=4, **heads
    )
    got = runner.get_weights(runner.set_weights(layer, weights))
    assert {name: array.shape for name, array in got.items()} == {
        name: array.shape for name, array in weights.items()
    }
    assert all(got[name].tobytes() == weights[name].tobytes() for name in weights)
    q, k, v = inputs(sizes=(5, 6, 7))
    lens = np.array([3, 1])
    expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=4, causal=True)
    np.testing.assert_allclose(
        runner.call(layer, q, k, v, lens, causal=True), expected, rtol=0, atol=5e-6
    )
    # Keys projected to every query head's width do not fit two key/value heads.
    too_wide = {**weights, "W_k": np.zeros((6, 12), np.float32)}
    with pytest.raises(ValueError, match=r"weights\['W_k'\] must have shape \(6, 6\)"):
        runner.set_weights(layer, too_wide)


def test_attention_weights_shape_and_rows(runner):
    layer, _ = built_layer(runner)
    q, k, v = inputs()
    output, weights = runner.call(layer, q, k, v, np.array([3, 0]), return_attention_weights=True)
    assert output.shape == (2, 3, 8)
    assert weights.shape == (2, 2, 3, 4)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(weights[0, :, :, 3], 0.0)
    np.testing.assert_allclose(weights[1], 0.25, atol=1e-7)  # fully hidden: uniform


def test_fully_hidden_rows_float16_are_uniform_not_nan(runner):
    layer, weights = built_layer(runner, dtype="float16")
    q, k, v = inputs()
    lens = np.zeros(2, np.int32)
    output = runner.call(layer, q, k, v, lens, dtype="float16")
    assert np.all(np.isfinite(output))
    expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=2)
    np.testing.assert_allclose(output, expected, atol=2e-2)


def test_eval_mode_is_deterministic_with_dropout(runner):
    layer, weights = built_layer(runner, dropout=0.5)
    q, k, v = inputs()
    first = runner.call(layer, q, k, v, np.array([2, 4]))
    second = runner.call(layer, q, k, v, np.array([2, 4]))
    np.testing.assert_array_equal(first, second)
    expected, _ = spec.reference_forward(weights, q, k, v, np.array([2, 4]), num_heads=2)
    np.testing.assert_allclose(first, expected, atol=5e-6)


def test_dropout_statistics_in_training(runner):
    # One head with identity projections and one-hot values makes the output
    # *be* the dropped-out attention weights.
    size, rate = 64, 0.3
    layer = runner.make_layer(
        size, 1, dropout=rate, query_size=size, key_size=size, value_size=size
    )
    eye = np.eye(size, dtype=np.float32)
    layer = runner.set_weights(layer, {"W_q": eye, "W_k": eye, "W_v": eye, "W_o": eye})
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((4, size, size)).astype(np.float32)
    keys = rng.standard_normal((4, size, size)).astype(np.float32)
    values = np.broadcast_to(eye, (4, size, size)).copy()
    dropped, weights = runner.call(
        layer, queries, keys, values, training=True, return_attention_weights=True
    )
    eval_weights = runner.call(layer, queries, keys, values, return_attention_weights=True)[1]
    np.testing.assert_allclose(weights[:, 0], eval_weights[:, 0], atol=1e-6)  # pre-dropout
    zero = dropped == 0
    # 16384 Bernoulli(0.3) draws: 7 standard deviations is 0.025.
    assert abs(zero.mean() - rate) < 0.025
    kept = ~zero
    np.testing.assert_allclose(dropped[kept], weights[:, 0][kept] / (1 - rate), rtol=1e-5)
    # The default call (a fused kernel, where the backend has one) drops the same way.
    fused = runner.call(layer, queries, keys, values, training=True)
    assert not np.array_equal(fused, dropped)
    zero = fused == 0
    assert abs(zero.mean() - rate) < 0.025
    np.testing.assert_allclose(fused[~zero], weights[:, 0][~zero] / (1 - rate), rtol=1e-5)


def test_training_without_dropout_equals_eval(runner):
    layer, _ = built_layer(runner)
    q, k, v = inputs()
    np.testing.assert_array_equal(
        runner.call(layer, q, k, v, np.array([1, 3]), training=True),
        runner.call(layer, q, k, v, np.array([1, 3])),
    )


def test_the_facts_module_defines_what_the_harness_reads(runner):
    """Every framework's facts module exports the functions the harness and the
    benchmarks read through it (``mha_multi.call.FACTS_MODULE_NAMES``)."""
    facts = importlib.import_module(f"{runner.package}._facts")
    missing = [name for name in call.FACTS_MODULE_NAMES if name not in facts.__all__]
    assert missing == []
    assert all(hasattr(facts, name) for name in facts.__all__)
