//! Dynamic loss scaling for F16 training (`torch.amp.GradScaler`). F16 gradients below 2^-24
//! flush to zero; scaling the loss by `S` before `backward` keeps them representable, and
//! the gradients are divided by `S` again before the optimizer reads them. A step whose
//! gradients hold an infinity or NaN (the scale was too large) is skipped and `S` backs off;
//! after `growth_interval` clean steps in a row `S` grows.
//!
//! As in PyTorch, `step` reads one flag on the host (whether any gradient was non-finite), so
//! a compiled step that calls it runs eagerly (a graph break). `scale` reads nothing: a
//! compiled forward and backward may call it, with `step` and `update` outside.

use crate::optimizer::Optimizer;
use kiln_tensor::{no_grad, DType, Device, Error, Result, Tensor, TensorId};
use std::collections::HashMap;

/// `torch.amp.GradScaler`'s settings, with its defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// Off, every method passes through: `scale` returns the loss, `step` steps.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, enabled: true }
    }
}

/// What one optimizer did since the last `update`.
#[derive(Debug, Clone, Copy, Default)]
struct Stage {
    found_inf: bool,
    stepped: bool,
}

/// Dynamic loss scaling: `scaler.scale(&loss)?.backward()?; scaler.step(&mut opt)?;
/// scaler.update()?;` (and `unscale_` before clipping the true gradients).
#[derive(Debug)]
pub struct GradScaler {
    cfg: GradScalerConfig,
    scale: f64,
    /// Clean steps in a row since the scale last changed.
    growth_tracker: usize,
    /// The scale the loss is multiplied by: a 0-dim F32 tensor made up front and changed in
    /// place, so a compiled forward and backward read it as state rather than baking it in.
    scale_t: Tensor,
    /// Per optimizer (by its first parameter), what it did this step.
    stages: HashMap<TensorId, Stage>,
}

impl GradScaler {
    /// A scaler for losses on `device` (`torch.amp.GradScaler(device)`).
    pub fn new(device: Device, cfg: GradScalerConfig) -> Result<GradScaler> {
        let ok = cfg.growth_factor > 1.0 && cfg.backoff_factor > 0.0 && cfg.backoff_factor < 1.0 && cfg.growth_interval > 0;
        let Some(scale) = f32_scale(cfg.init_scale).filter(|_| ok) else {
            return Err(Error::Msg(format!(
                "GradScaler: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval > 0; got {cfg:?}"
            )));
        };
        let scale_t = Tensor::scalar(scale, DType::F32, device)?;
        Ok(GradScaler { cfg, scale, growth_tracker: 0, scale_t, stages: HashMap::new() })
    }

