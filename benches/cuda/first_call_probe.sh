#!/usr/bin/env bash
# First calls in fresh processes (`KILN_LOG=time`), `ReduceOverhead`: each workload cold (an
# empty disk cache), then warm (the cache that run filled), with and without the cuBLASLt plans
# made ahead on cuBLAS's start thread (`KILN_PLAN_AHEAD=0`: the first run makes them).
# Needs .gpu/ (../shared/gpu/pack); results in $OUT/first_call.txt.
set -uo pipefail
out=${OUT:-$(mktemp -d)}
bin=$(mktemp -d)
tar -C "$bin" -xJf .gpu/bundle.tar.xz
for w in gpt_bf16 gpt_fp32 mlp_b32; do
  cache=$(mktemp -d)
  for setting in cold KILN_PLAN_AHEAD=1 KILN_PLAN_AHEAD=0 KILN_PLAN_AHEAD=1 KILN_PLAN_AHEAD=0; do
    echo "== $w $setting" | tee -a "$out/first_call.txt"
    env "${setting/cold/KILN_NONE=0}" KILN_CACHE_DIR="$cache" KILN_LOG=time "$bin/examples/bench_gpu" --only "$w" --modes reduce-overhead --steps 5 2>&1 \
      | grep -E "kiln time|compile_s" | tee -a "$out/first_call.txt"
  done
done
