//! Training on CUDA against the CPU: 200 steps of the MLP and of the GPT with dropout, AdamW,
//! a warmup-cosine schedule and gradient clipping, from the same seed; a checkpoint written
//! from the GPU resumes on the CPU; a steady-state step makes no driver allocation; F16 with
//! `GradScaler` skips the same steps; activation checkpointing on CUDA matches. Built only with `--features cuda`; without a GPU each
//! test fails saying so.

use kiln::models::{mlp, Gpt, GptConfig};
use kiln::nn::cross_entropy;
use kiln::optim::{clip_grad_norm, Adam, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use kiln::tensor::{cuda, Distribution};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpu() -> Device {
    let d = Device::cuda_if_available(0);
    assert!(d.is_cuda(), "NO GPU: this CUDA test needs an NVIDIA GPU and driver (run it on the GPU machine)");
    d
}

fn batch(step: u64, dev: Device) -> (Tensor, Tensor) {
    let x = Tensor::rand_at(&[16, 20], Distribution::Normal, 100, (step % 8) * 4096, DType::F32, Device::Cpu).unwrap();
    let y = Tensor::rand_at(&[16], Distribution::Uniform, 200, (step % 8) * 64, DType::F32, Device::Cpu).unwrap();
    let y = y.mul_scalar(5.0).unwrap().to_dtype(DType::I64).unwrap();
    (x.to_device(dev).unwrap(), y.to_device(dev).unwrap())
}

/// Losses, final parameters, and the driver allocations made after step 2.
fn train_mlp(dev: Device, steps: u64) -> (Vec<f32>, Vec<Vec<f32>>, u64) {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[20, 32, 5], dev).unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap();
    let mut sched = WarmupCosine::new(1e-2, 20, steps as usize, 1e-3).unwrap();
    sched.apply(&mut opt).unwrap();
    let (mut losses, mut allocs) = (Vec::new(), 0);
    for i in 0..steps {
        let (x, y) = batch(i, dev);
        if i == 2 {
            allocs = cuda::driver_allocations();
        }
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        clip_grad_norm(opt.params(), 1.0).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        sched.step(&mut opt).unwrap();
        losses.push(loss.item().unwrap() as f32);
    }
    let params = model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    (losses, params, cuda::driver_allocations() - allocs)
}

fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0f32, f32::max);
    assert!(worst < tol, "{what}: max relative difference {worst} (tolerance {tol})");
}

#[test]
fn mlp_trains_the_same_on_cuda_as_on_the_cpu_for_200_steps() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let (lc, pc, _) = train_mlp(Device::Cpu, 200);
    let (lg, pg, allocs) = train_mlp(dev, 200);
    assert_close("losses", &lg, &lc, 1e-3);
    for (i, (g, c)) in pg.iter().zip(&pc).enumerate() {
        assert_close(&format!("param {i}"), g, c, 2e-3);
    }
    assert!(lc[199] < lc[0] * 0.8, "it learned: {} -> {}", lc[0], lc[199]);
    assert_eq!(allocs, 0, "steps 3..200 on the GPU asked the driver for memory");
}

/// Losses and final parameters; `checkpointing`: each block recomputed in backward.
fn train_gpt(dev: Device, steps: u64, checkpointing: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    kiln::tensor::rng::manual_seed(7);
    let cfg = GptConfig { dropout: 0.1, ..GptConfig::new(11, 8, 16, 2, 2) };
    let model = Gpt::new(cfg, dev).unwrap();
    model.checkpointing.set(checkpointing);
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 3e-3, betas: (0.9, 0.95), ..AdamConfig::adamw() }).unwrap();
    let mut sched = WarmupCosine::new(3e-3, 10, steps as usize, 3e-4).unwrap();
    sched.apply(&mut opt).unwrap();
    let mut losses = Vec::new();
    for i in 0..steps {
        let tok = |s: u64| {
            let t = Tensor::rand_at(&[4, 8], Distribution::Uniform, s, i * 32, DType::F32, Device::Cpu).unwrap();
            t.mul_scalar(11.0).unwrap().to_dtype(DType::I64).unwrap().to_device(dev).unwrap()
        };
        let loss = model.loss(&tok(1), &tok(2)).unwrap();
        loss.backward().unwrap();
        clip_grad_norm(opt.params(), 0.5).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        sched.step(&mut opt).unwrap();
        losses.push(loss.item().unwrap() as f32);
    }
    (losses, model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect())
}

#[test]
fn gpt_with_dropout_trains_the_same_on_cuda_as_on_the_cpu_for_200_steps() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    assert_gpt_runs_close(train_gpt(dev, 200, false), train_gpt(Device::Cpu, 200, false));
}

/// Losses to 2e-3 and final parameters to 5e-3.
fn assert_gpt_runs_close((lg, pg): (Vec<f32>, Vec<Vec<f32>>), (lc, pc): (Vec<f32>, Vec<Vec<f32>>)) {
    assert_close("losses", &lg, &lc, 2e-3);
    for (i, (g, c)) in pg.iter().zip(&pc).enumerate() {
        assert_close(&format!("param {i}"), g, c, 5e-3);
    }
}

/// Activation checkpointing on CUDA: the recomputed blocks draw the same dropout masks on the
/// device, so 50 steps match the plain run on the CPU.
#[test]
fn gpt_with_activation_checkpointing_trains_the_same_on_cuda_as_plain_on_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    assert_gpt_runs_close(train_gpt(dev, 50, true), train_gpt(Device::Cpu, 50, false));
}

