"""A transformers checkpoint folder's attention layers as canonical weights and layer arguments.

:func:`attention_layers` reads a folder written by ``save_pretrained``
(``config.json``, one or several ``.safetensors`` files) one layer at a time
with numpy alone, and gives each attention layer's canonical weights and the
constructor arguments :func:`mha_multi.interop.llama.from_llama` would
return for that layer's block: ``MultiHeadAttention.from_canonical(weights,
**kwargs)`` builds it in any framework (docs: "Porting weights").
:func:`attention_state` is the way back, a layer's weights as the entries of
the checkpoint's state dict.

The config is read as transformers reads it for the model types of
:data:`~mha_multi.interop.families.KNOWN_BLOCKS`, and refused where it is
not known: another ``model_type`` or architecture, a field set to what the
layer does not compute, or a field whose default only transformers' config
class knows (:data:`REQUIRED_FIELDS`) left out of the file. What those
classes derive from older configs' fields (layer types, Gemma 3's rotary
settings by layer type) is derived here as they derive it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.interop.checkpoint_files import CONFIG, CheckpointFolder
from mha_multi.interop.families import (
    KNOWN_BLOCKS,
    QK_NORMS,
    SINK_BLOCKS,
    check_config_fields,
    layer_window,
)
from mha_multi.interop.fused_projections import FUSED_PROJECTIONS
from mha_multi.interop.llama_state import (
    PROJECTIONS,
    _canonical_arrays,
    _checked,
    block_arguments,
    fold_scale,
    llama_arrays,
    score_factor,
)
from mha_multi.interop.rotary_config import OWN_CONTEXT_LENGTH

__all__ = ["REQUIRED_FIELDS", "attention_layers", "attention_state", "model_config"]

#: Config fields read with no default here, which the file must hold (a
#: field with ``|`` is any one of those named): every model type's, then each
#: type's own. transformers' config classes fill in a missing one with their
#: default, which this reader does not guess: such a config is refused;
#: ``AutoConfig.from_pretrained(folder).save_pretrained(folder)`` writes them.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "": ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers"),
    # (num_key_value_heads: the config classes' own numbers; Llama's, Cohere's, OLMo 2's
    # and Phi-3's are num_attention_heads, _KV_HEADS_ARE_HEADS. head_dim: Qwen 3's,
    # Gemma's and gpt-oss' classes have their own, not hidden_size / num_attention_heads.)
    "mistral": ("sliding_window", "num_key_value_heads"),
    "qwen2": ("num_key_value_heads",),
    "gemma2": (
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "sliding_window",
        "num_key_value_heads",
        "head_dim",
    ),
    "gemma3_text": (
        "query_pre_attn_scalar",
        "sliding_window",
        "rms_norm_eps",
        "num_key_value_heads",
        "head_dim",
    ),
    "gpt_oss": (
        "sliding_window",
        "rope_parameters|rope_scaling",
        "num_key_value_heads",
        "head_dim",
    ),
    "qwen3": ("rms_norm_eps", "num_key_value_heads", "head_dim"),
    "olmo2": ("rms_norm_eps",),
}
#: Model types whose config class takes a missing ``num_key_value_heads`` as
#: ``num_attention_heads``; a null one too, but where the class takes an integer alone
#: (:data:`_KV_HEADS_INTEGER`), which refuses it.
_KV_HEADS_ARE_HEADS = ("llama", "cohere", "olmo2", "phi3")
_KV_HEADS_INTEGER = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
#: Config fields of sizes, positive integers where given (not null).
_SIZE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "head_dim",
)
#: Model types whose config class takes a missing or null ``head_dim`` as ``hidden_size
#: // num_attention_heads``; and those whose class has no such field, whose block reads a
#: missing one so (a null one it takes as the size, and fails). Where neither, the class
#: has a default of its own: :data:`REQUIRED_FIELDS`.
_HEAD_DIM_DERIVED = ("llama", "mistral")
_HEAD_DIM_READ = ("qwen2", "cohere", "olmo2", "phi3")
#: Model types whose config class's default ``rope_theta`` is not transformers' 10^4
#: (Cohere's 5 * 10^5, gpt-oss' 1.5 * 10^5): their configs must give it.
_OWN_THETA = ("cohere", "gpt_oss")
#: The rotary types that read ``original_max_position_embeddings`` (with Phi-3's names
#: for its ``longrope``).
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope", "su")
#: Model types whose ``sliding_window`` applies only where ``use_sliding_window`` is set
#: (Qwen's: the flag's default is ``False``).
_WINDOW_FLAGGED = ("qwen2", "qwen3")
#: Model types whose blocks have projection biases or not whatever the config says (the
#: projections that have them: Qwen 2's query, key and value, not its output), and
#: those whose ``attention_bias`` decides for all four (its default where the config
#: leaves it out), as transformers builds them.
_BIASES_FIXED = {"mistral": "", "phi3": "", "qwen2": "qkv"}
_BIASES_FIELD_DEFAULT = {
    "llama": False,
    "gemma2": False,
    "gemma3_text": False,
    "cohere": False,
    "qwen3": False,
    "olmo2": False,
    "gpt_oss": True,
}
#: Gemma 3's layer types, by which its config's ``rope_parameters`` are given.
_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
#: Model types whose scores are scaled by ``field ** -0.5`` rather than ``head_dim ** -0.5``.
_SCALE_FIELDS = {"gemma2": "query_pre_attn_scalar", "gemma3_text": "query_pre_attn_scalar"}
#: What follows a known block's class prefix in the architectures whose
#: attention layers are the decoder's (``LlamaForCausalLM``...).
_HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification")
_LAYER = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.")
#: Entries of older checkpoints that transformers skips when it loads them
#: (the rotary inverse frequencies, computed from the config instead).
_SKIPPED = ("rotary_emb.inv_freq",)


def _block_of(model_type: str) -> str:
    """The class name of the attention block of a known model type."""
    return next(name for name, kind in KNOWN_BLOCKS.items() if kind == model_type)


def model_config(config: Mapping[str, Any], *, source: str = CONFIG) -> SimpleNamespace:
    """A checkpoint's ``config.json`` as the attributes the converters read, checked.

    Raises:
        ValueError: an unknown ``model_type`` or architecture, a missing
            field of :data:`REQUIRED_FIELDS`, or a field set to what the
            layer does not compute; naming it.
    """
    model_type = config.get("model_type")
    if model_type not in KNOWN_BLOCKS.values():
        raise ValueError(
            f"{source}: model_type {model_type!r} is not known; the attention converters read "
            f"{', '.join(map(repr, KNOWN_BLOCKS.values()))}"
        )
    for field in REQUIRED_FIELDS[""] + REQUIRED_FIELDS.get(model_type, ()):
        if all(name not in config for name in field.split("|")):
            raise ValueError(
                f"{source}: model_type {model_type!r} needs the field {field!r}, which only "
                "transformers' config class can fill in: re-save the config with "
                "transformers >= 5 (AutoConfig.from_pretrained(...).save_pretrained(...))"
            )
    missing = _class_defaults(config, model_type)
    if missing:
        raise ValueError(
            f"{source}: model_type {model_type!r} needs the field {missing[0]!r} here, whose "
            "default only transformers' config class knows: re-save the config with "
            "transformers >= 5 (AutoConfig.from_pretrained(...).save_pretrained(...))"
        )
    prefix = _block_of(model_type)[: -len("Attention")]
    for architecture in config.get("architectures") or ():
        if architecture not in {prefix + head for head in _HEADS}:
            raise ValueError(
                f"{source}: architecture {architecture!r} is not known; a {model_type!r} "
                f"checkpoint converts as {', '.join(prefix + head for head in _HEADS)}"
            )
    if config.get("rope_parameters") is not None and config.get("rope_scaling") is not None:
        raise ValueError(
            f"{source}: rope_parameters and rope_scaling are both set; transformers then reads "
            "rope_scaling (and rope_theta) alone: keep one of them"
        )
    layer_types = config.get("layer_types")
    if model_type == "mistral" and layer_types and set(layer_types) != {"sliding_attention"}:
        raise ValueError(
            f"{source}: a mistral config with layer_types {sorted(set(layer_types))}: "
            "transformers' Mistral blocks slide on every layer whatever they say, its "
            "Ministral blocks as they say; which one the checkpoint is for is not known"
        )
    parameters = config.get("rope_parameters")
    if (
        model_type == "gemma3_text"
        and parameters is not None
        and not (isinstance(parameters, Mapping) and set(parameters) <= set(_GEMMA3_LAYER_TYPES))
    ):
        raise ValueError(
            f"{source}: a gemma3_text config's rope_parameters are given by layer type "
            f"({', '.join(_GEMMA3_LAYER_TYPES)}); got {parameters!r}"
        )
    namespace = SimpleNamespace(**config)
    if model_type in _WINDOW_FLAGGED:
        if not config.get("use_sliding_window", False):
            namespace.sliding_window = None  # (the window is then unused, the flag off unless set)
        elif "sliding_window" not in config:
            raise ValueError(
                f"{source}: a {model_type!r} config with use_sliding_window needs the field "
                "'sliding_window', whose default only transformers' config class knows: "
                "re-save the config with transformers >= 5 "
                "(AutoConfig.from_pretrained(...).save_pretrained(...))"
            )
    for field in _SIZE_FIELDS:
        value = config.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(
                f"{source}: config {field}={value!r}; transformers' config class takes a "
                "positive integer"
            )
    if config.get("head_dim") is None:
        if "head_dim" in config and model_type not in _HEAD_DIM_DERIVED:
            raise ValueError(
                f"{source}: a {model_type!r} config's head_dim is null, of which transformers "
                "builds no block: give the head size"
                + (
                    ", or leave the field out (hidden_size // num_attention_heads)"
                    if model_type in _HEAD_DIM_READ
                    else ""
                )
            )
        # (Missing, or null where the config class derives it: the block's head size is
        # hidden_size // num_attention_heads, which the tensors are checked against.)
        namespace.head_dim = config["hidden_size"] // config["num_attention_heads"]
        namespace.head_dim_derived = True  # (for messages: no number the file states)
    if config.get("num_key_value_heads") is None:
        if model_type in _KV_HEADS_INTEGER:
            raise ValueError(
                f"{source}: a {model_type!r} config's num_key_value_heads is null, where "
                "transformers' config class takes an integer; give the number of key/value heads"
            )
        # (Missing where _KV_HEADS_ARE_HEADS, REQUIRED_FIELDS otherwise; null: the heads.)
        namespace.num_key_value_heads = config["num_attention_heads"]
    if config.get("layer_types") is None:
        namespace.layer_types = _default_layer_types(namespace)
    if model_type == "gemma3_text":
        namespace.rope_parameters = _gemma3_rope(config)
    check_config_fields(namespace, _block_of(model_type))
    return namespace


def _class_defaults(config: Mapping[str, Any], model_type: str) -> list[str]:
    """The rotary fields ``config`` leaves to its config class's own default: ``rope_theta``
    (:data:`_OWN_THETA`), and with a scaled rotary type ``original_max_position_embeddings``
    (:data:`~mha_multi.interop.rotary_config.OWN_CONTEXT_LENGTH`)."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(parameters, Mapping):
        parameters = {}  # (refused where it is read)
    missing = []
    if model_type in _OWN_THETA and "rope_theta" not in config and "rope_theta" not in parameters:
        missing.append("rope_theta")
    kind = parameters.get("rope_type") or parameters.get("type")
    if (
        model_type in OWN_CONTEXT_LENGTH
        and kind in _ORIGINAL_LENGTH_TYPES
        and config.get("original_max_position_embeddings") is None
    ):
        missing.append("original_max_position_embeddings")
    return missing


