"""The checkpoint folders every backend converts hold what transformers computes.

``tests/fixtures/checkpoints/`` and ``transformers_checkpoints.npz`` were
written by ``tests/fixtures/transformers_checkpoints.py``; here, where
transformers is installed, each folder loads with ``from_pretrained`` into a
model whose blocks give the stored outputs, and
:func:`~mha_multi.interop.transformers.attention_layers` gives, from the
files alone, the arguments :func:`~mha_multi.interop.llama.from_llama`
gives of each loaded block, for their configs as transformers 5 writes
them and as older configs on the Hub hold them (the fields transformers'
config classes derive layer types and Gemma 3's rotary settings from).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
from transformers_blocks import attention_results  # noqa: E402
from transformers_checkpoints import CHECKPOINTS, FOLDERS, loaded, results, spec_output  # noqa: E402

from mha_multi import spec  # noqa: E402
from mha_multi.interop.families import KNOWN_BLOCKS, layer_window  # noqa: E402
from mha_multi.interop.llama import from_llama  # noqa: E402
from mha_multi.interop.rotary_config import WHOLE_HEAD_ROTARY, rotary_of  # noqa: E402
from mha_multi.interop.transformers import _check_fits, attention_layers, model_config  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402


@pytest.mark.parametrize("model", list(CHECKPOINTS))
def test_folders_hold_what_transformers_computes(model):
    lm = loaded(FOLDERS / model)
    stored = results()
    converted = {index: kwargs for index, _, kwargs in attention_layers(FOLDERS / model)}
    for index, layer in enumerate(lm.model.layers):
        computed = attention_results(layer.self_attn, lm.model.rotary_emb)
        for name, value in computed.items():
            np.testing.assert_allclose(value, stored[f"{model}.{index}.{name}"], rtol=0, atol=1e-12)
        assert converted[index] == from_llama(layer.self_attn)[1]


def _older(config: dict, **fields) -> dict:
    """``config`` without the fields transformers 5 derives, with ``fields`` to derive them."""
    kept = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    return {**kept, **fields}


def _without(config: dict, name: str) -> dict:
    return {k: v for k, v in config.items() if k != name}


#: name -> (model, its config as written before transformers 5, or with a field left
#: out whose default transformers' config class applies).
OLDER_CONFIGS = {
    "gemma3": (
        "gemma3",
        lambda config: _older(
            config,
            sliding_window_pattern=2,
            rope_local_base_freq=100.0,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "gpt_oss": ("gpt_oss", lambda config: _without(config, "layer_types")),
    "qwen3": (
        "qwen3",
        lambda config: _older(
            config,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            rope_theta=100.0,
        ),
    ),
    # Qwen's window is off unless use_sliding_window says so (its default: False).
    "qwen3, window without use_sliding_window": (
        "qwen3",
        lambda config: _without(
            _older(config, sliding_window=3, max_window_layers=1, rope_theta=100.0),
            "use_sliding_window",
        ),
    ),
    # Gemma 3's settings by layer type without their rope_theta: the global layers' is
    # the config's own (10^6 unless given), the local ones' its rope_local_base_freq.
    "gemma3, settings by layer type without rope_theta": (
        "gemma3",
        lambda config: {
            **config,
            "rope_local_base_freq": 50.0,
            "rope_parameters": {
                kind: _without(parameters, "rope_theta")
                for kind, parameters in config["rope_parameters"].items()
            },
        },
    ),
    # ... and without one layer type's settings: the default rotation, at its theta.
    "gemma3, the settings of one layer type": (
        "gemma3",
        lambda config: {
            **config,
            "rope_theta": 300.0,
            "rope_parameters": {"sliding_attention": {"rope_type": "default"}},
        },
    ),
}


@pytest.mark.parametrize("name", list(OLDER_CONFIGS))
def test_older_configs_read_as_transformers_reads_them(name, tmp_path):
    model, older = OLDER_CONFIGS[name]
    folder = tmp_path / model
    shutil.copytree(FOLDERS / model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(older(config)))
    lm = loaded(folder)
    converted = {index: kwargs for index, _, kwargs in attention_layers(folder)}
    assert converted == {
        index: from_llama(layer.self_attn)[1] for index, layer in enumerate(lm.model.layers)
    }


#: name -> (model, the config's fields changed): configs whose rotary settings or layer
#: types transformers' model reads otherwise than its config's first reading says.
EDITED_CONFIGS = {
    # The rotary embedding takes the config's own field over its parameters' (llama3's 4).
    "llama3, its own original_max_position_embeddings": (
        "llama3",
        {"original_max_position_embeddings": 4096},
    ),
    # A YaRN factor of None: the ratio of the context lengths (16 / 4).
    "llama3, yarn without a factor": (
        "llama3",
        {
            "max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 100.0,
                "factor": None,
                "original_max_position_embeddings": 4,
            },
        },
    ),
    # Settings by layer type where one of the two types has no layer.
    "gemma3, every layer sliding": (
        "gemma3",
        {"layer_types": ["sliding_attention", "sliding_attention"]},
    ),
}


@pytest.mark.parametrize("name", list(EDITED_CONFIGS))
def test_edited_configs_convert_to_what_the_loaded_model_computes(name, tmp_path):
    """Each layer read from the folder gives, through the float64 spec, its block's output
    in the model transformers loads from the folder."""
    model, fields = EDITED_CONFIGS[name]
    folder = tmp_path / model
    shutil.copytree(FOLDERS / model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    lm = loaded(folder)
    for index, weights, kwargs in attention_layers(folder):
        expected = attention_results(lm.model.layers[index].self_attn, lm.model.rotary_emb)
        output = spec_output(weights, kwargs)
        # (Gemma 3's scale folded into float32 weights.)
        np.testing.assert_allclose(output, expected["output"], rtol=0, atol=2e-5, err_msg=name)


#: (model, config field, value, the refusal): a config that says of the layers what the
#: tensors do not hold, or that transformers reads otherwise than its fields say.
CONTRADICTED = {
    "head_dim": ("llama3", "head_dim", 16, "head_dim=16 does not fit the checkpoint's tensors"),
    "hidden_size": ("qwen3", "hidden_size", 16, "hidden_size=16 does not fit"),
    "biases said, none held": (
        "llama3",
        "attention_bias",
        True,
        "attention_bias=True, but the checkpoint holds no projection biases",
    ),
    "biases held, none said": (
        "gpt_oss",
        "attention_bias",
        False,
        "attention_bias=False, but the checkpoint holds biases on all four projections",
    ),
    "rope_scaling beside rope_parameters": (
        "qwen3",
        "rope_scaling",
        {"rope_type": "linear", "factor": 2.0},
        "rope_parameters and rope_scaling are both set",
    ),
    # transformers takes it (its scaled tables are zeros); the layer does not.
    "an attention factor of 0": (
        "llama3",
        "rope_parameters",
        {
            "rope_type": "yarn",
            "rope_theta": 100.0,
            "factor": 2.0,
            "attention_factor": 0.0,
            "original_max_position_embeddings": 4,
        },
        "LlamaAttention's settings are not the layer's: rotary.scaling.attention_factor",
    ),
    "gemma3's rope_parameters not by layer type": (
        "gemma3",
        "rope_parameters",
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0},
        "given by layer type",
    ),
}


@pytest.mark.parametrize("name", list(CONTRADICTED))
def test_configs_the_tensors_contradict_are_refused(name, tmp_path):
    """transformers fails on such a folder, or computes with biases the checkpoint does
    not hold, or without those it holds, or with other rotary settings: nothing is
    converted."""
    model, field, value, match = CONTRADICTED[name]
    folder = tmp_path / model
    shutil.copytree(FOLDERS / model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=re.escape(match)):
        list(attention_layers(folder))


#: Fields beside the sizes that each model type's reader needs here.
_KV_FIELDS = {
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4,
    "rope_theta": 100.0,
    "query_pre_attn_scalar": 8,
    "attn_logit_softcapping": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
}


@pytest.mark.parametrize("given", ["left out", "null"])
@pytest.mark.parametrize(
    "model_type",
    ["llama", "cohere", "olmo2", "phi3", "qwen2", "qwen3", "mistral", "gemma2", "gpt_oss"],
)
def test_key_value_heads_read_as_the_config_class_reads_them(model_type, given):
    """A config without ``num_key_value_heads``: Llama's, Cohere's, OLMo 2's and Phi-3's
    classes take the query heads; the others' own numbers (Mistral's 8, Qwen's 32...),
    which only they know, are refused. A null is the query heads where the class takes
    one (Qwen's too), and refused where transformers' class takes an integer alone."""
    fields = {**_SIZES, "model_type": model_type, **_KV_FIELDS}
    if model_type != "gpt_oss":
        del fields["rope_parameters"]
    if given == "null":
        fields["num_key_value_heads"] = None
    try:
        theirs = transformers.AutoConfig.for_model(**copy.deepcopy(fields))
    except Exception as error:  # (huggingface_hub's strict check: an integer field's null)
        assert "num_key_value_heads" in str(error)
        theirs = None
    if given == "left out" and model_type not in ("llama", "cohere", "olmo2", "phi3"):
        assert theirs.num_key_value_heads != 2  # (the class's own number)
        with pytest.raises(ValueError, match="needs the field 'num_key_value_heads'"):
            model_config(fields)
    elif theirs is None:
        with pytest.raises(ValueError, match="num_key_value_heads is null"):
            model_config(fields)
    else:
        assert model_config(fields).num_key_value_heads == theirs.num_key_value_heads == 2


def test_grouped_tensors_of_a_config_without_key_value_heads_are_refused(tmp_path):
    """Llama's config class takes the missing field as the 4 query heads, where the
    tensors hold 2 key/value heads: transformers fails to load them, and so does the
    reader (it read the heads from the tensors)."""
    folder = tmp_path / "llama3"
    shutil.copytree(FOLDERS / "llama3", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(_without(config, "num_key_value_heads")))
    with pytest.raises(ValueError, match=re.escape("layer 0: W_k must have num_kv_heads")):
        list(attention_layers(folder))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_qwen_window_without_its_size_is_refused(model_type):
    """Qwen's config classes give a window of their own size (4096) where
    ``use_sliding_window`` is set and ``sliding_window`` left out: the reader, which
    does not know it, refuses (it read no window)."""
    fields = {
        **_SIZES,
        "model_type": model_type,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": True,
    }
    with pytest.raises(ValueError, match="use_sliding_window needs the field 'sliding_window'"):
        model_config(fields)


def test_a_mistral_config_with_layer_types_is_refused():
    """transformers' Mistral blocks slide on every layer, its Ministral blocks (which
    ``AutoModel`` makes of such a config) by layer type: not knowing which the
    checkpoint is for, the reader refuses layer types other than all sliding."""
    config = {
        "model_type": "mistral",
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "sliding_window": 3,
    }
    mixed = {**config, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ValueError, match="slide on every layer"):
        model_config(mixed)
    sliding = model_config({**config, "layer_types": ["sliding_attention"] * 2})
    assert [layer_window(sliding, index) for index in range(2)] == [3, 3]


def test_blocks_with_fixed_biases_refuse_tensors_that_differ():
    """A Mistral or Phi-3 block has no projection biases whatever its config says: a
    checkpoint that holds them is refused."""
    weights = init_weights(16, seed=0, num_heads=2, bias=True)
    heads = spec.heads_of_weights(weights, 2)
    unbiased = {k: v for k, v in weights.items() if not k.startswith("b_")}
    for model_type in ("mistral", "phi3"):
        config = SimpleNamespace(model_type=model_type, hidden_size=16, attention_bias=True)
        with pytest.raises(ValueError, match=f"a '{model_type}' block has no projection biases"):
            _check_fits(config, heads, weights)
        _check_fits(config, heads, unbiased)
    # Qwen 2's query, key and value projections have biases, its output projection none.
    config = SimpleNamespace(model_type="qwen2", hidden_size=16, attention_bias=False)
    said = "a 'qwen2' block has biases on q_proj, k_proj and v_proj only, but the checkpoint"
    with pytest.raises(ValueError, match=f"{said} holds biases on all four projections"):
        _check_fits(config, heads, weights, output_bias=True)
    with pytest.raises(ValueError, match=f"{said} holds no projection biases"):
        _check_fits(config, heads, unbiased)
    _check_fits(config, heads, {**weights, "b_o": np.zeros(16)}, output_bias=False)


#: The fields every config below holds (two layers of 2 heads of 8).
_SIZES = {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 2}
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
#: name -> a config whose rotary settings transformers' config class reads otherwise
#: than at first sight: its own fields over the parameters', or its own defaults.
ROTARY_READINGS = {
    # Phi-3's own original_max_position_embeddings over its parameters'.
    "phi3, its own context length": {
        "model_type": "phi3",
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 8,
        "rope_parameters": {
            **_LONGROPE,
            "rope_theta": 100.0,
            "original_max_position_embeddings": 16,
        },
    },
    # Any config's own field over its parameters', as the rotary embedding reads it.
    "llama, its own context length": {
        "model_type": "llama",
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 32,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 100.0,
            "factor": 2.0,
            "original_max_position_embeddings": 16,
        },
    },
    "llama, its own context length alone": {
        "model_type": "llama",
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0},
    },
    "llama, the context length for yarn": {
        "model_type": "llama",
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0},
    },
    # Only Phi-3's blocks rotate part of each head.
    "qwen3, partial_rotary_factor": {
        "model_type": "qwen3",
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "partial_rotary_factor": 0.5,
    },
    "phi3, partial_rotary_factor": {
        "model_type": "phi3",
        "rope_theta": 100.0,
        "partial_rotary_factor": 0.5,
    },
    "cohere, rope_theta": {"model_type": "cohere", "rope_theta": 300.0},
}


@pytest.mark.parametrize("name", list(ROTARY_READINGS))
def test_rotary_settings_read_as_the_config_class_reads_them(name):
    fields = {**_SIZES, **ROTARY_READINGS[name]}
    # (A copy: transformers' config changes the parameters it is given.)
    theirs = transformers.AutoConfig.for_model(**copy.deepcopy(fields))
    # As a rotary embedding reads them when it computes its frequencies (the config's
    # fields then its attributes).
    theirs.standardize_rope_params()
    parameters = theirs.rope_parameters
    rotary = rotary_of(model_config(fields))
    assert rotary["theta"] == parameters["rope_theta"]
    partial = fields["model_type"] not in WHOLE_HEAD_ROTARY
    assert rotary["fraction"] == (parameters.get("partial_rotary_factor", 1.0) if partial else 1.0)
    if "original_max_position_embeddings" in parameters:
        original = parameters["original_max_position_embeddings"]
        assert rotary["scaling"]["original_max_position_embeddings"] == original


#: name -> (a config leaving out a field its rotary settings read, the refusal).
ROTARY_DEFAULTS_UNKNOWN = {
    # Cohere's and gpt-oss' config classes' rope_theta is not transformers' 10^4.
    "cohere without rope_theta": ({"model_type": "cohere"}, "needs the field 'rope_theta'"),
    "gpt_oss, rope_scaling without rope_theta": (
        {
            "model_type": "gpt_oss",
            "num_key_value_heads": 2,
            "head_dim": 8,
            "sliding_window": 4,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
        },
        "needs the field 'rope_theta'",
    ),
    # Phi-3's config class has its own original_max_position_embeddings (4096).
    "phi3's longrope without its context length": (
        {
            "model_type": "phi3",
            "rope_scaling": {**_LONGROPE, "original_max_position_embeddings": 8},
        },
        "needs the field 'original_max_position_embeddings'",
    ),
    # The config classes' max_position_embeddings differ by model type.
    "dynamic without max_position_embeddings": (
        {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "reads the config's max_position_embeddings, which it lacks",
    ),
    "llama3 without either context length": (
        {
            "model_type": "llama",
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 2.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        },
        "reads the config's max_position_embeddings, which it lacks",
    ),
}


@pytest.mark.parametrize("name", list(ROTARY_DEFAULTS_UNKNOWN))
def test_rotary_fields_only_a_config_class_knows_are_refused(name):
    fields, match = ROTARY_DEFAULTS_UNKNOWN[name]
    with pytest.raises(ValueError, match=re.escape(match)):
        rotary_of(model_config({**_SIZES, **fields}))


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_settings_by_layer_type_where_the_blocks_share_one_are_refused(model, tmp_path):
    """Only Gemma 3's blocks take rotary settings by layer type: Llama's model reads one
    (transformers' default frequencies, off by 0.4 to 0.75 had each layer taken its
    type's), Qwen 3's fails to load. A folder of such settings, and a
    block's config, are refused rather than read layer by layer."""
    folder = tmp_path / model
    shutil.copytree(FOLDERS / model, folder)
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    config["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    }
    (folder / "config.json").write_text(json.dumps(config))
    match = f"which model_type {config['model_type']!r} does not read"
    with pytest.raises(ValueError, match=re.escape(match)):
        list(attention_layers(folder))
    block_config = SimpleNamespace(
        model_type=config["model_type"],
        layer_types=config["layer_types"],
        rope_parameters=config["rope_parameters"],
    )
    with pytest.raises(ValueError, match=re.escape(match)):
        rotary_of(block_config, "sliding_attention")


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "gemma3_text", "gpt_oss"])
def test_a_config_without_its_head_size_is_refused_where_the_class_has_its_own(model_type):
    """Qwen 3's, Gemma's and gpt-oss' config classes have a head size of their own, not
    ``hidden_size / num_attention_heads``: transformers builds blocks of it, which the
    checkpoint's tensors do not fit. The reader, which does not know it, refuses."""
    fields = {**_SIZES, "model_type": model_type, **_KV_FIELDS, "num_key_value_heads": 2}
    if model_type == "gemma3_text":  # (its rotary settings are by layer type)
        del fields["rope_parameters"]
    theirs = transformers.AutoConfig.for_model(**copy.deepcopy(_without(fields, "head_dim")))
    assert theirs.head_dim != _SIZES["hidden_size"] // _SIZES["num_attention_heads"]
    with pytest.raises(ValueError, match="needs the field 'head_dim'"):
        model_config(_without(fields, "head_dim"))
    assert model_config(fields).head_dim == 8


