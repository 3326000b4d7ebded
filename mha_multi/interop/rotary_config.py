"""transformers' rotary settings as the layer's ``rotary=`` argument (docs: "Porting weights").

A config's ``rope_parameters`` (or, before transformers 5, ``rope_scaling``
and ``rope_theta``), its ``partial_rotary_factor`` and its model type's
pairing of the rotated entries, read into the plain values
:class:`mha_multi.spec.Rotary` takes; a rotary type it does not compute, or
a field of a type's parameters it does not know, is refused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["INTERLEAVED_ROTARY", "rotary_of"]

#: Model types whose rotary embedding pairs entry ``2 i`` with ``2 i + 1``
#: (Cohere's ``rotate_half``); the others pair ``i`` with ``i + dim / 2``.
INTERLEAVED_ROTARY = frozenset({"cohere"})


def rotary_of(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The ``rotary=`` argument of transformers' rotary settings in ``config``.

    The pairing of the rotated entries is the model type's
    (:data:`INTERLEAVED_ROTARY`). A config whose ``rope_parameters`` are
    keyed by layer type (Gemma 3's ``sliding_attention`` and
    ``full_attention``) gives those of ``layer_type``.

    Every rotary type of transformers' ``ROPE_INIT_FUNCTIONS`` for these
    families is read: ``default``, ``linear``, ``dynamic`` (with the
    config's ``max_position_embeddings``), ``yarn``, ``longrope`` (its
    ``factor``, where not given, the ratio of ``max_position_embeddings`` to
    ``original_max_position_embeddings``, as transformers takes it) and
    ``llama3``, in the ``scaling`` of :class:`mha_multi.spec.Rotary`.

    Args:
        config: the model's config.
        layer_type: the block's layer type (its ``layer_type``), for a config
            of rotary settings by layer type.

    Raises:
        ValueError: another rotary type, or a field of a rotary type's
            parameters that transformers' type does not define (named):
            nothing is converted then; a config of settings by layer type
            without a ``layer_type`` it has settings for.
    """
    parameters = _layer_parameters(config, layer_type)
    if not parameters:  # transformers before rope_parameters
        parameters = dict(getattr(config, "rope_scaling", None) or {})
        parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = parameters.pop("rope_type", None) or parameters.pop("type", None) or "default"
    parameters.pop("type", None)
    rotary: dict[str, Any] = {
        "theta": float(parameters.pop("rope_theta")),
        # transformers 5 reads it from rope_parameters (Phi-3's configs hold it there only).
        "fraction": float(
            parameters.pop("partial_rotary_factor", None)
            or getattr(config, "partial_rotary_factor", None)
            or 1.0
        ),
    }
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"rope_type {kind!r} is not supported; the rotary types are "
            f"{', '.join(map(repr, _ROPE_KEYS))}"
        )
    unknown = sorted(set(parameters) - set(_ROPE_KEYS[kind]))
    if unknown:
        raise ValueError(
            f"rope_parameters field(s) {unknown} of rope_type {kind!r} are not supported; "
            f"its fields are {', '.join(_ROPE_KEYS[kind]) or 'none'} (with rope_type, "
            "rope_theta and partial_rotary_factor)"
        )
    if kind != "default":
        rotary["scaling"] = _scaling_of(kind, parameters, config)
    if getattr(config, "model_type", None) in INTERLEAVED_ROTARY:
        rotary["interleaved"] = True
    return rotary


#: Each rotary type's fields in ``rope_parameters`` beside ``rope_type``,
#: ``rope_theta`` and ``partial_rotary_factor`` (transformers' own validation's).
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "longrope": (
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "factor",
        "attention_factor",
    ),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}


def _scaling_of(kind: str, parameters: dict[str, Any], config: Any) -> dict[str, Any]:
    """The ``scaling`` of a type's checked ``rope_parameters``, read as transformers reads it."""
    # transformers treats these as unset where None (and YaRN's betas and
    # mscales where 0: ``or`` and truthiness in its code).
    falsy_unset = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    scaling = {
        name: value
        for name, value in parameters.items()
        if value is not None and not (name in falsy_unset and not value)
    }
    longest = getattr(config, "max_position_embeddings", None)
    if kind in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" not in scaling:
        # transformers' standardize_rope_params: the config's own field, else its context length.
        original = getattr(config, "original_max_position_embeddings", None) or longest
        scaling["original_max_position_embeddings"] = original
    if kind == "dynamic":
        scaling["max_position_embeddings"] = longest
    if kind == "longrope" and "factor" not in scaling:
        # transformers: the ratio of the context lengths, where the config has no factor.
        scaling["factor"] = longest / scaling["original_max_position_embeddings"]
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            scaling[name] = [float(value) for value in scaling[name]]
    return {"rope_type": kind, **scaling}


def _layer_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    """``config.rope_parameters``, those of ``layer_type`` where they are keyed by layer type."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not (parameters and set(parameters) <= layer_types):
        return parameters
    if layer_type not in parameters or parameters[layer_type] is None:
        raise ValueError(
            f"the config's rope_parameters are given by layer type ({sorted(parameters)}); "
            f"layer_type {layer_type!r} has none: pass the block's own layer type"
        )
    return dict(parameters[layer_type])
