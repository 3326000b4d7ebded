"""Keras' call plan on JAX and TensorFlow: an eager call as one compiled program per signature.

An eager call of the Keras layer on JAX or TensorFlow (concrete arrays, no
dropout applied) runs its whole flow, :func:`mha_multi.call.forward` with its
checks, projections, positions, kernel, output and cache update, as one
program of the layer's ``stateless_call`` (docs: "Fast paths"): a
``jax.jit`` program, as the NNX layer's eager calls run, or a ``tf.function``
graph. Eager JAX would otherwise dispatch each of the flow's operations
apart, and compile each of them for every new shape: a one-token call of 512
hiddens took 0.90 ms eagerly and 0.30 ms by its plan, a call of a new shape
1.4 to 1.9 s against 0.2 to 0.3 s (docs: "Results"). Eager TensorFlow runs
each operation from Python: a decoding step of the bench's shape took 9 ms
eagerly and 3 ms by its plan; but a trace costs some 80 ms, so a signature is
planned from its third call (``eager_calls_before_plan`` of
:mod:`mha_multi.keras._frameworks`), and a shape met once, a prompt's length,
runs the eager flow.

The program is made once per :func:`plan_key` (what decides the route
besides the arrays: the layer's settings, the call's flags, where the
queries live) and traced once per shapes, dtypes and given arguments
(``jax.jit``'s and ``tf.function``'s own keys). The layer's variables are
its arguments, never closed over, so a changed weight is seen by the next
call; and layers of the same settings (:func:`layer_settings`) share their
programs, as the NNX layer's do: a model of many such layers compiles each
signature once, not once a layer (the eager flow's operations, too, were
compiled once for every layer).
The checks of shapes and dtypes run while it is traced and raise there;
the check that reads values, a cached call's lengths against its capacity,
runs on every call (:func:`mha_multi.call.check_cache_values`, the lengths
an eager call returned known without a read), and the lengths a planned
call returns are remembered as an eager call's are. The program computes what a caller's
own ``jax.jit`` or ``tf.function`` of the layer computes: a traced flow reads
no value, so it attends over every cached position, the unfilled ones hidden.

Anything the plan does not serve (Keras on PyTorch, tracers and symbolic
tensors, numpy queries, keys or values (on TensorFlow, any numpy argument),
dropout applied, a mixed dtype policy, settings that cannot be hashed) takes
the eager flow, whose numbers differ from the program's in the last bits,
within float32 rounding (docs: "Reading the parity report").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mha_multi import call, spec
from mha_multi.keras._direct_call import keras_state_is_plain
from mha_multi.keras._facts import FACTS
from mha_multi.keras._frameworks import active
from mha_multi.keras._written_lengths import WRITTEN_LENGTHS
from mha_multi.spec.memo import Kept, KeptBy

__all__ = ["KEPT_PROGRAMS", "PLANS_PER_LAYER", "forget", "layer_settings", "planned_call"]

#: How many signatures' programs a layer keeps at hand, the oldest dropped first.
PLANS_PER_LAYER = 16

#: How many programs layers share, the oldest dropped first (each holds its compilations).
KEPT_PROGRAMS = 32

#: Programs by layer, then by :func:`plan_key`: a layer's own table, which finds its
#: programs without asking its settings at every call.
_PLANS = KeptBy(PLANS_PER_LAYER)

#: Programs by :func:`layer_settings` and :func:`plan_key`, shared by layers.
_SHARED: Kept[Any] = Kept(KEPT_PROGRAMS)

#: How many eager calls of each signature layers of one settings ran (for the frameworks
#: that count them before a program serves a signature), the oldest dropped first.
_SEEN: Kept[int] = Kept(8 * KEPT_PROGRAMS)

#: The layer each thread's planned call runs for, while it runs: the layer a program's
#: trace reads (:func:`_program`).
_CALLING = threading.local()

#: The call's keyword arguments that are arrays (or ``None``): the program's arguments.
ARRAY_KEYWORDS = ("cache", "head_mask", "positions", "bias", "segment_ids")


def forget() -> None:
    """Drops every layer's programs (and so their compilations) and counts of signatures."""
    _PLANS.clear()
    _SHARED.clear()
    _SEEN.clear()


def _seen_before(signature: tuple[Any, ...], before: int) -> bool:
    """Whether layers of one settings were called ``before`` times with ``signature``
    already (each call counted until then), where a framework's trace costs many eager
    calls (:attr:`~mha_multi.keras._frameworks._Framework.eager_calls_before_plan`): the
    layers of a deep model of one configuration share the count, as they share the
    programs."""
    count = _SEEN.get(signature, 0)
    if count >= before:
        return True
    _SEEN.keep(signature, count + 1)
    return False


def layer_settings(layer: Any) -> tuple[Any, ...]:
    """What a trace reads of ``layer`` besides its variables (whose shapes, dtypes and
    structure ``jax.jit`` keys): its class (whose ``call`` it runs), options, heads,
    dropout rate, autocast and dtype policy. Layers that answer the same run the same
    program: a traced call reads nothing else of its layer."""
    return (
        type(layer),
        layer.options,
        layer._heads,
        layer.dropout,
        layer.autocast,
        layer.dtype_policy.name,
    )


