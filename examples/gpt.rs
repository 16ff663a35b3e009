//! Train a GPT-style character language model.
//!
//!   cargo run --release --example gpt                     # embedded arithmetic corpus
//!   cargo run --release --example gpt -- --text FILE      # any text file
//!   options: --steps 300 --batch 16 --context 64 --layers 4 --heads 4 --d-model 128
//!            --lr 3e-3 --dropout 0.0 --seed 0 --compile [--compile-mode reduce-overhead]
//!            --checkpoint-every N --checkpoint-dir DIR (checkpoints/gpt) --resume
//!            --grad-checkpoint (recompute each block's activations in backward)
//!
//! On the default corpus (lines like `123+456=579`) it reports exact-match accuracy of
//! greedy completions of held-out `a+b=` prompts.

mod common;

use kiln::checkpoint::Checkpoints;
use kiln::compile::compile_step;
use kiln::data::{arithmetic_corpus, check_arithmetic_line};
use kiln::models::{Gpt, GptConfig};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use std::time::Instant;

/// Character vocabulary of a text, sorted.
fn vocab_of(text: &str) -> Vec<char> {
    let mut v: Vec<char> = text.chars().collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Entropy (nats) of the character frequencies: the loss of a model that ignores context.
fn unigram_entropy(ids: &[usize], vocab: usize) -> f64 {
    let mut counts = vec![0usize; vocab];
    ids.iter().for_each(|&i| counts[i] += 1);
    let n = ids.len() as f64;
    counts.iter().filter(|&&c| c > 0).map(|&c| -(c as f64 / n) * (c as f64 / n).ln()).sum()
}

/// A random batch of `[B, T]` windows and their next-character targets.
fn batch(ids: &[usize], b: usize, t: usize, rng: &mut u64, device: Device) -> Result<(Tensor, Tensor)> {
    let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
    for _ in 0..b {
        *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let s = (*rng >> 33) as usize % (ids.len() - t - 1);
        x.extend(ids[s..s + t].iter().map(|&i| i as i64));
        y.extend(ids[s + 1..s + t + 1].iter().map(|&i| i as i64));
    }
    Ok((Tensor::from_vec(x, &[b, t], device)?, Tensor::from_vec(y, &[b, t], device)?))
}

/// Greedy continuation of `prompt` until a newline (or `max` characters).
fn complete(model: &Gpt, vocab: &[char], prompt: &str, max: usize) -> Result<String> {
    let mut ids: Vec<i64> = prompt.chars().filter_map(|c| vocab.iter().position(|&v| v == c)).map(|i| i as i64).collect();
    let mut out = String::new();
    for _ in 0..max {
        let ctx = &ids[ids.len().saturating_sub(model.config.context)..];
        let x = Tensor::from_slice(ctx, &[1, ctx.len()], model.device())?;
        let logits = no_grad(|| model.forward(&x))?;
        let next = logits.narrow(1, ctx.len() - 1, 1)?.argmax(-1, false)?.item()? as usize;
        if vocab[next] == '\n' {
            break;
        }
        out.push(vocab[next]);
        ids.push(next as i64);
    }
    Ok(out)
}

fn main() -> Result<()> {
    let steps = common::flag("--steps", 300usize);
    let (b, t) = (common::flag("--batch", 16usize), common::flag("--context", 64usize));
    let seed = common::flag("--seed", 0u64);
    let text = match common::opt("--text") {
        Some(path) => std::fs::read_to_string(&path).map_err(|e| Error::Io(format!("{path}: {e}")))?,
        None => arithmetic_corpus(20_000, seed + 7),
    };
    let vocab = vocab_of(&text);
    let ids: Vec<usize> = text.chars().map(|c| vocab.iter().position(|&v| v == c).unwrap_or(0)).collect();
    if ids.len() < t + 2 {
        return Err(Error::Msg(format!("corpus has {} characters; it needs more than the context {t}", ids.len())));
    }
    let (d, layers, heads) = (common::flag("--d-model", 128usize), common::flag("--layers", 4usize), common::flag("--heads", 4usize));
    let config = GptConfig { dropout: common::flag("--dropout", 0.0f64), ..GptConfig::new(vocab.len(), t, d, layers, heads) };
    kiln::tensor::rng::manual_seed(seed);
    let device = common::device();
    let model = Gpt::new(config, device)?;
    let lr = common::flag("--lr", 3e-3f64);
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr, betas: (0.9, 0.95), weight_decay: 0.1, ..AdamConfig::adamw() })?;
    let mut sched = WarmupCosine::new(lr, (steps / 10).max(1), steps, lr / 10.0)?;
    sched.apply(&mut opt)?;
    let ckpts = Checkpoints { dir: common::opt("--checkpoint-dir").unwrap_or_else(|| "checkpoints/gpt".into()).into(), keep: 3 };
    let every = common::flag("--checkpoint-every", 0u64);
    let mut start_step = 0u64;
    if common::has("--resume") {
        match ckpts.latest()? {
            Some(path) => {
                let r = kiln::checkpoint::load(&path, &model, &mut opt, Some(&mut sched))?;
                println!("resumed from {} at step {}", path.display(), r.step);
                start_step = r.step;
            }
            None => println!("no checkpoint in {}; starting fresh", ckpts.dir.display()),
        }
    }
    let h = unigram_entropy(&ids, vocab.len());
    println!("corpus: {} characters, vocab {}; unigram entropy {h:.3} nats", ids.len(), vocab.len());
    println!(
        "model: {} layers, {} heads, d_model {}, context {t}: {} parameters",
        config.n_layer,
        config.n_head,
        config.d_model,
        model.num_parameters()
    );

    // One training step; with --compile it becomes one compiled graph.
    let step_fn = |opt: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = model.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        clip_grad_norm(opt.params(), 1.0)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    let compiled = common::has("--compile");
    model.checkpointing.set(common::has("--grad-checkpoint"));
    let cmode = common::compile_mode(device);
    println!("training on {device}{}", if compiled { format!(", compiled ({cmode:?})") } else { String::new() });
    let eager = step_fn;
    let mut cstep = compile_step(cmode, step_fn);
    // Batches depend only on the step number, so a resumed run sees the same data.
    let pb = common::bar(steps as u64, if compiled { "compiled" } else { "eager" });
    pb.set_position(start_step);
    let start = Instant::now();
    let mut loss_v = f64::NAN;
    for step in start_step as usize..steps {
        let mut rng = (seed ^ 0x9E37_79B9_7F4A_7C15).wrapping_add(step as u64);
        let (x, y) = batch(&ids, b, t, &mut rng, device)?;
        let loss = if compiled { cstep.call(&mut opt, &[&x, &y])?.remove(0) } else { eager(&mut opt, &[x, y])?.remove(0) };
        sched.step(&mut opt)?;
        if every > 0 && (step as u64 + 1).is_multiple_of(every) {
            ckpts.save(&model, &opt, Some(&sched), step as u64 + 1)?;
        }
        if step % 10 == 0 || step + 1 == steps {
            loss_v = loss.item()?;
            if !loss_v.is_finite() {
                return Err(Error::Msg(format!("loss became {loss_v} at step {step}; stopping")));
            }
            pb.set_message(format!("loss {loss_v:.3}"));
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let done = steps.saturating_sub(start_step as usize).max(1);
    println!("trained {done} steps in {secs:.1} s: {:.0} tokens/s, {:.1} ms/step", (done * b * t) as f64 / secs, 1e3 * secs / done as f64);
    println!(
        "peak memory {:.1} MiB{}",
        kiln::tensor::storage::peak_bytes() as f64 / (1 << 20) as f64,
        if model.checkpointing.get() { " (activation checkpointing)" } else { "" }
    );
    if compiled {
        println!("{}", cstep.explain());
    }
    println!("final loss {loss_v:.3} nats (unigram entropy {h:.3})");

    model.eval();
    if common::opt("--text").is_none() {
        let held_out = arithmetic_corpus(50, seed + 1_000);
        let mut right = 0;
        for line in held_out.lines() {
            let prompt = &line[..=line.find('=').unwrap_or(0)];
            let guess = format!("{prompt}{}", complete(&model, &vocab, prompt, 6)?);
            right += (check_arithmetic_line(&guess) == Some(true)) as usize;
        }
        println!("exact-match accuracy on 50 held-out sums: {right}/50");
        println!("sample: 12+34={}", complete(&model, &vocab, "12+34=", 6)?);
    } else {
        let prompt: String = text.chars().take(16).collect();
        println!("sample: {prompt}{}", complete(&model, &vocab, &prompt, 200)?);
    }
    Ok(())
}
