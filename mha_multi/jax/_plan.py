"""The call plan of eager NNX calls: a call's whole flow as one compiled program per signature.

An eager call of :class:`mha_multi.jax.MultiHeadAttention` (concrete arrays,
no dropout) runs :func:`mha_multi.call.forward`, its checks, projections,
positions, kernel, output and cache update, as one ``jax.jit`` program
(docs: "Fast paths"). The program is made once per :class:`PlanKey` (what
decides the route besides the arrays: the layer's settings, the call's
flags, where the queries live) and ``jax.jit`` traces it once per shapes,
dtypes and given arguments; a repeated call with the same signature is one
dispatch of the compiled program. The parameters and the cache are its
arguments, never closed over, so a changed weight is seen by the next call.

The checks of shapes and dtypes run while the program is traced, as in any
traced call, and raise there; the check that reads values, a cached call's
lengths against its capacity, cannot run inside a program and runs on every
call here (:func:`planned_call`). Anything the plan does not cover (tracers,
numpy or Python arguments, dropout, unhashable settings) takes the eager flow
of :func:`mha_multi.call.forward`, which computes the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mha_multi import call, spec
from mha_multi.jax import _facts
from mha_multi.jax._facts import JaxFacts
from mha_multi.jax._kernel import platform
from mha_multi.jax._projections import WeightsProjections
from mha_multi.spec.memo import Kept

__all__ = ["KEPT_PLANS", "LayerSettings", "PlanKey", "forget", "planned_call"]

#: How many plans are kept; the oldest is dropped first (each holds its compilations).
KEPT_PLANS = 32


class LayerSettings(NamedTuple):
    """What of the NNX layer decides a call's route: its static attributes."""

    options: spec.LayerOptions
    heads: tuple[int, int, int]  # num_heads, num_kv_heads, head_dim
    dtype: Any
    precision: Any
    implementation: str | None
    head_parallel: bool
    dropout_rate: float


class PlanKey(NamedTuple):
    """A plan's signature besides the arrays' shapes and dtypes (which ``jax.jit`` keys on)."""

    settings: LayerSettings
    causal: bool
    return_attention_weights: bool
    # Where the queries live: the kernel a call chooses depends on the platform.
    sharding: Any
    # The trace reads the CPU budget of the generic path's pieces.
    piece_bytes: int


_PLANS: Kept[Callable[..., call.Result]] = Kept(KEPT_PLANS)
_ARRAY_TYPE: type | None = None


def forget() -> None:
    """Drops every plan (and so its compilations)."""
    _PLANS.clear()


def _concrete(x: Any) -> bool:
    """Whether ``x`` is a concrete JAX array (no tracer, no numpy array, no Python number)."""
    global _ARRAY_TYPE
    if _ARRAY_TYPE is None:
        # Made at the first call, not at import: an array initialises JAX's backend.
        # (Evaluated, so that a first call under a trace makes no tracer.)
        with jax.ensure_compile_time_eval():
            _ARRAY_TYPE = type(jnp.zeros(()))
    return type(x) is _ARRAY_TYPE


def _program(key: PlanKey, on: str) -> Callable[..., call.Result]:
    """The compiled flow of calls of ``key``'s signature on platform ``on``."""
    settings = key.settings
    heads = spec.Heads(*settings.heads)

    def flow(
        params: Mapping[str, jax.Array], inputs: tuple[Any, ...], arrays: Mapping[str, Any]
    ) -> call.Result:
        sizes = {
            f"{name}_size": params[f"W_{name[0]}"].shape[0] for name in ("query", "key", "value")
        }
        return call.forward(
            JaxFacts(settings.precision, settings.implementation, platform=on),
            WeightsProjections(
                params, heads, sizes, dtype=settings.dtype, precision=settings.precision
            ),
            *inputs,
            causal=key.causal,
            return_attention_weights=key.return_attention_weights,
            **arrays,
            layer_options=settings.options,
            dropout_rate=settings.dropout_rate,
            head_parallel=settings.head_parallel,
        )

    return jax.jit(flow)


def planned_call(
    settings: LayerSettings,
    params: Mapping[str, Any],
    inputs: tuple[Any, Any, Any, Any],
    arrays: Mapping[str, Any],
    *,
    causal: Any,
    return_attention_weights: Any,
) -> call.Result | None:
    """An eager call without dropout by its plan, or ``None`` where the plan does not serve.

    Args:
        settings: the layer's.
        params: the layer's parameters' stored arrays, under their canonical names.
        inputs: the call's ``(queries, keys, values, valid_lens)``.
        arrays: the call's ``cache``, ``head_mask``, ``positions``, ``bias``
            and ``segment_ids`` (:func:`mha_multi.call.forward`'s keywords).
        causal, return_attention_weights: the call's flags.

    Returns:
        The :class:`mha_multi.call.Result` of the call, or ``None`` for a call
        the plan does not serve: one whose arguments or parameters are not all
        concrete JAX arrays (traced, numpy, sequences), whose flags are not
        bools, or whose settings cannot be hashed. The eager flow then runs it.

    Raises:
        TypeError, ValueError: as :func:`mha_multi.call.forward`.
    """
    queries, keys, _, valid_lens = inputs
    if not _concrete(queries):
        return None
    array_types = (_ARRAY_TYPE,)
    if not (
        call.all_arrays_of(inputs, array_types)
        and call.all_arrays_of(arrays, array_types)
        and call.all_arrays_of(params.values(), array_types)
    ):
        return None
    if not (causal is True or causal is False) or not (
        return_attention_weights is True or return_attention_weights is False
    ):
        return None
    key = PlanKey(
        settings, causal, return_attention_weights, queries.sharding, _facts.CPU_PIECE_BYTES
    )
    try:
        program = _PLANS.get(key)
    except TypeError:  # a precision or an option that cannot be hashed
        return None
    if program is None:
        program = _PLANS.keep(key, _program(key, platform(queries)))
    result = program(params, inputs, arrays)
    cache = arrays["cache"]
    if cache is not None:
        # Per call, after the traced checks (as in the eager flow): the lengths are
        # values, which no program can check; the step's result is dropped on an error.
        cache = spec.as_kv_cache(cache)  # (a plain tuple of the three is a cache too)
        lengths = np.asarray(cache.lengths)
        new = None if valid_lens is None else np.asarray(valid_lens)
        num_new = 0 if keys is None else queries.shape[1]
        spec.check_cache_values(lengths, new, num_new, cache.keys.shape[2])
    return result
