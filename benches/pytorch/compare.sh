#!/usr/bin/env bash
# One command on a GPU machine: Kiln's bench_gpu and PyTorch's gpu_bench.py on the same
# workloads, joined into one table (printed, and written to $OUT/compare.md when $OUT is set).
#   bash benches/pytorch/compare.sh [torch modes, default "eager"]
# Kiln's binary: .gpu/run (packed by ../shared/gpu/pack) when present, else cargo.
set -euo pipefail
cd "$(dirname "$0")/../.."
modes=${1:-eager}
out=${OUT:-$(mktemp -d)}
if [[ -f .gpu/run ]]; then
  bash .gpu/run example bench_gpu --modes eager,default,reduce-overhead,max-autotune > "$out/kiln.jsonl"
else
  cargo run --release --features cuda --example bench_gpu -- --modes eager,default,reduce-overhead,max-autotune > "$out/kiln.jsonl"
fi
python3 benches/pytorch/gpu_bench.py --modes "$modes" > "$out/torch.jsonl"
python3 benches/pytorch/compare.py "$out/kiln.jsonl" "$out/torch.jsonl" | tee "$out/compare.md"
