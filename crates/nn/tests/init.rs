//! `torch.nn.init`'s in-place initialisers: each one's statistics on a large weight, in
//! place on a parameter (same tensor, no autograd record), and their errors.

use kiln_nn::init::{
    calculate_gain, constant_, kaiming_normal_, kaiming_uniform_, normal_, ones_, uniform_, xavier_normal_, xavier_uniform_, zeros_,
    FanMode,
};
use kiln_tensor::{DType, Device, Result, Tensor};

/// A `[256, 512]` parameter (fan_in 512, fan_out 256).
fn weight() -> Tensor {
    let w = Tensor::zeros(&[256, 512], DType::F32, Device::Cpu).unwrap();
    w.set_requires_grad(true);
    w
}

/// Mean, standard deviation and largest magnitude.
fn stats(t: &Tensor) -> (f64, f64, f64) {
    let v: Vec<f64> = t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    (mean, std, v.iter().fold(0.0, |m: f64, x| m.max(x.abs())))
}

fn near(what: &str, got: f64, want: f64, rel: f64) {
    assert!((got - want).abs() <= rel * want.abs().max(1e-3), "{what}: got {got}, want {want}");
}

#[test]
fn each_initialiser_draws_its_distribution_in_place() -> Result<()> {
    let w = weight();
    let before = w.id();
    uniform_(&w, -2.0, 3.0)?;
    let v = w.to_vec::<f32>()?;
    assert!(v.iter().all(|&x| (-2.0..3.0).contains(&x)));
    near("uniform mean", stats(&w).0, 0.5, 0.05);
    near("uniform std", stats(&w).1, 5.0 / 12f64.sqrt(), 0.01);
    normal_(&w, 1.0, 2.0)?;
    near("normal mean", stats(&w).0, 1.0, 0.02);
    near("normal std", stats(&w).1, 2.0, 0.01);
    // Xavier: the bound sqrt(6 / (512 + 256)), a uniform's std bound / sqrt(3); the normal's
    // std sqrt(2 / 768).
    xavier_uniform_(&w, 1.0)?;
    let b = (6.0f64 / 768.0).sqrt();
    assert!(stats(&w).2 <= b);
    near("xavier_uniform std", stats(&w).1, b / 3f64.sqrt(), 0.01);
    xavier_normal_(&w, 2.0)?;
    near("xavier_normal std", stats(&w).1, 2.0 * (2.0f64 / 768.0).sqrt(), 0.01);
    // Kaiming for ReLU: sqrt(2) / sqrt(fan).
    kaiming_normal_(&w, 0.0, FanMode::FanIn, "relu")?;
    near("kaiming_normal fan_in std", stats(&w).1, 2f64.sqrt() / 512f64.sqrt(), 0.01);
    kaiming_normal_(&w, 0.0, FanMode::FanOut, "relu")?;
    near("kaiming_normal fan_out std", stats(&w).1, 2f64.sqrt() / 256f64.sqrt(), 0.01);
    // nn.Linear's default: kaiming_uniform_(a = sqrt(5)), a bound of 1 / sqrt(fan_in).
    kaiming_uniform_(&w, 5f64.sqrt(), FanMode::FanIn, "leaky_relu")?;
    let bound = 1.0 / 512f64.sqrt();
    assert!(stats(&w).2 <= bound * (1.0 + 1e-6));
    near("kaiming_uniform std", stats(&w).1, bound / 3f64.sqrt(), 0.01);
    // Constants; the tensor is the same parameter throughout, still a leaf with no record.
    constant_(&w, 0.25)?;
    assert!(w.to_vec::<f32>()?.iter().all(|&x| x == 0.25));
    ones_(&w)?;
    assert!(w.to_vec::<f32>()?.iter().all(|&x| x == 1.0));
    zeros_(&w)?;
    assert!(w.to_vec::<f32>()?.iter().all(|&x| x == 0.0));
    assert!(w.id() == before && w.requires_grad() && w.grad_fn().is_none() && w.grad().is_none());
    Ok(())
}

#[test]
fn gains_and_errors_follow_pytorch() -> Result<()> {
    assert_eq!(calculate_gain("relu", None)?, 2f64.sqrt());
    assert_eq!(calculate_gain("tanh", None)?, 5.0 / 3.0);
    assert_eq!(calculate_gain("leaky_relu", Some(0.2))?, (2.0f64 / 1.04).sqrt());
    assert_eq!(calculate_gain("conv2d", None)?, 1.0);
    let err = calculate_gain("swish", None).unwrap_err().to_string();
    assert!(err.contains("swish"), "{err}");
    let bias = Tensor::zeros(&[8], DType::F32, Device::Cpu)?;
    let err = xavier_uniform_(&bias, 1.0).unwrap_err().to_string();
    assert!(err.contains("xavier_uniform_") && err.contains("[8]"), "{err}");
    // Outside no_grad, an in-place write into a parameter names the call that was made.
    let w = weight();
    let err = w.zero_().unwrap_err().to_string();
    assert!(err.starts_with("zero_:") && err.contains("no_grad"), "{err}");
    let err = w.fill_(1.0).unwrap_err().to_string();
    assert!(err.starts_with("fill_:"), "{err}");
    Ok(())
}
