"""Docstring text that several frameworks' layers share, written once.

A docstring names a fragment on a line of its own, as ``{grouped_heads}``;
:func:`fill` puts the fragment's text in that line's place, indented as the
line is, when the layer's module is imported. ``help()`` and Sphinx read the
filled docstring, so they show the whole text; only the source is shorter.
Text that differs between the frameworks stays in each layer's docstring.
"""

from __future__ import annotations

import re
from typing import TypeVar

__all__ = ["FRAGMENTS", "fill"]

T = TypeVar("T")

#: Fragment name -> text, without the indentation of the place it fills.
FRAGMENTS: dict[str, str] = {
    # The class docstrings of the PyTorch, Keras and MXNet layers.
    "grouped_heads": """\
Grouped-query attention (docs: "The spec", grouped heads): with
``num_kv_heads < num_heads`` query head ``h`` reads key/value head
``h // (num_heads // num_kv_heads)``; ``W_k`` and ``W_v`` project to
``num_kv_heads * head_dim`` features, ``W_q`` to ``num_heads * head_dim``.""",
    # Constructor arguments (a Linen module's attributes).
    "num_heads_arg": """\
num_heads: number of (query) heads ``H``; must divide ``num_hiddens``
    unless ``head_dim`` is given.""",
    "kv_heads_args": """\
num_kv_heads: number of key/value heads; must divide ``num_heads``
    (``None``: ``num_heads``).
head_dim: size of each head (``None``: ``num_hiddens // num_heads``).""",
    "options_args": """\
rotary: ``None``, or rotary position embeddings of the projected
    queries and keys: a :class:`~mha_multi.spec.Rotary` or a dict of
    its fields (docs: "Positions and biases").
alibi: add ALiBi's per-head linear bias of the key distance.
window: ``None``, or the sliding window: a query sees the keys at
    most ``window - 1`` positions behind it.
softcap: ``None``, or Gemma 2's soft cap of the scaled scores.
qk_norm: ``None``, or the RMSNorm of the projected queries and keys
    before rotary: a :class:`~mha_multi.spec.QKNorm` or a dict of its
    fields; its weights are the parameters ``q_norm`` and ``k_norm``.
sinks: give each head a learned sink logit (the weight ``sinks``
    ``(num_heads,)``, zeros at first) that joins every query's softmax,
    taking weight but giving no value (gpt-oss). Together they are the
    layer's :class:`~mha_multi.spec.LayerOptions`.""",
    # The Flax modules' (NNX and Linen) computation settings.
    "flax_compute_args": """\
dtype: computation dtype; ``None`` promotes inputs and parameters.
param_dtype: dtype of the parameters. float64 (either) needs JAX's x64,
    without which JAX holds float32: refused (``ValueError``).
precision: precision of every matrix product.
implementation: which attention kernel runs when the weights are not
    requested and dropout is off: ``None`` (cuDNN's for 16-bit inputs
    on a GPU, the generic path otherwise), ``"generic"``, ``"xla"``
    or ``"cudnn"``; see :mod:`mha_multi.jax.functional`.""",
    # ``make_layer`` of the parity harness, one per framework (docs: "Architecture").
    "harness_layer_args": """\
num_hiddens: the layer's ``num_hiddens``.
num_heads: the layer's ``num_heads``.
num_kv_heads: the layer's ``num_kv_heads`` (``None``: ``num_heads``).
head_dim: the layer's ``head_dim`` (``None``: ``num_hiddens // num_heads``).
device: ``"cpu"`` or ``"gpu"``.""",
    # Call arguments.
    "positions_arg": """\
positions: ``None``, or integer ``(B, Q)`` positions a ``rotary``
    layer rotates the queries (and the keys of self-attention or a
    cached call) by; default ``arange``, with a cache
    ``lengths[b] + i`` (docs: "Positions and biases").""",
    "segment_ids_arg": """segment_ids: ``None``, or integer ``(B, Q)`` ids of packed sequences:
    query ``i`` sees key ``j`` only when their ids are equal, and a
    negative id is padding, fully hidden; a tuple ``(query_ids,
    key_ids)`` gives the keys ``(B, K)`` ids of their own. Rotary
    positions restart at each sequence unless ``positions`` are given.
    Not with a cache (docs: "Packed sequences").""",
}

_PLACEHOLDER = re.compile(r"^(\s*)\{(\w+)\}$")


def fill(obj: T) -> T:
    """Decorator: ``obj``'s docstring with each ``{name}`` line replaced by ``FRAGMENTS[name]``.

    Args:
        obj: a class or function; one without a docstring (``python -OO``)
            is returned as it is.

    Returns:
        ``obj``, its ``__doc__`` filled.

    Raises:
        KeyError: a placeholder names no fragment.
    """
    doc = obj.__doc__
    if doc is not None:
        obj.__doc__ = "\n".join(_filled(line) for line in doc.split("\n"))
    return obj


def _filled(line: str) -> str:
    match = _PLACEHOLDER.match(line)
    if match is None:
        return line
    indent, name = match.groups()
    return "\n".join(indent + text if text else text for text in FRAGMENTS[name].split("\n"))
