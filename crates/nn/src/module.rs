//! The `Module` trait (parameters and buffers by name) and `Forward`.

use kiln_tensor::{DType, Device, Error, Result, Tensor, TensorId};
use std::any::Any;
use std::collections::HashMap;

/// Anything with parameters. `#[derive(Module)]` writes it from a struct's fields (see
/// `kiln_derive`); by hand, `visit` is the one method to write: it names each parameter.
pub trait Module {
    /// Calls `f(name, param)` for every parameter, names prefixed with `prefix`.
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor));
    /// Calls `f(name, buffer)` for every buffer: state that is not trained but saved beside
    /// the parameters (batch norm's running statistics), as PyTorch's `named_buffers`.
    fn visit_buffers(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    /// Switches train/eval behaviour (dropout, batch norm) for this module and its children.
    fn set_training(&self, _training: bool) {}
    /// Calls `f(name, module)` for every submodule, each after its own submodules (the order
    /// of PyTorch's `apply`); `#[derive(Module)]` writes it from the fields.
    fn visit_modules(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &dyn Any)) {}
    /// Calls `f` on every tensor the module holds (parameters and buffers), each by `&mut` so
    /// that it can be replaced (what `to_device` does); `#[derive(Module)]` writes it. A module
    /// written by hand that holds tensors writes it too: the default passes a module that
    /// names none and refuses one that does, naming its type.
    fn visit_mut(&mut self, _f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        let mut holds = false;
        self.visit("", &mut |_, _| holds = true);
        self.visit_buffers("", &mut |_, _| holds = true);
        if holds {
            return Err(Error::Msg(format!(
                "{}: moving its tensors (to_device) is not written for this module",
                std::any::type_name::<Self>()
            )));
        }
        Ok(())
    }

    /// Calls `f(name, module)` on every submodule and then on this module (named `""`), as
    /// PyTorch's `model.apply(fn)`; `f` picks the types it cares about with `downcast_ref`:
    ///
    /// ```
    /// use kiln_nn::{init, Linear, Module, Sequential};
    /// use kiln_tensor::Device;
    /// let model = Sequential::new().add(Linear::new(4, 8, true, Device::Cpu)?).add(Linear::new(8, 2, true, Device::Cpu)?);
    /// let mut names = Vec::new();
    /// model.apply(&mut |name, m| {
    ///     if let Some(linear) = m.downcast_ref::<Linear>() {
    ///         init::zeros_(&linear.weight).unwrap();
    ///         names.push(name.to_string());
    ///     }
    /// });
    /// assert_eq!(names, ["0", "1"]);
    /// # Ok::<(), kiln_tensor::Error>(())
    /// ```
    fn apply(&self, f: &mut dyn FnMut(&str, &dyn Any))
    where
        Self: Sized + 'static,
    {
        self.visit_modules("", f);
        f("", self);
    }

    /// Each parameter once, under the first name it is visited by: a tensor shared by two
    /// fields (a tied head's weight) is one parameter, as in PyTorch.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        self.visit("", &mut |n, t| {
            if seen.insert(t.id()) {
                out.push((n, t.clone()))
            }
        });
        out
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit_buffers("", &mut |n, t| out.push((n, t.clone())));
        out
    }
    /// What a state dict holds: the parameters under every name they have (a tied weight
    /// under both), then the buffers.
    fn named_state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |n, t| out.push((n, t.clone())));
        out.extend(self.named_buffers());
        out
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|p| p.numel()).sum()
    }
    /// Moves every parameter and buffer to `device` in place, as PyTorch's `model.to(device)`:
    /// a tensor held by two fields (a tied weight) stays one tensor, a tensor already there is
    /// kept, `requires_grad` and a gradient move with it. Build the optimizer after the move
    /// (its parameters are the tensors it was given). A field that is a view of another
    /// tensor (not the tensor itself) cannot stay tied to it and is an error.
    fn to_device(&mut self, device: Device) -> Result<()>
    where
        Self: Sized,
    {
        remap(self, &mut |t| if t.device() == device { Ok(None) } else { t.to_device(device).map(Some) })
    }
    /// Casts every floating-point parameter and buffer to `dtype` in place, as PyTorch's
    /// `model.to(torch.float64)` (`.double()`, `.half()`), with `to_device`'s rules.
    fn to_dtype(&mut self, dtype: DType) -> Result<()>
    where
        Self: Sized,
    {
        remap(self, &mut |t| if !t.dtype().is_float() || t.dtype() == dtype { Ok(None) } else { t.to_dtype(dtype).map(Some) })
    }
    fn train(&self) {
        self.set_training(true)
    }
    fn eval(&self) {
        self.set_training(false)
    }
}

/// Replaces each tensor of `m` by `f`'s new value of it (`None`: kept), as a new leaf with the
/// old one's `requires_grad` and its gradient mapped too; a tensor met twice (tied) is mapped
/// once. Everything is checked and converted before anything changes, so a refusal (a view of
/// a tied weight, a layer shared with a clone) or a failed conversion leaves `m` as it was.
fn remap<M: Module + ?Sized>(m: &mut M, f: &mut dyn FnMut(&Tensor) -> Result<Option<Tensor>>) -> Result<()> {
    let (mut seen, mut at): (Vec<Tensor>, HashMap<TensorId, usize>) = (Vec::new(), HashMap::new());
    m.visit_mut(&mut |t| {
        at.entry(t.id()).or_insert_with(|| {
            seen.push(t.clone());
            seen.len() - 1
        });
        Ok(())
    })?;
    let mut new: Vec<Option<Tensor>> = Vec::with_capacity(seen.len());
    for t in &seen {
        new.push(converted(t, f)?);
    }
    for (i, a) in seen.iter().enumerate() {
        for (j, b) in seen.iter().enumerate().skip(i + 1) {
            if a.same_storage(b) && (new[i].is_some() || new[j].is_some()) {
                return Err(Error::Msg(format!(
                    "moving a module: a {:?} and a {:?} tensor share storage without being one tensor (a view of a tied weight); tie the tensor itself",
                    a.shape(),
                    b.shape()
                )));
            }
        }
    }
    m.visit_mut(&mut |t| {
        if let Some(Some(n)) = at.get(&t.id()).map(|&k| &new[k]) {
            *t = n.clone();
        }
        Ok(())
    })
}

/// `f`'s value of `t` as a new leaf with `t`'s `requires_grad` and gradient (mapped), or
/// `None` when `f` keeps it.
fn converted(t: &Tensor, f: &mut dyn FnMut(&Tensor) -> Result<Option<Tensor>>) -> Result<Option<Tensor>> {
    let Some(new) = f(&t.detach())? else { return Ok(None) };
    if t.requires_grad() {
        new.set_requires_grad(true);
    }
    if let Some(g) = t.grad() {
        new.set_grad(f(&g)?.or(Some(g)));
    }
    Ok(Some(new))
}

/// A module with one input and one output (what `Sequential` chains).
pub trait Forward {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

/// `prefix.name`, or `name` at the top.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}
