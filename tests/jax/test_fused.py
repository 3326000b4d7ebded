"""The fused path (jax.nn.dot_product_attention): when it runs, what it is given, its numbers.

On a CPU the default is the generic path; ``implementation="xla"`` runs the
fused path through XLA's kernel, the translation cuDNN's shares.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax_support import LinenRunner, NNXRunner, gpu, inputs, nan_where_nothing_is_seen

from mha_multi import spec
from mha_multi.jax import MultiHeadAttention, linen, multi_head_attention, set_weights
from mha_multi.jax._kernel import DOT_PRODUCT_ATTENTION, fused_dtype_supported
from mha_multi.parity.cases import CASES
from mha_multi.parity.harness import jax as backend
from mha_multi.parity.runners import get_runner
from mha_multi.weights import init_weights
from tests.backends import test_edges as edges
from tests.backends import test_fused_path as fused_path

INPUT_NAMES = backend.INPUT_NAMES


class XlaRunner(NNXRunner):
    """Layers with ``implementation="xla"``: the default call is the fused path,
    through XLA's kernel."""

    fused_kernel = DOT_PRODUCT_ATTENTION

    def __init__(self, **options):
        super().__init__(implementation="xla", **options)


XLA = XlaRunner()
SIXTEEN_BIT = ("bfloat16", "float16")


@pytest.fixture
def kernel_calls():
    """Every jax.nn.dot_product_attention call of the layers during the test."""
    with backend.kernel_spy() as calls:
        yield calls


def numpy_inputs(case):
    return [case.inputs[name] for name in INPUT_NAMES]


@pytest.mark.parametrize("name", [config.name for config in CASES])
def test_xla_kernel_follows_the_kernel_plan(cases, name):
    fused_path.test_default_call_follows_the_kernel_plan(XLA, cases, name)


@pytest.mark.parametrize(
    ("name", "lengths"),
    [
        ("lens_1d", [4, 7, 1]),
        ("lens_overlong", [7, 7, 7]),  # clipped to K = 7
        ("lens_zero", [1, 1, 3]),  # rows of lengths <= 0 are replaced after
        ("causal_cross", [6, 7, 2]),
    ],
)
def test_key_lengths_reach_the_kernel_as_int32_within_one_and_k(kernel_calls, cases, name, lengths):
    case = cases[name]
    XLA.call(XLA.layer_for(case), *numpy_inputs(case), case.valid_lens, causal=case.config.causal)
    (call,) = kernel_calls
    np.testing.assert_array_equal(call.key_lengths, lengths)
    assert call.key_lengths.dtype == np.int32


@pytest.mark.parametrize("name", [config.name for config in CASES])
def test_every_case_and_its_gradients_match_the_reference_under_jit(kernel_calls, cases, name):
    case = cases[name]
    config = case.config
    causal = config.causal
    cotangent = jnp.asarray(case.output_gradient)

    gates = XLA.case_options(case).get("head_mask")

    # Positions and biases as the case has them; options are static.
    given = {"positions": case.positions, "bias": case.bias}

    @jax.jit
    def forward_and_grads(
        params, q, k, v, lens, gates, given, causal=causal, cotangent=cotangent, config=config
    ):
        def loss(params, q, k, v):
            out = multi_head_attention(
                params,
                q,
                k,
                v,
                lens,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                causal=causal,
                return_attention_weights=False,
                implementation="xla",
                head_mask=gates,
                options=config.layer_options(),
                **given,
            )[0]
            return jnp.sum(out * cotangent), out

        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(params, q, k, v)

    params = {key: jnp.asarray(value) for key, value in case.weights.items()}
    (param_grads, *input_grads), out = forward_and_grads(
        params, *inputs(case), case.valid_lens, gates, given
    )
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6, err_msg=config.name)
    for key, grad in [*zip(INPUT_NAMES, input_grads, strict=True), *param_grads.items()]:
        np.testing.assert_allclose(grad, case.reference[f"grad.{key}"], atol=5e-5, err_msg=key)
    # Traced once: the fused path, but for the score options (a bias, ALiBi, a
    # window, a soft cap), which JAX's kernel call does not take; rotary and the
    # query/key norms act on q and k before any path.
    scored = case.bias is not None or set(config.options or {}) - {"rotary", "qk_norm"}
    assert len(kernel_calls) == (0 if scored else 1)


