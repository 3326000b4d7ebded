"""The benchmark's generation rows on JAX, on tiny shapes: ours compiled as Flax's guide
writes a fast loop (the ``jax`` rows: ``staged``, the layer split once and ``jax.jit`` of
a function that merges it) and called as it is (``jax (eager)``, its call plan), each
way held to the float64 spec (:mod:`generation_support`)."""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest
from generation_support import TINY, assert_spec_generation, generated

from mha_multi.bench.jax import FRAMEWORK
from mha_multi.jax import MultiHeadAttention


@pytest.mark.parametrize("execution", [None, "eager"], ids=["staged", "eager"])
@pytest.mark.parametrize("rotary", [None, {"theta": 10000.0}], ids=["plain", "rotary"])
def test_ours_and_the_hand_written_decoder_generate_the_spec_numbers(execution, rotary):
    shape = replace(TINY, rotary=rotary)
    for name, (prompt, outputs) in generated(FRAMEWORK, shape, execution).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(shape, prompt, outputs)


def test_the_staged_rows_recomputing_and_flax_s_decoder_generate_the_spec_numbers():
    """The first execution's other ways, staged too: ours recomputing over a buffer, and
    Flax's own decoder (``decode=True``, of a plain layer), whose cache the staged
    program returns at every step."""
    shape = replace(TINY, num_kv_heads=None, rotary=None)
    ways = generated(FRAMEWORK, shape, None, ("recompute", "native"))
    for name, (prompt, outputs) in ways.items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(shape, prompt, outputs)


def test_the_eager_rows_call_ours_as_it_is(monkeypatch):
    """The eager rows call the layer on concrete arrays (its call plan's way); the first
    execution's calls it inside ``jax.jit``'s trace, and its calls after their trace run
    the program alone."""
    traced = []
    call = MultiHeadAttention.__call__

    def watched(self, queries, *args, **kwargs):
        traced.append(isinstance(queries, jax.core.Tracer))
        return call(self, queries, *args, **kwargs)

    monkeypatch.setattr(MultiHeadAttention, "__call__", watched)
    generated(FRAMEWORK, TINY, "eager")
    assert traced and not any(traced)
    traced.clear()
    generated(FRAMEWORK, replace(TINY, prompt=6), None)  # (a new shape: traced anew)
    # The prefill's trace and the first step's; the steps after run the program.
    assert traced == [True, True]
