//! kiln-optim against hand-computed values and scalar f64 re-implementations of PyTorch's
//! formulas: SGD, Adam, AdamW, AMSGrad, the schedulers, clipping, and state save/load.

use kiln_optim::*;
use kiln_tensor::{Device, Error, Op, Tensor, Tracer};
use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;

fn param(v: &[f64]) -> Tensor {
    let p = Tensor::from_slice(v, &[v.len()], Device::Cpu).unwrap();
    p.set_requires_grad(true);
    p
}

fn set_grad(p: &Tensor, g: &[f64]) {
    p.set_grad(Some(Tensor::from_slice(g, &[g.len()], Device::Cpu).unwrap()));
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= tol, "got {got:?}, want {want:?} (tol {tol})");
    }
}

/// Builds an optimizer over the given parameters (for tests run over several kinds).
type MakeOpt = fn(Vec<Tensor>) -> Box<dyn Optimizer>;

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kiln_optim_{}_{name}.safetensors", std::process::id()))
}

/// The lr as the optimizer stores it (an F64 tensor: exact).
fn stored_lr(lr: f64) -> f64 {
    // Kept as a function so the reference reads like the optimizer does.
    lr
}

// ---------------------------------------------------------------- SGD

#[test]
fn sgd_nesterov_momentum_weight_decay_three_steps_by_hand() {
    // lr 0.25, momentum 0.5, weight decay 0.1, Nesterov; the gradient stays [0.5, 1.0].
    // Each step: g' = g + 0.1 p; buf = g' on step 1, else 0.5 buf + g'; d = g' + 0.5 buf;
    // p -= 0.25 d.
    // p[0] = 1:  step 1: g' = 0.6,        buf = 0.6,        d = 0.9,         p = 0.775
    //            step 2: g' = 0.5775,     buf = 0.8775,     d = 1.01625,     p = 0.5209375
    //            step 3: g' = 0.55209375, buf = 0.99084375, d = 1.047515625, p = 0.25905859375
    // p[1] = -2: step 1: g' = 0.8,        buf = 0.8,        d = 1.2,         p = -2.3
    //            step 2: g' = 0.77,       buf = 1.17,       d = 1.355,       p = -2.63875
    //            step 3: g' = 0.736125,   buf = 1.321125,   d = 1.3966875,   p = -2.987921875
    let p = param(&[1.0, -2.0]);
    set_grad(&p, &[0.5, 1.0]);
    let cfg = SgdConfig { lr: 0.25, momentum: 0.5, dampening: 0.0, weight_decay: 0.1, nesterov: true };
    let mut opt = SGD::new(vec![p.clone()], cfg).unwrap();
    let want = [[0.775, -2.3], [0.5209375, -2.63875], [0.25905859375, -2.987921875]];
    for w in want {
        opt.step().unwrap();
        assert_close(&values(&p), &w, 1e-12);
    }
    assert_close(&values(&p.grad().unwrap()), &[0.5, 1.0], 0.0); // the grad is not modified
    let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["step", "lr", "state.0.momentum_buffer"]);
    assert_close(&values(&opt.state_tensors()[2].1), &[0.99084375, 1.321125], 1e-12);
}

#[test]
fn sgd_dampened_momentum_matches_scalar_reference() {
    // PyTorch: buf = g on step 1, then buf = m buf + (1 - dampening) g; p -= lr buf.
    let (lr, m, damp) = (0.5, 0.9, 0.25);
    let grads = [[1.0, -2.0], [0.5, 0.25], [-1.0, 3.0]];
    let p = param(&[0.0, 1.0]);
    let cfg = SgdConfig { lr, momentum: m, dampening: damp, weight_decay: 0.0, nesterov: false };
    let mut opt = SGD::new(vec![p.clone()], cfg).unwrap();
    let (mut want, mut buf) = ([0.0, 1.0], [0.0, 0.0]);
    for (t, g) in grads.iter().enumerate() {
        set_grad(&p, g);
        opt.step().unwrap();
        for i in 0..2 {
            buf[i] = if t == 0 { g[i] } else { m * buf[i] + (1.0 - damp) * g[i] };
            want[i] -= lr * buf[i];
        }
        assert_close(&values(&p), &want, 1e-12);
    }
}

#[test]
fn sgd_plain_skips_params_without_grad() {
    let (a, b) = (param(&[1.0, 2.0]), param(&[3.0, 4.0]));
    set_grad(&a, &[1.0, -1.0]);
    let mut opt = SGD::new(vec![a.clone(), b.clone()], SgdConfig { lr: 0.5, ..Default::default() }).unwrap();
    opt.step().unwrap();
    assert_close(&values(&a), &[0.5, 2.5], 0.0);
    assert_close(&values(&b), &[3.0, 4.0], 0.0);
    let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["step", "lr"]); // no momentum: no per-parameter state
}

#[test]
fn sgd_rejects_invalid_configs() {
    let p = || vec![param(&[1.0])];
    let bad = [
        SgdConfig { nesterov: true, ..Default::default() },
        SgdConfig { nesterov: true, momentum: 0.9, dampening: 0.1, ..Default::default() },
        SgdConfig { lr: -1.0, ..Default::default() },
        SgdConfig { lr: f64::NAN, ..Default::default() },
        SgdConfig { momentum: -0.1, ..Default::default() },
        SgdConfig { weight_decay: -0.1, ..Default::default() },
    ];
    for cfg in bad {
        assert!(SGD::new(p(), cfg).is_err(), "{cfg:?} should be rejected");
    }
    let q = param(&[1.0]);
    assert!(SGD::new(vec![q.clone(), q], SgdConfig::default()).is_err(), "duplicate parameter");
    let non_leaf = param(&[1.0]).mul_scalar(2.0).unwrap();
    assert!(SGD::new(vec![non_leaf], SgdConfig::default()).is_err(), "non-leaf parameter");
    let mut opt = SGD::new(p(), SgdConfig::default()).unwrap();
    assert!(opt.set_lr(-0.5).is_err());
    assert_eq!(opt.lr(), 1e-3);
}