@pytest.mark.parametrize("name", ["lens_2d", "causal_more_queries", "causal_lens_2d"])
def test_fully_hidden_rows_are_corrected_whatever_the_kernel_leaves_there(monkeypatch, cases, name):
    # cuDNN's kernel leaves a query that sees no key NaN; the correction must
    # replace those rows and keep their NaN out of every gradient.
    nan_where_nothing_is_seen(monkeypatch)
    case = cases[name]
    params = {n: jnp.asarray(w) for n, w in case.weights.items()}

    def forward(params, q, k, v):
        return multi_head_attention(
            params,
            q,
            k,
            v,
            case.valid_lens,
            num_heads=case.config.num_heads,
            causal=case.config.causal,
            return_attention_weights=False,
            implementation="xla",
        )[0]

    out, vjp = jax.vjp(forward, params, *inputs(case))
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)
    param_grads, *input_grads = vjp(jnp.asarray(case.output_gradient))
    for name_, grad in zip(INPUT_NAMES, input_grads, strict=True):
        np.testing.assert_allclose(grad, case.reference[f"grad.{name_}"], atol=5e-5)
    for name_, grad in param_grads.items():
        np.testing.assert_allclose(grad, case.reference[f"grad.{name_}"], atol=5e-5)


def test_fully_hidden_rows_are_the_mean_of_the_values():
    # Hand-computed: a query that sees no key gets uniform weights 1/K.
    rng = np.random.default_rng(3)
    weights = {f"W_{p}": np.eye(4, dtype=np.float32) for p in "qkvo"}
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 4)).astype(np.float32)) for _ in range(3))
    out, _ = multi_head_attention(
        weights,
        q,
        k,
        v,
        jnp.array([0, -1]),
        num_heads=2,
        return_attention_weights=False,
        implementation="xla",
    )
    expected = np.broadcast_to(np.asarray(v).mean(axis=1, keepdims=True), (2, 3, 4))
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_dropout_and_float64_take_the_generic_path(kernel_calls, cases):
    case = cases["lens_none"]
    layer = XlaRunner(dropout=0.5).layer_for(case)
    layer.train()
    layer(*inputs(case), rngs=jax.random.key(0))  # no kernel has dropout on the weights
    assert kernel_calls == []
    layer.eval()
    layer(*inputs(case))
    assert len(kernel_calls) == 1  # a layer with dropout, in eval mode
    out = XLA.call(XLA.layer_for(case, dtype="float64"), *numpy_inputs(case), dtype="float64")
    assert len(kernel_calls) == 1  # the kernel's softmax is float32
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("name", ["lens_zero", "causal_lens_2d", "lens_1d_float"])
def test_16_bit_fused_path_within_tolerance(kernel_calls, cases, dtype, name):
    case = cases[name]
    layer = XLA.layer_for(case, dtype=dtype)
    out = layer(*inputs(case, dtype), case.valid_lens, causal=case.config.causal)
    assert len(kernel_calls) == 1 and out.dtype == backend.DTYPES[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), case.reference["output"], atol=2e-2)


