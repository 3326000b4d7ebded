"""Canonical weights to and from ``keras.layers.MultiHeadAttention``,
``keras.layers.GroupQueryAttention`` and d2l's Keras layer.

``keras.layers.MultiHeadAttention(num_heads=H, key_dim=dh)`` on 3-D inputs
computes the spec's function with ``num_hiddens = H * dh``. Its projections
are ``EinsumDense`` layers named ``query``, ``key``, ``value`` (kernels
``(in, H, dh)``, biases ``(H, dh)``) and ``output`` (kernel ``(H, dh, out)``,
bias ``(out,)``); reshaping a kernel to ``(in, H * dh)`` puts head ``h`` in
columns ``[h*dh, (h+1)*dh)``, the spec's head layout, so the canonical
weights are those kernels reshaped. Things callers must mind:

* scaling: Keras scales the scores by ``1/sqrt(key_dim)``, which is the
  spec's ``1/sqrt(head_dim)`` since ``key_dim`` is the head size;
* call order: Keras' layer is called ``(query, value, key)``, the spec's
  ``(queries, keys, values)``;
* masks: Keras' ``attention_mask`` is ``(B, Q, K)`` with ``True`` where a key
  is *visible* (:func:`attention_mask` builds it from ``valid_lens``);
  ``valid_lens`` counts visible keys. Keras' ``use_causal_mask`` aligns the
  triangle top-left, which equals the spec's bottom-right ``causal`` only
  when ``Q == K``; :func:`attention_mask` with ``causal=True`` gives the
  spec's rule for any sizes;
* fully hidden rows: the spec replaces hidden scores by ``-1e6``, so a
  query that sees no key gets uniform weights (the mean of all values).
  Keras' layer has two paths. Without scores and dropout it calls
  ``keras.ops.dot_product_attention``, which replaces hidden scores by a
  huge negative number: uniform weights, the spec's result. With
  ``return_attention_scores=True`` or dropout it uses its masked
  ``Softmax``, which zeroes hidden weights after the softmax: such a row
  attends to nothing, and its output is the output bias alone. Rows that
  see a key agree on both paths;
* returned scores are ``(B, H, Q, K)`` like the spec's weights.

What the canonical layer cannot express raises a ``ValueError`` saying what
is unsupported: attention over several axes, ``value_dim != key_dim``, an
``output_shape`` other than ``num_hiddens``, biases on some projections
only, a gate (``use_gate``) or a ``sliding_window``. The other way, these
converters hold d2l's head layout only: grouped key/value heads, which
``keras.layers.MultiHeadAttention`` lacks, or an explicit ``head_dim`` raise
a ``ValueError`` pointing to ``GroupQueryAttention``.

``keras.layers.GroupQueryAttention(head_dim, num_query_heads,
num_key_value_heads)`` computes the spec's grouped-query attention (docs:
"The spec", grouped heads) with ``num_heads = num_query_heads`` and
``num_kv_heads = num_key_value_heads``: it repeats each projected key/value
head ``G = num_heads // num_kv_heads`` times one after the other
(``ops.repeat`` on the heads axis), so query head ``h`` reads key/value head
``h // G``, the spec's rule. Its projections are ``EinsumDense`` layers named
``query`` (kernel ``(in, num_heads, head_dim)``), ``key`` and ``value``
(``(in, num_kv_heads, head_dim)``) and ``attention_output`` (``(num_heads,
head_dim, query_size)``), biases ``(heads, head_dim)`` and ``(query_size,)``
iff ``use_bias`` (on by default); the canonical weights are those kernels
reshaped, as above. What differs from ``MultiHeadAttention``, and what not:

* it scales the scores by ``1/sqrt(head_dim)``, the spec's scale, for any
  ``head_dim`` (it need not divide the output size);
* its output has the query's size (it has no ``output_shape``), so only
  weights with ``query_size == num_hiddens`` convert to it;
* call order, ``attention_mask`` polarity and shape, the top-left
  ``use_causal_mask`` and the two paths for fully hidden rows are those of
  ``MultiHeadAttention`` above (the same ``ops.dot_product_attention``, or
  the masked ``Softmax`` with scores or dropout); its dropout, like the
  spec's, drops attention weights;
* a gate (``use_gate``) or a ``sliding_window`` has no canonical form and
  is refused both ways.

Files: :func:`load_keras_mha`/:func:`save_keras_mha` and
:func:`load_keras_gqa`/:func:`save_keras_gqa` read and write what
``model.save_weights`` writes (``.weights.h5``) for a model holding one such
layer (the ``keras-mha`` and ``keras-gqa`` formats of ``python -m mha_multi
convert``; :func:`weights_file_format` tells them apart). The kernels store
the head layout, which the readers check head options against. A weights
file holds no configuration: a ``sliding_window``, which has no weights,
cannot be seen in one. Keras builds a ``GroupQueryAttention`` in a model
only for values of the query's size, so only such weights are written.

d2l's Keras/TensorFlow ``MultiHeadAttention`` holds ``keras.layers.Dense``
projections ``W_q``, ``W_k``, ``W_v``, ``W_o`` (``use_bias=False`` in the
book); their kernels are already canonical (:func:`from_keras_d2l`,
:func:`to_keras_d2l`).
"""

from mha_multi.interop.keras import _gqa, _mha
from mha_multi.interop.keras._d2l import from_keras_d2l, to_keras_d2l
from mha_multi.interop.keras._files import (
    load_keras_gqa,
    load_keras_mha,
    save_keras_gqa,
    save_keras_mha,
)
from mha_multi.interop.keras._gqa import (
    from_keras_gqa,
    from_keras_gqa_state,
    to_keras_gqa,
    to_keras_gqa_state,
)
from mha_multi.interop.keras._h5_groups import weights_file_format
from mha_multi.interop.keras._mask import attention_mask
from mha_multi.interop.keras._mha import (
    from_keras_mha,
    from_keras_mha_state,
    to_keras_mha,
    to_keras_mha_state,
)

# The sublayer names are bound here, with their descriptions, because the API
# page reads the descriptions of data from the module it documents.

#: Keras' sublayer name -> canonical projection letter.
KERAS_MHA_NAMES = _mha.KERAS_MHA_NAMES
#: ``keras.layers.GroupQueryAttention``'s sublayer name -> canonical projection letter.
KERAS_GQA_NAMES = _gqa.KERAS_GQA_NAMES

__all__ = [
    "KERAS_GQA_NAMES",
    "KERAS_MHA_NAMES",
    "attention_mask",
    "from_keras_d2l",
    "from_keras_gqa",
    "from_keras_gqa_state",
    "from_keras_mha",
    "from_keras_mha_state",
    "load_keras_gqa",
    "load_keras_mha",
    "save_keras_gqa",
    "save_keras_mha",
    "to_keras_d2l",
    "to_keras_gqa",
    "to_keras_gqa_state",
    "to_keras_mha",
    "to_keras_mha_state",
    "weights_file_format",
]
