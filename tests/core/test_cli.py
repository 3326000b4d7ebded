"""``python -m mha_multi convert`` on bad input: one line on stderr, exit status 2."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.__main__ import convert
from mha_multi.interop import FORMATS, Format, detect_format, load, save, suffix_formats
from mha_multi.interop.formats import (
    RECOGNISERS,
    check_heads_given,
    check_stored_heads,
    llama_prefixes,
    resolve_heads,
    safetensors_format,
)
from mha_multi.weights import check_weights, init_weights, load_weights, save_weights

PREFIX = "python -m mha_multi convert: error: "
HELP = " (see python -m mha_multi convert --help)"


def run_convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mha_multi", "convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a user error prints, after checking how the command failed."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "w.npz"
    save_weights(path, init_weights(8, bias=True))
    return path


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_truncated_input(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    save_weights(path, init_weights(8, bias=True))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    line = error_line(run_convert(path, tmp_path / "out.npz"))
    assert line.startswith(
        f"{PREFIX}{str(path)!r} is not a valid {suffix} file (truncated or corrupt): "
    )
    assert not (tmp_path / "out.npz").exists()


def test_empty_npz_input(tmp_path):
    path = tmp_path / "empty.npz"
    np.savez(path)
    line = error_line(run_convert(path, tmp_path / "out.npz"))
    assert line == (
        f"{PREFIX}{str(path)!r} holds no arrays; expected canonical weights W_q, W_k, W_v, W_o"
    )


@pytest.mark.parametrize("heads", ["0", "-2"])
def test_non_positive_num_heads_is_an_argument_error(tmp_path, source, heads):
    result = run_convert(source, tmp_path / "out.npz", "--num-heads", heads)
    line = error_line(result)
    assert line == f"{PREFIX}argument --num-heads: must be a positive integer; got {heads}{HELP}"
    assert not (tmp_path / "out.npz").exists()


def test_non_positive_num_heads_in_the_api(tmp_path, source):
    with pytest.raises(ValueError, match=r"^--num-heads must be a positive integer; got 0$"):
        convert(source, tmp_path / "out.npz", num_heads=0)


@pytest.mark.parametrize("option", [{"num_heads": 2}, {"head_dim": 4}], ids=str)
def test_heads_given_are_checked_against_the_sinks_and_norms(tmp_path, option):
    """Sinks (one a head) and per-head norms (of head_dim) fix the layout too: 4 heads of
    2 here, which --num-heads 2 or --head-dim 4 contradicts (both were taken)."""
    weights = init_weights(8, num_heads=4, sinks=True, seed=0)
    weights["q_norm"] = weights["k_norm"] = np.ones(2, np.float32)
    path = tmp_path / "sinks.safetensors"
    save_weights(path, weights)
    refused = r"have no head layout given --(num-heads 2|head-dim 4): weights\['q_norm'\]"
    with pytest.raises(ValueError, match=refused):
        convert(path, tmp_path / "out.npz", **option)
    with pytest.raises(ValueError, match=refused):
        load(path, **option)
    assert not (tmp_path / "out.npz").exists()
    assert load(path, num_heads=4)["sinks"].shape == (4,)


@pytest.mark.parametrize(
    ("destination", "name"),
    [("a.safetensors", "torch-d2l"), ("b.npz", "torch-mha"), ("c.pt", "mxnet-d2l")],
)
def test_a_format_given_is_written_under_its_own_file_names_only(tmp_path, destination, name):
    """A file named as another format's would be read back as that one (a PyTorch pickle
    named .safetensors was written, and could not be read)."""
    suffixes = " or ".join(FORMATS[name].suffixes)
    refused = f"^path must end in {suffixes} for the {name} format; got "
    with pytest.raises(ValueError, match=refused):
        save(tmp_path / destination, init_weights(8), name, num_heads=2)
    assert not (tmp_path / destination).exists()


@pytest.mark.parametrize("name", ["w.safetensors", "w.npz", "w.params", "w.pt"])
def test_a_directory_is_no_weights_file(tmp_path, name):
    """Named, reading and writing, before any format's own reader or writer meets it
    (safetensors named no path; MXNet's writer failed with a traceback)."""
    directory = tmp_path / name
    directory.mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory, not a weights file"):
        save(directory, init_weights(8), num_heads=2)
    if name.endswith((".npz", ".safetensors")):
        with pytest.raises(IsADirectoryError, match="is a directory, not a weights file"):
            load_weights(directory)


def test_numpy_extended_precision_is_no_canonical_dtype():
    weights = {name: array.astype(np.longdouble) for name, array in init_weights(8).items()}
    if np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("this platform's long double is float64")
    with pytest.raises(TypeError, match="canonical weights are float16, float32 or float64"):
        check_weights(weights)


@pytest.mark.parametrize(
    ("module", "destination", "label", "framework"),
    [
        ("torch", "out.pt", "torch-d2l", "PyTorch"),
        ("mxnet", "out.params", "mxnet-d2l", "MXNet"),
        ("keras", "out.weights.h5", "keras-mha", "Keras"),
    ],
)
def test_format_without_its_framework(tmp_path, source, module, destination, label, framework):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    line = error_line(run_convert(source, tmp_path / destination, "--num-heads", "2"))
    assert line == (
        f"{PREFIX}format {label} needs {framework}, which is not installed "
        f"(No module named '{module}'): pip install 'mha_multi[{module}]'"
    )


@pytest.mark.parametrize(
    ("module", "name", "labels", "framework"),
    [
        ("torch", "w.pt", "torch-mha/torch-d2l/llama", "PyTorch"),
        ("keras", "w.weights.h5", "keras-mha/keras-gqa", "Keras"),
    ],
)
def test_reading_a_shared_suffix_without_its_framework_names_every_candidate(
    tmp_path, module, name, labels, framework
):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    checkpoint = tmp_path / name
    checkpoint.write_bytes(b"not read: the recogniser needs the framework first")
    line = error_line(run_convert(checkpoint, tmp_path / "out.npz", "--num-heads", "2"))
    assert line == (
        f"{PREFIX}format {labels} needs {framework}, which is not installed "
        f"(No module named '{module}'): pip install 'mha_multi[{module}]'"
    )


def test_missing_source_and_destination_directory(tmp_path, source):
    missing = tmp_path / "none.npz"
    line = error_line(run_convert(missing, tmp_path / "out.npz"))
    assert line == f"{PREFIX}[Errno 2] No such file or directory: {str(missing)!r}"
    destination = tmp_path / "none" / "out.npz"
    line = error_line(run_convert(source, destination))
    assert line == (
        f"{PREFIX}no such directory: {str(tmp_path / 'none')!r} (for {str(destination)!r})"
    )


def test_valid_conversion_still_succeeds(tmp_path, source):
    result = run_convert(source, tmp_path / "out.safetensors", "--num-heads", "2")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith(f"{source} -> {tmp_path / 'out.safetensors'}: W_q (8, 8)")


def test_unknown_format_names_in_the_api(tmp_path, source):
    # "torch" names no format: reading a .pt file detects torch-mha or torch-d2l.
    with pytest.raises(ValueError, match=r"^unknown format 'torch'; expected one of canonical, "):
        convert(source, tmp_path / "out.npz", source_format="torch")
    with pytest.raises(ValueError, match=r"^unknown format 'npz'"):
        convert(source, tmp_path / "out.npz", destination_format="npz")
    with pytest.raises(ValueError, match=r"^unknown format 'torch'"):
        load(source, "torch")


# -- the format registry ------------------------------------------------------------------


def test_registry_records_are_complete():
    assert list(FORMATS) == [
        "canonical",
        "torch-mha",
        "torch-d2l",
        "llama",
        "mxnet-d2l",
        "keras-mha",
        "keras-gqa",
    ]
    for name, record in FORMATS.items():
        assert isinstance(record, Format) and record.name == name
        assert record.description and record.suffixes
        assert all(s.startswith(".") and s == s.lower() for s in record.suffixes)
        for target in (record.reader, record.writer):
            module, _, function = target.partition(":")
            assert module.startswith("mha_multi.") and function.isidentifier(), target
        assert (record.framework is None) == (record.extra is None)
        assert record.heads in (None, "stored", "required")
    heads = {name: record.heads for name, record in FORMATS.items() if record.heads}
    assert heads == {"llama": "required", "keras-mha": "stored", "keras-gqa": "stored"}


def test_shared_suffixes_have_one_default_and_one_recogniser():
    owners: dict[str, list[Format]] = {}
    for record in FORMATS.values():
        for suffix in record.suffixes:
            owners.setdefault(suffix, []).append(record)
    shared = {suffix: records for suffix, records in owners.items() if len(records) > 1}
    assert sorted(shared) == [".pt", ".pth", ".safetensors", ".weights.h5"]
    assert sorted(RECOGNISERS) == sorted(shared)  # a recogniser for each shared suffix, no more
    for suffix, records in shared.items():
        assert sum(r.default for r in records) == 1, suffix
        module, _, function = RECOGNISERS[suffix].partition(":")
        assert module.startswith("mha_multi.") and function.isidentifier(), suffix
    defaults = {suffix: next(r.name for r in rs if r.default) for suffix, rs in shared.items()}
    assert defaults == {
        ".pt": "torch-d2l",
        ".pth": "torch-d2l",
        ".safetensors": "canonical",
        ".weights.h5": "keras-mha",
    }


ALL_SUFFIXES = sorted({s for record in FORMATS.values() for s in record.suffixes})


@pytest.mark.parametrize("suffix", ALL_SUFFIXES + [s.upper() for s in ALL_SUFFIXES])
def test_detection_from_the_suffix_returns_registry_names_only(suffix):
    path = f"some.dir/weights{suffix}"
    names = suffix_formats(path)
    assert names and set(names) <= set(FORMATS)
    written = detect_format(path, reading=False)
    # A suffix of one format gets it; a shared one its default.
    assert written in names and (len(names) == 1 or FORMATS[written].default)
    if len(names) == 1:
        assert detect_format(path, reading=True) == names[0]


def test_detection_of_names_no_format_claims():
    assert suffix_formats("w.h5") == suffix_formats("w.ckpt") == suffix_formats("npz") == ()
    assert suffix_formats("w.weights.h5") == ("keras-mha", "keras-gqa")  # the longest suffix
    assert suffix_formats("w.bin") == ("llama",)
    assert suffix_formats("w.safetensors") == ("canonical", "llama")
    assert suffix_formats("w.PT") == ("torch-mha", "torch-d2l", "llama")
    for reading in (False, True):
        with pytest.raises(ValueError, match=r"^cannot tell the format of 'w\.ckpt' from its name"):
            detect_format("w.ckpt", reading=reading)


def _available(record: Format) -> bool:
    try:
        importlib.import_module(record.reader.partition(":")[0])
    except ImportError:
        return False
    return True


#: Weights each format holds: d2l's layout with sizes of their own, or (for
#: the grouped formats, which project one input size back to it) 4 query heads
#: reading 2 key/value heads of head_dim 3, with 10 features.
GROUPED = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}


