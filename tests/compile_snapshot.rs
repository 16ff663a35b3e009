//! Snapshot of the compiler's output for a small MLP training step (IR after passes and the
//! fusion groups), so a change in lowering or fusion shows in review, and the memory plan
//! against eager's measured peak. `KILN_UPDATE_SNAPSHOTS=1 cargo test --test compile_snapshot`
//! rewrites the snapshot.

use kiln::compile::{compile, Mode};
use kiln::models::mlp;
use kiln::nn::cross_entropy;
use kiln::optim::{AdamConfig, AdamW, Optimizer};
use kiln::prelude::*;
use kiln::tensor::storage::{live_bytes, peak_bytes, reset_peak_bytes};
use std::cell::RefCell;

fn batch(b: usize, inp: usize) -> (Tensor, Tensor) {
    let x = Tensor::rand_at(&[b, inp], kiln_tensor::Distribution::Normal, 1, 0, DType::F32, Device::Cpu).unwrap();
    (x, Tensor::zeros(&[b], DType::I64, Device::Cpu).unwrap())
}

#[test]
fn mlp_step_ir_and_fusion_groups() {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[6, 4, 3], Device::Cpu).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw()).unwrap());
    let mut step = compile(Mode::Default, |xs: &[Tensor]| {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        opt.borrow_mut().step()?;
        opt.borrow_mut().zero_grad()?;
        Ok(vec![loss])
    });
    let (x, y) = batch(2, 6);
    step.call(&[&x, &y]).unwrap();
    let got = step.dump().unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/snapshots/mlp_step.txt");
    if std::env::var("KILN_UPDATE_SNAPSHOTS").is_ok() {
        std::fs::write(path, &got).unwrap();
    }
    let want = std::fs::read_to_string(path).expect("snapshot missing: run with KILN_UPDATE_SNAPSHOTS=1");
    assert_eq!(got, want, "the compiled MLP step changed; review and update the snapshot if intended");
}

#[test]
fn compiled_peak_memory_is_at_most_eager_peak() {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[784, 256, 10], Device::Cpu).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw()).unwrap());
    let step_fn = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        opt.borrow_mut().step()?;
        opt.borrow_mut().zero_grad()?;
        Ok(vec![loss])
    };
    let (x, y) = batch(64, 784);
    let eager = step_fn;
    eager(&[x.clone(), y.clone()]).unwrap(); // optimizer state exists from here on
    let measure = |f: &mut dyn FnMut()| {
        let base = live_bytes();
        reset_peak_bytes();
        f();
        peak_bytes() - base
    };
    let eager_peak = measure(&mut || drop(eager(&[x.clone(), y.clone()]).unwrap()));
    let mut step = compile(Mode::Default, step_fn);
    step.call(&[&x, &y]).unwrap(); // trace
    let compiled_peak = measure(&mut || drop(step.call(&[&x, &y]).unwrap()));
    let planned = step.explain().planned_peak_bytes as u64;
    assert!(planned <= eager_peak, "planned {planned} B vs eager peak {eager_peak} B");
    assert!(compiled_peak <= eager_peak, "compiled peak {compiled_peak} B vs eager peak {eager_peak} B");
}
