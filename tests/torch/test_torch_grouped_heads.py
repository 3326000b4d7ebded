"""The PyTorch layer's grouped key/value heads: SDPA takes them unrepeated, or repeated once.

Eager and compiled calls, lazy sizes with ``num_kv_heads`` and ``head_dim``,
and the CUDA kernel that takes float32 grouped heads (told here that the CPU
is CUDA); every result the float64 reference's.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch
from torch_support import TRACED, sdpa_spy
from torch_support import compiler as compiler
from torch_support import runner as runner

from conftest import record_sdpa_key_heads
from mha_multi import spec
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.torch._facts import FACTS
from mha_multi.torch._kernel import SDPA
from mha_multi.weights import init_weights


@pytest.mark.parametrize("name", ["gqa", "mqa", "head_dim"])
def test_sdpa_takes_grouped_heads_unrepeated(runner, cases, name):
    case, config = cases[name], cases[name].config
    with sdpa_spy() as spy:
        out = runner.call(
            runner.layer_for(case),
            *(case.inputs[n] for n in INPUT_NAMES),
            case.valid_lens,
            causal=config.causal,
        )
    spy.assert_called_once()
    query, key, value = spy.call_args.args[:3]
    head_dim = query.shape[-1]
    assert query.shape == (config.batch, config.num_heads, config.num_queries, head_dim)
    kv_shape = (config.batch, config.num_kv_heads, config.num_keys, head_dim)
    assert key.shape == value.shape == kv_shape
    assert spy.call_args.kwargs["enable_gqa"] is True
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


def test_sdpa_gets_no_grouping_argument_for_multi_head_attention(runner, cases):
    case = cases["lens_1d"]
    with sdpa_spy() as spy:
        runner.call(runner.layer_for(case), *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    spy.assert_called_once()
    assert "enable_gqa" not in spy.call_args.kwargs  # PyTorch before 2.5 has no such argument


@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_sdpa_without_grouped_heads_gets_them_repeated_once(runner, cases, name):
    """The route of a PyTorch whose SDPA has no ``enable_gqa``: the plan's ``repeat_kv``."""
    case, config = cases[name], cases[name].config
    without_groups = dataclasses.replace(SDPA, takes_grouped_heads=False)
    with mock.patch.object(FACTS, "kernel", without_groups), sdpa_spy() as spy:
        out = runner.call(
            runner.layer_for(case),
            *(case.inputs[n] for n in INPUT_NAMES),
            case.valid_lens,
            causal=config.causal,
        )
    spy.assert_called_once()
    query, key = spy.call_args.args[:2]
    assert key.shape[1] == query.shape[1] == config.num_heads
    assert "enable_gqa" not in spy.call_args.kwargs
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


@pytest.mark.parametrize("name", ["gqa", "mqa", "head_dim"])
def test_torch_compile_grouped_heads_match_reference(runner, cases, name, compiler):
    """Forward, weights and gradients of a compiled layer of grouped heads: inductor's
    for grouped heads; for one key/value head and a head size of their own, whose graphs
    differ from it in sizes alone, the trace (:data:`torch_support.TRACED`)."""
    case = cases[name]
    layer = runner.layer_for(case)
    compiled = compiler(layer, fullgraph=True, backend="inductor" if name == "gqa" else TRACED)
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    kwargs = {"causal": case.config.causal}
    out = runner.call(compiled, *inputs, case.valid_lens, **kwargs)
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)
    out, weights = runner.call(
        compiled, *inputs, case.valid_lens, return_attention_weights=True, **kwargs
    )
    np.testing.assert_allclose(weights, case.reference["attention_weights"], rtol=0, atol=5e-6)
    tensors = [runner.to_native(x).requires_grad_(True) for x in inputs]
    compiled(*tensors, runner.native_lens(case.valid_lens), **kwargs).backward(
        runner.to_native(case.output_gradient)
    )
    np.testing.assert_allclose(
        tensors[1].grad.numpy(), case.reference["grad.keys"], rtol=0, atol=5e-5
    )
    np.testing.assert_allclose(
        layer.W_v.weight.grad.T.numpy(), case.reference["grad.W_v"], rtol=0, atol=5e-5
    )


def test_lazy_sizes_with_grouped_heads_and_head_dim(runner):
    rng = np.random.default_rng(0)
    layer = MultiHeadAttention(10, 4, num_kv_heads=2, head_dim=3)
    assert (layer.num_kv_heads, layer.head_dim) == (2, 3)
    assert "num_kv_heads=2, head_dim=3" in repr(layer)
    q, k, v = (runner.to_native(rng.standard_normal(s)) for s in [(2, 3, 7), (2, 5, 4), (2, 5, 6)])
    assert layer(q, k, v).shape == (2, 3, 10)
    shapes = {name: array.shape for name, array in get_weights(layer).items()}
    assert shapes == {"W_q": (7, 12), "W_k": (4, 6), "W_v": (6, 6), "W_o": (12, 10)}


def test_set_weights_fixes_lazy_sizes_with_grouped_heads(runner, cases):
    case = cases["head_dim"]
    config = case.config
    layer = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=True, **config.heads())
    layer = set_weights(layer, case.weights)
    assert layer.input_sizes() == {"query_size": 6, "key_size": 10, "value_size": 10}
    out = runner.call(layer, *(case.inputs[n] for n in INPUT_NAMES), case.valid_lens)
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


