"""The benchmark's Llama-shaped generation on the active Keras backend, on tiny shapes.

Ours and the hand-written Keras loop, eager and compiled (the loop with
static shapes where it compiles, and eagerly on JAX), are held to the
float64 spec (:mod:`generation_support`).
"""

from __future__ import annotations

import functools

import pytest

keras = pytest.importorskip("keras")

from generation_support import assert_spec_generation, generated  # noqa: E402

from mha_multi.bench.generate import GenerationShape  # noqa: E402
from mha_multi.bench.keras import FRAMEWORK  # noqa: E402

#: A Llama-shaped layer in miniature: rotary positions, 4 query and 2 key/value heads.
TINY = GenerationShape(
    batch=2,
    prompt=5,
    new_tokens=4,
    num_hiddens=16,
    num_heads=4,
    num_kv_heads=2,
    rotary={"theta": 10000.0},
)


@pytest.mark.parametrize("execution", ["eager", "compiled"])
def test_ours_and_the_hand_written_loop_generate_the_spec_numbers(execution, monkeypatch):
    if execution == "compiled" and keras.backend.backend() == "torch":
        import torch

        # Traced whole and functionalized as under inductor, without its code generation.
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    for name, (prompt, outputs) in generated(FRAMEWORK, TINY, execution).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(TINY, prompt, outputs)
