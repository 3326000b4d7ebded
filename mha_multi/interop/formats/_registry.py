"""The registry of weight-file formats: each format's record, and who tells shared endings apart.

Part of :mod:`mha_multi.interop.formats`, which documents the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = ["FORMATS", "RECOGNISERS", "Format"]


@dataclass(frozen=True)
class Format:
    """A weight-file format of the registry.

    Attributes:
        name: the registry key, as ``--from``/``--to`` take it (``torch-mha``).
        description: one line saying what the file holds.
        suffixes: lower-case endings of the file names that mean this format.
        reader: ``"module:function"``; the function takes ``(path)`` (and, when
            :attr:`heads`, ``num_heads=``, ``num_kv_heads=`` and
            ``head_dim=``, each ``None`` where not given) and returns
            canonical weights.
        writer: ``"module:function"``; the function takes ``(path, weights)``
            (and, when :attr:`heads`, the three keywords, resolved against the
            weights: all ints).
        framework: what the reader and writer import, as users know it
            (``"PyTorch"``); ``None`` for numpy alone.
        extra: the ``mha_multi[...]`` extra that installs the framework.
        heads: what the file does with the head layout. ``None``: it records
            none (the weights' widths are all it says; a layout given is
            checked against them). ``"stored"``: it stores the layout (kernels
            per head): the reader checks the keywords given against it, the
            writer needs it. ``"required"``: its shapes follow a layout that it
            does not record (a Llama state dict): the reader and the writer
            both need it.
        default: written for a file name that several formats share.
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    reader: str
    writer: str
    framework: str | None = None
    extra: str | None = None
    heads: Literal["stored", "required"] | None = None
    default: bool = True


#: Module of :mod:`mha_multi.interop` -> the framework it imports, as users
#: know it, and the ``mha_multi[...]`` extra that installs that framework.
_FRAMEWORKS = {
    "torch": ("PyTorch", "torch"),
    "llama": ("PyTorch", "torch"),
    "mxnet": ("MXNet", "mxnet"),
    "keras": ("Keras", "keras"),
}


def _interop_format(
    name: str,
    module: str,
    description: str,
    suffixes: tuple[str, ...],
    *,
    heads: Literal["stored", "required"] | None = None,
    default: bool = True,
) -> Format:
    """The record of a format that ``mha_multi.interop.<module>`` reads and writes.

    The reader and writer are that module's ``load_<format>`` and
    ``save_<format>`` (``-`` in ``name`` written ``_``), the names every
    interop module gives them.
    """
    framework, extra = _FRAMEWORKS[module]
    function = name.replace("-", "_")
    return Format(
        name=name,
        description=description,
        suffixes=suffixes,
        reader=f"mha_multi.interop.{module}:load_{function}",
        writer=f"mha_multi.interop.{module}:save_{function}",
        framework=framework,
        extra=extra,
        heads=heads,
        default=default,
    )


#: Format name -> record, in the order help and error messages list them.
FORMATS: Mapping[str, Format] = MappingProxyType(
    {
        record.name: record
        for record in (
            Format(
                name="canonical",
                description="canonical weights (.npz read with allow_pickle=False)",
                suffixes=(".npz", ".safetensors"),
                reader="mha_multi.weights:load_weights",
                writer="mha_multi.weights:save_weights",
            ),
            _interop_format(
                "torch-mha",
                "torch",
                "state_dict of torch.nn.MultiheadAttention",
                (".pt", ".pth"),
                default=False,
            ),
            _interop_format(
                "torch-d2l",
                "torch",
                "state_dict of d2l's torch MultiHeadAttention (also mha_multi.torch's)",
                (".pt", ".pth"),
            ),
            _interop_format(
                "llama",
                "llama",
                "state_dict of a Llama-style attention (q_proj, k_proj, v_proj, o_proj; "
                "transformers' LlamaAttention; read also with Phi-3's fused qkv_proj), "
                "by torch.save or safetensors",
                (".pt", ".pth", ".bin", ".safetensors"),
                heads="required",
                default=False,
            ),
            _interop_format(
                "mxnet-d2l",
                "mxnet",
                "Gluon parameters of d2l's MXNet MultiHeadAttention "
                "(also mha_multi.mxnet's), as save_parameters writes them",
                (".params",),
            ),
            _interop_format(
                "keras-mha",
                "keras",
                "Keras save_weights of a model holding one keras.layers.MultiHeadAttention",
                (".weights.h5",),
                heads="stored",
            ),
            _interop_format(
                "keras-gqa",
                "keras",
                "Keras save_weights of a model holding one keras.layers.GroupQueryAttention",
                (".weights.h5",),
                heads="stored",
                default=False,
            ),
        )
    }
)

#: File name ending shared by several formats -> ``"module:function"`` telling,
#: from the content of such a file, which of them it is (``function(path) ->
#: name``). A recogniser imports what reading the file needs, no more: a
#: ``.safetensors`` file is told apart by its header alone, without PyTorch.
RECOGNISERS: Mapping[str, str] = MappingProxyType(
    {
        ".safetensors": "mha_multi.interop.formats:safetensors_format",
        ".pt": "mha_multi.interop.torch:checkpoint_format",
        ".pth": "mha_multi.interop.torch:checkpoint_format",
        ".weights.h5": "mha_multi.interop.keras:weights_file_format",
    }
)


def _record(name: str) -> Format:
    """The record of format ``name``; ``ValueError`` naming the formats if there is none."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {', '.join(FORMATS)}") from None