def _default_layer_types(config: SimpleNamespace) -> list[str] | None:
    """The layer types transformers' config class gives a config without ``layer_types``.

    Gemma 2 and gpt-oss alternate sliding and full layers; Gemma 3 makes
    every ``sliding_window_pattern``-th layer (6th) full; Qwen's layers from
    ``max_window_layers`` on slide, where its window is used.
    """
    count = int(config.num_hidden_layers)
    period = {"gemma2": 2, "gpt_oss": 2}.get(config.model_type)
    if config.model_type == "gemma3_text":
        period = int(getattr(config, "sliding_window_pattern", 6))
    if period is not None:
        return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(count)]
    if config.model_type in ("qwen2", "qwen3") and getattr(config, "sliding_window", None):
        first = int(getattr(config, "max_window_layers", 28))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(count)]
    return None


def _gemma3_rope(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3's rotary settings by layer type, completed as transformers' config class
    completes them.

    The ``rope_parameters`` of a layer type, or a config before them
    (``rope_scaling`` for the global layers), default settings for a type
    they leave out; a type's ``rope_theta`` where it gives none: the
    config's ``rope_theta`` (10^6 unless given) for the global layers, its
    ``rope_local_base_freq`` (10^4 unless given) for the local ones.
    """
    parameters = config.get("rope_parameters")
    if parameters is None:
        full = {"rope_type": "default", **(config.get("rope_scaling") or {})}
        local = {"rope_type": "default"}
    else:
        full = dict(parameters.get("full_attention") or {"rope_type": "default"})
        local = dict(parameters.get("sliding_attention") or {"rope_type": "default"})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return {"sliding_attention": local, "full_attention": full}


def attention_layers(
    model_dir: str | os.PathLike[str], layers: Iterable[int] | None = None
) -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, Any]]]:
    """Each attention layer of a transformers checkpoint folder: ``(index, weights, kwargs)``.

    The folder is checked before the first layer is given (config, shards,
    every layer's entries named); then each layer's tensors, and only those,
    are read. Weights have the checkpoint's precision (``bfloat16`` read as
    ``float32``); ``kwargs`` are :func:`mha_multi.interop.llama.from_llama`'s
    for that layer (its layer type's rotary settings and window included).

    Args:
        model_dir: the folder (``config.json`` and ``model.safetensors``, or
            shards and ``model.safetensors.index.json``).
        layers: the layers' indices, in the order given; every layer by default.

    Raises:
        FileNotFoundError: no folder, config or weights file; a missing shard.
        ValueError: an unknown model type, architecture or config field
            (:func:`model_config`), a layer index out of range, a layer whose
            entries are missing or are not a known block's; nothing is given
            then for a folder-wide fault, and no further layer for a layer's.
    """
    folder, config, names = _checked_folder(model_dir, layers)
    return _layers(folder, config, names)


def _checked_folder(
    model_dir: str | os.PathLike[str], layers: Iterable[int] | None
) -> tuple[CheckpointFolder, SimpleNamespace, dict[int, str]]:
    """The folder, its config, and each layer asked for -> its entries' prefix."""
    folder = CheckpointFolder(model_dir)
    config = model_config(folder.config, source=os.fspath(folder.path / CONFIG))
    found = {}
    for name in folder.entries:
        match = _LAYER.match(name)
        if match:
            found.setdefault(int(match.group(2)), match.group(0))
    count = int(config.num_hidden_layers)
    indices = list(range(count)) if layers is None else [int(i) for i in layers]
    for index in indices:
        if not 0 <= index < count:
            raise ValueError(f"layer {index} is out of range: the model has {count} layers")
        if index not in found:
            raise ValueError(f"the checkpoint has no entries of layer {index}'s attention")
    return folder, config, {index: found[index] for index in indices}


def _layers(
    folder: CheckpointFolder, config: SimpleNamespace, prefixes: dict[int, str]
) -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, Any]]]:
    block = _block_of(config.model_type)
    for index, prefix in prefixes.items():
        names = [name for name in folder.entries if name.startswith(prefix)]
        state = {name: folder.tensor(name) for name in names if not name.endswith(_SKIPPED)}
        try:
            arrays = _canonical_arrays(state, prefix, sinks=block in SINK_BLOCKS)
            heads, weights, _ = _checked(
                arrays, config.num_attention_heads, getattr(config, "num_key_value_heads", None)
            )
            _check_fits(config, heads, weights, output_bias=f"{prefix}o_proj.bias" in state)
            precision = weights["W_o"].dtype
            kwargs = block_arguments(weights, config, heads, **_layer_facts(config, index, heads))
        except ValueError as error:
            raise ValueError(f"layer {index}: {error}") from error
        yield index, {name: array.astype(precision) for name, array in weights.items()}, kwargs


