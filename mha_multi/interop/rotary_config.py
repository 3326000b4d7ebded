"""transformers' rotary settings as the layer's ``rotary=`` argument (docs: "Porting weights").

A config's ``rope_parameters`` (or, before transformers 5, ``rope_scaling``
and ``rope_theta``), its ``partial_rotary_factor`` and its model type's
pairing of the rotated entries, read into the plain values
:class:`mha_multi.spec.Rotary` takes; a rotary type it does not compute is
refused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["INTERLEAVED_ROTARY", "rotary_of"]

#: Model types whose rotary embedding pairs entry ``2 i`` with ``2 i + 1``
#: (Cohere's ``rotate_half``); the others pair ``i`` with ``i + dim / 2``.
INTERLEAVED_ROTARY = frozenset({"cohere"})


def rotary_of(config: Any) -> dict[str, Any]:
    """The ``rotary=`` argument of transformers' rotary settings in ``config``.

    The pairing of the rotated entries is the model type's
    (:data:`INTERLEAVED_ROTARY`).

    Raises:
        ValueError: a rotary type other than transformers' ``default`` and
            ``llama3`` (not supported).
    """
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if not parameters:  # transformers before rope_parameters
        parameters = dict(getattr(config, "rope_scaling", None) or {})
        parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    rotary: dict[str, Any] = {
        "theta": float(parameters["rope_theta"]),
        # transformers 5 reads it from rope_parameters (Phi-3's configs hold it there only).
        "fraction": float(
            parameters.get("partial_rotary_factor")
            or getattr(config, "partial_rotary_factor", None)
            or 1.0
        ),
    }
    if kind == "llama3":
        rotary["scaling"] = {name: parameters[name] for name in _LLAMA3_SCALING}
    elif kind != "default":
        raise ValueError(
            f"rope_type {kind!r} is not supported; the rotary types are 'default' and 'llama3'"
        )
    if getattr(config, "model_type", None) in INTERLEAVED_ROTARY:
        rotary["interleaved"] = True
    return rotary


_LLAMA3_SCALING = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
