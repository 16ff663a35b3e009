//! Train a 784-256-10 MLP classifier (or with `--model cnn` a small CNN, `--model lstm` an LSTM
//! reading each image row by row) with AdamW, eagerly
//! and compiled from the same seed, and compare them.
//!
//!   cargo run --release --example mlp                    # embedded digits: eager vs compiled
//!   cargo run --release --example mlp -- --mnist DIR     # MNIST in its IDX format
//!   options: --mode eager|compiled|both (both) --epochs 2 --batch 32 --lr 1e-3 --model mlp|cnn|lstm
//!            --device cpu|cuda --compile-mode default|reduce-overhead|max-autotune
//!            --train 60000 --seed 0
//!            --checkpoint-every N --checkpoint-dir DIR (checkpoints/mlp) --resume

mod common;

use kiln::checkpoint::Checkpoints;
use kiln::compile::compile_step;
use kiln::data::{load_mnist, synthetic_digits, Dataset};
use kiln::loader::DataLoader;
use kiln::nn::{cross_entropy, Sequential};
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;
use std::time::{Duration, Instant};

/// Test accuracy in eval mode (batch norm's running statistics), the model left training.
fn accuracy(model: &Sequential, d: &Dataset, device: Device) -> Result<f64> {
    model.eval();
    let (x, y) = d.to_tensors()?;
    let mut correct = 0usize;
    for b in DataLoader::new(vec![x, y], 1000)?.to_device(device).epoch() {
        let b = b?;
        let pred = no_grad(|| model.forward(&b[0]))?.argmax(1, false)?;
        correct += pred.eq(&b[1])?.to_dtype(DType::I64)?.sum_all()?.item()? as usize;
    }
    model.train();
    Ok(correct as f64 / d.len() as f64)
}

struct Report {
    step_ms: f64,
    first_step: Duration,
    final_loss: f64,
    accuracy: f64,
}

