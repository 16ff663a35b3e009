//! Learning-rate schedules in closed form: `lr_at(t)` is the lr for step `t` (0-based), and
//! `step` moves to the next step and sets the optimizer's lr for it (in place, so a compiled
//! step reads the new value without retracing). Use like PyTorch: `apply` once after creating
//! the scheduler (PyTorch's constructor does this), then `opt.step(); sched.step(&mut opt)`.

use crate::common::ensure;
use crate::optimizer::Optimizer;
use kiln_tensor::{Error, Result};
use std::f64::consts::PI;

/// A schedule of learning rates over steps.
pub trait LrScheduler {
    /// Advances to the next step and sets `opt`'s lr for it.
    fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        let next = self.last_step() + 1;
        opt.set_lr(self.lr_at(next))?;
        self.set_last_step(next);
        Ok(())
    }
    /// The lr for step `step` (0-based).
    fn lr_at(&self, step: usize) -> f64;
    /// The step whose lr is current: 0 after creation, +1 per `step` (PyTorch's `last_epoch`).
    fn last_step(&self) -> usize;
    /// Moves the schedule (to resume from a checkpoint); call `apply` after.
    fn set_last_step(&mut self, s: usize);
    /// Sets `opt`'s lr for the current step.
    fn apply(&self, opt: &mut dyn Optimizer) -> Result<()> {
        opt.set_lr(self.lr_at(self.last_step()))
    }
}

/// `last_step` and `set_last_step` over a `last_step` field.
macro_rules! last_step_field {
    () => {
        fn last_step(&self) -> usize {
            self.last_step
        }
        fn set_last_step(&mut self, s: usize) {
            self.last_step = s;
        }
    };
}

/// `base_lr * gamma^(t / step_size)` (`torch.optim.lr_scheduler.StepLR`).
#[derive(Debug, Clone, PartialEq)]
pub struct StepLR {
    base_lr: f64,
    step_size: usize,
    gamma: f64,
    last_step: usize,
}

impl StepLR {
    pub fn new(base_lr: f64, step_size: usize, gamma: f64) -> Result<StepLR> {
        ensure(step_size > 0, "StepLR", || "step_size must be positive".into())?;
        Ok(StepLR { base_lr, step_size, gamma, last_step: 0 })
    }
}

impl LrScheduler for StepLR {
    fn lr_at(&self, step: usize) -> f64 {
        self.base_lr * self.gamma.powf((step / self.step_size) as f64)
    }
    last_step_field!();
}

/// `eta_min + (base_lr - eta_min) * (1 + cos(pi * t / t_max)) / 2`
/// (`torch.optim.lr_scheduler.CosineAnnealingLR`'s closed form; past `t_max` the cosine goes
/// on, as there).
#[derive(Debug, Clone, PartialEq)]
pub struct CosineAnnealingLR {
    base_lr: f64,
    t_max: usize,
    eta_min: f64,
    last_step: usize,
}

impl CosineAnnealingLR {
    pub fn new(base_lr: f64, t_max: usize, eta_min: f64) -> Result<CosineAnnealingLR> {
        ensure(t_max > 0, "CosineAnnealingLR", || "t_max must be positive".into())?;
        Ok(CosineAnnealingLR { base_lr, t_max, eta_min, last_step: 0 })
    }
}

impl LrScheduler for CosineAnnealingLR {
    fn lr_at(&self, step: usize) -> f64 {
        cosine(self.base_lr, self.eta_min, step as f64, self.t_max as f64)
    }
    last_step_field!();
}

/// Linear warmup `base_lr * (t + 1) / warmup_steps` for `t < warmup_steps`, then a cosine
/// from `base_lr` down to `min_lr` at `total_steps`, and `min_lr` after.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupCosine {
    base_lr: f64,
    warmup_steps: usize,
    total_steps: usize,
    min_lr: f64,
    last_step: usize,
}

impl WarmupCosine {
    pub fn new(base_lr: f64, warmup_steps: usize, total_steps: usize, min_lr: f64) -> Result<WarmupCosine> {
        ensure(warmup_steps < total_steps, "WarmupCosine", || {
            format!("warmup_steps ({warmup_steps}) must be below total_steps ({total_steps})")
        })?;
        Ok(WarmupCosine { base_lr, warmup_steps, total_steps, min_lr, last_step: 0 })
    }
}

