"""Randomised calls and decodings: PyTorch's fast route gives the generic flow's numbers.

Every configuration is run twice, once offered to the facts' route and once
through the generic flow alone (docs: "Fast paths"): the outputs (and, where
gradients are recorded, the input's gradient; with a cache, the cache) are
the same to the bit, NaN where the generic flow's are, or both raise the
same error. Layers with every option, grouped heads, 16 to 64 bits, empty
axes, non-finite and large inputs, lengths of every kind (hiding every key,
none, or some), on the host and as on a GPU.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from route_support import answered_calls, generic_only

from mha_multi import spec
from mha_multi.parity.harness import torch as backend
from mha_multi.spec import plan as spec_plan
from mha_multi.torch import MultiHeadAttention, _ragged, get_weights
from mha_multi.torch._cache import carried_check

RANDOMISED = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

ROTARY = {"theta": 100.0}
OPTIONS = [
    {},
    {"rotary": ROTARY},
    {"softcap": 2.0},
    {"window": 2},
    {"alibi": True},
    {"sinks": True},
    {"qk_norm": {}},
    {"rotary": ROTARY, "window": 3, "softcap": 3.0},
    {"window": 1, "alibi": True, "sinks": True},
    {"rotary": {"interleaved": True}, "qk_norm": {"scope": "whole"}},
    {"rotary": ROTARY, "window": 4, "qk_norm": {"unit_offset": True}},
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
#: The kinds of ``valid_lens`` a call without a cache is given.
LENGTHS = [None, "(B,)", "(B,) int32", "(B,) float", "(B, Q)", "list"]


def lengths_of(kind: str | None, batch: int, num_queries: int) -> object:
    """``valid_lens`` of ``kind``, from -1 (as 0) to past the keys (as all of them); a
    floating one's first may be NaN (hiding every key) or infinite."""
    if kind is None:
        return None
    shape = (batch, num_queries) if kind == "(B, Q)" else (batch,)
    lengths = torch.randint(-1, num_queries + 2, shape)
    if kind == "list":
        return lengths.tolist()
    if kind == "(B,) float":
        lengths = lengths.float()
        if batch:
            lengths[0] = [lengths[0], math.nan, math.inf, -math.inf][int(torch.randint(0, 4, ()))]
    return lengths.to(torch.int32) if kind == "(B,) int32" else lengths


def layer_of(options: dict, num_kv_heads: int, dtype: torch.dtype) -> MultiHeadAttention:
    made = MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, dtype=dtype, **options)
    x = torch.zeros(1, 2, 16, dtype=dtype)
    made(x, x, x)  # (sizes the lazy projections)
    return made


def poisoned(x: torch.Tensor, poison: str | None, where: tuple[int, ...]) -> torch.Tensor:
    if x.numel() and poison in ("nan", "inf"):
        x[tuple(i % n for i, n in zip(where, x.shape, strict=True))] = (
            math.nan if poison == "nan" else math.inf
        )
    return x * 1e3 if poison == "large" else x


def run(function) -> tuple:
    """``function()``'s tensors, or the error it raised (its type and message)."""
    try:
        return tuple(x.detach() for x in function())
    except (TypeError, ValueError, RuntimeError) as error:
        return (type(error).__name__, str(error))


def assert_route_is_generic(function, on_a_gpu: bool) -> None:
    """``function()`` offered to the route and through the generic flow alone: the same
    tensors to the bit (NaN where NaN), or the same error."""
    with backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext():
        with answered_calls():
            route = run(function)
        with generic_only():
            generic = run(function)
    assert len(route) == len(generic)
    for ours, theirs in zip(route, generic, strict=True):
        if isinstance(ours, str) or isinstance(theirs, str):
            assert ours == theirs
        else:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


