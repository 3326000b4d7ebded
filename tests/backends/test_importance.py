"""Every backend's ``head_importance`` equals the float64 reference importance
(docs: "Heads"), so the same batches and loss rank the heads alike in every
framework."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.parity.compare import tolerance
from mha_multi.parity.importance import (
    IMPORTANCE_CASES,
    importance_batches,
    reference_importance,
    runner_importance,
)
from mha_multi.weights import init_weights


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case_name", IMPORTANCE_CASES)
def test_head_importance_is_the_reference_importance(runner, cases, case_name, normalize):
    case = cases[case_name]
    expected = reference_importance(case, normalize=normalize)
    got = runner_importance(runner, case, normalize=normalize)
    assert got.shape == (case.config.num_heads,)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance("float32", "grad.head_mask"))
    # The ranking the pruning follows, where the reference separates the heads.
    assert np.argmax(got) == np.argmax(expected)
    if normalize:
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)


def _layer_and_batch(runner, cases):
    """The head-mask case's layer, its first batch as the backend takes it, and a
    native array of the output's shape (``fill``, for losses made of it)."""
    case = cases["head_mask"]
    batch = importance_batches(case)[0]
    native = (*(runner.to_native(x) for x in batch[:3]), runner.native_lens(batch[3]))

    def like_output(fill: float):
        return runner.to_native(np.full(case.output_gradient.shape, fill, np.float32))

    return runner.layer_for(case), native, like_output


def test_head_importance_of_a_loss_the_heads_do_not_change_is_zero(runner, cases):
    """A loss whose gradient is zero, and one that does not depend on the output at all
    (a tensor made apart from it, a number), give zeros in every backend: no NaN."""
    layer, batch, like_output = _layer_and_batch(runner, cases)
    zeros = like_output(0.0)
    constant = runner.to_native(np.array(2.0, np.float32))
    losses = {
        "zero gradient": lambda output: runner.inner_product(output, zeros),
        "a tensor apart from the output": lambda output: constant,
        "a Python number": lambda output: 2.0,
        "a numpy number": lambda output: np.float32(2.0),
    }
    for name, loss_fn in losses.items():
        importance = runner.head_importance(layer, [batch], loss_fn)
        np.testing.assert_array_equal(
            importance, np.zeros(cases["head_mask"].config.num_heads), err_msg=name
        )


def test_head_importance_names_a_loss_that_is_no_scalar(runner, cases):
    layer, batch, _ = _layer_and_batch(runner, cases)
    shape = re.escape(str(cases["head_mask"].output_gradient.shape))
    with pytest.raises(ValueError, match=f"loss_fn must return a scalar.*got shape {shape}"):
        runner.head_importance(layer, [batch], lambda output: output)
    for returned in ("2.0", None, [2.0], True):
        with pytest.raises(TypeError, match="loss_fn must return a scalar"):
            runner.head_importance(layer, [batch], lambda output, returned=returned: returned)


def test_head_importance_names_a_batch_that_is_not_four_arrays(runner, cases):
    layer, batch, like_output = _layer_and_batch(runner, cases)
    ones = like_output(1.0)

    def loss_fn(output):
        return runner.inner_product(output, ones)

    expected = re.escape("each batch must be (queries, keys, values, valid_lens)")
    with pytest.raises(ValueError, match=expected + ".*batch 0 has 3 items"):
        runner.head_importance(layer, [batch[:3]], loss_fn)
    with pytest.raises(TypeError, match=expected):
        runner.head_importance(layer, [batch[0]], loss_fn)
    with pytest.raises(ValueError, match="batches yielded no batch"):
        runner.head_importance(layer, [], loss_fn)


def test_a_float16_layers_importance_is_its_float32_sum(runner):
    """A float16 layer's gates are float32, and so is the sum that is their gradient:
    heads that matter more than float16 holds (gradients of 86430 and 105600 here,
    above its largest 65504, from an output gradient of 500 an entry) get finite
    importances, the reference's within float16's rounding (they were inf in PyTorch,
    JAX and MXNet, which summed in float16)."""
    if not runner.dtype_supported("cpu", "float16"):
        pytest.skip(f"{runner.name} does not run float16 on cpu")
    sizes = {"query_size": 5, "key_size": 6, "value_size": 7}
    weights = init_weights(16, num_heads=4, bias=True, seed=0, **sizes)
    rng = np.random.default_rng(0)
    queries, keys, values = (rng.standard_normal((32, 16, size)) for size in sizes.values())
    output, _ = spec.reference_forward(weights, queries, keys, values, None, num_heads=4)
    output_gradient = 500.0 * np.sign(output)
    expected = spec.reference_gradients(
        weights,
        queries,
        keys,
        values,
        None,
        num_heads=4,
        output_gradient=output_gradient,
        head_mask=np.ones(4),
    )["head_mask"]
    assert np.abs(expected).max() > 65504  # (beyond float16)
    layer = runner.make_layer(16, 4, bias=True, dtype="float16", **sizes)
    layer = runner.set_weights(layer, {k: v.astype(np.float16) for k, v in weights.items()})
    batch = tuple(runner.to_native(x, "cpu", "float16") for x in (queries, keys, values))
    gradient = runner.to_native(output_gradient, "cpu", "float16")
    got = runner.head_importance(
        layer, [(*batch, None)], lambda out: runner.inner_product(out, gradient), normalize=False
    )
    np.testing.assert_allclose(got, np.abs(expected), rtol=2e-3, atol=0)
