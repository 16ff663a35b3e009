//! The regression and binary losses and the new activations against PyTorch's formulas
//! written out per element, their gradients against finite differences, edge values (0 and 1
//! probabilities, zero KL targets), errors naming the shapes, and mixed dtypes promoted.

use kiln_autograd::{gradcheck, Backward, GradcheckConfig};
use kiln_nn::{
    binary_cross_entropy, binary_cross_entropy_with_logits, huber_loss, kl_div, l1_loss, leaky_relu, mse_loss, smooth_l1_loss, Forward,
    LeakyRelu, Reduction, Sigmoid,
};
use kiln_tensor::{DType, Device, Distribution, Result, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F64, Device::Cpu).unwrap()
}

fn uniform(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Uniform, seed, 0, DType::F64, Device::Cpu).unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

/// `loss` in every reduction against `per(x, y)` per element.
fn check_reductions(loss: impl Fn(&Tensor, &Tensor, Reduction) -> Result<Tensor>, x: &Tensor, y: &Tensor, per: impl Fn(f64, f64) -> f64) {
    let want: Vec<f64> = f64s(x).iter().zip(f64s(y)).map(|(&a, b)| per(a, b)).collect();
    let close = |got: Vec<f64>, want: &[f64]| {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "element {i}: got {g}, want {w}");
        }
    };
    close(f64s(&loss(x, y, Reduction::None).unwrap()), &want);
    close(f64s(&loss(x, y, Reduction::Sum).unwrap()), &[want.iter().sum()]);
    close(f64s(&loss(x, y, Reduction::Mean).unwrap()), &[want.iter().sum::<f64>() / want.len() as f64]);
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn regression_losses_match_their_formulas_and_finite_differences() -> Result<()> {
    let (x, y) = (randn(&[3, 5], 1).mul_scalar(2.0)?, randn(&[3, 5], 2));
    check_reductions(mse_loss, &x, &y, |a, b| (a - b).powi(2));
    check_reductions(l1_loss, &x, &y, |a, b| (a - b).abs());
    for k in [0.5, 1.0, 2.5] {
        let huber = |a: f64, b: f64| if (a - b).abs() < k { 0.5 * (a - b).powi(2) } else { k * ((a - b).abs() - 0.5 * k) };
        check_reductions(|p, t, r| huber_loss(p, t, k, r), &x, &y, huber);
        check_reductions(|p, t, r| smooth_l1_loss(p, t, k, r), &x, &y, |a, b| huber(a, b) / k);
    }
    check_reductions(|p, t, r| smooth_l1_loss(p, t, 0.0, r), &x, &y, |a, b| (a - b).abs());
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    let inputs = [x, y];
    gradcheck(|t| huber_loss(&t[0], &t[1], 1.0, Reduction::Mean), &inputs, cfg)?;
    gradcheck(|t| smooth_l1_loss(&t[0], &t[1], 0.7, Reduction::Sum), &inputs, cfg)?;
    gradcheck(|t| l1_loss(&t[0], &t[1], Reduction::Mean), &inputs, cfg)?;
    Ok(())
}

