//! Adam (L2 weight decay added to the gradient) and AdamW (decoupled weight decay), with the
//! AMSGrad option: `torch.optim.Adam` / `AdamW`, single-tensor path.

use crate::common::{cast, ensure, impl_optimizer, with_l2, Core, PerGroup};
use kiln_tensor::fused::{AdamHyper, AdamStep, AdamTensors};
use kiln_tensor::{BinaryOp, DType, Device, Result, Tensor};

/// Adam's and AdamW's hyperparameters. `Default` is Adam's (weight decay 0); `adamw()` is
/// AdamW's (weight decay 1e-2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, amsgrad: false }
    }
}

impl AdamConfig {
    /// `torch.optim.AdamW`'s defaults.
    pub fn adamw() -> Self {
        AdamConfig { weight_decay: 1e-2, ..AdamConfig::default() }
    }
}

/// Adam: `g += wd * p`, then the moment update below.
pub struct Adam {
    core: Core,
    cfg: AdamConfig,
    /// Each parameter's weight decay (`cfg`'s, or its group's).
    decay: Vec<f64>,
}

/// AdamW: `p *= 1 - lr * wd`, then the moment update below, with the raw gradient.
pub struct AdamW {
    core: Core,
    cfg: AdamConfig,
    /// Each parameter's weight decay (`cfg`'s, or its group's).
    decay: Vec<f64>,
}

impl Adam {
    pub fn new(params: Vec<Tensor>, cfg: AdamConfig) -> Result<Adam> {
        Adam::with_groups(vec![(params, cfg.weight_decay)], cfg)
    }
    /// Parameter groups with a weight decay each (PyTorch's `[{"params": .., "weight_decay":
    /// ..}, ..]`); the rest of `cfg` is shared. Parameters are numbered across the groups in
    /// order, as PyTorch numbers their state.
    pub fn with_groups(groups: Vec<(Vec<Tensor>, f64)>, cfg: AdamConfig) -> Result<Adam> {
        let (params, decay) = flatten_groups("Adam", groups)?;
        Ok(Adam { core: new_core("Adam", params, &cfg)?, cfg, decay })
    }
    pub fn config(&self) -> &AdamConfig {
        &self.cfg
    }
    fn update(&mut self) -> Result<()> {
        update(&mut self.core, &self.cfg, &self.decay, false)
    }
}

impl AdamW {
    pub fn new(params: Vec<Tensor>, cfg: AdamConfig) -> Result<AdamW> {
        AdamW::with_groups(vec![(params, cfg.weight_decay)], cfg)
    }
    /// Parameter groups with a weight decay each, as `Adam::with_groups`: typically
    /// `split_for_weight_decay`'s matrices with a decay and the rest with none.
    pub fn with_groups(groups: Vec<(Vec<Tensor>, f64)>, cfg: AdamConfig) -> Result<AdamW> {
        let (params, decay) = flatten_groups("AdamW", groups)?;
        Ok(AdamW { core: new_core("AdamW", params, &cfg)?, cfg, decay })
    }
    pub fn config(&self) -> &AdamConfig {
        &self.cfg
    }
    fn update(&mut self) -> Result<()> {
        update(&mut self.core, &self.cfg, &self.decay, true)
    }
}

/// The groups' parameters in order, and each one's weight decay (checked as PyTorch does).
fn flatten_groups(what: &'static str, groups: Vec<(Vec<Tensor>, f64)>) -> Result<(Vec<Tensor>, Vec<f64>)> {
    let (mut params, mut decay) = (Vec::new(), Vec::new());
    for (ps, wd) in groups {
        ensure(wd >= 0.0, what, || format!("invalid weight_decay {wd}: must be >= 0"))?;
        decay.extend(std::iter::repeat_n(wd, ps.len()));
        params.extend(ps);
    }
    Ok((params, decay))
}

