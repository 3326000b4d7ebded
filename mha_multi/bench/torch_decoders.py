"""PyTorch's hand-written static-cache decoder, the generation rows' anchor: eager and compiled.

What a careful user writes by hand for the weights of ours (docs:
"Generating with a cache"): a static cache of ``(B, H_kv, max_length,
head_dim)``; with rotary positions (a Llama-shaped layer), cosine and sine
tables made once for every position (:func:`~mha_multi.bench.generate.rotary_angles`)
and the queries and keys rotated, ``q * cos + rotate_half(q) * sin``, before
the keys enter the cache.

* eager: the cache written in place, ``scaled_dot_product_attention`` over
  its filled positions (``enable_gqa`` for grouped heads);
* ``compiled``: one step under ``torch.compile(fullgraph=True,
  dynamic=False)`` (``mode="reduce-overhead"`` on a GPU), as ours is
  compiled: static shapes, the position a tensor, the new rows written into
  the cache in place (``index_copy_``, as ours writes a compiled call's
  rows: CUDA-graph safe) and attention over all ``max_length`` positions
  with a mask; the prompt and the steps are two graphs. ``in_place=False``
  updates the cache functionally (``index_copy``, a new cache each step),
  the anchor's form before ours wrote in place.

:func:`hand_written_call` is the same projections and rotation for one call
without a cache: the anchor of the host rows (:mod:`mha_multi.bench.host`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from mha_multi.bench.generate import GenerationShape, Generator, rotary_angles
from mha_multi.parity.harness import torch as backend

__all__ = ["compiled", "forget_compiled", "hand_written_call", "hand_written_decoder"]


def compiled(function: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``function`` compiled as the generation rows compile ours and the hand-written
    step: one graph, static shapes, CUDA graphs on a GPU.

    Under CUDA graphs a replay writes its outputs where the previous one did:
    each call marks a new step and returns its first output (the token) copied.
    """
    if device != "gpu":
        return torch.compile(function, fullgraph=True, dynamic=False)
    graphed = torch.compile(function, fullgraph=True, dynamic=False, mode="reduce-overhead")

    def call(*args: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        first, *rest = graphed(*args)
        return (first.clone(), *rest)

    return call


def forget_compiled() -> None:
    """Forgets every compiled graph, ours and the hand-written step's.

    Dynamo counts a configuration's graphs against its limit of
    recompilations of one function: each configuration starts afresh.
    """
    torch._dynamo.reset()
    _compiled_attend.cache_clear()


#: Canonical weights, as numpy arrays.
Arrays = dict[str, np.ndarray]
Weights = dict[str, torch.Tensor]
Tables = tuple[torch.Tensor, torch.Tensor] | None


def _weights(weights: Arrays, device: str, dtype: str) -> Weights:
    """The projections' weights as ``nn.functional.linear`` takes them."""
    return {
        name: backend.to_native(np.ascontiguousarray(weights[name].T), device, dtype)
        for name in ("W_q", "W_k", "W_v", "W_o")
    }


def _tables(shape: GenerationShape, device: str, dtype: str) -> Tables:
    """The cosines and sines of every position, ``(max_length, head_dim)``, or ``None``."""
    angles = rotary_angles(shape)
    if angles is None:
        return None
    # Once for every position, in float32, then in the inputs' dtype.
    angles = torch.from_numpy(angles).to(backend.device(device))
    cos, sin = (table.to(backend.DTYPES[dtype]) for table in (angles.cos(), angles.sin()))
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``: entry ``i`` paired with ``i + head_dim / 2``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _project(
    x: torch.Tensor, at: slice | torch.Tensor, w: Weights, tables: Tables, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values of ``x`` at positions ``at``, ``(B, H, T, head_dim)``,
    the queries and keys rotated where there are ``tables``."""
    batch, length, _ = x.shape
    head_dim = w["W_q"].shape[0] // heads

    def split(name: str, count: int) -> torch.Tensor:
        projected = nn.functional.linear(x, w[name])
        return projected.view(batch, length, count, head_dim).transpose(1, 2)

    q, k, v = split("W_q", heads), split("W_k", kv_heads), split("W_v", kv_heads)
    if tables is not None:
        cos, sin = (table[at] for table in tables)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return q, k, v


def _output(context: torch.Tensor, w: Weights) -> torch.Tensor:
    return nn.functional.linear(context.transpose(1, 2).flatten(2), w["W_o"])


def hand_written_call(
    weights: Arrays, shape: GenerationShape, device: str, dtype: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``call(x)``: causal self-attention of ``x`` at positions ``0..T-1``, no cache,
    under ``torch.inference_mode``."""
    w, tables = _weights(weights, device, dtype), _tables(shape, device, dtype)
    heads, kv_heads = shape.num_heads, shape.kv_heads

    @torch.inference_mode()
    def call(x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        q, k, v = _project(x, slice(0, length), w, tables, heads, kv_heads)
        context = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=length > 1, enable_gqa=kv_heads != heads
        )
        return _output(context, w)

    return call


def hand_written_decoder(
    weights: Arrays,
    shape: GenerationShape,
    device: str,
    dtype: str,
    execution: str | None = None,
    *,
    in_place: bool = True,
) -> Generator:
    """The hand-written decoder of ``shape`` (rotary where it has rotary positions),
    eager or, for ``execution == "compiled"``, compiled (the cache written in place,
    or functionally where not ``in_place``)."""
    w, tables = _weights(weights, device, dtype), _tables(shape, device, dtype)
    heads, kv_heads = shape.num_heads, shape.kv_heads
    size = (shape.batch, kv_heads, shape.max_length, shape.num_hiddens // heads)
    if execution == "compiled":
        attend = _compiled_attend(heads, kv_heads, device, in_place)
        return _compiled_decoder(attend, w, tables, shape, size)
    cache = {}

    @torch.inference_mode()
    def attend(x: torch.Tensor, position: int) -> torch.Tensor:
        length = x.shape[1]
        end = position + length
        q, k, v = _project(x, slice(position, end), w, tables, heads, kv_heads)
        cache["k"][:, :, position:end] = k
        cache["v"][:, :, position:end] = v
        context = nn.functional.scaled_dot_product_attention(
            q,
            cache["k"][:, :, :end],
            cache["v"][:, :, :end],
            is_causal=length > 1,
            enable_gqa=kv_heads != heads,
        )
        return _output(context, w)

    def prefill(prompt: torch.Tensor) -> tuple[Any, torch.Tensor]:
        for name in ("k", "v"):
            cache[name] = torch.zeros(size, device=prompt.device, dtype=prompt.dtype)
        return shape.prompt, attend(prompt, 0)[:, -1:]

    def step(position: int, token: torch.Tensor) -> tuple[Any, torch.Tensor]:
        return position + 1, attend(token, position)

    return Generator(prefill, step, backend.sync, backend.to_numpy)


@functools.cache
def _compiled_attend(heads: int, kv_heads: int, device: str, in_place: bool) -> Callable[..., Any]:
    """The compiled step of a configuration: static shapes, the position a tensor, the
    cache written in place (or updated functionally). Made once, so that every decoder
    of the configuration (the warm-up's, the timed ones') shares its graphs: the
    weights are arguments."""

    def attend(
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
        w: Weights,
        tables: Tables,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        at = position + torch.arange(x.shape[1], device=x.device)
        q, k, v = _project(x, at, w, tables, heads, kv_heads)
        if in_place:
            keys.index_copy_(2, at, k)
            values.index_copy_(2, at, v)
        else:
            keys, values = keys.index_copy(2, at, k), values.index_copy(2, at, v)
        # Query i (at position + i) sees the keys up to itself.
        seen = torch.arange(keys.shape[2], device=x.device)[None, :] <= at[:, None]
        context = nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=seen, enable_gqa=kv_heads != heads
        )
        return _output(context, w), keys, values

    return compiled(attend, device)


def _compiled_decoder(
    attend: Callable[..., Any],
    w: Weights,
    tables: Tables,
    shape: GenerationShape,
    size: tuple[int, ...],
) -> Generator:
    """The hand-written decoder whose every call is ``attend``, a
    :func:`_compiled_attend` step."""

    @torch.inference_mode()
    def prefill(prompt: torch.Tensor) -> tuple[Any, torch.Tensor]:
        # Two caches: a step may write its rows into them.
        keys, values = (torch.zeros(size, device=prompt.device, dtype=prompt.dtype) for _ in "kv")
        start = torch.zeros((), dtype=torch.int64, device=prompt.device)
        output, keys, values = attend(prompt, keys, values, start, w, tables)
        return (keys, values, start + shape.prompt), output[:, -1:]

    @torch.inference_mode()
    def step(state: Any, token: torch.Tensor) -> tuple[Any, torch.Tensor]:
        keys, values, position = state
        output, keys, values = attend(token, keys, values, position, w, tables)
        return (keys, values, position + 1), output

    return Generator(prefill, step, backend.sync, backend.to_numpy)
