"""The imperative layer's plans with dropout: d2l's training calls, the generic flow's bits.

A layer with dropout on its attention weights, trained imperatively under
``autograd.record()`` (d2l's Transformer: the encoder's self-attention with
lengths, the decoder's with lengths per query, its attention to the encoder),
runs the plan of its call's signature: ``npx.dropout`` draws its mask from
MXNet's random state where the generic flow draws it, so with the same seed
the output and every gradient are the generic flow's to the bit (docs: "Fast
paths"); the dropout acts (the output is not the inference call's), and not
in inference mode, where the output is the generic flow's to the bit and the
float64 reference's.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mha_multi import spec
from mha_multi.mxnet import MultiHeadAttention, _cross, _facts, _plain, set_weights
from mha_multi.weights import init_weights

HEADS = {"num_heads": 4, "num_kv_heads": 2}
ATOL = 5e-6
#: Lengths of a batch of 3 over 5 keys: none, per example (one 0: a row hidden whole),
#: per query (4 queries: d2l's decoder's lengths for its causal rule, and some more).
LENGTHS = {
    "none": None,
    "int": np.array([1, 5, 0], dtype=np.int32),
    "float": np.array([2.0, 5.0, 3.5], dtype=np.float32),
    "per query": np.array([[1, 2, 3, 4], [0, 5, 5, 2], [5, 4, 3, 0]], dtype=np.float32),
}


def layer_and_weights(seed: int, **options):
    weights = init_weights(16, seed=seed, bias=True, **HEADS)
    layer = MultiHeadAttention(16, 4, 0.4, num_kv_heads=2, bias=True, **options)
    return set_weights(layer, weights), weights


@contextlib.contextmanager
def generic_only():
    """No plan answering: every call takes the generic flow."""
    with (
        mock.patch.object(_facts.MXNetFacts, "plain_attention", lambda *_, **__: None),
        mock.patch.object(_facts.MXNetFacts, "cross_attention", lambda *_, **__: None),
    ):
        yield


def trained(layer, queries, memory, lens, *, causal, seed):
    """A recorded training call's output and the gradients of its inputs and every
    parameter, the random state seeded first."""
    inputs = [queries] if memory is None else [queries, memory]
    for x in inputs:
        x.attach_grad()
    keys = queries if memory is None else memory
    mx.random.seed(seed)
    with autograd.record():
        output = layer(queries, keys, keys, lens, causal=causal)
    output.backward()
    grads = [x.grad.asnumpy() for x in inputs]
    grads += [p.grad().asnumpy() for p in layer.collect_params().values()]
    return [output.asnumpy(), *grads]


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize(
    ("kind", "options", "causal"),
    [
        ("self", {}, False),
        ("self", {}, True),
        ("self", {"softcap": 3.0}, False),  # (the generic path's attention)
        ("self", {"rotary": {"theta": 100.0}}, True),
        ("cross", {}, False),
    ],
    ids=["self", "causal", "soft cap", "rotary", "cross"],
)
def test_a_training_call_with_dropout_runs_its_plan_to_the_generic_flows_bits(
    lengths, kind, options, causal
):
    layer, weights = layer_and_weights(11, **options)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 4 if lengths == "per query" else 5, 16))
    memory = rng.standard_normal((3, 5, 16)) if kind == "cross" else None
    if kind == "self" and lengths == "per query":
        lens = LENGTHS[lengths][:, :4]
    else:
        lens = LENGTHS[lengths]

    def arrays():
        return (
            mx.np.array(x, dtype=np.float32),
            None if memory is None else mx.np.array(memory, dtype=np.float32),
            None if lens is None else mx.np.array(lens),
        )

    planned = trained(layer, *arrays(), causal=causal, seed=5)
    plans = (_plain if kind == "self" else _cross).plans_of(layer)
    assert len([p for p in plans.values() if p is not None]) == 1  # the plan ran the call
    with generic_only():
        generic = trained(layer, *arrays(), causal=causal, seed=5)
    for ours, theirs in zip(planned, generic, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    # Dropout acted: the output is not the inference call's, which is the reference's.
    queries, keys, valid_lens = arrays()
    keys = queries if keys is None else keys
    inferred = layer(queries, keys, keys, valid_lens, causal=causal).asnumpy()
    assert not np.allclose(planned[0], inferred, atol=1e-3)
    with generic_only():  # (outside training mode the plan calls no dropout: the same bits)
        np.testing.assert_array_equal(
            inferred, layer(queries, keys, keys, valid_lens, causal=causal).asnumpy()
        )
    expected, _ = spec.reference_forward(
        weights,
        x,
        *[x if memory is None else memory] * 2,
        lens,
        **HEADS,
        causal=causal,
        **options,
    )
    np.testing.assert_allclose(inferred, expected, rtol=0, atol=ATOL)
