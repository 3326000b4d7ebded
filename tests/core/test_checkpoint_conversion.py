"""``convert MODEL_DIR OUT_DIR`` and ``attention_layers`` on checkpoints saved by transformers.

The folders (``tests/fixtures/checkpoints/``: Llama 3, Qwen 3, Gemma 3 in
bfloat16, gpt-oss in nine shards) and each layer's block output in float64
were written by transformers (``tests/fixtures/transformers_checkpoints.py``);
here, with numpy alone, each converted layer is checked against that output
through the float64 spec, the reading one layer at a time, the way back,
and the command's refusals.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli import convert_error
from safetensors.numpy import load_file, save_file
from transformers_checkpoints import CHECKPOINTS, FOLDERS, SPEC_OPTIONS, results, spec_output

from mha_multi import spec
from mha_multi.__main__ import main
from mha_multi.interop import checkpoint_conversion, checkpoint_files
from mha_multi.interop.checkpoint_conversion import MANIFEST, convert_checkpoint, converted_layers
from mha_multi.interop.transformers import attention_layers
from mha_multi.weights import load_weights, save_weights


@pytest.mark.parametrize("model", list(CHECKPOINTS))
def test_converted_layers_compute_the_blocks(model, tmp_path):
    assert main(["convert", str(FOLDERS / model), str(tmp_path / "out")]) == 0
    expected = results()
    layers = list(converted_layers(tmp_path / "out"))
    assert [index for index, _, _ in layers] == [0, 1]
    for index, weights, kwargs in layers:
        output = spec_output(weights, kwargs)
        # float32 weights (Gemma 3's folded scale rounded to them)
        error = np.abs(output - expected[f"{model}.{index}.output"]).max()
        assert error <= 2e-5, f"{model} layer {index}: {error:.3g}"


def test_the_layer_types_give_each_layer_its_settings():
    layers = {index: kwargs for index, _, kwargs in attention_layers(FOLDERS / "gemma3")}
    assert layers[0]["window"] == 4 and layers[0]["rotary"]["theta"] == 100.0
    assert "window" not in layers[1] and layers[1]["rotary"]["theta"] == 10000.0
    assert [i for i, _, _ in attention_layers(FOLDERS / "gpt_oss", layers=[1])] == [1]


def test_a_sharded_checkpoint_is_read_one_layer_at_a_time(monkeypatch, tmp_path):
    """Before each layer is written, only that layer's tensors have been read since the last."""
    read: list[str] = []
    read_before_writing: list[list[str]] = []
    original_tensor, original_save = checkpoint_files.CheckpointFolder.tensor, save_weights

    def counted(self, name):
        read.append(name)
        return original_tensor(self, name)

    def saved(path, weights):
        read_before_writing.append(list(read))
        read.clear()
        original_save(path, weights)

    monkeypatch.setattr(checkpoint_files.CheckpointFolder, "tensor", counted)
    monkeypatch.setattr(checkpoint_conversion, "save_weights", saved)
    assert convert_checkpoint(FOLDERS / "gpt_oss", tmp_path / "out") == [0, 1]
    assert len(read_before_writing) == 2 and not read
    for index, names in enumerate(read_before_writing):
        # 4 weights, 4 biases and the sinks of this layer's attention, nothing else.
        assert len(names) == 9, names
        assert all(name.startswith(f"model.layers.{index}.self_attn.") for name in names), names


