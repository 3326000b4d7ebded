"""A rotary layer's tables at the default positions: made once per signature, reused by eager calls.

A second eager call of the same signature (positions count, dtype, device,
rotation) makes no tables and gives the float64 reference's numbers; a call
of another length or dtype makes its own; a decoding step takes its rows of
the table of its cache's every position (docs: "Fast paths").
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from mha_multi import call, spec
from mha_multi.call import rotary_tables
from mha_multi.parity.compare import tolerance
from mha_multi.weights import init_weights

ROTARY = {"theta": 100.0}
HEADS = {"num_heads": 4, "num_kv_heads": 2}


@pytest.fixture
def made(runner, monkeypatch):
    """How many tables the calls make: :func:`mha_multi.spec.rotary_tables`' runs."""
    if not runner.keeps_rotary_tables:
        pytest.skip(f"{runner.name}: an eager call makes its own rotary tables")
    runs = []
    make = spec.rotary_tables

    def counted(*args, **kwargs):
        runs.append(1)
        return make(*args, **kwargs)

    monkeypatch.setattr(spec, "rotary_tables", counted)
    rotary_tables.forget()  # (another backend's calls may have kept these signatures)
    return runs


def rotary_layer(runner, weights, dtype):
    layer = runner.make_layer(16, 4, num_kv_heads=2, rotary=ROTARY, dtype=dtype)
    return runner.set_weights(layer, weights)


def test_a_second_call_reuses_its_tables_and_another_signature_makes_its_own(runner, made):
    weights = init_weights(16, seed=11, **HEADS)
    x = np.random.default_rng(11).standard_normal((2, 5, 16))
    layers = {}

    def call(length, dtype="float32"):
        if dtype not in layers:
            cast = {name: array.astype(dtype) for name, array in weights.items()}
            layers[dtype] = rotary_layer(runner, cast, dtype)
        rows = runner.to_native(x[:, :length].astype(dtype), dtype=dtype)
        made.clear()
        output = runner.forward(layers[dtype], rows, rows, rows, None, causal=True)
        expected, _ = spec.reference_forward(
            weights, *[x[:, :length]] * 3, **HEADS, causal=True, rotary=ROTARY
        )
        got = runner.to_numpy(output)
        assert np.abs(got - expected).max() <= tolerance(dtype, "output"), (length, dtype)
        return got, len(made)

    first, makes = call(5)
    assert makes >= 1
    second, makes = call(5)
    assert makes == 0, "the second call of one signature made its tables again"
    np.testing.assert_array_equal(second, first)
    assert call(3)[1] >= 1, "another length took the tables of 5 positions"
    if runner.dtype_supported("cpu", "float64"):
        assert call(5, "float64")[1] >= 1, "float64 took float32's tables"
        # (The signature's third call, which Keras on TensorFlow traces into its program:
        # a trace makes its own tables, and the calls after it run the program.)
        call(5)
        assert call(5)[1] == 0
    # Only concrete arrays are kept (Keras' JAX runner compiles its calls: none).
    kept = rotary_tables.kept()
    assert len(kept) <= rotary_tables.KEPT_SIGNATURES
    for tables in kept:
        assert all(np.isfinite(runner.to_numpy(table)).all() for table in tables)


def test_decoding_steps_take_rows_of_one_table(runner, made):
    """Where the framework's cosines are each angle's own (not TensorFlow's CPU
    kernels: a step there makes its own tables)."""
    rows_of_one_table = importlib.import_module(f"{runner.package}._facts").FACTS.rows_of_one_table
    weights = {k: v.astype(np.float32) for k, v in init_weights(16, seed=12, **HEADS).items()}
    layer = rotary_layer(runner, weights, "float32")
    x = np.random.default_rng(12).standard_normal((2, 6, 16)).astype(np.float32)
    cache = runner.init_cache(layer, 2, 6)
    expected_cache = spec.KVCache(np.zeros((2, 2, 6, 4)), np.zeros((2, 2, 6, 4)), np.zeros(2))
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
        made.clear()
        rows = runner.to_native(x[:, start:stop])
        output, cache = runner.forward(layer, rows, rows, rows, None, causal=True, cache=cache)
        if start >= 4:  # a step after the first (Keras' JAX runner compiles the first)
            assert bool(made) != rows_of_one_table, (start, len(made))
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, *[x[:, start:stop]] * 3, expected_cache, **HEADS, causal=True, rotary=ROTARY
        )
        assert np.abs(runner.to_numpy(output) - expected).max() <= 5e-6, stop


def test_ragged_steps_take_rows_of_one_table_where_the_framework_picks_them(runner, made):
    """A ragged batch's steps (examples at different lengths) take each example's rows
    of the table where the framework picks rows (:meth:`mha_multi.call.Facts.rows_at`),
    and a call whose padding row would lie past the cache makes its own; every backend
    gives the float64 reference's numbers (those that pick no rows make their own
    tables, or compile the call)."""
    facts = importlib.import_module(f"{runner.package}._facts").FACTS
    picks = facts.rows_of_one_table and type(facts).rows_at is not call.Facts.rows_at
    weights = {k: v.astype(np.float32) for k, v in init_weights(16, seed=13, **HEADS).items()}
    layer = rotary_layer(runner, weights, "float32")
    x = np.random.default_rng(13).standard_normal((2, 8, 16)).astype(np.float32)
    cache = runner.init_cache(layer, 2, 7)
    expected_cache = spec.KVCache(np.zeros((2, 2, 7, 4)), np.zeros((2, 2, 7, 4)), np.zeros(2))
    # Lengths 3 and 1, steps to 6 and 4, then two positions of which the first
    # example's second is a padding row, at position 7: past the cache.
    calls = ((0, 3, [3, 1]), (3, 4, None), (4, 5, None), (5, 6, None), (6, 8, [1, 2]))
    for number, (start, stop, lens) in enumerate(calls):
        made.clear()
        rows = runner.to_native(x[:, start:stop])
        valid_lens = None if lens is None else runner.native_lens(np.array(lens, np.int32))
        output, cache = runner.forward(
            layer, rows, rows, rows, valid_lens, causal=True, cache=cache
        )
        if picks and number in (2, 3):  # (ragged steps after the first)
            assert not made, f"a ragged step made its tables ({start})"
        if picks and number == 4:
            assert made, "a padding row past the cache took a row of its table"
        expected, _, expected_cache = spec.reference_cached_forward(
            weights,
            *[x[:, start:stop]] * 3,
            expected_cache,
            None if lens is None else np.array(lens),
            **HEADS,
            causal=True,
            rotary=ROTARY,
        )
        got = runner.to_numpy(output)
        if lens is not None:  # (padding rows' outputs are unspecified)
            got, expected = (
                a[np.arange(stop - start) < np.array(lens)[:, None]] for a in (got, expected)
            )
        assert np.abs(got - expected).max() <= 5e-6, stop
