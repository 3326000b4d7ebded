"""The benchmark's Llama-shaped, compiled, host, calls and long rows on PyTorch, on tiny shapes.

Every way of generating is held to the float64 spec (:mod:`generation_support`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from generation_support import FLOAT32, TINY, assert_spec_generation, generated
from torch_support import TRACED

from mha_multi.bench.host import count_calls, time_host
from mha_multi.bench.torch import FRAMEWORK
from mha_multi.spec.reference import reference_forward
from mha_multi.weights import init_weights


@pytest.mark.parametrize("rotary", [None, {"theta": 10000.0}], ids=["plain", "rotary"])
def test_ours_and_the_hand_written_decoder_generate_the_spec_numbers(rotary):
    shape = replace(TINY, rotary=rotary)
    for name, (prompt, outputs) in generated(FRAMEWORK, shape, None).items():
        assert outputs.shape == (2, 4, 16), name
        assert_spec_generation(shape, prompt, outputs)


def test_compiled_ways_generate_the_spec_numbers_in_one_graph_each(monkeypatch):
    # Traced whole (fullgraph) and functionalized as under inductor (TRACED).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=TRACED))
    for prompt, outputs in generated(FRAMEWORK, TINY, "compiled").values():
        assert_spec_generation(TINY, prompt, outputs)


def test_the_host_and_calls_rows_are_measured_on_both_routes():
    rows = {
        (m.mode, m.implementation, m.shape["route"], bool(m.shape["rotary"])): m
        for m in time_host(FRAMEWORK, "cpu", blocks=2) + count_calls(FRAMEWORK, "cpu")
    }
    # The host rows: the tiny rotary layer (2/1 heads) and the tiny plain one (2/2).
    heads = {True: 1, False: None}
    for route in ("cpu", "gpu"):
        for rotary in (True, False):
            for what in ("one token", "decoding step"):
                for name in ("ours", "hand-written"):
                    row = rows[(f"host: {what}", name, route, rotary)]
                    assert row.seconds > 0 and row.shape["num_kv_heads"] == heads[rotary]
            # Ours and the hand-written steps, each fed its own outputs, agree.
            note = rows[("host: decoding step", "ours", route, rotary)].note
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


def test_the_long_pass_holds_ours_and_sdpas_layer_to_the_spec_and_times_both():
    from mha_multi.bench.common import Shape
    from mha_multi.bench.long import MODE, time_long

    shape = Shape(batch=2, length=12, num_hiddens=16, num_heads=4, num_kv_heads=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 12, 16)).astype(np.float32)
    weights = init_weights(16, num_heads=4, num_kv_heads=2)
    expected, _ = reference_forward(weights, x, x, x, num_heads=4, causal=True)
    pair = FRAMEWORK.long_pair(shape, "cpu", "float32")
    assert set(pair) == {"ours", "SDPA"}
    for _, call in pair.values():
        output = FRAMEWORK.backend.to_numpy(call(torch.from_numpy(x)))
        np.testing.assert_allclose(output, expected, atol=FLOAT32, rtol=0)
    rows = time_long(FRAMEWORK, "cpu", "float32", shape)
    assert [(m.implementation, m.mode, m.dtype) for m in rows] == [
        ("ours", MODE, "float32"),
        ("SDPA", MODE, "float32"),
    ]
    assert all(m.seconds > 0 and m.gflops > 0 for m in rows)
    assert float(rows[0].note.rsplit(" ", 1)[-1]) < FLOAT32


def test_the_long_pass_counts_causal_flops_and_knows_peaks_by_model():
    from mha_multi.bench.common import Shape
    from mha_multi.bench.long import causal_flops, peak_tflops

    # Two tokens of two hiddens, one head: four projections of 2 x 2 x 2 products (16
    # FLOPs each), and the scores' and weighted values' 2 x 2 x 2 products (16 each), of
    # which the causal rule keeps half.
    assert causal_flops(Shape(batch=1, length=2, num_hiddens=2, num_heads=1)) == 4 * 16 + 16
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("cpu") is None
