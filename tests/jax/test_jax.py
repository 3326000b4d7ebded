"""What only the JAX backend has: transformations, NNX/Linen equivalence, Flax conventions."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads
from jax_support import LinenRunner, NNXRunner, gpu, inputs
from option_cases import sink_past_float16

from mha_multi import spec
from mha_multi.jax import (
    MultiHeadAttention,
    _facts,
    functional,
    get_weights,
    linen,
    multi_head_attention,
    set_weights,
)
from mha_multi.parity.harness import jax as backend
from mha_multi.parity.runners import get_runner
from mha_multi.weights import init_weights
from tests.backends import test_parity as parity

NNX, LINEN = get_runner("jax-nnx"), get_runner("jax-linen")  # they turn on x64 for float64
INPUT_NAMES = backend.INPUT_NAMES


def linen_layer(case, dtype="float32", device="cpu", **options):
    """The Linen module of ``case`` (with ``options``) and its variables."""
    layer = LinenRunner(**options).layer_for(case, device=device, dtype=dtype)
    return layer.module, layer.variables


def small_inputs(seed=0, batch=2, num_queries=3, num_keys=4, size=8):
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        for shape in ((batch, num_queries, size), (batch, num_keys, size), (batch, num_keys, size))
    ]


# -- gradients ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["lens_2d", "causal_cross", "cross_sizes", "lens_zero"])
def test_check_grads_float64(cases, name):
    case = cases[name]
    params = {key: jnp.asarray(value, jnp.float64) for key, value in case.weights.items()}
    lens = case.valid_lens

    def forward(params, q, k, v):
        return multi_head_attention(
            params, q, k, v, lens, num_heads=case.config.num_heads, causal=case.config.causal
        )[0]

    # Compiled: check_grads evaluates the function and its derivatives many
    # times, and eagerly each evaluation compiles every operation anew.
    check_grads(jax.jit(forward), (params, *inputs(case, "float64")), order=1, modes=("fwd", "rev"))

    module, variables = linen_layer(case, "float64")

    def linen_forward(variables, q, k, v):
        return module.apply(variables, q, k, v, lens, causal=case.config.causal)

    check_grads(
        jax.jit(linen_forward), (variables, *inputs(case, "float64")), order=1, modes=("rev",)
    )


@pytest.mark.parametrize("name", ["book", "causal_lens_2d", "cross_sizes"])
def test_jitted_grad_matches_reference_gradients(cases, name):
    case = cases[name]
    layer = NNX.layer_for(case)
    cotangent = jnp.asarray(case.output_gradient)

    @nnx.jit
    def loss_grads(layer, q, k, v, lens):
        def loss(layer, q, k, v):
            out = layer(q, k, v, lens, causal=case.config.causal)
            return jnp.sum(out * cotangent)

        return nnx.grad(loss, argnums=(0, 1, 2, 3))(layer, q, k, v)

    layer_grads, *input_grads = loss_grads(layer, *inputs(case), case.valid_lens)
    for name_, grad in zip(INPUT_NAMES, input_grads, strict=True):
        np.testing.assert_allclose(grad, case.reference[f"grad.{name_}"], atol=5e-5)
    pure = nnx.to_pure_dict(layer_grads)
    for weight_name in case.weights:
        entry = "kernel" if weight_name.startswith("W") else "bias"
        grad = pure[f"W_{weight_name[-1]}"][entry]
        np.testing.assert_allclose(grad, case.reference[f"grad.{weight_name}"], atol=5e-5)


# -- transformations -----------------------------------------------------------


@pytest.mark.parametrize("name", ["book", "lens_1d_float", "causal_more_queries", "cross_sizes"])
def test_jit_matches_reference(cases, name):
    case = cases[name]
    causal = case.config.causal
    expected = case.reference["output"], case.reference["attention_weights"]

    nnx_call = nnx.jit(
        lambda layer, q, k, v, lens: layer(
            q, k, v, lens, causal=causal, return_attention_weights=True
        )
    )
    module, variables = linen_layer(case)
    linen_call = jax.jit(
        lambda variables, q, k, v, lens: module.apply(
            variables, q, k, v, lens, causal=causal, return_attention_weights=True
        )
    )
    functional_call = jax.jit(
        multi_head_attention, static_argnames=("num_heads", "causal", "dtype", "precision")
    )
    results = {
        "nnx": nnx_call(NNX.layer_for(case), *inputs(case), case.valid_lens),
        "linen": linen_call(variables, *inputs(case), case.valid_lens),
        "functional": functional_call(
            case.weights,
            *inputs(case),
            case.valid_lens,
            num_heads=case.config.num_heads,
            causal=causal,
        ),
    }
    for got in results.values():
        for actual, reference in zip(got, expected, strict=True):
            np.testing.assert_allclose(actual, reference, atol=5e-6)


def test_vmap_over_an_extra_leading_axis():
    num_stacks, weights = 3, init_weights(8, bias=True, seed=4)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((num_stacks, 2, 3, 8)).astype(np.float32)
    kv = rng.standard_normal((num_stacks, 2, 5, 8)).astype(np.float32)
    lens = np.array([[1, 5], [0, 3], [4, 2]])
    expected = np.stack(
        [
            spec.reference_forward(weights, q[i], kv[i], kv[i], lens[i], num_heads=2)[0]
            for i in range(num_stacks)
        ]
    )

    functional = jax.vmap(
        lambda q, kv, lens: multi_head_attention(weights, q, kv, kv, lens, num_heads=2)[0]
    )
    layer = set_weights(MultiHeadAttention(8, 2, bias=True, rngs=nnx.Rngs(0)), weights)
    nnx_vmapped = nnx.vmap(
        lambda layer, q, kv, lens: layer(q, kv, kv, lens), in_axes=(None, 0, 0, 0)
    )
    module = linen.MultiHeadAttention(8, 2, bias=True)
    variables = linen.variables_from_weights(weights, module)
    linen_vmapped = jax.vmap(lambda q, kv, lens: module.apply(variables, q, kv, kv, lens))

    for got in (
        functional(q, kv, lens),
        nnx_vmapped(layer, q, kv, lens),
        jax.jit(linen_vmapped)(q, kv, lens),
    ):
        assert got.shape == (num_stacks, 2, 3, 8)
        np.testing.assert_allclose(got, expected, atol=5e-6)


# -- errors under jit ------------------------------------------------------------


def test_jitted_bad_shapes_raise_the_same_value_error():
    weights = init_weights(8)
    layer = set_weights(MultiHeadAttention(8, 2, rngs=nnx.Rngs(0)), weights)
    module = linen.MultiHeadAttention(8, 2)
    variables = linen.variables_from_weights(weights, module)
    q, k, v = small_inputs()
    nnx_call = nnx.jit(lambda layer, q, k, v, lens: layer(q, k, v, lens))
    linen_call = jax.jit(lambda q, k, v, lens: module.apply(variables, q, k, v, lens))
    functional_call = jax.jit(
        lambda q, k, v, lens: multi_head_attention(weights, q, k, v, lens, num_heads=2)
    )
    calls = [functools.partial(nnx_call, layer), linen_call, functional_call]
    bad = [
        ((q[..., :5], k, v, None), "queries last dimension must be query_size=8"),
        ((q, k, v[:, :3], None), "same length; got 4 keys and 3 values"),
        ((q, k, v, jnp.ones((2, 4))), r"\(batch, num_queries\) = \(2, 3\)"),
    ]
    for call in calls:
        for args, match in bad:
            with pytest.raises(ValueError, match=match):
                call(*args)
        with pytest.raises(TypeError, match="valid_lens must be an integer or floating"):
            call(q, k, v, jnp.array([True, False]))


def test_non_floating_inputs_are_a_type_error():
    layer = MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
    q, k, v = small_inputs()
    with pytest.raises(TypeError, match="keys must be a floating-point array; got int32"):
        layer(q, k.astype(jnp.int32), v)
    with pytest.raises(TypeError, match="queries must be an array; got list"):
        layer([[[0.0] * 8]], k, v)


# -- NNX and Linen are the same computation ------------------------------------------


# The parity report compares the two runners on every case; here, one case
# per feature keeps the eager (op-by-op compiled) comparison quick.
BIT_IDENTICAL_CASES = ("book", "lens_1d_float", "causal_lens_2d", "cross_sizes")


@pytest.mark.parametrize("name", BIT_IDENTICAL_CASES)
@pytest.mark.parametrize("dtype", list(backend.DTYPES))
def test_nnx_and_linen_are_bit_identical(cases, dtype, name):
    case = cases[name]
    causal = case.config.causal
    layers = [runner.layer_for(case, dtype=dtype) for runner in (NNX, LINEN)]
    arrays = inputs(case, dtype)
    got_nnx, got_linen = (
        runner.forward(
            layer, *arrays, case.valid_lens, causal=causal, return_attention_weights=True
        )
        for runner, layer in zip((NNX, LINEN), layers, strict=True)
    )
    for a, b in zip(got_nnx, got_linen, strict=True):
        assert a.dtype == b.dtype == backend.DTYPES[dtype]
        np.testing.assert_array_equal(a, b)

    cotangent = backend.to_native(case.output_gradient, dtype=dtype)
    nnx_grads, linen_grads = (
        runner.vjp(layer, *arrays, case.valid_lens, causal=causal, output_gradient=cotangent)
        for runner, layer in zip((NNX, LINEN), layers, strict=True)
    )
    assert nnx_grads.keys() == linen_grads.keys()
    for name_, grad in nnx_grads.items():
        np.testing.assert_array_equal(grad, linen_grads[name_], err_msg=name_)


@pytest.mark.parametrize("name", ["book", "causal_lens_2d"])
def test_nnx_and_linen_are_bit_identical_under_jit(cases, name):
    case = cases[name]
    causal = case.config.causal
    module, variables = linen_layer(case)
    got_nnx = nnx.jit(lambda layer, *x: layer(*x, causal=causal, return_attention_weights=True))(
        NNX.layer_for(case), *inputs(case), case.valid_lens
    )
    got_linen = jax.jit(
        lambda v, *x: module.apply(v, *x, causal=causal, return_attention_weights=True)
    )(variables, *inputs(case), case.valid_lens)
    for a, b in zip(got_nnx, got_linen, strict=True):
        np.testing.assert_array_equal(a, b)


def test_dropout_with_the_same_key_is_bit_identical(cases):
    case = cases["book"]
    layer = NNXRunner(dropout=0.4).layer_for(case)
    layer.train()
    module, variables = linen_layer(case, dropout=0.4)
    root = jax.random.key(7)
    # The key Linen's top-level module draws for its first 'dropout' request.
    key = module.apply(variables, method=lambda m: m.make_rng("dropout"), rngs={"dropout": root})
    arrays = inputs(case)
    got_linen = module.apply(
        variables, *arrays, case.valid_lens, training=True, rngs={"dropout": root}
    )
    got_nnx = layer(*arrays, case.valid_lens, rngs=key)
    got_nnx_jit = nnx.jit(lambda layer, *x: layer(*x, rngs=key))(layer, *arrays, case.valid_lens)
    got_functional = multi_head_attention(
        case.weights,
        *arrays,
        case.valid_lens,
        num_heads=5,
        dropout_rate=0.4,
        deterministic=False,
        dropout_rng=key,
    )[0]
    np.testing.assert_array_equal(got_nnx, got_linen)
    np.testing.assert_array_equal(got_functional, got_linen)
    np.testing.assert_allclose(got_nnx_jit, got_linen, atol=1e-6)
    # Dropout did act: the result is not the deterministic output.
    assert np.abs(np.asarray(got_nnx) - case.reference["output"]).max() > 1e-2


def test_dropout_streams_are_reproducible_and_advance(cases):
    case = cases["book"]
    runner = NNXRunner(dropout=0.4)
    first, second = runner.layer_for(case), runner.layer_for(case)  # training: NNX's default
    arrays = inputs(case)
    a1, b1 = first(*arrays, case.valid_lens), second(*arrays, case.valid_lens)
    np.testing.assert_array_equal(a1, b1)  # same seed, same masks
    assert not np.array_equal(first(*arrays, case.valid_lens), a1)  # the stream advanced


# -- modes -----------------------------------------------------------------------


def test_train_eval_deterministic_and_view(cases):
    case = cases["book"]
    layer = NNXRunner(dropout=0.5).layer_for(case)
    arrays = inputs(case)
    expected = case.reference["output"]

    def close_to_reference(out):
        return np.abs(np.asarray(out) - expected).max() < 5e-6

    assert not layer.deterministic  # nnx.Dropout's default: training
    assert not close_to_reference(layer(*arrays, case.valid_lens))
    assert close_to_reference(layer(*arrays, case.valid_lens, deterministic=True))
    layer.eval()
    assert close_to_reference(layer(*arrays, case.valid_lens))
    assert not close_to_reference(layer(*arrays, case.valid_lens, deterministic=False))
    layer.train()
    assert close_to_reference(nnx.view(layer, deterministic=True)(*arrays, case.valid_lens))
    assert not close_to_reference(layer(*arrays, case.valid_lens))


def test_linen_training_needs_a_dropout_rng_and_eval_does_not(cases):
    case = cases["book"]
    module, variables = linen_layer(case, dropout=0.5)
    arrays = inputs(case)
    out = module.apply(variables, *arrays, case.valid_lens)
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)
    with pytest.raises(Exception, match="dropout"):
        module.apply(variables, *arrays, case.valid_lens, training=True)


def test_functional_dropout_without_a_key_is_an_error():
    q, k, v = small_inputs()
    with pytest.raises(ValueError, match="dropout_rng is required"):
        multi_head_attention(
            init_weights(8), q, k, v, num_heads=2, dropout_rate=0.1, deterministic=False
        )


# -- dtypes ------------------------------------------------------------------------


def test_computation_dtype_and_promotion(cases):
    case = cases["lens_zero"]
    reference = case.reference["output"]
    layer = MultiHeadAttention(16, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    set_weights(layer, case.weights)
    out = layer(*inputs(case), case.valid_lens)
    assert out.dtype == jnp.bfloat16 and layer.W_q.kernel[...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=2e-2)
    # Without a computation dtype, inputs and parameters promote (Flax's rule).
    promoted = NNX.layer_for(case)(*inputs(case, "float16"), case.valid_lens)
    assert promoted.dtype == jnp.float32


def test_set_weights_keeps_the_parameter_dtype():
    weights = init_weights(8, bias=True, seed=3)
    layer = set_weights(
        MultiHeadAttention(8, 2, bias=True, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), weights
    )
    assert layer.W_o.bias[...].dtype == jnp.bfloat16
    got = get_weights(layer)
    for name, array in weights.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], array.astype(jnp.bfloat16).astype(np.float32))
    # Weights of bfloat16 (which numpy does not count among its floats) are named so.
    bfloat16 = {name: jnp.asarray(array, jnp.bfloat16) for name, array in weights.items()}
    with pytest.raises(TypeError, match=r"got dtype bfloat16: canonical weights are float16"):
        set_weights(layer, bfloat16)


# -- parameters and weights -----------------------------------------------------------


def test_state_uses_d2l_names():
    layer = MultiHeadAttention(8, 2, bias=True, rngs=nnx.Rngs(0))
    paths = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert paths == {f"W_{p}/{t}" for p in "qkvo" for t in ("kernel", "bias")}
    module = linen.MultiHeadAttention(8, 2, bias=True)
    variables = module.init(jax.random.key(0), *small_inputs())
    assert jax.tree.map(jnp.shape, variables) == {
        "params": {f"W_{p}": {"kernel": (8, 8), "bias": (8,)} for p in "qkvo"}
    }
    np.testing.assert_array_equal(get_weights(layer)["W_q"], np.asarray(layer.W_q.kernel[...]))


def test_linen_infers_sizes_at_init_and_checks_them_after():
    module = linen.MultiHeadAttention(12, 3)
    rng = np.random.default_rng(1)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s).astype(np.float32))
        for s in ((2, 3, 7), (2, 5, 4), (2, 5, 6))
    )
    variables = module.init(jax.random.key(0), q, k, v)
    weights = linen.weights_from_variables(variables)
    assert {name: w.shape for name, w in weights.items()} == {
        "W_q": (7, 12),
        "W_k": (4, 12),
        "W_v": (6, 12),
        "W_o": (12, 12),
    }
    expected, _ = spec.reference_forward(weights, q, k, v, num_heads=3)
    np.testing.assert_allclose(module.apply(variables, q, k, v), expected, atol=5e-6)
    with pytest.raises(ValueError, match="keys last dimension must be key_size=4"):
        module.apply(variables, q, v, v)
    with pytest.raises(ValueError, match="queries last dimension must be query_size=8"):
        linen.MultiHeadAttention(12, 3, query_size=8).init(jax.random.key(0), q, k, v)


def test_linen_variables_round_trip_and_strict_loading():
    weights = init_weights(12, query_size=5, key_size=6, value_size=7, bias=True, seed=9)
    module = linen.MultiHeadAttention(12, 3, bias=True)
    got = linen.weights_from_variables(linen.variables_from_weights(weights, module))
    assert got.keys() == weights.keys()
    assert all(got[name].tobytes() == weights[name].tobytes() for name in weights)
    with pytest.raises(ValueError, match="missing 'b_k'"):
        linen.variables_from_weights(init_weights(12), module)
    with pytest.raises(ValueError, match=r"W_q'\] must have shape \(8, 12\)"):
        module = linen.MultiHeadAttention(12, 3, bias=True, query_size=8)
        linen.variables_from_weights(weights, module)
    module = linen.MultiHeadAttention(12, 3, bias=True)
    params = dict(linen.variables_from_weights(weights, module)["params"])
    for edited, match in (
        ({**params, "W_x": params["W_q"]}, r"Linen params: \['W_x'\]"),
        ({**params, "W_q": {**params["W_q"], "scale": params["W_q"]["bias"]}}, r"W_q: \['scale'\]"),
    ):
        with pytest.raises(ValueError, match=match):  # (not dropped: read back, they are lost)
            linen.weights_from_variables({"params": edited})


def test_configuration_errors_at_construction():
    with pytest.raises(ValueError, match=r"num_hiddens \(10\).*num_heads \(3\)"):
        linen.MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="key_size must be a positive int"):
        MultiHeadAttention(8, 2, key_size=-1, rngs=nnx.Rngs(0))


def test_valid_lens_accepts_sequences_numpy_and_jax_arrays(cases):
    case = cases["lens_2d"]
    layer = NNX.layer_for(case)
    for valid_lens in (
        case.valid_lens.tolist(),
        case.valid_lens,
        jnp.asarray(case.valid_lens),
        case.valid_lens.astype(np.float16),
    ):
        out = layer(*inputs(case), valid_lens)
        np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)


def test_positions_beyond_32_bits_without_x64_are_refused_not_wrapped():
    """Without x64 JAX holds int64 positions as int32, wrapping ``2**32 + 2`` to 2: numpy
    positions past int32 are refused naming them, and those within it rotate as the
    reference rotates them."""
    weights = init_weights(8, seed=5)
    queries = small_inputs(5)[0]
    rotary = {"theta": 100.0}
    beyond = np.array([[0, 1, 2**32 + 2], [3, 2**31, 5]])
    within = np.array([[0, 1, 70000], [3, -9, 5]])
    expected, _ = spec.reference_forward(
        weights, *[queries] * 3, num_heads=2, rotary=rotary, positions=within
    )
    with jax.enable_x64(False):
        params = {name: jnp.asarray(w, jnp.float32) for name, w in weights.items()}

        def call(positions):
            return multi_head_attention(
                params,
                *[queries] * 3,
                num_heads=2,
                options={"rotary": rotary},
                positions=positions,
                return_attention_weights=False,
            )[0]

        with pytest.raises(
            ValueError, match=r"^positions must fit in int32, the integers .*4294967298$"
        ):
            call(beyond)
        out = call(within)
    np.testing.assert_allclose(out, expected, atol=5e-6)


@pytest.mark.parametrize("implementation", ["generic", "xla"])
@pytest.mark.parametrize(
    "lens",
    [
        np.array([2**62, 2]),
        [sys.maxsize, -sys.maxsize - 1],
        np.array([2**31, -(2**31) - 1]),
        np.array([2**63 + 5, 3], np.uint64),
        np.array([[2**40, 0, -(2**40)], [1, 2**33, 3]]),
    ],
    ids=["2^62", "maxsize_list", "2^31", "uint64", "2d_large"],
)
def test_integer_lengths_beyond_32_bits_are_clipped_not_wrapped(lens, implementation):
    # Without x64 JAX would turn 2**62 into 0 and 2**31 into -2**31: every key hidden.
    weights = init_weights(8, seed=5)
    queries, keys, values = small_inputs(5)
    expected, _ = spec.reference_forward(weights, queries, keys, values, lens, num_heads=2)
    with jax.enable_x64(False):
        params = {name: jnp.asarray(w, jnp.float32) for name, w in weights.items()}
        assert functional.as_valid_lens(lens).dtype == jnp.int32
        out, _ = multi_head_attention(
            params,
            queries,
            keys,
            values,
            lens,
            num_heads=2,
            return_attention_weights=False,
            implementation=implementation,
        )
    np.testing.assert_allclose(out, expected, atol=5e-6)


@pytest.mark.parametrize("implementation", ["generic", "xla"])
@pytest.mark.parametrize(
    "lens",
    [
        np.array([5e-324, 2 + 1e-9]),
        np.array([[1e-310, 1 + 1e-12, -1e-300], [np.nan, np.inf, 3 - 1e-13]]),
    ],
    ids=["1d", "2d"],
)
def test_float64_lengths_without_x64_show_the_keys_they_show(lens, implementation):
    # Rounded to float32, 5e-324 would be 0 (key 0 hidden) and 2 + 1e-9 would be 2.
    weights = init_weights(8, seed=5)
    queries, keys, values = small_inputs(5)
    expected, _ = spec.reference_forward(weights, queries, keys, values, lens, num_heads=2)
    with jax.enable_x64(False):
        params = {name: jnp.asarray(w, jnp.float32) for name, w in weights.items()}
        assert functional.as_valid_lens(lens).dtype == jnp.float32
        out, _ = multi_head_attention(
            params,
            queries,
            keys,
            values,
            lens,
            num_heads=2,
            return_attention_weights=False,
            implementation=implementation,
        )
    np.testing.assert_allclose(out, expected, atol=5e-6)


# -- the generic path on a CPU, piece by piece -------------------------------------


# Pieces split the batch axis only: one case of each kind of per-example
# argument or option in float32 (lengths of each rank, causal, grouped heads,
# gates, positions, biases, windows), and 16-bit arithmetic on a few.
PIECES_CASES = (
    "book",
    "lens_1d",
    "lens_2d",
    "lens_zero",
    "causal_cross",
    "cross_sizes",
    "gqa",
    "head_mask_gqa",
    "rotary",
    "bias",
    "score_bias",
    "alibi",
    "window",
    "softcap",
)


@pytest.mark.parametrize(
    ("case_name", "dtype"),
    [(name, "float32") for name in PIECES_CASES]
    + [(name, "bfloat16") for name in ("cross_sizes", "gqa", "lens_2d")],
)
def test_pieces_of_the_batch_match_the_reference(monkeypatch, cases, dtype, case_name):
    # The cases' scores are far below the budget: one byte makes every example a piece.
    monkeypatch.setattr(_facts, "CPU_PIECE_BYTES", 1)
    parity.test_case_within_tolerance(NNX, "cpu", dtype, case_name, cases)


def _pieces_traced(case, **kwargs):
    """Whether the generic path goes piece by piece (a scan) for ``case``."""
    jaxpr = jax.make_jaxpr(
        lambda *x: multi_head_attention(
            case.weights, *x, case.valid_lens, num_heads=case.config.num_heads, **kwargs
        )
    )(*inputs(case))
    return "scan" in str(jaxpr)


def test_pieces_only_past_the_budget_and_never_with_dropout(monkeypatch, cases):
    case = cases["lens_2d"]
    assert not _pieces_traced(case)
    monkeypatch.setattr(_facts, "CPU_PIECE_BYTES", 1)
    assert _pieces_traced(case)
    # One dropout mask for the whole batch, as Flax draws it.
    dropout = {"dropout_rate": 0.5, "deterministic": False, "dropout_rng": jax.random.key(0)}
    assert not _pieces_traced(case, **dropout)


@pytest.mark.parametrize(
    ("budget", "pieces"),
    [(6, 1), (4, 2), (3, 2), (2.5, 3), (2, 3), (1.5, 6), (1, 6), (0, 6)],
)
def test_the_batch_splits_into_the_fewest_pieces_within_the_budget(monkeypatch, budget, pieces):
    example_bytes = 120
    monkeypatch.setattr(_facts, "CPU_PIECE_BYTES", int(budget * example_bytes))
    assert _facts.batch_pieces(6, example_bytes) == pieces


# -- GPU --------------------------------------------------------------------------


def test_gpu_highest_precision_float32_parity(cases):
    device = gpu()
    case = cases["causal_lens_2d"]
    layer = NNXRunner(precision="highest").layer_for(case, device=device)
    module, variables = linen_layer(case, device=device, precision="highest")
    arrays = inputs(case, device=device)
    with jax.default_device(backend.device(device)):
        out = layer(*arrays, case.valid_lens, causal=True)
        linen_out = module.apply(variables, *arrays, case.valid_lens, causal=True)
    assert layer.W_q.kernel[...].devices() == {backend.device(device)}
    assert out.devices() == {backend.device(device)}
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)
    np.testing.assert_array_equal(out, linen_out)
    got = get_weights(layer)
    assert all(got[name].tobytes() == case.weights[name].tobytes() for name in case.weights)


def test_functional_sinks_are_a_parameter_and_an_option():
    weights = init_weights(16, num_heads=4, num_kv_heads=2, sinks=True, seed=9)
    weights["sinks"] = np.array([2.0, -1.0, 0.5, 0.0], np.float32)
    rng = np.random.default_rng(9)
    q, kv = (rng.standard_normal((2, 3, 16)).astype(np.float32) for _ in range(2))
    lens = np.array([3, 0], np.int32)
    expected, _ = spec.reference_forward(weights, q, kv, kv, lens, num_heads=4, sinks=True)

    def loss(params):
        out, _ = multi_head_attention(params, q, kv, kv, lens, num_heads=4, options={"sinks": True})
        return jnp.sum(out), out

    (grads, out) = jax.grad(loss, has_aux=True)(weights)
    np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)
    assert grads["sinks"].shape == (4,) and np.abs(np.asarray(grads["sinks"])).max() > 0
    without = {name: value for name, value in weights.items() if name != "sinks"}
    with pytest.raises(ValueError, match="'sinks'"):
        multi_head_attention(without, q, kv, kv, num_heads=4, options={"sinks": True})
    with pytest.raises(ValueError, match="'sinks'"):
        multi_head_attention(weights, q, kv, kv, num_heads=4)


@pytest.mark.parametrize("rotary", [None, {"theta": 100.0}], ids=["plain", "rotary"])
def test_flax_summaries_tabulate_the_layer(rotary):
    """``nnx.tabulate`` and Linen's ``Module.tabulate``, as for Flax's own attention: NNX
    compiled each method a call makes and returned the input sizes as traced arrays,
    which the call's checks compared (``TracerBoolConversionError``); Linen's checks
    called a method before the module's setup (an ``AssertionError`` inside Flax)."""
    x = jnp.ones((2, 5, 16))
    layer = MultiHeadAttention(16, 4, rotary=rotary, rngs=nnx.Rngs(0))
    table = nnx.tabulate(layer, x, x, x)
    assert "W_q" in table and "MultiHeadAttention" in table
    module = linen.MultiHeadAttention(16, 4, rotary=rotary)
    table = module.tabulate(jax.random.key(0), x, x, x)
    assert "W_q" in table and "MultiHeadAttention" in table
    # The layer calls as before afterwards (nnx.tabulate's wrappers are gone).
    layer.eval()
    assert layer(x, x, x).shape == (2, 5, 16)


