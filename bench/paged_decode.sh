#!/bin/bash
# Decoding against a paged KV cache read in place (issue 40, target: ≥ 90% of the contiguous
# decode's bandwidth and ≥ 80% of the DRAM read bandwidth): examples/paged_decode.attn (one query
# per head, H=32, D=128, a cache of 32768 tokens in pages of 16, the pages shuffled in the pool)
# with the pages in FlashAttention's and vLLM's NHD layout ([pages, page size, heads, width]: a
# head's rows 16 KB apart) and in FlashInfer's HND layout ([pages, heads, page size, width],
# permuted into `paged`: a head's rows of a page together), against examples/decode.attn on the
# same cache stored contiguously ([B, H, T, D]), and the DRAM read bandwidth measured as bench/compare.py
# does (the faster of torch.sum and a matrix-vector product over 1 GiB of f32, bench/.venv's
# torch; skipped without it). attnc bench, interleaved round by round, median of the rounds'
# medians; rates are GB/s of K and V read. The paged runs walk every head of a page together
# (the `HeadGroup` of the schedule); the same with one head per work item (ATTNC_HEAD_GROUP=1,
# what ran before) is measured in the same rounds.
#
#     cargo build --release -p attnc && bash bench/paged_decode.sh [ROUNDS] [THREADS] [T] [P]
set -euo pipefail
cd "$(dirname "$0")/.."
A=./target/release/attnc
ROUNDS=${1:-3}
THREADS=${2:-2}
T=${3:-32768}
P=${4:-16}
H=32 D=128
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 bench/write_pages.py "$dir/table.npy" "$dir/lens.npy" 1 "$T" "$P"
NP=$(( (T + P - 1) / P ))
ms() { "$A" bench "$@" --threads "$THREADS" --iters 10 --warmup 2 --json | sed -n 's/^json: .*"median_ms": \([0-9.]*\).*/\1/p'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
PY=bench/.venv/bin/python
dram() {
  [ -x "$PY" ] || return 0
  "$PY" - "$THREADS" <<'PYEOF'
import sys, time
sys.path.insert(0, "bench")
import torch, compare
torch.set_num_threads(int(sys.argv[1]))
best = float("inf")
for fn in compare.dram_reads().values():
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    best = min(best, sorted(times)[2])
print(f"{compare.DRAM_BYTES / best / 1e9:.2f}")
PYEOF
}
paged="" hnd="" paged1="" hnd1="" contiguous="" bw=""
pages=(--input "block_table=$dir/table.npy" --input "lens=$dir/lens.npy" --dim H=$H --dim D=$D --dim M=1 --dim P="$P" --dim NP=$NP)
for _ in $(seq "$ROUNDS"); do
  paged="$paged $(ms examples/paged_decode.attn "${pages[@]}")"
  hnd="$hnd $(ms examples/paged_decode.attn --entry paged_decode_hnd "${pages[@]}")"
  paged1="$paged1 $(ATTNC_HEAD_GROUP=1 ms examples/paged_decode.attn "${pages[@]}")"
  hnd1="$hnd1 $(ATTNC_HEAD_GROUP=1 ms examples/paged_decode.attn --entry paged_decode_hnd "${pages[@]}")"
  contiguous="$contiguous $(ms examples/decode.attn --dim B=1 --dim H=$H --dim T="$T" --dim D=$D)"
  bw="$bw $(dram)"
done
p=$(echo "$paged" | median); n=$(echo "$hnd" | median); p1=$(echo "$paged1" | median); n1=$(echo "$hnd1" | median); c=$(echo "$contiguous" | median); d=$(echo "$bw" | median)
awk -v p="$p" -v n="$n" -v p1="$p1" -v n1="$n1" -v c="$c" -v d="${d:-0}" -v t="$T" -v h=$H -v dd=$D -v pg="$P" 'BEGIN {
  gb = 2 * t * h * dd * 4 / 1e9
  printf "T=%d page %d: contiguous %.2f ms (%.1f GB/s)", t, pg, c, gb / c * 1e3
  if (d > 0) printf ", DRAM read %.1f GB/s (contiguous at %.0f%%)", d, gb / c * 1e3 / d * 100
  printf "\n"
  split("NHD HND NHD,one-head-items HND,one-head-items", name); split(p " " n " " p1 " " n1, time)
  for (k = 1; k <= 4; k++) {
    printf "  paged %s: %.2f ms (%.1f GB/s), %.0f%% of contiguous", name[k], time[k], gb / time[k] * 1e3, c / time[k] * 100
    if (d > 0) printf ", %.0f%% of DRAM read", gb / time[k] * 1e3 / d * 100
    printf "\n"
  } }'
