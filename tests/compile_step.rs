//! `compile_step`: a compiled step over state the caller owns, with a scheduler stepping the
//! same optimizer between calls and no `RefCell`, against the same loop run eagerly.

use kiln::compile::{compile_step, Mode};
use kiln::nn::{cross_entropy, Linear};
use kiln::optim::{AdamConfig, AdamW, LrScheduler, Optimizer, StepLR};
use kiln::prelude::*;
use kiln::tensor::Distribution;

fn batch(step: u64) -> (Tensor, Tensor) {
    let x = Tensor::rand_at(&[8, 5], Distribution::Normal, 100 + step, 0, DType::F32, Device::Cpu).unwrap();
    let y = Tensor::from_vec((0..8).map(|i| (i + step as i64) % 3).collect::<Vec<i64>>(), &[8], Device::Cpu).unwrap();
    (x, y)
}

fn model() -> Linear {
    let m = Linear::new(5, 3, true, Device::Cpu).unwrap();
    let w = Tensor::rand_at(&[3, 5], Distribution::Normal, 7, 0, DType::F32, Device::Cpu).unwrap();
    let b = Tensor::from_vec(vec![0.1f32, -0.2, 0.3], &[3], Device::Cpu).unwrap();
    no_grad(|| {
        m.weight.assign(&w)?;
        m.bias.as_ref().map_or(Ok(()), |bias| bias.assign(&b))
    })
    .unwrap();
    m
}

/// Six steps of AdamW with the lr halved every two steps; the losses and final weight.
/// `zero_first`: the step starts with `zero_grad()` (PyTorch's usual order) instead of ending
/// with it, so every call after the first finds the last call's gradients in place.
fn train(compiled: bool, zero_first: bool) -> Result<(Vec<f32>, Vec<f32>)> {
    let halved = |steps: i32| 0.05 * 0.5f64.powi(steps / 2);
    let m = model();
    let mut opt = AdamW::new(m.parameters(), AdamConfig { lr: 0.05, ..AdamConfig::adamw() })?;
    let mut sched = StepLR::new(0.05, 2, 0.5)?;
    let step_fn = |opt: &mut AdamW, xs: &[Tensor]| {
        if zero_first {
            opt.zero_grad()?;
        }
        let loss = cross_entropy(&m.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        opt.step()?;
        if !zero_first {
            opt.zero_grad()?;
        }
        Ok(vec![loss])
    };
    let mut step = compile_step(Mode::Default, step_fn);
    let eager = step_fn;
    let mut losses = Vec::new();
    for s in 0..6 {
        let (x, y) = batch(s);
        // The caller keeps the optimizer: the scheduler takes it between the calls.
        let out = if compiled { step.call(&mut opt, &[x, y])? } else { eager(&mut opt, &[x, y])? };
        losses.push(out[0].to_vec::<f32>()?[0]);
        sched.step(&mut opt)?;
        assert!((opt.lr() - halved(s as i32 + 1)).abs() < 1e-12, "step {s}: lr {}", opt.lr());
    }
    if compiled {
        assert_eq!(step.counts(), (6, 5), "one trace, then replays");
    }
    assert_eq!(m.weight.grad().is_some(), zero_first, "the gradients left after the last step");
    Ok((losses, m.weight.to_vec::<f32>()?))
}

#[test]
fn a_step_over_caller_owned_state_matches_the_eager_loop() -> Result<()> {
    for zero_first in [false, true] {
        let (eager_losses, eager_w) = train(false, zero_first)?;
        let (losses, w) = train(true, zero_first)?;
        for (a, b) in losses.iter().zip(&eager_losses).chain(w.iter().zip(&eager_w)) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "zero_grad first: {zero_first}\ncompiled {losses:?} {w:?}\neager {eager_losses:?} {eager_w:?}"
            );
        }
    }
    Ok(())
}
