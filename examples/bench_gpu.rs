//! The side-by-side benchmark's Kiln half: median step times of the comparison workloads
//! (MLP 784-256-10 with CE + AdamW at batch 32 and 4096, nn.Transformer(512, 8) forward on
//! (10, 32, 512), the GPT char-LM AdamW step in FP32 and BF16). Prints one JSON line per
//! workload; benches/pytorch/compare.py joins them with PyTorch's and prints the table.
//!
//!   cargo run --release --features cuda --example bench_gpu -- [--device cuda|cpu] [--only NAME] [--steps N]
//!
//! Timing: warm-up steps, then each step is timed on the host with the device synchronised
//! before and after (so it is the step's full latency), and the median is reported.

mod common;

use common::{flag, opt};
use kiln::models::{mlp, Gpt, GptConfig};
use kiln::nn::{cross_entropy, Transformer, TransformerConfig, TransformerMasks};
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;
use kiln::tensor::{cuda, set_default_dtype, Distribution};
use std::time::Instant;

fn median_ms(dev: Device, warmup: usize, steps: usize, mut step: impl FnMut() -> Result<()>) -> Result<f64> {
    kiln::tensor::storage::reset_peak_bytes();
    for _ in 0..warmup {
        step()?;
    }
    kiln::tensor::profile::reset();
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        cuda::synchronize(dev)?;
        let t = Instant::now();
        step()?;
        cuda::synchronize(dev)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `a + b` on 16M contiguous floats: reads 2 x 64 MiB and writes 64 MiB.
fn elementwise(dev: Device, steps: usize) -> Result<f64> {
    let n = 1 << 24;
    let a = Tensor::rand_at(&[n], Distribution::Normal, 6, 0, DType::F32, dev)?;
    let b = Tensor::rand_at(&[n], Distribution::Normal, 7, 0, DType::F32, dev)?;
    median_ms(dev, 3, steps, || a.add(&b).map(|_| ()))
}

fn report(workload: &str, precision: &str, ms: f64, dev: Device) {
    if kiln::tensor::profile::enabled() {
        eprintln!("--- {workload}: per-op device time over the timed steps (KILN_PROFILE)\n{}", kiln::tensor::profile::report());
        kiln::tensor::profile::reset();
    }
    let peak = kiln::tensor::storage::peak_bytes() as f64 / 1048576.0;
    println!(
        "{{\"workload\": \"{workload}\", \"impl\": \"kiln eager\", \"precision\": \"{precision}\", \"median_ms\": {ms:.4}, \"device\": \"{dev}\", \"peak_mib\": {peak:.1}}}"
    );
}

fn mlp_step(dev: Device, batch: usize, steps: usize) -> Result<f64> {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[784, 256, 10], dev)?;
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-3, ..AdamConfig::adamw() })?;
    let x = Tensor::rand_at(&[batch, 784], Distribution::Normal, 1, 0, DType::F32, dev)?;
    let y = Tensor::rand_at(&[batch], Distribution::Uniform, 2, 0, DType::F32, dev)?.mul_scalar(10.0)?.to_dtype(DType::I64)?;
    median_ms(dev, 10, steps, || {
        let loss = cross_entropy(&model.forward(&x)?, &y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()
    })
}

fn transformer_forward(dev: Device, steps: usize) -> Result<f64> {
    kiln::tensor::rng::manual_seed(0);
    let mut model = Transformer::new(TransformerConfig { d_model: 512, nhead: 8, ..TransformerConfig::default() }, dev)?;
    model.set_training(false);
    let x = Tensor::rand_at(&[10, 32, 512], Distribution::Normal, 3, 0, DType::F32, dev)?;
    median_ms(dev, 3, steps, || {
        let _no_grad = NoGradGuard::new();
        model.forward(&x, &x, &TransformerMasks::default()).map(|_| ())
    })
}

fn gpt_step(dev: Device, dtype: DType, steps: usize) -> Result<f64> {
    kiln::tensor::rng::manual_seed(0);
    set_default_dtype(dtype);
    let cfg = GptConfig { vocab: 65, context: 256, d_model: 384, n_layer: 6, n_head: 6, dropout: 0.0, tied_head: false };
    let model = Gpt::new(cfg, dev)?;
    set_default_dtype(DType::F32);
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 3e-4, ..AdamConfig::adamw() })?;
    let tok = |s| -> Result<Tensor> {
        Tensor::rand_at(&[64, 256], Distribution::Uniform, s, 0, DType::F32, dev)?.mul_scalar(65.0)?.to_dtype(DType::I64)
    };
    let (x, y) = (tok(4)?, tok(5)?);
    median_ms(dev, 3, steps, || {
        let loss = model.loss(&x, &y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()
    })
}

fn main() -> Result<()> {
    let dev = match opt("--device").as_deref() {
        Some("cpu") => Device::Cpu,
        Some(_) | None => Device::cuda_if_available(0),
    };
    let only = opt("--only");
    let steps: usize = flag("--steps", 50);
    let want = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    eprintln!("kiln bench on {dev} ({steps} timed steps each; TF32 {})", if cfg!(feature = "cuda") { "off" } else { "n/a" });
    if want("add_16M") {
        let ms = elementwise(dev, steps)?;
        report("add_16M", "fp32", ms, dev);
        eprintln!("add_16M: {:.0} GB/s", 3.0 * 4.0 * (1u64 << 24) as f64 / (ms * 1e-3) / 1e9);
    }
    if want("mlp_b32") {
        report("mlp_b32", "fp32", mlp_step(dev, 32, steps * 4)?, dev);
    }
    if want("mlp_b4096") {
        report("mlp_b4096", "fp32", mlp_step(dev, 4096, steps * 2)?, dev);
    }
    if want("transformer_fwd") {
        report("transformer_fwd", "fp32", transformer_forward(dev, steps)?, dev);
    }
    if want("gpt_fp32") {
        report("gpt_fp32", "fp32", gpt_step(dev, DType::F32, steps.min(20))?, dev);
    }
    if want("gpt_bf16") {
        report("gpt_bf16", "bf16 (params and compute)", gpt_step(dev, DType::BF16, steps.min(20))?, dev);
    }
    Ok(())
}
