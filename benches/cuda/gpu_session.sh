#!/usr/bin/env bash
# One device call's checks on the lent GPU machine. Here, one pack holding the tests and the
# examples (each pack replaces .gpu/): `../shared/gpu/pack`, or faster without the criterion
# benches, a copy made by
#   sed 's/\[\[ \$what == all || \$what == benches \]\]/[[ $what == benches ]]/' ../shared/gpu/pack > /tmp/pack
# then `bash /tmp/pack`; then `run` with carry [".gpu"]:
#
#   bash benches/cuda/gpu_session.sh [tests] [bench] [ab] [ncu]   (no argument: tests bench ncu)
#
# tests: the four GPU suites, their result lines in $OUT/tests.log (full output beside it);
# bench: bench_gpu's GPT BF16 and FP32, MLP b32 and Transformer steps, ReduceOverhead and
#        MaxAutotune, two rounds, JSON lines in $OUT/bench.jsonl;
# ab:    GPT BF16 `ReduceOverhead`, two rounds, once per setting in $AB (space-separated
#        `VAR=value` switches of a change being measured, removed once measured; none is
#        left now), then `MaxAutotune` in
#        a fresh cache folder with the tuned choices of Kiln's own kernels printed
#        (`KILN_LOG=kernels`): $OUT/ab.log;
# ncu:   per-kernel device times of GPT BF16 `ReduceOverhead` steps, graph nodes profiled as
#        replayed (caches and clocks untouched): $OUT/ncu.csv, summed by kernel in $OUT/ncu_top.txt.
# Each part prints what it ran; a failing suite does not stop the others.
set -uo pipefail
out=${OUT:-$(mktemp -d)}
parts=${*:-tests bench ncu}
bin=$(mktemp -d)
tar -C "$bin" -xJf .gpu/bundle.tar.xz
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader || true

if [[ $parts == *tests* ]]; then
  for t in cuda_basics cuda_ops cuda_compile cuda_train; do
    if [[ -x $bin/tests/$t ]]; then
      "$bin/tests/$t" --test-threads 1 > "$out/$t.log" 2>&1
      echo "$t (exit $?): $(grep -E '^test result' "$out/$t.log" | tail -1)" | tee -a "$out/tests.log"
      grep -E '^test .* FAILED|panicked' "$out/$t.log" | head -20 | tee -a "$out/tests.log"
    else
      echo "$t: not packed" | tee -a "$out/tests.log"
    fi
  done
fi

if [[ $parts == *bench* ]]; then
  b=$bin/examples/bench_gpu
  for round in 1 2; do
    for w in gpt_bf16 gpt_fp32 mlp_b32 transformer_fwd; do
      "$b" --only "$w" --modes reduce-overhead,max-autotune --steps 20 2> "$out/bench_$w.err" | tee -a "$out/bench.jsonl"
    done
    echo "round $round done"
  done
fi

if [[ $parts == *ab* ]]; then
  b=$bin/examples/bench_gpu
  for round in 1 2; do
    for setting in KILN_NONE=0 ${AB:-}; do
      echo "round $round, $setting: $(env "$setting" "$b" --only gpt_bf16 --modes reduce-overhead --steps 20 2>/dev/null | grep -o '"median_ms": [0-9.]*')" | tee -a "$out/ab.log"
    done
  done
  for w in gpt_bf16 transformer_fwd mlp_b32; do
    KILN_CACHE_DIR=$(mktemp -d) KILN_LOG=kernels "$b" --only "$w" --modes max-autotune --steps 20 2> "$out/tuned_$w.err" | tee -a "$out/ab.log"
    grep -E "tuned|max-autotune timed" "$out/tuned_$w.err" | tee -a "$out/ab.log"
  done
fi

if [[ $parts == *ncu* ]]; then
  ncu=/usr/local/cuda/bin/ncu
  "$ncu" --graph-profiling node --cache-control none --clock-control none --launch-skip 2000 --launch-count 300 \
    --csv --metrics gpu__time_duration.sum "$bin/examples/bench_gpu" --only gpt_bf16 --modes reduce-overhead --steps 12 \
    > "$out/ncu.csv" 2> "$out/ncu.err"
  python3 - "$out/ncu.csv" > "$out/ncu_top.txt" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
total, count = collections.defaultdict(float), collections.Counter()
for r in rows[1:]:
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[r[unit]]
    total[r[name][:90]] += float(r[value].replace(",", "")) * scale
    count[r[name][:90]] += 1
print(f"{sum(total.values()):.1f} us in {sum(count.values())} kernels")
for k, us in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{us:9.1f} us {count[k]:4d}x {us / count[k]:7.1f} us  {k}")
PY
  head -40 "$out/ncu_top.txt"
fi
