"""The benchmark's Llama-shaped, compiled, host and Python-calls rows on PyTorch, on tiny shapes.

Every way of generating is held to the float64 spec (:mod:`generation_support`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from generation_support import FLOAT32, TINY, assert_spec_generation, generated

from mha_multi.bench.host import count_calls, time_host
from mha_multi.bench.torch import FRAMEWORK


@pytest.mark.parametrize("rotary", [None, {"theta": 10000.0}], ids=["plain", "rotary"])
def test_ours_and_the_hand_written_decoder_generate_the_spec_numbers(rotary):
    shape = replace(TINY, rotary=rotary)
    for name, (prompt, outputs) in generated(FRAMEWORK, shape, None).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(shape, prompt, outputs)


def test_compiled_ways_generate_the_spec_numbers_in_one_graph_each(monkeypatch):
    # Traced whole (fullgraph) and functionalized as under inductor, without
    # inductor's minutes of code generation: AOT autograd's eager backend.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    for prompt, outputs in generated(FRAMEWORK, TINY, "compiled").values():
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
