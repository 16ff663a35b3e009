#!/usr/bin/env python3
"""Generate PyTorch golden fixtures for Kiln's `nn` crate tests.

What it makes
-------------
Small safetensors files in ``crates/nn/tests/golden/`` (relative to the repo
root), which the Rust tests embed with ``include_bytes!``:

  linear.safetensors         nn.Linear(5, 3): forward + backward
  layer_norm.safetensors     nn.LayerNorm(6) with random affine params
  mha.safetensors            nn.MultiheadAttention(8, 2, batch_first) self-attn
                             with a causal attn_mask AND a key_padding_mask
  encoder_layer.safetensors  nn.TransformerEncoderLayer (post-norm, relu)
  decoder_layer.safetensors  nn.TransformerDecoderLayer (pre-norm, gelu)
  cross_entropy.safetensors  F.cross_entropy with/without label smoothing,
                             with one ignore_index (-100) target
  gpt_train.safetensors      a tiny explicit 2-block GPT: init params, loss and
                             grads at init, then 5 AdamW steps (warmup+cosine
                             LR, grad-norm clipping): per-step losses and final
                             params

Conventions
-----------
* Every float tensor is torch.float64; integer index tensors are int64;
  boolean masks are stored as uint8 (1 = True = masked / padded).
* Each fixture reseeds with torch.manual_seed(0), so fixtures are independent
  of each other and of the order they are generated in.
* Dropout is 0 everywhere. Modules are put in ``.train()`` mode so that
  nn.MultiheadAttention / nn.TransformerEncoderLayer never take PyTorch's
  fused inference "fast path" (which is only used in eval mode without grad);
  with dropout = 0 train mode is deterministic and follows the plain math path.
* Backward is driven by a random upstream gradient ``dout`` (same shape as
  ``out``): the implied scalar loss is ``(out * dout).sum()``, so every
  ``grad.*`` key is d/d(that tensor) of that scalar.

How to run
----------
From the repository root:

    pip install torch safetensors numpy
    python3 scripts/make_golden.py

The outputs are committed. CI never runs this script; re-run it by hand only
when a fixture needs to change, and commit the regenerated files.

GPT learning-rate schedule (gpt_train.safetensors), applied before step t=0..4
by setting param_group['lr']:

    base_lr = 1e-2, warmup = 2, total = 5
    lr_t = base_lr * (t + 1) / warmup                                         if t < warmup
    lr_t = base_lr * 0.5 * (1 + cos(pi * (t - warmup) / (total - warmup)))    otherwise
    -> [5e-3, 1e-2, 1e-2, 7.5e-3, 2.5e-3]
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "crates", "nn", "tests", "golden")

BASE_LR = 1e-2
WARMUP = 2
TOTAL = 5


def lr_at(t):
    if t < WARMUP:
        return BASE_LR * (t + 1) / WARMUP
    return BASE_LR * 0.5 * (1.0 + math.cos(math.pi * (t - WARMUP) / (TOTAL - WARMUP)))


def c(t):
    """Detached, contiguous copy suitable for safetensors."""
    return t.detach().clone().contiguous()


def save(name, tensors):
    for k, v in tensors.items():
        assert v.dtype in (torch.float64, torch.int64, torch.uint8), (name, k, v.dtype)
    path = os.path.join(OUT_DIR, name)
    save_file({k: c(v) for k, v in tensors.items()}, path)
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} keys)")


def params_and_grads(module, prefix_param="", prefix_grad="grad."):
    d = {}
    for n, p in module.named_parameters():
        d[prefix_param + n] = p
        d[prefix_grad + n] = p.grad
    return d


def state_dict_and_grads(module):
    d = {k: v for k, v in module.state_dict().items()}
    for n, p in module.named_parameters():
        d["grad." + n] = p.grad
    return d


def causal_mask(t):
    """bool [t, t], True = masked (strict upper triangle: key j > query i)."""
    return torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)


# --------------------------------------------------------------------------
def make_linear():
    torch.manual_seed(0)
    m = nn.Linear(5, 3).train()
    x = torch.randn(4, 5, requires_grad=True)
    out = m(x)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    # sanity: out = x @ W^T + b
    assert torch.allclose(out, x @ m.weight.T + m.bias)
    save("linear.safetensors", {
        "weight": m.weight, "bias": m.bias, "x": x, "out": out, "dout": dout,
        "grad.x": x.grad, "grad.weight": m.weight.grad, "grad.bias": m.bias.grad,
    })


def make_layer_norm():
    torch.manual_seed(0)
    m = nn.LayerNorm(6).train()
    with torch.no_grad():
        m.weight.copy_(torch.randn(6))
        m.bias.copy_(torch.randn(6))
    x = torch.randn(2, 3, 6, requires_grad=True)
    out = m(x)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    # sanity: biased variance, eps inside the sqrt
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    ref = (x - mu) / torch.sqrt(var + m.eps) * m.weight + m.bias
    assert m.eps == 1e-5 and torch.allclose(out, ref)
    save("layer_norm.safetensors", {
        "weight": m.weight, "bias": m.bias, "x": x, "out": out, "dout": dout,
        "grad.x": x.grad, "grad.weight": m.weight.grad, "grad.bias": m.bias.grad,
    })


def ref_mha(x_q, x_kv, in_w, in_b, out_w, out_b, nhead, add_mask):
    """Reference math for nn.MultiheadAttention (batch_first).

    in_w = [W_q; W_k; W_v] stacked on dim 0 ([3E, E]); add_mask broadcastable
    to [B, H, Tq, Tk] with 0 / -inf entries.
    """
    B, Tq, E = x_q.shape
    Tk = x_kv.shape[1]
    D = E // nhead
    wq, wk, wv = in_w.chunk(3, 0)
    bq, bk, bv = in_b.chunk(3, 0)
    q = (x_q @ wq.T + bq).view(B, Tq, nhead, D).transpose(1, 2)
    k = (x_kv @ wk.T + bk).view(B, Tk, nhead, D).transpose(1, 2)
    v = (x_kv @ wv.T + bv).view(B, Tk, nhead, D).transpose(1, 2)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if add_mask is not None:
        s = s + add_mask
    a = torch.softmax(s, -1) @ v
    a = a.transpose(1, 2).reshape(B, Tq, E)
    return a @ out_w.T + out_b


def make_mha():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(embed_dim=8, num_heads=2, dropout=0.0, batch_first=True).train()
    # Default init has in_proj_bias = 0 and out_proj.bias = 0: randomise them so
    # the golden actually tests the bias paths.
    with torch.no_grad():
        m.in_proj_bias.copy_(0.1 * torch.randn_like(m.in_proj_bias))
        m.out_proj.bias.copy_(0.1 * torch.randn_like(m.out_proj.bias))
    B, T, E = 2, 5, 8
    x = torch.randn(B, T, E, requires_grad=True)
    attn_mask = causal_mask(T)                       # [T, T], True = masked
    kpm = torch.zeros(B, T, dtype=torch.bool)        # [B, T], True = pad
    kpm[1, T - 1] = True
    out, w = m(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False)
    assert w is None
    dout = torch.randn_like(out)
    (out * dout).sum().backward()

    add = torch.zeros(B, 1, T, T)
    add = add.masked_fill(attn_mask.view(1, 1, T, T), float("-inf"))
    add = add.masked_fill(kpm.view(B, 1, 1, T), float("-inf"))
    ref = ref_mha(x, x, m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias, 2, add)
    assert torch.allclose(out, ref, atol=1e-12), (out - ref).abs().max()

    d = state_dict_and_grads(m)
    assert set(m.state_dict().keys()) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    d.update({
        "x": x, "attn_mask": attn_mask.to(torch.uint8), "key_padding_mask": kpm.to(torch.uint8),
        "out": out, "dout": dout, "grad.x": x.grad,
    })
    save("mha.safetensors", d)


def randomise_norms_and_biases(module):
    """Default init leaves LayerNorm weight=1/bias=0 and MHA biases=0; perturb
    them so the fixture exercises every parameter path."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith("in_proj_bias") or n.endswith("out_proj.bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif n.startswith("norm"):
                if n.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))


