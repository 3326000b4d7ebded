"""Decoders (and calls) timed in turns in one process, and their Python calls (the tools' own).

A machine's speed drifts within seconds, so ratios of separate runs mislead:
each decoder runs ``turn`` steps in its turn, round after round, and a
decoder's time is its median turn's (docs: "Results").
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from mha_multi.bench.host import counted

#: A decoder's maker: a step function of a fresh decoder after its prompt.
Maker = Callable[[], Callable[[], Any]]


def timed_turns(
    makers: dict[str, Maker],
    *,
    rounds: int,
    turn: int,
    done: Callable[[Any], None],
    around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> dict[str, list[float]]:
    """Microseconds a step of each decoder, one entry a turn.

    ``done(output)`` waits until a step's output is computed (the device's
    queue drained); ``around[name]()`` is entered for that decoder's turns
    (the route turned off, say)."""
    around = around or {}
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            with around.get(name, contextlib.nullcontext)():
                step = make()
                done(step())
                start = time.perf_counter()
                for _ in range(turn):
                    output = step()
                done(output)
                times[name].append((time.perf_counter() - start) / turn * 1e6)
    return times


def median_calls(
    calls: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    turn: int,
    around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> dict[str, float]:
    """Each way's median turn's microseconds a call, ``calls`` (on the host, nothing
    to wait for) taking turns (:func:`timed_turns`)."""
    makers = {way: lambda call=call: call for way, call in calls.items()}
    times = timed_turns(makers, rounds=rounds, turn=turn, done=lambda _: None, around=around)
    return {way: statistics.median(measured) for way, measured in times.items()}


def report(times: dict[str, list[float]], difference: float, *, per: str = "step") -> None:
    """Each decoder's median ``per`` (a step, a call) and its speed against
    ``hand-written``'s."""
    hand = statistics.median(times["hand-written"])
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"{name:>13}: {median:7.0f} us a {per}, {hand / median:.2f}x hand-written")
    print(f"largest difference, ours and the hand-written outputs: {difference:.1e}")


def compare(
    ours: Maker,
    hand: Maker,
    *,
    generic: Callable[[], contextlib.AbstractContextManager],
    difference: float,
    rounds: int,
    turn: int,
    done: Callable[[Any], None],
    per: str = "step",
    counted_calls: int = 20,
) -> None:
    """Ours, ours through the generic flow alone (inside ``generic()``) and the
    hand-written way timed in turns and reported, then the Python calls of ours and of
    the generic flow (cProfile, over ``counted_calls``)."""
    makers = {"ours": ours, "generic flow": ours, "hand-written": hand}
    around = {"generic flow": generic}
    times = timed_turns(makers, rounds=rounds, turn=turn, done=done, around=around)
    report(times, difference, per=per)
    route_calls = counted(ours(), counted_calls)
    with generic():
        generic_calls = counted(ours(), counted_calls)
    print(f"Python calls a {per}: {route_calls:.0f} (the generic flow's {generic_calls:.0f})")
