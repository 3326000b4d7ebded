"""Canonical weights to and from ``torch.nn.MultiheadAttention`` and d2l's torch layer.

``torch.nn.MultiheadAttention`` computes the same function as the spec for
``query_size == embed_dim``, with three differences callers must mind:

* masks: its ``key_padding_mask`` and boolean ``attn_mask`` are ``True``
  where a key is *hidden*; ``valid_lens`` counts visible keys
  (:func:`key_padding_mask` converts);
* a query that sees no key gets NaN (or zeros on its fused paths); the spec
  gives uniform weights, i.e. the mean of all values;
* its returned weights are averaged over heads unless
  ``average_attn_weights=False``.

It has no grouped key/value heads and no head size of its own (every
projection has ``embed_dim`` features): weights of such a layer have no
``torch.nn.MultiheadAttention`` form. d2l's layout, four named projections,
holds them (:func:`to_torch_d2l_state`), shapes following the weights.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mha_multi import spec
from mha_multi.interop.formats import llama_prefixes
from mha_multi.torch._facts import host_array
from mha_multi.weights import WeightsConfig, check_state_mapping, check_weights

__all__ = [
    "checkpoint_format",
    "from_torch_d2l",
    "from_torch_d2l_state",
    "from_torch_mha",
    "from_torch_mha_state",
    "key_padding_mask",
    "load_torch_d2l",
    "load_torch_mha",
    "save_torch_d2l",
    "save_torch_mha",
    "to_torch_d2l",
    "to_torch_d2l_state",
    "to_torch_mha",
    "to_torch_mha_state",
]

_UNSUPPORTED = {
    "bias_k": "add_bias_kv=True (learned extra key/value rows)",
    "bias_v": "add_bias_kv=True (learned extra key/value rows)",
}


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(host_array(value))


def from_torch_mha_state(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights from a ``torch.nn.MultiheadAttention`` ``state_dict``.

    Handles the packed ``in_proj_weight`` (``kdim == vdim == embed_dim``) and
    the separate ``q/k/v_proj_weight`` layouts, with or without biases.

    Raises:
        ValueError: an entry the canonical layer cannot express (``bias_k``,
            ``bias_v``), a missing entry, or inconsistent shapes.
    """
    check_state_mapping(state_dict, "state_dict")
    for name, reason in _UNSUPPORTED.items():
        if name in state_dict:
            raise ValueError(f"unsupported torch.nn.MultiheadAttention option: {reason}")
    expected = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    expected |= {"q_proj_weight", "k_proj_weight", "v_proj_weight"}
    extra = sorted(set(state_dict) - expected)
    if extra:
        raise ValueError(f"unexpected torch.nn.MultiheadAttention entries: {extra}")
    if "out_proj.weight" not in state_dict:
        raise ValueError("state_dict is missing 'out_proj.weight'")
    out_weight = _numpy(state_dict["out_proj.weight"])
    embed_dim = out_weight.shape[0]
    separate = sorted({"q_proj_weight", "k_proj_weight", "v_proj_weight"} & set(state_dict))
    if "in_proj_weight" in state_dict and separate:
        raise ValueError(
            f"state_dict holds in_proj_weight and {separate}: a torch.nn.MultiheadAttention "
            "has the packed layout or the separate one, not both"
        )
    if "in_proj_weight" in state_dict:
        packed = _numpy(state_dict["in_proj_weight"])
        if packed.shape != (3 * embed_dim, embed_dim):
            raise ValueError(
                f"in_proj_weight must have shape {(3 * embed_dim, embed_dim)}; got {packed.shape}"
            )
        kernels = np.split(packed, 3)
    else:
        missing = [
            n for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight") if n not in state_dict
        ]
        if missing:
            raise ValueError(f"state_dict is missing {missing} (and has no in_proj_weight)")
        kernels = [_numpy(state_dict[f"{p}_proj_weight"]) for p in "qkv"]
        # torch.nn.MultiheadAttention's shapes: (embed_dim, embed_dim) queries, and
        # (embed_dim, kdim|vdim) keys and values.
        for p, kernel in zip("qkv", kernels, strict=True):
            if (
                kernel.ndim != 2
                or kernel.shape[0] != embed_dim
                or (p == "q" and kernel.shape[1] != embed_dim)
            ):
                width = "embed_dim" if p == "q" else "kdim" if p == "k" else "vdim"
                raise ValueError(
                    f"{p}_proj_weight must have shape (embed_dim, {width}) with embed_dim "
                    f"{embed_dim} (out_proj.weight's); got {kernel.shape}"
                )
    weights = {f"W_{p}": kernel.T for p, kernel in zip("qkv", kernels, strict=True)}
    weights["W_o"] = out_weight.T
    has_in_bias = state_dict.get("in_proj_bias") is not None
    has_out_bias = state_dict.get("out_proj.bias") is not None
    if has_in_bias != has_out_bias:
        raise ValueError(
            "unsupported: biases on the input projections but not the output one (or the reverse)"
        )
    if has_in_bias:
        packed_bias = _numpy(state_dict["in_proj_bias"])
        widths = [weights[f"W_{p}"].shape[1] for p in "qkv"]
        if packed_bias.shape != (sum(widths),):
            raise ValueError(
                f"in_proj_bias must have shape ({sum(widths)},) (the query, key and value "
                f"projections' biases); got {packed_bias.shape}"
            )
        biases = np.split(packed_bias, np.cumsum(widths)[:-1])
        weights.update({f"b_{p}": bias for p, bias in zip("qkv", biases, strict=True)})
        weights["b_o"] = _numpy(state_dict["out_proj.bias"])
    weights = {name: np.ascontiguousarray(array) for name, array in weights.items()}
    return check_weights(weights)[0]