def test_precision_reaches_the_kernel_products(cases):
    case = cases["lens_1d"]
    q, k, v = inputs(case)

    def products(precision):
        jaxpr = jax.make_jaxpr(
            lambda q, k, v: multi_head_attention(
                case.weights,
                q,
                k,
                v,
                case.valid_lens,
                num_heads=case.config.num_heads,
                precision=precision,
                return_attention_weights=False,
                implementation="xla",
            )[0]
        )(q, k, v)
        return [
            eqn.params["precision"]
            for eqn in _equations(jaxpr.jaxpr)
            if eqn.primitive.name == "dot_general"
        ]

    for precision in ("highest", lax.Precision.HIGHEST, ("highest", "highest")):
        found = products(precision)
        assert len(found) == 6  # four projections and the kernel's two products
        assert all(p == (lax.Precision.HIGHEST, lax.Precision.HIGHEST) for p in found)


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def test_which_dtypes_and_precisions_the_fused_path_serves():
    served = fused_dtype_supported
    assert served(jnp.float32) and served(jnp.bfloat16) and served(jnp.float16)
    assert served(jnp.float32, precision=lax.DotAlgorithmPreset.F32_F32_F32)
    assert not served(jnp.float64)
    assert not served(jnp.float32, precision=(lax.Precision.DEFAULT, lax.Precision.HIGHEST))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["lens_zero", "causal_cross", "causal_lens_2d"])
def test_nnx_and_linen_fused_paths_are_bit_identical(cases, dtype, name):
    case = cases[name]
    causal = case.config.causal
    layer = XLA.layer_for(case, dtype=dtype)
    linen_layer = LinenRunner(implementation="xla").layer_for(case, dtype=dtype)
    module, variables = linen_layer.module, linen_layer.variables
    arrays = inputs(case, dtype)
    calls = [
        lambda: layer(*arrays, case.valid_lens, causal=causal),
        lambda: module.apply(variables, *arrays, case.valid_lens, causal=causal),
        lambda: nnx.jit(lambda layer, *x: layer(*x, causal=causal))(
            layer, *arrays, case.valid_lens
        ),
        lambda: jax.jit(lambda v, *x: module.apply(v, *x, causal=causal))(
            variables, *arrays, case.valid_lens
        ),
    ]
    outputs = []
    for run in calls:
        # A spy of its own each: the eager calls of both modules are one
        # compiled program, which the second would find already traced.
        with backend.kernel_spy() as kernel_calls:
            outputs.append(run())
        assert len(kernel_calls) == 1
    eager, jitted = outputs[:2], outputs[2:]
    for nnx_out, linen_out in (eager, jitted):
        np.testing.assert_array_equal(nnx_out, linen_out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_default_is_the_generic_path(kernel_calls, cases, dtype):
    # XLA's kernel measured no faster than the generic path on a CPU.
    case = cases["causal_lens_2d"]
    default, generic = get_runner("jax-nnx"), NNXRunner(implementation="generic")
    out, out_generic = (
        runner.layer_for(case, dtype=dtype)(*inputs(case, dtype), case.valid_lens, causal=True)
        for runner in (default, generic)
    )
    assert kernel_calls == []
    np.testing.assert_array_equal(out, out_generic)


def test_unknown_implementation_is_a_value_error():
    with pytest.raises(ValueError, match="implementation must be None, 'generic', 'xla'"):
        MultiHeadAttention(8, 2, implementation="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="implementation must be None"):
        linen.MultiHeadAttention(8, 2, implementation="flash")
    q = jnp.ones((1, 2, 8))
    with pytest.raises(ValueError, match="implementation must be None"):
        multi_head_attention(init_weights(8), q, q, q, num_heads=2, implementation="flash")


@pytest.mark.parametrize(
    ("lens", "causal", "num_queries"),
    [([0, 5], False, 6), ([[0, 1, 2, 3, 4, 6]] * 2, True, 6), (None, True, 8), ([3, 1], True, 4)],
)
def test_gpu_16_bit_default_is_cudnn_and_matches_the_reference(
    kernel_calls, lens, causal, num_queries
):
    device = gpu()
    weights = init_weights(32, bias=True, seed=6)  # 2 heads of 16: cuDNN's head sizes
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, num_queries, 32)).astype(np.float32)
    kv = rng.standard_normal((2, 6, 32)).astype(np.float32)
    lens = None if lens is None else np.asarray(lens)
    expected, _ = spec.reference_forward(weights, q, kv, kv, lens, num_heads=2, causal=causal)
    layer = backend.make_layer(32, 2, bias=True, device=device, dtype="bfloat16")
    set_weights(layer, weights).eval()
    q16, kv16 = (backend.to_native(x, device, "bfloat16") for x in (q, kv))
    with jax.default_device(backend.device(device)):
        out = layer(q16, kv16, kv16, lens, causal=causal)
        grads = jax.grad(
            lambda q: layer(q, kv16, kv16, lens, causal=causal).astype(jnp.float32).sum()
        )(q16)
    # The default asks for no kernel but cuDNN's on a GPU.
    assert kernel_calls
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-2)
    assert np.isfinite(np.asarray(grads, np.float32)).all()


