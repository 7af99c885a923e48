#!/bin/bash
# Attention sinks' cost over plain causal attention (issue 40, target: ≤ 5%, forward and
# forward + backward): bench/over_causal.sh with examples/sinks.attn.
#
#     cargo build --release -p attnc && bash bench/sinks_overhead.sh [ROUNDS] [THREADS]
exec bash "$(dirname "$0")/over_causal.sh" sinks "$@"
