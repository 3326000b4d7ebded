"""Host time of a PyTorch call on the fast route against the generic flow, in turns.

The same layer and inputs, the route refused by a patch on every other call
(docs: "Fast paths"): each pair of calls meets the same moment of a shared
machine, and the median of the pairs' differences is what the route saves.
One thread, under ``torch.inference_mode``; self-attention of one example of
``N`` positions and ``D`` hiddens (8 heads from 64 hiddens on, else 2), with
lengths (``valid_lens``, all of them) or without; ``--keys K``: attention to
``K`` positions of their own (keys that are the values, cross-attention's
route), its lengths ``K``. ``--gpu``: on the route a GPU's call takes, on the
CPU (the facts told that every tensor is on a GPU: nothing read), whose host
time is a GPU's call's.

    python tools/route_time.py D N [--lengths] [--keys K] [--gpu] [--pairs P]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, _facts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hiddens", type=int)
    parser.add_argument("positions", type=int)
    parser.add_argument("--lengths", action="store_true")
    parser.add_argument("--keys", type=int, default=None)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--pairs", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layer = MultiHeadAttention(args.hiddens, 8 if args.hiddens >= 64 else 2).eval()
    x = torch.randn(1, args.positions, args.hiddens)
    if args.keys is None:
        memory, name = x, "plain_attention"
    else:
        memory, name = torch.randn(1, args.keys, args.hiddens), "cross_attention"
    lengths = torch.tensor([memory.shape[1]]) if args.lengths else None
    route = getattr(_facts.FACTS, name)
    refused = [False]

    def offered(*given: object, **named: object) -> object:
        return None if refused[0] else route(*given, **named)

    times: dict[bool, list[int]] = {False: [], True: []}
    on_a_gpu = backend.as_if_on_a_gpu() if args.gpu else contextlib.nullcontext()
    with (
        mock.patch.object(_facts.FACTS, name, offered),
        on_a_gpu,
        torch.inference_mode(),
    ):
        for _ in range(20):
            layer(x, memory, memory, lengths)
        for pair in range(args.pairs):
            for generic in (pair % 2 == 0, pair % 2 == 1):  # (who goes first alternates)
                refused[0] = generic
                start = time.perf_counter_ns()
                layer(x, memory, memory, lengths)
                times[generic].append(time.perf_counter_ns() - start)
    saved = statistics.median(g - r for r, g in zip(times[False], times[True], strict=True))
    ours, generic = (statistics.median(times[k]) / 1e3 for k in (False, True))
    print(
        f"D={args.hiddens} N={args.positions} keys={memory.shape[1]} lengths={args.lengths} "
        f"gpu={args.gpu}: "
        f"route {ours:.0f} us, "
        f"generic flow {generic:.0f} us, median saving {saved / 1e3:.1f} us per call"
    )


if __name__ == "__main__":
    main()
