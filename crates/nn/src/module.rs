//! The `Module` trait (parameters and buffers by name) and `Forward`.

use kiln_tensor::{Result, Tensor};
use std::any::Any;

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
    fn train(&self) {
        self.set_training(true)
    }
    fn eval(&self) {
        self.set_training(false)
    }
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