#[test]
fn mis_shaped_grad_is_an_error() {
    let p = param(&[1.0, 2.0]);
    set_grad(&p, &[1.0]); // would broadcast silently in an in-place op
    let mut opt = SGD::new(vec![p.clone()], SgdConfig::default()).unwrap();
    let e = opt.step().unwrap_err().to_string();
    assert!(e.contains("[2]") && e.contains("[1]"), "{e}");
}

// ---------------------------------------------------------------- Adam / AdamW

/// PyTorch's single-tensor Adam on f64 scalars.
fn adam_reference(p0: &[f64], grads: &[Vec<f64>], cfg: &AdamConfig, decoupled: bool) -> Vec<Vec<f64>> {
    let (b1, b2) = cfg.betas;
    let (lr, wd) = (stored_lr(cfg.lr), cfg.weight_decay);
    let n = p0.len();
    let (mut p, mut m, mut v, mut vmax) = (p0.to_vec(), vec![0.0; n], vec![0.0; n], vec![0.0f64; n]);
    let mut out = Vec::new();
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as f64;
        let (bc1, bc2) = (1.0 - b1.powf(t), 1.0 - b2.powf(t));
        for i in 0..n {
            let mut gi = g[i];
            if wd != 0.0 && decoupled {
                p[i] *= 1.0 - lr * wd;
            } else if wd != 0.0 {
                gi += wd * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            vmax[i] = vmax[i].max(v[i]);
            let second = if cfg.amsgrad { vmax[i] } else { v[i] };
            let denom = second.sqrt() / bc2.sqrt() + cfg.eps;
            p[i] -= lr / bc1 * m[i] / denom;
        }
        out.push(p.clone());
    }
    out
}

/// Runs an optimizer over `grads` (one per step) and returns the params after each step.
fn run_steps(opt: &mut dyn Optimizer, p: &Tensor, grads: &[Vec<f64>]) -> Vec<Vec<f64>> {
    grads
        .iter()
        .map(|g| {
            set_grad(p, g);
            opt.step().unwrap();
            values(p)
        })
        .collect()
}

fn adam_grads() -> Vec<Vec<f64>> {
    vec![vec![0.1, -0.3, 1.0], vec![0.2, -0.1, 0.5], vec![-0.4, 0.05, 0.25]]
}

#[test]
fn adam_three_steps_match_reference() {
    let p0 = [0.5, -1.5, 2.0];
    for wd in [0.0, 0.1] {
        let cfg = AdamConfig { lr: 0.01, weight_decay: wd, ..Default::default() };
        let p = param(&p0);
        let mut opt = Adam::new(vec![p.clone()], cfg).unwrap();
        let got = run_steps(&mut opt, &p, &adam_grads());
        let want = adam_reference(&p0, &adam_grads(), &cfg, false);
        for (g, w) in got.iter().zip(&want) {
            assert_close(g, w, 1e-12);
        }
    }
}

#[test]
fn adam_first_step_moves_each_param_by_lr() {
    // Step 1: m/bc1 = g and sqrt(v/bc2) = |g|, so p -= lr * sign(g) (up to eps).
    let p = param(&[1.0, 1.0]);
    set_grad(&p, &[3.0, -0.5]);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig { lr: 0.125, ..Default::default() }).unwrap();
    opt.step().unwrap();
    assert_close(&values(&p), &[0.875, 1.125], 1e-8);
}

#[test]
fn adamw_three_steps_match_reference() {
    let p0 = [0.5, -1.5, 2.0];
    let cfg = AdamConfig { lr: 0.01, ..AdamConfig::adamw() };
    assert_eq!(cfg.weight_decay, 1e-2);
    let p = param(&p0);
    let mut opt = AdamW::new(vec![p.clone()], cfg).unwrap();
    let got = run_steps(&mut opt, &p, &adam_grads());
    let want = adam_reference(&p0, &adam_grads(), &cfg, true);
    for (g, w) in got.iter().zip(&want) {
        assert_close(g, w, 1e-12);
    }
    // Decoupled decay differs from L2 decay.
    let q = param(&p0);
    let mut adam = Adam::new(vec![q.clone()], cfg).unwrap();
    let l2 = run_steps(&mut adam, &q, &adam_grads());
    assert!((l2[2][0] - got[2][0]).abs() > 1e-6);
}

#[test]
fn amsgrad_uses_running_max_of_second_moment() {
    // A large gradient then small ones with a short-memory beta2: v shrinks fast while
    // max_exp_avg_sq keeps the peak.
    let p0 = [1.0, -1.0];
    let betas = (0.9, 0.5);
    let grads = vec![vec![2.0, -1.0], vec![0.01, 0.02], vec![0.01, -0.03]];
    for (amsgrad, decoupled) in [(true, false), (true, true), (false, false)] {
        let cfg = AdamConfig { lr: 0.05, betas, amsgrad, weight_decay: 0.05, ..Default::default() };
        let p = param(&p0);
        let mut opt: Box<dyn Optimizer> = if decoupled {
            Box::new(AdamW::new(vec![p.clone()], cfg).unwrap())
        } else {
            Box::new(Adam::new(vec![p.clone()], cfg).unwrap())
        };
        let got = run_steps(opt.as_mut(), &p, &grads);
        let want = adam_reference(&p0, &grads, &cfg, decoupled);
        for (g, w) in got.iter().zip(&want) {
            assert_close(g, w, 1e-12);
        }
        let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
        let mut expect = vec!["step", "lr", "state.0.exp_avg", "state.0.exp_avg_sq"];
        if amsgrad {
            expect.push("state.0.max_exp_avg_sq");
        }
        assert_eq!(names, expect);
    }
    let plain = adam_reference(&p0, &grads, &AdamConfig { lr: 0.05, betas, ..Default::default() }, false);
    let ams = adam_reference(&p0, &grads, &AdamConfig { lr: 0.05, betas, amsgrad: true, ..Default::default() }, false);
    assert!((plain[2][0] - ams[2][0]).abs() > 1e-4, "the test must exercise the max");
}

