"""The packed row: tokens per second of forward+backward over long-tailed lengths, packed, padded.

A batch of sequences whose lengths follow a long tail (most short, a few
near the longest) is trained on two ways (docs: "Packed sequences"):
*padded*, one sequence a row up to the longest with ``valid_lens``, and
*packed*, the sequences laid one after another into as few rows of the same
length as first-fit-decreasing finds, with ``segment_ids``. Both are causal
self-attention with rotary positions (restarting at each sequence when
packed), and compute the same numbers at the real positions; the row reports
the real tokens per second of each and their ratio.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mha_multi import spec
from mha_multi.bench.common import Measurement, Shape, median_seconds
from mha_multi.bench.framework import Framework

__all__ = ["PackedBatch", "long_tailed_lengths", "pack", "time_packed"]

#: The rotary positions of both ways (Llama's base).
ROTARY = {"theta": 10000.0}


def long_tailed_lengths(count: int, longest: int, *, seed: int = 0) -> list[int]:
    """``count`` sequence lengths in ``[1, longest]`` with a long tail.

    Log-normal around an eighth of ``longest``, clipped; the longest length
    is always drawn once, so padding reaches it. Most padded positions are
    then empty (about three quarters).
    """
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(mean=np.log(longest / 8), sigma=0.8, size=count)
    lengths = np.clip(np.round(drawn), 1, longest).astype(int)
    lengths[0] = longest
    return lengths.tolist()


def pack(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """The lengths laid into rows of ``row_length`` positions, first fit, longest first.

    Raises:
        ValueError: a length longer than a row.
    """
    rows: list[list[int]] = []
    free: list[int] = []
    for length in sorted(lengths, reverse=True):
        if length > row_length:
            raise ValueError(f"a sequence of {length} positions does not fit rows of {row_length}")
        row = next((i for i, room in enumerate(free) if room >= length), None)
        if row is None:
            rows.append([])
            free.append(row_length)
            row = len(rows) - 1
        rows[row].append(length)
        free[row] -= length
    return rows


@dataclass(frozen=True)
class PackedBatch:
    """The two layouts of one batch of sequences of ``lengths``, rows of ``row_length``."""

    lengths: tuple[int, ...]
    row_length: int

    @property
    def rows(self) -> list[list[int]]:
        return pack(self.lengths, self.row_length)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def empty_share(self) -> float:
        """The share of the padded layout's positions that hold no token."""
        return 1.0 - self.tokens / (len(self.lengths) * self.row_length)

    def segment_ids(self) -> np.ndarray:
        """The packed rows' ``segment_ids`` (:func:`mha_multi.spec.segment_ids_from_lengths`)."""
        return spec.segment_ids_from_lengths(self.rows, self.row_length)


def time_packed(
    framework: Framework,
    device: str,
    dtype: str,
    *,
    count: int = 32,
    base: Shape | None = None,
) -> list[Measurement]:
    """The packed row: ours padded and ours packed, forward+backward, tokens per second.

    Args:
        framework: the framework benchmarked.
        device, dtype: where and in what.
        count: the sequences of the batch, of :func:`long_tailed_lengths`
            up to ``base.length``.
        base: the width and heads (its batch is not read).
    """
    base = base or Shape()
    batch = PackedBatch(tuple(long_tailed_lengths(count, base.length)), base.length)
    layer = framework.ours(base, device, dtype, rotary=ROTARY)
    rng = np.random.default_rng(1)
    label = framework.label(framework.executions[0])
    layouts = {
        "padded": (count, np.asarray(batch.lengths, np.int32), None),
        "packed": (len(batch.rows), None, batch.segment_ids()),
    }
    rows = []
    for name, (num_rows, lens, ids) in layouts.items():
        x = rng.standard_normal((num_rows, base.length, base.num_hiddens)).astype(np.float32)
        native = framework.array(x, device, dtype)
        given = (
            {} if ids is None else {"segment_ids": framework.backend.lens_to_native(ids, device)}
        )
        native_lens = None if lens is None else framework.backend.lens_to_native(lens, device)
        gradient = framework.array(np.ones_like(x) / x.size, device, dtype)

        def step(native=native, native_lens=native_lens, given=given, gradient=gradient) -> None:
            grads = framework.backend.vjp(
                layer,
                native,
                native,
                native,
                native_lens,
                causal=True,
                output_gradient=gradient,
                **given,
            )
            framework.sync(grads["queries"])

        row = Measurement(
            label,
            f"ours, {name}",
            "packed forward+backward",
            device,
            dtype,
            base.length,
            note=(
                f"{count} sequences, {batch.tokens} tokens; {num_rows} rows; "
                f"{100 * batch.empty_share:.0f}% of padded positions empty"
            ),
            shape={**vars(base), "batch": num_rows},
        )
        try:
            seconds = median_seconds(step, repeats=5)
        except Exception as error:  # e.g. a compiler that cannot take the layer
            print(f"[bench] packed row, {name}: {error}", flush=True)
            rows.append(Measurement(**{**row.as_dict(), "note": f"failed: {type(error).__name__}"}))
            continue
        rows.append(
            Measurement(
                **{**row.as_dict(), "seconds": seconds, "tokens_per_s": batch.tokens / seconds}
            )
        )
        gc.collect()
    return rows
