"""Canonical weights: one framework-free mapping that every backend reads and writes.

The mapping is ``str -> numpy.ndarray`` in the ``y = x @ W + b`` orientation
(Keras/Flax ``Dense`` kernels; PyTorch and Gluon store the transpose):

====================  ==========================================  ===============
name                  shape                                       present
====================  ==========================================  ===============
``W_q``               ``(query_size, num_heads*head_dim)``        always
``W_k``               ``(key_size, num_kv_heads*head_dim)``       always
``W_v``               ``(value_size, num_kv_heads*head_dim)``     always
``W_o``               ``(num_heads*head_dim, num_hiddens)``       always
``b_q``               ``(num_heads*head_dim,)``                   iff ``bias=True``
``b_k``, ``b_v``      ``(num_kv_heads*head_dim,)``                iff ``bias=True``
``b_o``               ``(num_hiddens,)``                          iff ``bias=True``
``q_norm``            ``(head_dim,)``, or see below               iff ``qk_norm``
``k_norm``            ``(head_dim,)``, or see below               iff ``qk_norm``
``sinks``             ``(num_heads,)``                            iff ``sinks=True``
====================  ==========================================  ===============

The norms' weights (``qk_norm=``, docs: "Positions and biases") are
``(head_dim,)``, shared by every head, for a norm of scope ``"heads"``, and
the whole projection's width for scope ``"whole"``: ``(num_heads*head_dim,)``
and ``(num_kv_heads*head_dim,)``.

For multi-head attention with the default head size (``num_kv_heads =
num_heads``, ``head_dim = num_hiddens // num_heads``) every width is
``num_hiddens``, so those weights need no head configuration.

Files are ``.npz`` (read with ``allow_pickle=False``) or ``.safetensors``;
a round trip is bit-exact.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mha_multi import spec
from mha_multi.spec.checks import check_positive_int

__all__ = [
    "BIAS_NAMES",
    "KERNEL_NAMES",
    "NORM_NAMES",
    "SINKS_NAME",
    "WeightsConfig",
    "check_layer_weights",
    "check_only_projections",
    "check_state_mapping",
    "check_weights",
    "init_weights",
    "load_weights",
    "save_weights",
    "weight_shapes",
]

KERNEL_NAMES = ("W_q", "W_k", "W_v", "W_o")
BIAS_NAMES = ("b_q", "b_k", "b_v", "b_o")
NORM_NAMES = spec.QK_NORM_NAMES
#: The name of the heads' sink logits, ``(num_heads,)``, present iff ``sinks=True``.
SINKS_NAME = "sinks"


def check_state_mapping(state: Any, name: str) -> None:
    """Raises ``TypeError`` unless a framework's state (``name``, what a reader takes) is a
    mapping of names to arrays, before anything reads it."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{name} must be a mapping of names to arrays; got {type(state).__name__}")


def check_only_projections(layer: Any, source: str) -> None:
    """Raises where ``layer`` (ours, read as d2l's layer) holds weights beyond its four
    projections: the query/key norms or the sink logits, which d2l's layer has no place
    for, and which a reader of its projections alone would leave out.

    Raises:
        ValueError: naming the entry and ``source`` (the reader).
    """
    for name in (*NORM_NAMES, SINKS_NAME):
        if getattr(layer, name, None) is not None:
            raise ValueError(
                f"unexpected entry {name!r} in a d2l MultiHeadAttention ({source}): d2l's "
                "layer holds the four projections alone (get_weights reads every weight "
                "of ours)"
            )


# A zip archive starts with a local file header, or, when empty, with its end record.
_ZIP_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06")


@dataclass(frozen=True)
class WeightsConfig:
    """The sizes a set of canonical weights describes."""

    num_hiddens: int
    query_size: int
    key_size: int
    value_size: int
    bias: bool
    query_features: int | None = None
    """Width of the projected queries, ``num_heads * head_dim`` (``W_q``'s columns)."""
    kv_features: int | None = None
    """Width of the projected keys and values, ``num_kv_heads * head_dim``."""
    sinks: bool = False
    """Whether the weights hold the heads' sink logits (``sinks``)."""


