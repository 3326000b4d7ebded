"""A transformers causal LM generating with our layer and its cache in every decoder layer."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mha_multi.interop.transformers_models import replace_attention

sizes = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
config = LlamaConfig(**sizes, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
# Two prompts, the shorter left-padded, as a tokenizer pads for generation.
input_ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 10, 11, 12]])
attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
greedy = {"do_sample": False, "max_new_tokens": 8, "min_new_tokens": 8}
with torch.no_grad():
    expected = model.generate(input_ids, attention_mask=attention_mask, **greedy)

# [causal-lm]
# Every self_attn becomes our layer (converted by from_llama: an unknown block is
# refused before anything changes); each holds a cache of max_length positions.
replace_attention(model, max_length=16)
with torch.no_grad():
    logits = model(input_ids, attention_mask=attention_mask).logits
    tokens = model.generate(input_ids, attention_mask=attention_mask, **greedy)
# [/causal-lm]

assert logits.shape == (2, 5, 97)
assert torch.equal(tokens, expected)  # transformers' own tokens
print(tokens[:, 5:].tolist())
