//! Eager and compiled CPU training steps (forward, backward, AdamW, zero_grad):
//! MLP 784-256-10 at batch 32 and 1024, and the small GPT (vocab 65, context 64, 4 layers,
//! 4 heads, d_model 128, batch 16). `cargo bench --bench train_step`
//! benches/pytorch/cpu_train_step.py measures PyTorch on the same workloads.

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::compile::{compile_step, Mode};
use kiln::models::{mlp, Gpt, GptConfig};
use kiln::nn::cross_entropy;
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;
use kiln_tensor::Distribution;

fn mlp_step(c: &mut Criterion) {
    // Thousands of steps on one batch memorise it and drive the gradients into subnormals,
    // which would time the CPU's microcode assists, not Kiln.
    kiln::tensor::set_flush_denormal(true);
    for batch in [32usize, 1024] {
        kiln::tensor::rng::manual_seed(0);
        let model = mlp(&[784, 256, 10], Device::Cpu).unwrap();
        let mut opt = AdamW::new(model.parameters(), AdamConfig::adamw()).unwrap();
        let x = Tensor::rand_at(&[batch, 784], Distribution::Uniform, 1, 0, DType::F32, Device::Cpu).unwrap();
        let y = Tensor::rand_at(&[batch], Distribution::Uniform, 2, 0, DType::F32, Device::Cpu)
            .unwrap()
            .mul_scalar(10.0)
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap();
        let step_fn = |opt: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
            loss.backward()?;
            opt.step()?;
            opt.zero_grad()?;
            Ok(vec![loss])
        };
        let eager = step_fn;
        c.bench_function(&format!("mlp_b{batch}_eager"), |b| b.iter(|| eager(&mut opt, &[x.clone(), y.clone()]).unwrap()));
        let mut step = compile_step(Mode::Default, step_fn);
        c.bench_function(&format!("mlp_b{batch}_compiled"), |b| b.iter(|| step.call(&mut opt, &[&x, &y]).unwrap()));
    }
}

fn gpt_step(c: &mut Criterion) {
    kiln::tensor::set_flush_denormal(true);
    kiln::tensor::rng::manual_seed(0);
    let cfg = GptConfig::new(65, 64, 128, 4, 4);
    let model = Gpt::new(cfg, Device::Cpu).unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamConfig::adamw()).unwrap();
    let tok = |seed| {
        Tensor::rand_at(&[16, 64], Distribution::Uniform, seed, 0, DType::F32, Device::Cpu)
            .unwrap()
            .mul_scalar(65.0)
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap()
    };
    let (x, y) = (tok(3), tok(4));
    let mut g = c.benchmark_group("gpt");
    g.sample_size(20);
    let step_fn = |opt: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = model.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    let eager = step_fn;
    g.bench_function("gpt_small_b16_eager", |b| b.iter(|| eager(&mut opt, &[x.clone(), y.clone()]).unwrap()));
    let mut step = compile_step(Mode::Default, step_fn);
    g.bench_function("gpt_small_b16_compiled", |b| b.iter(|| step.call(&mut opt, &[&x, &y]).unwrap()));
    g.finish();
}

criterion_group!(benches, mlp_step, gpt_step);
criterion_main!(benches);