#[test]
fn adam_rejects_invalid_configs() {
    let bad = [
        AdamConfig { betas: (1.0, 0.999), ..Default::default() },
        AdamConfig { betas: (0.9, -0.1), ..Default::default() },
        AdamConfig { eps: -1e-8, ..Default::default() },
        AdamConfig { weight_decay: -1.0, ..Default::default() },
        AdamConfig { lr: -1e-3, ..Default::default() },
    ];
    for cfg in bad {
        assert!(Adam::new(vec![param(&[1.0])], cfg).is_err(), "{cfg:?}");
        assert!(AdamW::new(vec![param(&[1.0])], cfg).is_err(), "{cfg:?}");
    }
}

#[test]
fn step_count_and_lr_are_tensors_updated_in_place() {
    let p = param(&[1.0, 2.0]);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    let state = opt.state_tensors();
    let (step, lr) = (state[0].1.clone(), state[1].1.clone());
    assert!(step.shape().is_empty() && lr.shape().is_empty());
    opt.step().unwrap(); // no grads: nothing happens, as in PyTorch
    assert_eq!(step.item().unwrap(), 0.0);
    set_grad(&p, &[1.0, 1.0]);
    opt.step().unwrap();
    let first = opt.state_tensors();
    opt.step().unwrap();
    opt.set_lr(0.5).unwrap();
    assert_eq!(step.item().unwrap(), 2.0);
    assert_eq!(lr.item().unwrap(), 0.5);
    assert_eq!(opt.lr(), 0.5);
    // Same tensors (storage) after more steps and an lr change: nothing was replaced.
    let later = opt.state_tensors();
    assert_eq!(later.len(), 4);
    for ((n0, t0), (n1, t1)) in first.iter().zip(&later) {
        assert_eq!(n0, n1);
        assert!(t0.same_storage(t1), "{n0} changed storage");
    }
    assert!(later[0].1.same_storage(&step) && later[1].1.same_storage(&lr));
}

#[test]
fn zero_grad_sets_to_none_by_default_or_zeroes_in_place() {
    let p = param(&[1.0, 2.0]);
    set_grad(&p, &[3.0, 4.0]);
    let mut opt = SGD::new(vec![p.clone(), param(&[5.0])], SgdConfig::default()).unwrap();
    opt.zero_grad().unwrap();
    assert!(p.grad().is_none());
    set_grad(&p, &[3.0, 4.0]);
    let g = p.grad().unwrap();
    opt.zero_grad_with(false).unwrap();
    let after = p.grad().unwrap();
    assert!(after.same_storage(&g));
    assert_close(&values(&after), &[0.0, 0.0], 0.0);
    assert!(opt.params()[1].grad().is_none(), "a missing grad stays missing");
}

// ---------------------------------------------------------------- tracing

/// Records every op (as text) and counts host reads.
#[derive(Default)]
struct Recorder {
    ops: RefCell<Vec<String>>,
    host_reads: RefCell<usize>,
}

impl Tracer for Recorder {
    fn record(&self, op: &Op, _inputs: &[&Tensor], _output: &Tensor) {
        self.ops.borrow_mut().push(format!("{op:?}"));
    }
    fn host_read(&self, _what: &'static str, _t: &Tensor) -> kiln_tensor::Result<()> {
        *self.host_reads.borrow_mut() += 1;
        Err(Error::GraphBreak("host read while tracing".into()))
    }
}

fn traced(f: impl FnOnce()) -> (Vec<String>, usize) {
    let rec = Rc::new(Recorder::default());
    let prev = kiln_tensor::set_tracer(Some(rec.clone()));
    f();
    kiln_tensor::set_tracer(prev);
    let ops = rec.ops.borrow().clone();
    let reads = *rec.host_reads.borrow();
    (ops, reads)
}

#[test]
fn traced_steps_read_nothing_on_the_host_and_bake_in_no_step_or_lr() {
    let make: [MakeOpt; 3] = [
        |p| Box::new(Adam::new(p, AdamConfig { amsgrad: true, weight_decay: 0.1, ..Default::default() }).unwrap()),
        |p| Box::new(AdamW::new(p, AdamConfig::adamw()).unwrap()),
        |p| Box::new(SGD::new(p, SgdConfig { momentum: 0.9, nesterov: true, weight_decay: 0.1, ..Default::default() }).unwrap()),
    ];
    for new in make {
        let p = param(&[1.0, -2.0, 0.5]);
        set_grad(&p, &[0.3, 0.1, -0.2]);
        let mut opt = new(vec![p.clone()]);
        opt.step().unwrap(); // creates the state buffers
        let (a, reads_a) = traced(|| opt.step().unwrap());
        opt.set_lr(0.123).unwrap(); // as a scheduler would, outside the traced step
        let (b, reads_b) = traced(|| {
            clip_grad_norm(std::slice::from_ref(&p), 1.0).unwrap();
            opt.step().unwrap();
        });
        assert_eq!((reads_a, reads_b), (0, 0));
        assert!(!a.is_empty());
        // Steps 2 and 3, with different lrs, record exactly the same ops and constants.
        assert_eq!(a, b[b.len() - a.len()..]);
        assert!(a.iter().all(|op| !op.starts_with("Full")), "no constant tensors made in a step: {a:?}");
    }
}