@RANDOMISED
@given(
    options=st.sampled_from(OPTIONS),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(DTYPES),
    on_a_gpu=st.booleans(),
    recording=st.booleans(),
    causal=st.booleans(),
    shape=st.tuples(st.integers(0, 3), st.integers(0, 6)),
    lengths=st.sampled_from(LENGTHS),
    poison=st.sampled_from([None, "nan", "inf", "large"]),
    where=st.tuples(*[st.integers(0, 15)] * 3),
    seed=st.integers(0, 2**16),
)
def test_a_call_without_a_cache_is_the_generic_flows(
    options, num_kv_heads, dtype, on_a_gpu, recording, causal, shape, lengths, poison, where, seed
):
    torch.manual_seed(seed)
    layer = layer_of(options, num_kv_heads, dtype).train(recording)
    x = poisoned(torch.randn(*shape, 16, dtype=torch.float64), poison, where).to(dtype)
    valid_lens = lengths_of(lengths, *shape)

    def call():
        queries = x.clone().requires_grad_(recording)
        with contextlib.nullcontext() if recording else torch.no_grad():
            out = layer(queries, queries, queries, valid_lens, causal=causal)
        if not recording:
            return (out,)
        out.sum().backward()
        return out, queries.grad

    assert_route_is_generic(call, on_a_gpu)


#: What every randomised decoding draws: the layer, where it runs, its steps, the
#: position a poisoned token is poisoned at and the seed of its values.
DECODING = {
    "options": st.sampled_from(OPTIONS),
    "num_kv_heads": st.sampled_from([1, 2, 4]),
    "dtype": st.sampled_from(DTYPES[:3]),
    "on_a_gpu": st.booleans(),
    "steps": st.integers(1, 8),
    "where": st.tuples(*[st.integers(0, 15)] * 3),
    "seed": st.integers(0, 2**16),
}


@RANDOMISED
@given(
    **DECODING,
    batch=st.integers(1, 3),
    prompt=st.integers(1, 6),
    max_length=st.sampled_from([10, 16]),
    poison=st.sampled_from([None, "nan", "large"]),
)
def test_a_decoding_is_the_generic_flows(
    options, num_kv_heads, dtype, on_a_gpu, batch, prompt, steps, max_length, poison, where, seed
):
    """A prompt, then one token a step (past ``max_length``: the overflow's error), a
    step's token poisoned where ``where`` says: outputs and the cache the same."""
    torch.manual_seed(seed)
    layer = layer_of(options, num_kv_heads, dtype).eval()
    first = torch.randn(batch, prompt, 16, dtype=torch.float64).to(dtype)
    tokens = [torch.randn(batch, 1, 16, dtype=torch.float64) for _ in range(steps)]
    tokens[where[0] % steps] = poisoned(tokens[where[0] % steps], poison, where)
    tokens = [token.to(dtype) for token in tokens]

    def decode():
        outputs = []
        with torch.no_grad():
            out, cache = layer(
                first, first, first, causal=True, cache=layer.init_cache(batch, max_length)
            )
            outputs.append(out)
            for token in tokens:
                out, cache = layer(token, token, token, causal=True, cache=cache)
                outputs.append(out)
        return (*outputs, cache.keys, cache.values, cache.lengths)

    assert_route_is_generic(decode, on_a_gpu)


@RANDOMISED
@given(
    **DECODING,
    prompts=st.lists(st.integers(0, 6), min_size=2, max_size=3),
    max_length=st.sampled_from([10, 16, 80]),  # (80: past a GPU's span bucket)
    stale=st.sampled_from([None, "nan", "large", "huge"]),
    poison=st.sampled_from([None, "nan", "inf", "large"]),
)
def test_a_ragged_decoding_is_the_generic_flows(
    options, num_kv_heads, dtype, on_a_gpu, prompts, steps, max_length, stale, poison, where, seed
):
    """Prompts of different lengths (``prompts``, padding past each), then one token a
    step for every example, each at its own position (past ``max_length``: the
    overflow's error), a step's token poisoned where ``where`` says, and the cache's
    positions past the prompts ``stale`` (NaN, large values, or values so large that
    the scores they would make pass the fused kernel's bound: hidden from every
    query, the generic flow's read counts them): outputs, the cache and what its check
    knows the same."""
    torch.manual_seed(seed)
    layer = layer_of(options, num_kv_heads, dtype).eval()
    batch = len(prompts)
    first = torch.randn(batch, max(prompts), 16, dtype=torch.float64).to(dtype)
    tokens = [torch.randn(batch, 1, 16, dtype=torch.float64) for _ in range(steps)]
    tokens[where[0] % steps] = poisoned(tokens[where[0] % steps], poison, where)
    tokens = [token.to(dtype) for token in tokens]
    shape = layer.init_cache(batch, max_length).keys.shape
    stale_rows = [
        poisoned(torch.randn(shape, dtype=torch.float64), stale, (*where, where[1])) for _ in "kv"
    ]
    if stale == "huge":
        stale_rows = [torch.randn(shape, dtype=torch.float64) * 1e7 for _ in "kv"]
    elif stale == "nan":  # (and at the last position: past any span but the whole cache's)
        stale_rows[1][..., -1, :] = math.nan

    def decode():
        outputs = []
        cache = layer.init_cache(batch, max_length)
        if stale is not None:
            for held, rows in zip((cache.keys, cache.values), stale_rows, strict=True):
                held.copy_(rows)
        with torch.no_grad():
            out, cache = layer(first, first, first, torch.tensor(prompts), causal=True, cache=cache)
            outputs.append(out)
            for token in tokens:
                out, cache = layer(token, token, token, causal=True, cache=cache)
                outputs += (out, known_of(cache))
        return (*outputs, cache.keys, cache.values, cache.lengths)

    assert_route_is_generic(decode, on_a_gpu)