def _fitting_weights(name: str, bias: bool) -> tuple[dict[str, np.ndarray], int]:
    if name in ("llama", "keras-gqa"):
        return init_weights(10, bias=bias, seed=11, **GROUPED), GROUPED["num_heads"]
    return init_weights(8, key_size=5, value_size=6, bias=bias, seed=11), 2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_round_trips_where_its_framework_is_installed(tmp_path, name, bias):
    record = FORMATS[name]
    if not _available(record):
        pytest.skip(f"{record.framework} is not installed here")
    weights, num_heads = _fitting_weights(name, bias)
    path = tmp_path / f"weights{record.suffixes[-1]}"
    save(path, weights, name, num_heads=num_heads)
    assert detect_format(path, reading=True) == name
    for back in (load(path, name, num_heads=num_heads), load(path, num_heads=num_heads)):
        assert sorted(back) == sorted(weights)
        assert all(back[k].tobytes() == weights[k].tobytes() for k in weights), name
    # The command's function, with formats from the names (and the content).
    source = tmp_path / "source.safetensors"
    save_weights(source, weights)
    written = tmp_path / f"written{record.suffixes[0]}"
    convert(source, written, num_heads=num_heads, destination_format=name)
    restored = tmp_path / "restored.npz"
    assert convert(written, restored, num_heads=num_heads).keys() == weights.keys()
    again = load_weights(restored)
    assert all(again[k].tobytes() == weights[k].tobytes() for k in weights), name