def test_mode_flags_that_are_no_bools_are_refused():
    """``deterministic`` (NNX) and ``training`` (Linen) are bools: the string "False" is
    truthy, and turned NNX's dropout off and Linen's on."""
    x = jnp.ones((2, 3, 8))
    with pytest.raises(TypeError, match="^deterministic must be a bool; got 'False'"):
        MultiHeadAttention(8, 2, dropout=0.5, deterministic="False", rngs=nnx.Rngs(0))
    layer = MultiHeadAttention(8, 2, dropout=0.5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="^deterministic must be a bool; got 'False'"):
        layer(x, x, x, deterministic="False")
    module = linen.MultiHeadAttention(8, 2, dropout=0.5)
    variables = module.init(jax.random.key(0), x, x, x)
    with pytest.raises(TypeError, match="^training must be a bool; got 'False'"):
        module.apply(variables, x, x, x, training="False", rngs={"dropout": jax.random.key(1)})
    # Numpy's bools are bools.
    out = module.apply(variables, x, x, x, training=np.False_)
    np.testing.assert_array_equal(out, module.apply(variables, x, x, x))


def test_a_float64_layer_or_cache_without_x64_is_refused_not_computed_in_float32():
    """Without x64 JAX holds float64 as float32: a layer asked for float64 computed in
    float32 with JAX's warning alone. With x64 the same calls give float64."""
    makers = {
        "nnx dtype": lambda: MultiHeadAttention(8, 2, dtype=jnp.float64),
        "nnx param_dtype": lambda: MultiHeadAttention(8, 2, param_dtype=jnp.float64),
        "linen param_dtype": lambda: linen.MultiHeadAttention(8, 2, param_dtype=jnp.float64),
        "linen dtype": lambda: linen.MultiHeadAttention(8, 2, dtype="float64"),
        "init_cache": lambda: MultiHeadAttention(8, 2).init_cache(1, 4, dtype=jnp.float64),
    }
    x64 = jax.config.jax_enable_x64
    try:
        jax.config.update("jax_enable_x64", False)
        for name, make in makers.items():
            with pytest.raises(
                ValueError,
                match="^dtype float64: JAX holds float64 arrays as float32"
                if "param" not in name
                else "^param_dtype float64: JAX holds",
            ):
                make()
        jax.config.update("jax_enable_x64", True)
        x = np.ones((1, 3, 8))
        assert MultiHeadAttention(8, 2, dtype=jnp.float64)(x, x, x).dtype == jnp.float64
        assert makers["init_cache"]().keys.dtype == jnp.float64
    finally:
        jax.config.update("jax_enable_x64", x64)


