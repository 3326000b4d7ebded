"""Python function calls per call of the PyTorch layer, counted by cProfile.

A call's fixed cost on the host is its Python: the checks, the plan and the
flow around the kernels. cProfile counts every function it enters (builtins
included), the same count on any machine for the same code and inputs, so a
change that adds host work shows here before any timer sees it (docs:
"Results"). Each row runs 100 calls after 3 that warm every memo.

    python tools/call_count.py

``python -m mha_multi.bench run --only calls <backend>`` counts the benchmark's
rows the same way, in every framework.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mha_multi.bench import host
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

CALLS = 100
HIDDENS, HEADS = 16, 2


def layer(**options: object) -> MultiHeadAttention:
    made = MultiHeadAttention(HIDDENS, HEADS, **options)
    set_weights(
        made,
        init_weights(
            HIDDENS,
            seed=0,
            num_heads=HEADS,
            num_kv_heads=options.get("num_kv_heads"),  # type: ignore[arg-type]
        ),
    )
    return made


def counted(step: Callable[[], object]) -> float:
    """Function calls per ``step``, over :data:`CALLS` of them after three."""
    return host.counted(step, CALLS)


def rows() -> dict[str, Callable[[], object]]:
    token = torch.randn(1, 1, HIDDENS)
    plain_eval = layer().eval()
    plain_train = layer().train()
    rotary = layer(num_kv_heads=1, rotary={"theta": 10000.0}).eval()

    def no_grad(made: MultiHeadAttention) -> Callable[[], object]:
        def step() -> object:
            with torch.no_grad():
                return made(token, token, token)

        return step

    def decode(made: MultiHeadAttention) -> Callable[[], object]:
        with torch.no_grad():
            _, cache = made(token, token, token, causal=True, cache=made.init_cache(1, 4096))
        held = [cache]

        def step() -> object:
            with torch.no_grad():
                out, held[0] = made(token, token, token, causal=True, cache=held[0])
            return out

        return step

    memory = torch.randn(1, 4, HIDDENS)

    def cross() -> object:
        with torch.no_grad():
            return plain_eval(token, memory, memory, torch.tensor([3]))

    return {
        "one token, eval, no_grad": no_grad(plain_eval),
        "one token over 4 keys, lengths, no_grad": cross,
        "one token, training": lambda: plain_train(token, token, token),
        "decoding step": decode(layer().eval()),
        "one token, rotary 2/1 heads, no_grad": no_grad(rotary),
        "decoding step, rotary 2/1 heads": decode(rotary),
    }


def main() -> None:
    torch.set_num_threads(1)
    for name, step in rows().items():
        print(f"{name:40s} {counted(step):7.1f} calls per call")


if __name__ == "__main__":
    main()
