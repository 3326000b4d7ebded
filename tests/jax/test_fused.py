"""The fused path (jax.nn.dot_product_attention): when it runs, what it is given, its numbers.

On a CPU the default is the generic path; ``implementation="xla"`` runs the
fused path through XLA's kernel, the translation cuDNN's shares.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from conftest import gpu_required
from mha_multi import spec
from mha_multi.jax import MultiHeadAttention, linen, multi_head_attention, set_weights
from mha_multi.jax.functional import fused_dtype_supported
from mha_multi.parity.cases import CASES, build_case
from mha_multi.parity.runners.jax import JaxNNXRunner
from mha_multi.weights import init_weights
from tests.backends import test_edges as edges

jax.config.update("jax_enable_x64", True)

INPUT_NAMES = ("queries", "keys", "values")


@functools.cache
def case_named(name):
    return build_case(next(c for c in CASES if c.name == name))


def arrays(case, dtype=jnp.float32):
    return [jnp.asarray(case.inputs[name], dtype) for name in INPUT_NAMES]


def nnx_layer(case, dtype=jnp.float32, implementation="xla", **kwargs):
    config = case.config
    layer = MultiHeadAttention(
        config.num_hiddens,
        config.num_heads,
        bias=config.bias,
        param_dtype=dtype,
        rngs=nnx.Rngs(0),
        implementation=implementation,
        **config.sizes(),
        **kwargs,
    )
    layer.eval()
    return set_weights(layer, case.weights)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the keyword arguments of every jax.nn.dot_product_attention call."""
    calls = []
    original = jax.nn.dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    return calls


# (case, what the kernel gets: mask, key lengths, is_causal)
PATHS = [
    ("lens_none", False, None, False),
    ("lens_1d", False, [4, 7, 1], False),
    ("lens_overlong", False, [7, 7, 7], False),  # clipped to K = 7
    ("lens_zero", False, [1, 1, 3], False),  # rows of lengths <= 0 are replaced after
    ("lens_1d_float", True, None, False),  # j < 2.5: a mask, not lengths
    ("lens_2d", True, None, False),
    ("causal", False, None, True),  # Q == K: the kernel's own (top-left) flag
    ("causal_cross", True, [6, 7, 2], False),  # Q < K: bottom-right needs a mask
    ("causal_more_queries", True, None, False),
    ("causal_lens_2d", True, None, True),
]


@pytest.mark.parametrize(("name", "mask", "lengths", "is_causal"), PATHS)
def test_default_call_takes_the_fused_path(kernel_calls, name, mask, lengths, is_causal):
    case = case_named(name)
    layer = nnx_layer(case)
    out = layer(*arrays(case), case.valid_lens, causal=case.config.causal)
    assert len(kernel_calls) == 1
    call = kernel_calls[0]
    assert (call["mask"] is not None) == mask
    assert call["is_causal"] == is_causal
    assert call["implementation"] == "xla"  # CPU
    if lengths is None:
        assert call["key_value_seq_lengths"] is None
    else:
        np.testing.assert_array_equal(call["key_value_seq_lengths"], lengths)
        assert call["key_value_seq_lengths"].dtype == jnp.int32
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)
    # The weights come from the generic path.
    _, weights = layer(
        *arrays(case), case.valid_lens, causal=case.config.causal, return_attention_weights=True
    )
    assert len(kernel_calls) == 1
    np.testing.assert_allclose(weights, case.reference["attention_weights"], atol=5e-6)