#[allow(clippy::too_many_arguments)]
fn train(compiled: bool, device: Device, train: &Dataset, test: &Dataset, epochs: usize, bs: usize, lr: f64, seed: u64) -> Result<Report> {
    kiln::tensor::rng::manual_seed(seed);
    let (_, model) = make_model(train, device)?;
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr, ..AdamConfig::adamw() })?;
    // One training step: forward, backward, optimizer, zero_grad. Compiled, it is one graph;
    // the optimizer stays ours between steps (the checkpoints read and restore it).
    let step_fn = |opt: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    let eager = step_fn;
    let mut step = compile_step(common::compile_mode(device), step_fn);
    // A new order every epoch from the seed; the last short batch too: its size makes the
    // compiled step's batch dim dynamic (one more graph, which later sizes reuse).
    let (xs, ys) = train.to_tensors()?;
    let mut loader = DataLoader::new(vec![xs, ys], bs)?.shuffle(seed).to_device(device);
    let steps_per_epoch = loader.len();
    let what = if compiled { "compiled" } else { "eager" };
    // Checkpoints per mode; a resumed run skips the steps it already took (the data order
    // depends only on the seed and the epoch, so it sees the same batches).
    let ckpts = Checkpoints {
        dir: std::path::PathBuf::from(common::opt("--checkpoint-dir").unwrap_or_else(|| "checkpoints/mlp".into())).join(what),
        keep: 3,
    };
    let every = common::flag("--checkpoint-every", 0usize);
    let mut done = 0usize;
    if common::has("--resume") {
        if let Some(path) = ckpts.latest()? {
            done = kiln::checkpoint::load(&path, &model, &mut opt, None)?.step as usize;
            println!("{what}: resumed from {} at step {done}", path.display());
        }
    }
    let (mut last_loss, mut first_step, mut steady) = (f64::NAN, Duration::ZERO, Duration::ZERO);
    for epoch in 0..epochs {
        let pb = common::bar(steps_per_epoch as u64, &format!("{what} {}", epoch + 1));
        for (i, b) in loader.epoch().enumerate() {
            let global = epoch * steps_per_epoch + i;
            if global < done {
                pb.inc(1);
                continue;
            }
            let b = b?;
            let (x, y) = (&b[0], &b[1]);
            // On a GPU each step is timed to its end on the device (work is queued
            // asynchronously), as the benchmarks do.
            kiln::tensor::cuda::synchronize(device)?;
            let t = Instant::now();
            let out = if compiled { step.call(&mut opt, &[x, y])? } else { eager(&mut opt, &b)? };
            kiln::tensor::cuda::synchronize(device)?;
            let dt = t.elapsed();
            if global == done {
                first_step = dt;
            } else {
                steady += dt;
            }
            if i % 50 == 0 || i + 1 == steps_per_epoch {
                last_loss = out[0].item()?;
                if !last_loss.is_finite() {
                    return Err(Error::Msg(format!("loss became {last_loss} at epoch {} step {i}; stopping", epoch + 1)));
                }
                pb.set_message(format!("loss {last_loss:.4}"));
            }
            if every > 0 && (global + 1) % every == 0 {
                ckpts.save(&model, &opt, None, global as u64 + 1)?;
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        if (epoch + 1) * steps_per_epoch <= done {
            println!("{what:>8} epoch {}: trained before the checkpoint", epoch + 1);
            continue;
        }
        println!("{what:>8} epoch {}: loss {last_loss:.4}, test accuracy {:.2}%", epoch + 1, 100.0 * accuracy(&model, test, device)?);
    }
    if compiled {
        println!("{}", step.explain());
    }
    let steps = (epochs * steps_per_epoch).saturating_sub(done + 1).max(1);
    Ok(Report {
        step_ms: 1e3 * steady.as_secs_f64() / steps as f64,
        first_step,
        final_loss: last_loss,
        accuracy: accuracy(&model, test, device)?,
    })
}

/// `--model mlp` (784-256-10), `cnn` (`kiln::models::cnn`) or `lstm`
/// (`kiln::models::lstm_classifier`), and its name.
fn make_model(d: &Dataset, device: Device) -> Result<(&'static str, Sequential)> {
    match common::opt("--model").as_deref() {
        None | Some("mlp") => Ok(("MLP 784-256-10", kiln::models::mlp(&[d.rows * d.cols, 256, 10], device)?)),
        Some("cnn") => Ok(("CNN conv8-bn-pool-conv16-bn-pool-linear", kiln::models::cnn(d.rows, d.cols, 10, device)?)),
        Some("lstm") => Ok(("LSTM over image rows (128 units) + linear", kiln::models::lstm_classifier(d.rows, d.cols, 128, 10, device)?)),
        Some(other) => Err(Error::Msg(format!("--model {other}: expected mlp, cnn or lstm"))),
    }
}

fn main() -> Result<()> {
    let (epochs, bs, lr, seed) =
        (common::flag("--epochs", 2usize), common::flag("--batch", 32usize), common::flag("--lr", 1e-3f64), common::flag("--seed", 0u64));
    let mode = common::opt("--mode").unwrap_or_else(|| "both".into());
    let device = common::device();
    let (train_set, test_set) = match common::opt("--mnist") {
        Some(dir) => load_mnist(std::path::Path::new(&dir)).map_err(Error::Msg)?,
        None => (synthetic_digits(common::flag("--train", 60_000usize), seed + 1), synthetic_digits(5_000, seed + 2)),
    };
    println!("data: {} train / {} test images of {}x{}", train_set.len(), test_set.len(), train_set.rows, train_set.cols);
    let (name, model) = make_model(&train_set, device)?;
    println!("model: {name} ({} parameters), AdamW lr {lr}, batch {bs}, {epochs} epochs, on {device}", model.num_parameters());
    let mut reports = Vec::new();
    for compiled in [false, true] {
        if mode == "both" || (mode == "compiled") == compiled {
            reports.push((compiled, train(compiled, device, &train_set, &test_set, epochs, bs, lr, seed)?));
        }
    }
    println!("\n{:>9} | {:>12} | {:>16} | {:>10} | {:>9}", "", "ms / step", "first step (ms)", "final loss", "accuracy");
    for (compiled, r) in &reports {
        let name = if *compiled { "compiled" } else { "eager" };
        println!(
            "{name:>9} | {:>12.3} | {:>16.1} | {:>10.4} | {:>8.2}%",
            r.step_ms,
            r.first_step.as_secs_f64() * 1e3,
            r.final_loss,
            100.0 * r.accuracy
        );
    }
    if let [(_, e), (_, c)] = &reports[..] {
        println!("speedup of the compiled step: {:.2}x (the first compiled step traces and compiles)", e.step_ms / c.step_ms);
    }
    Ok(())
}