@pytest.mark.parametrize("call", ["self-attention", "prefill", "step"])
def test_float32_grouped_heads_on_cuda_reach_sdpa_repeated(monkeypatch, call):
    """On CUDA the one SDPA kernel that takes float32 grouped heads holds every score:
    grouped heads of more queries than ``head_dim`` reach SDPA repeated
    (``repeats_grouped_heads``, told here that the CPU is CUDA), a decoding step's
    as they are, its query heads the queries of their key/value head (no
    ``enable_gqa``); the numbers are the float64 reference's either way."""
    import mha_multi.torch._facts as facts_module

    def as_on_cuda(q, num_queries, head_dim, dtype=None):
        return (dtype or q.dtype) == torch.float32 and num_queries > head_dim

    monkeypatch.setattr(facts_module, "repeats_grouped_heads", as_on_cuda)
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=31)
    heads = {"num_heads": 4, "num_kv_heads": 2}
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2), weights).eval()
    x = np.random.default_rng(31).standard_normal((2, 7, 16)).astype(np.float32)
    seen = record_sdpa_key_heads(monkeypatch)
    prompt, row = x[:, :6], x[:, 6:]
    with torch.no_grad():
        if call == "self-attention":
            tensor = torch.from_numpy(prompt)
            output = layer(tensor, tensor, tensor, causal=True)
            expected, _ = spec.reference_forward(
                weights, prompt, prompt, prompt, **heads, causal=True
            )
        else:
            cache = layer.init_cache(2, 8)
            tensor = torch.from_numpy(prompt)
            output, cache = layer(tensor, tensor, tensor, causal=True, cache=cache)
            expected, _, held = spec.reference_cached_forward(
                weights,
                prompt,
                prompt,
                prompt,
                spec.KVCache(np.zeros((2, 2, 8, 4)), np.zeros((2, 2, 8, 4)), np.zeros(2, np.int64)),
                **heads,
                causal=True,
            )
            if call == "step":
                seen.clear()
                tensor = torch.from_numpy(row)
                output, _ = layer(tensor, tensor, tensor, causal=True, cache=cache)
                expected, _, _ = spec.reference_cached_forward(
                    weights, row, row, row, held, **heads, causal=True
                )
    # Six queries of four dimensions: repeated to the query heads; one query: folded.
    assert seen == ([(2, False)] if call == "step" else [(4, False)])
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=5e-6)


def _recording_sdpa(monkeypatch) -> list[tuple[tuple[int, ...], tuple[int, ...] | None, bool]]:
    """Each SDPA call's query shape, ``attn_mask`` shape and ``enable_gqa``."""
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        mask = None if attn_mask is None else tuple(attn_mask.shape)
        seen.append((tuple(q.shape), mask, kwargs.get("enable_gqa", False)))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize(
    "call", ["lengths", "bias", "step", "ALiBi step", "rotary step", "one token"]
)
def test_one_querys_grouped_heads_reach_sdpa_as_their_key_heads_queries(monkeypatch, call):
    """One query's 4 heads of 2 key/value heads reach SDPA as 2 heads of 2 queries each
    (``folds_groups``: no ``enable_gqa``), a mask of each head's folded alike, in the
    generic flow (lengths, a bias per head) and on the route (a decoding step, with
    ALiBi's bias per head or rotary positions; a token with no cache): the float64
    reference's numbers."""
    heads = {"num_heads": 4, "num_kv_heads": 2}
    options = {"ALiBi step": {"alibi": True}, "rotary step": {"rotary": {"theta": 10000.0}}}
    options = options.get(call, {})
    weights = init_weights(16, **heads, seed=33)
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2, **options), weights).eval()
    rng = np.random.default_rng(33)
    x, memory = rng.standard_normal((2, 1, 16)), rng.standard_normal((2, 5, 16))
    x, memory = x.astype(np.float32), memory.astype(np.float32)
    lens, bias = np.array([5, 2]), rng.standard_normal((2, 4, 1, 5)).astype(np.float32)
    with torch.no_grad():
        if call.endswith("step"):
            prompt = torch.from_numpy(memory)
            _, cache = layer(prompt, prompt, prompt, causal=True, cache=layer.init_cache(2, 8))
            held = spec.KVCache(*(t.numpy().astype(np.float64) for t in cache))
        seen = _recording_sdpa(monkeypatch)
        token, keys = torch.from_numpy(x), torch.from_numpy(memory)
        if call == "lengths":
            out = layer(token, keys, keys, torch.tensor(lens))
            expected, _ = spec.reference_forward(weights, x, memory, memory, lens, **heads)
        elif call == "bias":
            out = layer(token, keys, keys, bias=torch.from_numpy(bias))
            expected, _ = spec.reference_forward(weights, x, memory, memory, bias=bias, **heads)
        elif call == "one token":
            out = layer(token, token, token)
            expected, _ = spec.reference_forward(weights, x, x, x, **heads)
        else:
            out, _ = layer(token, token, token, causal=True, cache=cache)
            expected, _, _ = spec.reference_cached_forward(
                weights, x, x, x, held, **heads, causal=True, **options
            )
    mask = {"lengths": (2, 1, 1, 5), "bias": (2, 2, 2, 5), "ALiBi step": (1, 2, 2, 6)}
    assert seen == [((2, 2, 2, 4), mask.get(call), False)]
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=5e-6)
