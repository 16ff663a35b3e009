//! kiln-autograd: reverse-mode differentiation over the graph that `Tensor::apply` records.
//!
//! Each op output that depends on a tensor requiring grad carries a `GradFn` (the op and its
//! inputs); that chain is the tape. `backward` walks it in reverse topological order and
//! applies one rule per primitive op (`rules.rs`), written with tensor ops only, so a tracer
//! sees the backward pass like any other code. Gradients accumulate in place into the
//! leaves' `.grad()`.

mod checkpoint;
mod engine;
mod gradcheck;
mod hooks;
mod rules;

pub use checkpoint::checkpoint;
pub use engine::{backward, backward_with, grad, Backward, GradModeGuard, NoGradGuard};
pub use gradcheck::{gradcheck, GradcheckConfig};
pub use hooks::{register_post_accumulate_grad_hook, HookHandle};
pub use kiln_tensor::no_grad;
