"""The checkpoint folders every backend converts hold what transformers computes.

``tests/fixtures/checkpoints/`` and ``transformers_checkpoints.npz`` were
written by ``tests/fixtures/transformers_checkpoints.py``; here, where
transformers is installed, each folder loads with ``from_pretrained`` into a
model whose blocks give the stored outputs, and
:func:`~mha_multi.interop.transformers.attention_layers` gives, from the
files alone, the arguments :func:`~mha_multi.interop.llama.from_llama`
gives of each loaded block.
"""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
from transformers_blocks import attention_results  # noqa: E402
from transformers_checkpoints import CHECKPOINTS, FOLDERS, loaded, results  # noqa: E402

from mha_multi.interop.llama import from_llama  # noqa: E402
from mha_multi.interop.transformers import attention_layers  # noqa: E402


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
