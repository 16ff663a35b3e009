//! The three snippets of PyTorch 2.0's `torch.compile` announcement, in Kiln:
//! 1. a model compiled as a whole (`compile_module`, PyTorch's `torch.compile(model)`): the
//!    784-256-10 MLP's forward on a `[32, 784]` batch, its output differentiable, and an
//!    eager optimizer stepping after `backward()`;
//! 2. a whole `train_step(model, x, y, optimizer, loss_fn)` compiled in `ReduceOverhead`;
//! 3. 100 forward calls of `nn.Transformer(d_model=512, nhead=8, num_encoder_layers=6)` on
//!    `(10, 32, 512)`, timed without and with compile after a warm-up call.
//!
//!   cargo run --release --example tour                  # on the GPU when there is one
//!   cargo run --release --example tour -- --device cpu  # options: --calls 100

use kiln::compile::{compile, compile_step, Mode};
use kiln::models::mlp;
use kiln::nn::{cross_entropy, Transformer, TransformerConfig, TransformerMasks};
use kiln::optim::{AdamConfig, AdamW, SgdConfig, SGD};
use kiln::prelude::*;
use kiln::tensor::Distribution;
use std::time::Instant;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn randn(shape: &[usize], seed: u64, dev: Device) -> Result<Tensor> {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, dev)
}

/// Snippet 1: `compiled_model = torch.compile(model); out = compiled_model(x);
/// out.sum().backward(); optimizer.step()`.
fn compiled_model(dev: Device) -> Result<()> {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[784, 256, 10], dev)?;
    let mut optimizer = SGD::new(model.parameters(), SgdConfig { lr: 0.01, ..SgdConfig::default() })?;
    let compiled = kiln::compile_module(Mode::Default, &model);
    let x = randn(&[32, 784], 1, dev)?;
    optimizer.zero_grad()?;
    let out = compiled.forward(&x)?;
    out.sum_all()?.backward()?;
    optimizer.step()?;
    let eager = no_grad(|| model.forward(&x))?;
    println!("1. compile_module(MLP 784-256-10): out {:?}, out[0, :4] = {:?}", out.shape(), &out.to_vec_f64()?[..4]);
    let grad_norm = model.parameters()[0].grad().map(|g| g.square()?.sum_all()?.item()).transpose()?.unwrap_or(0.0).sqrt();
    println!("   backward through the compiled graph: |grad fc1.weight| = {grad_norm:.4}; after the SGD step,");
    println!("   eager out[0, :4] = {:?}", &eager.to_vec_f64()?[..4]);
    Ok(())
}

/// Snippet 2: `@torch.compile(mode="reduce-overhead") def train(model, x, y, optimizer,
/// loss_fn)`: forward, loss, backward and the optimizer step as one graph.
fn compiled_train_step(dev: Device) -> Result<()> {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[784, 256, 10], dev)?;
    let mut optimizer = AdamW::new(model.parameters(), AdamConfig { lr: 1e-3, ..AdamConfig::adamw() })?;
    let loss_fn = cross_entropy;
    // (The gradients are cleared after the update, so that every call starts from none.)
    let mut train = compile_step(Mode::ReduceOverhead, |optimizer: &mut AdamW, xs: &[Tensor]| {
        let loss = loss_fn(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        optimizer.step()?;
        optimizer.zero_grad()?;
        Ok(vec![loss])
    });
    let x = randn(&[32, 784], 2, dev)?;
    let y = randn(&[32], 3, dev)?.abs()?.mul_scalar(3.0)?.to_dtype(DType::I64)?;
    let mut losses = Vec::new();
    for _ in 0..20 {
        losses.push(train.call(&mut optimizer, &[&x, &y])?[0].item()?);
    }
    let (calls, replays) = train.counts();
    println!(
        "2. train_step compiled (ReduceOverhead): loss {:.4} -> {:.4} over 20 steps, {replays} of {calls} calls replayed",
        losses[0], losses[19]
    );
    Ok(())
}

/// Snippet 3: 100 forward calls of the Transformer, without and with compile.
fn transformer(dev: Device, calls: usize) -> Result<()> {
    kiln::tensor::rng::manual_seed(0);
    let cfg = TransformerConfig { d_model: 512, nhead: 8, num_encoder_layers: 6, ..TransformerConfig::default() };
    let model = Transformer::new(cfg, dev)?;
    model.eval();
    let x = randn(&[10, 32, 512], 4, dev)?;
    let masks = TransformerMasks::default();
    let mut eager = |xs: &[Tensor]| no_grad(|| Ok(vec![model.forward(&xs[0], &xs[0], &masks)?]));
    let time = |f: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>| -> Result<(f64, Tensor)> {
        let out = f(std::slice::from_ref(&x))?.remove(0);
        out.sum_all()?.item()?;
        let t = Instant::now();
        for _ in 0..calls {
            f(std::slice::from_ref(&x))?;
        }
        let last = f(std::slice::from_ref(&x))?.remove(0);
        last.sum_all()?.item()?;
        Ok((t.elapsed().as_secs_f64(), out))
    };
    let (plain, out) = time(&mut eager)?;
    let mut compiled = compile(Mode::Default, |xs: &[Tensor]| no_grad(|| Ok(vec![model.forward(&xs[0], &xs[0], &masks)?])));
    let (fast, out_c) = time(&mut |xs| compiled.call(xs))?;
    let diff = out.sub(&out_c)?.abs()?.max(&AllDims, false)?.item()?;
    println!("3. nn.Transformer(d_model=512, nhead=8, num_encoder_layers=6), {calls} forward calls on (10, 32, 512):");
    println!("   without compile: {plain:.3} s");
    println!("   with compile: {fast:.3} s ({:.2}x; largest difference {diff:.1e})", plain / fast);
    Ok(())
}

fn main() -> Result<()> {
    let dev = match arg("--device").as_deref() {
        Some("cpu") => Device::Cpu,
        _ => Device::cuda_if_available(0),
    };
    let calls: usize = arg("--calls").map_or(Ok(100), |c| c.parse()).map_err(|e| Error::Msg(format!("--calls: {e}")))?;
    println!("Kiln's tour of torch.compile's announcement, on {dev:?}");
    compiled_model(dev)?;
    compiled_train_step(dev)?;
    transformer(dev, calls)
}
