//! Kiln: eager tensors with a tape autograd, an `nn` and `optim` stack, and a compiler that
//! traces whole training steps. This facade re-exports the crates; `kiln::prelude::*` brings
//! what a training script needs.
//!
//! ```
//! use kiln::prelude::*;
//! let w = Tensor::from_slice(&[1.0f32, 2.0], &[2], Device::Cpu)?;
//! w.set_requires_grad(true);
//! w.square()?.sum_all()?.backward()?;
//! assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0]);
//! # Ok::<(), kiln::Error>(())
//! ```

// `#[derive(Module)]` expands to `::kiln::nn` paths; inside this crate they resolve here.
extern crate self as kiln;

pub mod checkpoint;
mod compile_module;
pub mod data;
pub mod hf;
pub mod loader;
pub mod metrics;
pub mod models;
pub mod text;

pub use compile_module::{compile_module, CompiledModule};
pub use kiln_autograd as autograd;
pub use kiln_compile as compile;
pub use kiln_distributed as distributed;
pub use kiln_nn as nn;
pub use kiln_optim as optim;
pub use kiln_tensor as tensor;
pub use kiln_tensor::{DType, Device, Error, Result, Tensor};

pub mod prelude {
    pub use kiln_autograd::{no_grad, Backward, NoGradGuard};
    pub use kiln_nn::{Forward, Module};
    pub use kiln_optim::{LrScheduler, Optimizer};
    pub use kiln_tensor::{AllDims, DType, Device, Error, Result, Tensor};
}