def test_every_case_and_its_gradients_match_the_reference_under_jit(kernel_calls):
    for config in CASES:
        case = case_named(config.name)
        causal = config.causal
        cotangent = jnp.asarray(case.output_gradient)

        @jax.jit
        def forward_and_grads(
            params, q, k, v, lens, causal=causal, cotangent=cotangent, num_heads=config.num_heads
        ):
            def loss(params, q, k, v):
                out = multi_head_attention(
                    params,
                    q,
                    k,
                    v,
                    lens,
                    num_heads=num_heads,
                    causal=causal,
                    return_attention_weights=False,
                    implementation="xla",
                )[0]
                return jnp.sum(out * cotangent), out

            return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(params, q, k, v)

        params = {name: jnp.asarray(value) for name, value in case.weights.items()}
        (param_grads, *input_grads), out = forward_and_grads(params, *arrays(case), case.valid_lens)
        np.testing.assert_allclose(out, case.reference["output"], atol=5e-6, err_msg=config.name)
        for name, grad in zip(INPUT_NAMES, input_grads, strict=True):
            np.testing.assert_allclose(grad, case.reference[f"grad.{name}"], atol=5e-5)
        for name, grad in param_grads.items():
            np.testing.assert_allclose(grad, case.reference[f"grad.{name}"], atol=5e-5)
    assert len(kernel_calls) == len(CASES)  # traced once per case: the fused path


@pytest.mark.parametrize("name", ["lens_2d", "causal_more_queries", "causal_lens_2d"])
def test_fully_hidden_rows_are_corrected_whatever_the_kernel_leaves_there(monkeypatch, name):
    # cuDNN's kernel leaves a query that sees no key NaN; the correction must
    # replace those rows and keep their NaN out of every gradient.
    original = jax.nn.dot_product_attention

    def nan_rows(q, k, v, *, mask=None, **kwargs):
        out = original(q, k, v, mask=mask, **kwargs)
        if mask is None:
            return out
        mask = mask if mask.ndim == 4 else mask[None, None]
        seen = jnp.transpose(jnp.any(mask, axis=-1), (0, 2, 1))[..., None]  # (B|1, Q|1, 1, 1)
        return jnp.where(seen, out, jnp.nan)

    monkeypatch.setattr(jax.nn, "dot_product_attention", nan_rows)
    case = case_named(name)
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

    out, vjp = jax.vjp(forward, params, *arrays(case))
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


def test_dropout_and_float64_take_the_generic_path(kernel_calls):
    case = case_named("lens_none")
    layer = nnx_layer(case, dropout=0.5)
    layer.train()
    layer(*arrays(case), rngs=jax.random.key(0))  # no kernel has dropout on the weights
    assert kernel_calls == []
    layer.eval()
    layer(*arrays(case))
    assert len(kernel_calls) == 1  # a layer with dropout, in eval mode
    out = nnx_layer(case, jnp.float64)(*arrays(case, jnp.float64))
    assert len(kernel_calls) == 1  # the kernel's softmax is float32
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", ["lens_zero", "causal_lens_2d", "lens_1d_float"])
def test_16_bit_fused_path_within_tolerance(kernel_calls, dtype, name):
    case = case_named(name)
    layer = nnx_layer(case, dtype)
    out = layer(*arrays(case, dtype), case.valid_lens, causal=case.config.causal)
    assert len(kernel_calls) == 1 and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), case.reference["output"], atol=2e-2)


def test_precision_reaches_the_kernel_products():
    case = case_named("lens_1d")
    q, k, v = arrays(case)

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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", ["lens_zero", "causal_cross", "causal_lens_2d"])
def test_nnx_and_linen_fused_paths_are_bit_identical(kernel_calls, dtype, name):
    case = case_named(name)
    causal = case.config.causal
    layer = nnx_layer(case, dtype)
    config = case.config
    module = linen.MultiHeadAttention(
        config.num_hiddens,
        config.num_heads,
        bias=config.bias,
        param_dtype=dtype,
        implementation="xla",
    )
    variables = linen.variables_from_weights(case.weights, module)
    inputs = arrays(case, dtype)
    eager = (
        layer(*inputs, case.valid_lens, causal=causal),
        module.apply(variables, *inputs, case.valid_lens, causal=causal),
    )
    jitted = (
        nnx.jit(lambda layer, *x: layer(*x, causal=causal))(layer, *inputs, case.valid_lens),
        jax.jit(lambda v, *x: module.apply(v, *x, causal=causal))(
            variables, *inputs, case.valid_lens
        ),
    )
    assert len(kernel_calls) == 4
    for nnx_out, linen_out in (eager, jitted):
        np.testing.assert_array_equal(nnx_out, linen_out)