impl LrScheduler for WarmupCosine {
    fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.base_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let done = step.min(self.total_steps) - self.warmup_steps;
        cosine(self.base_lr, self.min_lr, done as f64, (self.total_steps - self.warmup_steps) as f64)
    }
    last_step_field!();
}

/// The 1cycle policy (`torch.optim.lr_scheduler.OneCycleLR`, two phases, cosine annealing):
/// from `max_lr / div_factor` up to `max_lr` over the first `pct_start` of the steps, then down
/// to `max_lr / div_factor / final_div_factor` at step `total_steps - 1`. PyTorch also cycles
/// momentum by default; this sets the lr only (`cycle_momentum=False`).
#[derive(Debug, Clone, PartialEq)]
pub struct OneCycleLR {
    max_lr: f64,
    total_steps: usize,
    pct_start: f64,
    div_factor: f64,
    final_div_factor: f64,
    last_step: usize,
}

impl OneCycleLR {
    /// PyTorch's defaults: `pct_start` 0.3, `div_factor` 25, `final_div_factor` 1e4.
    pub fn new(max_lr: f64, total_steps: usize) -> Result<OneCycleLR> {
        OneCycleLR::with_options(max_lr, total_steps, 0.3, 25.0, 1e4)
    }

    pub fn with_options(max_lr: f64, total_steps: usize, pct_start: f64, div_factor: f64, final_div_factor: f64) -> Result<OneCycleLR> {
        let what = "OneCycleLR";
        ensure(total_steps > 0, what, || "total_steps must be positive".into())?;
        ensure((0.0..=1.0).contains(&pct_start), what, || format!("pct_start {pct_start} must be in [0, 1]"))?;
        ensure(div_factor > 0.0 && final_div_factor > 0.0, what, || "div_factor and final_div_factor must be positive".into())?;
        let s = OneCycleLR { max_lr, total_steps, pct_start, div_factor, final_div_factor, last_step: 0 };
        // PyTorch divides by each phase's length and fails on an empty one.
        let (up, total) = (s.warmup_end(), total_steps as f64 - 1.0);
        ensure(up != 0.0 && up != total, what, || {
            format!("pct_start * total_steps = {} leaves a phase of zero length", pct_start * total_steps as f64)
        })?;
        Ok(s)
    }

    /// The (fractional) step where the lr peaks, as PyTorch computes it.
    fn warmup_end(&self) -> f64 {
        self.pct_start * self.total_steps as f64 - 1.0
    }
}

impl LrScheduler for OneCycleLR {
    /// Like PyTorch, stepping past `total_steps` is an error.
    fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        let next = self.last_step + 1;
        if next > self.total_steps {
            return Err(Error::Msg(format!(
                "OneCycleLR: tried to step {next} times; the specified number of total steps is {}",
                self.total_steps
            )));
        }
        opt.set_lr(self.lr_at(next))?;
        self.last_step = next;
        Ok(())
    }
    /// Steps past `total_steps` get the lr of `total_steps`.
    fn lr_at(&self, step: usize) -> f64 {
        let t = step.min(self.total_steps) as f64;
        let initial = self.max_lr / self.div_factor;
        let min = initial / self.final_div_factor;
        let (up, end) = (self.warmup_end(), self.total_steps as f64 - 1.0);
        if t <= up {
            anneal_cos(initial, self.max_lr, t / up)
        } else {
            anneal_cos(self.max_lr, min, (t - up) / (end - up))
        }
    }
    last_step_field!();
}

/// `lo + (hi - lo) * (1 + cos(pi * t / len)) / 2`: `hi` at 0, `lo` at `len` (PyTorch's
/// arithmetic, in its order).
fn cosine(hi: f64, lo: f64, t: f64, len: f64) -> f64 {
    lo + (hi - lo) * (1.0 + (PI * t / len).cos()) / 2.0
}

/// PyTorch's `_annealing_cos`: from `start` at 0 to `end` at 1 (its exact arithmetic).
fn anneal_cos(start: f64, end: f64, pct: f64) -> f64 {
    end + (start - end) / 2.0 * ((PI * pct).cos() + 1.0)
}

/// `base_lr * gamma^t` (`torch.optim.lr_scheduler.ExponentialLR`).
#[derive(Debug, Clone, PartialEq)]
pub struct ExponentialLR {
    base_lr: f64,
    gamma: f64,
    last_step: usize,
}