# torch.nn.MultiheadAttention has no grouped heads: tests/torch checks that it refuses them.
@pytest.mark.parametrize(
    "name", [n for n, r in FORMATS.items() if r.heads is None and n != "torch-mha"]
)
def test_formats_without_heads_hold_grouped_weights(tmp_path, name):
    record = FORMATS[name]
    if not _available(record):
        pytest.skip(f"{record.framework} is not installed here")
    weights = init_weights(10, key_size=6, bias=True, seed=12, **GROUPED)
    path = tmp_path / f"weights{record.suffixes[0]}"
    save(path, weights, name, head_dim=3)
    back = load(path, name, num_kv_heads=2)
    assert all(back[k].tobytes() == weights[k].tobytes() for k in weights), name


def test_help_lists_every_format():
    result = subprocess.run(
        [sys.executable, "-m", "mha_multi", "convert", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = result.stdout.split("\nformats:\n", 1)[1]
    for record in FORMATS.values():
        assert f"  {record.name} " in listed and record.suffixes[0] in listed


# -- the head layout ----------------------------------------------------------------------


@pytest.fixture
def grouped(tmp_path):
    """A canonical file of 4 query heads reading 2 key/value heads of head_dim 3 (10 features)."""
    path = tmp_path / "grouped.npz"
    save_weights(path, init_weights(10, bias=True, seed=4, **GROUPED))
    return path


@pytest.mark.parametrize(
    "options",
    [
        {"num_heads": 4},
        {"num_kv_heads": 2},
        {"head_dim": 3},
        {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3},
    ],
)
def test_any_one_head_option_fixes_the_layout(options):
    # W_q has 4 * 3 columns and W_k 2 * 3: one number gives the other two.
    weights = init_weights(10, seed=0, **GROUPED)
    assert resolve_heads(weights, **options) == spec.Heads(4, 2, 3)
    assert resolve_heads(weights) is None
    # d2l's layout: 8 features, 2 heads of 4, each with its own key and value.
    assert resolve_heads(init_weights(8, seed=0), num_kv_heads=2) == spec.Heads(2, 2, 4)


def test_the_layout_is_printed_after_the_shapes(tmp_path, grouped):
    result = run_convert(grouped, tmp_path / "out.safetensors", "--num-kv-heads", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n").endswith("b_o (10,); num_heads 4, num_kv_heads 2, head_dim 3")
    result = run_convert(grouped, tmp_path / "out.npz")
    assert result.returncode == 0 and result.stdout.rstrip("\n").endswith("b_o (10,)")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--num-heads", "4", "--num-kv-heads", "1"],
            "--num-kv-heads 1 does not match the weights of {source}: given --num-heads 4, "
            "their query projection (12 features) holds 4 heads of head_dim 3 and their key "
            "and value projections (6 features) 2 key/value heads",
        ),
        (
            ["--head-dim", "3", "--num-heads", "2"],
            "--head-dim 3 does not match the weights of {source}: given --num-heads 2, their "
            "query projection (12 features) holds 2 heads of head_dim 6 and their key and value "
            "projections (6 features) 1 key/value heads",
        ),
        (
            ["--num-heads", "5"],
            "the query projection of {source} has 12 features (num_heads * head_dim), which "
            "--num-heads (5) does not divide",
        ),
        (
            ["--num-kv-heads", "4"],
            "the key and value projections of {source} have 6 features (num_kv_heads * "
            "head_dim), which --num-kv-heads (4) does not divide",
        ),
        (
            ["--head-dim", "4"],
            "the key and value projections of {source} have 6 features, no whole number of "
            "heads of head_dim 4 (given --head-dim 4)",
        ),
        (
            ["--head-dim", "5"],
            "the query projection of {source} has 12 features, no whole number of heads of "
            "head_dim 5 (given --head-dim 5)",
        ),
    ],
)
def test_head_options_that_do_not_fit_the_weights(tmp_path, grouped, options, message):
    line = error_line(run_convert(grouped, tmp_path / "out.npz", *options))
    assert line == PREFIX + message.format(source=repr(str(grouped)))
    assert not (tmp_path / "out.npz").exists()


