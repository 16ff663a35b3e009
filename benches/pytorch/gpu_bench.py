"""PyTorch half of the side-by-side GPU benchmark: the same workloads as
examples/bench_gpu.rs, same shapes, batch and precision, one JSON line per (workload, mode).

    python3 benches/pytorch/gpu_bench.py [--modes eager,default,reduce-overhead] [--only NAME] [--steps N] [--profile]

Modes: eager (with fused AdamW where the workload has an optimizer), and torch.compile modes.
Timing matches Kiln's: warm-up, then each step timed with the device synchronised before and
after; the median is reported. FP32 runs with TF32 off (PyTorch's default for matmuls).
"""
import argparse, json, math, statistics, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"


def median_ms(step, warmup, steps):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def mlp_step(batch, compile_mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(batch, 784, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    def step(x=x, y=y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return compiled(step, compile_mode, (x, y))


class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.h = h
        s.ln1, s.qkv, s.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        s.ln2, s.fc, s.fc_proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(s, x):
        b, t, d = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, s.h, d // s.h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + s.proj(a)
        return x + s.fc_proj(F.gelu(s.fc(s.ln2(x))))


class Gpt(nn.Module):
    def __init__(s, vocab=65, ctx=256, d=384, layers=6, heads=6, tied=False):
        super().__init__()
        s.tok, s.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        s.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        s.ln_f, s.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        if tied:
            s.head.weight = s.tok.weight

    def forward(s, idx):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks:
            x = blk(x)
        return s.head(s.ln_f(x))


def gpt_step(bf16, compile_mode):
    torch.manual_seed(0)
    model = Gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    x = torch.randint(0, 65, (64, 256), device=dev)
    y = torch.randint(0, 65, (64, 256), device=dev)

    def step(x=x, y=y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).view(-1, 65), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return compiled(step, compile_mode, (x, y))


# GPT-2 shapes as nanoGPT trains them: vocab padded to 50304, context 1024, tied head.
GPT2 = {"gpt2_124m": dict(d=768, layers=12, heads=12, batch=8), "gpt2_350m": dict(d=1024, layers=24, heads=16, batch=4)}
PEAK_BF16 = 989e12  # H100/H200 SXM dense BF16


def gpt2_flops_per_token(c, vocab=50304, ctx=1024):
    """nanoGPT's estimate: 6 N per token for the parameters but the position table, 12 L d T
    for attention."""
    d, L = c["d"], c["layers"]
    n = vocab * d + L * (12 * d * d + 13 * d) + 2 * d
    return 6 * n + 12 * L * d * ctx


def gpt2_step(name, compile_mode):
    c = GPT2[name]
    torch.manual_seed(0)
    model = Gpt(50304, 1024, c["d"], c["layers"], c["heads"], tied=True).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    x = torch.randint(0, 50257, (c["batch"], 1024), device=dev)
    y = torch.randint(0, 50257, (c["batch"], 1024), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).view(-1, 50304), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return compiled(step, compile_mode)


def transformer_forward(compile_mode):
    torch.manual_seed(0)
    model = nn.Transformer(d_model=512, nhead=8).to(dev).eval()
    x = torch.randn(10, 32, 512, device=dev)

    def step():
        with torch.no_grad():
            return model(x, x)  # returned, so torch.compile cannot drop the work as dead code

    return compiled(step, compile_mode)


def add_16m(compile_mode):
    a = torch.randn(1 << 24, device=dev)
    b = torch.randn(1 << 24, device=dev)

    def step():
        return a + b

    return compiled(step, compile_mode)


def kernel_table(step, title):
    """Device time per kernel over 5 steps, largest first, with input shapes (for diagnosis)."""
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"--- {title}: CUDA kernels over 5 steps", file=sys.stderr)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90), file=sys.stderr)


DYNAMIC = None  # torch.compile's `dynamic` (--dynamic sets True)


SWEEP_INPUTS = {}  # a step's batch-first inputs, for --sweep


def compiled(step, mode, inputs=None):
    fn = step if mode == "eager" else torch.compile(step, mode=None if mode == "default" else mode, dynamic=DYNAMIC)
    SWEEP_INPUTS[id(fn)] = inputs
    if mode == "eager":
        return fn, 0.0
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return fn, time.perf_counter() - t


def batch_sweep(fn, n):
    """`n` calls on the first b rows of each input, b drawn from 1..=batch in the order
    bench_gpu's --sweep draws; prints the time and torch.compile's graph count."""
    xs = SWEEP_INPUTS.get(id(fn))
    if xs is None:
        return None
    full, state, seen, total, again = xs[0].shape[0], 0x9E3779B97F4A7C15, set(), 0.0, 0.0
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        b = 1 + (state >> 33) % full
        part = [x[:b].contiguous() for x in xs]
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*part)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        total += dt
        again += dt if b in seen else 0.0
        seen.add(b)
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    print(f"sweep: {n} calls over {len(seen)} batch sizes in {total:.2f} s ({again:.3f} s in the calls of a size seen before)", file=sys.stderr)
    return {"sweep": n, "graphs": graphs, "sweep_s": round(total, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="eager")
    ap.add_argument("--only", default=None)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="print the CUDA kernel table of 5 steps (stderr)")
    ap.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    ap.add_argument("--sweep", type=int, default=0, help="then N calls at random batch sizes (compile counts)")
    a = ap.parse_args()
    global DYNAMIC
    DYNAMIC = True if a.dynamic else None
    import torch._dynamo.utils  # noqa: F401 (the graph counters)
    work = [
        ("add_16M", "fp32", add_16m, 1),
        ("mlp_b32", "fp32", lambda m: mlp_step(32, m), 4),
        ("mlp_b4096", "fp32", lambda m: mlp_step(4096, m), 2),
        ("transformer_fwd", "fp32", transformer_forward, 1),
        ("gpt_fp32", "fp32", lambda m: gpt_step(False, m), 0.4),
        ("gpt_bf16", "bf16 autocast", lambda m: gpt_step(True, m), 0.4),
        ("gpt2_124m", "bf16 autocast", lambda m: gpt2_step("gpt2_124m", m), 0.4),
        ("gpt2_350m", "bf16 autocast", lambda m: gpt2_step("gpt2_350m", m), 0.4),
    ]
    for name, prec, make, mult in work:
        if a.only and a.only not in name:
            continue
        for mode in a.modes.split(","):
            torch.cuda.reset_peak_memory_stats()
            torch._dynamo.utils.counters.clear()
            step, compile_s = make(mode)
            ms = median_ms(step, 5, max(10, int(a.steps * mult)))
            if a.profile:
                kernel_table(step, f"{name} {mode}")
            peak = torch.cuda.max_memory_allocated() / 2**20
            impl = "torch eager" if mode == "eager" else f"torch.compile {mode}" + (" dynamic" if a.dynamic else "")
            row = {"workload": name, "impl": impl, "precision": prec, "median_ms": round(ms, 4),
                   "compile_s": round(compile_s, 2), "peak_mib": round(peak, 1)}
            if name in GPT2:
                tokens = GPT2[name]["batch"] * 1024
                row["tokens_per_s"] = round(tokens / (ms * 1e-3))
                row["mfu"] = round(gpt2_flops_per_token(GPT2[name]) * tokens / (ms * 1e-3) / PEAK_BF16, 4)
            print(json.dumps(row), flush=True)
            if a.sweep and mode != "eager":
                sweep = batch_sweep(step, a.sweep)
                if sweep:
                    print(json.dumps({"workload": name, "impl": impl, **sweep}), flush=True)


if __name__ == "__main__":
    main()