#[test]
fn binary_cross_entropy_with_and_without_logits() -> Result<()> {
    // Logits up to ±30: the stable form never overflows; targets soft, in [0, 1].
    let x = Tensor::from_vec(vec![-30.0, -2.0, -0.5, 0.0, 0.3, 1.5, 4.0, 30.0], &[2, 4], Device::Cpu)?;
    let y = uniform(&[2, 4], 3);
    let bce = |p: f64, t: f64| -(t * p.ln().max(-100.0) + (1.0 - t) * (1.0 - p).ln().max(-100.0));
    check_reductions(
        |a, b, r| binary_cross_entropy_with_logits(a, b, None, r),
        &x,
        &y,
        |a, t| {
            // log(1 + e^-a) in a form exact at both ends.
            let softplus_neg = if a > 0.0 { (-a).exp().ln_1p() } else { -a + a.exp().ln_1p() };
            t * softplus_neg + (1.0 - t) * (a + softplus_neg)
        },
    );
    let mid = x.clamp(-5.0, 5.0)?;
    check_reductions(|a, b, r| binary_cross_entropy(&a.sigmoid()?, b, r), &mid, &y, |a, t| bce(sigmoid(a), t));
    // pos_weight [4] weighs the positive term per column.
    let pw = Tensor::from_vec(vec![1.0, 2.0, 0.5, 3.0], &[4], Device::Cpu)?;
    let got = f64s(&binary_cross_entropy_with_logits(&mid, &y, Some(&pw), Reduction::None)?);
    for (i, ((a, t), g)) in f64s(&mid).into_iter().zip(f64s(&y)).zip(got).enumerate() {
        let w = [1.0, 2.0, 0.5, 3.0][i % 4];
        let want = -(w * t * sigmoid(a).ln() + (1.0 - t) * (1.0 - sigmoid(a)).ln());
        assert!((g - want).abs() < 1e-12, "element {i}: {g} vs {want}");
    }
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| binary_cross_entropy_with_logits(&t[0], &t[1], Some(&pw), Reduction::Mean), &[mid.clone(), y.clone()], cfg)?;
    gradcheck(|t| binary_cross_entropy(&t[0].sigmoid()?, &t[1], Reduction::Sum), &[mid, y], cfg)?;
    // Probabilities of exactly 0 and 1: the logs are clamped at -100, loss and gradient finite.
    let p = Tensor::from_vec(vec![0.0f32, 1.0, 0.0, 1.0], &[4], Device::Cpu)?;
    p.set_requires_grad(true);
    let t = Tensor::from_vec(vec![0.0f32, 1.0, 1.0, 0.0], &[4], Device::Cpu)?;
    let loss = binary_cross_entropy(&p, &t, Reduction::None)?;
    assert_eq!(loss.to_vec::<f32>()?, vec![0.0, 0.0, 100.0, 100.0]);
    loss.sum_all()?.backward()?;
    assert!(p.grad().unwrap().to_vec::<f32>()?.iter().all(|g| g.is_finite()));
    Ok(())
}

#[test]
fn kl_divergence_with_probability_and_log_targets() -> Result<()> {
    let input = randn(&[2, 5], 4).log_softmax(1)?;
    let target = randn(&[2, 5], 5).softmax(1)?;
    let want = |lp: f64, t: f64| if t > 0.0 { t * (t.ln() - lp) } else { 0.0 };
    check_reductions(|a, b, r| kl_div(a, b, false, r), &input, &target, want);
    check_reductions(|a, b, r| kl_div(a, &b.log()?, true, r), &input, &target, want);
    // A zero target contributes zero, and its gradient is finite.
    let t0 = Tensor::from_vec(vec![0.0f32, 0.25, 0.75], &[3], Device::Cpu)?;
    t0.set_requires_grad(true);
    let lp = Tensor::from_vec(vec![-1.0f32, -2.0, -0.5], &[3], Device::Cpu)?;
    let kl = kl_div(&lp, &t0, false, Reduction::None)?;
    assert_eq!(kl.to_vec::<f32>()?[0], 0.0);
    kl.sum_all()?.backward()?;
    assert!(t0.grad().unwrap().to_vec::<f32>()?.iter().all(|g| g.is_finite()));
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| kl_div(&t[0].log_softmax(1)?, &t[1].softmax(1)?, false, Reduction::Sum), &[randn(&[2, 5], 6), randn(&[2, 5], 7)], cfg)?;
    Ok(())
}

#[test]
fn sigmoid_and_leaky_relu_modules() -> Result<()> {
    let x = Tensor::from_vec(vec![-2.0, -0.0, 0.0, 3.0], &[4], Device::Cpu)?;
    assert_eq!(f64s(&LeakyRelu::default().forward(&x)?), vec![-0.02, 0.0, 0.0, 3.0]);
    assert_eq!(f64s(&leaky_relu(&x, 0.2)?), vec![-0.4, 0.0, 0.0, 3.0]);
    let s = f64s(&Sigmoid.forward(&x)?);
    assert!((s[0] - sigmoid(-2.0)).abs() < 1e-15 && (s[3] - sigmoid(3.0)).abs() < 1e-15);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| leaky_relu(&t[0], 0.1)?.sum_all(), &[randn(&[7], 8)], cfg)?;
    Ok(())
}

