"""A call's checks and kernel plan, decided by its signature's first call and looked up
by the calls after it (mha_multi.call.decisions): the same answers, errors every time."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mha_multi import call, spec
from mha_multi.call import decisions
from mha_multi.call.kernel_plan import planned


class _Facts(call.Facts):
    """Facts of a framework whose tracer, while ``traced``, must see every decision run."""

    kernel = spec.FusedKernel("a kernel of SDPA's rules", mask_and_causal=True)

    def __init__(self) -> None:
        self.traced = False

    def tracing(self) -> bool:
        return self.traced


@pytest.fixture(autouse=True)
def _forgotten():
    decisions.forget()
    yield
    decisions.forget()


def test_a_signature_decides_once_errors_every_time_and_unhashable_keys_each_time() -> None:
    facts, made = _Facts(), []

    def half(n: object) -> float:
        made.append(n)
        if isinstance(n, int) and n == 0:
            raise ValueError("n: expected a number other than 0")
        return float(np.sum(n)) / 2

    def decide(n: object, key: object) -> float:
        return decisions.once_per_signature(facts, half, key, n)

    assert decide(4, 4) == decide(4, 4) == 2.0
    assert made == [4]
    for count in (1, 2):  # (nothing kept of an error: it raises again)
        with pytest.raises(ValueError, match="n: expected"):
            decide(0, 0)
        assert made.count(0) == count
    array = np.array([2, 4])
    assert decide(array, [2, 4]) == decide(array, [2, 4]) == 3.0  # (a list: no hash)
    assert sum(x is array for x in made) == 2

    class NoHash:  # (as MXNet's arrays: their hash raises NotImplementedError)
        def __hash__(self) -> int:
            raise NotImplementedError

    assert decide(array, NoHash()) == decide(array, NoHash()) == 3.0
    assert sum(x is array for x in made) == 4
    facts.traced = True  # (a tracer that must see it run: nothing looked up or kept)
    assert decide(4, 4) == 2.0 and decide(6, 6) == 3.0
    numbers = [n for n in made if isinstance(n, int)]
    assert numbers.count(4) == 2 and numbers.count(6) == 1
    facts.traced = False
    assert decide(6, 6) == 3.0 and [n for n in made if isinstance(n, int)].count(6) == 2


def test_the_checks_of_a_signature_run_once_and_a_bad_call_raises_every_time(monkeypatch) -> None:
    facts, checked = _Facts(), []

    def counted(*args, **kwargs):
        checked.append(args)
        return spec.check_inputs(*args, **kwargs)

    sizes = {"query_size": 8, "key_size": 8, "value_size": 8}
    good, bad = ((2, 3, 8),) * 3, ((2, 3, 8), (2, 3, 5), (2, 3, 5))
    for _ in range(3):
        decisions.once_per_signature(facts, counted, (good, True), *good, None, **sizes)
    assert len(checked) == 1
    for count in (2, 3):  # (a wrong key size: raised, and checked again the next time)
        with pytest.raises(ValueError, match="keys last dimension must be key_size=8"):
            decisions.once_per_signature(facts, counted, (bad, True), *bad, None, **sizes)
        assert len(checked) == count


@pytest.mark.parametrize("causal", [False, True])
def test_a_kept_plan_serves_the_sizes_it_compares_alike_as_a_plan_made_for_them(causal) -> None:
    """``planned`` keeps a plan by the sizes and the shortest length as the plan compares
    them (``spec.plan_relations``): for every pair of sizes and lengths, the plan kept for
    the first is what ``spec.plan_kernel`` makes for the second where they compare alike."""
    facts = _Facts()
    grid = [
        {"sizes": (batch, queries, keys), "shortest_length": shortest}
        for batch, queries, keys in itertools.product((0, 2), (0, 1, 3, 4), (0, 1, 3, 4, 9))
        for shortest in (None, 0, 1, 3, 4, 9, math.nan)
    ]
    for first, second in itertools.product(grid, repeat=2):
        base = {"lens_ndim": 1, "causal": causal, "values_exact": True}
        one, other = {**base, **first}, {**base, **second}
        if spec.plan_relations(one) != spec.plan_relations(other):
            continue
        decisions.forget()
        planned(facts, one)
        assert planned(facts, other) == spec.plan_kernel(facts.kernel, **other)