def _check_fits(
    config: SimpleNamespace,
    heads: spec.Heads,
    weights: Mapping[str, Any],
    *,
    output_bias: bool | None = None,
) -> None:
    """Raises where the config says of a layer what its tensors do not hold.

    transformers builds the block from the config and fails on tensors of
    other sizes, or initialises biases the checkpoint lacks and leaves out
    those its block does not have: the layer read from the tensors would
    compute something else (docs: "Porting weights"). ``output_bias``:
    whether the checkpoint holds ``o_proj``'s bias (canonical weights hold a
    zero ``b_o`` where it holds the others' alone); ``None``: where
    ``weights`` hold ``b_o``.
    """
    stated = {
        "hidden_size": (getattr(config, "hidden_size", None), weights["W_q"].shape[0]),
        "head_dim": (getattr(config, "head_dim", None), heads.head_dim),
    }
    for field, (value, held) in stated.items():
        if value is not None and int(value) != held:
            said = f"config {field}={value!r}"
            if field == "head_dim" and getattr(config, "head_dim_derived", False):
                said = f"config head_dim (none given: hidden_size // num_attention_heads = {value})"
            raise ValueError(
                f"{said} does not fit the checkpoint's tensors, which hold {field} {held}"
            )
    model_type = config.model_type
    if model_type in _BIASES_FIXED:
        biased = _BIASES_FIXED[model_type]
        said = f"a {model_type!r} block has {_BIASES[biased]}"
    elif model_type in _BIASES_FIELD_DEFAULT:
        field = bool(getattr(config, "attention_bias", _BIASES_FIELD_DEFAULT[model_type]))
        biased, said = ("qkvo" if field else ""), f"config attention_bias={field!r}"
    else:
        return
    held = "qkv" if "b_q" in weights else ""
    if "b_o" in weights if output_bias is None else output_bias:
        held += "o"
    if biased != held:
        raise ValueError(
            f"{said}, but the checkpoint holds {_BIASES[held]}: transformers' block "
            "would compute without them or with biases of its own"
        )


