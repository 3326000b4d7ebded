"""Edge inputs, identically in every backend and on every code path.

Each test compares a backend against the float64 reference (or a value
computed here by hand) on inputs where a careless path goes wrong: 16-bit
products that do not accumulate in float32, scores that overflow float16,
non-finite inputs, huge or NaN lengths, empty axes and arguments of the
wrong type. ``output`` is the default call (a fused kernel where the backend
has one); ``return_attention_weights=True`` takes the generic path.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.weights import init_weights

SIXTEEN_BIT = ("bfloat16", "float16")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (round to nearest even), as float64."""
    if dtype == "float16":
        return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)
    assert dtype == "bfloat16"
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def skip_unsupported(runner, dtype: str) -> None:
    if not runner.dtype_supported("cpu", dtype):
        pytest.skip(f"{runner.name} has no {dtype}")


def layer_with(runner, weights, num_heads, *, dtype="float32", device="cpu"):
    num_hiddens = weights["W_o"].shape[1]
    layer = runner.make_layer(
        num_hiddens,
        num_heads,
        bias="b_o" in weights,
        query_size=weights["W_q"].shape[0],
        key_size=weights["W_k"].shape[0],
        value_size=weights["W_v"].shape[0],
        dtype=dtype,
        device=device,
    )
    return runner.set_weights(layer, weights)


def float32_layer(runner, weights, num_heads=2, device="cpu"):
    weights = {n: w.astype(np.float32) for n, w in weights.items()}
    return layer_with(runner, weights, num_heads, device=device)


def against_reference(runner, layer, weights, inputs, lens, *, causal=False, device="cpu"):
    """The float64 reference ``(output, weights)`` and the backend's float32 results."""
    expected = spec.reference_forward(weights, *inputs, lens, num_heads=2, causal=causal)
    f32 = [x.astype(np.float32) for x in inputs]
    return expected, *both_paths(runner, layer, *f32, lens, causal=causal, device=device)


def both_paths(runner, layer, *args, **kwargs):
    """The default call's output and the generic path's (the one returning weights)."""
    fused = runner.call(layer, *args, **kwargs)
    generic, weights = runner.call(layer, *args, return_attention_weights=True, **kwargs)
    return {"default": fused, "generic": generic}, weights


def assert_matches_reference(got, expected, atol, what=""):
    """Same non-finite pattern as the reference, finite values within ``atol``."""
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        np.testing.assert_array_equal(test(got), test(expected), err_msg=f"{what}: {name}")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=atol, err_msg=what)


def assert_rounded_once(got, exact, dtype):
    """``got`` is ``exact`` rounded to ``dtype`` once, up to the rare flip.

    Summing in float32 and rounding once lands on the rounded exact value
    except where the float32 sum sits within its own error of a rounding
    boundary; a product accumulated in 16 bits (or rounded in blocks) is off
    by one or more units in the last place in a large share of the elements.
    """
    expected = round_to(exact, dtype)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(expected))) - (7 if dtype == "bfloat16" else 10))
    off = np.abs(got - expected) / ulp
    assert off.max() <= 1, f"{off.max():.1f} units in the last place off"
    assert np.mean(off > 0) <= 0.02, f"{np.mean(off > 0):.1%} of the elements not rounded once"


