//! Training that survives: exact resume (eager and compiled) with dropout, an interrupted
//! save that leaves the previous checkpoint intact, and anomaly mode naming the op.

use kiln::checkpoint::{self, write_atomic_with, Checkpoints};
use kiln::compile::{compile, compile_step, Mode};
use kiln::models::{Gpt, GptConfig};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use kiln_tensor::Distribution;
use std::io::Write;

const TOTAL: u64 = 16;

fn tokens(step: u64, seed: u64) -> Tensor {
    Tensor::rand_at(&[4, 8], Distribution::Uniform, seed, step * 32, DType::F32, Device::Cpu)
        .unwrap()
        .mul_scalar(11.0)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap()
}

struct Run {
    model: Gpt,
    opt: AdamW,
    sched: WarmupCosine,
}

fn fresh(init_seed: u64) -> Run {
    kiln::tensor::rng::manual_seed(init_seed);
    let cfg = GptConfig { dropout: 0.1, ..GptConfig::new(11, 8, 16, 2, 2) };
    let model = Gpt::new(cfg, Device::Cpu).unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap();
    let sched = WarmupCosine::new(1e-2, 4, TOTAL as usize, 1e-3).unwrap();
    sched.apply(&mut opt).unwrap();
    Run { model, opt, sched }
}

/// Steps `from..to`, eagerly or through a compiled step made here (the optimizer is the
/// step's state, which the scheduler takes between calls).
fn train(r: &mut Run, from: u64, to: u64, compiled: bool) {
    let model = &r.model;
    let step_fn = |o: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = model.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        clip_grad_norm(o.params(), 1.0)?;
        o.step()?;
        o.zero_grad()?;
        Ok(vec![loss])
    };
    let eager = step_fn;
    let mut step = compile_step(Mode::Default, step_fn);
    for i in from..to {
        let (x, y) = (tokens(i, 1), tokens(i, 2));
        if compiled {
            step.call(&mut r.opt, &[&x, &y]).unwrap();
        } else {
            eager(&mut r.opt, &[x, y]).unwrap();
        }
        r.sched.step(&mut r.opt).unwrap();
    }
}

fn params(r: &Run) -> Vec<Vec<f32>> {
    r.model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn resume_matches_straight(compiled: bool) {
    let mut straight = fresh(3);
    train(&mut straight, 0, TOTAL, compiled);

    let mut first = fresh(3);
    train(&mut first, 0, TOTAL / 2, compiled);
    let dir = temp_dir(if compiled { "resume-c" } else { "resume-e" });
    let ckpts = Checkpoints { dir: dir.clone(), keep: 2 };
    let path = ckpts.save(&first.model, &first.opt, Some(&first.sched), TOTAL / 2).unwrap();
    drop(first);
    // "A new process": other initial weights and generator, then the checkpoint.
    let mut second = fresh(99);
    kiln::tensor::rng::manual_seed(12345);
    let resume = checkpoint::load(&path, &second.model, &mut second.opt, Some(&mut second.sched)).unwrap();
    assert_eq!(resume.step, TOTAL / 2);
    train(&mut second, resume.step, TOTAL, compiled);
    assert_eq!(params(&second), params(&straight), "resumed training is bit-identical (compiled: {compiled})");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eager_resume_is_bit_identical() {
    resume_matches_straight(false);
}

#[test]
fn compiled_resume_is_bit_identical() {
    resume_matches_straight(true);
}

#[test]
fn a_save_that_dies_half_way_leaves_the_previous_checkpoint() {
    let mut r = fresh(4);
    train(&mut r, 0, 2, false);
    let dir = temp_dir("killed");
    let path = dir.join("model.safetensors");
    checkpoint::save(&path, &r.model, &r.opt, None, 2).unwrap();
    let saved = params(&r);
    train(&mut r, 2, 4, false);
    let bytes = checkpoint::to_bytes(&r.model, &r.opt, None, 4).unwrap();
    // The writer dies after 1000 bytes.
    let err = write_atomic_with(&path, &bytes, |f, b| {
        f.write_all(&b[..1000])?;
        Err(std::io::Error::other("simulated crash"))
    });
    assert!(err.unwrap_err().to_string().contains("simulated crash"));
    let mut back = fresh(5);
    let resume = checkpoint::load(&path, &back.model, &mut back.opt, None).unwrap();
    assert_eq!((resume.step, params(&back)), (2, saved));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary file is left behind");
    // Keep-last-N.
    let ckpts = Checkpoints { dir: dir.join("ring"), keep: 2 };
    for s in [10, 20, 30] {
        ckpts.save(&r.model, &r.opt, None, s).unwrap();
    }
    let names: Vec<String> = ckpts.list().unwrap().iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["ckpt-0000000020.safetensors", "ckpt-0000000030.safetensors"]);
    // A file that is not a checkpoint is a clear error.
    std::fs::write(dir.join("junk"), b"\x10\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let e = checkpoint::load(&dir.join("junk"), &back.model, &mut back.opt, None).unwrap_err().to_string();
    assert!(e.contains("checkpoint"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn anomaly_mode_names_the_op_that_made_a_nan() -> Result<()> {
    let w = Tensor::from_slice(&[1.0f32, -2.0, 3.0], &[3], Device::Cpu)?;
    w.set_requires_grad(true);
    let f = |w: &Tensor| -> Result<Tensor> { w.mul_scalar(2.0)?.sqrt()?.sum_all() };
    assert!(f(&w)?.item()?.is_nan(), "without anomaly mode the NaN flows on");
    kiln::tensor::set_detect_anomaly(true);
    let e = f(&w).unwrap_err().to_string();
    assert!(e.contains("anomaly: sqrt produced 1 NaN") && e.contains("[3] F32"), "{e}");
    // Compiled: the kernel that makes it is named too.
    kiln::tensor::set_detect_anomaly(false);
    let mut step = compile(Mode::Default, |xs: &[Tensor]| Ok(vec![xs[0].mul_scalar(2.0)?.log()?.sum_all()?]));
    let good = Tensor::from_slice(&[1.0f32, 2.0], &[2], Device::Cpu)?;
    step.call(&[&good])?; // trace
    kiln::tensor::set_detect_anomaly(true);
    let bad = Tensor::from_slice(&[1.0f32, -2.0], &[2], Device::Cpu)?;
    let e = step.call(&[&bad]).unwrap_err().to_string();
    kiln::tensor::set_detect_anomaly(false);
    assert!(e.contains("anomaly:") && e.contains("NaN"), "{e}");
    Ok(())
}
