#!/usr/bin/env python3
"""A 4-layer Llama-style model (hidden 512, 8 query heads of 64, 2 key/value heads) at B=1,
S=1024: one forward+backward step with attention on attnc (``attnc.hf``) against
transformers' "sdpa", the same weights, interleaved for several rounds, medians compared
(issue target: >= 1.2x sdpa on one thread).

With ``--bound``, a third copy runs with attention replaced by a copy of the queries (no
attention at all): its time is the rest of the step, and sdpa's time over it is the most that
any attention backend could reach against sdpa on this machine.

With ``--pad N``, a batch of two rows, the first left-padded by ``N`` tokens (its attention
mask 0 there, its labels ignored): transformers then hands every backend a bool
``[B, 1, S, S]`` mask (causal and padding) instead of ``is_causal``.

    python python/bench/hf_llama.py [--rounds 3] [--threads 1] [--seq 1024] [--bound] [--pad N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import attnc.hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--bound", action="store_true", help="also time the step without attention (the rest of the model)")
    ap.add_argument("--pad", type=int, default=None, help="a batch of two, the first row left-padded by this many tokens")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name = attnc.hf.register()
    impls = [name, "sdpa"]
    if args.bound:
        from transformers import AttentionInterface

        def no_attention(module, query, key, value, attention_mask, **kwargs):
            # [B, H, S, D] -> [B, S, H, D], the layout transformers expects; key and value stay
            # in the graph (a zero term), so that their projections' gradients are computed.
            return (query.transpose(1, 2) + 0.0 * (key.mean() + value.mean())).contiguous(), None

        AttentionInterface.register("no_attention", no_attention)
        impls.append("no_attention")
    config = LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    models = {impl: AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl) for impl in impls}
    for impl in impls[1:]:
        models[impl].load_state_dict(models[name].state_dict())
    batch = 1 if args.pad is None else 2
    ids = torch.randint(0, 1000, (batch, args.seq))
    mask = torch.ones(batch, args.seq, dtype=torch.long)
    if args.pad is not None:
        mask[0, : args.pad] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def step(model):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    times = {impl: [] for impl in models}
    for impl, model in models.items():
        step(model)  # warm-up (attnc compiles here, once)
    for _ in range(args.rounds):
        for impl, model in models.items():
            start = time.perf_counter()
            step(model)
            times[impl].append(time.perf_counter() - start)
    a, b = statistics.median(times[name]), statistics.median(times["sdpa"])
    padding = "" if args.pad is None else f", row 0 left-padded by {args.pad}"
    print(f"# 4-layer Llama, B={batch} S={args.seq}{padding}, {args.threads} thread(s), torch {torch.__version__}, {args.rounds} rounds interleaved")
    print(f"forward+backward: attnc {a * 1e3:.0f} ms, sdpa {b * 1e3:.0f} ms, sdpa/attnc {b / a:.2f}")
    if args.bound:
        r = statistics.median(times["no_attention"])
        print(f"without attention: {r * 1e3:.0f} ms (the rest of the step); attention: attnc {(a - r) * 1e3:.0f} ms, sdpa {(b - r) * 1e3:.0f} ms; bound on sdpa/attnc {b / r:.2f}")


if __name__ == "__main__":
    main()
