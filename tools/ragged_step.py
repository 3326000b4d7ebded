"""A ragged batch's eager PyTorch decoding step against the hand-written loop, on the CPU.

A batch of 8 prompts of different lengths (256 down to 217 tokens, the
bench's generation shape otherwise: 512 hiddens, 8 query heads) decodes one
token per step, each example at its own position (docs: "Generating with a
cache"). Three decoders take turns of 40 steps in one process: the layer
with its cache (a ragged step's route, docs: "Fast paths"), the same layer
through the generic flow alone (the route turned off), and the loop a
careful user writes for a ragged batch (three products, rows written at each
example's position by advanced indexing, SDPA over the positions up to the
longest with the lengths' mask, the output product; a rotary layer's rows of
its tables picked by position). The median turn's time per step is printed
in microseconds, with the ratio ours / hand-written in speed (above 1 when
ours is faster), the largest difference between ours and the loop's
outputs, and the Python function calls per step (cProfile) of the route and
of the generic flow. ``cuda``: on a GPU (the route's generic path, which reads
nothing; each turn ends with a synchronisation). ``window``: the layer's window
holds every position of the cache (Mistral's and Gemma 3's local layers while a
context is shorter than their window: it hides nothing, and the loop is the
same). ``sliding``: a window of 128 positions, which hides keys at every
step (gpt-oss's; Mistral's and Gemma 3's past theirs), the loop's mask the
window's too. ``softcap``: the layer soft-caps its scores at 50 (Gemma 2's),
and ``sinks``: the layer's sink logits join each head's softmax (gpt-oss's):
no kernel takes either, so ours takes the generic path's attention and the
loop writes its attention out (each key/value head's query heads as its
queries: the scores, ``50 * tanh(scores / 50)``, the mask, the softmax with
the sinks' column and its product with the values). ``alibi``: ALiBi's bias
(BLOOM's), which the loop gives SDPA as its float mask.

    python tools/ragged_step.py [num_kv_heads] [rounds] [rotary] [window] [sliding]
        [softcap] [sinks] [alibi] [cuda]
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.nn import functional
from turns import compare

from mha_multi.parity.harness import torch as backend
from mha_multi.spec import alibi_slopes
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

BATCH, HIDDENS, HEADS, PROMPT, MAX_LENGTH, TURN = 8, 512, 8, 256, 1024, 40
DEVICE = torch.device("cuda" if "cuda" in sys.argv[1:] else "cpu")
HEAD_DIM = HIDDENS // HEADS
ROTARY = {"theta": 10000.0}
SOFTCAP = 50.0
SLIDING = 128
FLAGS = ("rotary", "window", "sliding", "softcap", "sinks", "alibi", "cuda")


def prompt_lengths() -> torch.Tensor:
    return torch.tensor([PROMPT - (7 * b) % 40 for b in range(BATCH)], device=DEVICE)


def layer_steps(layer: MultiHeadAttention, prompt: torch.Tensor, token: torch.Tensor):
    """A step function of the layer after its prompt."""
    with torch.inference_mode():
        _, cache = layer(
            prompt,
            prompt,
            prompt,
            prompt_lengths(),
            causal=True,
            cache=layer.init_cache(BATCH, MAX_LENGTH),
        )
    held = [cache]

    def step() -> torch.Tensor:
        with torch.inference_mode():
            output, held[0] = layer(token, token, token, causal=True, cache=held[0])
        return output

    return step


def written_attention(
    q: torch.Tensor,
    attended: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    *,
    softcap: bool,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one query per head over the ``attended`` keys and values written out,
    for what no kernel takes (Gemma 2's ``softcap`` of the scores, gpt-oss's ``sinks``):
    each key/value head's query heads as its queries, no copy of the keys and values for
    grouped heads."""
    keys, values = attended
    batch, num_heads = q.shape[:2]
    grouped = q.reshape(batch, keys.shape[1], -1, HEAD_DIM)
    scores = grouped @ keys.transpose(-1, -2) / HEAD_DIM**0.5
    if softcap:
        scores = torch.tanh(scores / SOFTCAP) * SOFTCAP
    scores = scores.masked_fill(~mask, -1e6)
    if sinks is None:
        weights = torch.softmax(scores, -1)
    else:  # (each head's logit a column of its own, dropped after the softmax)
        column = sinks.view(1, keys.shape[1], -1, 1).expand(batch, -1, -1, 1)
        weights = torch.softmax(torch.cat((scores, column), -1), -1)[..., :-1]
    return (weights @ values).reshape(batch, num_heads, 1, HEAD_DIM)


