"""Joins the JSON lines of examples/bench_gpu.rs (Kiln) and gpu_bench.py (PyTorch) into one
Markdown table: median step time per implementation, and each one's ratio to PyTorch eager.

    python3 benches/pytorch/compare.py kiln.jsonl torch.jsonl
"""
import json, sys

rows = []
for path in sys.argv[1:]:
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
order = ["add_16M", "mlp_b32", "mlp_b4096", "transformer_fwd", "gpt_fp32", "gpt_bf16", "gpt_pure_bf16"]
print("| workload | implementation | precision | median step | vs torch eager | compile | peak memory (steps) | peak memory (first call) |")
print("|---|---|---|---|---|---|---|---|")
for w in order:
    mine = [r for r in rows if r["workload"] == w]
    base = next((r["median_ms"] for r in mine if r["impl"] == "torch eager"), None)
    for r in mine:
        ratio = f"{base / r['median_ms']:.2f}x faster" if base and r["median_ms"] <= base else (f"{r['median_ms'] / base:.2f}x slower" if base else "-")
        c = r.get("compile_s")
        comp = "-" if not c else (f"{c:.1f} s" if c >= 0.1 else f"{c * 1000:.0f} ms")
        ms = r["median_ms"]
        t = f"{ms * 1000:.1f} us" if ms < 0.1 else (f"{ms * 1000:.0f} us" if ms < 1 else f"{ms:.2f} ms")
        if w == "add_16M":
            t += f" ({3 * 4 * 2**24 / (ms * 1e-3) / 1e9:.0f} GB/s)"
        first = f"{r['compile_peak_mib']:.0f} MiB" if "compile_peak_mib" in r else "-"
        print(f"| {w} | {r['impl']} | {r['precision']} | {t} | {ratio} | {comp} | {r.get('peak_mib', 0):.0f} MiB | {first} |")