// ---------------------------------------------------------------- schedulers

/// The lrs the optimizer gets for steps 0..n under `sched`.
fn lr_sequence(sched: &mut dyn LrScheduler, n: usize) -> Vec<f64> {
    let mut opt = SGD::new(vec![param(&[0.0])], SgdConfig { lr: 1.0, ..Default::default() }).unwrap();
    sched.apply(&mut opt).unwrap();
    let mut out = vec![opt.lr()];
    for t in 1..n {
        sched.step(&mut opt).unwrap();
        assert_eq!(sched.last_step(), t);
        out.push(opt.lr());
    }
    for (t, lr) in out.iter().enumerate() {
        assert_eq!(*lr, sched.lr_at(t));
    }
    out
}

#[test]
fn step_lr_sequence() {
    let got = lr_sequence(&mut StepLR::new(0.1, 2, 0.5).unwrap(), 7);
    let want: Vec<f64> = (0..7).map(|t| 0.1 * 0.5f64.powi(t / 2)).collect();
    assert_close(&got, &want, 1e-15);
    assert_close(&got, &[0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.0125], 1e-15);
    assert!(StepLR::new(0.1, 0, 0.5).is_err());
}

#[test]
fn cosine_annealing_sequence() {
    let got = lr_sequence(&mut CosineAnnealingLR::new(0.1, 4, 0.01).unwrap(), 5);
    let want: Vec<f64> = (0..5).map(|t| 0.01 + 0.09 * (1.0 + (std::f64::consts::PI * t as f64 / 4.0).cos()) / 2.0).collect();
    assert_close(&got, &want, 1e-15);
    assert_close(&got, &[0.1, 0.0868198051533946, 0.055, 0.0231801948466054, 0.01], 1e-15);
    assert!(CosineAnnealingLR::new(0.1, 0, 0.0).is_err());
}

#[test]
fn warmup_cosine_sequence() {
    let mut s = WarmupCosine::new(1e-2, 2, 5, 0.0).unwrap();
    let got = lr_sequence(&mut s, 5);
    assert_close(&got, &[5e-3, 1e-2, 1e-2, 7.5e-3, 2.5e-3], 1e-15);
    assert_close(&[s.lr_at(5), s.lr_at(9)], &[0.0, 0.0], 1e-15); // clamped at total_steps
    let s = WarmupCosine::new(1.0, 0, 4, 0.2).unwrap();
    assert_close(&[s.lr_at(0), s.lr_at(2), s.lr_at(4)], &[1.0, 0.6, 0.2], 1e-15);
    assert!(WarmupCosine::new(1.0, 5, 5, 0.0).is_err());
}

#[test]
fn exponential_multistep_and_linear_sequences() {
    let got = lr_sequence(&mut ExponentialLR::new(0.1, 0.5).unwrap(), 4);
    assert_close(&got, &[0.1, 0.05, 0.025, 0.0125], 1e-15);
    assert!(ExponentialLR::new(0.1, 0.0).is_err());
    // Milestones unsorted, 4 given twice: gamma once from step 2, three times from step 4.
    let got = lr_sequence(&mut MultiStepLR::new(1.0, &[4, 2, 4], 0.1).unwrap(), 6);
    assert_close(&got, &[1.0, 1.0, 0.1, 0.1, 1e-3, 1e-3], 1e-15);
    // Factor 0.25 to 1 over three steps, then held.
    let got = lr_sequence(&mut LinearLR::new(0.5, 0.25, 1.0, 3).unwrap(), 6);
    assert_close(&got, &[0.125, 0.25, 0.375, 0.5, 0.5, 0.5], 1e-15);
    assert!(LinearLR::new(0.5, 0.0, 1.0, 3).is_err());
    assert!(LinearLR::new(0.5, 0.5, 1.5, 3).is_err());
    assert!(LinearLR::new(0.5, 0.5, 1.0, 0).is_err());
}

#[test]
fn lambda_polynomial_and_warm_restart_sequences() {
    // LambdaLR: a linear warmup over 3 steps.
    let got = lr_sequence(&mut LambdaLR::new(0.3, |t| ((t + 1) as f64 / 3.0).min(1.0)), 5);
    assert_close(&got, &[0.1, 0.2, 0.3, 0.3, 0.3], 1e-15);
    // PolynomialLR: (1 - t/4)^2, then 0.
    let got = lr_sequence(&mut PolynomialLR::new(1.0, 4, 2.0).unwrap(), 6);
    assert_close(&got, &[1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0], 1e-15);
    assert!(PolynomialLR::new(1.0, 0, 1.0).is_err());
    // Warm restarts, t_0 2, t_mult 2: cycles of 2 then 4 steps, each from base_lr down.
    let cos = |tc: f64, ti: f64| 0.1 + 0.9 * (1.0 + (std::f64::consts::PI * tc / ti).cos()) / 2.0;
    let got = lr_sequence(&mut CosineAnnealingWarmRestarts::new(1.0, 2, 2, 0.1).unwrap(), 7);
    let want = [cos(0.0, 2.0), cos(1.0, 2.0), cos(0.0, 4.0), cos(1.0, 4.0), cos(2.0, 4.0), cos(3.0, 4.0), cos(0.0, 8.0)];
    assert_close(&got, &want, 1e-15);
    assert_close(&got[..3], &[1.0, 0.55, 1.0], 1e-15);
    let fixed = CosineAnnealingWarmRestarts::new(1.0, 3, 1, 0.0).unwrap();
    assert_close(&[fixed.lr_at(3), fixed.lr_at(3_000_001)], &[1.0, fixed.lr_at(1)], 1e-15);
    assert!(CosineAnnealingWarmRestarts::new(1.0, 0, 1, 0.0).is_err());
}