def make_encoder_layer():
    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                   activation="relu", batch_first=True, norm_first=False).train()
    randomise_norms_and_biases(m)
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = m(x)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()

    # sanity: post-norm, x = norm1(x + sa(x)); x = norm2(x + ff(x))
    sa = m.self_attn
    h = m.norm1(x + ref_mha(x, x, sa.in_proj_weight, sa.in_proj_bias, sa.out_proj.weight, sa.out_proj.bias, 2, None))
    ref = m.norm2(h + m.linear2(F.relu(m.linear1(h))))
    assert torch.allclose(out, ref, atol=1e-12)

    d = state_dict_and_grads(m)
    d.update({"x": x, "out": out, "dout": dout, "grad.x": x.grad})
    save("encoder_layer.safetensors", d)


def make_decoder_layer():
    torch.manual_seed(0)
    m = nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                   activation="gelu", batch_first=True, norm_first=True).train()
    randomise_norms_and_biases(m)
    tgt = torch.randn(2, 4, 8, requires_grad=True)
    memory = torch.randn(2, 5, 8, requires_grad=True)
    tgt_mask = causal_mask(4)
    out = m(tgt, memory, tgt_mask=tgt_mask, tgt_is_causal=False)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()

    # sanity: pre-norm; memory is NOT normalised by the layer.
    sa, ca = m.self_attn, m.multihead_attn
    add = torch.zeros(4, 4).masked_fill(tgt_mask, float("-inf"))
    x = tgt
    n1 = m.norm1(x)
    x = x + ref_mha(n1, n1, sa.in_proj_weight, sa.in_proj_bias, sa.out_proj.weight, sa.out_proj.bias, 2, add)
    x = x + ref_mha(m.norm2(x), memory, ca.in_proj_weight, ca.in_proj_bias, ca.out_proj.weight, ca.out_proj.bias, 2, None)
    x = x + m.linear2(F.gelu(m.linear1(m.norm3(x)), approximate="none"))
    assert torch.allclose(out, x, atol=1e-12)

    d = state_dict_and_grads(m)
    d.update({
        "tgt": tgt, "memory": memory, "tgt_mask": tgt_mask.to(torch.uint8),
        "out": out, "dout": dout, "grad.tgt": tgt.grad, "grad.memory": memory.grad,
    })
    save("decoder_layer.safetensors", d)


