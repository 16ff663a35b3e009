//! Adagrad (`torch.optim.Adagrad`) and Lion (Chen et al. 2023, "Symbolic Discovery of
//! Optimization Algorithms"; the form of the `lion-pytorch` package).

use crate::common::{cast, ensure, impl_optimizer, with_l2, Core, PerGroup};
use kiln_tensor::{DType, Result, Tensor};

/// `torch.optim.Adagrad`'s hyperparameters (its defaults in `Default`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdagradConfig {
    pub lr: f64,
    pub lr_decay: f64,
    pub weight_decay: f64,
    pub initial_accumulator_value: f64,
    pub eps: f64,
}

impl Default for AdagradConfig {
    fn default() -> Self {
        AdagradConfig { lr: 1e-2, lr_decay: 0.0, weight_decay: 0.0, initial_accumulator_value: 0.0, eps: 1e-10 }
    }
}

/// `g += wd * p; sum += g^2; p -= lr / (1 + (step - 1) lr_decay) * g / (sqrt(sum) + eps)`.
pub struct Adagrad {
    core: Core,
    cfg: AdagradConfig,
}

impl Adagrad {
    pub fn new(params: Vec<Tensor>, cfg: AdagradConfig) -> Result<Adagrad> {
        let what = "Adagrad";
        ensure(cfg.lr_decay >= 0.0, what, || format!("invalid lr_decay value: {}", cfg.lr_decay))?;
        ensure(cfg.weight_decay >= 0.0, what, || format!("invalid weight_decay value: {}", cfg.weight_decay))?;
        ensure(cfg.initial_accumulator_value >= 0.0, what, || {
            format!("invalid initial_accumulator_value value: {}", cfg.initial_accumulator_value)
        })?;
        ensure(cfg.eps >= 0.0, what, || format!("invalid epsilon value: {}", cfg.eps))?;
        let core = Core { init: cfg.initial_accumulator_value, ..Core::new(what, params, cfg.lr, vec!["sum"])? };
        Ok(Adagrad { core, cfg })
    }

    pub fn config(&self) -> &AdagradConfig {
        &self.cfg
    }

    fn update(&mut self) -> Result<()> {
        let c = self.cfg;
        let grads = self.core.begin_step()?;
        let mut clrs = PerGroup::new();
        for (i, g) in grads {
            let p = self.core.params[i].clone();
            // The decayed lr from the step and lr tensors (a traced step keeps reading them),
            // in f64 and cast where it meets the parameter.
            let clr = clrs.get(&p, |dtype, device| {
                let decay = cast(&self.core.step, DType::F64, device)?.sub_scalar(1.0)?.mul_scalar(c.lr_decay)?.add_scalar(1.0)?;
                cast(&self.core.lr, DType::F64, device)?.div(&decay)?.to_dtype(dtype)
            })?;
            let g = if c.weight_decay != 0.0 { with_l2(&p, &g, c.weight_decay)? } else { g };
            let (bufs, _) = self.core.buffers(i)?;
            let sum = &bufs[0];
            sum.add_(&g.square()?)?;
            let d = g.div(&sum.sqrt()?.add_scalar(c.eps)?)?;
            d.mul_(&clr)?;
            p.sub_(&d)?;
        }
        Ok(())
    }
}

impl_optimizer!(Adagrad);

/// Lion's hyperparameters (`lion-pytorch`'s defaults in `Default`; its authors suggest an lr
/// 3-10x smaller than AdamW's and a weight decay 3-10x larger).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub weight_decay: f64,
}

impl Default for LionConfig {
    fn default() -> Self {
        LionConfig { lr: 1e-4, betas: (0.9, 0.99), weight_decay: 0.0 }
    }
}

/// `p *= 1 - lr wd; p -= lr sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g`: every step
/// moves each weight by the same amount, one buffer per parameter.
pub struct Lion {
    core: Core,
    cfg: LionConfig,
}

impl Lion {
    pub fn new(params: Vec<Tensor>, cfg: LionConfig) -> Result<Lion> {
        let (b1, b2) = cfg.betas;
        let what = "Lion";
        ensure((0.0..=1.0).contains(&b1), what, || format!("invalid beta parameter at index 0: {b1} (must be in [0, 1])"))?;
        ensure((0.0..=1.0).contains(&b2), what, || format!("invalid beta parameter at index 1: {b2} (must be in [0, 1])"))?;
        ensure(cfg.weight_decay >= 0.0, what, || format!("invalid weight_decay value: {}", cfg.weight_decay))?;
        Ok(Lion { core: Core::new(what, params, cfg.lr, vec!["exp_avg"])?, cfg })
    }

    pub fn config(&self) -> &LionConfig {
        &self.cfg
    }

    fn update(&mut self) -> Result<()> {
        let LionConfig { betas: (b1, b2), weight_decay: wd, .. } = self.cfg;
        let grads = self.core.begin_step()?;
        let mut lrs = PerGroup::new();
        for (i, g) in grads {
            let p = self.core.params[i].clone();
            // The lr and the decoupled decay `1 - lr wd` (worked out in f64), once per dtype
            // and device.
            let (lr, decay) = lrs.get(&p, |dtype, device| {
                let lr64 = cast(&self.core.lr, DType::F64, device)?;
                let decay = if wd != 0.0 { Some(lr64.mul_scalar(-wd)?.add_scalar(1.0)?.to_dtype(dtype)?) } else { None };
                Ok((lr64.to_dtype(dtype)?, decay))
            })?;
            let (bufs, _) = self.core.buffers(i)?;
            let m = &bufs[0];
            if let Some(decay) = &decay {
                p.mul_(decay)?;
            }
            let dir = m.mul_scalar(b1)?.add(&g.mul_scalar(1.0 - b1)?)?.sign()?;
            p.sub_(&dir.mul(&lr)?)?;
            m.mul_scalar_(b2)?;
            m.add_(&g.mul_scalar(1.0 - b2)?)?;
        }
        Ok(())
    }
}

impl_optimizer!(Lion);
