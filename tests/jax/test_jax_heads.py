"""The NNX and Linen layers' heads: ``head_mask``, ``head_importance`` and pruned layers.

Every result is checked against the float64 reference of :mod:`mha_multi.spec`
(the gates' gradient included), never against the layers themselves; the
generic parity checks of the head-mask cases run through the runners.
"""

from __future__ import annotations

import heads_cases as hc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax_support import LinenRunner, NNXRunner, inputs

from mha_multi import spec
from mha_multi.jax import MultiHeadAttention, head_importance, linen, set_weights
from mha_multi.jax._kernel import DOT_PRODUCT_ATTENTION
from mha_multi.parity.cases import HEAD_MASK_CASES, build_case
from mha_multi.parity.harness import jax as backend
from mha_multi.weights import init_weights

FLOAT32_ATOL, FLOAT32_GRAD_ATOL, SIXTEEN_BIT_ATOL = 5e-6, 5e-5, 2e-2
NAMES = [config.name for config in HEAD_MASK_CASES]


@pytest.fixture(scope="module")
def cases():
    return {config.name: build_case(config) for config in HEAD_MASK_CASES}


def gates_of(case):
    return jnp.asarray(np.asarray(case.config.head_mask, np.float32))


def make(seed, *, num_heads=4, num_kv_heads=2, head_dim=None, dtype=jnp.float32, **options):
    """An NNX layer of random weights, the float64 weights, inputs and a generator."""
    layout = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    weights = init_weights(num_hiddens=16, **layout, bias=True, seed=seed, **hc.SIZES)
    layer = MultiHeadAttention(16, **layout, bias=True, param_dtype=dtype, **hc.SIZES, **options)
    set_weights(layer, weights).eval()
    rng = np.random.default_rng(seed)
    arrays = hc.random_inputs(rng)
    return {k: v.astype(np.float64) for k, v in weights.items()}, layer, arrays, rng


def as_linen(layer, weights):
    """The Linen module of the NNX ``layer``'s configuration, with ``weights``."""
    module = linen.MultiHeadAttention(
        layer.num_hiddens,
        layer.num_heads,
        bias=layer.bias,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        **layer.input_sizes(),
    )
    return module, linen.variables_from_weights(weights, module, dtype=jnp.float32)


# -- head_mask on every path -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fused", [True, False], ids=["nnx-xla", "linen-generic"])
def test_head_mask_on_the_fused_and_generic_paths_is_the_references(cases, name, fused):
    """XLA's kernel runs once as the plan says (the gates act after it); the weights' call
    and the default Linen layer take the generic path; the weights are the ungated ones."""
    case = cases[name]
    config, lens = case.config, case.valid_lens
    plan = spec.plan_kernel(
        DOT_PRODUCT_ATTENTION,
        sizes=(config.batch, config.num_queries, config.num_keys),
        lens_ndim=None if lens is None else lens.ndim,
        lens_integer=True,
        causal=config.causal,
        grouped=config.num_kv_heads is not None,
    )
    runner = NNXRunner(implementation="xla") if fused else LinenRunner()
    layer = runner.layer_for(case)
    arrays = (*inputs(case), runner.native_lens(lens))
    options = runner.case_options(case)
    with backend.kernel_spy() as calls:
        output = backend.forward(layer, *arrays, **options)
    expected = [(plan.needs_mask, plan.is_causal)] if fused else []
    assert [(call.mask, call.is_causal) for call in calls] == expected
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=FLOAT32_ATOL)
    with backend.kernel_spy() as calls:
        output, weights = backend.forward(layer, *arrays, return_attention_weights=True, **options)
    assert calls == []
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=FLOAT32_ATOL)
    np.testing.assert_allclose(
        weights, case.reference["attention_weights"], rtol=0, atol=FLOAT32_ATOL
    )


@pytest.mark.parametrize("name", NAMES)
def test_gradients_with_a_head_mask_are_the_references_nnx_fused_and_linen(cases, name):
    """Every gradient, the gates' included, through the facts module's vjp."""
    case = cases[name]
    for runner in (NNXRunner(implementation="xla"), LinenRunner()):
        grads = backend.vjp(
            runner.layer_for(case),
            *inputs(case),
            case.valid_lens,
            causal=case.config.causal,
            output_gradient=jnp.asarray(case.output_gradient, jnp.float32),
            head_mask=gates_of(case),
        )
        assert set(grads) == {key[len("grad.") :] for key in case.reference if "grad." in key}
        assert grads["head_mask"].shape == gates_of(case).shape
        for key, value in grads.items():
            expected = case.reference[f"grad.{key}"]
            np.testing.assert_allclose(
                value, expected, rtol=0, atol=FLOAT32_GRAD_ATOL, err_msg=f"{runner.name}: {key}"
            )