def test_widths_of_no_head_layout(tmp_path):
    # 4 query heads of head_dim 3 would read 3 key/value heads, which do not divide them.
    rng = np.random.default_rng(0)
    weights = {
        "W_q": rng.standard_normal((10, 12)),
        "W_k": rng.standard_normal((10, 9)),
        "W_v": rng.standard_normal((10, 9)),
        "W_o": rng.standard_normal((12, 10)),
    }
    source = tmp_path / "odd.npz"
    save_weights(source, weights)
    line = error_line(run_convert(source, tmp_path / "out.npz", "--head-dim", "3"))
    assert line == (
        f"{PREFIX}the weights of {str(source)!r} have no head layout given --head-dim 3: "
        "num_kv_heads (3) must divide num_heads (4)"
    )


@pytest.mark.parametrize("flag", ["--num-kv-heads", "--head-dim"])
def test_non_positive_head_options_are_argument_errors(tmp_path, source, flag):
    line = error_line(run_convert(source, tmp_path / "out.npz", flag, "0"))
    assert line == f"{PREFIX}argument {flag}: must be a positive integer; got 0{HELP}"
    with pytest.raises(ValueError, match=rf"^{flag} must be a positive integer; got 0$"):
        convert(source, tmp_path / "out.npz", **{flag[2:].replace("-", "_"): 0})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Checked before any file is read or any framework imported.
        (
            ["{grouped}", "{out}.bin"],
            "writing llama needs --num-heads (or --num-kv-heads or --head-dim): a llama file "
            "does not record its head layout, which its shapes must fit",
        ),
        (
            ["{grouped}", "{out}.pt", "--to", "llama"],
            "writing llama needs --num-heads (or --num-kv-heads or --head-dim): a llama file "
            "does not record its head layout, which its shapes must fit",
        ),
        (
            ["{grouped}", "{out}.weights.h5", "--to", "keras-gqa"],
            "writing keras-gqa needs --num-heads (or --num-kv-heads or --head-dim): the kernels "
            "are per head",
        ),
        (
            ["{out}.bin", "{out}.npz"],
            "reading llama needs --num-heads (or --num-kv-heads or --head-dim): a llama file "
            "does not record its head layout, which its shapes must fit",
        ),
    ],
)
def test_missing_head_options(tmp_path, grouped, args, message):
    out = str(tmp_path / "out")
    line = error_line(run_convert(*(a.format(grouped=grouped, out=out) for a in args)))
    assert line == PREFIX + message