# -- 16-bit products accumulate in float32 and round once --------------------


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_16bit_projection_accumulates_in_float32(runner, dtype):
    """One key and an identity ``W_o`` make the output the value projection itself."""
    skip_unsupported(runner, dtype)
    rng = np.random.default_rng(1)
    value_size, num_hiddens, batch = 512, 64, 32
    weights = {
        "W_q": rng.standard_normal((4, num_hiddens)),
        "W_k": rng.standard_normal((4, num_hiddens)),
        # Nonnegative, so no sum cancels to a value whose float32 error is
        # a whole 16-bit unit (the float32 sum itself is not exact).
        "W_v": np.abs(rng.standard_normal((value_size, num_hiddens))),
        "W_o": np.eye(num_hiddens),
    }
    weights = {name: round_to(w, dtype).astype(np.float32) for name, w in weights.items()}
    queries = rng.standard_normal((batch, 1, 4)).astype(np.float32)
    keys = rng.standard_normal((batch, 1, 4)).astype(np.float32)
    values = round_to(np.abs(rng.standard_normal((batch, 1, value_size))), dtype)
    values = values.astype(np.float32)
    layer = layer_with(runner, weights, 1, dtype=dtype)
    exact = values.astype(np.float64) @ weights["W_v"].astype(np.float64)
    outputs, _ = both_paths(runner, layer, queries, keys, values, dtype=dtype)
    for path, output in outputs.items():
        assert output.shape == exact.shape, path
        assert_rounded_once(output, exact, dtype)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_16bit_attention_product_accumulates_in_float32(runner, dtype):
    """``W_q = 0`` gives uniform weights ``1/512`` (exact), so the output is a mean of values."""
    skip_unsupported(runner, dtype)
    rng = np.random.default_rng(2)
    num_keys, num_hiddens, batch = 512, 64, 16
    eye = np.eye(num_hiddens, dtype=np.float32)
    weights = {
        "W_q": np.zeros((num_hiddens, num_hiddens), np.float32),
        "W_k": round_to(rng.standard_normal((num_hiddens, num_hiddens)), dtype).astype(np.float32),
        "W_v": eye,
        "W_o": eye,
    }
    queries = rng.standard_normal((batch, 1, num_hiddens)).astype(np.float32)
    keys = rng.standard_normal((batch, num_keys, num_hiddens)).astype(np.float32)
    values = round_to(rng.standard_normal((batch, num_keys, num_hiddens)), dtype)
    layer = layer_with(runner, weights, 1, dtype=dtype)
    exact = values.mean(axis=1, keepdims=True)
    outputs, _ = both_paths(runner, layer, queries, keys, values.astype(np.float32), dtype=dtype)
    for path, output in outputs.items():
        assert output.shape == exact.shape, path
        assert_rounded_once(output, exact, dtype)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_16bit_huge_scores_neither_overflow_nor_leak(runner, dtype):
    """Scores of 1.8e5 (visible) and 3.6e5 (hidden) in float16's range of 65504.

    Identity ``W_q``/``W_k`` and inputs of 300 make every visible score equal,
    so the weights are uniform over the visible keys whatever the rounding;
    the hidden keys score higher and must still get weight 0.
    """
    skip_unsupported(runner, dtype)
    rng = np.random.default_rng(3)
    size, num_keys = 8, 6
    weights = {
        "W_q": np.eye(size, dtype=np.float32),
        "W_k": np.eye(size, dtype=np.float32),
        "W_v": rng.standard_normal((size, size)).astype(np.float32) / np.sqrt(size),
        "W_o": rng.standard_normal((size, size)).astype(np.float32) / np.sqrt(size),
    }
    queries = np.full((2, 3, size), 300.0, np.float32)
    keys = np.full((2, num_keys, size), 300.0, np.float32)
    keys[:, 4:] = 600.0  # hidden by the lengths below
    values = rng.standard_normal((2, num_keys, size)).astype(np.float32)
    lens = np.array([4, 2])
    expected, _ = spec.reference_forward(weights, queries, keys, values, lens, num_heads=2)
    layer = layer_with(runner, weights, 2, dtype=dtype)
    outputs, _ = both_paths(runner, layer, queries, keys, values, lens, dtype=dtype)
    for path, output in outputs.items():
        assert np.all(np.isfinite(output)), path
        np.testing.assert_allclose(output, expected, atol=2e-2, err_msg=path)


# -- non-finite inputs propagate exactly as in the reference -----------------


