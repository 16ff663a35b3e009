//! Train a 784-256-10 MLP classifier with AdamW.
//!
//!   cargo run --release --example mlp                    # embedded procedurally drawn digits
//!   cargo run --release --example mlp -- --mnist DIR     # MNIST in its IDX format
//!   options: --epochs 4 --batch 32 --lr 1e-3 --train 60000 --seed 0

mod common;

use kiln::data::{load_mnist, synthetic_digits, Dataset};
use kiln::nn::cross_entropy;
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;
use std::time::Instant;

/// Images `[n, rows*cols]` and labels `[n]` of the samples `idx`.
fn batch(d: &Dataset, idx: &[usize], device: Device) -> Result<(Tensor, Tensor)> {
    let px = d.rows * d.cols;
    let mut x = Vec::with_capacity(idx.len() * px);
    for &i in idx {
        x.extend_from_slice(d.image(i));
    }
    let y: Vec<i64> = idx.iter().map(|&i| d.labels[i] as i64).collect();
    Ok((Tensor::from_vec(x, &[idx.len(), px], device)?, Tensor::from_vec(y, &[idx.len()], device)?))
}

fn accuracy(model: &dyn Forward, d: &Dataset, device: Device) -> Result<f64> {
    let mut correct = 0usize;
    for chunk in (0..d.len()).collect::<Vec<_>>().chunks(1000) {
        let (x, y) = batch(d, chunk, device)?;
        let pred = no_grad(|| model.forward(&x))?.argmax(1, false)?;
        correct += pred.eq(&y)?.to_dtype(DType::I64)?.sum_all()?.item()? as usize;
    }
    Ok(correct as f64 / d.len() as f64)
}

fn main() -> Result<()> {
    let (epochs, bs, lr, seed) =
        (common::flag("--epochs", 4usize), common::flag("--batch", 32usize), common::flag("--lr", 1e-3f64), common::flag("--seed", 0u64));
    let device = Device::Cpu;
    let (train, test) = match common::opt("--mnist") {
        Some(dir) => load_mnist(std::path::Path::new(&dir)).map_err(Error::Msg)?,
        None => (synthetic_digits(common::flag("--train", 60_000usize), seed + 1), synthetic_digits(5_000, seed + 2)),
    };
    println!("data: {} train / {} test images of {}x{}", train.len(), test.len(), train.rows, train.cols);
    kiln::tensor::rng::manual_seed(seed);
    let model = kiln::models::mlp(&[train.rows * train.cols, 256, 10], device)?;
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr, ..AdamConfig::adamw() })?;
    println!("model: MLP 784-256-10, {} parameters; AdamW lr {lr}, batch {bs}", model.num_parameters());

    let steps_per_epoch = train.len() / bs;
    let start = Instant::now();
    let mut last_loss = f64::NAN;
    for epoch in 0..epochs {
        let pb = common::bar(steps_per_epoch as u64, &format!("epoch {}", epoch + 1));
        // A fresh shuffle per epoch from a simple LCG over the seed.
        let mut order: Vec<usize> = (0..train.len()).collect();
        let mut s = seed.wrapping_add(epoch as u64).wrapping_mul(6364136223846793005).wrapping_add(1);
        for i in (1..order.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        for step in 0..steps_per_epoch {
            let (x, y) = batch(&train, &order[step * bs..(step + 1) * bs], device)?;
            let loss = cross_entropy(&model.forward(&x)?, &y)?;
            loss.backward()?;
            opt.step()?;
            opt.zero_grad()?;
            if step % 50 == 0 || step + 1 == steps_per_epoch {
                last_loss = loss.item()?;
                if !last_loss.is_finite() {
                    return Err(Error::Msg(format!("loss became {last_loss} at epoch {} step {step}; stopping", epoch + 1)));
                }
                pb.set_message(format!("loss {last_loss:.4}"));
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        println!("epoch {}: loss {last_loss:.4}, test accuracy {:.2}%", epoch + 1, 100.0 * accuracy(&model, &test, device)?);
    }
    let secs = start.elapsed().as_secs_f64();
    let steps = epochs * steps_per_epoch;
    println!("trained {steps} steps in {secs:.1} s ({:.3} ms/step); final loss {last_loss:.4}", 1e3 * secs / steps as f64);
    Ok(())
}
