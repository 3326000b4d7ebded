"""transformers' rotary settings as the layer's ``rotary=`` argument (docs: "Porting weights").

A config's ``rope_parameters`` (or, before transformers 5, ``rope_scaling``
and ``rope_theta``), its ``partial_rotary_factor`` and its model type's
pairing of the rotated entries, read into the plain values
:class:`mha_multi.spec.Rotary` takes; a rotary type it does not compute, or
a field of a type's parameters it does not know, is refused.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "INTERLEAVED_ROTARY",
    "OWN_CONTEXT_LENGTH",
    "ROPE_BY_LAYER_TYPE",
    "WHOLE_HEAD_ROTARY",
    "rotary_of",
]

#: Model types whose rotary embedding pairs entry ``2 i`` with ``2 i + 1``
#: (Cohere's ``rotate_half``); the others pair ``i`` with ``i + dim / 2``.
INTERLEAVED_ROTARY = frozenset({"cohere"})
#: Known model types whose blocks rotate whole heads: their default rotary type does
#: not read ``partial_rotary_factor``, and a scaled one that does gives fewer
#: frequencies than their rotation takes (transformers' forward fails). Phi-3's
#: blocks, and configs of no known model type, rotate the first fraction of each head.
WHOLE_HEAD_ROTARY = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "cohere", "olmo2", "gpt_oss"}
)
#: Model types whose config class has an ``original_max_position_embeddings`` of its
#: own (Phi-3's, 4096 unless given): a config of theirs always has the field, which a
#: scaled rotary type takes over its parameters' (as any config's field of that name).
OWN_CONTEXT_LENGTH = frozenset({"phi3"})
#: Model types whose blocks take rotary settings by layer type where the config's
#: ``rope_parameters`` are keyed by its ``layer_types`` (Gemma 3's: a rotary embedding
#: per layer type); the others' blocks share one, of settings given once.
ROPE_BY_LAYER_TYPE = frozenset({"gemma3_text"})
#: Model types whose config class reads these rotary types as another (Phi-3's).
_RENAMED_TYPES = {"phi3": {"su": "longrope", "yarn": "longrope"}}


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
    ``llama3``, in the ``scaling`` of :class:`mha_multi.spec.Rotary`. Their
    ``original_max_position_embeddings`` is the config's own field of that
    name where it has one (Phi-3's always, :data:`OWN_CONTEXT_LENGTH`), as
    transformers' rotary embedding takes it when it computes its
    frequencies, else the parameters', else ``max_position_embeddings``
    (settings by layer type: the parameters', else
    ``max_position_embeddings``). A YaRN ``factor`` of ``None`` is the ratio
    of ``max_position_embeddings`` to ``original_max_position_embeddings``,
    as transformers takes it. Phi-3's ``su``
    and ``yarn`` are its ``longrope``. ``partial_rotary_factor`` is read except
    where the model type's blocks rotate whole heads
    (:data:`WHOLE_HEAD_ROTARY`), whose default rotary type rotates whole
    heads whatever it says.

    Args:
        config: the model's config.
        layer_type: the block's layer type (its ``layer_type``), for a config
            of rotary settings by layer type.

    Raises:
        ValueError: another rotary type, or a field of a rotary type's
            parameters that transformers' type does not define (named):
            nothing is converted then; a config of settings by layer type
            without a ``layer_type`` it has settings for; a
            ``partial_rotary_factor`` other than 1 with a scaled rotary type
            where the blocks rotate whole heads; a layer type's YaRN
            ``truncate`` of false, which transformers does not read; settings
            by layer type where the model type's blocks share one rotary
            embedding (:data:`ROPE_BY_LAYER_TYPE`); a
            ``max_position_embeddings`` that the rotary type reads and the
            config lacks; an ``original_max_position_embeddings`` of ``None``
            that it reads; settings by layer type beside fields of no layer
            type.
    """
    parameters, by_layer_type = _layer_parameters(config, layer_type)
    if not parameters:  # transformers before rope_parameters
        parameters = dict(getattr(config, "rope_scaling", None) or {})
    # (transformers' standardize_rope_params: the config's own rope_theta where the
    # parameters have none, else its config class's default, 10^4 for the types that
    # reach here without one: a checkpoint folder's config must give the others',
    # mha_multi.interop.transformers.model_config.)
    if parameters.get("rope_theta") is None:
        parameters["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    model_type = getattr(config, "model_type", None)
    kind = parameters.pop("rope_type", None) or parameters.pop("type", None) or "default"
    parameters.pop("type", None)
    kind = _RENAMED_TYPES.get(model_type, {}).get(kind, kind)
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
    if rotary["fraction"] != 1.0 and model_type in WHOLE_HEAD_ROTARY:
        if kind != "default":
            raise ValueError(
                f"partial_rotary_factor {rotary['fraction']} with rope_type {kind!r} is not "
                f"supported for model_type {model_type!r}: its blocks rotate whole heads, and "
                "transformers' scaled rotary types then give fewer frequencies than they take"
            )
        rotary["fraction"] = 1.0  # (its default rotary type does not read the factor)
    if by_layer_type and "truncate" in parameters:
        # transformers' YaRN reads truncate from the config's rope_parameters themselves,
        # which by layer type hold none: it truncates whatever a layer type's say.
        truncate = parameters.pop("truncate")
        if truncate is not None and not truncate:
            raise ValueError(
                f"rope_parameters[{layer_type!r}] sets truncate={truncate!r}, which "
                "transformers does not read for rotary settings by layer type (it truncates): "
                "leave it out"
            )
    if kind != "default":
        rotary["scaling"] = _scaling_of(kind, parameters, config, by_layer_type=by_layer_type)
    if model_type in INTERLEAVED_ROTARY:
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


def _scaling_of(
    kind: str, parameters: dict[str, Any], config: Any, *, by_layer_type: bool
) -> dict[str, Any]:
    """The ``scaling`` of a type's checked ``rope_parameters``, read as transformers reads
    it (``by_layer_type``: those of a layer type, of settings given by layer type)."""
    # transformers treats these as unset where None (and YaRN's betas and
    # mscales where 0: ``or`` and truthiness in its code).
    falsy_unset = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    scaling = {
        name: value
        for name, value in parameters.items()
        if value is not None and not (name in falsy_unset and not value)
    }
    if kind in ("llama3", "yarn", "longrope"):
        # transformers' standardize_rope_params, which its rotary embedding runs again as
        # it computes the frequencies (when every field of a config is its attribute): the
        # config's own original_max_position_embeddings over the parameters' (but in
        # settings by layer type), else the parameters', else the config's context length.
        if not by_layer_type and hasattr(config, "original_max_position_embeddings"):
            own = config.original_max_position_embeddings
            if own is None:
                raise ValueError(
                    f"rope_type {kind!r} reads the config's original_max_position_embeddings "
                    "over its parameters', and the config's is null: give a length, or leave "
                    "the field out"
                )
            scaling["original_max_position_embeddings"] = own
        elif "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = _context_length(config, kind)
    if kind == "yarn" and "factor" not in scaling and "factor" in parameters:
        # transformers: the ratio of the context lengths, where the factor is None.
        longest = _context_length(config, kind)
        scaling["factor"] = longest / scaling["original_max_position_embeddings"]
    if kind == "dynamic":
        scaling["max_position_embeddings"] = _context_length(config, kind)
    if kind == "longrope" and "factor" not in scaling:
        # transformers: the ratio of the context lengths, where the config has no factor.
        longest = _context_length(config, kind)
        scaling["factor"] = longest / scaling["original_max_position_embeddings"]
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            scaling[name] = [float(value) for value in scaling[name]]
    return {"rope_type": kind, **scaling}


def _context_length(config: Any, kind: str) -> int:
    """The config's ``max_position_embeddings``, which rotary type ``kind`` reads.

    Raises:
        ValueError: the config has none (its config class's default, which a checkpoint's
            config without it would take, is not known here).
    """
    longest = getattr(config, "max_position_embeddings", None)
    if longest is None:
        raise ValueError(
            f"rope_type {kind!r} reads the config's max_position_embeddings, which it lacks: "
            "only transformers' config class knows its default (re-save the config with "
            "transformers >= 5)"
        )
    return longest


def _layer_parameters(config: Any, layer_type: str | None) -> tuple[dict[str, Any], bool]:
    """``config.rope_parameters``, those of ``layer_type`` where they are keyed by layer type,
    and whether they are."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    layer_types = set(getattr(config, "layer_types", None) or ())
    # (transformers' nested_rope_parameter_keys: given by layer type where any key is a
    # layer type of the config's layers; another layer type's settings are not read.)
    if not set(parameters) & layer_types:
        return parameters, False
    model_type = getattr(config, "model_type", None)
    if model_type not in ROPE_BY_LAYER_TYPE:
        raise ValueError(
            f"the config's rope_parameters are given by layer type "
            f"({sorted(set(parameters) & layer_types)}), which model_type {model_type!r} "
            "does not read: its blocks share one rotary embedding (transformers reads "
            f"settings by layer type for {', '.join(map(repr, sorted(ROPE_BY_LAYER_TYPE)))} "
            "alone); give its rotary settings once"
        )
    stray = sorted(
        key for key, value in parameters.items() if not (value is None or isinstance(value, dict))
    )
    if stray:
        raise ValueError(
            f"the config's rope_parameters are given by layer type ({sorted(layer_types)}), "
            f"beside field(s) {stray} of no layer type, which transformers does not read: "
            "leave them out, or give them in each layer type's settings"
        )
    if layer_type not in parameters or parameters[layer_type] is None:
        raise ValueError(
            f"the config's rope_parameters are given by layer type ({sorted(parameters)}); "
            f"layer_type {layer_type!r} has none: pass the block's own layer type"
        )
    return dict(parameters[layer_type]), True