def test_a_state_of_another_layer_is_refused_at_the_call():
    """``nnx.update`` takes any layer's state: another ``num_kv_heads``' kernels failed deep
    inside the call, and the sinks and norms of a layer with them were set beside an
    optionless layer's own and ignored (off by 0.5). The call names them; a state of
    the same configuration loads and gives its layer's numbers."""
    options = {"num_kv_heads": 2, "head_dim": 8, "sinks": True, "qk_norm": {"scope": "heads"}}
    source = MultiHeadAttention(12, 4, rngs=nnx.Rngs(0), **options)
    x = np.random.default_rng(0).standard_normal((1, 5, 12)).astype(np.float32)
    others = {
        "without options": ({"num_kv_heads": 2, "head_dim": 8}, "the layer holds 'sinks'"),
        "other heads": ({**options, "num_kv_heads": 1}, r"the layer holds W_k of shape \(12, 16\)"),
    }
    for config, match in others.values():
        target = MultiHeadAttention(12, 4, rngs=nnx.Rngs(1), **config)
        nnx.update(target, nnx.state(source))
        with pytest.raises(ValueError, match=match):
            target(x, x, x)
    same = MultiHeadAttention(12, 4, rngs=nnx.Rngs(1), **options)
    nnx.update(same, nnx.state(source))
    np.testing.assert_array_equal(np.asarray(same(x, x, x)), np.asarray(source(x, x, x)))