def make_cross_entropy():
    torch.manual_seed(0)
    N, C = 6, 5
    logits = torch.randn(N, C, requires_grad=True)
    targets = torch.randint(0, C, (N,), dtype=torch.int64)
    targets[2] = -100
    loss = F.cross_entropy(logits, targets, label_smoothing=0.1, ignore_index=-100)
    (g,) = torch.autograd.grad(loss, logits)
    loss_plain = F.cross_entropy(logits, targets, ignore_index=-100)
    (g_plain,) = torch.autograd.grad(loss_plain, logits)

    # sanity: smoothed loss = mean over non-ignored rows of
    #   (1-eps) * (-logp[y]) + eps * mean_c(-logp[c])
    eps = 0.1
    keep = targets != -100
    lp = torch.log_softmax(logits, -1)[keep]
    y = targets[keep]
    nll = -lp.gather(1, y[:, None]).squeeze(1)
    smooth = -lp.mean(-1)
    assert torch.allclose(loss, ((1 - eps) * nll + eps * smooth).mean())
    assert torch.allclose(loss_plain, nll.mean())
    assert loss.dim() == 0

    save("cross_entropy.safetensors", {
        "logits": logits, "targets": targets,
        "loss": loss, "grad.logits": g,
        "loss_plain": loss_plain, "grad_plain.logits": g_plain,
    })


# --------------------------------------------------------------------------
# Tiny GPT, written out explicitly so Kiln can mirror it op for op.
VOCAB, CTX, D_MODEL, N_HEAD, N_LAYER = 11, 8, 16, 2, 2


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        H, Dh = self.h, C // self.h
        q, k, v = self.qkv(x).split(C, dim=2)          # order: q, k, v
        q = q.view(B, T, H, Dh).transpose(1, 2)         # [B, H, T, Dh]
        k = k.view(B, T, H, Dh).transpose(1, 2)
        v = v.view(B, T, H, Dh).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = att @ v                                     # [B, H, T, Dh]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="none"))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(CTX, D_MODEL)
        self.blocks = nn.ModuleList([Block(D_MODEL, N_HEAD) for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        B, T = tokens.shape
        pos = torch.arange(T, dtype=torch.int64)
        x = self.tok_emb(tokens) + self.pos_emb(pos)[None]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))                  # [B, T, VOCAB]


def gpt_loss(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))   # mean over B*T


def make_gpt_train():
    torch.manual_seed(0)
    model = GPT().train()
    tokens = torch.randint(0, VOCAB, (4, CTX), dtype=torch.int64)
    targets = torch.randint(0, VOCAB, (4, CTX), dtype=torch.int64)

    d = {"tokens": tokens, "targets": targets}
    for n, p in model.named_parameters():
        d["init." + n] = c(p)

    loss0 = gpt_loss(model, tokens, targets)
    loss0.backward()
    d["loss0"] = c(loss0)
    for n, p in model.named_parameters():
        d["grad0." + n] = c(p.grad)
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    losses = []
    for t in range(TOTAL):
        lr = lr_at(t)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        losses.append(loss.item())
        print(f"  gpt step {t}: lr={lr:.6g} loss={loss.item():.10f}")
    assert losses[0] == loss0.item()
    d["losses"] = torch.tensor(losses, dtype=torch.float64)
    for n, p in model.named_parameters():
        d["final." + n] = c(p)
    save("gpt_train.safetensors", d)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    make_linear()
    make_layer_norm()
    make_mha()
    make_encoder_layer()
    make_decoder_layer()
    make_cross_entropy()
    make_gpt_train()


if __name__ == "__main__":
    main()