def test_gpu_16_bit_head_sizes_cudnn_declines_take_the_generic_path(kernel_calls, cases):
    device = gpu()
    case = cases["book"]  # head size 20: not a multiple of 8
    layer = get_runner("jax-nnx").layer_for(case, device=device, dtype="bfloat16")
    with jax.default_device(backend.device(device)):
        out = layer(*inputs(case, "bfloat16", device), case.valid_lens)
    assert len(kernel_calls) == 1  # cuDNN's, which declined while traced
    np.testing.assert_allclose(np.asarray(out, np.float64), case.reference["output"], atol=2e-2)


# -- the edge inputs of tests/backends/test_edges.py on XLA's kernel ------------


@pytest.fixture(scope="module")
def xla_runner():
    return XLA


def _parameters(test, argname):
    """The values ``test`` is parametrized with for ``argname``, as its own marks list them."""
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == argname:
            return list(mark.args[1]), mark.kwargs.get("ids")
    raise LookupError(f"{test.__name__} is not parametrized over {argname}")


EXTREME_LENS, EXTREME_LENS_IDS = _parameters(edges.test_extreme_lengths_mean_what_they_say, "lens")


@pytest.mark.parametrize("name", sorted(edges.NONFINITE))
def test_xla_kernel_nonfinite_inputs_propagate_as_in_reference(kernel_calls, xla_runner, name):
    edges.test_nonfinite_inputs_propagate_as_in_reference(xla_runner, "cpu", name)
    assert len(kernel_calls) == 2  # causal False and True: the default calls are fused


@pytest.mark.parametrize("lens", EXTREME_LENS, ids=EXTREME_LENS_IDS)
def test_xla_kernel_extreme_lengths_mean_what_they_say(kernel_calls, xla_runner, lens):
    edges.test_extreme_lengths_mean_what_they_say(xla_runner, "cpu", lens)
    assert len(kernel_calls) == 2


@pytest.mark.parametrize("dtype", edges.SIXTEEN_BIT)
@pytest.mark.parametrize(
    "test",
    [
        edges.test_16bit_projection_accumulates_in_float32,
        edges.test_16bit_attention_product_accumulates_in_float32,
        edges.test_16bit_huge_scores_neither_overflow_nor_leak,
    ],
    ids=lambda test: test.__name__.removeprefix("test_16bit_"),
)
def test_xla_kernel_16_bit_edges(kernel_calls, xla_runner, test, dtype):
    test(xla_runner, dtype)
    assert len(kernel_calls) == 1


@pytest.mark.parametrize("lens_kind", ["none", "1d", "2d"])
@pytest.mark.parametrize("shape", sorted(edges.EMPTY_SHAPES))
def test_xla_layer_with_empty_axes_takes_the_generic_path(
    kernel_calls, xla_runner, shape, lens_kind
):
    edges.test_empty_axes(xla_runner, shape, lens_kind)
    assert len(kernel_calls) == 1  # only the closing call on full shapes is fused


def test_packed_sequences_reach_the_kernel_as_a_mask(kernel_calls):
    from mha_multi.parity.cases import build_case
    from mha_multi.parity.compare import compare
    from mha_multi.parity.packed_cases import PACKED_CASES

    case = build_case(PACKED_CASES[1])  # causal, rotary, grouped heads, padding
    checks = compare(XLA.run(case, device="cpu", dtype="float32"), case.reference, "float32")
    assert [c.quantity for c in checks if not c.passed] == []
    assert kernel_calls and all(call.mask for call in kernel_calls)
