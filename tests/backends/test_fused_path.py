"""Every backend's default call takes its fused kernel the way the one kernel plan says.

For each parity case, the default call (no weights returned, eval mode)
must call the backend's fused kernel once, give it what
:func:`mha_multi.spec.plan_kernel` decides for the case (a mask or none, the
kernel's causal flag, key lengths), and return the float64 reference's
output; the call that returns the weights takes the generic path and calls
no kernel. The plan's rules themselves are checked against hand-worked
tables in ``tests/core/test_spec.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.parity.cases import CASES, OPTION_CASES

OPTION_NAMES = {config.name for config in OPTION_CASES}

FLOAT32_ATOL = 5e-6


def planned(runner, case) -> spec.KernelPlan:
    """The plan for ``case`` from the facts a backend has before its kernel runs."""
    config, lens = case.config, case.valid_lens
    shortest = None
    if runner.reads_shortest_length and lens is not None:
        shortest = float(np.min(lens))
    options = spec.LayerOptions.of(config.layer_options())
    # Rotary embeddings change q and k, not what the kernel is given.
    scored = case.bias is not None or options.alibi or options.window or options.softcap
    scored = scored or options.sinks
    if scored and not runner.passes_options:
        return spec.KernelPlan(fused=False, reason="the kernel's call passes no options")
    return spec.plan_kernel(
        runner.fused_kernel,
        sizes=(config.batch, config.num_queries, config.num_keys),
        lens_ndim=None if lens is None else lens.ndim,
        lens_integer=lens is None or lens.dtype.kind in "iu",
        causal=config.causal,
        values_exact=True,  # the cases' values are finite and small
        shortest_length=shortest,
        grouped=config.num_kv_heads not in (None, config.num_heads),
        bias=case.bias is not None or options.alibi,
        softcap=options.softcap is not None,
        window=options.window is not None,
        sinks=options.sinks,
    )


@pytest.fixture
def fused_runner(runner):
    if runner.fused_kernel is None:
        pytest.skip(f"{runner.name}: the default call takes the generic path on a CPU")
    return runner


@pytest.mark.parametrize("name", [config.name for config in CASES])
def test_default_call_follows_the_kernel_plan(fused_runner, cases, name):
    runner, case = fused_runner, cases[name]
    plan = planned(runner, case)
    # Every case but those with an option a kernel does not take (docs:
    # "Positions and biases", kernels) plans the fused kernel.
    assert plan.fused or name in OPTION_NAMES, plan.reason
    inputs = [case.inputs[key] for key in ("queries", "keys", "values")]
    layer = runner.layer_for(case)
    with runner.kernel_spy() as calls:
        output = runner.call(layer, *inputs, case.valid_lens, **runner.case_options(case))
    assert len(calls) == plan.fused
    if plan.fused:
        (call,) = calls
        # A bias reaches the kernel in its mask argument.
        assert call.mask == (plan.needs_mask or plan.bias)
        assert call.is_causal == plan.is_causal
        assert (call.key_lengths is not None) == plan.key_lengths
        assert call.dropout == 0.0
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=FLOAT32_ATOL)

    with runner.kernel_spy() as calls:
        output, weights = runner.call(
            layer,
            *inputs,
            case.valid_lens,
            return_attention_weights=True,
            **runner.case_options(case),
        )
    assert calls == []
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=FLOAT32_ATOL)
    np.testing.assert_allclose(
        weights, case.reference["attention_weights"], rtol=0, atol=FLOAT32_ATOL
    )


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_values_a_kernel_would_get_wrong_take_the_generic_path(fused_runner, cases, value):
    runner, case = fused_runner, cases["lens_1d"]
    if runner.fused_kernel.replaces_hidden_scores:
        pytest.skip(f"{runner.name}: its kernel replaces hidden scores, as the spec does")
    queries = case.inputs["queries"].copy()
    keys = case.inputs["keys"].copy()
    keys[0, -1, 0] = value  # a key that lengths [4, 7, 1] hide from example 0
    expected, _ = spec.reference_forward(
        case.weights,
        queries,
        keys,
        case.inputs["values"],
        case.valid_lens,
        num_heads=case.config.num_heads,
    )
    with runner.kernel_spy() as calls:
        output = runner.call(
            runner.layer_for(case), queries, keys, case.inputs["values"], case.valid_lens
        )
    assert calls == []
    np.testing.assert_array_equal(np.isnan(output), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_allclose(output[finite], expected[finite], rtol=0, atol=FLOAT32_ATOL)
