"""PyTorch's route for plain cross-attention that reads nothing (docs: "Fast paths").

A call of keys and values of its own, a layer without options, not causal,
whose generic flow's plan is the generic path's with nothing read (a GPU's
call of few scores; on the CPU, told that its tensors are on a GPU), is run
by the route: the same outputs and gradients as the generic flow's to the
bit, NaN where its are, the same errors (the randomised route tests'
comparison); the float64 reference's numbers.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from route_support import answered_cross_calls, generic_only
from test_torch_route_random import (
    DTYPES,
    LENGTHS,
    RANDOMISED,
    assert_route_is_generic,
    lengths_of,
    poisoned,
)

from mha_multi import spec
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, get_weights


def layer_of(num_kv_heads: int, dtype: torch.dtype, **options: object) -> MultiHeadAttention:
    made = MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, dtype=dtype, **options)
    x = torch.zeros(1, 2, 16, dtype=dtype)
    made(x, x, x)  # (sizes the lazy projections)
    return made


@RANDOMISED
@given(
    num_kv_heads=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    recording=st.booleans(),
    sizes=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(0, 6)),
    lengths=st.sampled_from([*LENGTHS, "(B, Q) wrong"]),
    inputs=st.sampled_from(["keys are values", "values apart", "queries are keys"]),
    poison=st.sampled_from([None, "nan", "inf", "large"]),
    where=st.tuples(*[st.integers(0, 15)] * 3),
    seed=st.integers(0, 2**16),
)
def test_a_gpus_cross_attention_is_the_generic_flows(
    num_kv_heads, dtype, bias, recording, sizes, lengths, inputs, poison, where, seed
):
    torch.manual_seed(seed)
    layer = layer_of(num_kv_heads, dtype, bias=bias).train(recording)
    batch, num_queries, num_keys = sizes
    if inputs == "queries are keys":
        num_keys = num_queries
    x = torch.randn(batch, num_queries, 16, dtype=torch.float64).to(dtype)
    memory = poisoned(torch.randn(batch, num_keys, 16, dtype=torch.float64), poison, where)
    memory, apart = memory.to(dtype), torch.randn(batch, num_keys, 16).to(dtype)
    if lengths == "(B, Q) wrong":  # (per key, not per query: the checks' error)
        valid_lens = torch.ones(batch, num_keys + 1, dtype=torch.int64)
    else:
        valid_lens = lengths_of(lengths, batch, num_queries)
        if lengths == "(B, Q)":
            valid_lens = valid_lens % (num_keys + 2) - 1

    def call():
        queries = x.clone().requires_grad_(recording)
        keys = memory.clone().requires_grad_(recording)
        if inputs == "queries are keys":
            arguments = (queries, queries, keys)
        else:
            arguments = (queries, keys, keys if inputs == "keys are values" else apart)
        with contextlib.nullcontext() if recording else torch.no_grad():
            out = layer(*arguments, valid_lens)
        if not recording:
            return (out,)
        out.sum().backward()
        return out, queries.grad, *([keys.grad] if keys.grad is not None else [])

    assert_route_is_generic(call, on_a_gpu=True)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("lengths", [None, [3, 0], [[1, 5, 0], [2, 2, 9]]])
def test_a_gpus_cross_attention_takes_the_route_to_the_references_numbers(num_kv_heads, lengths):
    """d2l's ``attention(X, Y, Y, valid_lens)`` on a GPU: the route answers it, with lengths
    per example, per query (some hiding every key) or none, and its output is the float64
    reference's."""
    layer = layer_of(num_kv_heads, torch.float64, bias=True).eval()
    x, memory = (
        torch.randn(2, 3, 16, dtype=torch.float64),
        torch.randn(2, 5, 16, dtype=torch.float64),
    )
    valid_lens = None if lengths is None else torch.tensor(lengths)
    with backend.as_if_on_a_gpu(), answered_cross_calls() as answers, torch.no_grad():
        for _ in range(2):  # (the first call plans, the second looks the plan up)
            out = layer(x, memory, memory, valid_lens)
    assert answers == [True, True]
    expected, _ = spec.reference_forward(
        get_weights(layer),
        x.numpy(),
        memory.numpy(),
        memory.numpy(),
        None if lengths is None else np.array(lengths),
        num_heads=4,
    )
    torch.testing.assert_close(out, torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


def test_which_cross_attention_calls_the_route_takes():
    """On a GPU, a call whose scores are few takes the route; one whose generic flow reads
    its values (a head's 65536 scores with a gradient) does not, nor does a call on the
    host (whose generic flow reads and runs SDPA), a causal one, or a layer with options.
    SDPA runs only where the generic flow read."""
    plain, windowed = layer_of(2, torch.float32), layer_of(2, torch.float32, window=2)
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    long_x, long_memory = torch.randn(1, 256, 16), torch.randn(1, 256, 16)
    with answered_cross_calls() as answers, backend.kernel_spy() as sdpa:
        plain(x, memory, memory)  # (the host)
        with backend.as_if_on_a_gpu():
            plain(x, memory, memory, torch.tensor([5, 1]))
            plain(long_x, long_memory, long_memory, torch.tensor([200]))  # (read: SDPA)
            plain(x, memory, memory, causal=True)
            windowed(x, memory, memory)
            with torch.no_grad():
                plain(long_x, long_memory, long_memory, torch.tensor([200]))
    assert answers == [False, True, False, False, False, True]
    assert len(sdpa) == 2  # (the host's call and the long call recording a gradient)


def test_a_new_signatures_error_is_the_generic_flows():
    """A signature the route has not seen runs the generic flow's checks first: a wrong
    shape raises their error, word for word, after a call of another signature planned."""
    layer = layer_of(4, torch.float32)
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    wrong = torch.randn(2, 4, 16)
    with backend.as_if_on_a_gpu(), torch.no_grad():
        layer(x, memory, memory)
        with answered_cross_calls() as answers, pytest.raises(ValueError) as ours:
            layer(x, memory, wrong)
        with generic_only(), pytest.raises(ValueError) as theirs:
            layer(x, memory, wrong)
    assert answers == []  # (the route raised, before answering)
    assert str(ours.value) == str(theirs.value)
    assert "values" in str(ours.value)


def test_the_routes_plan_is_kept_by_signature():
    """Each signature is planned once: a call of new lengths' shape or new keys' length
    plans again, a repeated one looks its plan up, and each gives the generic flow's bits."""
    layer = layer_of(2, torch.float32)
    x = torch.randn(2, 3, 16)
    calls = [
        (torch.randn(2, 5, 16), torch.tensor([5, 2])),
        (torch.randn(2, 7, 16), torch.tensor([5, 2])),
        (torch.randn(2, 7, 16), torch.tensor([[1, 2, 3], [0, 7, 7]])),
        (torch.randn(2, 7, 16), torch.tensor([math.inf, 2.5])),
    ]
    with backend.as_if_on_a_gpu(), torch.no_grad():
        for memory, valid_lens in calls * 2:
            with answered_cross_calls() as answers:
                ours = layer(x, memory, memory, valid_lens)
            with generic_only():
                theirs = layer(x, memory, memory, valid_lens)
            assert answers == [True]
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