def _check_native_heads(config: WeightsConfig) -> None:
    """Raises ``ValueError`` for a head layout ``torch.nn.MultiheadAttention`` cannot express."""
    if config.kv_features != config.query_features:
        raise ValueError(
            "torch.nn.MultiheadAttention has no grouped key/value heads (num_kv_heads < "
            f"num_heads): W_k and W_v have {config.kv_features} columns, W_q "
            f"{config.query_features}; its every projection has embed_dim features"
        )
    if config.query_features != config.num_hiddens:
        raise ValueError(
            "torch.nn.MultiheadAttention has no head size of its own (its head_dim is "
            f"embed_dim // num_heads): W_q has {config.query_features} columns, not "
            f"num_hiddens = {config.num_hiddens}"
        )


def to_torch_mha_state(weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A ``torch.nn.MultiheadAttention`` ``state_dict`` holding canonical weights.

    The packed layout is used when key and value sizes equal ``num_hiddens``.

    Raises:
        ValueError: invalid weights, or what ``torch.nn.MultiheadAttention``
            cannot express: ``query_size != num_hiddens``, grouped key/value
            heads, or projections of another width than ``num_hiddens`` (an
            explicit ``head_dim``).
    """
    arrays, config = check_weights(weights)
    _check_native_heads(config)
    if config.query_size != config.num_hiddens:
        raise ValueError(
            f"torch.nn.MultiheadAttention needs query_size == embed_dim; got query_size "
            f"{config.query_size} and num_hiddens {config.num_hiddens}"
        )

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    state: dict[str, torch.Tensor] = {}
    packed = config.key_size == config.value_size == config.num_hiddens
    if packed:
        state["in_proj_weight"] = tensor(np.concatenate([arrays[f"W_{p}"].T for p in "qkv"]))
    else:
        state.update({f"{p}_proj_weight": tensor(arrays[f"W_{p}"].T) for p in "qkv"})
    if config.bias:
        state["in_proj_bias"] = tensor(np.concatenate([arrays[f"b_{p}"] for p in "qkv"]))
    state["out_proj.weight"] = tensor(arrays["W_o"].T)
    if config.bias:
        state["out_proj.bias"] = tensor(arrays["b_o"])
    return state


def from_torch_mha(module: torch.nn.MultiheadAttention) -> dict[str, np.ndarray]:
    """Canonical weights of a ``torch.nn.MultiheadAttention`` (see the module notes).

    Raises:
        TypeError: ``module`` is no ``torch.nn.MultiheadAttention``.
        ValueError: ``add_bias_kv`` or ``add_zero_attn``, which the spec has no
            counterpart for.
    """
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(
            f"module must be a torch.nn.MultiheadAttention; got {type(module).__name__}"
        )
    if module.add_zero_attn:
        raise ValueError("unsupported torch.nn.MultiheadAttention option: add_zero_attn=True")
    return from_torch_mha_state(module.state_dict())


def to_torch_mha(
    weights: Mapping[str, Any], num_heads: int, *, batch_first: bool = True
) -> torch.nn.MultiheadAttention:
    """A new ``torch.nn.MultiheadAttention`` holding canonical weights (float32, CPU).

    Raises:
        TypeError: ``num_heads`` is not an int.
        ValueError: as :func:`to_torch_mha_state`, or ``num_heads`` does not divide
            ``num_hiddens`` (:func:`mha_multi.spec.check_config`).
    """
    arrays, config = check_weights(weights)
    _check_native_heads(config)
    spec.check_config(config.num_hiddens, num_heads, 0.0)
    module = torch.nn.MultiheadAttention(
        config.num_hiddens,
        int(num_heads),
        bias=config.bias,
        kdim=config.key_size,
        vdim=config.value_size,
        batch_first=batch_first,
    )
    state = to_torch_mha_state(arrays)
    module.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return module


def from_torch_d2l_state(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights from d2l's torch ``MultiHeadAttention`` (or ours) ``state_dict``.

    d2l names its projections ``W_q``, ``W_k``, ``W_v``, ``W_o`` (``nn.Linear``,
    weight ``(out, in)``); d2l's ``attention.dropout`` has no state. Grouped
    heads or an explicit ``head_dim`` (ours) give the widths of their layout.
    """
    check_state_mapping(state_dict, "state_dict")
    weights = {}
    for name, value in state_dict.items():
        layer, _, kind = name.partition(".")
        if layer not in ("W_q", "W_k", "W_v", "W_o") or kind not in ("weight", "bias"):
            raise ValueError(f"unexpected entry {name!r} in a d2l MultiHeadAttention state_dict")
        array = _numpy(value)
        weights[layer if kind == "weight" else f"b_{layer[-1]}"] = (
            np.ascontiguousarray(array.T) if kind == "weight" else array
        )
    return check_weights(weights)[0]


def to_torch_d2l_state(weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """d2l's torch ``MultiHeadAttention`` ``state_dict`` (also ours) from canonical weights."""
    arrays, _ = check_weights(weights)
    state = {}
    for name, array in arrays.items():
        if name.startswith("W_"):
            state[f"{name}.weight"] = torch.from_numpy(np.ascontiguousarray(array.T))
        else:
            state[f"W_{name[-1]}.bias"] = torch.from_numpy(np.ascontiguousarray(array))
    return state


def from_torch_d2l(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Canonical weights of d2l's torch ``MultiHeadAttention`` (or ours).

    Raises:
        TypeError: ``module`` is no ``torch.nn.Module``.
        ValueError: a parameter or buffer other than the projections',
            weights that do not fit the canonical layer, or a layer whose heads
            are sharded (:func:`mha_multi.torch.get_weights` gathers them).
    """
    _check_module(module)
    return from_torch_d2l_state(module.state_dict())


def to_torch_d2l(weights: Mapping[str, Any], module: torch.nn.Module) -> torch.nn.Module:
    """Loads canonical weights into d2l's torch ``MultiHeadAttention`` (or ours), strictly.

    Values are cast to the module's parameter dtypes and devices.

    Args:
        weights: canonical weights.
        module: the layer, with biases iff the weights have them.

    Returns:
        ``module``.

    Raises:
        TypeError: ``module`` is no ``torch.nn.Module``.
        ValueError: invalid weights, a layer whose parameters differ in
            names or shapes, or one whose heads are sharded
            (:func:`mha_multi.torch.set_weights` distributes them).
    """
    _check_module(module)
    state = to_torch_d2l_state(weights)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:  # torch lists every mismatch, one per line
        text = str(error).split(":", 1)[-1]  # after "Error(s) in loading state_dict for X:"
        raise ValueError(
            f"the weights do not fit {type(module).__name__}: {' '.join(text.split())}"
        ) from error
    return module


def _check_module(module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if getattr(module, "_sharding", None) is not None:  # (its parameters are split tensors)
        raise ValueError(
            "the module's heads are sharded: mha_multi.torch.get_weights and set_weights "
            "gather and distribute its weights (called on every process)"
        )


def _first_sentence(text: str) -> str:
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    # torch's C++ checks prefix their message with where they failed.
    line = re.sub(r"^\[enforce fail at [^\]]*\][\s.]*", "", line)
    return line.split(". ", 1)[0].rstrip(".")


def _load_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.fspath(path)
    with open(path, "rb") as file:  # so that a missing file stays a FileNotFoundError
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            # A damaged or foreign file fails wherever torch's parser stops
            # (RuntimeError, EOFError, UnpicklingError, KeyError, struct.error,
            # ...), and nothing in it ran (weights_only=True): it is a bad input.
            text = str(error)
            if "WeightsUnpickler error:" in text:  # the reason after paragraphs of advice
                text = text.split("WeightsUnpickler error:", 1)[1]
            detail = _first_sentence(text)
            if not detail or isinstance(error, KeyError):  # (a KeyError's text is its key)
                detail = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
            raise ValueError(
                f"{path!r} is not a PyTorch checkpoint that torch.load(weights_only=True) "
                f"reads: {detail}"
            ) from error
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} does not hold a state_dict")
    return state


def _save_state_dict(path: str | os.PathLike[str], state: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as file:  # an unwritable path raises OSError, not torch's RuntimeError
        torch.save(state, file)


def checkpoint_format(path: str | os.PathLike[str]) -> str:
    """Which layout a PyTorch checkpoint holds: ``"llama"``, ``"torch-d2l"`` or ``"torch-mha"``.

    A Llama-style attention block has a ``q_proj.weight``, bare or under a
    prefix (:func:`mha_multi.interop.formats.llama_prefixes`); d2l's layer
    (and ours) names its projections ``W_q``...; any other ``state_dict`` is
    taken for ``torch.nn.MultiheadAttention``'s, whose reader then checks it.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a checkpoint that ``torch.load(weights_only=True)``
            reads, or not a ``state_dict``.
    """
    state = _load_state_dict(path)
    if llama_prefixes(state):
        return "llama"
    return "torch-d2l" if any(str(k).startswith("W_") for k in state) else "torch-mha"


def load_torch_mha(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Canonical weights from a checkpoint of a ``torch.nn.MultiheadAttention`` ``state_dict``.

    The file is read with ``torch.load(weights_only=True)``: nothing in it runs.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a damaged file, one that is not a ``state_dict``, or one
            of another layout (see :func:`from_torch_mha_state`).
    """
    return from_torch_mha_state(_load_state_dict(path))


def save_torch_mha(path: str | os.PathLike[str], weights: Mapping[str, Any]) -> None:
    """Writes canonical weights as a ``torch.nn.MultiheadAttention`` ``state_dict`` checkpoint.

    Raises:
        ValueError: weights the native layer cannot express (see
            :func:`to_torch_mha_state`).
        OSError: the file cannot be written.
    """
    _save_state_dict(path, to_torch_mha_state(weights))


def load_torch_d2l(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Canonical weights from a checkpoint of d2l's torch layer's ``state_dict`` (or ours).

    The file is read with ``torch.load(weights_only=True)``: nothing in it runs.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a damaged file, one that is not a ``state_dict``, or one
            of another layout (see :func:`from_torch_d2l_state`).
    """
    return from_torch_d2l_state(_load_state_dict(path))


def save_torch_d2l(path: str | os.PathLike[str], weights: Mapping[str, Any]) -> None:
    """Writes canonical weights as a ``state_dict`` checkpoint of d2l's torch layer (or ours).

    Raises:
        ValueError: invalid weights.
        OSError: the file cannot be written.
    """
    _save_state_dict(path, to_torch_d2l_state(weights))


def key_padding_mask(valid_lens: Any, num_keys: int) -> torch.Tensor:
    """``torch.nn.MultiheadAttention``'s ``key_padding_mask`` for 1-D ``valid_lens``.

    ``True`` marks a hidden key, the opposite polarity of the spec's
    visibility: key ``j`` of example ``b`` is hidden iff ``j >= valid_lens[b]``.
    """
    lens = torch.as_tensor(np.asarray(valid_lens))
    if lens.dim() != 1:
        raise ValueError(
            f"valid_lens must be 1-D for a key padding mask; got shape {tuple(lens.shape)}"
        )
    return torch.arange(num_keys)[None, :] >= lens[:, None]