def test_compiled_calls_with_a_head_mask_are_the_references():
    """nnx.jit: a gated forward with the gates' gradient, and a ragged prefill and a step with
    (B, H) and (H,) gates on a cache; jax.jit of Linen's apply: the same prefill."""
    weights, layer, (queries, keys, values), rng = make(1)
    lens = np.array([6, 1, 4])
    gates = rng.uniform(-1, 2, (3, 4)).astype(np.float32)
    output_gradient = rng.standard_normal((3, 5, 16))

    @nnx.jit
    def gated(layer, gates, *arrays):
        def loss(gates):
            output = layer(*arrays, head_mask=gates)
            return jnp.sum(output * output_gradient), output

        return jax.grad(loss, has_aux=True)(gates)

    grad, output = gated(layer, jnp.asarray(gates), queries, keys, values, jnp.asarray(lens))
    reference = {"num_heads": 4, "head_mask": gates}
    expected, _ = spec.reference_forward(weights, queries, keys, values, lens, **reference)
    np.testing.assert_allclose(output, expected, rtol=0, atol=FLOAT32_ATOL)
    expected = spec.reference_gradients(
        weights, queries, keys, values, lens, output_gradient=output_gradient, **reference
    )["head_mask"]
    np.testing.assert_allclose(grad, expected, rtol=0, atol=FLOAT32_GRAD_ATOL)

    step = nnx.jit(lambda layer, *args, **kw: layer(*args, causal=True, **kw))
    module, variables = as_linen(layer, weights)
    linen_step = jax.jit(lambda v, *args, **kw: module.apply(v, *args, causal=True, **kw))
    cache = linen_cache = layer.init_cache(3, 8)
    reference_cache = spec.KVCache(*(np.asarray(x) for x in cache))
    schedule = [
        (slice(0, 4), np.array([4, 2, 1]), gates),
        (slice(4, 5), np.array([1, 1, 0]), np.array([0.0, 1.0, 0.5, -1.0], np.float32)),
    ]
    for rows, new_lens, step_gates in schedule:
        chunk = [x[:, rows] for x in (queries, keys, values)]
        expected, _, reference_cache = spec.reference_cached_forward(
            weights, *chunk, reference_cache, new_lens, num_heads=4, causal=True,
            head_mask=step_gates,
        )  # fmt: skip
        arguments = (*chunk, jnp.asarray(new_lens))
        output, cache = step(layer, *arguments, cache=cache, head_mask=jnp.asarray(step_gates))
        np.testing.assert_allclose(output, expected, rtol=0, atol=FLOAT32_ATOL)
        assert np.asarray(cache.lengths).tolist() == reference_cache.lengths.tolist()
        output, linen_cache = linen_step(
            variables, *arguments, cache=linen_cache, head_mask=jnp.asarray(step_gates)
        )
        np.testing.assert_allclose(output, expected, rtol=0, atol=FLOAT32_ATOL)


def test_gradients_of_a_cached_call_with_a_head_mask_are_the_full_forwards():
    """From an empty cache, a cached call is one causal forward of ``valid_lens`` lengths."""
    weights, layer, arrays, rng = make(2)
    arrays = [x[:, :5] for x in arrays]
    lens = np.array([5, 2, 3])
    gates = rng.uniform(-1, 2, (3, 4)).astype(np.float32)
    output_gradient = rng.standard_normal((3, 5, 16))
    grads = backend.vjp(
        layer,
        *(jnp.asarray(x) for x in arrays),
        jnp.asarray(lens),
        causal=True,
        output_gradient=jnp.asarray(output_gradient, jnp.float32),
        cache=layer.init_cache(3, 7),
        head_mask=jnp.asarray(gates),
    )
    expected = spec.reference_gradients(
        weights, *arrays, lens, num_heads=4, causal=True, output_gradient=output_gradient,
        head_mask=gates,
    )  # fmt: skip
    for key in ("head_mask", "queries", "values", "W_k", "W_o", "b_v"):
        np.testing.assert_allclose(
            grads[key], expected[key], rtol=0, atol=FLOAT32_GRAD_ATOL, err_msg=key
        )