impl ExponentialLR {
    pub fn new(base_lr: f64, gamma: f64) -> Result<ExponentialLR> {
        ensure(gamma > 0.0, "ExponentialLR", || format!("gamma {gamma} must be positive"))?;
        Ok(ExponentialLR { base_lr, gamma, last_step: 0 })
    }
}

impl LrScheduler for ExponentialLR {
    fn lr_at(&self, step: usize) -> f64 {
        self.base_lr * self.gamma.powf(step as f64)
    }
    last_step_field!();
}

/// `base_lr * gamma^k`, `k` the milestones at or before `t` (`MultiStepLR`; a milestone given
/// twice counts twice, as there).
#[derive(Debug, Clone, PartialEq)]
pub struct MultiStepLR {
    base_lr: f64,
    milestones: Vec<usize>,
    gamma: f64,
    last_step: usize,
}

impl MultiStepLR {
    pub fn new(base_lr: f64, milestones: &[usize], gamma: f64) -> Result<MultiStepLR> {
        let mut milestones = milestones.to_vec();
        milestones.sort_unstable();
        Ok(MultiStepLR { base_lr, milestones, gamma, last_step: 0 })
    }
}

impl LrScheduler for MultiStepLR {
    fn lr_at(&self, step: usize) -> f64 {
        let passed = self.milestones.partition_point(|&m| m <= step);
        self.base_lr * self.gamma.powi(passed as i32)
    }
    last_step_field!();
}

/// `base_lr` times a factor going linearly from `start_factor` to `end_factor` over
/// `total_iters` steps, then held (`torch.optim.lr_scheduler.LinearLR`, whose defaults are
/// 1/3, 1 and 5): the usual linear warmup.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearLR {
    base_lr: f64,
    start_factor: f64,
    end_factor: f64,
    total_iters: usize,
    last_step: usize,
}

impl LinearLR {
    pub fn new(base_lr: f64, start_factor: f64, end_factor: f64, total_iters: usize) -> Result<LinearLR> {
        let what = "LinearLR";
        ensure(start_factor > 0.0 && start_factor <= 1.0, what, || format!("start_factor {start_factor} must be in (0, 1]"))?;
        ensure((0.0..=1.0).contains(&end_factor), what, || format!("end_factor {end_factor} must be in [0, 1]"))?;
        ensure(total_iters > 0, what, || "total_iters must be positive".into())?;
        Ok(LinearLR { base_lr, start_factor, end_factor, total_iters, last_step: 0 })
    }
}

impl LrScheduler for LinearLR {
    fn lr_at(&self, step: usize) -> f64 {
        let done = step.min(self.total_iters) as f64 / self.total_iters as f64;
        self.base_lr * (self.start_factor + (self.end_factor - self.start_factor) * done)
    }
    last_step_field!();
}

/// Whether a smaller or a larger metric is better (`ReduceLROnPlateau`'s `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlateauMode {
    Min,
    Max,
}

/// `torch.optim.lr_scheduler.ReduceLROnPlateau` (relative threshold): after more than
/// `patience` calls without a metric better than the best by `threshold` (relative), the lr
/// is multiplied by `factor` (not below `min_lr`), then `cooldown` calls pass before bad calls
/// count again. It reads a metric, so it steps with `step_with(metric, opt)`, not through
/// `LrScheduler`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceLROnPlateau {
    pub mode: PlateauMode,
    pub factor: f64,
    pub patience: usize,
    pub threshold: f64,
    pub cooldown: usize,
    pub min_lr: f64,
    best: f64,
    bad: usize,
    cooling: usize,
}

impl ReduceLROnPlateau {
    /// PyTorch's defaults: factor 0.1, patience 10, threshold 1e-4, cooldown 0, min_lr 0.
    pub fn new(mode: PlateauMode) -> ReduceLROnPlateau {
        let best = if mode == PlateauMode::Min { f64::INFINITY } else { f64::NEG_INFINITY };
        ReduceLROnPlateau { mode, factor: 0.1, patience: 10, threshold: 1e-4, cooldown: 0, min_lr: 0.0, best, bad: 0, cooling: 0 }
    }