def hand_steps(
    weights: dict,
    kv_heads: int,
    options: dict,
    sinks: torch.Tensor | None,
    prompt: torch.Tensor,
    token: torch.Tensor,
):
    """The hand-written loop's step function after its prompt (the layer's weights and
    ``options``, its ``sinks`` logits)."""
    rotary, softcap = "rotary" in options, "softcap" in options
    window = options.get("window", MAX_LENGTH)
    slopes = None
    if options.get("alibi"):  # (the layer's slopes, (H, 1, 1))
        slopes = torch.from_numpy(alibi_slopes(HEADS)).float().to(DEVICE).view(HEADS, 1, 1)
    w_q, w_k, w_v, w_o = (
        torch.from_numpy(weights[n]).float().T.to(DEVICE) for n in ("W_q", "W_k", "W_v", "W_o")
    )
    keys = torch.zeros(BATCH, kv_heads, MAX_LENGTH, HEAD_DIM, device=DEVICE)
    values = torch.zeros_like(keys)
    examples = torch.arange(BATCH, device=DEVICE)
    key_positions = torch.arange(MAX_LENGTH, device=DEVICE)
    inverse = 1.0 / (
        ROTARY["theta"] ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    )
    angles = torch.arange(MAX_LENGTH).float()[:, None] * inverse.float()
    angles = torch.cat([angles, angles], -1).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()

    def project(x: torch.Tensor):
        length = x.shape[1]
        q, k, v = (
            functional.linear(x, w).view(BATCH, length, n, HEAD_DIM).transpose(1, 2)
            for w, n in ((w_q, HEADS), (w_k, kv_heads), (w_v, kv_heads))
        )
        return q, k, v

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        half = HEAD_DIM // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s

    lengths = prompt_lengths()
    with torch.inference_mode():
        _, k, v = project(prompt)
        if rotary:
            k = rotate(k, cos[:PROMPT], sin[:PROMPT])
        keys[:, :, :PROMPT], values[:, :, :PROMPT] = k, v
    longest = [int(lengths.max())]

    def step() -> torch.Tensor:
        with torch.inference_mode():
            q, k, v = project(token)
            if rotary:
                c, s = cos[lengths].view(BATCH, 1, 1, -1), sin[lengths].view(BATCH, 1, 1, -1)
                q, k = rotate(q, c, s), rotate(k, c, s)
            keys[examples, :, lengths] = k.squeeze(2)
            values[examples, :, lengths] = v.squeeze(2)
            end = longest[0] + 1
            seen = key_positions[:end]
            mask = (seen <= lengths[:, None]) & (seen > lengths[:, None] - window)
            mask = mask.view(BATCH, 1, 1, end)
            if slopes is not None:  # (ALiBi's bias, slope * (j - position), where seen)
                distance = (seen - lengths[:, None]).view(BATCH, 1, 1, end)
                mask = torch.where(mask, slopes * distance, float("-inf"))
            if softcap or sinks is not None:
                attended = keys[:, :, :end], values[:, :, :end]
                context = written_attention(q, attended, mask, softcap=softcap, sinks=sinks)
            else:
                context = functional.scaled_dot_product_attention(
                    q,
                    keys[:, :, :end],
                    values[:, :, :end],
                    attn_mask=mask,
                    enable_gqa=kv_heads != HEADS,
                )
            lengths.add_(1)
            longest[0] += 1
            return functional.linear(context.transpose(1, 2).reshape(BATCH, 1, HIDDENS), w_o)

    return step


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    arguments = [a for a in sys.argv[1:] if a not in FLAGS]
    kv_heads = int(arguments[0]) if arguments else 2
    rounds = int(arguments[1]) if len(arguments) > 1 else 12
    flags = {flag for flag in FLAGS if flag in sys.argv[1:]}
    torch.manual_seed(0)
    weights = init_weights(HIDDENS, seed=0, num_heads=HEADS, num_kv_heads=kv_heads)
    options = {
        **({"rotary": ROTARY} if "rotary" in flags else {}),
        **({"window": MAX_LENGTH} if "window" in flags else {}),
        **({"window": SLIDING} if "sliding" in flags else {}),
        **({"softcap": SOFTCAP} if "softcap" in flags else {}),
        **({"sinks": True} if "sinks" in flags else {}),
        **({"alibi": True} if "alibi" in flags else {}),
    }
    if "sinks" in flags:
        weights["sinks"] = np.random.default_rng(0).standard_normal(HEADS).astype(np.float32)
    layer = MultiHeadAttention(HIDDENS, HEADS, num_kv_heads=kv_heads, **options)
    layer = set_weights(layer.to(DEVICE), weights).eval()
    sinks = layer.sink_logits().detach() if "sinks" in flags else None
    prompt = torch.randn(BATCH, PROMPT, HIDDENS, device=DEVICE)
    token = torch.randn(BATCH, 1, HIDDENS, device=DEVICE)

    generic = backend.generic_flow_only  # (the route answering no call)

    ours, theirs = (
        layer_steps(layer, prompt, token),
        hand_steps(weights, kv_heads, options, sinks, prompt, token),
    )
    difference = max(float((ours() - theirs()).abs().max()) for _ in range(TURN))
    compare(
        lambda: layer_steps(layer, prompt, token),
        lambda: hand_steps(weights, kv_heads, options, sinks, prompt, token),
        generic=generic,
        difference=difference,
        rounds=rounds,
        turn=TURN,
        done=lambda _: sync(),
    )


if __name__ == "__main__":
    main()