def _features(
    num_hiddens: int, num_heads: int | None, num_kv_heads: int | None, head_dim: int | None
) -> tuple[int, int]:
    """``(num_heads * head_dim, num_kv_heads * head_dim)``; both ``num_hiddens`` without heads."""
    if num_heads is None:
        if num_kv_heads is not None or head_dim is not None:
            raise ValueError("num_kv_heads and head_dim need num_heads")
        return num_hiddens, num_hiddens
    heads = spec.check_heads(num_hiddens, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return heads.query_features, heads.kv_features


def weight_shapes(
    num_hiddens: int,
    *,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    bias: bool = False,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    sinks: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Canonical names and shapes for a configuration.

    Input sizes default to ``num_hiddens``. Without ``num_heads`` the layout is
    multi-head attention with the default head size, whose shapes do not
    depend on the number of heads; ``sinks=True`` needs ``num_heads`` (else
    a ``ValueError``).
    """
    check_positive_int("num_hiddens", num_hiddens)
    for name, size in (
        ("query_size", query_size),
        ("key_size", key_size),
        ("value_size", value_size),
    ):
        if size is not None:
            check_positive_int(name, size)
    query_features, kv_features = _features(num_hiddens, num_heads, num_kv_heads, head_dim)
    shapes: dict[str, tuple[int, ...]] = {
        "W_q": (num_hiddens if query_size is None else query_size, query_features),
        "W_k": (num_hiddens if key_size is None else key_size, kv_features),
        "W_v": (num_hiddens if value_size is None else value_size, kv_features),
        "W_o": (query_features, num_hiddens),
    }
    if bias:
        shapes.update(
            {
                "b_q": (query_features,),
                "b_k": (kv_features,),
                "b_v": (kv_features,),
                "b_o": (num_hiddens,),
            }
        )
    if sinks:
        if num_heads is None:
            raise ValueError("sinks=True needs num_heads (the sinks are (num_heads,))")
        shapes[SINKS_NAME] = (int(num_heads),)
    return shapes


def init_weights(
    num_hiddens: int,
    *,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    bias: bool = False,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    sinks: bool = False,
    seed: int = 0,
    dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
    """Seeded canonical weights.

    Each entry is drawn from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, the
    default initialisation of ``torch.nn.Linear`` (and so of d2l's layer),
    which keeps activations of unit scale.

    Args:
        num_hiddens: output size of every projection.
        query_size, key_size, value_size: input sizes (default ``num_hiddens``).
        bias: whether to include ``b_q``, ``b_k``, ``b_v``, ``b_o``.
        num_heads, num_kv_heads, head_dim: the head layout (see
            :func:`mha_multi.spec.check_heads`); only grouped heads or an
            explicit ``head_dim`` change the shapes.
        sinks: whether to include the heads' sink logits ``sinks``, zeros
            (a zero logit is one more key of score 0 in every row).
        seed: seed of a ``numpy.random.default_rng``.
        dtype: dtype of the returned arrays.

    Returns:
        The canonical mapping.
    """
    rng = np.random.default_rng(seed)
    shapes = weight_shapes(
        num_hiddens,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        bias=bias,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sinks=sinks,
    )
    weights = {}
    for name, shape in shapes.items():
        bound = 0.0 if name == SINKS_NAME else 1.0 / np.sqrt(shapes["W_" + name[-1]][0])
        weights[name] = rng.uniform(-bound, bound, size=shape).astype(dtype)
    return weights


def check_weights(
    weights: Mapping[str, Any],
    *,
    num_hiddens: int | None = None,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    bias: bool | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    qk_norm: str | bool | None = False,
    sinks: bool | None = False,
) -> tuple[dict[str, np.ndarray], WeightsConfig]:
    """Strictly validates a canonical mapping.

    Sizes given as ``None`` are inferred from the weights (``num_hiddens`` and
    the input sizes from the kernels, ``bias`` from the presence of ``b_q``).
    With neither ``num_hiddens`` nor ``num_heads`` every width is read from the
    kernels (any head layout); with ``num_hiddens`` alone the layout is
    multi-head attention with the default head size; with ``num_heads``,
    the widths are those of the head layout.

    Args:
        weights: a mapping of canonical names to arrays (anything
            ``numpy.asarray`` accepts).
        num_hiddens, query_size, key_size, value_size, bias: what the
            weights must describe, where known.
        num_heads, num_kv_heads, head_dim: the layer's head layout, where known.
        qk_norm: the query/key norms' entries ``q_norm``, ``k_norm``:
            ``False`` refuses them (a layer or converter without norms),
            ``"heads"`` or ``"whole"`` (a :class:`mha_multi.spec.QKNorm`'s
            scope) requires them, ``None`` takes them where present, of
            either scope's shapes.
        sinks: whether the weights hold the sink logits ``sinks`` (of a
            layer with ``sinks=True``); ``None`` reads it from the entry's
            presence (:func:`mha_multi.spec.sinks_shape`). ``False`` by
            default: a layer without sinks, or a native one, refuses it.

    Returns:
        ``(weights, config)``: the entries as numpy arrays, and the sizes.

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not a
            floating-point array.
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of names to arrays; got {type(weights)}")
    arrays: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        try:
            array = np.asarray(value)
        except Exception as error:
            raise TypeError(f"weights[{name!r}] is not convertible to a numpy array") from error
        if not array.dtype.isnative:
            # (A file's big-endian arrays, which numpy keeps so: the same numbers in the
            # host's order, which PyTorch takes alone.)
            array = array.astype(array.dtype.newbyteorder("="))
        arrays[name] = array
    for name in KERNEL_NAMES:
        if name not in arrays:
            raise ValueError(f"weights is missing {name!r}")
        if arrays[name].ndim != 2:
            raise ValueError(f"weights[{name!r}] must be 2-D; got shape {arrays[name].shape}")
        if 0 in arrays[name].shape:
            # (A layer has no size of 0: its constructor refuses one.)
            raise ValueError(f"weights[{name!r}] must not be empty; got shape {arrays[name].shape}")
    if bias is None:
        bias = "b_q" in arrays
    if sinks is None:
        sinks = SINKS_NAME in arrays
    if num_hiddens is None and num_heads is None:
        # Nothing known: any head layout, the widths the kernels have (checked
        # against each other below).
        num_hiddens = int(arrays["W_o"].shape[1])
        query_features, kv_features = int(arrays["W_q"].shape[1]), int(arrays["W_k"].shape[1])
    elif num_heads is None:
        # A layer that gives no head layout is d2l's: every width num_hiddens.
        query_features = kv_features = num_hiddens
    else:
        if num_hiddens is None:
            num_hiddens = int(arrays["W_o"].shape[1])
        query_features, kv_features = _features(num_hiddens, num_heads, num_kv_heads, head_dim)
    expected = weight_shapes(
        num_hiddens,
        query_size=arrays["W_q"].shape[0] if query_size is None else query_size,
        key_size=arrays["W_k"].shape[0] if key_size is None else key_size,
        value_size=arrays["W_v"].shape[0] if value_size is None else value_size,
        bias=bias,
    )
    expected["W_q"] = (expected["W_q"][0], query_features)
    expected["W_k"] = (expected["W_k"][0], kv_features)
    expected["W_v"] = (expected["W_v"][0], kv_features)
    expected["W_o"] = (query_features, num_hiddens)
    if bias:
        expected.update({"b_q": (query_features,), "b_k": (kv_features,), "b_v": (kv_features,)})
    head_size = None if num_heads is None else query_features // num_heads
    qk_norm, norm_shapes = spec.qk_norm_shapes(
        {name: arrays[name].shape for name in NORM_NAMES if name in arrays},
        qk_norm,
        query_features=query_features,
        kv_features=kv_features,
        head_dim=head_size,
    )
    expected.update(norm_shapes)
    if sinks:
        expected[SINKS_NAME] = spec.sinks_shape(arrays.get(SINKS_NAME), num_heads, query_features)
    for name in sorted(set(expected) - set(arrays)):
        reason = f"qk_norm scope {qk_norm!r}" if name in NORM_NAMES else f"bias={bias}"
        reason = f"sinks={sinks}" if name == SINKS_NAME else reason
        raise ValueError(f"weights is missing {name!r} ({reason})")
    for name in sorted(set(arrays) - set(expected)):
        flag = "sinks" if name == SINKS_NAME else "bias" if name in BIAS_NAMES else ""
        reason = f" (the layer has {flag}=False)" if flag else ""
        reason = " (the layer has no qk_norm)" if name in NORM_NAMES else reason
        raise ValueError(
            f"weights has an unexpected entry {name!r}{reason}; expected exactly {sorted(expected)}"
        )
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(f"weights[{name!r}] must have shape {shape}; got {arrays[name].shape}")
        dtype = arrays[name].dtype
        if dtype.kind == "f" and dtype.itemsize > 8:
            # (numpy's extended precision: no framework, and no file format but numpy's,
            # holds it; each writer failed its own way.)
            raise TypeError(
                f"weights[{name!r}] has dtype {dtype}: canonical weights are float16, float32 "
                "or float64"
            )
        if dtype.kind != "f":
            # (bfloat16, ml_dtypes' to numpy, is no numpy float: its kind is "V".)
            detail = (
                ": canonical weights are float16, float32 or float64 (bfloat16 casts to "
                "float32 exactly)"
                if dtype.name == "bfloat16"
                else ""
            )
            raise TypeError(
                f"weights[{name!r}] must be a floating-point array; got dtype {dtype}{detail}"
            )
    config = WeightsConfig(
        num_hiddens=num_hiddens,
        query_size=expected["W_q"][0],
        key_size=expected["W_k"][0],
        value_size=expected["W_v"][0],
        bias=bias,
        query_features=query_features,
        kv_features=kv_features,
        sinks=sinks,
    )
    return {name: arrays[name] for name in expected}, config


class SizedLayer(Protocol):
    """What :func:`check_layer_weights` reads of a layer of any framework."""

    num_hiddens: int
    bias: bool
    #: The layer's checked constructor options (its ``qk_norm`` names the norms'
    #: entries, and its ``sinks`` are read).
    options: spec.LayerOptions

    @property
    def heads(self) -> spec.Heads:
        """The layer's head layout."""

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where not known yet."""


def check_layer_weights(
    weights: Mapping[str, Any], layer: SizedLayer, heads: spec.Heads | None = None
) -> tuple[dict[str, np.ndarray], WeightsConfig]:
    """:func:`check_weights` against a layer: its width, biases, norms, heads and known
    input sizes.

    Args:
        weights: the canonical mapping to load into ``layer``.
        layer: the layer; input sizes it does not know yet are read from ``weights``.
        heads: the head layout the weights must have; ``None`` for ``layer.heads``
            (a layer whose heads are sharded loads the whole layer's weights).

    Returns:
        ``(weights, config)`` as :func:`check_weights` returns them.

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not a
            floating-point array.
        ValueError: a missing, extra or mis-shaped entry (``sinks`` as the
            layer's ``options.sinks`` says), named.
    """
    heads = layer.heads if heads is None else heads
    qk_norm = layer.options.qk_norm
    return check_weights(
        weights,
        num_hiddens=layer.num_hiddens,
        bias=layer.bias,
        qk_norm=False if qk_norm is None else qk_norm.scope,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        **layer.input_sizes(),
        sinks=layer.options.sinks,
    )


def _format(path: str | os.PathLike[str]) -> str:
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in (".npz", ".safetensors"):
        raise ValueError(f"path must end in .npz or .safetensors; got {os.fspath(path)!r}")
    return suffix


def save_weights(path: str | os.PathLike[str], weights: Mapping[str, Any]) -> None:
    """Writes canonical weights to ``.npz`` or ``.safetensors`` (by suffix).

    The weights are validated first; nothing is written for an invalid mapping.
    """
    arrays, _ = check_weights(weights, qk_norm=None, sinks=None)
    if _format(path) == ".npz":
        with open(path, "wb") as file:
            np.savez(file, **arrays)
    else:
        from safetensors.numpy import save

        # Serialised in memory and written by Python so that an unwritable path
        # raises the usual OSError rather than safetensors' own error.
        data = save({name: np.ascontiguousarray(a) for name, a in arrays.items()})
        with open(path, "wb") as file:
            file.write(data)


def _read_npz(path: str) -> dict[str, np.ndarray]:
    # Opened here so that a missing or unreadable file keeps its OSError, and
    # checked for the zip signature because np.load hands anything else to its
    # pickle branch, whose message (or, on numpy 2, EOFError for an empty file)
    # would not say that the file is damaged.
    with open(path, "rb") as stream:
        if stream.read(4) not in _ZIP_SIGNATURES:
            raise ValueError(
                f"{path!r} is not a valid .npz file: it is not a zip archive "
                "(truncated, or another format)"
            )
        stream.seek(0)
        try:
            with np.load(stream, allow_pickle=False) as archive:
                names = archive.files
                # (A zip archive may hold a name twice, or as name and name.npy: numpy
                # would read the last of them, with no word.)
                twice = sorted({name for name in names if names.count(name) > 1})
                if twice:
                    raise ValueError(f"it holds {', '.join(map(repr, twice))} twice")
                return {name: archive[name] for name in names}
        # What zipfile and zlib raise for damaged archives: a bad header can ask
        # for an unsupported feature or version, encryption, or a seek before
        # the start of the file (OSError), or an array no memory holds.
        except (
            zipfile.BadZipFile,
            zlib.error,
            EOFError,
            NotImplementedError,
            RuntimeError,
            OSError,
            MemoryError,
        ) as error:
            raise ValueError(
                f"{path!r} is not a valid .npz file (truncated or corrupt): {error}"
            ) from error
        except ValueError as error:  # e.g. an object array, refused without unpickling
            raise ValueError(f"{path!r} is not a valid .npz file: {error}") from error


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except SafetensorError as error:
        raise ValueError(
            f"{path!r} is not a valid .safetensors file (truncated or corrupt): {error}"
        ) from error
    # A valid file of a dtype numpy lacks: bfloat16 (TypeError), the float8 types
    # (safetensors asks numpy for them by name: AttributeError).
    except (TypeError, AttributeError) as error:
        raise TypeError(
            f"{path!r} holds a tensor numpy cannot represent ({error}); "
            "canonical weights are float16, float32 or float64"
        ) from error


def load_weights(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Reads and validates canonical weights from ``.npz`` or ``.safetensors``.

    Raises:
        OSError: the file cannot be opened (``FileNotFoundError`` when there is none).
        ValueError: a suffix other than ``.npz``/``.safetensors``; a
            truncated, corrupt or empty file, or one holding pickled objects;
            weights that :func:`check_weights` rejects (its message, after
            the file's name).
        TypeError: a tensor whose dtype numpy cannot represent (``bfloat16``),
            or weights that are not floating-point.
    """
    reader = _read_npz if _format(path) == ".npz" else _read_safetensors
    path = os.fspath(path)
    if os.path.isdir(path):  # (safetensors' own error named no path)
        raise IsADirectoryError(f"{path!r} is a directory, not a weights file")
    weights = reader(path)
    if not weights:
        raise ValueError(
            f"{path!r} holds no arrays; expected canonical weights {', '.join(KERNEL_NAMES)}"
        )
    try:
        return check_weights(weights, qk_norm=None, sinks=None)[0]
    except ValueError as error:
        raise ValueError(f"{path!r}: {error}") from error
    except TypeError as error:
        raise TypeError(f"{path!r}: {error}") from error
