"""The benchmark's Llama-shaped generation on MXNet, on tiny shapes.

Ours and the hand-written MXNet loop (grouped heads scored as their key/value
head's queries), hybridized and imperative, are held to the float64 spec
(:mod:`generation_support`).
"""

from __future__ import annotations

import pytest
from generation_support import TINY, assert_spec_generation, generated

from mha_multi.bench.mxnet import FRAMEWORK


@pytest.mark.parametrize("execution", [None, "imperative"], ids=["hybridized", "imperative"])
def test_ours_and_the_hand_written_loop_generate_the_spec_numbers(execution):
    assert TINY.num_heads != TINY.num_kv_heads and TINY.rotary  # grouped heads, rotated
    for name, (prompt, outputs) in generated(FRAMEWORK, TINY, execution).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(TINY, prompt, outputs)
