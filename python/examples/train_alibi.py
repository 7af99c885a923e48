#!/usr/bin/env python3
"""Train a tiny causal language model whose attention is attnc's ALiBi kernel.

The attention block is ``examples/alibi.attn``, compiled by attnc; its backward pass is derived
by attnc from the same source, so the ALiBi slopes are learned too. The same model written in
plain PyTorch starts from the same weights and takes the same steps; the two losses must agree
at every step. Synthetic data: each sequence counts up from a random start (mod the
vocabulary), so the next token is predictable from the previous one.

    python python/examples/train_alibi.py [--steps 40]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import attnc
import attnc.torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB, EMBED, HEADS, SEQ, BATCH = 32, 32, 4, 24, 8


class TinyLM(torch.nn.Module):
    """Embedding, one causal ALiBi attention layer with a residual, and a readout."""

    def __init__(self, attention):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, EMBED)
        self.qkv = torch.nn.Linear(EMBED, 3 * EMBED)
        self.proj = torch.nn.Linear(EMBED, EMBED)
        self.readout = torch.nn.Linear(EMBED, VOCAB)
        # ALiBi's slopes m_h = 2^(-8h/H), learned here.
        self.slopes = torch.nn.Parameter(torch.tensor([2.0 ** (-8.0 * h / HEADS) for h in range(1, HEADS + 1)]))
        self.attention = attention

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, EMBED // HEADS).permute(2, 0, 3, 1, 4)
        a = self.attention(q, k, v, self.slopes)  # [B, H, S, Dh]
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, EMBED))
        return self.readout(x)


def torch_alibi(q, k, v, slopes):
    """The same attention in plain PyTorch: softmax(q kᵀ/√D + m_h (j - i), causal) v."""
    s, d = q.shape[-2], q.shape[-1]
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    bias = (slopes[:, None, None] * (j - i)).masked_fill(j > i, float("-inf"))
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + bias, dim=-1) @ v


def batch(generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    return (start + torch.arange(SEQ + 1)) % VOCAB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    prog = attnc.compile(ROOT / "examples" / "alibi.attn", threads=1)
    ours = TinyLM(attnc.torch.attention(prog))
    theirs = TinyLM(torch_alibi)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.Adam(ours.parameters(), lr=3e-3)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    initial_slopes = ours.slopes.detach().clone()
    start = time.perf_counter()
    worst = 0.0
    first = last = float("nan")
    for step in range(args.steps):
        tokens = batch(data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        losses = []
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        if step == 0:
            first = losses[0]
        last = losses[0]
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}: loss attnc {losses[0]:.5f}  pytorch {losses[1]:.5f}")
    slope_gap = float((ours.slopes - theirs.slopes).detach().abs().max())
    moved = float((ours.slopes.detach() - initial_slopes).abs().max())
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s; loss {first:.3f} -> {last:.3f}; "
          f"largest loss difference {worst:.2e}; slopes moved by {moved:.3f} and differ by {slope_gap:.2e}")
    if worst > 1e-3 or slope_gap > 1e-3:
        print("attnc and PyTorch disagree", file=sys.stderr)
        return 1
    if args.steps >= 20 and not last < first:
        print("the loss did not decrease", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