def _nonfinite_cases():
    rng = np.random.default_rng(4)
    weights = init_weights(8, bias=True, seed=4)
    queries = rng.standard_normal((2, 3, 8))
    keys = rng.standard_normal((2, 5, 8))
    values = rng.standard_normal((2, 5, 8))
    lens = np.array([3, 5])

    def case(**edits):
        w, q, k, v = (dict(weights), queries.copy(), keys.copy(), values.copy())
        arrays = {"q": q, "k": k, "v": v}
        for target, edit in edits.items():
            if target in arrays:
                edit(arrays[target])
            else:
                w[target] = w[target].copy()
                edit(w[target])
        return w, q, k, v

    def put(index, value):
        def edit(array):
            array[index] = value

        return edit

    return {
        "nan_query_element": (*case(q=put((0, 1, 2), np.nan)), lens),
        "nan_in_W_q": (*case(W_q=put((3, 0), np.nan)), lens),
        "inf_in_hidden_key": (*case(k=put((0, 4, 1), np.inf)), lens),
        "nan_in_hidden_key": (*case(k=put((0, 3), np.nan)), lens),
        "nan_in_hidden_value": (*case(v=put((0, 4, 0), np.nan)), lens),
        "inf_in_visible_key": (*case(k=put((1, 2, 5), np.inf)), lens),
        "nan_in_b_v": (*case(b_v=put(3, np.nan)), None),
        "nan_query_element_no_lengths": (*case(q=put((0, 1, 2), np.nan)), None),
        "nan_in_W_q_no_lengths": (*case(W_q=put((3, 0), np.nan)), None),
    }


NONFINITE = _nonfinite_cases()


@pytest.mark.parametrize("name", sorted(NONFINITE))
def test_nonfinite_inputs_propagate_as_in_reference(runner, available_device, name):
    weights, *inputs, lens = NONFINITE[name]
    layer = float32_layer(runner, weights, device=available_device)
    for causal in (False, True):
        (expected, expected_weights), outputs, attention_weights = against_reference(
            runner, layer, weights, inputs, lens, causal=causal, device=available_device
        )
        for path, output in outputs.items():
            assert_matches_reference(output, expected, 5e-6, f"{path} causal={causal}")
        assert_matches_reference(attention_weights, expected_weights, 5e-6, "weights")


# -- visible scores below the mask value -----------------------------------


def scores_below_the_mask_value(batch, length, seed=0):
    """One head of 4 whose every score is ``-4.5e6``, and inputs ``(batch, length, 4)``.

    ``W_q`` and ``W_k`` keep the first feature (negated for the keys), which
    is 3000 everywhere, so ``q . k / sqrt(4) = -9e6 / 2`` exactly for every
    pair; the values differ. The spec replaces a hidden score by ``-1e6``,
    above every visible one: a row with a hidden key averages the values of
    its hidden keys, where a kernel that adds ``-inf`` to them would average
    its visible ones.
    """
    weights = init_weights(4, num_heads=1, bias=False, seed=seed)
    weights["W_q"] = np.diag([1.0, 0.0, 0.0, 0.0]).astype(np.float32)
    weights["W_k"] = np.diag([-1.0, 0.0, 0.0, 0.0]).astype(np.float32)
    x = np.random.default_rng(seed).standard_normal((batch, length, 4)).astype(np.float32)
    x[..., 0] = 3e3
    return weights, x


def test_visible_scores_below_the_mask_value_lose_to_hidden_keys_on_every_path(runner):
    """Lengths, a causal self-attention call (queries, keys and values one array:
    a plain call) and a ragged cached chunk that fills its cache, each against
    the float64 reference, by the default call (fused where the backend has a
    kernel) and the generic path."""
    weights, x = scores_below_the_mask_value(2, 3)
    layer = layer_with(runner, weights, 1)
    tolerance = {"rtol": 1e-5, "atol": 1e-3}  # values of magnitude 3000
    lens = np.array([1, 2])
    expected, expected_weights = spec.reference_forward(weights, x, x, x, lens, num_heads=1)
    assert expected_weights[0, 0, :, 1:].min() > 0.49  # the hidden keys win
    outputs, _ = both_paths(runner, layer, x, x, x, lens)
    for path, output in outputs.items():
        np.testing.assert_allclose(output, expected, **tolerance, err_msg=f"lengths, {path}")
    same = runner.to_native(x)
    expected, _ = spec.reference_forward(weights, x, x, x, num_heads=1, causal=True)
    output = runner.to_numpy(runner.forward(layer, same, same, same, None, causal=True))
    np.testing.assert_allclose(output, expected, **tolerance, err_msg="causal self-attention")
    lens = np.array([3, 2], np.int32)
    empty = spec.KVCache(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 4)), np.zeros(2, np.int32))
    expected, _, _ = spec.reference_cached_forward(weights, x, x, x, empty, lens, num_heads=1)
    for weights_too in (False, True):
        result = runner.forward(
            layer,
            same,
            same,
            same,
            runner.native_lens(lens),
            cache=runner.init_cache(layer, 2, 3),
            return_attention_weights=weights_too,
        )
        output = runner.to_numpy(result[0])
        real = np.arange(3)[None, :] < lens[:, None]  # (padding rows are free)
        np.testing.assert_allclose(
            output[real], expected[real], **tolerance, err_msg=f"cached, weights={weights_too}"
        )