@pytest.fixture
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        if gpu_required():
            pytest.fail("no GPU visible to JAX, and MHA_MULTI_REQUIRE_GPU is set")
        pytest.skip("no GPU visible to JAX")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_cpu_default_is_the_generic_path(kernel_calls, dtype):
    # XLA's kernel measured no faster than the generic path on a CPU.
    case = case_named("causal_lens_2d")
    out = nnx_layer(case, dtype, implementation=None)(
        *arrays(case, dtype), case.valid_lens, causal=True
    )
    out_generic = nnx_layer(case, dtype, implementation="generic")(
        *arrays(case, dtype), case.valid_lens, causal=True
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
    kernel_calls, gpu, lens, causal, num_queries
):
    weights = init_weights(32, bias=True, seed=6)  # 2 heads of 16: cuDNN's head sizes
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, num_queries, 32)).astype(np.float32)
    kv = rng.standard_normal((2, 6, 32)).astype(np.float32)
    lens = None if lens is None else np.asarray(lens)
    expected, _ = spec.reference_forward(weights, q, kv, kv, lens, num_heads=2, causal=causal)
    with jax.default_device(gpu):
        layer = set_weights(
            MultiHeadAttention(32, 2, bias=True, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
            weights,
        )
        layer.eval()
        q16, kv16 = (jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu) for x in (q, kv))
        out = layer(q16, kv16, kv16, lens, causal=causal)
        grads = jax.grad(
            lambda q: layer(q, kv16, kv16, lens, causal=causal).astype(jnp.float32).sum()
        )(q16)
    assert kernel_calls[0]["implementation"] == "cudnn"
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-2)
    assert np.isfinite(np.asarray(grads, np.float32)).all()


def test_gpu_16_bit_head_sizes_cudnn_declines_take_the_generic_path(kernel_calls, gpu):
    case = case_named("book")  # head size 20: not a multiple of 8
    with jax.default_device(gpu):
        layer = nnx_layer(case, jnp.bfloat16, implementation=None)
        out = layer(*[jax.device_put(x, gpu) for x in arrays(case, jnp.bfloat16)], case.valid_lens)
    assert [call["implementation"] for call in kernel_calls] == ["cudnn"]
    np.testing.assert_allclose(np.asarray(out, np.float64), case.reference["output"], atol=2e-2)


# -- the edge inputs of tests/backends/test_edges.py on XLA's kernel ------------


class XlaNNXRunner(JaxNNXRunner):
    """The NNX runner with ``implementation="xla"``: its default call is the fused path."""

    name = "jax-nnx-xla"

    def make_layer(self, num_hiddens, num_heads, **kwargs):
        return super().make_layer(num_hiddens, num_heads, implementation="xla", **kwargs)


@pytest.fixture(scope="module")
def xla_runner():
    return XlaNNXRunner()


def _parameters(test, argname):
    """The values ``test`` is parametrized with for ``argname``, as its own marks list them."""
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == argname:
            return list(mark.args[1]), mark.kwargs.get("ids")
    raise LookupError(f"{test.__name__} is not parametrized over {argname}")


EXTREME_LENS, EXTREME_LENS_IDS = _parameters(edges.test_extreme_lengths_mean_what_they_say, "lens")


@pytest.mark.parametrize("name", sorted(edges.NONFINITE))
def test_xla_kernel_nonfinite_inputs_propagate_as_in_reference(kernel_calls, xla_runner, name):
    edges.test_nonfinite_inputs_propagate_as_in_reference(xla_runner, name)
    assert len(kernel_calls) == 2  # causal False and True: the default calls are fused


@pytest.mark.parametrize("lens", EXTREME_LENS, ids=EXTREME_LENS_IDS)
def test_xla_kernel_extreme_lengths_mean_what_they_say(kernel_calls, xla_runner, lens):
    edges.test_extreme_lengths_mean_what_they_say(xla_runner, lens)
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
