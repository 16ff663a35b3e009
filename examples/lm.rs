//! Train a GPT-2- or Llama-shaped language model on text with GPT-2's tokenizer: validation
//! loss every few steps, a CSV log and a PNG of the loss curves, checkpoints, a sample at
//! the end.
//!
//!   cargo run --release --example lm                                  # the Rust Book, on the CPU
//!   cargo run --release --features cuda --example lm -- --device cuda --size 124m --batch 8 --context 1024 --compile
//!
//! Data: `--data FILE` (a text file, tokenized here, the last tenth held out) or `--data DIR`
//! (`*train*.bin` and `*val*.bin`: llm.c shards or nanoGPT's bare tokens, memory-mapped; `prepare` writes
//! them); by default `data/rust_book.txt`.
//! Model: `--arch gpt2|llama`, `--size 124m|350m` or `--layers --d-model --heads --kv-heads`
//! (default 4, 128, 4, 2), `--context 128`, or `--init-from DIR` (a Hugging Face checkpoint).
//! Training: `--batch 8 --steps 200 --lr 1e-3 --warmup 30 --grad-accum 1 --compile
//! [--compile-mode M] --device cpu|cuda --fp32` (BF16 autocast on a GPU unless `--fp32`);
//! `--min-context N` draws each step's sequence length from N..=context, as variable-length
//! fine-tuning feeds a model (compiled: once specialised, then one dynamic graph for all).
//! Evaluation and output: `--eval-every 50 --eval-batches 8 --out runs/lm` (metrics.csv,
//! loss.png, checkpoints) `--checkpoint-every N --resume --prompt TEXT --seed 0`.

mod common;

use common::{flag, has, opt};
use kiln::checkpoint::Checkpoints;
use kiln::compile::compile_step;
use kiln::hf::AnyLm;
use kiln::metrics::{LogRow, TrainLog};
use kiln::models::{generate, GenerateConfig, Gpt, GptConfig, Llama, LlamaConfig};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use kiln::text::{Gpt2Tokenizer, TokenDataset};
use rand::SeedableRng;
use std::path::Path;
use std::time::Instant;

fn build(device: Device, context: usize) -> Result<AnyLm> {
    if let Some(dir) = opt("--init-from") {
        let m = AnyLm::from_pretrained(&dir, device)?;
        if m.lm().max_seq() < context {
            return Err(Error::Msg(format!("--context {context} is longer than the checkpoint's {} positions", m.lm().max_seq())));
        }
        m.module().train();
        return Ok(m);
    }
    let (layers, d, heads) = match opt("--size").as_deref() {
        Some("124m") => (12, 768, 12),
        Some("350m") => (24, 1024, 16),
        Some(s) => return Err(Error::Msg(format!("--size {s}: 124m or 350m"))),
        None => (flag("--layers", 4), flag("--d-model", 128), flag("--heads", 4)),
    };
    Ok(match opt("--arch").as_deref().unwrap_or("gpt2") {
        "gpt2" => AnyLm::Gpt(Gpt::new(
            GptConfig { vocab: 50304, context, dropout: flag("--dropout", 0.0), ..GptConfig::gpt2(d, layers, heads) },
            device,
        )?),
        "llama" => {
            let kv = flag("--kv-heads", (heads / 2).max(1));
            let hidden = (8 * d / 3).next_multiple_of(64);
            let c = LlamaConfig {
                vocab: 50304,
                dim: d,
                n_layers: layers,
                n_heads: heads,
                n_kv_heads: kv,
                hidden,
                max_seq: context,
                ..LlamaConfig::tiny(50304)
            };
            AnyLm::Llama(Llama::new(c, device)?)
        }
        a => return Err(Error::Msg(format!("--arch {a}: gpt2 or llama"))),
    })
}

fn load_data() -> Result<TokenDataset> {
    match opt("--data") {
        Some(p) if Path::new(&p).is_dir() => TokenDataset::open_dir(Path::new(&p)),
        Some(p) => {
            let text = std::fs::read_to_string(&p).map_err(|e| Error::Io(format!("{p}: {e}")))?;
            TokenDataset::from_text(&p, &text, 0.1)
        }
        None => TokenDataset::from_text("data/rust_book.txt", include_str!("../data/rust_book.txt"), 0.1),
    }
}