/// nanoGPT's rule: parameters of two or more dims (the weights of products and embeddings)
/// take weight decay; the rest (biases, norms' scales) do not. Returns (decayed, not).
pub fn split_for_weight_decay(params: Vec<Tensor>) -> (Vec<Tensor>, Vec<Tensor>) {
    params.into_iter().partition(|p| p.rank() >= 2)
}

impl_optimizer!(Adam);
impl_optimizer!(AdamW);

/// PyTorch's constructor checks, then the shared state with Adam's buffer names.
fn new_core(what: &'static str, params: Vec<Tensor>, cfg: &AdamConfig) -> Result<Core> {
    let (b1, b2) = cfg.betas;
    ensure(cfg.eps >= 0.0, what, || format!("invalid epsilon {}: must be >= 0", cfg.eps))?;
    ensure((0.0..1.0).contains(&b1), what, || format!("invalid beta parameter at index 0: {b1} (must be in [0, 1))"))?;
    ensure((0.0..1.0).contains(&b2), what, || format!("invalid beta parameter at index 1: {b2} (must be in [0, 1))"))?;
    ensure(cfg.weight_decay >= 0.0, what, || format!("invalid weight_decay {}: must be >= 0", cfg.weight_decay))?;
    let mut keys = vec!["exp_avg", "exp_avg_sq"];
    if cfg.amsgrad {
        keys.push("max_exp_avg_sq");
    }
    Core::new(what, params, cfg.lr, keys)
}

/// This step's 0-dim factors, in the dtype and on the device of a group of parameters.
#[derive(Clone)]
struct Factors {
    /// `lr / (1 - beta1^step)`.
    step_size: Tensor,
    /// `sqrt(1 - beta2^step)`.
    bc2_sqrt: Tensor,
    /// AdamW's `1 - lr * wd` (None for Adam or a zero weight decay).
    decay: Option<Tensor>,
}

/// One step: the gradients, then each weight decay's parameters as a group of their own.
fn update(core: &mut Core, cfg: &AdamConfig, decay: &[f64], decoupled: bool) -> Result<()> {
    let mut grads = core.begin_step()?;
    while let Some(&(first, _)) = grads.first() {
        let wd = decay[first];
        let (group, rest): (Vec<_>, Vec<_>) = grads.into_iter().partition(|(i, _)| decay[*i] == wd);
        update_group(core, &AdamConfig { weight_decay: wd, ..*cfg }, group, decoupled)?;
        grads = rest;
    }
    Ok(())
}

fn update_group(core: &mut Core, cfg: &AdamConfig, grads: Vec<(usize, Tensor)>, decoupled: bool) -> Result<()> {
    let fused = fused_scalars(core, cfg, decoupled)?;
    let mut rest = Vec::new();
    for (i, g) in grads {
        let p = core.params[i].clone();
        let (bufs, _) = core.buffers(i)?;
        // Eager CPU updates take the one-pass kernel; traced or other steps the primitives.
        if let Some(s) = fused {
            if kiln_tensor::fused::adam_step_(&p, &g, &bufs[0], &bufs[1], bufs.get(2), s)? {
                continue;
            }
        }
        rest.push((p, g, bufs));
    }
    // On a GPU the fused kernel updates many parameters per launch and reads lr and step
    // there (no host read).
    let hyper = AdamHyper { beta1: cfg.betas.0, beta2: cfg.betas.1, eps: cfg.eps, weight_decay: cfg.weight_decay, decoupled };
    let items: Vec<AdamTensors<'_>> = rest.iter().map(|(p, g, b)| AdamTensors { p, g, m: &b[0], v: &b[1], vmax: b.get(2) }).collect();
    let done = kiln_tensor::fused::adam_step_device_(&items, (&core.lr, &core.step), hyper)?;
    let mut groups = PerGroup::new();
    for ((p, g, bufs), done) in rest.iter().zip(done) {
        if !done {
            let f = groups.get(p, |dtype, device| factors(core, cfg, decoupled, dtype, device))?;
            update_param(p, g, bufs, &f, cfg, decoupled)?;
        }
    }
    Ok(())
}

