"""The benchmark's generation rows on JAX, on tiny shapes: ours under ``nnx.jit`` (the
``jax`` rows) and called as it is (``jax (eager)``, its call plan), each way held to
the float64 spec (:mod:`generation_support`)."""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest
from generation_support import TINY, assert_spec_generation, generated

from mha_multi.bench.jax import FRAMEWORK
from mha_multi.jax import MultiHeadAttention


@pytest.mark.parametrize("execution", [None, "eager"], ids=["nnx.jit", "eager"])
@pytest.mark.parametrize("rotary", [None, {"theta": 10000.0}], ids=["plain", "rotary"])
def test_ours_and_the_hand_written_decoder_generate_the_spec_numbers(execution, rotary):
    shape = replace(TINY, rotary=rotary)
    for name, (prompt, outputs) in generated(FRAMEWORK, shape, execution).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(shape, prompt, outputs)


def test_the_eager_rows_call_ours_as_it_is(monkeypatch):
    """The eager rows call the layer on concrete arrays (its call plan's way); the first
    execution's calls it inside ``nnx.jit``'s trace."""
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
    assert traced and all(traced)
