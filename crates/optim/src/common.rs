//! What every optimizer shares: its parameters, the lr and step count as 0-dim tensors, the
//! per-parameter state buffers (named like PyTorch's `state.{i}.{key}`) and their loading.

use kiln_tensor::{no_grad, DType, Device, Error, Result, Tensor, TensorId};
use std::collections::HashSet;

/// Parameters, lr, step and each parameter's state buffers.
pub(crate) struct Core {
    /// Optimizer name for error messages.
    pub what: &'static str,
    pub params: Vec<Tensor>,
    /// The learning rate the math reads (0-dim F64 on the first parameter's device).
    pub lr: Tensor,
    /// Host copy of `lr` for `Optimizer::lr` (reading the tensor would be a host read).
    pub lr_value: f64,
    /// Steps taken (0-dim F64), read as a tensor so a traced step does not bake it in.
    pub step: Tensor,
    /// Names of each parameter's buffers, e.g. `["exp_avg", "exp_avg_sq"]`.
    pub keys: Vec<&'static str>,
    /// Per parameter, its buffers in `keys` order; None until its first update (PyTorch
    /// creates state lazily, so frozen parameters cost no memory).
    pub state: Vec<Option<Vec<Tensor>>>,
    /// The value new buffers start from (Adagrad's `initial_accumulator_value`). A buffer is
    /// made with it rather than filled after: a compiled step runs a creating fill once but
    /// replays an in-place fill every step.
    pub init: f64,
}

impl Core {
    pub fn new(what: &'static str, params: Vec<Tensor>, lr: f64, keys: Vec<&'static str>) -> Result<Core> {
        check_lr(what, lr)?;
        check_params(what, &params)?;
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let lr_t = Tensor::scalar(lr, DType::F64, device)?;
        let step = Tensor::scalar(0.0, DType::F64, device)?;
        let state = vec![None; params.len()];
        Ok(Core { what, params, lr: lr_t, lr_value: lr, step, keys, state, init: 0.0 })
    }