@pytest.mark.parametrize(
    "options",
    [
        {"window": 3},
        {"window": 2, "alibi": True},
        {"rotary": ROTARY, "window": 3, "qk_norm": {}},
    ],
)
def test_a_ragged_step_past_a_window_after_a_read_is_the_generic_flows(options, monkeypatch):
    """On a GPU, the ragged step right after a call that read every value (a prompt whose
    scores are many: the thresholds lowered here) attends from the first position the
    window shows the shortest example, rounded down to the span bucket (64 of 70
    positions), as the generic flow does; the steps after it, with rows no call read,
    from 0. Outputs, cache and what its check knows the same. (A layer whose options
    no kernel takes, a soft cap or sinks, reads no prompt: its steps start at 0.)"""
    monkeypatch.setattr(spec_plan, "DEVICE_READ_SCORES", 1 << 10)
    monkeypatch.setattr(spec_plan, "DEVICE_READ_TOTAL_SCORES", 1 << 12)
    torch.manual_seed(0)
    layer = layer_of(options, 2, torch.float32).eval()
    prompts = torch.tensor([80, 70, 75])
    first = torch.randn(3, 80, 16)
    tokens = [torch.randn(3, 1, 16) for _ in range(3)]
    firsts = []
    window_first = _ragged._window_first

    def spy(*args):
        found = window_first(*args)
        firsts.append(found[0])
        return found

    monkeypatch.setattr(_ragged, "_window_first", spy)

    def decode():
        outputs = []
        with torch.no_grad():
            out, cache = layer(
                first, first, first, prompts, causal=True, cache=layer.init_cache(3, 160)
            )
            for token in tokens:
                out, cache = layer(token, token, token, causal=True, cache=cache)
                outputs += (out, known_of(cache))
        return (*outputs, cache.keys, cache.values, cache.lengths)

    assert_route_is_generic(decode, on_a_gpu=True)
    assert firsts == [64, 0, 0]


@pytest.mark.parametrize(
    "options",
    [{"alibi": True}, {"alibi": True, "window": 3}, {"rotary": ROTARY, "alibi": True, "window": 2}],
)
@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_a_ragged_alibi_step_on_the_host_is_the_generic_flows(options, num_kv_heads, monkeypatch):
    """On the host, a ragged step of an ALiBi layer gives SDPA the bias of each example's
    own position where the lengths and a window hide keys (as the queries of their
    key/value head, where heads are grouped), and a step whose scores pass the kernel's
    limit (a token a thousand times larger) the generic path with that bias: outputs,
    cache and what its check knows the generic flow's."""
    torch.manual_seed(0)
    layer = layer_of(options, num_kv_heads, torch.float32).eval()
    prompt = torch.randn(3, 6, 16)
    tokens = [torch.randn(3, 1, 16) for _ in range(4)]
    tokens[2] = tokens[2] * 1e3
    likes, exact = [], []
    alibi_bias, fused_read = _ragged._alibi_bias, _ragged._fused_read
    monkeypatch.setattr(
        _ragged, "_alibi_bias", lambda *args: likes.append(args[-1].dim()) or alibi_bias(*args)
    )
    monkeypatch.setattr(
        _ragged, "_fused_read", lambda *args: exact.append((read := fused_read(*args))[0]) or read
    )
    lengths = torch.tensor([6, 2, 4])

    def decode():
        outputs, cache = [], layer.init_cache(3, 16)
        with torch.no_grad():
            out, cache = layer(prompt, prompt, prompt, lengths, causal=True, cache=cache)
            for token in tokens:
                out, cache = layer(token, token, token, causal=True, cache=cache)
                outputs += (out, known_of(cache))
        return (*outputs, cache.keys, cache.values, cache.lengths)

    assert_route_is_generic(decode, on_a_gpu=False)
    assert likes == [3] * 4  # (each step's bias of the queries' dtype: a fused plan's)
    assert exact == [True, True, False, True], exact  # (SDPA's, the generic path's, SDPA's)


