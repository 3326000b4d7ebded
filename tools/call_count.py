"""Python function calls per call of the PyTorch layer, counted by cProfile.

A call's fixed cost on the host is its Python: the checks, the plan and the
flow around the kernels. cProfile counts every function it enters (builtins
included), the same count on any machine for the same code and inputs, so a
change that adds host work shows here before any timer sees it (docs:
"Results"). Each row runs 100 calls after 3 that warm every memo.

    python tools/call_count.py

``python -m mha_multi.bench run --only calls <backend>`` counts the benchmark's
rows the same way, in every framework. The rows of layers with options (2
query heads, 1 key/value head; a one-token call under ``no_grad`` and in
``train()`` mode recording gradients, and a decoding step) follow;
``--generic`` counts every row through the generic flow, the fast route
turned off (docs: "Fast paths"); ``--gpu`` counts the route a GPU's calls
take, on the CPU told its tensors are on a GPU.

    python tools/call_count.py [--generic] [--gpu]
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch

from mha_multi.bench import host
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

CALLS = 100
HIDDENS, HEADS = 16, 2
NORMS = ("q_norm", "k_norm")


#: Layers of today's families, by their options (rotary, window, cap, sinks, norms).
ROTARY = {"theta": 10000.0}
OPTIONS: dict[str, dict[str, object]] = {
    "window": {"window": 8},
    "soft cap": {"softcap": 30.0},
    "ALiBi": {"alibi": True},
    "rotary, window": {"rotary": ROTARY, "window": 8},
    "rotary, norms (Qwen 3)": {"rotary": ROTARY, "qk_norm": {}},
    "rotary, window, sinks (gpt-oss)": {"rotary": ROTARY, "window": 8, "sinks": True},
    "rotary, window, soft cap (Gemma 2)": {"rotary": ROTARY, "window": 8, "softcap": 50.0},
    "rotary, window, norms (Gemma 3)": {
        "rotary": ROTARY,
        "window": 8,
        "qk_norm": {"unit_offset": True},
    },
}


def layer(**options: object) -> MultiHeadAttention:
    made = MultiHeadAttention(HIDDENS, HEADS, **options)
    weights = init_weights(
        HIDDENS,
        seed=0,
        num_heads=HEADS,
        num_kv_heads=options.get("num_kv_heads"),  # type: ignore[arg-type]
        sinks=bool(options.get("sinks")),
    )
    if options.get("qk_norm") is not None:  # (the norms' weights as the layer starts them)
        weights.update({name: getattr(made, name).detach().numpy() for name in NORMS})
    set_weights(made, weights)
    return made


def counted(step: Callable[[], object]) -> float:
    """Function calls per ``step``, over :data:`CALLS` of them after three."""
    return host.counted(step, CALLS)


def rows() -> dict[str, Callable[[], object]]:
    token = torch.randn(1, 1, HIDDENS)
    plain_eval = layer().eval()
    plain_train = layer().train()
    rotary = layer(num_kv_heads=1, rotary=ROTARY).eval()
    rotary_train = layer(num_kv_heads=1, rotary=ROTARY).train()

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

    lengths = torch.tensor([1])

    def with_lengths() -> object:
        with torch.no_grad():
            return plain_eval(token, token, token, lengths)

    counted_rows = {
        "one token, eval, no_grad": no_grad(plain_eval),
        "one token, lengths, no_grad": with_lengths,
        "one token, lengths, training": lambda: plain_train(token, token, token, lengths),
        "one token over 4 keys, lengths, no_grad": cross,
        "one token, training": lambda: plain_train(token, token, token),
        "decoding step": decode(layer().eval()),
        "one token, rotary 2/1 heads, no_grad": no_grad(rotary),
        "one token, rotary 2/1 heads, training": lambda: rotary_train(token, token, token),
        "decoding step, rotary 2/1 heads": decode(rotary),
    }
    for name, options in OPTIONS.items():
        made = layer(num_kv_heads=1, **options).eval()
        training = layer(num_kv_heads=1, **options).train()
        counted_rows[f"one token, {name}"] = no_grad(made)
        counted_rows[f"one token, {name}, training"] = lambda made=training: made(
            token, token, token
        )
        counted_rows[f"decoding step, {name}"] = decode(made)
    return counted_rows


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    # (The route's offers declined by a plain function, one call as the route's own
    # first test is: every call takes the generic flow.)
    generic = "--generic" in argv
    declined = backend.generic_flow_only() if generic else contextlib.nullcontext()
    on_a_gpu = backend.as_if_on_a_gpu() if "--gpu" in argv else contextlib.nullcontext()
    with declined, on_a_gpu:
        for name, step in rows().items():
            print(f"{name:60s} {counted(step):7.1f} calls per call")


if __name__ == "__main__":
    main(sys.argv[1:])