    /// The gradients to apply, as `(param index, grad)`, and the step count bumped when
    /// there is any (a step without gradients changes nothing, as in PyTorch).
    pub fn begin_step(&self) -> Result<Vec<(usize, Tensor)>> {
        let mut grads = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = p.grad() else { continue };
            // In-place ops broadcast their source: catch a mis-shaped grad here, not silently.
            if g.shape() != p.shape() || g.dtype() != p.dtype() {
                return Err(Error::Msg(format!(
                    "{}: parameter {i} has shape {:?} ({:?}) but its grad has shape {:?} ({:?})",
                    self.what,
                    p.shape(),
                    p.dtype(),
                    g.shape(),
                    g.dtype()
                )));
            }
            grads.push((i, g));
        }
        if !grads.is_empty() {
            self.step.add_scalar_(1.0)?;
        }
        Ok(grads)
    }

    /// Parameter `i`'s buffers, created (`init` like the parameter) on first use; the flag says
    /// whether they were just created.
    pub fn buffers(&mut self, i: usize) -> Result<(Vec<Tensor>, bool)> {
        if let Some(b) = &self.state[i] {
            return Ok((b.clone(), false));
        }
        let p = &self.params[i];
        let bufs: Vec<Tensor> = self.keys.iter().map(|_| p.full_like(self.init)).collect::<Result<_>>()?;
        self.state[i] = Some(bufs.clone());
        Ok((bufs, true))
    }

    pub fn zero_grad(&self, set_to_none: bool) -> Result<()> {
        if set_to_none {
            self.params.iter().for_each(|p| p.set_grad(None));
            return Ok(());
        }
        no_grad(|| self.params.iter().filter_map(Tensor::grad).try_for_each(|g| g.zero_()))
    }

    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr(self.what, lr)?;
        no_grad(|| self.lr.fill_(lr))?;
        self.lr_value = lr;
        Ok(())
    }

    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("step".to_string(), self.step.clone()), ("lr".to_string(), self.lr.clone())];
        for (i, bufs) in self.state.iter().enumerate() {
            let Some(bufs) = bufs else { continue };
            out.extend(self.keys.iter().zip(bufs).map(|(k, b)| (format!("state.{i}.{k}"), b.clone())));
        }
        out
    }

    /// Validates everything first, then assigns: an error leaves the optimizer untouched.
    pub fn load(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        let plan = self.plan_load(tensors)?;
        no_grad(|| self.apply_load(plan))
    }

    fn plan_load(&self, tensors: &[(String, Tensor)]) -> Result<LoadPlan> {
        let mut step = None;
        let mut lr = None;
        let mut found: Vec<Vec<Option<Tensor>>> = vec![vec![None; self.keys.len()]; self.params.len()];
        for (name, t) in tensors {
            let slot = match name.as_str() {
                "step" => &mut step,
                "lr" => &mut lr,
                _ => {
                    let (i, k) = self.parse_name(name)?;
                    &mut found[i][k]
                }
            };
            if slot.replace(t.clone()).is_some() {
                return Err(self.load_err(format!("tensor '{name}' appears twice")));
            }
        }
        let step = self.check_scalar("step", step)?;
        let lr = self.check_scalar("lr", lr)?;
        let lr_value = lr.item()?;
        check_lr(self.what, lr_value)?;
        let state = found.into_iter().enumerate().map(|(i, bufs)| self.check_param_state(i, bufs)).collect::<Result<_>>()?;
        Ok(LoadPlan { step, lr, lr_value, state })
    }

    fn apply_load(&mut self, plan: LoadPlan) -> Result<()> {
        self.step.assign(&plan.step)?;
        self.lr.assign(&plan.lr)?;
        self.lr_value = plan.lr_value;
        for (i, new) in plan.state.into_iter().enumerate() {
            let Some(src) = new else {
                self.state[i] = None;
                continue;
            };
            // Into the existing buffers when there are some: their storage must not change.
            let (bufs, _) = self.buffers(i)?;
            for (b, s) in bufs.iter().zip(&src) {
                b.assign(s)?;
            }
        }
        Ok(())
    }

    /// `state.{i}.{key}` -> (i, index of key).
    fn parse_name(&self, name: &str) -> Result<(usize, usize)> {
        let parsed = name.strip_prefix("state.").and_then(|r| r.split_once('.')).and_then(|(i, k)| {
            let i: usize = i.parse().ok().filter(|&i| i < self.params.len())?;
            Some((i, self.keys.iter().position(|&key| key == k)?))
        });
        parsed.ok_or_else(|| {
            self.load_err(format!(
                "unexpected tensor '{name}': expected 'step', 'lr' and 'state.{{i}}.{{key}}' with i < {} and key in {:?}",
                self.params.len(),
                self.keys
            ))
        })
    }

    /// `step` or `lr`: present, 0-dim F64, moved to our device.
    fn check_scalar(&self, name: &str, t: Option<Tensor>) -> Result<Tensor> {
        let t = t.ok_or_else(|| self.load_err(format!("missing tensor '{name}'")))?;
        if !t.shape().is_empty() || t.dtype() != DType::F64 {
            return Err(self.load_err(format!("'{name}' has shape {:?} ({:?}), expected shape [] (F64)", t.shape(), t.dtype())));
        }
        t.to_device(self.step.device())
    }

    /// All of parameter `i`'s buffers or none; each shaped, typed and placed like it.
    fn check_param_state(&self, i: usize, bufs: Vec<Option<Tensor>>) -> Result<Option<Vec<Tensor>>> {
        if bufs.iter().all(Option::is_none) {
            return Ok(None);
        }
        let p = &self.params[i];
        let mut out = Vec::with_capacity(bufs.len());
        for (key, b) in self.keys.iter().zip(bufs) {
            let name = format!("state.{i}.{key}");
            let b = b.ok_or_else(|| self.load_err(format!("parameter {i} has some state but no '{name}'")))?;
            if b.shape() != p.shape() || b.dtype() != p.dtype() {
                return Err(self.load_err(format!(
                    "'{name}' has shape {:?} ({:?}) but parameter {i} has shape {:?} ({:?})",
                    b.shape(),
                    b.dtype(),
                    p.shape(),
                    p.dtype()
                )));
            }
            out.push(b.to_device(p.device())?);
        }
        Ok(Some(out))
    }

    fn load_err(&self, msg: String) -> Error {
        Error::Msg(format!("{} load_state: {msg}", self.what))
    }
}