#: The projections with biases (canonical weights hold none, those of q, k and v, or all
#: four), in words.
_BIASES = {
    "": "no projection biases",
    "qkv": "biases on q_proj, k_proj and v_proj only",
    "qkvo": "biases on all four projections",
}


def _layer_facts(config: SimpleNamespace, index: int, heads: spec.Heads) -> dict[str, Any]:
    """What a block of layer ``index`` would say of itself: class, norms, window, scale, type."""
    model_type = config.model_type
    qk_norm = None
    if model_type in QK_NORMS:
        qk_norm = {**QK_NORMS[model_type][1], "eps": float(config.rms_norm_eps)}
    scale_field = _SCALE_FIELDS.get(model_type)
    scale = getattr(config, scale_field) if scale_field else heads.head_dim
    layer_types = getattr(config, "layer_types", None)
    return {
        "block": _block_of(model_type),
        "qk_norm": qk_norm,
        "window": layer_window(config, index),
        "scaling": float(scale) ** -0.5,
        "layer_type": layer_types[index] if layer_types else None,
    }


def attention_state(
    config: SimpleNamespace, index: int, weights: Mapping[str, Any], prefix: str
) -> dict[str, np.ndarray]:
    """Layer ``index``'s canonical weights as the checkpoint's entries, under ``prefix``.

    The inverse of :func:`attention_layers` for one layer: the score scale
    folded in on the way in is taken out, a fused projection (Phi-3's) joined.

    Raises:
        ValueError: weights that do not fit the config's heads.
    """
    weights = {name: np.asarray(array) for name, array in weights.items()}
    heads, weights, _ = _checked(
        weights, config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    )
    # (Canonical weights hold a zero b_o where the block's output has no bias.)
    no_output_bias = _BIASES_FIXED.get(config.model_type) == "qkv" and "b_o" in weights
    if no_output_bias and np.any(weights["b_o"] != 0):
        raise ValueError(
            f"a {config.model_type!r} block has {_BIASES['qkv']}; the weights' b_o is not "
            "zero, which its checkpoint cannot hold"
        )
    facts = _layer_facts(config, index, heads)
    factor = score_factor(facts["scaling"], heads.head_dim)
    if factor != 1.0:
        fold_scale(weights, 1.0 / factor, facts["qk_norm"])
    layout = config.model_type if config.model_type in FUSED_PROJECTIONS else None
    state = llama_arrays(weights, heads.num_heads, heads.num_kv_heads, layout)
    if no_output_bias:
        del state[f"{PROJECTIONS['o']}.bias"]
    return {prefix + name: array for name, array in state.items()}
