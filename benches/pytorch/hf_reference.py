"""Hugging Face `transformers` side of Kiln's checkpoint round trips and generation checks.

    python3 benches/pytorch/hf_reference.py make OUT      # tiny random GPT-2 and Llama (+ sharded Llama) saved
                                                         # with save_pretrained, their logits and greedy tokens
    python3 benches/pytorch/hf_reference.py check DIR     # load Kiln-saved DIR/{gpt2,llama} with from_pretrained and
                                                         # compare logits and greedy tokens with DIR/*/kiln.json
    python3 benches/pytorch/hf_reference.py against REF NAME KILN  # Kiln's logits and greedy tokens (KILN, from
                                                         # `examples/generate --json`) against REF[NAME]
    python3 benches/pytorch/hf_reference.py decode [--device cuda]  # transformers' generate tokens/s at batch 1

Weights are drawn wider than the models' own init (std 0.2, norms' scales around 1), so that
the logits differ visibly between positions and a wrong layout cannot pass.
"""
import json, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

IDS = [[3, 17, 42, 5, 88, 0, 61, 23, 9, 70, 14, 33]]
NEW = 10


def widen(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + noise if p.dim() == 1 and ("ln" in name or "norm" in name) else noise)
    return model.eval()


def tiny_gpt2():
    c = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return widen(GPT2LMHeadModel(c), 1)


def tiny_llama():
    c = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False)
    return widen(LlamaForCausalLM(c), 2)


def run(model, ids=IDS):
    x = torch.tensor(ids)
    with torch.no_grad():
        logits = model(x).logits[0]
        # The mask is given: generate would otherwise mask every token equal to pad_token_id.
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=model.config.vocab_size - 1)
    return {"ids": ids[0], "logits": [round(v, 7) for v in logits.flatten().tolist()], "shape": list(logits.shape),
            "greedy": out[0, len(ids[0]):].tolist()}


def make(out):
    ref = {}
    for name, model in [("gpt2", tiny_gpt2()), ("llama", tiny_llama())]:
        model.save_pretrained(f"{out}/{name}", safe_serialization=True)
        ref[name] = run(model)
    tiny_llama().save_pretrained(f"{out}/llama_sharded", safe_serialization=True, max_shard_size="20KB")
    with open(f"{out}/reference.json", "w") as f:
        json.dump(ref, f)
    for k, v in ref.items():
        print(k, "greedy", v["greedy"])


def check(d):
    worst = 0.0
    for name, cls in [("gpt2", GPT2LMHeadModel), ("llama", LlamaForCausalLM)]:
        kiln = json.load(open(f"{d}/{name}/kiln.json"))
        model = cls.from_pretrained(f"{d}/{name}").eval()
        got = run(model, [kiln["ids"]])
        diff = max(abs(a - b) for a, b in zip(got["logits"], kiln["logits"]))
        worst = max(worst, diff)
        same = got["greedy"] == kiln["greedy"]
        print(f"{name}: transformers loaded Kiln's checkpoint; logits max |diff| {diff:.2e} over {len(got['logits'])} values; "
              f"greedy transformers {got['greedy']} kiln {kiln['greedy']} {'equal' if same else 'DIFFER'}")
    sys.exit(0 if worst < 1e-4 else 1)


def against(ref, name, kiln_path):
    want, kiln = json.load(open(ref))[name], json.load(open(kiln_path))
    diff = max(abs(a - b) for a, b in zip(want["logits"], kiln["logits"]))
    same = want["greedy"] == kiln["greedy"]
    print(f"{name}: Kiln loaded transformers' checkpoint; logits max |diff| {diff:.2e} over {len(want['logits'])} values; "
          f"greedy transformers {want['greedy']} kiln {kiln['greedy']} {'equal' if same else 'DIFFER'}")
    return diff < 1e-4 and same


def decode(device):
    # The shapes of `examples/generate.rs --size 124m`.
    llama = LlamaConfig(vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)
    for name, model in [("gpt2_124m", GPT2LMHeadModel(GPT2Config())), ("llama_124m", LlamaForCausalLM(llama))]:
        model = model.to(device).eval()
        x = torch.tensor([[50, 51, 52, 53]], device=device) % model.config.vocab_size
        best = 0.0
        for _ in range(3):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                               pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            best = max(best, 64 / (time.perf_counter() - t))
        print(json.dumps({"model": name, "impl": "transformers generate", "device": device, "batch": 1, "new_tokens": 64,
                          "tokens_per_s": round(best, 1)}))
        if device == "cuda" and "--compiled" in sys.argv:
            decode_compiled(name, model, x)


def decode_compiled(name, model, x):
    """`generate` over a static cache with the forward under torch.compile (reduce-overhead):
    transformers' recipe for compiled decoding. The first two runs compile and warm up."""
    try:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                               pad_token_id=0, cache_implementation="static")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        print(json.dumps({"model": name, "impl": "transformers generate, static cache, torch.compile reduce-overhead",
                          "device": "cuda", "batch": 1, "new_tokens": 64, "first_s": round(times[0], 1),
                          "tokens_per_s": round(64 / min(times[2:]), 1)}))
    except Exception as e:  # an older transformers without static caches
        print(json.dumps({"model": name, "impl": "transformers static cache + torch.compile", "error": str(e)[:200]}))


if __name__ == "__main__":
    torch.manual_seed(0)
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2])
    elif cmd == "check":
        check(sys.argv[2])
    elif cmd == "against":
        sys.exit(0 if against(*sys.argv[2:5]) else 1)
    else:
        decode(sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda")