/// Validated state, ready to assign.
struct LoadPlan {
    step: Tensor,
    lr: Tensor,
    lr_value: f64,
    state: Vec<Option<Vec<Tensor>>>,
}

/// Values derived once per step for each (dtype, device) among the parameters, so a step
/// over many parameters computes its 0-dim scalars (bias corrections, lr casts) once.
pub(crate) struct PerGroup<T> {
    items: Vec<((DType, Device), T)>,
}

impl<T: Clone> PerGroup<T> {
    pub fn new() -> Self {
        PerGroup { items: Vec::new() }
    }
    pub fn get(&mut self, p: &Tensor, make: impl FnOnce(DType, Device) -> Result<T>) -> Result<T> {
        let key = (p.dtype(), p.device());
        if let Some((_, v)) = self.items.iter().find(|(k, _)| *k == key) {
            return Ok(v.clone());
        }
        let v = make(key.0, key.1)?;
        self.items.push((key, v.clone()));
        Ok(v)
    }
}

/// A 0-dim tensor moved to `device` and cast to `dtype` (no-ops when already so).
pub(crate) fn cast(t: &Tensor, dtype: DType, device: Device) -> Result<Tensor> {
    t.to_device(device)?.to_dtype(dtype)
}

/// `g + wd * p` (PyTorch's L2 weight decay, `grad.add(param, alpha=wd)`), a new tensor.
pub(crate) fn with_l2(p: &Tensor, g: &Tensor, wd: f64) -> Result<Tensor> {
    let t = p.mul_scalar(wd)?;
    t.add_(g)?;
    Ok(t)
}

/// An error unless `ok`: `what: msg` (PyTorch's constructor checks).
pub(crate) fn ensure(ok: bool, what: &str, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Msg(format!("{what}: {}", msg())))
    }
}

fn check_lr(what: &str, lr: f64) -> Result<()> {
    // `lr >= 0.0` is false for NaN too, like PyTorch's `not 0.0 <= lr`.
    ensure(lr >= 0.0, what, || format!("invalid learning rate {lr}: must be >= 0"))
}

/// Leaves of a float dtype, each once (a duplicate would be updated twice per step).
fn check_params(what: &str, params: &[Tensor]) -> Result<()> {
    let mut seen: HashSet<TensorId> = HashSet::new();
    for (i, p) in params.iter().enumerate() {
        ensure(p.is_leaf(), what, || {
            format!("parameter {i} (shape {:?}) is not a leaf tensor; optimize the leaves it was computed from", p.shape())
        })?;
        ensure(p.dtype().is_float(), what, || {
            format!("parameter {i} has dtype {:?}; only floating-point tensors can be optimized", p.dtype())
        })?;
        ensure(seen.insert(p.id()), what, || format!("parameter {i} (shape {:?}) appears more than once", p.shape()))?;
    }
    Ok(())
}

/// Implements `Optimizer` for a struct with a `core: Core` field and an
/// `fn update(&mut self) -> Result<()>` that does one step's math.
macro_rules! impl_optimizer {
    ($t:ty) => {
        impl $crate::optimizer::Optimizer for $t {
            fn step(&mut self) -> kiln_tensor::Result<()> {
                kiln_tensor::no_grad(|| self.update())
            }
            fn zero_grad_with(&mut self, set_to_none: bool) -> kiln_tensor::Result<()> {
                self.core.zero_grad(set_to_none)
            }
            fn lr(&self) -> f64 {
                self.core.lr_value
            }
            fn set_lr(&mut self, lr: f64) -> kiln_tensor::Result<()> {
                self.core.set_lr(lr)
            }
            fn params(&self) -> &[kiln_tensor::Tensor] {
                &self.core.params
            }
            fn state_tensors(&self) -> Vec<(String, kiln_tensor::Tensor)> {
                self.core.state_tensors()
            }
            fn load_state_tensors(&mut self, tensors: &[(String, kiln_tensor::Tensor)]) -> kiln_tensor::Result<()> {
                self.core.load(tensors)
            }
        }
    };
}
pub(crate) use impl_optimizer;
