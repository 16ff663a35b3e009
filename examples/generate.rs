//! Text from a GPT-2 or Llama model with a key/value cache: from a Hugging Face checkpoint
//! directory, or a randomly initialised model of a given size (for decode speed).
//!
//!   cargo run --release --example generate -- --from DIR [--prompt "Once upon a time"]
//!   cargo run --release --features cuda --example generate -- --arch gpt2 --size 124m --device cuda
//!
//! Flags: `--arch gpt2|llama` (from the checkpoint's config when `--from` is given), `--size
//! tiny|124m|350m` (random weights, `--seed`), `--prompt TEXT` (GPT-2's tokenizer) or `--ids
//! 1,2,3`, `--max-new-tokens N`, `--temperature T` (0: greedy), `--top-k K`, `--top-p P`,
//! `--no-cache` (recompute the prefix each token), `--compiled` (one compiled decode step over
//! a preallocated cache, a CUDA graph replay per token on a GPU), `--save DIR` (write the model as a Hugging
//! Face checkpoint), `--json FILE` (the prompt's logits and the new tokens, for
//! `benches/pytorch/hf_reference.py check`).

mod common;

use common::{device, flag, has, opt};
use kiln::hf::AnyLm;
use kiln::models::{generate, GenerateConfig, Gpt, GptConfig, Llama, LlamaConfig};
use kiln::prelude::*;
use kiln::text::Gpt2Tokenizer;

/// A model to decode from and how to save it.
fn load(dev: Device) -> Result<AnyLm> {
    if let Some(dir) = opt("--from") {
        return AnyLm::from_pretrained(&dir, dev);
    }
    kiln::tensor::rng::manual_seed(flag("--seed", 0));
    let size = opt("--size").unwrap_or_else(|| "tiny".into());
    let arch = opt("--arch").unwrap_or_else(|| "gpt2".into());
    Ok(match (arch.as_str(), size.as_str()) {
        ("gpt2", "124m") => AnyLm::Gpt(Gpt::new(GptConfig::gpt2(768, 12, 12), dev)?),
        ("gpt2", "350m") => AnyLm::Gpt(Gpt::new(GptConfig::gpt2(1024, 24, 16), dev)?),
        ("gpt2", _) => AnyLm::Gpt(Gpt::new(GptConfig { vocab: 50257, context: 256, ..GptConfig::gpt2(64, 2, 4) }, dev)?),
        ("llama", "124m") => AnyLm::Llama(Llama::new(
            LlamaConfig { dim: 768, n_layers: 12, n_heads: 12, n_kv_heads: 4, hidden: 2048, max_seq: 1024, ..LlamaConfig::tiny(50257) },
            dev,
        )?),
        ("llama", _) => AnyLm::Llama(Llama::new(LlamaConfig::tiny(50257), dev)?),
        (a, s) => return Err(Error::Msg(format!("unknown --arch {a} / --size {s} (gpt2|llama, tiny|124m|350m)"))),
    })
}

fn prompt_ids(tok: &Gpt2Tokenizer, vocab: usize) -> Result<Vec<u32>> {
    if let Some(ids) = opt("--ids") {
        return ids.split(',').map(|s| s.trim().parse::<u32>().map_err(|e| Error::Msg(format!("--ids: '{s}': {e}")))).collect();
    }
    let ids = tok.encode(&opt("--prompt").unwrap_or_else(|| "The quick brown fox".into()));
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(Error::Msg(format!("the prompt's token {bad} is outside this model's vocabulary of {vocab}; give --ids")));
    }
    Ok(ids)
}

fn main() -> Result<()> {
    let dev = device();
    let model = load(dev)?;
    let lm = model.lm();
    if let Some(dir) = opt("--save") {
        model.save_pretrained(&dir)?;
        println!("saved a Hugging Face checkpoint to {dir}");
    }
    let tok = Gpt2Tokenizer::new()?;
    let prompt = prompt_ids(&tok, lm.vocab())?;
    let cfg = GenerateConfig {
        max_new_tokens: flag("--max-new-tokens", 32),
        temperature: flag("--temperature", 0.0),
        top_k: opt("--top-k").and_then(|k| k.parse().ok()),
        top_p: opt("--top-p").and_then(|p| p.parse().ok()),
        seed: flag("--seed", 0),
        stop_token: (lm.vocab() > 50256).then_some(50256),
        use_cache: !has("--no-cache"),
        compiled: has("--compiled"),
    };
    // One run to warm up the kernels, then the timed one.
    generate(lm, &prompt, &GenerateConfig { max_new_tokens: cfg.max_new_tokens.min(2), ..cfg.clone() })?;
    let out = generate(lm, &prompt, &cfg)?;
    if lm.vocab() >= 50257 {
        let text: Vec<u32> = prompt.iter().chain(&out.tokens).copied().filter(|&t| (t as usize) < Gpt2Tokenizer::VOCAB).collect();
        println!("{}", tok.decode_lossy(&text)?);
    }
    println!("tokens: {:?}", out.tokens);
    println!(
        "{} new tokens on {dev}: prompt of {} in {:.1} ms, then {:.1} tokens/s (batch 1, {})",
        out.tokens.len(),
        prompt.len(),
        out.prefill_s * 1e3,
        out.tokens_per_s,
        match (cfg.use_cache, cfg.compiled) {
            (false, _) => "no cache".to_string(),
            (true, false) => "kv cache".to_string(),
            (true, true) => format!("compiled decode step over a static cache, compiled in {:.0} ms", out.compile_s * 1e3),
        }
    );
    if let Some(path) = opt("--json") {
        let logits = no_grad(|| {
            lm.logits(
                &Tensor::from_vec(prompt.iter().map(|&i| i as i64).collect::<Vec<_>>(), &[1, prompt.len()], Device::Cpu)?.to_device(dev)?,
            )
        })?;
        let logits = logits.to_dtype(DType::F32)?.to_vec::<f32>()?;
        let text = format!("{{\"ids\": {prompt:?}, \"greedy\": {:?}, \"logits\": {logits:?}}}\n", out.tokens);
        std::fs::write(&path, text).map_err(|e| Error::Io(format!("{path}: {e}")))?;
    }
    Ok(())
}