#[test]
fn one_cycle_sequence() {
    // max_lr 1, 10 steps: starts at 1/25, peaks at step 0.3*10 - 1 = 2, ends at 1/25/1e4 at 9.
    let mut s = OneCycleLR::new(1.0, 10).unwrap();
    let got = lr_sequence(&mut s, 11);
    let (initial, min) = (0.04, 0.04 / 1e4);
    let anneal = |a: f64, b: f64, pct: f64| b + (a - b) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0);
    let want: Vec<f64> =
        (0..=10).map(|t| if t <= 2 { anneal(initial, 1.0, t as f64 / 2.0) } else { anneal(1.0, min, (t as f64 - 2.0) / 7.0) }).collect();
    assert_close(&got, &want, 1e-15);
    assert_close(&got[..3], &[0.04, 0.52, 1.0], 1e-15);
    assert_close(&[got[9]], &[4e-6], 1e-18);
    // PyTorch allows total_steps calls of step() and errors after.
    let mut opt = SGD::new(vec![param(&[0.0])], SgdConfig::default()).unwrap();
    assert!(s.step(&mut opt).is_err());
    assert_eq!(s.last_step(), 10);
    assert!(OneCycleLR::with_options(1.0, 10, 0.1, 25.0, 1e4).is_err(), "empty warmup phase");
}

#[test]
fn scheduler_resumes_from_set_last_step() {
    let mut a = WarmupCosine::new(1e-2, 2, 5, 0.0).unwrap();
    let mut opt = SGD::new(vec![param(&[0.0])], SgdConfig::default()).unwrap();
    a.set_last_step(2);
    a.apply(&mut opt).unwrap();
    assert_eq!(opt.lr(), 1e-2);
    a.step(&mut opt).unwrap();
    assert!((opt.lr() - 7.5e-3).abs() < 1e-15);
}

// ---------------------------------------------------------------- clipping

#[test]
fn clip_grad_norm_scales_to_max_norm() {
    let p = param(&[0.0, 0.0]);
    set_grad(&p, &[3.0, 4.0]);
    let g = p.grad().unwrap();
    let norm = clip_grad_norm(std::slice::from_ref(&p), 1.0).unwrap();
    assert!(norm.shape().is_empty());
    assert_close(&[norm.item().unwrap()], &[5.0], 1e-12);
    assert_close(&values(&p.grad().unwrap()), &[0.6, 0.8], 1e-6);
    assert!(p.grad().unwrap().same_storage(&g), "clipped in place");
}

#[test]
fn clip_grad_norm_over_several_params() {
    // Norm of [3] and [4] together is 5; a param without grad is skipped; max 10 > 5 keeps
    // the grads as they are (coefficient clamped to 1).
    let (a, b, c) = (param(&[0.0]), param(&[0.0]), param(&[0.0]));
    set_grad(&a, &[3.0]);
    set_grad(&b, &[4.0]);
    let norm = clip_grad_norm(&[a.clone(), b.clone(), c.clone()], 10.0).unwrap();
    assert_close(&[norm.item().unwrap()], &[5.0], 1e-12);
    assert_close(&values(&a.grad().unwrap()), &[3.0], 0.0);
    assert_close(&values(&b.grad().unwrap()), &[4.0], 0.0);
    let norm = clip_grad_norm(&[a.clone(), b.clone(), c], 2.5).unwrap();
    assert_close(&[norm.item().unwrap()], &[5.0], 1e-12);
    assert_close(&[values(&a.grad().unwrap())[0], values(&b.grad().unwrap())[0]], &[1.5, 2.0], 1e-6);
    assert_eq!(clip_grad_norm(&[param(&[1.0])], 1.0).unwrap().item().unwrap(), 0.0);
}

#[test]
fn clip_grad_value_clamps_in_place() {
    let p = param(&[0.0, 0.0, 0.0]);
    set_grad(&p, &[-3.0, 0.5, 2.0]);
    let g = p.grad().unwrap();
    clip_grad_value(std::slice::from_ref(&p), 1.0).unwrap();
    assert_close(&values(&g), &[-1.0, 0.5, 1.0], 0.0);
}

// ---------------------------------------------------------------- state

fn snapshot(opt: &dyn Optimizer) -> Vec<(String, Vec<f64>)> {
    opt.state_tensors().into_iter().map(|(n, t)| (n, t.to_vec_f64().unwrap())).collect()
}

#[test]
fn save_load_round_trip_continues_identically() {
    let make: [MakeOpt; 2] = [
        |p| Box::new(AdamW::new(p, AdamConfig { amsgrad: true, ..AdamConfig::adamw() }).unwrap()),
        |p| Box::new(SGD::new(p, SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() }).unwrap()),
    ];
    for (k, new) in make.into_iter().enumerate() {
        let (a, frozen) = (param(&[0.5, -1.5, 2.0]), param(&[7.0]));
        let mut opt = new(vec![a.clone(), frozen.clone()]);
        run_steps(opt.as_mut(), &a, &adam_grads()[..2]);
        opt.set_lr(0.005).unwrap();
        let path = temp_path(&format!("round_trip_{k}"));
        save_state(opt.as_ref(), &path).unwrap();

        // A fresh optimizer over parameters with the same values, loaded from the file.
        let b = param(&values(&a));
        let mut loaded = new(vec![b.clone(), param(&[7.0])]);
        load_state(loaded.as_mut(), &path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(snapshot(loaded.as_ref()), snapshot(opt.as_ref()));
        assert_eq!(loaded.lr(), stored_lr(0.005));

        let more = [vec![0.3, 0.3, -0.1], vec![-0.2, 0.0, 0.4]];
        assert_eq!(run_steps(loaded.as_mut(), &b, &more), run_steps(opt.as_mut(), &a, &more));
    }
}

