#!/bin/bash
# attnc's own cost of score modifications (issue 6, target 3): plain causal, causal + ALiBi and
# causal + soft-capping timed interleaved round by round (attnc bench, median of each round's
# median), B=1 H=8, D in {64, 128}, S in {1024, 4096}, 1 and 2 threads.
#
#     cargo build --release -p attnc && bash bench/score_mod_overhead.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
A=./target/release/attnc
ROUNDS=${1:-5}
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for t in 1 2; do
  for d in 64 128; do
    for s in 1024 4096; do
      declare -A times=()
      for _ in $(seq "$ROUNDS"); do
        for k in causal alibi softcap; do
          ms=$($A bench "examples/$k.attn" --dim B=1 --dim H=8 --dim "S=$s" --dim "D=$d" --threads "$t" --iters 5 --warmup 1 --peak 1 --json \
            | sed -n 's/^json: .*"median_ms": \([0-9.]*\).*/\1/p')
          times[$k]="${times[$k]:-} $ms"
        done
      done
      c=$(echo "${times[causal]}" | median); a=$(echo "${times[alibi]}" | median); f=$(echo "${times[softcap]}" | median)
      awk -v c="$c" -v a="$a" -v f="$f" -v d="$d" -v s="$s" -v t="$t" 'BEGIN {
        printf "D=%d S=%d %dT: causal %.2f ms, ALiBi %.2f ms (%+.1f%%), soft-capping %.2f ms (%+.1f%%)\n", d, s, t, c, a, (a / c - 1) * 100, f, (f / c - 1) * 100 }'
      unset times
    done
  done
done