#[test]
fn a_checkpoint_written_on_the_gpu_resumes_on_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    kiln::tensor::rng::manual_seed(1);
    let model = mlp(&[20, 32, 5], dev).unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamConfig::adamw()).unwrap();
    for i in 0..3 {
        let (x, y) = batch(i, dev);
        cross_entropy(&model.forward(&x).unwrap(), &y).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    let bytes = kiln::checkpoint::to_bytes(&model, &opt, None, 3).unwrap();
    let cpu_model = mlp(&[20, 32, 5], Device::Cpu).unwrap();
    let mut cpu_opt = AdamW::new(cpu_model.parameters(), AdamConfig::adamw()).unwrap();
    let resume = kiln::checkpoint::from_bytes(&bytes, std::path::Path::new("gpu.ckpt"), &cpu_model, &mut cpu_opt, None).unwrap();
    assert_eq!(resume.step, 3);
    for (g, c) in model.parameters().iter().zip(cpu_model.parameters()) {
        assert_eq!(g.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    }
}

/// Adam (L2), AdamW, both with AMSGrad, and AdamW with weight-decay groups (the device's
/// fused update launched once a group): the GPU against the CPU.
#[test]
fn adam_with_l2_amsgrad_and_decay_groups_updates_the_same_on_both_devices() {
    use kiln::optim::split_for_weight_decay;
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let run = |dev: Device, kind: &str| -> Vec<Vec<f32>> {
        kiln::tensor::rng::manual_seed(5);
        let model = mlp(&[20, 16, 5], dev).unwrap();
        let cfg = AdamConfig { lr: 5e-3, weight_decay: 0.1, amsgrad: true, ..AdamConfig::default() };
        let mut opt: Box<dyn Optimizer> = match kind {
            "Adam" => Box::new(Adam::new(model.parameters(), cfg).unwrap()),
            "AdamW" => Box::new(AdamW::new(model.parameters(), cfg).unwrap()),
            _ => {
                let (decayed, rest) = split_for_weight_decay(model.parameters());
                Box::new(AdamW::with_groups(vec![(decayed, 0.5), (rest, 0.0)], AdamConfig { amsgrad: false, ..cfg }).unwrap())
            }
        };
        for i in 0..20 {
            let (x, y) = batch(i, dev);
            cross_entropy(&model.forward(&x).unwrap(), &y).unwrap().backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
        model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
    };
    for kind in ["Adam", "AdamW", "AdamW groups"] {
        for (i, (g, c)) in run(dev, kind).iter().zip(run(Device::Cpu, kind)).enumerate() {
            assert_close(&format!("param {i} ({kind})"), g, &c, 1e-4);
        }
    }
}

/// F16 autocast with `GradScaler` on the GPU against the CPU: the same steps skipped (the
/// first scale, 2^24, overflows F16's gradients), the same scale at the end, parameters close.
#[test]
fn f16_training_with_a_grad_scaler_skips_the_same_steps_on_both_devices() {
    use kiln::optim::{GradScaler, GradScalerConfig};
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let run = |dev: Device| -> (Vec<bool>, f64, Vec<Vec<f32>>) {
        kiln::tensor::rng::manual_seed(7);
        let model = mlp(&[20, 32, 5], dev).unwrap();
        let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap();
        let cfg = GradScalerConfig { init_scale: 16777216.0, growth_interval: 4, ..GradScalerConfig::default() };
        let mut scaler = GradScaler::new(dev, cfg).unwrap();
        let mut taken = Vec::new();
        for i in 0..24 {
            let (x, y) = batch(i, dev);
            let loss = {
                let _f16 = kiln::tensor::Autocast::new(DType::F16).unwrap();
                cross_entropy(&model.forward(&x).unwrap(), &y).unwrap()
            };
            scaler.scale(&loss).unwrap().backward().unwrap();
            taken.push(scaler.step(&mut opt).unwrap());
            scaler.update().unwrap();
            opt.zero_grad().unwrap();
        }
        (taken, scaler.current_scale(), model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect())
    };
    let ((gt, gs, gp), (ct, cs, cp)) = (run(dev), run(Device::Cpu));
    assert_eq!(gt, ct, "the same steps skipped");
    assert!(!gt[0] && gt.iter().filter(|&&t| t).count() >= 10, "skipped at first, then taken: {gt:?}");
    assert_eq!(gs, cs);
    for (i, (g, c)) in gp.iter().zip(&cp).enumerate() {
        assert_close(&format!("param {i}"), g, c, 2e-3);
    }
}

/// `Module::to_device`: a Llama made on the CPU, moved to the GPU in place (its rotary tables
/// too, which the model does not name), gives the CPU's logits; moving back gives the same
/// parameters.
#[test]
fn a_model_moved_to_the_gpu_gives_the_cpus_logits() {
    use kiln::models::{Llama, LlamaConfig};
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    kiln::tensor::rng::manual_seed(3);
    let mut model = Llama::new(LlamaConfig::tiny(50), Device::Cpu).unwrap();
    let ids = Tensor::from_vec(vec![1i64, 7, 3, 9, 4], &[1, 5], Device::Cpu).unwrap();
    let want = model.forward(&ids).unwrap().to_vec::<f32>().unwrap();
    let params = model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect::<Vec<_>>();
    model.to_device(dev).unwrap();
    assert!(model.named_state().iter().all(|(_, t)| t.device() == dev), "every tensor on the GPU");
    let got = model.forward(&ids.to_device(dev).unwrap()).unwrap().to_vec::<f32>().unwrap();
    let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "logits moved to the GPU differ from the CPU's by {worst}");
    model.to_device(Device::Cpu).unwrap();
    assert_eq!(model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect::<Vec<_>>(), params);
}
