"""The generation benchmark, written once: tokens per second with a key/value cache.

The layer is used as a one-layer decoder whose next input is its last
output: a batch of ``B`` prompts of ``prompt`` tokens is prefilled, then
``new_tokens`` tokens are generated one at a time, three ways:

* ``cached``: ours with a key/value cache (docs: "Generating with a cache"),
  one token per call after one prefill call;
* ``recompute``: ours without a cache, the whole causal forward over every
  token so far at every step, as d2l's decoder does;
* ``native``: the framework's own cached decoding where it has one (Flax
  NNX's ``decode=True``), which takes one token per call, prompt included;
* ``hand-written``: the twenty lines a careful user writes for the same
  weights: a static cache of ``(B, H_kv, max_length, head_dim)`` written in
  place and the framework's attention over the filled positions.

The ways but ``recompute`` generate in turns of a few steps
(:func:`generate_in_turns`), so that a shared machine's drift falls on all
of them alike, and do so :data:`ROUNDS` times: a rate is the median
round's. Every way generates the same numbers, which the run checks (each row
records its largest difference from ``cached``). Peak memory of the cached
generation is set beside the cache's size, ``2 * B * num_kv_heads *
max_length * head_dim`` elements.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mha_multi.bench.common import Measurement, Shape, collector_paused, kv_bytes

__all__ = [
    "GenerationShape",
    "Generator",
    "generate",
    "generate_in_turns",
    "generation_peak_mib",
    "rotary_angles",
    "run_generation",
]


@dataclass(frozen=True)
class GenerationShape:
    """What is generated: ``batch`` sequences of ``prompt`` then ``new_tokens`` tokens."""

    batch: int = 8
    prompt: int = 256
    new_tokens: int = 256
    num_hiddens: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None
    #: The layer's rotary positions (its ``rotary=`` argument: ``{"theta":
    #: 10000.0}`` rotates half-split pairs at the default positions, as Llama
    #: does), ``None`` for none; the hand-written decoder rotates the same way.
    rotary: dict[str, float] | None = None

    @property
    def max_length(self) -> int:
        return self.prompt + self.new_tokens

    @property
    def kv_heads(self) -> int:
        return self.attention_shape().kv_heads

    @property
    def layer_options(self) -> dict[str, Any]:
        """Our layer's options beyond its sizes: its rotary positions, if any."""
        return {} if self.rotary is None else {"rotary": dict(self.rotary)}

    def note_shape(self) -> dict[str, Any]:
        """The shape a generation row records: the full cache's attention, the
        prompt, and the rotary setting where there is one."""
        shape = {**vars(self.attention_shape()), "prompt": self.prompt}
        return shape if self.rotary is None else {**shape, "rotary": dict(self.rotary)}

    def cache_bytes(self, itemsize: int) -> int:
        """Bytes of a cache of ``max_length`` positions: keys and values."""
        return kv_bytes(self.attention_shape(), itemsize)

    def attention_shape(self) -> Shape:
        """Self-attention over all ``max_length`` positions, the full cache's."""
        return Shape(
            self.batch, self.max_length, self.num_hiddens, self.num_heads, self.num_kv_heads
        )


