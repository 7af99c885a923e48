#!/usr/bin/env bash
# Regenerates the pictures in docs/pictures/ from the examples (see docs/pictures.md).
# Usage: bash docs/pictures/make.sh   (from anywhere; builds attnc first, a debug build is fast enough)
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --quiet --bin attnc
attnc=target/debug/attnc
out=docs/pictures

# Tile maps: causal, sliding window with global tokens, prefix-LM (one panel each).
$attnc explain examples/causal.attn --dim S=1024 --tiles $out/tiles-causal.png >/dev/null
$attnc explain examples/sliding_window.attn --dim S=2048 --tiles $out/tiles-sliding-window.png >/dev/null
$attnc explain examples/document_mask.attn --random-inputs --dim B=1 --dim S=512 --tile-size 32x32 \
    --tiles $out/tiles-document-mask.png >/dev/null
$attnc explain examples/prefix_lm.attn --dim S=1024 --tile-size 32x32 --tiles $out/tiles-prefix-lm.png >/dev/null

# The graph before and after optimisation.
$attnc build examples/causal.attn --emit svg -o $out/causal-ir.svg
$attnc build examples/causal.attn --emit svg-opt -o $out/causal-opt.svg

# An alignment matrix with tokens on its axes (random weights: the inputs are seeded noise).
$attnc run examples/alignment.attn --random-inputs --seed 3 --dim B=1 --dim M=7 --dim N=8 --dim D=4 \
    --heatmap weights=$out/alignment.png --labels $out/alignment-rows.txt,$out/alignment-cols.txt >/dev/null
# An output with leading axes: each batch element's alignment [4, 12, 16] is a panel.
$attnc run examples/alignment.attn --random-inputs --seed 5 --dim B=4 --dim M=12 --dim N=16 --dim D=4 \
    --heatmap weights=$out/alignment-batch.png >/dev/null
echo "wrote $(ls $out | grep -cE '\.(png|svg)$') pictures in $out"