    /// Takes this epoch's metric and lowers `opt`'s lr on a plateau; returns whether it did.
    pub fn step_with(&mut self, metric: f64, opt: &mut dyn Optimizer) -> Result<bool> {
        ensure(self.factor < 1.0 && self.factor >= 0.0, "ReduceLROnPlateau", || format!("factor {} must be in [0, 1)", self.factor))?;
        let better = match self.mode {
            PlateauMode::Min => metric < self.best * (1.0 - self.threshold),
            PlateauMode::Max => metric > self.best * (1.0 + self.threshold),
        };
        if better {
            self.best = metric;
            self.bad = 0;
        } else {
            self.bad += 1;
        }
        if self.cooling > 0 {
            self.cooling -= 1;
            self.bad = 0;
        }
        if self.bad <= self.patience {
            return Ok(false);
        }
        self.cooling = self.cooldown;
        self.bad = 0;
        let (old, new) = (opt.lr(), (opt.lr() * self.factor).max(self.min_lr));
        // PyTorch skips changes smaller than its eps (1e-8).
        if old - new <= 1e-8 {
            return Ok(false);
        }
        opt.set_lr(new)?;
        Ok(true)
    }
}

/// `base_lr * f(t)` for any `f` (`torch.optim.lr_scheduler.LambdaLR`).
pub struct LambdaLR {
    base_lr: f64,
    f: Box<dyn Fn(usize) -> f64>,
    last_step: usize,
}

impl LambdaLR {
    pub fn new(base_lr: f64, f: impl Fn(usize) -> f64 + 'static) -> LambdaLR {
        LambdaLR { base_lr, f: Box::new(f), last_step: 0 }
    }
}

impl LrScheduler for LambdaLR {
    fn lr_at(&self, step: usize) -> f64 {
        self.base_lr * (self.f)(step)
    }
    last_step_field!();
}

/// `base_lr * (1 - min(t, total_iters) / total_iters)^power`
/// (`torch.optim.lr_scheduler.PolynomialLR`): 0 from `total_iters` on.
#[derive(Debug, Clone, PartialEq)]
pub struct PolynomialLR {
    base_lr: f64,
    total_iters: usize,
    power: f64,
    last_step: usize,
}

impl PolynomialLR {
    pub fn new(base_lr: f64, total_iters: usize, power: f64) -> Result<PolynomialLR> {
        ensure(total_iters > 0, "PolynomialLR", || "total_iters must be positive".into())?;
        ensure(power >= 0.0, "PolynomialLR", || format!("power {power} must be non-negative"))?;
        Ok(PolynomialLR { base_lr, total_iters, power, last_step: 0 })
    }
}

impl LrScheduler for PolynomialLR {
    fn lr_at(&self, step: usize) -> f64 {
        let left = 1.0 - step.min(self.total_iters) as f64 / self.total_iters as f64;
        self.base_lr * left.powf(self.power)
    }
    last_step_field!();
}

/// Cosine annealing from `base_lr` to `eta_min` over cycles of `t_0`, `t_0 * t_mult`, ...
/// steps, restarting at `base_lr` after each (SGDR;
/// `torch.optim.lr_scheduler.CosineAnnealingWarmRestarts`).
#[derive(Debug, Clone, PartialEq)]
pub struct CosineAnnealingWarmRestarts {
    base_lr: f64,
    t_0: usize,
    t_mult: usize,
    eta_min: f64,
    last_step: usize,
}

impl CosineAnnealingWarmRestarts {
    pub fn new(base_lr: f64, t_0: usize, t_mult: usize, eta_min: f64) -> Result<CosineAnnealingWarmRestarts> {
        ensure(t_0 > 0 && t_mult > 0, "CosineAnnealingWarmRestarts", || format!("t_0 {t_0} and t_mult {t_mult} must be positive"))?;
        Ok(CosineAnnealingWarmRestarts { base_lr, t_0, t_mult, eta_min, last_step: 0 })
    }
}

impl LrScheduler for CosineAnnealingWarmRestarts {
    fn lr_at(&self, step: usize) -> f64 {
        // The step within its cycle, cycles counted off exactly (no float logarithm).
        let (mut t_cur, mut t_i) = (if self.t_mult == 1 { step % self.t_0 } else { step }, self.t_0);
        while t_cur >= t_i {
            t_cur -= t_i;
            t_i = t_i.saturating_mul(self.t_mult);
        }
        self.eta_min + (self.base_lr - self.eta_min) * (1.0 + (PI * t_cur as f64 / t_i as f64).cos()) / 2.0
    }
    last_step_field!();
}