def rotary_angles(shape: GenerationShape) -> np.ndarray | None:
    """The rotation angles of every position a generation of ``shape`` reaches.

    ``(max_length, head_dim)`` float32, each half ``position * inv_freq`` with
    ``inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)`` computed
    in float64 and rounded to float32, and the product one float32 rounding,
    as the spec makes its tables (docs: "Positions and biases"); the two
    halves repeat, as transformers' ``rotate_half`` pairs entry ``i`` with
    ``i + head_dim / 2``. ``None`` where ``shape`` has no rotary positions.
    A hand-written decoder takes their cosines and sines once, in its
    framework.
    """
    if shape.rotary is None:
        return None
    if set(shape.rotary) - {"theta"}:
        raise ValueError(f"the hand-written decoders rotate by theta alone; got {shape.rotary}")
    head_dim = shape.num_hiddens // shape.num_heads
    theta = float(shape.rotary.get("theta", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    positions = np.arange(shape.max_length, dtype=np.float32)[:, None]
    angles = positions * inv_freq.astype(np.float32)  # float32 x float32: one rounding
    return np.concatenate([angles, angles], axis=-1)


@dataclass
class Generator:
    """One way of generating, as a framework supplies it.

    Attributes:
        prefill: ``prefill(prompt)`` takes the framework's ``(B, prompt, D)``
            array and returns ``(state, last)``: whatever the steps carry, and
            the ``(B, 1, D)`` output at the prompt's last position.
        step: ``step(state, token) -> (state, output)`` for one ``(B, 1, D)``
            token; ``output`` is ``(B, 1, D)``.
        sync: blocks until an output is computed.
        to_numpy: an output as numpy.
    """

    prefill: Callable[[Any], tuple[Any, Any]]
    step: Callable[[Any, Any], tuple[Any, Any]]
    sync: Callable[[Any], None]
    to_numpy: Callable[[Any], np.ndarray]


#: The steps one way takes before the next way's turn (:func:`generate_in_turns`).
TURN = 16
#: The generations in turns each way's rate is the median of (:func:`run_generation`).
ROUNDS = 3


def generate(
    generator: Generator, prompt: Any, new_tokens: int, *, pause_collector: bool = True
) -> tuple[float, float, np.ndarray]:
    """Prefills, then generates ``new_tokens`` tokens, each the previous output (the
    garbage collector waiting, :func:`~mha_multi.bench.common.collector_paused`, unless
    not ``pause_collector``).

    Returns:
        ``(prefill seconds, generation seconds, outputs (B, new_tokens, D))``.
    """
    with collector_paused() if pause_collector else contextlib.nullcontext():
        start = time.perf_counter()
        state, token = generator.prefill(prompt)
        generator.sync(token)
        prefilled = time.perf_counter()
        outputs = []
        for _ in range(new_tokens):
            state, token = generator.step(state, token)
            outputs.append(token)
        generator.sync(token)
        done = time.perf_counter()
    gathered = np.concatenate([generator.to_numpy(x) for x in outputs], axis=1)
    return prefilled - start, done - prefilled, gathered


def generate_in_turns(
    generators: dict[str, Generator], prompt: Any, new_tokens: int
) -> dict[str, tuple[float, float, np.ndarray]]:
    """:func:`generate` of every generator, taking turns of :data:`TURN` steps.

    A shared machine's speed drifts over seconds: ways timed one after the
    other can differ by that drift alone, while ways that alternate every
    few steps meet the same minutes. Each turn ends with a sync; the order
    of the ways is the same at every turn, so that no way's turn follows its
    own (:func:`~mha_multi.bench.common.medians_in_turns`). The garbage
    collector waits (:func:`~mha_multi.bench.common.collector_paused`).

    Returns:
        Name -> ``(prefill seconds, generation seconds, outputs (B, new_tokens, D))``.
    """
    states, prefill_s, seconds, outputs = {}, {}, {}, {}
    with collector_paused():
        for name, generator in generators.items():
            start = time.perf_counter()
            states[name] = generator.prefill(prompt)
            generator.sync(states[name][1])
            prefill_s[name], seconds[name], outputs[name] = time.perf_counter() - start, 0.0, []
        for first in range(0, new_tokens, TURN):
            for name, generator in generators.items():
                start = time.perf_counter()
                state, token = states[name]
                for _ in range(min(TURN, new_tokens - first)):
                    state, token = generator.step(state, token)
                    outputs[name].append(token)
                generator.sync(token)
                seconds[name] += time.perf_counter() - start
                states[name] = (state, token)
    return {
        name: (
            prefill_s[name],
            seconds[name],
            np.concatenate([generator.to_numpy(x) for x in outputs[name]], axis=1),
        )
        for name, generator in generators.items()
    }


def run_generation(
    framework: Any,
    device: str,
    dtype: str,
    shape: GenerationShape,
    itemsize: int,
    *,
    execution: str | None = None,
    ways: Sequence[str] | None = None,
) -> list[Measurement]:
    """Times every generator of ``framework`` and measures the cached one's peak memory.

    ``framework.generators(shape, device, dtype, execution)`` returns name ->
    a function making a fresh :class:`Generator` (a new cache each time).
    A warm-up generation of a few tokens loads kernels and compiles first;
    then ``recompute`` generates alone, once, and the other ways in turns
    (:func:`generate_in_turns`), :data:`ROUNDS` times, each with new caches:
    a row's time is the median round's. Peak memory is measured for the first
    execution mode only. ``ways`` keeps only the generators of those names
    (``None``: all).
    """
    rng = np.random.default_rng(0)
    prompt_np = rng.standard_normal((shape.batch, shape.prompt, shape.num_hiddens)).astype(
        np.float32
    )
    prompt = framework.array(prompt_np, device, dtype)
    label = framework.label(execution)
    note_shape = shape.note_shape()
    makers = framework.generators(shape, device, dtype, execution)
    if ways is not None:
        makers = {name: make for name, make in makers.items() if name in ways}
    failed: dict[str, Exception] = {}
    for name, make in makers.items():
        try:
            generate(make(), prompt, 2)  # loads kernels, compiles
        except Exception as error:  # e.g. a native decoder that cannot take these sizes
            failed[name] = error
    timed: dict[str, tuple[float, float, np.ndarray]] = {}
    if "recompute" in makers and "recompute" not in failed:
        # Alone: a step of it takes as long as many of the others.
        timed["recompute"] = generate(makers["recompute"](), prompt, shape.new_tokens)
    in_turns = [name for name in makers if name not in (*failed, *timed)]
    rounds = [
        generate_in_turns({name: makers[name]() for name in in_turns}, prompt, shape.new_tokens)
        for _ in range(ROUNDS)
    ]
    for name in in_turns:
        prefill_s, seconds = (
            float(np.median([timings[name][i] for timings in rounds])) for i in (0, 1)
        )
        timed[name] = (prefill_s, seconds, rounds[0][name][2])
    outputs = {name: result[2] for name, result in timed.items()}
    rows = []
    for name in makers:
        row = Measurement(
            label, name, "generate", device, dtype, shape.max_length, shape=note_shape
        )
        if name in failed:
            print(f"[bench] {label} generate {name}: {failed[name]}", flush=True)
            rows.append(replace(row, note=f"failed: {type(failed[name]).__name__}"))
            continue
        prefill_s, seconds, _ = timed[name]
        rows.append(
            replace(
                row,
                seconds=seconds,
                tokens_per_s=shape.batch * shape.new_tokens / seconds,
                note=f"prefill {prefill_s * 1e3:.0f} ms",
            )
        )
    if "cached" in outputs:
        # Every way generates the same numbers: each row notes how far from ours.
        differences = {
            name: float(np.abs(output - outputs["cached"]).max())
            for name, output in outputs.items()
            if name != "cached"
        }
        rows = [
            replace(r, note=f"{r.note}; max |this - cached| {differences[r.implementation]:.1e}")
            if r.implementation in differences
            else r
            for r in rows
        ]
    first = execution == framework.executions[0]
    if framework.measures_memory(device) and "cached" in outputs and first:
        # In a process of its own: a process's peak never falls.
        command = [sys.executable, "-m", "mha_multi.bench", "generation-memory", framework.name]
        command += [device, dtype, json.dumps(vars(shape))]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        peak = float(output.split()[-1])
        size = shape.cache_bytes(itemsize) / 2**20
        rows.append(
            Measurement(
                label,
                "cached",
                "generate memory",
                device,
                dtype,
                shape.max_length,
                peak_mib=peak,
                note=f"the cache: {size:.1f} MiB",
                shape=note_shape,
            )
        )
    return rows


def generation_peak_mib(framework: Any, device: str, dtype: str, shape: GenerationShape) -> float:
    """Peak memory a cached generation adds, above its layer, prompt and loaded kernels.

    Meaningful only as the first measurement of a process. A warm-up
    generation of two tokens (a cache of its own) loads kernels and
    compiled programs first; the figure is then the peak of a whole
    generation: the cache, the cache a functional update writes beside it,
    and the temporaries of a step.
    """
    framework.setup()
    rng = np.random.default_rng(0)
    prompt = framework.array(
        rng.standard_normal((shape.batch, shape.prompt, shape.num_hiddens)).astype(np.float32),
        device,
        dtype,
    )
    make = framework.generators(shape, device, dtype)["cached"]
    generate(make(), prompt, 2)
    # (The collector running, as in a user's loop: garbage it would take is no peak.)
    return framework.peak_mib(
        device, lambda: generate(make(), prompt, shape.new_tokens, pause_collector=False)
    )