def test_settings_by_layer_type_beside_other_fields_are_refused():
    """transformers reads the layer types' settings alone: a field beside them is unread."""
    config = SimpleNamespace(
        model_type="gemma3_text",
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100.0},
            "rope_theta": 5.0,
        },
    )
    with pytest.raises(ValueError, match=re.escape("beside field(s) ['rope_theta'] of no layer")):
        rotary_of(config, "sliding_attention")
    del config.rope_parameters["rope_theta"]
    assert rotary_of(config, "sliding_attention")["theta"] == 10.0


def test_every_known_model_type_says_whether_its_blocks_rotate_whole_heads():
    """A family added to the known blocks is classified: Phi-3's blocks alone rotate
    part of each head (``apply_rotary_pos_emb`` with a pass-through part)."""
    assert set(KNOWN_BLOCKS.values()) - WHOLE_HEAD_ROTARY == {"phi3"}
    assert set(KNOWN_BLOCKS.values()) >= WHOLE_HEAD_ROTARY


def _block_head_dim(fields: dict) -> int | None:
    """The head size of the attention block transformers builds of ``fields``, or
    ``None`` where it builds none (its config class or the block refuses them)."""
    try:
        config = transformers.AutoConfig.for_model(**copy.deepcopy(fields))
        block = next(name for name, kind in KNOWN_BLOCKS.items() if kind == fields["model_type"])
        module = getattr(transformers, block[: -len("Attention")] + "ForCausalLM").__module__
        attention = getattr(__import__(module, fromlist=[block]), block)(config, layer_idx=0)
    except Exception:  # (huggingface_hub's strict check, or the block's)
        return None
    return attention.head_dim


