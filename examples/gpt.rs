//! Train a GPT-style character language model.
//!
//!   cargo run --release --example gpt                     # embedded arithmetic corpus
//!   cargo run --release --example gpt -- --text FILE      # any text file
//!   options: --steps 300 --batch 16 --context 64 --layers 4 --heads 4 --d-model 128
//!            --lr 3e-3 --dropout 0.0 --seed 0
//!
//! On the default corpus (lines like `123+456=579`) it reports exact-match accuracy of
//! greedy completions of held-out `a+b=` prompts.

mod common;

use kiln::data::{arithmetic_corpus, check_arithmetic_line};
use kiln::models::{Gpt, GptConfig};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, WarmupCosine};
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
fn batch(ids: &[usize], b: usize, t: usize, rng: &mut u64) -> Result<(Tensor, Tensor)> {
    let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
    for _ in 0..b {
        *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let s = (*rng >> 33) as usize % (ids.len() - t - 1);
        x.extend(ids[s..s + t].iter().map(|&i| i as i64));
        y.extend(ids[s + 1..s + t + 1].iter().map(|&i| i as i64));
    }
    Ok((Tensor::from_vec(x, &[b, t], Device::Cpu)?, Tensor::from_vec(y, &[b, t], Device::Cpu)?))
}

/// Greedy continuation of `prompt` until a newline (or `max` characters).
fn complete(model: &Gpt, vocab: &[char], prompt: &str, max: usize) -> Result<String> {
    let mut ids: Vec<i64> = prompt.chars().filter_map(|c| vocab.iter().position(|&v| v == c)).map(|i| i as i64).collect();
    let mut out = String::new();
    for _ in 0..max {
        let ctx = &ids[ids.len().saturating_sub(model.config.context)..];
        let x = Tensor::from_slice(ctx, &[1, ctx.len()], Device::Cpu)?;
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
    let config = GptConfig {
        vocab: vocab.len(),
        context: t,
        d_model: common::flag("--d-model", 128usize),
        n_layer: common::flag("--layers", 4usize),
        n_head: common::flag("--heads", 4usize),
        dropout: common::flag("--dropout", 0.0f64),
        tied_head: false,
    };
    kiln::tensor::rng::manual_seed(seed);
    let mut model = Gpt::new(config, Device::Cpu)?;
    let lr = common::flag("--lr", 3e-3f64);
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr, betas: (0.9, 0.95), weight_decay: 0.1, ..AdamConfig::adamw() })?;
    let mut sched = WarmupCosine::new(lr, (steps / 10).max(1), steps, lr / 10.0)?;
    sched.apply(&mut opt)?;
    let h = unigram_entropy(&ids, vocab.len());
    println!("corpus: {} characters, vocab {}; unigram entropy {h:.3} nats", ids.len(), vocab.len());
    println!(
        "model: {} layers, {} heads, d_model {}, context {t}: {} parameters",
        config.n_layer,
        config.n_head,
        config.d_model,
        model.num_parameters()
    );

    let mut rng = seed ^ 0x9E37_79B9_7F4A_7C15;
    let pb = common::bar(steps as u64, "train");
    let start = Instant::now();
    let mut loss_v = f64::NAN;
    for step in 0..steps {
        let (x, y) = batch(&ids, b, t, &mut rng)?;
        let loss = model.loss(&x, &y)?;
        loss.backward()?;
        clip_grad_norm(opt.params(), 1.0)?;
        opt.step()?;
        opt.zero_grad()?;
        sched.step(&mut opt)?;
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
    println!(
        "trained {steps} steps in {secs:.1} s: {:.0} tokens/s, {:.1} ms/step",
        (steps * b * t) as f64 / secs,
        1e3 * secs / steps as f64
    );
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
