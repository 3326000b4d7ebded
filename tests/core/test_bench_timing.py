"""How the benchmark times ways against each other: what a timed turn runs beside."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from mha_multi.bench.generate import Generator, generate, generate_in_turns


def _way(seen: list[bool], *, failing_at: int | None = None) -> Generator:
    """A generator of no work that notes, at its prefill and each step, whether Python's
    garbage collector is on (and raises at step ``failing_at``)."""

    def prefill(prompt: np.ndarray) -> tuple[int, np.ndarray]:
        seen.append(gc.isenabled())
        return 0, prompt

    def step(state: int, token: np.ndarray) -> tuple[int, np.ndarray]:
        seen.append(gc.isenabled())
        if state == failing_at:
            raise RuntimeError("a failing step")
        return state + 1, token

    return Generator(prefill, step, lambda token: None, np.asarray)


@pytest.fixture(params=[True, False], ids=["collector on", "collector off"])
def collector(request):
    """The collector on or off before a timing, as it was after the test."""
    was = gc.isenabled()
    (gc.enable if request.param else gc.disable)()
    yield request.param
    (gc.enable if was else gc.disable)()


def test_ways_in_turns_are_timed_with_the_collector_paused(collector):
    """Every prefill and step of ways in turns runs with Python's garbage collector off
    (a full pass, which the outputs a generation keeps set off, falls on one way's
    turn), and the collector is as it was after, a failing step's error included."""
    seen: list[bool] = []
    timed = generate_in_turns({"a": _way(seen), "b": _way(seen)}, np.zeros((1, 1, 2)), 20)
    assert seen == [False] * 42
    assert [outputs.shape for _, _, outputs in timed.values()] == [(1, 20, 2)] * 2
    assert gc.isenabled() is collector
    with pytest.raises(RuntimeError, match="a failing step"):
        generate_in_turns({"a": _way(seen, failing_at=3)}, np.zeros((1, 1, 2)), 20)
    assert gc.isenabled() is collector


def test_one_generation_is_timed_with_the_collector_paused(collector):
    """A way timed alone (:func:`generate`) runs with the collector off too."""
    seen: list[bool] = []
    _, _, outputs = generate(_way(seen), np.zeros((1, 1, 2)), 5)
    assert seen == [False] * 6 and outputs.shape == (1, 5, 2)
    assert gc.isenabled() is collector


def test_a_generation_whose_memory_is_measured_runs_with_the_collector_as_it_is(collector):
    """Not paused where a generation's peak memory is measured (``pause_collector=False``):
    garbage the collector would take in a user's loop is no peak."""
    seen: list[bool] = []
    generate(_way(seen), np.zeros((1, 1, 2)), 5, pause_collector=False)
    assert seen == [collector] * 6
