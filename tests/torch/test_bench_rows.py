"""The benchmark's Llama-shaped, compiled, host and Python-calls rows on PyTorch, on tiny shapes.

Every way of generating is held to the float64 spec: a generation's outputs
are, position by position, the causal self-attention of the sequence it was
fed (the prompt, then each output in turn).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from mha_multi.bench import host
from mha_multi.bench.generate import GenerationShape
from mha_multi.bench.host import count_calls, time_host
from mha_multi.bench.torch import FRAMEWORK
from mha_multi.spec.reference import reference_forward
from mha_multi.weights import init_weights

#: A Llama-shaped layer in miniature: rotary positions, 4 query and 2 key/value heads.
TINY = replace(host.TINY, batch=2, prompt=5, new_tokens=4, num_heads=4, num_kv_heads=2)
FLOAT32 = 5e-6  # the spec's float32 forward tolerance (docs: "Parity")


def assert_spec_generation(shape: GenerationShape, prompt: np.ndarray, outputs: np.ndarray) -> None:
    """``outputs`` ``(B, new_tokens, D)``, the steps' outputs after feeding ``prompt``
    and then the prefill's last output and each step's, against the spec."""
    weights = init_weights(
        shape.num_hiddens, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads
    )
    fed = np.concatenate([prompt, outputs[:, :-1]], axis=1)
    expected, _ = reference_forward(
        weights, fed, fed, fed, num_heads=shape.num_heads, causal=True, **shape.layer_options
    )
    # The prefill's last output (position prompt - 1), then each step's.
    np.testing.assert_allclose(outputs, expected[:, shape.prompt - 1 :], atol=FLOAT32, rtol=0)


def generated(shape: GenerationShape, execution: str | None) -> dict[str, tuple]:
    """Way -> ``(prompt, outputs)``: the prefill's last output, then the steps'."""
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((shape.batch, shape.prompt, shape.num_hiddens)).astype(np.float32)
    makers = FRAMEWORK.generators(shape, "cpu", "float32", execution)
    results = {}
    for name in ("cached", "hand-written"):
        generator = makers[name]()
        state, token = generator.prefill(FRAMEWORK.array(prompt, "cpu", "float32"))
        tokens = [token]
        for _ in range(shape.new_tokens - 1):
            state, token = generator.step(state, token)
            tokens.append(token)
        outputs = np.concatenate([FRAMEWORK.backend.to_numpy(t) for t in tokens], axis=1)
        results[name] = (prompt, outputs)
    return results


@pytest.mark.parametrize("rotary", [None, {"theta": 10000.0}], ids=["plain", "rotary"])
def test_ours_and_the_hand_written_decoder_generate_the_spec_numbers(rotary):
    shape = replace(TINY, rotary=rotary)
    for name, (prompt, outputs) in generated(shape, None).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(shape, prompt, outputs)


def test_compiled_ways_generate_the_spec_numbers_in_one_graph_each(monkeypatch):
    # Traced whole (fullgraph) and functionalized as under inductor, without
    # inductor's minutes of code generation: AOT autograd's eager backend.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    for prompt, outputs in generated(TINY, "compiled").values():
        assert_spec_generation(TINY, prompt, outputs)


def test_the_host_and_calls_rows_are_measured_on_both_routes():
    rows = {
        (m.mode, m.implementation, m.shape["route"], bool(m.shape["rotary"])): m
        for m in time_host(FRAMEWORK, "cpu", blocks=2) + count_calls(FRAMEWORK, "cpu")
    }
    for route in ("cpu", "gpu"):
        for what in ("one token", "decoding step"):
            for name in ("ours", "hand-written"):
                assert rows[(f"host: {what}", name, route, True)].seconds > 0
        # Ours and the hand-written steps, each fed its own outputs, agree.
        note = rows[("host: decoding step", "ours", route, True)].note
        assert float(note.rsplit(" ", 1)[-1]) < FLOAT32
    for rotary in (False, True):
        for name in ("ours", "hand-written"):
            assert rows[("python calls: decoding step", name, "cpu", rotary)].calls > 10
        assert rows[("python calls: one token, training", "ours", "cpu", rotary)].calls > 10


def test_the_packed_row_times_both_layouts():
    from mha_multi.bench.common import Shape
    from mha_multi.bench.packed import time_packed

    shape = Shape(length=32, num_hiddens=16, num_heads=2)
    rows = time_packed(FRAMEWORK, "cpu", "float32", count=6, base=shape)
    assert [m.implementation for m in rows] == ["ours, padded", "ours, packed"]
    assert all(m.tokens_per_s > 0 for m in rows)
    assert rows[1].shape["batch"] < rows[0].shape["batch"] == 6