#[test]
fn load_with_wrong_shape_errors_and_changes_nothing() {
    let p = param(&[1.0, 2.0]);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    run_steps(&mut opt, &p, &[vec![0.1, 0.2], vec![0.3, -0.4]]);
    let before = snapshot(&opt);
    let lr_before = opt.lr();

    // Valid step and lr first, so a partial load would show.
    let mut bad: Vec<(String, Tensor)> = vec![
        ("step".into(), Tensor::scalar(99.0, kiln_tensor::DType::F64, Device::Cpu).unwrap()),
        ("lr".into(), Tensor::scalar(0.5, kiln_tensor::DType::F64, Device::Cpu).unwrap()),
        ("state.0.exp_avg".into(), Tensor::zeros(&[2], kiln_tensor::DType::F64, Device::Cpu).unwrap()),
        ("state.0.exp_avg_sq".into(), Tensor::zeros(&[3], kiln_tensor::DType::F64, Device::Cpu).unwrap()),
    ];
    let e = opt.load_state_tensors(&bad).unwrap_err().to_string();
    assert!(e.contains("state.0.exp_avg_sq") && e.contains("[3]") && e.contains("[2]"), "{e}");
    assert_eq!(snapshot(&opt), before);
    assert_eq!(opt.lr(), lr_before);

    // Also through a file.
    let path = temp_path("wrong_shape");
    let q = param(&[1.0, 2.0, 3.0]);
    let mut other = Adam::new(vec![q.clone()], AdamConfig::default()).unwrap();
    run_steps(&mut other, &q, &[vec![1.0, 1.0, 1.0]]);
    save_state(&other, &path).unwrap();
    let e = load_state(&mut opt, &path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(e.contains("[3]") && e.contains("[2]"), "{e}");
    assert_eq!(snapshot(&opt), before);

    // Wrong dtype, unknown name, missing lr, incomplete per-parameter state.
    bad[3].1 = Tensor::zeros(&[2], kiln_tensor::DType::F32, Device::Cpu).unwrap();
    assert!(opt.load_state_tensors(&bad).unwrap_err().to_string().contains("F32"));
    bad[3].0 = "state.0.momentum_buffer".into();
    assert!(opt.load_state_tensors(&bad).unwrap_err().to_string().contains("unexpected tensor 'state.0.momentum_buffer'"));
    assert!(opt.load_state_tensors(&bad[..1]).unwrap_err().to_string().contains("missing tensor 'lr'"));
    assert!(opt.load_state_tensors(&bad[..3]).unwrap_err().to_string().contains("state.0.exp_avg_sq"));
    assert_eq!(snapshot(&opt), before);
}

#[test]
fn load_drops_state_of_params_absent_from_the_checkpoint() {
    let p = param(&[1.0, 2.0]);
    let mut opt = SGD::new(vec![p.clone()], SgdConfig { momentum: 0.9, ..Default::default() }).unwrap();
    run_steps(&mut opt, &p, &[vec![1.0, 1.0]]);
    assert_eq!(opt.state_tensors().len(), 3);
    // A checkpoint taken before any step: only step and lr.
    let zero = vec![
        ("step".to_string(), Tensor::scalar(0.0, kiln_tensor::DType::F64, Device::Cpu).unwrap()),
        ("lr".to_string(), Tensor::scalar(0.25, kiln_tensor::DType::F64, Device::Cpu).unwrap()),
    ];
    opt.load_state_tensors(&zero).unwrap();
    assert_eq!(opt.state_tensors().len(), 2);
    assert_eq!(opt.lr(), 0.25);
    // The momentum buffer starts again from the gradient, as on a first step.
    run_steps(&mut opt, &p, &[vec![1.0, -1.0]]);
    assert_close(&values(&opt.state_tensors()[2].1), &[1.0, -1.0], 0.0);
}

#[test]
fn malformed_or_missing_files_are_clear_errors() {
    let mut opt = Adam::new(vec![param(&[1.0])], AdamConfig::default()).unwrap();
    let path = temp_path("garbage");
    std::fs::write(&path, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all").unwrap();
    let e = load_state(&mut opt, &path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(e, Error::Format { .. }), "{e}");
    std::fs::write(&path, b"abc").unwrap();
    assert!(matches!(load_state(&mut opt, &path).unwrap_err(), Error::Format { .. }));
    std::fs::remove_file(&path).unwrap();
    let e = load_state(&mut opt, &temp_path("does_not_exist")).unwrap_err();
    assert!(matches!(e, Error::Io(_)), "{e}");
}

// ---------------------------------------------------------------- fused vs primitive path

/// A tracer that records nothing: its presence makes Adam take the primitive-op path.
struct Quiet;
impl kiln_tensor::Tracer for Quiet {
    fn record(&self, _: &kiln_tensor::Op, _: &[&Tensor], _: &Tensor) {}
    fn host_read(&self, _: &'static str, _: &Tensor) -> kiln_tensor::Result<()> {
        Ok(())
    }
}

/// The one-pass eager kernel and the primitive ops a compiled step sees agree, for Adam,
/// AdamW and AMSGrad, in f32 over a parameter large enough to take the parallel path.
#[test]
fn fused_adam_matches_the_primitive_path() {
    for (decoupled, amsgrad) in [(false, false), (true, false), (true, true)] {
        let run = |traced: bool| -> Vec<f32> {
            let n = 300_000;
            let p = Tensor::rand_at(&[n], kiln_tensor::Distribution::Normal, 5, 0, kiln_tensor::DType::F32, Device::Cpu).unwrap();
            p.set_requires_grad(true);
            let cfg = AdamConfig { lr: 1e-2, weight_decay: 0.1, amsgrad, ..AdamConfig::default() };
            let mut opt: Box<dyn Optimizer> = if decoupled {
                Box::new(AdamW::new(vec![p.clone()], cfg).unwrap())
            } else {
                Box::new(Adam::new(vec![p.clone()], cfg).unwrap())
            };
            for step in 0..3u64 {
                let g = Tensor::rand_at(&[n], kiln_tensor::Distribution::Normal, 6, step * n as u64, kiln_tensor::DType::F32, Device::Cpu)
                    .unwrap();
                p.set_grad(Some(g));
                if traced {
                    kiln_tensor::set_tracer(Some(std::rc::Rc::new(Quiet)));
                }
                opt.step().unwrap();
                kiln_tensor::set_tracer(None);
            }
            p.to_vec::<f32>().unwrap()
        };
        let (fused, primitive) = (run(false), run(true));
        // f32 rounding differs between one fused expression and separate passes.
        let worst = fused.iter().zip(&primitive).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0.0f32, f32::max);
        assert!(worst < 1e-6, "decoupled {decoupled} amsgrad {amsgrad}: max difference {worst}");
        assert_ne!(fused, run_initial(), "the parameters moved");
    }
}

fn run_initial() -> Vec<f32> {
    Tensor::rand_at(&[300_000], kiln_tensor::Distribution::Normal, 5, 0, kiln_tensor::DType::F32, Device::Cpu)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// Weight-decay groups update each parameter exactly as an optimizer of its group's decay
/// alone would (the step count and lr are shared, as in PyTorch's one optimizer).
#[test]
fn weight_decay_groups_match_one_optimizer_per_group() {
    let grads = [[0.5, -1.0, 0.25, 2.0], [1.5, 0.5, -0.5, 1.0]];
    for decoupled in [false, true] {
        let make = |params: Vec<(Vec<Tensor>, f64)>| -> Box<dyn Optimizer> {
            let cfg = AdamConfig { lr: 0.1, ..AdamConfig::default() };
            if decoupled {
                Box::new(AdamW::with_groups(params, cfg).unwrap())
            } else {
                Box::new(Adam::with_groups(params, cfg).unwrap())
            }
        };
        let (w, b) = (param(&[1.0, -2.0, 0.5, 3.0]), param(&[0.25, -0.75]));
        let (w1, b1) = (param(&[1.0, -2.0, 0.5, 3.0]), param(&[0.25, -0.75]));
        let mut grouped = make(vec![(vec![w.clone()], 0.3), (vec![b.clone()], 0.0)]);
        let (mut only_w, mut only_b) = (make(vec![(vec![w1.clone()], 0.3)]), make(vec![(vec![b1.clone()], 0.0)]));
        for g in grads {
            for (p, q) in [(&w, &w1), (&b, &b1)] {
                let n = p.numel();
                set_grad(p, &g[..n]);
                set_grad(q, &g[..n]);
            }
            grouped.step().unwrap();
            only_w.step().unwrap();
            only_b.step().unwrap();
        }
        assert_eq!(values(&w), values(&w1), "decoupled {decoupled}: the decayed group");
        assert_eq!(values(&b), values(&b1), "decoupled {decoupled}: the group without decay");
        assert_ne!(values(&w), values(&param(&[1.0, -2.0, 0.5, 3.0])));
    }
    let (decayed, rest) =
        split_for_weight_decay(vec![param(&[1.0]), Tensor::zeros(&[2, 2], kiln_tensor::DType::F64, Device::Cpu).unwrap()]);
    assert_eq!((decayed.len(), rest.len()), (1, 1));
    assert_eq!(decayed[0].shape(), &[2, 2]);
    assert!(AdamW::with_groups(vec![(vec![param(&[1.0])], -0.1)], AdamConfig::adamw()).is_err());
}

/// `ReduceLROnPlateau` traced by hand (patience 2, cooldown 1, factor 0.5, min_lr 0.3): losses
/// 1.0 (best), 0.99995 (within the 1e-4 threshold: bad), 1.2, 1.1 (three bad: cut to 0.5 and
/// cool down), 1.3 (cooling: counts nothing), 1.3, 1.3, 1.3 (three bad: 0.5 to the floor 0.3),
/// then 0.5 (better), and more bad calls at the floor change nothing.
#[test]
fn reduce_lr_on_plateau_by_hand() {
    let mut opt = SGD::new(vec![param(&[0.0])], SgdConfig { lr: 1.0, ..Default::default() }).unwrap();
    let mut s = ReduceLROnPlateau::new(PlateauMode::Min);
    (s.factor, s.patience, s.cooldown, s.min_lr) = (0.5, 2, 1, 0.3);
    let losses = [1.0, 0.99995, 1.2, 1.1, 1.3, 1.3, 1.3, 1.3, 0.5, 0.9, 0.9, 0.9, 0.9];
    let mut lrs = Vec::new();
    let mut cuts = Vec::new();
    for l in losses {
        cuts.push(s.step_with(l, &mut opt).unwrap());
        lrs.push(opt.lr());
    }
    assert_eq!(lrs, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]);
    assert_eq!(cuts.iter().filter(|&&c| c).count(), 2);
    let mut up = ReduceLROnPlateau::new(PlateauMode::Max);
    up.patience = 0;
    assert!(!up.step_with(0.5, &mut opt).unwrap() && up.step_with(0.4, &mut opt).unwrap(), "accuracy falling: cut at once");
    assert!((opt.lr() - 0.03).abs() < 1e-12);
}

/// Runs an optimizer `make` builds over one parameter starting at [1, -3] through `grads`,
/// checks each element against `reference(start, its gradients)`, and returns the names of
/// the optimizer's state.
fn check_two_weights<O: Optimizer>(
    make: impl FnOnce(Vec<Tensor>) -> O,
    grads: &[[f64; 2]],
    reference: impl Fn(f64, &[f64]) -> f64,
) -> Vec<String> {
    let p = param(&[1.0, -3.0]);
    let mut opt = make(vec![p.clone()]);
    for g in grads {
        set_grad(&p, g);
        opt.step().unwrap();
    }
    let want: Vec<f64> = (0..2).map(|k| reference([1.0, -3.0][k], &grads.iter().map(|g| g[k]).collect::<Vec<_>>())).collect();
    assert_close(&values(&p), &want, 1e-12);
    opt.state_tensors().into_iter().map(|(n, _)| n).collect()
}

/// RMSprop against a scalar f64 re-implementation of `torch.optim.RMSprop`'s formula, plain
/// and with weight decay, momentum and centring together, three steps of changing gradients.
#[test]
fn rmsprop_matches_pytorchs_formula() {
    let reference = |cfg: RmsPropConfig, p0: f64, grads: &[f64]| -> f64 {
        let (mut p, mut s, mut a, mut buf) = (p0, 0.0, 0.0, 0.0);
        for &g in grads {
            let g = g + cfg.weight_decay * p;
            s = cfg.alpha * s + (1.0 - cfg.alpha) * g * g;
            let var = if cfg.centered {
                a = cfg.alpha * a + (1.0 - cfg.alpha) * g;
                s - a * a
            } else {
                s
            };
            let d = g / (var.sqrt() + cfg.eps);
            let d = if cfg.momentum > 0.0 {
                buf = cfg.momentum * buf + d;
                buf
            } else {
                d
            };
            p -= cfg.lr * d;
        }
        p
    };
    let grads = [[0.5, -2.0], [0.25, 1.0], [-1.0, 0.5]];
    let full = RmsPropConfig { lr: 0.05, alpha: 0.9, eps: 1e-6, weight_decay: 0.1, momentum: 0.5, centered: true };
    for cfg in [RmsPropConfig::default(), full] {
        let names = check_two_weights(|p| RmsProp::new(p, cfg).unwrap(), &grads, |p0, g| reference(cfg, p0, g));
        assert!(names.contains(&"state.0.square_avg".to_string()), "{names:?}");
        assert_eq!(names.contains(&"state.0.grad_avg".to_string()), cfg.centered);
    }
    assert!(RmsProp::new(vec![param(&[1.0])], RmsPropConfig { alpha: -0.5, ..RmsPropConfig::default() }).is_err());
}

/// Adagrad against a scalar f64 re-implementation of `torch.optim.Adagrad`'s formula, plain
/// and with lr decay, weight decay and a starting accumulator together.
#[test]
fn adagrad_matches_pytorchs_formula() {
    let reference = |cfg: AdagradConfig, p0: f64, grads: &[f64]| -> f64 {
        let (mut p, mut sum) = (p0, cfg.initial_accumulator_value);
        for (t, &g) in grads.iter().enumerate() {
            let g = g + cfg.weight_decay * p;
            let clr = cfg.lr / (1.0 + t as f64 * cfg.lr_decay);
            sum += g * g;
            p -= clr * g / (sum.sqrt() + cfg.eps);
        }
        p
    };
    let grads = [[0.5, -2.0], [0.25, 1.0], [-1.0, 0.5]];
    let full = AdagradConfig { lr: 0.1, lr_decay: 0.5, weight_decay: 0.1, initial_accumulator_value: 0.25, eps: 1e-6 };
    for cfg in [AdagradConfig::default(), full] {
        let names = check_two_weights(|p| Adagrad::new(p, cfg).unwrap(), &grads, |p0, g| reference(cfg, p0, g));
        assert!(names.contains(&"state.0.sum".to_string()), "{names:?}");
    }
    let e = Adagrad::new(vec![param(&[1.0])], AdagradConfig { lr_decay: -1.0, ..AdagradConfig::default() }).err().unwrap().to_string();
    assert!(e.contains("lr_decay"), "{e}");
}

/// Lion against its published update, with and without decoupled weight decay: each step
/// moves every weight by exactly lr (plus the decay).
#[test]
fn lion_matches_its_published_update() {
    let reference = |cfg: LionConfig, p0: f64, grads: &[f64]| -> f64 {
        let (mut p, mut m) = (p0, 0.0f64);
        for &g in grads {
            p *= 1.0 - cfg.lr * cfg.weight_decay;
            let c = cfg.betas.0 * m + (1.0 - cfg.betas.0) * g;
            p -= cfg.lr
                * if c > 0.0 {
                    1.0
                } else if c < 0.0 {
                    -1.0
                } else {
                    0.0
                };
            m = cfg.betas.1 * m + (1.0 - cfg.betas.1) * g;
        }
        p
    };
    let grads = [[0.5, -2.0], [0.25, 1.0], [-10.0, 0.5], [0.0, 0.0]];
    for cfg in [LionConfig { lr: 0.1, ..LionConfig::default() }, LionConfig { lr: 0.01, betas: (0.5, 0.9), weight_decay: 2.0 }] {
        let names = check_two_weights(|p| Lion::new(p, cfg).unwrap(), &grads, |p0, g| reference(cfg, p0, g));
        assert_eq!(names, ["step", "lr", "state.0.exp_avg"]);
    }
    // Plain Lion moves by exactly lr a step: 1 - 0.1 - 0.1 + 0.1 + 0.1 (the last gradient is
    // zero, but momentum remembers the third).
    let p = param(&[1.0]);
    let mut opt = Lion::new(vec![p.clone()], LionConfig { lr: 0.1, ..LionConfig::default() }).unwrap();
    for g in [0.5, 0.25, -10.0, 0.0] {
        set_grad(&p, &[g]);
        opt.step().unwrap();
    }
    assert_close(&values(&p), &[1.0], 1e-12);
    assert!(Lion::new(vec![param(&[1.0])], LionConfig { betas: (1.5, 0.9), ..LionConfig::default() }).is_err());
}
