"""What a layer gives the call flow and gets back: its projections, the call's result.

A backend's layer is :class:`Projections` to the flow (its heads, input sizes
and projections); every call returns a :class:`Result`. The framework's side
of the contract is :class:`~mha_multi.call.facts.Facts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from mha_multi import spec

Array = Any
#: A call's array arguments, as its errors name them.
INPUT_NAMES = ("queries", "keys", "values")
#: The shapes a call's ``bias`` and ``head_mask`` may have, as the facts' errors word them.
BIAS_SHAPE = "broadcastable to (batch, num_heads, num_queries, num_keys)"
GATES_SHAPE = "of shape (num_heads,) or (batch, num_heads)"


class Projections(Protocol):
    """What the driver asks of a layer: its heads, sizes and projections."""

    @property
    def heads(self) -> spec.Heads:
        """The heads this call computes (a sharded layer's own share)."""

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where not known yet."""

    def project_inputs(
        self, queries: Array, keys: Array | None, values: Array | None
    ) -> tuple[Any, ...]:
        """``(q, k, v)``: the projected inputs; ``k`` and ``v`` ``None`` without keys."""

    def qk_norm_weights(self) -> tuple[Array, Array]:
        """``(q_norm, k_norm)``: the query/key norms' weights, in the projections' dtype.

        Asked only of a layer with ``qk_norm`` (:func:`mha_multi.spec.normalize_qk`).
        """

    def sink_logits(self) -> Array:
        """The ``(H,)`` sink logits of the heads this call computes (a layer with
        ``sinks=True``; docs: "Positions and biases"), after :meth:`project_inputs`."""

    def project_output(self, context: Array, gates: Array | None) -> Array:
        """``W_o`` (and ``b_o``) of the heads' context gated by ``gates``.

        The gating is :func:`mha_multi.spec.apply_head_mask`; where a 16-bit
        product is taken and rounded is the layer's fact.
        """


class Result(NamedTuple):
    """What :func:`attend` computes: the output, the weights and the cache."""

    output: Array
    #: ``(B, H, Q, K)`` pre-dropout weights, ``None`` unless asked for (or fused).
    weights: Array | None
    #: The cache after the call; ``None`` for a call without one.
    cache: spec.KVCache | None

    def returned(self, return_attention_weights: bool) -> Any:
        """The layer's return value: the output, then the weights and the cache where given."""
        if self.cache is None:
            return (self.output, self.weights) if return_attention_weights else self.output
        if return_attention_weights:
            return self.output, self.weights, self.cache
        return self.output, self.cache


#: The call's arguments that may be tuples of arrays, and of how many: a cache's
#: keys, values and lengths, and the queries' and keys' segment ids.
TUPLE_ARGUMENTS = {"cache": 3, "segment_ids": 2}


def all_arrays_of(arrays: Iterable[Any] | Mapping[str, Any], array_types: tuple[type, ...]) -> bool:
    """Whether each of ``arrays`` is ``None`` or of one of ``array_types`` (the exact type:
    no subclass, no tracer): the arguments a call plan's compiled program takes.

    Given as a mapping of the call's keywords, a cache and segment ids may be
    tuples of such arrays (:data:`TUPLE_ARGUMENTS`); no other argument may (a
    tuple elsewhere, which the eager flow refuses naming it, would reach the
    program as a tuple of traced arrays).
    """
    if not isinstance(arrays, Mapping):
        return all(x is None or type(x) in array_types for x in arrays)
    for name, x in arrays.items():
        if x is None or type(x) in array_types:
            continue
        if (type(x) is tuple or type(x) is spec.KVCache) and len(x) == TUPLE_ARGUMENTS.get(name):
            for y in x:
                if type(y) not in array_types:
                    return False
            continue
        return False
    return True


def array_signature(arrays: Iterable[Any]) -> tuple[Any, ...]:
    """The shapes and dtypes of ``arrays``, each ``None``, an array (a variable) or a
    tuple, list or dict of them: what a call plan's program is traced for besides the
    call's flags (``jax.jit``'s and ``tf.function``'s own keys)."""
    # (A loop, not a generator: each of a generator's items is a Python call, and a
    # planned call asks at every call.)
    signature: list[Any] = []
    for x in arrays:
        kind = type(x)
        if x is None:
            signature.append(None)
        elif kind is tuple or kind is list or kind is spec.KVCache:
            signature.append(array_signature(x))
        elif kind is dict:
            signature.append(array_signature(x.values()))
        else:
            signature.append((tuple(x.shape), x.dtype))
    return tuple(signature)
