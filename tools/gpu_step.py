"""The host's time of an eager PyTorch decoding step where the tensors live on a GPU.

A decoding step of a small batch on a GPU takes the host's time: the
kernels run while the host queues the next ones. Three decoders of the
bench's generation (``mha_multi.bench``'s generators) take turns of 16
steps: the layer with a cache (on a GPU its plain route runs the generic
path's attention and reads nothing, docs: "Fast paths"), the same layer with
that route refused (the generic flow: every check at every step), and the
bench's hand-written decoder. Each prints its median time per step over the
rounds, in microseconds.

On the CPU the PyTorch facts are told that every tensor is on a GPU
(``mha_multi.parity.harness.torch.as_if_on_a_gpu``), so the layer runs the
operations it would run there, on the CPU's kernels: with a
tiny layer, whose kernels cost next to nothing, what remains is the host's
cost of a GPU step (docs: "Results"). ``host`` runs the same on the CPU as
it is: the route's CPU step (SDPA after its one finiteness read).

    python tools/gpu_step.py [cpu|gpu|host] [batch hiddens heads kv_heads]   # cpu 1 16 2 2
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from unittest import mock

import torch

from mha_multi.bench import generate
from mha_multi.bench.torch import FRAMEWORK
from mha_multi.parity.harness import torch as harness
from mha_multi.torch import _facts

PROMPT, NEW_TOKENS, ROUNDS = 8, 256, 5


def refusable(stack: contextlib.ExitStack) -> list[bool]:
    """A flag that, while true, has the plain route refuse every call (a patch entered
    once: entering one at every step would cost more than a step)."""
    refusing = [False]
    route, step = _facts.FACTS.plain_attention, _facts.FACTS.plain_step

    def plain_attention(*args, **kwargs):
        return None if refusing[0] else route(*args, **kwargs)

    def plain_step(*args, **kwargs):
        return None if refusing[0] else step(*args, **kwargs)

    stack.enter_context(mock.patch.object(_facts.FACTS, "plain_attention", plain_attention))
    stack.enter_context(mock.patch.object(_facts.FACTS, "plain_step", plain_step))
    return refusing


def refused(make: generate.Generator, refusing: list[bool]) -> generate.Generator:
    """``make``'s decoder with the plain route refused at every step."""

    def step(state, token):
        refusing[0] = True
        try:
            return make.step(state, token)
        finally:
            refusing[0] = False

    return generate.Generator(make.prefill, step, make.sync, make.to_numpy)


def main(device: str = "cpu", batch: int = 1, hiddens: int = 16, heads: int = 2, kv: int = 2):
    shape = generate.GenerationShape(batch, PROMPT, NEW_TOKENS, hiddens, heads, kv)
    mode, as_if_on_a_gpu = device, device == "cpu"
    if device != "gpu":
        device = "cpu"
        torch.set_num_threads(1)  # the host's cost, not the kernels'
    prompt = FRAMEWORK.array(
        torch.randn(batch, PROMPT, hiddens, generator=torch.Generator().manual_seed(0)).numpy(),
        device,
        "float32",
    )
    with contextlib.ExitStack() as stack:
        if as_if_on_a_gpu:
            stack.enter_context(harness.as_if_on_a_gpu())
        refusing = refusable(stack)
        makers = FRAMEWORK.generators(shape, device, "float32")
        ways = {
            "route": lambda: makers["cached"](),
            "generic flow": lambda: refused(makers["cached"](), refusing),
            "hand-written": lambda: makers["hand-written"](),
        }
        for make in ways.values():
            generate.generate(make(), prompt, 4)  # kernels loaded
        steps: dict[str, list[float]] = {name: [] for name in ways}
        outputs = {}
        for _ in range(ROUNDS):
            timed = generate.generate_in_turns(
                {name: make() for name, make in ways.items()}, prompt, NEW_TOKENS
            )
            for name, (_, seconds, output) in timed.items():
                steps[name].append(seconds / NEW_TOKENS * 1e6)
                outputs[name] = output
    print(f"{mode}, {shape}, median of {ROUNDS} generations in turns")
    hand = statistics.median(steps["hand-written"])
    for name, times in steps.items():
        median = statistics.median(times)
        differs = abs(outputs[name] - outputs["route"]).max()
        print(
            f"{name:>13}: {median:8.1f} us a step, {hand / median:.2f}x the hand-written"
            f" speed; largest difference from the route {differs:.1e}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(arg) for arg in sys.argv[2:6]))