def test_a_ragged_step_past_a_window_with_no_bound_of_the_keys_before_it(monkeypatch):
    """On the host, a ragged step whose window starts past the positions the check's
    bound of the keys holds for (a prompt as long as the window, which hides no key and
    so reads no key's magnitude, then one token for the first example alone) reads the
    keys it attends over and keeps the bound it had, as the generic flow does: outputs,
    cache and what its check knows the same."""
    torch.manual_seed(0)
    layer = layer_of({"rotary": ROTARY, "window": 4}, 2, torch.float32).eval()
    prompt, more = torch.randn(3, 4, 16), torch.randn(3, 1, 16)
    tokens = [torch.randn(3, 1, 16) for _ in range(3)]
    reads = []
    read = _ragged._fused_read
    monkeypatch.setattr(
        _ragged, "_fused_read", lambda *args: reads.append(args[8] < args[7]) or read(*args)
    )

    def decode():
        outputs = []
        with torch.no_grad():
            out, cache = layer(prompt, prompt, prompt, cache=layer.init_cache(3, 16))
            out, cache = layer(more, more, more, torch.tensor([1, 0, 0]), cache=cache)
            outputs += (out, known_of(cache))
            for token in tokens:
                out, cache = layer(token, token, token, causal=True, cache=cache)
                outputs += (out, known_of(cache))
        return (*outputs, cache.keys, cache.values, cache.lengths)

    assert_route_is_generic(decode, on_a_gpu=False)
    assert reads and all(reads), reads


