"""PyTorch CPU baselines for Kiln's benches/train_step.rs (same models, batches, optimizer).

    pip install torch && python3 benches/pytorch/cpu_train_step.py [--threads 2]

Prints the median and 10th/90th percentile step time (ms) of eager training steps with
AdamW (default foreach implementation and fused=True). Interleave with
`cargo bench --bench train_step` runs: this machine drifts by about 25% over minutes.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = lambda z: z.view(b, t, self.h, d // self.h).transpose(1, 2)
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab=65, ctx=64, d=128, layers=4, heads=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def transformer_forward(steps, warmup=3):
    """The seed's `nn.Transformer(d_model=512, nhead=8)` forward on (10, 32, 512), eval, no grad."""
    model = nn.Transformer(d_model=512, nhead=8).eval()
    x = torch.randn(10, 32, 512)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            model(x, x)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    print(f"{'transformer_fwd':28s} {'-':8s} median {statistics.median(times):8.3f} ms")


def bench(name, model, loss_fn, fused, steps, warmup=20):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = lambda p: times[int(p * (len(times) - 1))]
    print(f"{name:28s} {'fused' if fused else 'default':8s} median {statistics.median(times):8.3f} ms  p10 {q(0.1):8.3f}  p90 {q(0.9):8.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as Kiln's benches: one batch repeated underflows the gradients
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    for fused in (False, True):
        for b in (32, 1024):
            m = mlp()
            x, y = torch.rand(b, 784), torch.randint(0, 10, (b,))
            bench(f"mlp_b{b}", m, lambda: F.cross_entropy(m(x), y), fused, args.steps)
        g = Gpt()
        idx, tgt = torch.randint(0, 65, (16, 64)), torch.randint(0, 65, (16, 64))
        bench("gpt_small_b16", g, lambda: g(idx, tgt), fused, max(20, args.steps // 10))
        # The seed's Transformer as a training step: MSE of its output against a target.
        t = nn.Transformer(d_model=512, nhead=8, dropout=0.0)
        src, out = torch.randn(10, 32, 512), torch.randn(10, 32, 512)
        bench("transformer_step", t, lambda: F.mse_loss(t(src, src), out), fused, max(5, args.steps // 40), warmup=2)
    transformer_forward(max(5, args.steps // 20))


if __name__ == "__main__":
    main()
