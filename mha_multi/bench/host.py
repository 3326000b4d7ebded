"""The host rows: a tiny layer's call and decoding step (the time is Python's), and its calls.

The tiny layers (:data:`TINY`: 16 hiddens, 2 query heads and 1 key/value
head, rotary positions, one example, one thread; :data:`TINY_PLAIN`: the
same sizes with 2 key/value heads and no option) compute next to nothing,
so a call's time is the host's work around its kernels: the checks, the plan,
the flow. Two kinds of row:

* ``host: one token`` and ``host: decoding step``
  (:func:`time_host`): ours against the hand-written call and decoding step
  (the generation rows' anchor) in alternating blocks of :data:`BLOCK` calls
  in one process, a shared machine's drift falling on both; a row's time is
  the median block's per call, for each tiny layer. Each route a framework
  offers is timed: the CPU's, and where the framework can take it on the
  CPU, the one a GPU's call takes (PyTorch: ``as_if_on_a_gpu``).
* ``python calls: ...`` (:func:`count_calls`): the Python function calls one
  call makes, counted by cProfile (builtins included): the same on every
  machine for the same code, plain and rotary, in the framework's eager mode.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import importlib
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from mha_multi.bench.common import Measurement, collector_paused
from mha_multi.bench.generate import GenerationShape, Generator

__all__ = [
    "BLOCK",
    "TINY",
    "TINY_PLAIN",
    "alternating_blocks",
    "count_calls",
    "counted",
    "time_host",
]

#: The tiny Llama-shaped layer of the host rows (its prompt: a few tokens).
_SIZES = {"num_hiddens": 16, "num_heads": 2, "num_kv_heads": 1}
TINY = GenerationShape(batch=1, prompt=4, new_tokens=0, rotary={"theta": 10000.0}, **_SIZES)
#: The tiny plain layer of the host rows: as many key/value heads as query heads, no option.
TINY_PLAIN = replace(TINY, num_kv_heads=None, rotary=None)
#: Calls of one way before the other's turn (:func:`alternating_blocks`).
BLOCK = 20
#: Calls :func:`counted` profiles, after three.
COUNTED_CALLS = 20


def alternating_blocks(
    calls: dict[str, Callable[[], Any]], sync: Callable[[Any], None], blocks: int
) -> dict[str, list[float]]:
    """Seconds per call of each of :data:`BLOCK` calls, every way taking turns.

    A warm-up block each first; then ``blocks`` rounds, the ways in the same
    order every round (:func:`~mha_multi.bench.common.medians_in_turns`: no
    block follows its own way's). Each block ends with ``sync`` of its last
    result. The garbage collector waits
    (:func:`~mha_multi.bench.common.collector_paused`).

    Returns:
        Name -> the seconds per call of each timed block.
    """
    for call in calls.values():
        sync([call() for _ in range(BLOCK)][-1])
    times: dict[str, list[float]] = {name: [] for name in calls}
    with collector_paused():
        for _ in range(blocks):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(BLOCK - 1):
                    call()
                sync(call())
                times[name].append((time.perf_counter() - start) / BLOCK)
    return times


def counted(call: Callable[[], Any], calls: int = COUNTED_CALLS) -> float:
    """Python function calls per ``call``, over ``calls`` of them after three."""
    for _ in range(3):
        call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    return pstats.Stats(profile).total_calls / calls


def _stepping(generator: Generator, prompt: Any, outputs: list) -> Callable[[], Any]:
    """``generator``'s decoding steps as a function of nothing, each fed the last output."""
    held = list(generator.prefill(prompt))

    def step() -> Any:
        held[0], held[1] = generator.step(*held)
        outputs.append(held[1])
        return held[1]

    return step


def _ways(framework: Any, shape: GenerationShape, device: str) -> dict[str, dict[str, Any]]:
    """``"one token"`` and ``"decoding step"`` -> way -> its call, and ``"outputs"`` ->
    way -> the steps' outputs as they come.

    Ours is called eagerly (``framework.eager_layer_call``); the hand-written
    call and step are there where the framework has the one-token anchor
    (``framework.hand_written_call``), its step then the generation rows'
    eager hand-written decoder.
    """
    dtype = "float32"
    layer = framework.ours(shape.attention_shape(), device, dtype, **shape.layer_options)
    call = framework.eager_layer_call(layer)
    rng = np.random.default_rng(0)
    prompt_np = rng.standard_normal((shape.batch, shape.prompt, shape.num_hiddens))
    prompt = framework.array(prompt_np.astype(np.float32), device, dtype)
    token = framework.array(prompt_np[:, :1].astype(np.float32), device, dtype)

    ours = framework.cached_generator(layer, call, shape)
    outputs: dict[str, list] = {"ours": [], "hand-written": []}
    ways: dict[str, dict[str, Any]] = {
        "one token": {"ours": lambda: call(token)},
        "decoding step": {"ours": _stepping(ours, prompt, outputs["ours"])},
        "outputs": outputs,
    }
    if framework.hand_written_call is not None:
        weights = importlib.import_module(framework.package).get_weights(layer)
        anchor = framework.hand_written_call(weights, shape, device, dtype)
        ways["one token"]["hand-written"] = lambda: anchor(token)
        decoder = framework.hand_written(weights, shape, device, dtype)
        ways["decoding step"]["hand-written"] = _stepping(decoder, prompt, outputs["hand-written"])
    return ways


def time_host(framework: Any, device: str, *, blocks: int = 40) -> list[Measurement]:
    """The host rows of ``framework``, :data:`TINY`'s and :data:`TINY_PLAIN`'s, on each
    of its routes (``framework.host_routes``).

    Each way's decoding steps feed it its own last output, from the same
    prompt: the note gives how far ours is from the hand-written steps.
    """
    rows = []
    for route, context in framework.host_routes(device).items():
        for layer in (TINY, TINY_PLAIN):
            shape = replace(layer, new_tokens=(blocks + 1) * BLOCK)
            with context():
                rows += _host_rows(framework, shape, device, route, blocks)
    return [Measurement(**row) for row in rows]


def _host_rows(
    framework: Any, shape: GenerationShape, device: str, route: str, blocks: int
) -> list[dict[str, Any]]:
    """:func:`time_host`'s rows of one tiny layer (``shape``) on one route."""
    rows = []
    ways = _ways(framework, shape, device)
    outputs = ways.pop("outputs")
    for what, calls in ways.items():
        times = alternating_blocks(calls, framework.sync, blocks)
        note = f"{route} route; median of {blocks} blocks of {BLOCK} calls"
        if what == "decoding step":
            ours, hand = (
                np.concatenate([framework.backend.to_numpy(o) for o in outputs[n]], 1)
                for n in ("ours", "hand-written")
            )
            note += f"; max |hand-written - ours| {np.abs(ours - hand).max():.1e}"
        for name, seconds in times.items():
            rows.append(
                _row(framework, name, f"host: {what}", device, shape, route)
                | {"seconds": statistics.median(seconds), "note": note}
            )
    return rows


def _row(
    framework: Any, name: str, mode: str, device: str, shape: GenerationShape, route: str
) -> dict[str, Any]:
    sizes = {**vars(shape.attention_shape()), "length": 1, "rotary": shape.rotary}
    return {
        "backend": framework.label(framework.executions[0]),
        "implementation": name,
        "mode": mode,
        "device": device,
        "dtype": "float32",
        "length": 1,
        "shape": {**sizes, "route": route},
    }


def count_calls(framework: Any, device: str) -> list[Measurement]:
    """Python calls per call of ours (and of the hand-written anchors where the framework
    has them), one token without a cache and one decoding step, plain and rotary, in
    the framework's eager mode; and ours' one-token call in training mode where the
    framework counts it (``framework.eager_layer_call(..., training=True)``)."""
    rows = []
    for rotary in (None, TINY.rotary):
        shape = replace(TINY, rotary=rotary, new_tokens=COUNTED_CALLS + 8)
        ways = _ways(framework, shape, device)
        ways.pop("outputs")
        layer = framework.ours(shape.attention_shape(), device, "float32", **shape.layer_options)
        with contextlib.suppress(NotImplementedError):
            training = framework.eager_layer_call(layer, training=True)
            token = np.ones((1, 1, shape.num_hiddens), np.float32)
            token = framework.array(token, device, "float32")
            ways["one token, training"] = {"ours": functools.partial(training, token)}
        for what, calls in ways.items():
            for name, call in calls.items():
                row = _row(framework, name, f"python calls: {what}", device, shape, "cpu")
                rows.append(Measurement(**row, calls=counted(call)))
    return rows
