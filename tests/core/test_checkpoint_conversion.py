"""``convert MODEL_DIR OUT_DIR`` and ``attention_layers`` on checkpoints saved by transformers.

The folders (``tests/fixtures/checkpoints/``: Llama 3, Qwen 3, Gemma 3 in
bfloat16, gpt-oss in nine shards) and each layer's block output in float64
were written by transformers (``tests/fixtures/transformers_checkpoints.py``);
here, with numpy alone, each converted layer is checked against that output
through the float64 spec, the reading one layer at a time, the way back,
and the command's refusals.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli import convert_error
from transformers_blocks import batch
from transformers_checkpoints import CHECKPOINTS, FOLDERS, results

from mha_multi import spec
from mha_multi.__main__ import main
from mha_multi.interop import checkpoint_files
from mha_multi.interop.checkpoint_conversion import MANIFEST, converted_layers
from mha_multi.interop.transformers import attention_layers

#: The layer's options the float64 spec takes (the rest are the layer's construction).
OPTIONS = ("rotary", "window", "softcap", "sinks", "qk_norm")


@pytest.mark.parametrize("model", list(CHECKPOINTS))
def test_converted_layers_compute_the_blocks(model, tmp_path):
    assert main(["convert", str(FOLDERS / model), str(tmp_path / "out")]) == 0
    expected, data = results(), batch()
    layers = list(converted_layers(tmp_path / "out"))
    assert [index for index, _, _ in layers] == [0, 1]
    for index, weights, kwargs in layers:
        output, _ = spec.reference_forward(
            weights,
            data["x"],
            data["x"],
            data["x"],
            num_heads=kwargs["num_heads"],
            num_kv_heads=kwargs["num_kv_heads"],
            causal=True,
            positions=data["positions"],
            bias=data["bias"],
            **{name: kwargs[name] for name in OPTIONS if name in kwargs},
        )
        output = np.where(data["real"][..., None], output, 0.0)
        # float32 weights (Gemma 3's folded scale rounded to them)
        error = np.abs(output - expected[f"{model}.{index}.output"]).max()
        assert error <= 2e-5, f"{model} layer {index}: {error:.3g}"


def test_the_layer_types_give_each_layer_its_settings():
    layers = {index: kwargs for index, _, kwargs in attention_layers(FOLDERS / "gemma3")}
    assert layers[0]["window"] == 4 and layers[0]["rotary"]["theta"] == 100.0
    assert "window" not in layers[1] and layers[1]["rotary"]["theta"] == 10000.0
    assert [i for i, _, _ in attention_layers(FOLDERS / "gpt_oss", layers=[1])] == [1]


def test_a_sharded_checkpoint_is_read_one_layer_at_a_time(monkeypatch):
    read: list[str] = []
    original = checkpoint_files.CheckpointFolder.tensor

    def counted(self, name):
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(checkpoint_files.CheckpointFolder, "tensor", counted)
    for index, weights, _ in attention_layers(FOLDERS / "gpt_oss"):
        # Only this layer's attention entries (4 weights, 4 biases, sinks) were read since the last.
        assert len(read) == 9 and all(f"layers.{index}.self_attn." in n for n in read), read
        assert "sinks" in weights
        read.clear()


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


def _broken(tmp_path: Path, model: str, change) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(FOLDERS / model, folder)
    change(folder)
    return folder


def _set(field, value):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        config[field] = value
        (folder / "config.json").write_text(json.dumps(config))

    return change


@pytest.mark.parametrize(
    ("model", "change", "message"),
    [
        ("llama3", lambda f: (f / "config.json").unlink(), "has no config.json"),
        ("llama3", _set("model_type", "granite"), "model_type 'granite' is not known"),
        ("llama3", _set("architectures", ["LlamaForVision"]), "'LlamaForVision' is not known"),
        ("gemma3", _set("attn_logit_softcapping", 30.0), "attn_logit_softcapping=30.0"),
        ("gemma3", _set("layer_types", None), "needs the field 'layer_types'"),
        (
            "llama3",
            _set("rope_parameters", {"rope_type": "su", "rope_theta": 1.0}),
            "layer 0: rope_type 'su' is not supported",
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
