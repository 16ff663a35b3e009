//! RMSprop (`torch.optim.RMSprop`, single-tensor path): a running average of squared
//! gradients scales each step, optionally centred by the running average of gradients, with
//! optional momentum and L2 weight decay.

use crate::common::{cast, ensure, impl_optimizer, with_l2, Core, PerGroup};
use kiln_tensor::{Result, Tensor};

/// `torch.optim.RMSprop`'s hyperparameters (its defaults in `Default`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsPropConfig {
    pub lr: f64,
    pub alpha: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub centered: bool,
}

impl Default for RmsPropConfig {
    fn default() -> Self {
        RmsPropConfig { lr: 1e-2, alpha: 0.99, eps: 1e-8, weight_decay: 0.0, momentum: 0.0, centered: false }
    }
}

/// `g += wd * p; s = alpha * s + (1 - alpha) * g^2`; centred, `a = alpha * a + (1 - alpha) * g`
/// and `s - a^2` in place of `s`; `d = g / (sqrt(s) + eps)`; with momentum
/// `buf = momentum * buf + d` and `d = buf`; `p -= lr * d`.
pub struct RmsProp {
    core: Core,
    cfg: RmsPropConfig,
}

impl RmsProp {
    pub fn new(params: Vec<Tensor>, cfg: RmsPropConfig) -> Result<RmsProp> {
        let what = "RMSprop";
        ensure(cfg.eps >= 0.0, what, || format!("invalid epsilon {}: must be >= 0", cfg.eps))?;
        ensure(cfg.alpha >= 0.0, what, || format!("invalid alpha {}: must be >= 0", cfg.alpha))?;
        ensure(cfg.momentum >= 0.0, what, || format!("invalid momentum {}: must be >= 0", cfg.momentum))?;
        ensure(cfg.weight_decay >= 0.0, what, || format!("invalid weight_decay {}: must be >= 0", cfg.weight_decay))?;
        let mut keys = vec!["square_avg"];
        if cfg.momentum > 0.0 {
            keys.push("momentum_buffer");
        }
        if cfg.centered {
            keys.push("grad_avg");
        }
        Ok(RmsProp { core: Core::new(what, params, cfg.lr, keys)?, cfg })
    }

    pub fn config(&self) -> &RmsPropConfig {
        &self.cfg
    }

    fn update(&mut self) -> Result<()> {
        let c = self.cfg;
        let grads = self.core.begin_step()?;
        let mut lrs = PerGroup::new();
        for (i, g) in grads {
            let p = self.core.params[i].clone();
            let lr = lrs.get(&p, |dtype, device| cast(&self.core.lr, dtype, device))?;
            let g = if c.weight_decay != 0.0 { with_l2(&p, &g, c.weight_decay)? } else { g };
            let (bufs, _) = self.core.buffers(i)?;
            let square_avg = &bufs[0];
            square_avg.mul_scalar_(c.alpha)?;
            square_avg.add_(&g.square()?.mul_scalar(1.0 - c.alpha)?)?;
            let var = if c.centered {
                let grad_avg = bufs.last().expect("centred keeps grad_avg last");
                grad_avg.mul_scalar_(c.alpha)?;
                grad_avg.add_(&g.mul_scalar(1.0 - c.alpha)?)?;
                square_avg.sub(&grad_avg.square()?)?
            } else {
                square_avg.clone()
            };
            let denom = var.sqrt()?.add_scalar(c.eps)?;
            let d = if c.momentum > 0.0 {
                let buf = &bufs[1];
                buf.mul_scalar_(c.momentum)?;
                buf.add_(&g.div(&denom)?)?;
                buf.mul(&lr)?
            } else {
                let d = g.div(&denom)?;
                d.mul_(&lr)?;
                d
            };
            p.sub_(&d)?;
        }
        Ok(())
    }
}

impl_optimizer!(RmsProp);