#[test]
fn losses_name_mismatched_shapes_and_bad_parameters_and_promote_dtypes() {
    let (a, b) = (randn(&[2, 3], 9), randn(&[3, 2], 10));
    let e = mse_loss(&a, &b, Reduction::Mean).unwrap_err().to_string();
    assert!(e.contains("mse_loss") && e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    // Mixed float dtypes promote (an autocast prediction against an F32 target).
    let mixed = l1_loss(&a.to_dtype(DType::BF16).unwrap(), &a.to_dtype(DType::F32).unwrap(), Reduction::Sum).unwrap();
    assert_eq!(mixed.dtype(), DType::F32);
    let e = huber_loss(&a, &a, -1.0, Reduction::Mean).unwrap_err().to_string();
    assert!(e.contains("delta") && e.contains("-1"), "{e}");
    let e = smooth_l1_loss(&a, &a, f64::NAN, Reduction::Mean).unwrap_err().to_string();
    assert!(e.contains("beta"), "{e}");
    let e = binary_cross_entropy_with_logits(&a, &b, None, Reduction::Sum).unwrap_err().to_string();
    assert!(e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    let e = kl_div(&a, &b, false, Reduction::Sum).unwrap_err().to_string();
    assert!(e.contains("kl_div"), "{e}");
}

/// Cross-entropy on BF16 logits reads them as they are: the losses are those of the same
/// values in F32 (F32 under autocast, rounded to BF16 without it), and the logits' gradient
/// is BF16, the F32 gradient rounded. The per-row gradient must be in the losses' dtype.
#[test]
fn cross_entropy_on_bf16_logits_computes_in_f32() -> Result<()> {
    use kiln_nn::{cross_entropy_with, CrossEntropyConfig};
    let logits = randn(&[6, 11], 12).mul_scalar(3.0)?.to_dtype(DType::BF16)?;
    let wide = logits.to_dtype(DType::F32)?;
    let targets = Tensor::from_slice(&[3i64, -100, 0, 10, 5, 5], &[6], Device::Cpu)?;
    let cfg = CrossEntropyConfig { label_smoothing: 0.1, reduction: kiln_nn::Reduction::None, ..Default::default() };
    let want = wide.cross_entropy_rows(&targets, cfg.ignore_index, cfg.label_smoothing)?.to_vec::<f32>()?;
    {
        let _amp = kiln_tensor::Autocast::new(DType::BF16)?;
        let rows = cross_entropy_with(&logits, &targets, cfg)?;
        assert_eq!(rows.dtype(), DType::F32, "losses of BF16 logits under autocast");
        let got = rows.to_vec::<f32>()?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "row {i}: {g} vs {w}");
        }
        assert_eq!(got[1], 0.0, "the ignored row");
    }
    let pure = cross_entropy_with(&logits, &targets, cfg)?;
    assert_eq!(pure.dtype(), DType::BF16, "without autocast the losses keep the logits' dtype");
    for (g, w) in pure.to_dtype(DType::F32)?.to_vec::<f32>()?.iter().zip(&want) {
        let rounded = Tensor::from_slice(&[*w], &[1], Device::Cpu)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.to_vec::<f32>()?[0];
        assert_eq!(*g, rounded);
    }
    // The logits' gradient for per-row weights.
    let gr = Tensor::from_slice(&[0.5f32, 1.0, -2.0, 0.25, 1.0, 3.0], &[6], Device::Cpu)?;
    let grad = logits.cross_entropy_rows_backward(&targets, &gr, cfg.ignore_index, cfg.label_smoothing)?;
    assert_eq!(grad.dtype(), DType::BF16);
    let want = wide.cross_entropy_rows_backward(&targets, &gr, cfg.ignore_index, cfg.label_smoothing)?.to_vec::<f32>()?;
    for (i, (g, w)) in grad.to_dtype(DType::F32)?.to_vec::<f32>()?.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 4e-3 * w.abs() + 1e-6, "gradient {i}: {g} vs {w}");
    }
    let e = logits.cross_entropy_rows_backward(&targets, &gr.to_dtype(DType::BF16)?, None, 0.0).unwrap_err().to_string();
    assert!(e.contains("cross_entropy_backward") && e.contains("F32") && e.contains("BF16"), "{e}");
    Ok(())
}