# -- lengths: NaN, huge, negative --------------------------------------------


@pytest.mark.parametrize(
    "lens",
    [
        np.array([np.nan, 0.0]),
        np.array([np.nan, 2.0], np.float32),
        np.array([[np.nan, 1, 2], [0, np.inf, -np.inf]]),
        np.array([2**62, 2], np.int64),
        np.array([sys.maxsize, -sys.maxsize - 1], np.int64),
        np.array([2**31, 1], np.int64),
        np.array([2**63 + 5, 3], np.uint64),
        np.array([[2**40, 0, -(2**40)], [1, 2**33, 3]], np.int64),
        # Below the smallest normal number: key 0 shown (0 < len), where XLA's and
        # TensorFlow's kernels flush such numbers to zero before comparing.
        np.array([[1e-45, 1e-40, -1e-45], [0.0, 2.0, 1e-38]], np.float32),
        np.array([5e-324, 1e-310]),
    ],
    ids=[
        "nan_zero",
        "nan_f32",
        "nan_inf_2d",
        "2^62",
        "maxsize",
        "2^31",
        "uint64",
        "2d_large",
        "subnormal_f32",
        "subnormal_f64",
    ],
)
def test_extreme_lengths_mean_what_they_say(runner, available_device, lens):
    rng = np.random.default_rng(5)
    weights = init_weights(8, seed=5)
    inputs = [rng.standard_normal((2, n, 8)) for n in (3, 4, 4)]
    layer = float32_layer(runner, weights, device=available_device)
    for causal in (False, True):
        (expected, _), outputs, _ = against_reference(
            runner, layer, weights, inputs, lens, causal=causal, device=available_device
        )
        for path, output in outputs.items():
            np.testing.assert_allclose(output, expected, atol=5e-6, err_msg=path)


def test_narrow_integer_lengths_do_not_wrap(runner):
    """int8 lengths against 200 key positions: positions must not be cast to int8."""
    rng = np.random.default_rng(9)
    weights = init_weights(8, seed=9)
    queries, keys = rng.standard_normal((2, 2, 8)), rng.standard_normal((2, 200, 8))
    layer = float32_layer(runner, weights)
    for lens in (np.array([100, 127], np.int8), np.array([130, 255], np.uint8)):
        (expected, expected_weights), outputs, _ = against_reference(
            runner, layer, weights, (queries, keys, keys), lens
        )
        assert np.count_nonzero(expected_weights[0, 0, 0]) == lens[0]
        for path, output in outputs.items():
            np.testing.assert_allclose(output, expected, atol=5e-6, err_msg=path)


# -- empty axes ---------------------------------------------------------------


EMPTY_SHAPES = {"no_keys": (2, 3, 0), "no_queries": (2, 0, 4), "no_batch": (0, 3, 4)}


