"""Every rotary type's cosines and sines against transformers' own rotary embedding module.

``LlamaRotaryEmbedding`` of a config of each ``rope_type`` gives cos and sin
(attention factor included) at some ``position_ids``: the tables of the
layer's ``rotary=`` read from that config's rotary settings (:func:`rotary_of`,
of no model type: the spec's rotation of part of each head included) must be the
same, within and beyond the original context for the types that switch
(dynamic NTK, LongRoPE), with the call's length given on the host and
computed from the positions on the device.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.interop.llama import rotary_of
from mha_multi.torch._ops import TorchOps

transformers = pytest.importorskip("transformers")

HEAD_DIM = 8
#: rope_type -> (rope_parameters beyond rope_type, other config fields).
CONFIGS = {
    "linear": ({"factor": 2.5}, {}),
    "dynamic": ({"factor": 3.0}, {"max_position_embeddings": 8}),
    "yarn": (
        {
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
        },
        {"max_position_embeddings": 512},
    ),
    "yarn untruncated, attention factor given, half rotated": (
        {
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
            "attention_factor": 1.3,
            "partial_rotary_factor": 0.5,
        },
        {"max_position_embeddings": 256},
    ),
    "longrope": (
        {
            "short_factor": [1.0, 1.25, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
            "original_max_position_embeddings": 8,
        },
        {"max_position_embeddings": 64},
    ),
    "longrope with factor": (
        {
            "short_factor": [1.1, 1.3],
            "long_factor": [3.0, 5.0],
            "original_max_position_embeddings": 8,
            "factor": 2.0,
            "partial_rotary_factor": 0.5,
        },
        {"max_position_embeddings": 64},
    ),
    "llama3": (
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {},
    ),
}
#: Within the original context (largest position 7: length 8), and beyond it.
POSITIONS = {
    "within": np.array([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]),
    "beyond": np.array([[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]]),
}


def settings(config):
    """``config``'s rotary settings alone, of no model type: read as transformers' rotary
    functions read them (a family's blocks may rotate whole heads whatever they say)."""
    return SimpleNamespace(
        rope_parameters=config.rope_parameters,
        max_position_embeddings=config.max_position_embeddings,
    )


def embedding(name):
    """A fresh ``LlamaRotaryEmbedding`` (transformers' dynamic type keeps state) and its config."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRotaryEmbedding

    parameters, fields = CONFIGS[name]
    config = LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": name.split()[0], "rope_theta": 100.0, **parameters},
        **fields,
    )
    return LlamaRotaryEmbedding(config), config


@pytest.mark.parametrize("where", sorted(POSITIONS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tables_are_transformers_cos_and_sin(name, where):
    module, config = embedding(name)
    positions = POSITIONS[where]
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = module(x, torch.from_numpy(positions))
    rotary = spec.check_rotary(rotary_of(settings(config)))
    half = rotary.dim(HEAD_DIM) // 2
    expected = [t[..., :half].numpy() for t in (cos, sin)]
    length = int(positions.max()) + 1
    runs = {
        "host length": (spec.NumpyOps(), np.zeros(1, np.float32), positions, length),
        "device length (numpy)": (spec.NumpyOps(), np.zeros(1, np.float32), positions, None),
        "device length (torch)": (TorchOps(), x, torch.from_numpy(positions), None),
    }
    for run, (ops, like, at, known) in runs.items():
        tables = spec.rotary_tables(ops, like, at, rotary, HEAD_DIM, length=known)
        for ours, theirs in zip(tables, expected, strict=True):
            ours = np.asarray(ours)[..., 0, :]  # (B, T, dim/2): the heads' axis dropped
            # Both are float32 angles; transformers computes the frequencies in float32.
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6, err_msg=f"{name}: {run}")


def test_the_types_that_switch_do_switch_at_the_original_context():
    """The fixtures above would pass for a type that ignored the length: the
    tables within and beyond the original context differ for dynamic NTK and
    LongRoPE, and a call of length exactly the original context is within."""
    for name in ("dynamic", "longrope"):
        rotary = spec.check_rotary(rotary_of(settings(embedding(name)[1])))
        within = rotary.inverse_frequencies(HEAD_DIM, 8)
        np.testing.assert_array_equal(within, rotary.inverse_frequencies(HEAD_DIM, 1))
        assert np.abs(rotary.inverse_frequencies(HEAD_DIM, 9) - within).max() > 1e-3
