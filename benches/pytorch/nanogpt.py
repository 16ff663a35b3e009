"""nanoGPT-style character model in PyTorch: the twin of examples/nanogpt.rs (same model, data,
optimizer and loop), for the README's side-by-side and the line counts.

    python3 benches/pytorch/nanogpt.py [--compile] [--steps 200]
"""
import math, sys
import torch
import torch.nn as nn
import torch.nn.functional as F

ctx, d, layers, heads, dropout, batch, accum, steps, lr = 64, 128, 4, 4, 0.1, 16, 2, 200, 3e-3
if "--steps" in sys.argv:
    steps = int(sys.argv[sys.argv.index("--steps") + 1])


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), CausalSelfAttention(), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, d), nn.Embedding(ctx, d), nn.Dropout(dropout)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


text = open("data/rust_book.txt", encoding="utf-8").read()[:200_000]
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text])
torch.manual_seed(0)
model = GPT(len(chars))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def lr_at(step, warmup=20):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))


def get_batch():
    i = torch.randint(len(data) - ctx - 1, (batch,))
    return torch.stack([data[j:j + ctx] for j in i]), torch.stack([data[j + 1:j + ctx + 1] for j in i])


def train_step(xs):
    total = 0.0
    for x, y in xs:
        loss = F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1)) / accum
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


step_fn = torch.compile(train_step) if "--compile" in sys.argv else train_step
for step in range(steps):
    for g in opt.param_groups:
        g["lr"] = lr_at(step)
    loss = step_fn([get_batch() for _ in range(accum)])
    if step % 50 == 0 or step == steps - 1:
        print(f"step {step}: loss {loss.item():.3f}")
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": steps}, "/tmp/nanogpt_torch.pt")
model.eval()
idx = torch.tensor([[chars.index(c) for c in "The borrow"]])
with torch.no_grad():
    for _ in range(60):
        idx = torch.cat([idx, model(idx[:, -ctx:])[:, -1].argmax(-1, keepdim=True)], dim=1)
print("".join(chars[i] for i in idx[0].tolist()))
