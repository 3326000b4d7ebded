"""``python -m mha_multi convert`` between canonical files and torch checkpoints."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from cli import PREFIX, convert_error
from llama_support import llama_attention, llama_output

from mha_multi import spec
from mha_multi.__main__ import convert, main
from mha_multi.interop import FORMATS, detect_format, load, save
from mha_multi.interop.torch import checkpoint_format
from mha_multi.weights import init_weights, load_weights, save_weights


@pytest.mark.parametrize("kind", ["torch-mha", "torch-d2l"])
@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_canonical_to_torch_and_back_is_bit_exact(tmp_path, kind, suffix):
    weights = init_weights(8, bias=True, seed=5)
    source = tmp_path / f"weights{suffix}"
    save_weights(source, weights)
    checkpoint = tmp_path / "layer.pt"
    convert(source, checkpoint, destination_format=kind, num_heads=2)
    state = torch.load(checkpoint, weights_only=True)
    assert ("in_proj_weight" in state) == (kind == "torch-mha")
    back = tmp_path / f"back{suffix}"
    convert(checkpoint, back)  # the layout is recognised from the keys
    loaded = load_weights(back)
    assert all(loaded[k].tobytes() == weights[k].tobytes() for k in weights)


def test_native_checkpoint_loads_into_our_layer(tmp_path):
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    torch.save(module.state_dict(), tmp_path / "native.pt")
    assert main(["convert", str(tmp_path / "native.pt"), str(tmp_path / "w.safetensors")]) == 0
    from mha_multi.torch import MultiHeadAttention, set_weights

    layer = set_weights(
        MultiHeadAttention(8, 2, bias=True), load_weights(tmp_path / "w.safetensors")
    )
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 5, 8), dtype=np.float32))
    with torch.no_grad():
        expected, _ = module.eval()(x, x, x, need_weights=False)
        np.testing.assert_allclose(layer.eval()(x, x, x).numpy(), expected.numpy(), atol=5e-6)


def test_clear_errors(tmp_path, capsys):
    save_weights(tmp_path / "w.npz", init_weights(8))
    assert main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "w.ckpt")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    assert (
        main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "o.pt"), "--num-heads", "3"]) == 2
    )
    assert "not divisible by --num-heads (3)" in capsys.readouterr().err
    torch.save({"W_q.weight": torch.zeros(8, 7)}, tmp_path / "bad.pt")
    assert main(["convert", str(tmp_path / "bad.pt"), str(tmp_path / "o.npz")]) == 2
    assert "missing 'W_k'" in capsys.readouterr().err


def test_command_line_entry_point(tmp_path):
    save_weights(tmp_path / "w.safetensors", init_weights(4, bias=True))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_multi",
            "convert",
            str(tmp_path / "w.safetensors"),
            str(tmp_path / "w.pt"),
            "--to",
            "torch-mha",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "W_q (4, 4)" in result.stdout


NOT_A_CHECKPOINT = "is not a PyTorch checkpoint that torch.load(weights_only=True) reads: "


def test_format_that_does_not_match_the_file(tmp_path):
    source = tmp_path / "w.npz"
    save_weights(source, init_weights(8))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_multi",
            "convert",
            str(source),
            str(tmp_path / "o.npz"),
            "--from",
            "torch-mha",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"{PREFIX}{str(source)!r} {NOT_A_CHECKPOINT}"
        "file in archive is not in a subdirectory: W_q.npy"
    ]


def test_damaged_and_foreign_checkpoints(tmp_path):
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    native = tmp_path / "native.pt"
    torch.save(module.state_dict(), native)
    data = native.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    assert convert_error(truncated, tmp_path / "o.npz") == (
        f"{str(truncated)!r} {NOT_A_CHECKPOINT}"
        "PytorchStreamReader failed reading zip archive: failed finding central directory"
    )
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert convert_error(empty, tmp_path / "o.npz") == (
        f"{str(empty)!r} {NOT_A_CHECKPOINT}EOFError"
    )
    # Bytes that are no pickle: torch's KeyError says only the key it missed.
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"hello world garbage")
    assert convert_error(junk, tmp_path / "o.npz") == (
        f"{str(junk)!r} {NOT_A_CHECKPOINT}KeyError: 101"
    )
    # The layout named by --from is checked against the keys.
    assert convert_error(native, tmp_path / "o.npz", "--from", "torch-d2l") == (
        "unexpected entry 'in_proj_weight' in a d2l MultiHeadAttention state_dict"
    )
    # Objects that weights_only=True refuses to build are reported, not loaded.
    pickled = tmp_path / "numpy.pt"
    torch.save({"W_q.weight": np.zeros((8, 8), np.float32)}, pickled)
    message = convert_error(pickled, tmp_path / "o.npz")
    assert message.startswith(f"{str(pickled)!r} {NOT_A_CHECKPOINT}Unsupported global: ")
    assert not (tmp_path / "o.npz").exists()


def test_destination_in_a_missing_directory(tmp_path):
    source = tmp_path / "w.npz"
    save_weights(source, init_weights(8))
    destination = tmp_path / "none" / "o.pt"
    assert convert_error(source, destination) == (
        f"no such directory: {str(tmp_path / 'none')!r} (for {str(destination)!r})"
    )


@pytest.mark.parametrize("name", ["torch-mha", "torch-d2l"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".PT"])
def test_checkpoints_are_recognised_as_registry_formats(tmp_path, name, suffix):
    weights = init_weights(8, bias=True, seed=1)
    path = tmp_path / f"layer{suffix}"
    save(path, weights, name)
    assert checkpoint_format(path) == name
    assert detect_format(path, reading=True) == name in FORMATS
    assert detect_format(path, reading=False) == "torch-d2l"  # the default for writing
    back = load(path)
    assert all(back[k].tobytes() == weights[k].tobytes() for k in weights)


def test_native_module_checkpoint_is_torch_mha(tmp_path):
    module = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=3, bias=False)
    torch.save(module.state_dict(), tmp_path / "native.pth")
    assert detect_format(tmp_path / "native.pth", reading=True) == "torch-mha"
    assert load(tmp_path / "native.pth")["W_v"].shape == (3, 8)


def test_checkpoint_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    assert convert_error(tmp_path / "list.pt", tmp_path / "o.npz") == (
        f"{str(tmp_path / 'list.pt')!r} does not hold a state_dict"
    )
    assert convert_error(tmp_path / "list.pt", tmp_path / "o.npz", "--from", "torch-mha") == (
        f"{str(tmp_path / 'list.pt')!r} does not hold a state_dict"
    )


# -- llama: Llama-style attention state dicts ---------------------------------------------


def save_state(path, state):
    """``torch.save``, or safetensors for a ``.safetensors`` name (what checkpoints use)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({name: tensor.contiguous() for name, tensor in state.items()}, path)
    else:
        torch.save(state, path)