    /// The loss times the current scale (the loss itself when disabled).
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.cfg.enabled {
            return Ok(loss.clone());
        }
        if loss.device() != self.scale_t.device() {
            return Err(Error::Msg(format!(
                "GradScaler: the loss is on {:?} but the scaler was made for {:?}",
                loss.device(),
                self.scale_t.device()
            )));
        }
        // In F32 at least, as PyTorch's promotion does: a 16-bit loss times 65536 overflows.
        let wide = if loss.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        loss.to_dtype(wide)?.mul(&self.scale_t.to_dtype(wide)?)
    }

    /// Divides `opt`'s gradients by the scale in place and notes whether any is non-finite
    /// (one host read). Call it before clipping so the clip sees the true gradients; `step`
    /// then does not divide again. An error if called twice between updates.
    pub fn unscale_(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        let key = optimizer_key(opt)?;
        match self.stages.get(&key) {
            Some(Stage { stepped: true, .. }) => return Err(Error::Msg("GradScaler: unscale_() is being called after step()".into())),
            Some(_) => {
                return Err(Error::Msg("GradScaler: unscale_() was already called on this optimizer since the last update()".into()))
            }
            None => {}
        }
        // PyTorch refuses too: F16 gradients unscaled in F16 flush to zero again.
        if let Some((i, _)) = opt.params().iter().enumerate().find(|(_, p)| p.grad().is_some_and(|g| g.dtype() == DType::F16)) {
            return Err(Error::dtype(
                "GradScaler",
                format!("parameter {i} has an F16 gradient; keep parameters in F32 (autocast computes in F16) to unscale their gradients"),
            ));
        }
        let found_inf = no_grad(|| unscale_grads(opt.params(), 1.0 / self.scale))?;
        self.stages.insert(key, Stage { found_inf, stepped: false });
        Ok(())
    }

    /// Unscales (unless `unscale_` did) and steps `opt` if every gradient is finite. Returns
    /// whether the step was taken (a skipped step changes neither parameters nor state).
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<bool> {
        if !self.cfg.enabled {
            opt.step()?;
            return Ok(true);
        }
        let key = optimizer_key(opt)?;
        if !self.stages.contains_key(&key) {
            self.unscale_(opt)?;
        }
        let stage = self.stages[&key];
        if stage.stepped {
            return Err(Error::Msg("GradScaler: step() was already called on this optimizer since the last update()".into()));
        }
        let taken = !stage.found_inf;
        if taken {
            opt.step()?;
        }
        self.stages.insert(key, Stage { stepped: true, ..stage });
        Ok(taken)
    }

    /// Backs the scale off if any optimizer met a non-finite gradient this step, else counts a
    /// clean step and grows the scale after `growth_interval` of them. An error when no
    /// optimizer was unscaled or stepped since the last update.
    pub fn update(&mut self) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        if self.stages.is_empty() {
            return Err(Error::Msg("GradScaler: update() without unscale_() or step() since the last update()".into()));
        }
        let found_inf = self.stages.drain().any(|(_, s)| s.found_inf);
        let (scale, tracker) = next_scale(&self.cfg, self.scale, self.growth_tracker, found_inf);
        self.set_state(scale, tracker)
    }

    /// The current scale (`get_scale`).
    pub fn current_scale(&self) -> f64 {
        if self.cfg.enabled {
            self.scale
        } else {
            1.0
        }
    }

    /// The scale and the count of clean steps in a row: what a checkpoint keeps.
    pub fn state(&self) -> (f64, usize) {
        (self.scale, self.growth_tracker)
    }

    /// Restores what `state` returned.
    pub fn set_state(&mut self, scale: f64, growth_tracker: usize) -> Result<()> {
        let Some(scale) = f32_scale(scale) else {
            return Err(Error::Msg(format!("GradScaler: a scale must be positive and finite in F32, got {scale}")));
        };
        self.scale = scale;
        self.growth_tracker = growth_tracker;
        self.scale_t.fill_(scale)
    }
}

/// `scale` as the F32 the loss is multiplied by, if it is positive and finite there.
fn f32_scale(scale: f64) -> Option<f64> {
    let f = scale as f32;
    (f.is_finite() && f > 0.0).then_some(f as f64)
}

/// Steps are keyed by an optimizer's first parameter (an optimizer without any has nothing
/// to scale).
fn optimizer_key(opt: &dyn Optimizer) -> Result<TensorId> {
    opt.params().first().map(Tensor::id).ok_or_else(|| Error::Msg("GradScaler: the optimizer has no parameters".into()))
}

/// Multiplies every gradient by `inv` in place; returns whether any value is infinite or NaN.
/// `g * 0` is 0 for a finite value and NaN otherwise, so one sum over all of them, read once,
/// says whether any gradient holds a non-finite value.
fn unscale_grads(params: &[Tensor], inv: f64) -> Result<bool> {
    let mut check: Option<(Tensor, Device)> = None;
    for g in params.iter().filter_map(Tensor::grad) {
        g.mul_scalar_(inv)?;
        let zero = g.mul_scalar(0.0)?.sum_all()?.to_dtype(DType::F32)?;
        check = Some(match check {
            Some((acc, device)) => (acc.add(&zero.to_device(device)?)?, device),
            None => (zero, g.device()),
        });
    }
    match check {
        Some((acc, _)) => Ok(acc.item()?.is_nan()),
        None => Ok(false),
    }
}

/// PyTorch's `_amp_update_scale_`: (scale, growth tracker) after a step.
fn next_scale(cfg: &GradScalerConfig, scale: f64, tracker: usize, found_inf: bool) -> (f64, usize) {
    if found_inf {
        return (scale * cfg.backoff_factor, 0);
    }
    // `>=`: a tracker restored from a run with a longer interval still grows.
    if tracker + 1 >= cfg.growth_interval {
        // PyTorch keeps the old scale when growing would overflow F32.
        let grown = scale * cfg.growth_factor;
        return (f32_scale(grown).unwrap_or(scale), 0);
    }
    (scale, tracker + 1)
}