def test_which_formats_need_heads():
    check_heads_given("canonical", reading=False)
    check_heads_given("keras-gqa", reading=True)  # the file stores them
    for name, reading in [("keras-gqa", False), ("keras-mha", False), ("llama", True)]:
        with pytest.raises(ValueError, match=rf"^{'reading' if reading else 'writing'} {name}"):
            check_heads_given(name, reading=reading)
        check_heads_given(name, reading=reading, head_dim=3)


def test_options_are_checked_against_the_heads_a_file_stores():
    stored = spec.Heads(num_heads=4, num_kv_heads=2, head_dim=3)
    check_stored_heads(stored, "w.weights.h5", num_heads=4, num_kv_heads=2, head_dim=3)
    check_stored_heads(stored, "w.weights.h5")
    for option, stored_as in [
        ({"num_heads": 2}, "--num-heads 2 does not match the 4 heads"),
        ({"num_kv_heads": 1}, "--num-kv-heads 1 does not match the 2 key/value heads"),
        ({"head_dim": 6}, "--head-dim 6 does not match the head_dim 3"),
    ]:
        with pytest.raises(ValueError) as error:
            check_stored_heads(stored, "w.weights.h5", detail=" (why)", **option)
        assert str(error.value) == f"{stored_as} stored in 'w.weights.h5' (why)"


# -- recognising Llama-style state dicts without a framework ------------------------------


def test_llama_prefixes():
    names = ["q_proj.weight", "k_proj.weight", "mlp.up_proj.weight"]
    assert llama_prefixes(names) == [""]
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (1, 0) for p in "qkvo"]
    assert llama_prefixes(names) == ["model.layers.0.self_attn.", "model.layers.1.self_attn."]
    # Only whole entry names: not "xq_proj.weight", "q_proj.weight_scale" or "W_q.weight".
    assert llama_prefixes(["xq_proj.weight", "q_proj.weight_scale", "W_q.weight"]) == []


def _llama_safetensors(path, prefix=""):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    shapes = {"q_proj": (12, 10), "k_proj": (6, 10), "v_proj": (6, 10), "o_proj": (10, 12)}
    tensors = {f"{prefix}{n}.weight": rng.standard_normal(s, np.float32) for n, s in shapes.items()}
    save_file(tensors, path)
    return tensors


@pytest.mark.parametrize("prefix", ["", "self_attn.", "model.layers.0.self_attn."])
def test_safetensors_are_recognised_from_their_header(tmp_path, prefix):
    path = tmp_path / "attention.safetensors"
    _llama_safetensors(path, prefix)
    assert safetensors_format(path) == "llama"
    assert detect_format(path, reading=True) == "llama"
    canonical = tmp_path / "canonical.safetensors"
    save_weights(canonical, init_weights(8))
    assert safetensors_format(canonical) == detect_format(canonical, reading=True) == "canonical"
    # A damaged file goes to the canonical reader, which says what is wrong.
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(path.read_bytes()[:20])
    assert safetensors_format(damaged) == "canonical"
    with pytest.raises(FileNotFoundError):
        safetensors_format(tmp_path / "none.safetensors")


def test_llama_safetensors_without_torch(tmp_path):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here")
    path = tmp_path / "attention.safetensors"
    _llama_safetensors(path)
    line = error_line(run_convert(path, tmp_path / "out.npz", "--num-heads", "4"))
    assert line == (
        f"{PREFIX}format llama needs PyTorch, which is not installed (No module named 'torch'): "
        "pip install 'mha_multi[torch]'"
    )
