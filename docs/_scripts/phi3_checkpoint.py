"""Writes the small Phi-3 checkpoint that the porting examples of every framework read.

``python docs/_scripts/phi3_checkpoint.py`` (in an environment with torch and
transformers: the ``tests-torch`` one) builds transformers' ``Phi3Attention``
from a small config (random weights, fused ``qkv_proj``, partial rotary, a
sliding window) and writes, in ``docs/examples/phi3/``:

* ``config.json``: the model's config, as a checkpoint directory holds it;
* ``model.safetensors``: the block's float32 state dict under
  ``model.layers.0.self_attn.``, as in a model's checkpoint;
* ``expected.npz``: an input, its ``position_ids`` and the block's float64
  output, which the examples check their layer against.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers.models.phi3 import modeling_phi3

OUT = Path(__file__).resolve().parents[1] / "examples" / "phi3"
PREFIX = "model.layers.0.self_attn."
#: The config's attention settings; the rest keeps Phi-3's defaults.
ATTENTION = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped heads
    "partial_rotary_factor": 0.5,  # half of each head rotated
    "sliding_window": 4,
}


def main() -> None:
    config = modeling_phi3.Phi3Config(**ATTENTION)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    block = modeling_phi3.Phi3Attention(config, layer_idx=0).eval()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "config.json").write_text(config.to_json_string())
    save_file(
        {PREFIX + name: t.contiguous() for name, t in block.state_dict().items()},
        OUT / "model.safetensors",
    )
    # The block's own output in float64 on a causal batch at shifted positions.
    block = block.double()
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 6, 32)))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    visible = (j <= i) & (i - j < config.sliding_window)
    mask = torch.from_numpy(np.where(visible, 0.0, -1e30))[None, None].expand(2, 1, 6, 6)
    rotary = modeling_phi3.Phi3RotaryEmbedding(config).double()
    with torch.no_grad():
        output, _ = block(x, rotary(x, positions), attention_mask=mask)
    np.savez(OUT / "expected.npz", x=x.numpy(), positions=positions.numpy(), output=output.numpy())


if __name__ == "__main__":
    main()
