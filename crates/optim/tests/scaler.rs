//! `GradScaler` against hand-computed scales and against unscaled F32 training: the scaled
//! loss, exact unscaling, skipped steps on non-finite gradients, growth and backoff, the
//! misuse errors, and F16 gradients that underflow without it.

use kiln_autograd::Backward;
use kiln_optim::*;
use kiln_tensor::{Autocast, DType, Device, Result, Tensor};

fn param(v: &[f32], shape: &[usize]) -> Result<Tensor> {
    let p = Tensor::from_vec(v.to_vec(), shape, Device::Cpu)?;
    p.set_requires_grad(true);
    Ok(p)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

fn sgd(p: &Tensor, lr: f64) -> Result<SGD> {
    SGD::new(vec![p.clone()], SgdConfig { lr, ..SgdConfig::default() })
}

fn scaler(growth_interval: usize) -> Result<GradScaler> {
    GradScaler::new(Device::Cpu, GradScalerConfig { init_scale: 1024.0, growth_interval, ..GradScalerConfig::default() })
}

#[test]
fn the_loss_is_scaled_and_the_gradients_unscaled_exactly() -> Result<()> {
    // loss = sum(p * x): dloss/dp = x. Scale 1024 is a power of two, so unscaling is exact.
    let p = param(&[1.0, 2.0, 3.0], &[3])?;
    let x = Tensor::from_vec(vec![0.5f32, -0.25, 3.0], &[3], Device::Cpu)?;
    let mut s = scaler(2000)?;
    let scaled = s.scale(&p.mul(&x)?.sum_all()?)?;
    assert_eq!(scaled.item()?, 1024.0 * (0.5 - 0.5 + 9.0));
    scaled.backward()?;
    assert_eq!(f32s(&p.grad().unwrap()), vec![512.0, -256.0, 3072.0], "backward saw the scaled loss");
    let mut opt = sgd(&p, 0.5)?;
    s.unscale_(&mut opt)?;
    assert_eq!(f32s(&p.grad().unwrap()), vec![0.5, -0.25, 3.0], "unscale_ divided by 1024");
    assert!(s.step(&mut opt)?, "finite gradients: the step is taken");
    assert_eq!(f32s(&p), vec![0.75, 2.125, 1.5], "SGD read the true gradients (no second unscale)");
    s.update()?;
    assert_eq!(s.state(), (1024.0, 1), "one clean step counted, scale kept");
    Ok(())
}

#[test]
fn a_non_finite_gradient_skips_the_step_and_backs_off() -> Result<()> {
    let p = param(&[1.0, 2.0], &[2])?;
    let mut opt = AdamW::new(vec![p.clone()], AdamConfig::adamw())?;
    let mut s = scaler(2000)?;
    for bad in [f32::INFINITY, f32::NAN] {
        p.set_grad(Some(Tensor::from_vec(vec![1.0f32, bad], &[2], Device::Cpu)?));
        assert!(!s.step(&mut opt)?, "a non-finite gradient ({bad}): the step is skipped");
        assert_eq!(f32s(&p), vec![1.0, 2.0], "parameters unchanged");
        assert!(opt.state_tensors().iter().all(|(name, t)| name != "step" || t.item().unwrap() == 0.0), "no step counted");
        s.update()?;
    }
    assert_eq!(s.state(), (256.0, 0), "backed off twice: 1024 * 0.5 * 0.5");
    Ok(())
}

#[test]
fn the_scale_grows_after_growth_interval_clean_steps() -> Result<()> {
    let p = param(&[1.0], &[1])?;
    let mut opt = sgd(&p, 0.1)?;
    let mut s = scaler(3)?;
    let mut seen = Vec::new();
    for _ in 0..7 {
        p.set_grad(Some(Tensor::from_vec(vec![64.0f32], &[1], Device::Cpu)?));
        s.step(&mut opt)?;
        s.update()?;
        seen.push(s.state());
    }
    assert_eq!(seen, vec![(1024.0, 1), (1024.0, 2), (2048.0, 0), (2048.0, 1), (2048.0, 2), (4096.0, 0), (4096.0, 1)]);
    Ok(())
}

#[test]
fn misuse_is_an_error_and_disabled_passes_through() -> Result<()> {
    let p = param(&[1.0], &[1])?;
    let mut opt = sgd(&p, 0.5)?;
    let mut s = scaler(2000)?;
    assert!(s.update().unwrap_err().to_string().contains("without unscale_() or step()"));
    p.set_grad(Some(Tensor::from_vec(vec![2048.0f32], &[1], Device::Cpu)?));
    s.unscale_(&mut opt)?;
    assert!(s.unscale_(&mut opt).unwrap_err().to_string().contains("already called"));
    s.step(&mut opt)?;
    assert!(s.step(&mut opt).unwrap_err().to_string().contains("step() was already called"));
    s.update()?;
    assert_eq!(f32s(&p), vec![0.0], "one step of 0.5 * (2048 / 1024)");
    let bad = GradScalerConfig { backoff_factor: 1.5, ..GradScalerConfig::default() };
    assert!(GradScaler::new(Device::Cpu, bad).unwrap_err().to_string().contains("backoff_factor"));

    let mut off = GradScaler::new(Device::Cpu, GradScalerConfig { enabled: false, ..GradScalerConfig::default() })?;
    let loss = p.add_scalar(3.0)?.sum_all()?;
    assert_eq!(off.scale(&loss)?.item()?, 3.0);
    p.set_grad(Some(Tensor::from_vec(vec![2.0f32], &[1], Device::Cpu)?));
    assert!(off.step(&mut opt)?);
    off.update()?;
    assert_eq!((f32s(&p), off.current_scale()), (vec![-1.0], 1.0));
    Ok(())
}

/// `x @ w` computed in F16 (autocast), then a loss so small that its gradient, `1e-8` a
/// logit, flushes to zero in F16: `w`'s gradient is all zeros unless the loss is scaled.
fn tiny_loss_grad(scaler: Option<&mut GradScaler>) -> Result<Vec<f32>> {
    let w = param(&[0.5, -1.0, 0.25, 2.0, -0.75, 1.5], &[3, 2])?;
    let x = Tensor::from_vec(vec![1.0f32, 2.0, -1.0, 0.5, 0.25, 3.0], &[2, 3], Device::Cpu)?;
    let logits = {
        let _f16 = Autocast::new(DType::F16)?;
        x.matmul(&w)?
    };
    assert_eq!(logits.dtype(), DType::F16);
    let loss = logits.to_dtype(DType::F32)?.sum_all()?.mul_scalar(1e-8)?;
    let mut opt = sgd(&w, 1.0)?;
    match scaler {
        Some(s) => {
            s.scale(&loss)?.backward()?;
            s.unscale_(&mut opt)?;
        }
        None => loss.backward()?,
    }
    Ok(f32s(&w.grad().unwrap()))
}

#[test]
fn f16_gradients_that_underflow_unscaled_survive_scaling() -> Result<()> {
    assert_eq!(tiny_loss_grad(None)?, vec![0.0; 6], "1e-8 flushes to zero in F16");
    let mut s = GradScaler::new(Device::Cpu, GradScalerConfig::default())?;
    let got = tiny_loss_grad(Some(&mut s))?;
    // dloss/dw[i][j] = 1e-8 * sum over rows of x[:, i]: x's column sums are 1.5, 2.25, 2.0.
    let want = [1.5e-8f32, 1.5e-8, 2.25e-8, 2.25e-8, 2.0e-8, 2.0e-8];
    for (g, w) in got.iter().zip(want) {
        // 1e-8 * 65536 = 6.55e-4 is held in F16 to 2^-11 relative; the products add a little.
        assert!((g - w).abs() <= 2e-3 * w, "got {got:?}, want {want:?}");
    }
    Ok(())
}

#[test]
fn f16_gradients_a_long_tracker_and_out_of_range_scales() -> Result<()> {
    // F16 parameters: unscaling in F16 would flush small gradients again (PyTorch refuses too).
    let p16 = Tensor::full(1.0, &[1], DType::F16, Device::Cpu)?;
    p16.set_requires_grad(true);
    p16.set_grad(Some(Tensor::full(1.0, &[1], DType::F16, Device::Cpu)?));
    let mut opt16 = SGD::new(vec![p16.clone()], SgdConfig::default())?;
    let e = scaler(2000)?.step(&mut opt16).unwrap_err().to_string();
    assert!(e.contains("F16 gradient"), "{e}");

    // A tracker restored from a run with a longer interval grows at the next clean step.
    let p = param(&[1.0], &[1])?;
    let mut opt = sgd(&p, 0.1)?;
    let mut s = scaler(3)?;
    s.set_state(1024.0, 7)?;
    p.set_grad(Some(Tensor::from_vec(vec![64.0f32], &[1], Device::Cpu)?));
    s.step(&mut opt)?;
    assert!(s.unscale_(&mut opt).unwrap_err().to_string().contains("after step()"));
    s.update()?;
    assert_eq!(s.state(), (2048.0, 0));

    // Scales are F32's: beyond its range (or flushed to zero by it) is an error.
    assert!(s.set_state(1e39, 0).is_err() && s.set_state(1e-50, 0).is_err());
    let big = GradScalerConfig { init_scale: 1e39, ..GradScalerConfig::default() };
    assert!(GradScaler::new(Device::Cpu, big).is_err());
    Ok(())
}