def test_the_progress_bar_shows_on_a_terminal_only(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal, pipe = Terminal(), io.StringIO()
    convert_checkpoint(FOLDERS / "qwen3", tmp_path / "a", progress=terminal)
    convert_checkpoint(FOLDERS / "qwen3", tmp_path / "b", progress=pipe)
    assert terminal.getvalue().endswith("] 2/2\n") and "] 1/2" in terminal.getvalue()
    assert pipe.getvalue() == ""


def test_a_fused_checkpoint_converts_and_writes_back(tmp_path):
    """Phi-3's qkv_proj (the porting examples' folder holds layer 0 of 32): split and joined."""
    phi3 = Path(__file__).resolve().parents[2] / "docs" / "examples" / "phi3"
    ((index, weights, kwargs),) = attention_layers(phi3, layers=[0])
    assert index == 0 and kwargs["window"] == 4 and kwargs["rotary"]["fraction"] == 0.5
    expected = np.load(phi3 / "expected.npz")
    output, _ = spec.reference_forward(
        weights,
        *[expected["x"]] * 3,
        num_heads=kwargs["num_heads"],
        causal=True,
        positions=expected["positions"],
        **{name: kwargs[name] for name in SPEC_OPTIONS if name in kwargs},
    )
    np.testing.assert_allclose(output, expected["output"], rtol=0, atol=2e-5)
    copy = tmp_path / "phi3"
    shutil.copytree(phi3, copy)
    assert main(["convert", str(phi3), str(tmp_path / "out"), "--layers", "0"]) == 0
    assert main(["convert", str(tmp_path / "out"), str(copy)]) == 0
    assert (copy / "model.safetensors").read_bytes() == (phi3 / "model.safetensors").read_bytes()


def test_writing_back_gives_the_checkpoint(tmp_path):
    for model in ("gemma3", "gpt_oss"):
        copy = tmp_path / model
        shutil.copytree(FOLDERS / model, copy)
        out = tmp_path / f"{model}-layers"
        assert main(["convert", str(FOLDERS / model), str(out), "--layers", "1"]) == 0
        manifest = json.loads((out / MANIFEST).read_text())
        assert [layer["index"] for layer in manifest["layers"]] == [1]
        # Layer 1 written back over the copy after damaging it.
        damaged = checkpoint_files.CheckpointFolder(copy)
        names = [n for n in damaged.entries if "layers.1.self_attn." in n]
        for new, old in damaged.rewrite({n: np.zeros(damaged.entries[n]["shape"]) for n in names}):
            new.replace(old)
        assert main(["convert", str(out), str(copy)]) == 0
        original, restored = (checkpoint_files.CheckpointFolder(p) for p in (FOLDERS / model, copy))
        assert set(original.entries) == set(restored.entries)
        for name in original.entries:
            # Gemma 3's scale, folded in and taken out, may move a bfloat16 by one step.
            np.testing.assert_allclose(
                restored.tensor(name), original.tensor(name), rtol=2**-8, atol=0, err_msg=name
            )
    # The shards written are safetensors files to the safetensors library too.
    for shard in sorted((tmp_path / "gpt_oss").glob("*.safetensors")):
        theirs, ours = load_file(FOLDERS / "gpt_oss" / shard.name), load_file(shard)
        assert theirs.keys() == ours.keys()
        assert all(np.array_equal(theirs[name], ours[name]) for name in theirs)


def test_a_block_without_an_output_bias_is_written_back(tmp_path):
    """Qwen 2's blocks have biases on q, k and v only, which canonical weights hold with a
    zero ``b_o``: the way back leaves it out, and the checkpoint comes back to the byte
    (it was refused: the weights gave an ``o_proj.bias`` the checkpoint lacks). A ``b_o``
    that is not zero cannot be written into such a checkpoint."""
    folder, out = tmp_path / "qwen2", tmp_path / "layers"
    folder.mkdir()
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rope_theta": 100.0,
    }
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    widths = {"q": 16, "k": 8, "v": 8, "o": 16}
    tensors = {}
    for name, width in widths.items():
        prefix = f"model.layers.0.self_attn.{name}_proj."
        tensors[prefix + "weight"] = rng.standard_normal((width, 16)).astype(np.float32)
        if name != "o":
            tensors[prefix + "bias"] = rng.standard_normal(width).astype(np.float32)
    save_file(tensors, folder / "model.safetensors")
    assert main(["convert", str(folder), str(out)]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert main(["convert", str(out), str(copy)]) == 0
    assert (copy / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    (layer,) = json.loads((out / MANIFEST).read_text())["layers"]
    weights = load_weights(out / layer["weights"])
    save_weights(out / layer["weights"], {**weights, "b_o": np.full(16, 0.5, np.float32)})
    message = convert_error(out, copy)
    assert "a 'qwen2' block has biases on q_proj, k_proj and v_proj only" in message
    assert (copy / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def _broken(tmp_path: Path, model: str, change) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(FOLDERS / model, folder)
    change(folder)
    return folder


def _with_entry(name):
    """A change adding the float32 entry ``name`` to a single-file checkpoint."""

    def change(folder):
        path = folder / "model.safetensors"
        header, start = checkpoint_files.read_header(path)
        data = path.read_bytes()
        tensors = {}
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            tensors[key] = (entry["dtype"], entry["shape"], data[start + begin : start + end])
        tensors[name] = ("F32", [4], np.ones(4, np.float32).tobytes())
        checkpoint_files.write_safetensors(path, tensors)

    return change


def test_rotary_frequencies_of_older_checkpoints_are_skipped(tmp_path):
    """transformers skips them too: they are computed from the config."""
    folder = _broken(
        tmp_path, "llama3", _with_entry("model.layers.0.self_attn.rotary_emb.inv_freq")
    )
    for (_, ours, _), (_, theirs, _) in zip(
        attention_layers(folder), attention_layers(FOLDERS / "llama3"), strict=True
    ):
        assert ours.keys() == theirs.keys()
        assert all(np.array_equal(ours[name], theirs[name]) for name in ours)


def _set(field, value):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        config[field] = value
        (folder / "config.json").write_text(json.dumps(config))

    return change


def _drop(field):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        del config[field]
        (folder / "config.json").write_text(json.dumps(config))

    return change


@pytest.mark.parametrize(
    ("model", "change", "message"),
    [
        ("llama3", lambda f: (f / "config.json").unlink(), "has no config.json"),
        ("llama3", _set("model_type", "granite"), "model_type 'granite' is not known"),
        ("llama3", _set("architectures", ["LlamaForVision"]), "'LlamaForVision' is not known"),
        ("gemma3", _set("attn_logit_softcapping", 30.0), "attn_logit_softcapping=30.0"),
        (
            "llama3",
            _set("attn_logit_softcapping", 0.5),
            "attn_logit_softcapping=0.5 is not supported: transformers' 'llama' blocks",
        ),
        ("gemma3", _drop("query_pre_attn_scalar"), "needs the field 'query_pre_attn_scalar'"),
        (
            "llama3",
            _set("rope_parameters", {"rope_type": "su", "rope_theta": 1.0}),
            "layer 0: rope_type 'su' is not supported",
        ),
        (
            "llama3",
            _with_entry("model.layers.1.self_attn.gate.weight"),
            "layer 1: unexpected Llama attention entries ['gate.weight']",
        ),
        (
            "gpt_oss",
            lambda f: (f / "model-00003-of-00009.safetensors").unlink(),
            "missing shard 'model-00003-of-00009.safetensors'",
        ),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, model, change, message):
    folder = _broken(tmp_path, model, change)
    assert message in convert_error(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_options_that_do_not_apply_are_refused(tmp_path):
    assert "out of range" in convert_error(FOLDERS / "qwen3", tmp_path / "out", "--layers", "2")
    assert "--num-heads is for files" in convert_error(
        FOLDERS / "qwen3", tmp_path / "out", "--num-heads", "4"
    )
    assert "--layers is for a checkpoint folder" in convert_error(
        FOLDERS / "qwen3" / "model.safetensors", tmp_path / "out.npz", "--layers", "0"
    )
    assert "not a list of layer indices" in convert_error(FOLDERS / "qwen3", "out", "--layers", "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    assert "is not an empty folder" in convert_error(FOLDERS / "qwen3", tmp_path / "full")
    # Writing back into another model's checkpoint.
    assert main(["convert", str(FOLDERS / "qwen3"), str(tmp_path / "out")]) == 0
    assert "model_type 'qwen3'" in convert_error(tmp_path / "out", FOLDERS / "llama3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "out"]


def _error(function, *args):
    with pytest.raises(ValueError) as info:
        list(function(*args))
    return str(info.value)


def _edit_layer(**fields):
    def change(manifest):
        manifest["layers"][0].update(fields)

    return change


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: m.pop("model_type"), "its model_type is no string"),
        (lambda m: m.update(layers={"0": {}}), "its layers are no list"),
        (
            lambda m: m["layers"][0].pop("index"),
            "its layers[0] is not {'index': int, 'weights': str",
        ),
        (_edit_layer(index="1"), "is not {'index': int"),
        (_edit_layer(index=True), "is not {'index': int"),
        (_edit_layer(kwargs=None), "is not {'index': int"),
        (_edit_layer(weights="../model/model.safetensors"), "is no file name of the folder"),
        (_edit_layer(weights=""), "is no file name of the folder"),
        (lambda m: m["layers"].append(dict(m["layers"][0])), "it lists a layer twice"),
    ],
)
def test_a_damaged_manifest_is_named_not_a_key_error(tmp_path, change, problem):
    out = tmp_path / "out"
    assert main(["convert", str(FOLDERS / "qwen3"), str(out), "--layers", "1"]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    change(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    shutil.copytree(FOLDERS / "qwen3", tmp_path / "model")
    before = (tmp_path / "model" / "model.safetensors").read_bytes()
    named = f"{str(out / MANIFEST)!r} is not a converted folder's manifest: "
    for message in (convert_error(out, tmp_path / "model"), _error(converted_layers, out)):
        assert named in message and problem in message, message
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == before


def test_the_command_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "nothing"
    missing.mkdir()
    process = subprocess.run(
        [sys.executable, "-m", "mha_multi", "convert", str(missing), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert process.returncode == 2
    assert process.stderr.count("\n") == 1 and "has no config.json" in process.stderr