/// The fused kernel's scalars from the host copies of lr and step; None while tracing or
/// off the CPU (reading the step there would be a host read).
fn fused_scalars(core: &Core, cfg: &AdamConfig, decoupled: bool) -> Result<Option<AdamStep>> {
    if kiln_tensor::is_tracing() || core.step.device() != Device::Cpu {
        return Ok(None);
    }
    let t = core.step.item()?;
    let (b1, b2) = cfg.betas;
    let lr = core.lr_value;
    Ok(Some(AdamStep {
        beta1: b1,
        beta2: b2,
        eps: cfg.eps,
        l2: if decoupled { 0.0 } else { cfg.weight_decay },
        decay: if decoupled { 1.0 - lr * cfg.weight_decay } else { 1.0 },
        step_size: lr / (1.0 - b1.powf(t)),
        bc2_sqrt: (1.0 - b2.powf(t)).sqrt(),
    }))
}

/// The bias corrections from the step and lr tensors, in f64 (as the eager kernels compute
/// them on the host or on the device), cast to the parameters' dtype where they meet them:
/// `1 - 0.999^t` in f32 would carry a relative error near 1e-5.
fn factors(core: &Core, cfg: &AdamConfig, decoupled: bool, dtype: DType, device: Device) -> Result<Factors> {
    let step = cast(&core.step, DType::F64, device)?;
    let lr = cast(&core.lr, DType::F64, device)?;
    let (b1, b2) = cfg.betas;
    let bc1 = step.scalar_op(BinaryOp::Pow, b1, true)?.rsub_scalar(1.0)?;
    let bc2 = step.scalar_op(BinaryOp::Pow, b2, true)?.rsub_scalar(1.0)?;
    let decay =
        if decoupled && cfg.weight_decay != 0.0 { Some(lr.mul_scalar(cfg.weight_decay)?.rsub_scalar(1.0)?.to_dtype(dtype)?) } else { None };
    Ok(Factors { step_size: lr.div(&bc1)?.to_dtype(dtype)?, bc2_sqrt: bc2.sqrt()?.to_dtype(dtype)?, decay })
}

/// One parameter's update. Each tensor op is a pass over memory: 13 passes and at most two
/// temporaries alive at once (plus 1 pass for AdamW's decay, 2 for Adam's L2 term and 2 for
/// AMSGrad's running max).
fn update_param(p: &Tensor, g: &Tensor, bufs: &[Tensor], f: &Factors, cfg: &AdamConfig, decoupled: bool) -> Result<()> {
    let (b1, b2) = cfg.betas;
    if let Some(decay) = &f.decay {
        p.mul_(decay)?;
    }
    let l2;
    let g = if !decoupled && cfg.weight_decay != 0.0 {
        l2 = with_l2(p, g, cfg.weight_decay)?;
        &l2
    } else {
        g
    };
    let (m, v) = (&bufs[0], &bufs[1]);
    // m = b1 * m + (1 - b1) * g
    m.mul_scalar_(b1)?;
    m.add_(&g.mul_scalar(1.0 - b1)?)?;
    // v = b2 * v + (1 - b2) * g^2, scaling the square (our temporary) in place.
    let g2 = g.square()?;
    g2.mul_scalar_(1.0 - b2)?;
    v.mul_scalar_(b2)?;
    v.add_(&g2)?;
    drop(g2);
    // AMSGrad: the denominator uses the running max of v.
    let v = match bufs.get(2) {
        Some(vmax) => {
            vmax.assign(&vmax.maximum(v)?)?;
            vmax
        }
        None => v,
    };
    // denom = sqrt(v) / sqrt(1 - b2^t) + eps
    let denom = v.sqrt()?;
    denom.div_(&f.bc2_sqrt)?;
    denom.add_scalar_(cfg.eps)?;
    // p -= (lr / (1 - b1^t)) * m / denom
    let upd = m.div(&denom)?;
    upd.mul_(&f.step_size)?;
    p.sub_(&upd)
}