def plan_key(layer: Any, queries: Any, flags: tuple[Any, ...]) -> tuple[Any, ...]:
    """What decides a planned call's program besides its arrays' shapes, dtypes and which
    are given (``jax.jit``'s own key): the call's ``flags``, the layer's settings
    read while tracing, and where the queries live (the kernel a call takes depends
    on the platform)."""
    return (
        flags,
        layer.compute_dtype,
        layer.dropout,
        layer._head_parallel,
        active().plan_place(queries),
    )


def planned_call(
    layer: Any, inputs: tuple[Any, Any, Any, Any], keywords: dict[str, Any]
) -> tuple[Any] | None:
    """An eager call by its plan: ``(returned,)``, the layer's return value, or ``None``
    where the plan does not serve it and the eager flow runs it.

    Args:
        layer: the Keras layer, built.
        inputs: the call's ``(queries, keys, values, valid_lens)``.
        keywords: its other arguments, as :meth:`MultiHeadAttention.call` takes them.

    Raises:
        TypeError, ValueError: as the eager flow (:func:`mha_multi.call.forward`).
    """
    framework = active()
    compile_call = framework.compile_call
    if compile_call is None:
        return None
    arrays = {name: keywords.get(name) for name in ARRAY_KEYWORDS}
    concrete = framework.plan_arrays
    # (The inputs as arrays of the framework: the eager flow's TypeError for others.)
    if not concrete(inputs[:3], numpy=False) or not concrete({"valid_lens": inputs[3], **arrays}):
        return None
    causal = keywords.get("causal", False)
    weights = keywords.get("return_attention_weights", False)
    training = keywords.get("training")
    if not (causal is True or causal is False) or not (weights is True or weights is False):
        return None  # (the eager flow raises on a causal that is no bool)
    if (training and layer.dropout > 0) or not keras_state_is_plain(layer, traced=True):
        return None
    try:
        # (A layer's options are fixed when it is made: others set since get programs anew.)
        plans = _PLANS.of(layer, made_for=layer.options)
        key = plan_key(layer, inputs[0], (causal, weights, bool(training)))
        before = framework.eager_calls_before_plan
        if before:
            signature = call.array_signature((*inputs, *arrays.values()))
            if not _seen_before((layer_settings(layer), key, signature), before):
                return None
        program = plans.get(key)
        if program is None:
            # (Another layer of the same settings may have made it.)
            shared = (layer_settings(layer), key)
            program = _SHARED.get(shared) or _SHARED.keep(
                shared, _program(compile_call, causal, weights, bool(training))
            )
            plans.keep(key, program)
    except TypeError:  # (a setting that cannot be hashed)
        return None
    _CALLING.layer = layer
    try:
        # (In the order of layer.variables, which every layer of these settings makes its
        # variables in: which of them are trainable may differ between layers sharing the
        # program, and within one layer between calls; the flow splits them.)
        returned = program([v.value for v in layer.variables], inputs, arrays)
    finally:
        _CALLING.layer = None
    cache = arrays["cache"]
    if cache is not None:
        # Per call, after the traced checks (as in the eager flow): the lengths are
        # values, which no program can check; the call's result is dropped on an error.
        queries, keys, _, valid_lens = inputs
        num_new = 0 if keys is None else queries.shape[1]
        fill = call.check_cache_values(FACTS, spec.as_kv_cache(cache), valid_lens, num_new)
        if fill is not None:
            # (The next step's check and plan read nothing: docs, "Generating with a cache".)
            WRITTEN_LENGTHS.remember(returned[-1].lengths, fill.held)
    return (returned,)


def _program(
    compile_call: Callable[..., Any], causal: bool, weights: bool, training: bool
) -> Callable[..., Any]:
    """The compiled flow of calls with these flags, for layers of one settings.

    The flow runs the ``stateless_call`` of the layer its thread's call is
    for (:data:`_CALLING`, held only while that call runs: a program holding
    a layer would keep it alive). A trace, the first call of a signature,
    reads that layer's settings, which every layer sharing the program has
    (:func:`layer_settings`); its variables are the program's arguments.
    """

    def flow(values: list[Any], inputs: tuple, arrays: dict) -> Any:
        layer = _CALLING.layer
        # (stateless_call takes the trainable values and the others apart, in the order of
        # the layer's lists: the tracing layer's split, of the values in one order.)
        trainable, non_trainable = [], []
        for variable, value in zip(layer.variables, values, strict=True):
            (trainable if variable.trainable else non_trainable).append(value)
        returned, _ = layer.stateless_call(
            trainable,
            non_trainable,
            *inputs,
            causal=causal,
            return_attention_weights=weights,
            training=training,
            **arrays,
        )
        return returned

    return compile_call(flow)