/// Mean loss over `batches` validation batches (the same ones at every evaluation).
fn evaluate(m: &AnyLm, data: &TokenDataset, (batch, context, batches): (usize, usize, usize), device: Device) -> Result<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1234);
    let mut total = 0.0;
    for _ in 0..batches {
        let (x, y) = data.val.batch(batch, context, m.lm().vocab(), &mut rng, device)?;
        total += no_grad(|| m.loss(&x, &y))?.item()?;
    }
    Ok(total / batches as f64)
}

fn main() -> Result<()> {
    let device = common::device();
    let seed = flag("--seed", 0u64);
    let (batch, context, steps) = (flag("--batch", 8usize), flag("--context", 128usize), flag("--steps", 200usize));
    let accum = flag("--grad-accum", 1usize).max(1);
    let (eval_every, eval_batches) = (flag("--eval-every", 50usize).max(1), flag("--eval-batches", 8usize).max(1));
    kiln::tensor::rng::manual_seed(seed);
    let data = load_data()?;
    let model = build(device, context)?;
    let params = model.module().parameters();
    let (layers, d) = model.layers_and_width();
    let n_params = model.module().num_parameters();
    println!("data: {} train tokens, {} validation tokens", data.train.len(), data.val.len());
    println!("model: {} layers, d_model {d}, context {context}: {:.1}M parameters", layers, n_params as f64 / 1e6);
    let lr = flag("--lr", 1e-3f64);
    let (decay, no_decay) = kiln::optim::split_for_weight_decay(params.clone());
    let cfg = AdamConfig { lr, betas: (0.9, 0.95), weight_decay: 0.1, ..AdamConfig::adamw() };
    let mut opt = AdamW::with_groups(vec![(decay, 0.1), (no_decay, 0.0)], cfg)?;
    let mut sched = WarmupCosine::new(lr, flag("--warmup", (steps / 10).max(1)), steps, flag("--min-lr", lr / 10.0))?;
    sched.apply(&mut opt)?;
    let out = std::path::PathBuf::from(opt_or("--out", "runs/lm"));
    let ckpts = Checkpoints { dir: out.join("checkpoints"), keep: 2 };
    let mut start_step = 0usize;
    if has("--resume") {
        if let Some(path) = ckpts.latest()? {
            start_step = kiln::checkpoint::load(&path, model.module(), &mut opt, Some(&mut sched))?.step as usize;
            println!("resumed from {} at step {start_step}", path.display());
        }
    }
    let mut log = if start_step > 0 { TrainLog::resume(&out, start_step)? } else { TrainLog::create(&out)? };
    // One optimizer step over `accum` micro-batches: inputs x0, y0, x1, y1, ...
    let step_fn = |opt: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let mut total: Option<Tensor> = None;
        for m in 0..accum {
            let loss = model.loss(&xs[2 * m], &xs[2 * m + 1])?.div_scalar(accum as f64)?;
            loss.backward()?;
            total = Some(match total {
                Some(t) => (t + &loss.detach())?,
                None => loss.detach(),
            });
        }
        clip_grad_norm(&params, 1.0)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![total.expect("one micro-batch at least")])
    };
    let compiled = has("--compile");
    let mut cstep = compile_step(common::compile_mode(device), step_fn);
    let _autocast = (device.is_cuda() && !has("--fp32")).then(|| kiln::tensor::Autocast::new(DType::BF16)).transpose()?;
    let positions = if matches!(model, AnyLm::Gpt(_)) { context * d } else { 0 };
    let flops_per_token = common::train_flops_per_token(n_params - positions, layers, d, context);
    let min_context = flag("--min-context", context).clamp(1, context);
    let tokens_per_step = batch * context * accum;
    println!("training on {device}{}; {tokens_per_step} tokens a step; log in {}", if compiled { ", compiled" } else { "" }, out.display());
    let pb = common::bar(steps as u64, if compiled { "compiled" } else { "eager" });
    pb.set_position(start_step as u64);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(start_step as u64));
    let every = flag("--checkpoint-every", 0usize);
    // Throughput over the steps since the last log line, evaluation left out.
    let (mut t_last, mut tokens) = (Instant::now(), 0usize);
    for step in start_step..steps {
        let mut xs = Vec::with_capacity(2 * accum);
        let length = if min_context < context { rand::Rng::random_range(&mut rng, min_context..=context) } else { context };
        for _ in 0..accum {
            let (x, y) = data.train.batch(batch, length, model.lm().vocab(), &mut rng, device)?;
            xs.extend([x, y]);
        }
        tokens += batch * length * accum;
        let loss = if compiled { cstep.call(&mut opt, &xs)?.remove(0) } else { step_fn(&mut opt, &xs)?.remove(0) };
        let lr_now = sched.lr_at(sched.last_step());
        sched.step(&mut opt)?;
        if every > 0 && (step + 1) % every == 0 {
            ckpts.save(model.module(), &opt, Some(&sched), step as u64 + 1)?;
        }
        let last = step + 1 == steps;
        if step % 10 == 0 || last || step % eval_every == 0 {
            let train_loss = loss.item()?;
            if !train_loss.is_finite() {
                return Err(Error::Msg(format!("loss became {train_loss} at step {step}; stopping")));
            }
            let tokens_s = tokens as f64 / t_last.elapsed().as_secs_f64();
            (t_last, tokens) = (Instant::now(), 0);
            let val_loss =
                if step % eval_every == 0 || last { Some(evaluate(&model, &data, (batch, context, eval_batches), device)?) } else { None };
            log.push(LogRow { step, train_loss, val_loss, lr: lr_now, tokens_per_s: tokens_s })?;
            if val_loss.is_some() {
                log.plot(&format!("{} {}M on {} tokens", model.arch(), n_params / 1_000_000, data.train.len()))?;
                t_last = Instant::now();
            }
            let mfu = if device.is_cuda() {
                format!(", MFU {:.1} %", 100.0 * tokens_s * flops_per_token / common::PEAK_BF16_FLOPS)
            } else {
                String::new()
            };
            let val = log.rows().iter().rev().find_map(|r| r.val_loss).map(|v| format!(", val {v:.3}")).unwrap_or_default();
            pb.set_message(format!("loss {train_loss:.3}{val}, {tokens_s:.0} tok/s{mfu}"));
        }
        pb.inc(1);
    }
    pb.finish();
    if compiled {
        let e = cstep.explain();
        println!("compiled: {} graphs, {} sequence shapes traced for the dynamic one", e.graphs, e.shapes_traced);
    }
    let rows = log.rows();
    let first_val = rows.iter().find_map(|r| r.val_loss).unwrap_or(f64::NAN);
    let last_val = rows.iter().rev().find_map(|r| r.val_loss).unwrap_or(f64::NAN);
    println!("validation loss {first_val:.3} -> {last_val:.3} nats; {} and {} written", log.csv.display(), log.png.display());
    model.module().eval();
    let tok = Gpt2Tokenizer::new()?;
    let prompt = tok.encode(&opt_or("--prompt", "The borrow checker"));
    let max_new = 48.min(model.lm().max_seq().saturating_sub(prompt.len()));
    let cfg = GenerateConfig {
        max_new_tokens: max_new,
        temperature: 0.8,
        top_k: Some(40),
        seed,
        stop_token: Some(Gpt2Tokenizer::EOT),
        ..GenerateConfig::default()
    };
    let sample = generate(model.lm(), &prompt, &cfg)?;
    // The padded vocabulary's last 47 ids are never trained on and never sampled in practice.
    let new: Vec<u32> = sample.tokens.iter().copied().filter(|&t| (t as usize) < Gpt2Tokenizer::VOCAB).collect();
    println!("sample: {}", tok.decode_lossy(&[prompt, new].concat())?);
    Ok(())
}

fn opt_or(name: &str, default: &str) -> String {
    opt(name).unwrap_or_else(|| default.to_string())
}
