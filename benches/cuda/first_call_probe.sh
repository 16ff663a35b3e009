#!/usr/bin/env bash
# First calls in fresh processes (`KILN_LOG=time`), `ReduceOverhead`: each workload cold (an
# empty disk cache), then twice warm (the cache that run filled).
# Needs .gpu/ (../shared/gpu/pack); results in $OUT/first_call.txt.
set -uo pipefail
out=${OUT:-$(mktemp -d)}
bin=$(mktemp -d)
tar -C "$bin" -xJf .gpu/bundle.tar.xz
for w in gpt_bf16 gpt_fp32 mlp_b32; do
  cache=$(mktemp -d)
  for run in cold warm warm; do
    echo "== $w $run" | tee -a "$out/first_call.txt"
    KILN_CACHE_DIR="$cache" KILN_LOG=time "$bin/examples/bench_gpu" --only "$w" --modes reduce-overhead --steps 5 2>&1 \
      | grep -E "kiln time|compile_s" | tee -a "$out/first_call.txt"
  done
done
