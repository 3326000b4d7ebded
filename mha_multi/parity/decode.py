"""Decoding schedules: the defining property of a key/value cache, driven once.

A schedule splits a ragged batch of sequences into calls: a prefill of any
length, then chunks of any length (1 included), each example appending its
own number of real positions per call. :func:`decode` runs a schedule
through any step function (a backend's layer, or the float64 reference), so
the test-suite and the parity command drive every backend the same way, and
:func:`full_reference` is what every schedule must give (docs: "Generating
with a cache").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mha_multi import spec

#: The layer's inputs, in call order.
INPUT_NAMES = ("queries", "keys", "values")

__all__ = [
    "Chunk",
    "chunk_index",
    "chunk_rows",
    "decode",
    "full_reference",
    "full_reference_gradients",
    "random_schedule",
    "reference_decode",
]

#: One call of a schedule: ``(T, new_lens)``, ``T`` new positions of which
#: example ``b`` keeps ``new_lens[b]``.
Chunk = tuple[int, Sequence[int]]

#: ``step(queries, keys, values, new_lens) -> output``: one cached call on
#: numpy ``(B, T, ·)`` rows and ``(B,)`` int32 new lengths, returning the
#: ``(B, T, num_hiddens)`` output as numpy. The step keeps the cache.
Step = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def chunk_rows(x: np.ndarray, consumed: np.ndarray, num_new: int) -> np.ndarray:
    """The rows of one call: ``x[b, consumed[b] + t]`` for ``t < T``, modulo ``N``.

    Rows past an example's new length are padding. They are other positions'
    data, later ones included, so a backend that kept a padding position, or
    let a query see one, would give other numbers than the full forward.
    """
    index = chunk_index(consumed, num_new, x.shape[1])
    return np.take_along_axis(x, index[..., None], axis=1)


def chunk_index(consumed: np.ndarray, num_new: int, length: int) -> np.ndarray:
    """The positions ``(B, T)`` of one call's rows (:func:`chunk_rows`): ``consumed[b] +
    t`` modulo ``length``."""
    return (consumed[:, None] + np.arange(num_new)) % length


def decode(
    step: Step, inputs: Mapping[str, np.ndarray], lengths: np.ndarray, chunks: Sequence[Chunk]
) -> np.ndarray:
    """Runs a schedule and gathers the outputs at the real positions.

    Args:
        step: one cached call (see :data:`Step`).
        inputs: the full ``queries``, ``keys`` and ``values``, ``(B, N, ·)``.
        lengths: ``(B,)`` real positions of each sequence.
        chunks: the schedule; its new lengths sum to ``lengths``.

    Returns:
        ``(B, N, num_hiddens)`` outputs, each at its absolute position, and 0
        at positions past ``lengths``.
    """
    lengths = np.asarray(lengths, np.int64)
    consumed = np.zeros_like(lengths)
    outputs: np.ndarray | None = None
    for num_new, new_lens in chunks:
        new = np.asarray(new_lens, np.int64)
        rows = [chunk_rows(inputs[name], consumed, num_new) for name in INPUT_NAMES]
        output = np.asarray(step(*rows, new.astype(np.int32)), np.float64)
        if outputs is None:
            batch, length = inputs["queries"].shape[:2]
            outputs = np.zeros((batch, length, output.shape[-1]))
        for b in range(len(new)):
            outputs[b, consumed[b] : consumed[b] + new[b]] = output[b, : new[b]]
        consumed += new
    if not np.array_equal(consumed, lengths):
        raise ValueError(f"the schedule appends {consumed.tolist()}, not {lengths.tolist()}")
    assert outputs is not None, "a schedule has at least one call"
    return outputs


def full_reference(
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    lengths: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    **options: Any,
) -> np.ndarray:
    """What every schedule gives: one causal float64 forward with ``valid_lens=lengths``.

    Positions past ``lengths`` are 0, as :func:`decode` leaves them.
    ``options`` are the layer's positions and biases options: a cached
    query ``i`` sits at ``lengths[b] + i``, which the schedule makes the
    position of the same row in the one forward.
    """
    output, _ = spec.reference_forward(
        weights,
        *(inputs[name] for name in INPUT_NAMES),
        np.asarray(lengths),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        causal=True,
        **options,
    )
    real = np.arange(output.shape[1]) < np.asarray(lengths)[:, None]
    return np.where(real[..., None], output, 0.0)


def full_reference_gradients(
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    lengths: np.ndarray,
    output_gradient: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
) -> dict[str, np.ndarray]:
    """What every schedule's gradients are: those of :func:`full_reference`'s one causal
    float64 forward (:func:`mha_multi.spec.reference_gradients`), of ``sum(output *
    output_gradient)``, keyed as it keys them."""
    return spec.reference_gradients(
        weights,
        *(inputs[name] for name in INPUT_NAMES),
        np.asarray(lengths),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        causal=True,
        output_gradient=output_gradient,
    )


def reference_decode(
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    lengths: np.ndarray,
    chunks: Sequence[Chunk],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    max_length: int,
) -> np.ndarray:
    """:func:`decode` through :func:`mha_multi.spec.reference_cached_forward`."""
    heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=num_kv_heads)
    shape = spec.cache_shape(len(lengths), max_length, heads)
    cache = spec.KVCache(np.zeros(shape), np.zeros(shape), np.zeros(len(lengths), np.int32))

    def step(queries: Any, keys: Any, values: Any, new_lens: np.ndarray) -> np.ndarray:
        nonlocal cache
        output, _, cache = spec.reference_cached_forward(
            weights,
            queries,
            keys,
            values,
            cache,
            new_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            causal=True,
        )
        return output

    return decode(step, inputs, lengths, chunks)


def random_schedule(
    rng: np.random.Generator, lengths: np.ndarray, *, max_chunk: int = 3
) -> list[Chunk]:
    """A random split of ragged sequences into calls.

    A padded prefill of random length (an example may append nothing, or
    less than the call's length), then chunks of 1 to ``max_chunk``
    positions, each example appending a random share of what it has left.
    Unless the prefill takes everything, some call has length 1.
    """
    remaining = np.asarray(lengths, np.int64).copy()
    longest = int(remaining.max(initial=0))
    num_new = int(rng.integers(1, longest + 1)) if longest else 1
    chunks: list[Chunk] = []
    while True:
        new = np.minimum(remaining, rng.integers(0, num_new + 1, size=len(remaining)))
        if remaining.sum() and not new.sum():
            new[int(remaining.argmax())] = min(num_new, int(remaining.max()))
        chunks.append((num_new, new.astype(int).tolist()))
        remaining -= new
        if not remaining.sum():
            return chunks
        single = any(size == 1 for size, _ in chunks[1:])
        if not single and remaining.max() <= max_chunk:
            num_new = 1
        else:
            num_new = int(rng.integers(1, max_chunk + 1))