@pytest.mark.parametrize("mask_dtype", [jnp.float32, None])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_layers_take_gates_of_any_floating_dtype(dtype, mask_dtype):
    """The gates are cast to the computation dtype; their gradient comes back in their own."""
    weights, layer, arrays, rng = make(4, dtype=dtype)
    mask_dtype = mask_dtype or dtype
    mask = jnp.asarray(rng.uniform(0, 1.5, 4), mask_dtype)
    lens = np.array([2, 6, 5])
    output_gradient = rng.standard_normal((3, 5, 16)) / np.sqrt(15)
    arrays = [jnp.asarray(x, dtype) for x in arrays]

    def loss(mask):
        output = layer(*arrays, jnp.asarray(lens), head_mask=mask)
        return jnp.sum(output * jnp.asarray(output_gradient, dtype)).astype(jnp.float32), output

    grad, output = jax.grad(loss, has_aux=True)(mask)
    assert output.dtype == dtype and grad.dtype == mask_dtype
    # The reference from the inputs, weights and gates as the layer holds them.
    held = {name: np.asarray(jnp.asarray(w, dtype), np.float64) for name, w in weights.items()}
    arrays = [np.asarray(x, np.float64) for x in arrays]
    rounded = np.asarray(mask.astype(dtype), np.float64)
    expected, _ = spec.reference_forward(held, *arrays, lens, num_heads=4, head_mask=rounded)
    np.testing.assert_allclose(np.asarray(output, np.float64), expected, atol=SIXTEEN_BIT_ATOL)
    expected = spec.reference_gradients(
        held, *arrays, lens, num_heads=4, output_gradient=output_gradient, head_mask=rounded
    )["head_mask"]
    np.testing.assert_allclose(np.asarray(grad, np.float64), expected, atol=SIXTEEN_BIT_ATOL)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (np.ones(3, np.float32), ValueError, r"\(num_heads,\) = \(4,\) or .* = \(3, 4\)"),
        (jnp.ones((2, 4)), ValueError, r"head_mask must have shape .* got \(2, 4\)"),
        (jnp.ones((3, 4, 1)), ValueError, "head_mask must have shape"),
        (jnp.ones(4, jnp.int32), TypeError, "head_mask must be a floating-point"),
        (np.ones(4, bool), TypeError, "head_mask must be a floating-point"),
        ([1.0, 1.0, 0.0, 1.0], TypeError, "head_mask must be a floating-point array .* got list"),
    ],
)
def test_bad_head_masks_are_the_specs_errors(mask, error, match):
    weights, layer, arrays, _ = make(5)
    arrays = [jnp.asarray(x[:, :2]) for x in arrays]
    module, variables = as_linen(layer, weights)
    calls = [
        lambda: layer(*arrays, head_mask=mask),
        lambda: layer(*arrays, head_mask=mask, cache=layer.init_cache(3, 4)),
        lambda: jax.jit(lambda v, *x: module.apply(v, *x, head_mask=mask))(variables, *arrays),
    ]
    for call in calls:
        with pytest.raises(error, match=match):
            call()


# -- head_importance -----------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False])
def test_head_importance_is_the_references_for_nnx_and_linen(normalize):
    """In evaluation mode whatever the NNX layer's, which is left as it is; Linen as the pair
    ``(module, variables)`` and bound to its variables."""
    weights, layer, _, rng = make(7, num_heads=6, num_kv_heads=3, head_dim=3, dropout=0.5)
    layer.train()
    batches = hc.importance_batches(rng)
    expected = hc.reference_importance(weights, batches, num_heads=6, normalize=normalize)
    # loss_fn is traced (once for each batch shape): it finds G by the output's shape.
    loss_weights = {g.shape: jnp.asarray(g) for _, _, g in batches}

    def loss_fn(output):
        return jnp.sum(output * loss_weights[output.shape])

    module, variables = as_linen(layer, weights)
    for target in (layer, (module, variables), module.bind(variables)):
        found = head_importance(
            target,
            ((*(jnp.asarray(x) for x in arrays), lens) for arrays, lens, _ in batches),
            loss_fn,
            normalize=normalize,
        )
        assert found.shape == (6,) and found.dtype == np.float64
        np.testing.assert_allclose(found, expected, rtol=0, atol=FLOAT32_GRAD_ATOL)
        if normalize:
            assert np.linalg.norm(found) == pytest.approx(1.0)
    assert not layer.deterministic  # still training


def test_head_importance_refuses_a_linen_module_without_variables():
    # (Losses and batches it refuses in every backend alike: tests/backends/test_importance.py.)
    _, _, arrays, _ = make(8)
    batch = (*(jnp.asarray(x) for x in arrays), None)
    with pytest.raises(TypeError, match=r"\(module, variables\)"):
        head_importance(linen.MultiHeadAttention(16, 4), [batch], lambda output: output.sum())


# -- pruned layers -------------------------------------------------------------------------


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "removed"), hc.PRUNING_CASES)
def test_a_pruned_layer_is_the_full_one_with_those_heads_masked(num_heads, num_kv_heads, removed):
    """NNX and Linen layers built from ``config.kwargs()``, against the full layer and the
    float64 reference with those heads' gates at 0."""
    head_dim = 3 if num_heads == 6 else None
    weights, layer, arrays, _ = make(
        9, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    gates, pruned, config = hc.prune_with_gates(
        weights, removed, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    small = set_weights(MultiHeadAttention(**config.kwargs()), pruned)
    small.eval()
    assert (small.num_heads, small.num_kv_heads) == (config.num_heads, config.num_kv_heads)
    module = linen.MultiHeadAttention(**config.kwargs())
    variables = linen.variables_from_weights(pruned, module, dtype=jnp.float32)
    lens = np.array([2, 6, 0])
    arguments = (*(jnp.asarray(x) for x in arrays), jnp.asarray(lens))
    masked = layer(*arguments, causal=True, head_mask=jnp.asarray(gates))
    expected, _ = spec.reference_forward(
        weights, *arrays, lens, num_heads=num_heads, causal=True, head_mask=gates
    )
    for output in (
        small(*arguments, causal=True),
        module.apply(variables, *arguments, causal=True),
    ):
        np.testing.assert_allclose(output, masked, rtol=0, atol=FLOAT32_ATOL)
        np.testing.assert_allclose(output, expected, rtol=0, atol=FLOAT32_ATOL)