@pytest.mark.parametrize("lens_kind", ["none", "1d", "2d"])
@pytest.mark.parametrize("shape", sorted(EMPTY_SHAPES))
def test_empty_axes(runner, shape, lens_kind):
    batch, num_queries, num_keys = EMPTY_SHAPES[shape]
    rng = np.random.default_rng(6)
    weights = init_weights(8, bias=True, seed=6)
    inputs = [rng.standard_normal((batch, n, 8)) for n in (num_queries,) + 2 * (num_keys,)]
    queries, keys, values = inputs
    lens = {
        "none": None,
        "1d": np.arange(batch) + 1,
        "2d": np.ones((batch, num_queries), np.int64),
    }[lens_kind]
    layer = float32_layer(runner, weights)
    f32 = [x.astype(np.float32) for x in inputs]
    for causal in (False, True):
        (expected, expected_weights), outputs, attention_weights = against_reference(
            runner, layer, weights, inputs, lens, causal=causal
        )
        assert attention_weights.shape == (batch, 2, num_queries, num_keys)
        np.testing.assert_allclose(attention_weights, expected_weights, atol=5e-6)
        for path, output in outputs.items():
            assert output.shape == (batch, num_queries, 8), path
            np.testing.assert_allclose(output, expected, atol=5e-6, err_msg=path)
    output_gradient = rng.standard_normal(expected.shape)
    expected_grads = spec.reference_gradients(
        weights, queries, keys, values, lens, num_heads=2, output_gradient=output_gradient
    )
    grads = runner.gradients(
        layer,
        *f32,
        lens,
        causal=False,
        output_gradient=output_gradient.astype(np.float32),
        device="cpu",
        dtype="float32",
    )
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad.shape == expected_grads[name].shape, name
        np.testing.assert_allclose(grad, expected_grads[name], atol=5e-5, err_msg=name)
    # The layer (and its framework) still works after an empty call.
    full = [rng.standard_normal((2, n, 8)).astype(np.float32) for n in (3, 4, 4)]
    expected, _ = spec.reference_forward(weights, *full, num_heads=2)
    np.testing.assert_allclose(runner.call(layer, *full), expected, atol=5e-6)


# -- arguments of the wrong type ---------------------------------------------


@pytest.mark.parametrize("causal", ["False", "True", 1, np.array(True), np.array([True, False])])
def test_causal_must_be_a_bool(runner, causal):
    weights = init_weights(8, seed=7)
    layer = layer_with(runner, weights, 2)
    rng = np.random.default_rng(7)
    f32 = [rng.standard_normal((2, n, 8)).astype(np.float32) for n in (3, 4, 4)]
    for return_attention_weights in (False, True):
        with pytest.raises(TypeError, match="causal must be a bool"):
            runner.call(
                layer, *f32, causal=causal, return_attention_weights=return_attention_weights
            )


@pytest.mark.parametrize("flag", ["False", 1, np.array(True)])
def test_the_other_flags_must_be_bools(runner, flag):
    """``bias`` and ``return_attention_weights`` as ``causal``: a string would switch
    the biases on, or return the weights; a NumPy bool is a bool."""
    weights = init_weights(8, seed=7)
    with pytest.raises(TypeError, match="bias must be a bool"):
        runner.make_layer(8, 2, bias=flag, query_size=8, key_size=8, value_size=8)
    layer = layer_with(runner, weights, 2)
    rng = np.random.default_rng(7)
    f32 = [rng.standard_normal((2, n, 8)).astype(np.float32) for n in (3, 4, 4)]
    with pytest.raises(TypeError, match="return_attention_weights must be a bool"):
        runner.call(layer, *f32, return_attention_weights=flag)
    output, weights_given = runner.call(layer, *f32, return_attention_weights=np.bool_(True))
    expected, expected_weights = spec.reference_forward(weights, *f32, num_heads=2)
    np.testing.assert_allclose(output, expected, atol=5e-6)
    np.testing.assert_allclose(weights_given, expected_weights, atol=5e-6)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_python_lists_are_not_arrays(runner, position):
    weights = init_weights(8, seed=8)
    layer = layer_with(runner, weights, 2)
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal((2, n, 8)).astype(np.float32) for n in (3, 4, 4)]
    native = runner.call_as_given  # the framework's own arrays for the other two
    converted = [runner.to_native(x) for x in arrays]
    converted[position] = arrays[position].tolist()
    name = ("queries", "keys", "values")[position]
    with pytest.raises(TypeError, match=name):
        native(layer, *converted)
