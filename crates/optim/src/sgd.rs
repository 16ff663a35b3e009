//! Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay
//! (`torch.optim.SGD`, single-tensor path).

use crate::common::{cast, ensure, impl_optimizer, with_l2, Core, PerGroup};
use kiln_tensor::{Error, Result, Tensor};

/// `torch.optim.SGD`'s hyperparameters (its defaults in `Default`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

/// SGD: `g += wd * p; buf = momentum * buf + (1 - dampening) * g` (the first step starts
/// `buf = g`); `g = nesterov ? g + momentum * buf : buf`; `p -= lr * g`.
#[allow(clippy::upper_case_acronyms)] // PyTorch's name
pub struct SGD {
    core: Core,
    cfg: SgdConfig,
}

impl SGD {
    pub fn new(params: Vec<Tensor>, cfg: SgdConfig) -> Result<SGD> {
        let what = "SGD";
        ensure(cfg.momentum >= 0.0, what, || format!("invalid momentum {}: must be >= 0", cfg.momentum))?;
        ensure(cfg.weight_decay >= 0.0, what, || format!("invalid weight_decay {}: must be >= 0", cfg.weight_decay))?;
        let nesterov_ok = !cfg.nesterov || (cfg.momentum > 0.0 && cfg.dampening == 0.0);
        ensure(nesterov_ok, what, || "nesterov momentum requires a momentum > 0 and zero dampening".into())?;
        let keys = if cfg.momentum != 0.0 { vec!["momentum_buffer"] } else { vec![] };
        Ok(SGD { core: Core::new(what, params, cfg.lr, keys)?, cfg })
    }

    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }

    fn update(&mut self) -> Result<()> {
        let grads = self.core.begin_step()?;
        let mut lrs = PerGroup::new();
        for (i, g) in grads {
            let p = self.core.params[i].clone();
            let lr = lrs.get(&p, |dtype, device| cast(&self.core.lr, dtype, device))?;
            let (d, owned) = self.direction(i, &p, g)?;
            // Scale our own temporary in place rather than allocating another.
            let upd = if owned {
                d.mul_(&lr)?;
                d
            } else {
                d.mul(&lr)?
            };
            p.sub_(&upd)?;
        }
        Ok(())
    }

    /// The direction for parameter `i` (gradient, L2 term, momentum) and whether it is a
    /// temporary of ours (true) or a tensor that must not be changed (the grad or the buffer).
    fn direction(&mut self, i: usize, p: &Tensor, g: Tensor) -> Result<(Tensor, bool)> {
        let c = self.cfg;
        let (g, owned) = if c.weight_decay != 0.0 { (with_l2(p, &g, c.weight_decay)?, true) } else { (g, false) };
        if c.momentum == 0.0 {
            return Ok((g, owned));
        }
        let (bufs, fresh) = self.core.buffers(i)?;
        let buf = &bufs[0];
        // PyTorch starts the buffer at the first gradient, undamped. Without dampening the
        // update below does exactly that from the zero buffer (0 * m + g == g), so a compiled
        // step traced on the first step replays the same rule on later steps. With dampening
        // the first step is a different rule, which a graph cannot replay.
        if fresh && c.dampening != 0.0 {
            if kiln_tensor::is_tracing() {
                return Err(Error::Msg(format!(
                    "SGD: with dampening {} the momentum buffer starts at the first gradient undamped, a first-step rule a compiled step cannot replay; take one eager step before compiling",
                    c.dampening
                )));
            }
            buf.assign(&g)?;
        } else {
            buf.mul_scalar_(c.momentum)?;
            if c.dampening == 0.0 {
                buf.add_(&g)?;
            } else {
                buf.add_(&g.mul_scalar(1.0 - c.dampening)?)?;
            }
        }
        if !c.nesterov {
            return Ok((buf.clone(), false));
        }
        let n = buf.mul_scalar(c.momentum)?;
        n.add_(&g)?;
        Ok((n, true))
    }
}

impl_optimizer!(SGD);
