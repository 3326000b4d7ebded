"""The query/key norms' parameters in every backend: their start, canonical weights in and out.

What the norms compute, their gradients and a cached decode are the parity
cases' (``qk_norm_heads``, ``qk_norm_whole``, ``cached_qk_norm``) and the
transformers blocks' (Qwen 3, Gemma 3, OLMo 2).
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.weights import init_weights

LAYOUT = {"num_kv_heads": 1, "query_size": 8, "key_size": 8, "value_size": 8}


@pytest.mark.parametrize("scope", ["heads", "whole"])
def test_norms_start_as_the_models_and_load_strictly(runner, scope):
    """``w`` starts at 1, Gemma's ``1 + w`` at 0; weights go in and out bit-exact, and a
    missing or unexpected norm entry is named."""
    for unit_offset in (False, True):
        norm = {"scope": scope, "unit_offset": unit_offset}
        start = runner.get_weights(runner.make_layer(8, 2, qk_norm=norm, **LAYOUT))
        shapes = spec.QKNorm(**norm).shapes(spec.Heads(2, 1, 4))
        for name, shape in shapes.items():
            np.testing.assert_array_equal(start[name], np.full(shape, 0.0 if unit_offset else 1.0))
    rng = np.random.default_rng(0)
    weights = init_weights(8, num_heads=2, num_kv_heads=1, seed=0)
    weights |= {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
    layer = runner.make_layer(8, 2, qk_norm={"scope": scope}, **LAYOUT)
    got = runner.get_weights(runner.set_weights(layer, weights))
    assert sorted(got) == sorted(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    missing = {name: array for name, array in weights.items() if name != "k_norm"}
    with pytest.raises(ValueError, match="'k_norm'"):
        runner.set_weights(runner.make_layer(8, 2, qk_norm={"scope": scope}, **LAYOUT), missing)
    with pytest.raises(ValueError, match="'k_norm'.*no qk_norm"):
        runner.set_weights(runner.make_layer(8, 2, **LAYOUT), weights)