@pytest.mark.parametrize("given", ["left out", "null", 4, 8])
@pytest.mark.parametrize(
    "model_type",
    ["llama", "cohere", "olmo2", "phi3", "qwen2", "qwen3", "mistral", "gemma2", "gpt_oss"],
)
def test_the_head_size_is_read_as_transformers_builds_its_blocks(model_type, given):
    """A config's ``head_dim``, given, left out or null: the reader's is the head size
    of the block transformers builds of it (Llama's and Mistral's classes take a missing
    or null one as ``hidden_size // num_attention_heads``, the blocks of the classes
    without the field a missing one; a null one they fail on), or it refuses where
    transformers builds none or one of a size of its class's own."""
    fields = {**_SIZES, "model_type": model_type, **_KV_FIELDS, "num_key_value_heads": 2}
    if model_type != "gpt_oss":
        del fields["rope_parameters"]
    if given == "left out":
        del fields["head_dim"]
    else:
        fields["head_dim"] = None if given == "null" else given
    theirs = _block_head_dim(fields)
    if theirs is None or (given == "left out" and theirs != 8):
        with pytest.raises(ValueError, match="head_dim"):
            model_config(fields)
    else:
        assert model_config(fields).head_dim == theirs


@pytest.mark.parametrize(
    "field, value",
    [("head_dim", 8.9), ("head_dim", 8.0), ("hidden_size", "16"), ("num_attention_heads", True)],
)
def test_sizes_that_are_no_positive_integers_are_refused(field, value):
    """transformers' config classes take integers: a size of another type (truncated,
    it would convert layers of another size than the config says) is refused, named."""
    fields = {**_SIZES, "model_type": "llama", "num_key_value_heads": 2, field: value}
    with pytest.raises(ValueError, match=re.escape(f"config {field}={value!r}")):
        model_config(fields)


@pytest.mark.parametrize("given", ["left out", "null"])
def test_tensors_of_another_head_size_than_the_derived_one_are_refused(given, tmp_path):
    """A Llama config without a head size: transformers builds blocks of ``hidden_size //
    num_attention_heads`` (4) and fails to load tensors of head size 8; nothing is
    converted, and the message says where the 4 comes from."""
    config = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields = _without(fields, "head_dim") if given == "left out" else {**fields, "head_dim": None}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    match = "config head_dim (none given: hidden_size // num_attention_heads = 4) does not fit"
    with pytest.raises(ValueError, match=re.escape(match)):
        list(attention_layers(tmp_path))
