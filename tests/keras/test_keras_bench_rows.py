"""The benchmark's Llama-shaped generation on the active Keras backend, on tiny shapes.

Ours and the hand-written Keras loop, eager and compiled (the loop with
static shapes where it compiles, and eagerly on JAX), are held to the
float64 spec (:mod:`generation_support`).
"""

from __future__ import annotations

import functools

import pytest

keras = pytest.importorskip("keras")

from generation_support import TINY, assert_spec_generation, generated  # noqa: E402

from mha_multi.bench.keras import FRAMEWORK  # noqa: E402


@pytest.mark.parametrize("execution", ["eager", "compiled"])
def test_ours_and_the_hand_written_loop_generate_the_spec_numbers(execution, monkeypatch):
    if execution == "compiled" and keras.backend.backend() == "torch":
        import torch

        # Traced whole and functionalized as under inductor, without its code generation.
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    for name, (prompt, outputs) in generated(FRAMEWORK, TINY, execution).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(TINY, prompt, outputs)
