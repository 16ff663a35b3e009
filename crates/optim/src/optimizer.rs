//! The `Optimizer` trait every optimizer implements.

use kiln_tensor::{Result, Tensor};

/// An optimizer over a fixed list of parameters (`torch.optim.Optimizer`, one param group).
pub trait Optimizer {
    /// One update of every parameter that has a gradient (those whose `grad()` is None are
    /// skipped, as in PyTorch).
    fn step(&mut self) -> Result<()>;
    /// Drops every gradient (PyTorch's default `set_to_none=True`): the next backward then
    /// hands its result over without a zeroing pass and an accumulating pass.
    fn zero_grad(&mut self) -> Result<()> {
        self.zero_grad_with(true)
    }
    /// `set_to_none = false` zeroes existing gradients in place instead, so their buffers stay
    /// the same tensors across steps.
    fn zero_grad_with(&mut self, set_to_none: bool) -> Result<()>;
    /// The current learning rate (a host copy of the lr tensor the math reads).
    fn lr(&self) -> f64;
    /// Sets the learning rate in place (the lr tensor keeps its storage).
    fn set_lr(&mut self, lr: f64) -> Result<()>;
    fn params(&self) -> &[Tensor];
    /// `step`, `lr` and `state.{i}.{buffer}` for each parameter `i` that has state. The
    /// tensors are the live ones (shared storage), not copies.
    fn state_tensors(&self) -> Vec<(String, Tensor)>;
    /// Loads what `state_tensors` returned. Checks every name, shape and dtype first and loads
    /// nothing on error; parameters absent from `tensors` lose their state (as in PyTorch).
    fn load_state_tensors(&mut self, tensors: &[(String, Tensor)]) -> Result<()>;
}
