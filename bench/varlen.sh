#!/bin/bash
# A packed ragged batch (issue 40, target: ≥ 1.5× faster than the batch padded to its longest
# sequence, and within 10% of the sequences run one by one): examples/varlen.attn over 8
# sequences of 100–4000 tokens packed into one axis (ids from a .npy file), against
# examples/causal.attn on the batch padded to 4000 (B=8) and on each sequence alone (the sum of
# 8 runs). attnc bench, interleaved round by round, median of the rounds' medians; H=8.
#
#     cargo build --release -p attnc && bash bench/varlen.sh [ROUNDS] [THREADS] [D]
set -euo pipefail
cd "$(dirname "$0")/.."
A=./target/release/attnc
ROUNDS=${1:-3}
THREADS=${2:-2}
D=${3:-64}
LENS="100 650 1200 1750 2300 2850 3400 4000"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 bench/write_ids.py "$dir/seq.npy" $LENS
ms() { "$A" bench "$@" --threads "$THREADS" --iters 3 --warmup 1 --json | sed -n 's/^json: .*"median_ms": \([0-9.]*\).*/\1/p'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
packed="" padded="" separate=""
for _ in $(seq "$ROUNDS"); do
  packed="$packed $(ms examples/varlen.attn --input "seq=$dir/seq.npy" --dim H=8 --dim "D=$D")"
  padded="$padded $(ms examples/causal.attn --dim B=8 --dim H=8 --dim S=4000 --dim "D=$D")"
  sum=0
  for n in $LENS; do
    t=$(ms examples/causal.attn --dim B=1 --dim H=8 --dim "S=$n" --dim "D=$D")
    sum=$(awk -v a="$sum" -v b="$t" 'BEGIN {print a + b}')
  done
  separate="$separate $sum"
done
p=$(echo "$packed" | median); q=$(echo "$padded" | median); s=$(echo "$separate" | median)
awk -v p="$p" -v q="$q" -v s="$s" -v d="$D" 'BEGIN {
  printf "D=%d: packed %.1f ms, padded to 4000 %.1f ms (packed %.2fx faster), one by one %.1f ms (packed %+.1f%%)\n", d, p, q, q / p, s, (p / s - 1) * 100 }'
