#!/usr/bin/env python3
"""A Hugging Face Llama running its attention on attnc: register the backend, build a small
random model from a config (no download), and check it against transformers' "sdpa" on a
left-padded batch, in generation and in training.

    pip install ./python torch transformers
    python python/examples/hf_llama.py
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import attnc.hf

name = attnc.hf.register()  # "attnc": attention and mask functions
config = LlamaConfig(
    vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
)
torch.manual_seed(0)
ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
reference.load_state_dict(ours.state_dict())

ids = torch.randint(0, 1000, (2, 64))
mask = torch.ones_like(ids)
mask[1, :16] = 0  # left padding: transformers hands attnc the padding mask too
with torch.no_grad():
    a = ours(input_ids=ids, attention_mask=mask).logits
    b = reference(input_ids=ids, attention_mask=mask).logits
    print(f"logits: max |attnc - sdpa| = {float((a - b)[mask.bool()].abs().max()):.2e}")
    gen_a = ours.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    gen_b = reference.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    print(f"greedy generation, 16 tokens through the KV cache: identical = {bool(torch.equal(gen_a, gen_b))}")

labels = ids.clone()
labels[1, :17] = -100
opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
for step in range(5):
    opt.zero_grad()
    loss = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()  # through attnc's fused backward
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")