def known_of(cache) -> torch.Tensor:
    """What a cache's check knows (:class:`mha_multi.torch._cache.CacheCheck`), as numbers:
    the positions checked and known finite, the keys' bound, and whether a poison or
    rows are left to read (-1: nothing known)."""
    check = carried_check(cache.lengths)
    if check is None:
        return torch.tensor([-1.0])
    finite_from = -1 if check.finite_from is None else check.finite_from
    pending = bool(check.pending) or check.pending_from is not None
    return torch.tensor(
        [
            check.upto,
            finite_from,
            check.key_upto,
            check.key_max,
            check.poison is not None,
            pending,
            *check.lengths.tolist(),
        ],
        dtype=torch.float64,
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"rotary": ROTARY},
        {"qk_norm": {}},
        {"softcap": 2.0},
        {"sinks": True},
        {"window": 8},
        {"window": 8, "softcap": 2.0, "sinks": True},
        {"window": 4},
        {"window": 6},
        {"window": 2, "softcap": 2.0},
        {"window": 2, "sinks": True, "alibi": True},
        {"alibi": True},
        {"window": 4, "alibi": True},
    ],
)
@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_ragged_steps_reach_the_route_with_every_option(options, num_kv_heads):
    """A step of examples at different lengths takes the route, on the host and on a GPU,
    with every option: on the host SDPA with the lengths' mask, the window's where it
    hides keys (the prompts hold 4, 2 and 3 positions: the steps fill up to 5, 6, 7,
    which a window of 8 holds, one of 4 none, one of 6 the first two) and ALiBi's bias
    of each example's own position, or the generic path where no kernel takes the
    options (a soft cap, sinks); on a GPU, where a step reads nothing, the generic
    path."""
    torch.manual_seed(0)
    prompt, token = torch.randn(3, 4, 16), torch.randn(3, 1, 16)
    for on_a_gpu in (False, True):
        # (A layer of its own: its plans are kept by device, which the GPU's pretends.)
        layer = layer_of(options, num_kv_heads, torch.float32).eval()
        with torch.no_grad(), backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext():
            _, cache = layer(
                prompt,
                prompt,
                prompt,
                torch.tensor([4, 2, 3]),
                causal=True,
                cache=layer.init_cache(3, 8),
            )
            with answered_calls() as answers:
                for _ in range(3):
                    _, cache = layer(token, token, token, causal=True, cache=cache)
        assert answers == [True] * 3, (on_a_gpu, answers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_randomised_layers_reach_the_route(dtype):
    """The route answers the randomised tests' plain calls in every dtype (so that they
    compare it, not the generic flow with itself)."""
    layer = layer_of({"rotary": ROTARY, "softcap": 2.0}, 2, dtype).eval()
    x = torch.randn(2, 3, 16, dtype=dtype)
    with answered_calls() as answers, torch.no_grad():
        layer(x, x, x, causal=True)
    assert answers == [True]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", LENGTHS[1:-1])
def test_calls_with_lengths_reach_the_route(lengths, causal):
    """A call with lengths (a tensor) takes the route, on the host and on a GPU, recording
    a gradient or not, lengths that hide every key of a row included (the randomised
    tests then compare it with the generic flow); lengths not a tensor do not."""
    torch.manual_seed(0)
    layer = layer_of({"rotary": ROTARY}, 2, torch.float32)
    x = torch.randn(3, 4, 16)
    valid_lens = lengths_of(lengths, 3, 4)
    # (A layer of its own: a plan is kept by device, which the host's and a GPU's told
    # apart share here.)
    on_a_gpu = layer_of({"rotary": ROTARY}, 2, torch.float32)
    with answered_calls() as answers:
        layer(x, x, x, valid_lens, causal=causal)
        with torch.no_grad():
            layer(x, x, x, valid_lens * 0, causal=causal)
        layer(x, x, x, [4, 1, 0], causal=causal)
        with backend.as_if_on_a_gpu():
            on_a_gpu(x, x, x, valid_lens, causal=causal)
            with torch.no_grad():
                on_a_gpu(x, x, x, valid_lens * 0, causal=causal)
    assert answers == [True, True, False, True, True]


def test_a_gpus_call_with_lengths_that_reads_is_the_generic_flows():
    """On a GPU, a call with lengths whose scores are many enough for the generic flow to
    read its values (a head's 65536 with a gradient, spec.reads_values) is left to that
    flow, which reads them and runs SDPA (the example of length 0 fixed after it); one
    with fewer takes the route, whose attention is the generic path's: no SDPA."""
    layer = layer_of({}, 2, torch.float32)
    lengths = torch.tensor([200, 0])
    with backend.as_if_on_a_gpu(), answered_calls() as answers:
        for length in (255, 256):
            x = torch.randn(2, length, 16)
            with backend.kernel_spy() as sdpa:
                layer(x, x, x, lengths)
            assert len(sdpa) == (0 if length == 255 else 1), length
    assert answers == [True, False]


@pytest.mark.parametrize(
    "options", [{"window": 2}, {"alibi": True}, {"softcap": 2.0}, {"sinks": True}]
)
def test_calls_with_lengths_reach_the_route_with_every_option(options):
    """A window and ALiBi reach SDPA (a mask, a bias) and a soft cap and sinks, which no
    kernel takes, the generic path: their calls with lengths take the route either way,
    and give the float64 reference's numbers."""
    layer = layer_of(options, 2, torch.float64).eval()
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    lengths = torch.tensor([4, 2, 0])
    with answered_calls() as answers, torch.no_grad():
        out = layer(x, x, x, lengths, causal=True)
    assert answers == [True]
    expected, _ = spec.reference_forward(
        get_weights(layer), *[x.numpy()] * 3, lengths.numpy(), num_heads=4, causal=True, **options
    )
    torch.testing.assert_close(out, torch.from_numpy(expected), rtol=1e-12, atol=1e-12)