def test_a_linen_module_refuses_parameters_it_does_not_use():
    """Flax applies a module to any variables: the sinks, norms or biases of another
    module's were ignored (off by 0.2 to 0.6). The module names them; its own apply."""
    weights = init_weights(8, num_heads=2, bias=True, seed=3)
    weights.update(sinks=np.ones(2, np.float32), q_norm=np.ones(4, np.float32))
    weights["k_norm"] = np.ones(4, np.float32)
    variables = linen.variables_from_weights(weights)
    x = np.ones((1, 3, 8), np.float32)
    for config, unused in (
        ({"bias": True}, "k_norm, q_norm, sinks"),
        ({"bias": True, "sinks": True, "qk_norm": {"scope": "heads"}}, None),
        ({"bias": False, "sinks": True, "qk_norm": {"scope": "heads"}}, "W_q/bias, W_k/bias"),
    ):
        module = linen.MultiHeadAttention(8, 2, **config)
        if unused is None:
            module.apply(variables, x, x, x)
            continue
        with pytest.raises(ValueError, match=f"the module's params hold {unused}"):
            module.apply(variables, x, x, x)


def test_float16_computation_takes_float32_sink_logits_into_the_float32_softmax():
    """Parameters in float32, computation in float16: a sink logit past float16's 65504
    rounded to the computation's dtype first was ``inf``, and every output NaN (NNX and
    Linen). Head 0's sink takes all its weight: its context is 0, as the reference's."""
    weights, x, expected = sink_past_float16()
    nnx_layer = set_weights(
        MultiHeadAttention(8, 2, sinks=True, dtype=jnp.float16, param_dtype=jnp.float32), weights
    )
    module = linen.MultiHeadAttention(8, 2, sinks=True, dtype=jnp.float16)
    variables = linen.variables_from_weights(weights, module)
    for output in (nnx_layer(x, x, x), module.apply(variables, x, x, x)):
        np.testing.assert_allclose(np.asarray(output, np.float64), expected, rtol=0, atol=2e-3)