# (num_heads, num_kv_heads, head_dim): GQA with a head size of its own, MQA, MHA.
LLAMA_HEADS = [(4, 2, 6), (4, 1, 8), (4, 4, 4)]


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".safetensors"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), LLAMA_HEADS)
def test_llama_checkpoint_gives_the_module_output(
    tmp_path, capsys, suffix, num_heads, num_kv_heads, head_dim
):
    module = llama_attention(num_heads, num_kv_heads, head_dim, bias=True)
    checkpoint = tmp_path / f"attention{suffix}"
    save_state(checkpoint, module.state_dict())
    assert detect_format(checkpoint, reading=True) == "llama"
    canonical = tmp_path / "canonical.npz"
    # num_kv_heads comes from the shapes, and is printed.
    assert main(["convert", str(checkpoint), str(canonical), "--num-heads", str(num_heads)]) == 0
    printed = capsys.readouterr().out.rstrip()
    assert printed.endswith(
        f"num_heads {num_heads}, num_kv_heads {num_kv_heads}, head_dim {head_dim}"
    )
    weights = load_weights(canonical)
    x = np.random.default_rng(1).standard_normal((2, 5, 16))
    for causal in (False, True):
        expected = llama_output(module, torch.from_numpy(x), causal=causal)
        output, _ = spec.reference_forward(
            weights, x, x, x, None, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal
        )
        np.testing.assert_allclose(output, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("bias", [False, True])
def test_canonical_to_llama_loads_into_the_module_and_back(tmp_path, suffix, bias):
    heads = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 6}
    weights = init_weights(16, bias=bias, seed=7, dtype=np.float64, **heads)
    source = tmp_path / "canonical.safetensors"
    save_weights(source, weights)
    checkpoint = tmp_path / f"llama{suffix}"
    # --head-dim alone fixes the layout; writing a shared suffix as llama takes --to.
    assert main(["convert", str(source), str(checkpoint), "--to", "llama", "--head-dim", "6"]) == 0
    if suffix == ".pt":
        state = torch.load(checkpoint, weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(checkpoint)
    assert sorted(state) == sorted(
        f"{p}_proj.{kind}" for p in "qkvo" for kind in (("weight", "bias") if bias else ("weight",))
    )
    module = llama_attention(4, 2, 6, bias=bias, seed=9)
    module.load_state_dict(state, strict=True)
    x = np.random.default_rng(2).standard_normal((3, 4, 16))
    expected, _ = spec.reference_forward(weights, x, x, x, None, num_heads=4, causal=True)
    np.testing.assert_allclose(
        llama_output(module, torch.from_numpy(x), causal=True), expected, rtol=0, atol=1e-12
    )
    back = tmp_path / "back.npz"
    assert main(["convert", str(checkpoint), str(back), "--num-kv-heads", "2"]) == 0
    restored = load_weights(back)
    assert all(restored[k].tobytes() == weights[k].tobytes() for k in weights)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("prefix", ["self_attn.", "model.layers.0.self_attn."])
def test_llama_entries_under_a_prefix(tmp_path, suffix, prefix):
    module = llama_attention(4, 2, 6, bias=False)
    state = {prefix + name: tensor for name, tensor in module.state_dict().items()}
    # A decoder layer's other entries are not the attention's: ignored.
    state["mlp.up_proj.weight"] = torch.zeros(3, 16, dtype=torch.float64)
    state[prefix.replace("self_attn.", "input_layernorm.weight")] = torch.ones(16)
    checkpoint = tmp_path / f"layer{suffix}"
    save_state(checkpoint, state)
    assert detect_format(checkpoint, reading=True) == "llama"
    weights = load(checkpoint, num_heads=4)
    for letter in "qkvo":
        np.testing.assert_array_equal(
            weights[f"W_{letter}"], getattr(module, f"{letter}_proj").weight.detach().numpy().T
        )
    # Written back without the prefix.
    save(tmp_path / "bare.pt", weights, "llama", num_heads=4)
    assert sorted(torch.load(tmp_path / "bare.pt", weights_only=True)) == sorted(
        f"{p}_proj.weight" for p in "qkvo"
    )


def test_bfloat16_llama_safetensors(tmp_path):
    module = llama_attention(4, 2, 6, bias=True)
    state = {name: tensor.to(torch.bfloat16) for name, tensor in module.state_dict().items()}
    save_state(tmp_path / "model.safetensors", state)
    weights = load(tmp_path / "model.safetensors", num_heads=4)
    # float32 holds every bfloat16 value: the numbers are the file's exactly.
    assert weights["W_q"].dtype == np.float32
    np.testing.assert_array_equal(weights["W_q"], state["q_proj.weight"].float().numpy().T)
    np.testing.assert_array_equal(weights["b_k"], state["k_proj.bias"].float().numpy())


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_checkpoint_recogniser_tells_llama_apart(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    torch.save(llama_attention(4, 2, 6, bias=False).state_dict(), path)
    assert checkpoint_format(path) == "llama"
    torch.save({"W_q.weight": torch.zeros(2, 2)}, path)
    assert checkpoint_format(path) == "torch-d2l"
    torch.save(torch.nn.MultiheadAttention(8, 2).state_dict(), path)
    assert checkpoint_format(path) == "torch-mha"
    assert detect_format(path, reading=False) == "torch-d2l"


def test_grouped_llama_to_an_mha_only_format(tmp_path):
    checkpoint = tmp_path / "llama.pt"
    torch.save(llama_attention(4, 2, 6, bias=True).state_dict(), checkpoint)
    destination = tmp_path / "mha.pt"
    message = convert_error(checkpoint, destination, "--num-heads", "4", "--to", "torch-mha")
    assert message == (
        "torch.nn.MultiheadAttention has no grouped key/value heads (num_kv_heads < num_heads): "
        "W_k and W_v have 12 columns, W_q 24; its every projection has embed_dim features"
    )
    assert not destination.exists()
    # The head size of its own (24 query features for 16 hiddens) is refused as well.
    torch.save(llama_attention(4, 4, 6, bias=True).state_dict(), checkpoint)
    message = convert_error(checkpoint, destination, "--num-heads", "4", "--to", "torch-mha")
    assert message.startswith("torch.nn.MultiheadAttention has no head size of its own")
    # torch-d2l (ours) holds both.
    assert main(["convert", str(checkpoint), str(destination), "--num-heads", "4"]) == 0


def test_llama_errors(tmp_path):
    checkpoint = tmp_path / "llama.pt"
    torch.save(llama_attention(4, 2, 6, bias=True).state_dict(), checkpoint)
    out = tmp_path / "out.npz"
    needs = "(or --num-kv-heads or --head-dim): a llama file does not record its head layout"
    assert convert_error(checkpoint, out).startswith(f"reading llama needs --num-heads {needs}")
    assert convert_error(checkpoint, out, "--num-heads", "4", "--num-kv-heads", "1") == (
        f"--num-kv-heads 1 does not match the weights of {str(checkpoint)!r}: given --num-heads "
        "4, their query projection (24 features) holds 4 heads of head_dim 6 and their key and "
        "value projections (12 features) 2 key/value heads"
    )
    assert convert_error(checkpoint, out, "--num-heads", "5") == (
        f"the query projection of {str(checkpoint)!r} has 24 features (num_heads * head_dim), "
        "which --num-heads (5) does not divide"
    )
    # A whole model's state dict: several blocks.
    state = llama_attention(4, 2, 6, bias=False).state_dict()
    model = {f"model.layers.{i}.self_attn.{k}": v for i in range(4) for k, v in state.items()}
    torch.save(model, tmp_path / "model.bin")
    assert convert_error(tmp_path / "model.bin", out, "--num-heads", "4") == (
        f"{str(tmp_path / 'model.bin')!r} must hold the state dict of one Llama-style attention "
        "block; found 4 ('model.layers.0.self_attn.', 'model.layers.1.self_attn.', "
        "'model.layers.2.self_attn.', ...)"
    )
    # --from llama on another layout.
    torch.save(torch.nn.MultiheadAttention(8, 2).state_dict(), tmp_path / "mha.pt")
    assert convert_error(tmp_path / "mha.pt", out, "--from", "llama", "--num-heads", "2") == (
        f"{str(tmp_path / 'mha.pt')!r} must hold the state dict of one Llama-style attention "
        "block; found none (no 'q_proj.weight' entry)"
    )
    # An entry of another module under the block's prefix, and a damaged file.
    torch.save({**state, "rotary_emb.inv_freq": torch.ones(3)}, tmp_path / "extra.pt")
    assert convert_error(tmp_path / "extra.pt", out, "--num-heads", "4") == (
        f"{str(tmp_path / 'extra.pt')!r}: unexpected Llama attention entries "
        "['rotary_emb.inv_freq']"
    )
    damaged = tmp_path / "damaged.safetensors"
    save_state(damaged, state)
    damaged.write_bytes(damaged.read_bytes()[:-10])
    message = convert_error(damaged, out, "--from", "llama", "--num-heads", "4")
    assert message.startswith(f"{str(damaged)!r} is not a valid .safetensors file")
    # Writing: cross-attention weights have no Llama form.
    source = tmp_path / "cross.npz"
    save_weights(source, init_weights(16, key_size=8, num_heads=4, num_kv_heads=2, head_dim=6))
    assert convert_error(source, tmp_path / "x.bin", "--num-heads", "4").startswith(
        "Llama attention projects one hidden_states of hidden_size features"
    )
    assert not out.exists() and not (tmp_path / "x.bin").exists()
