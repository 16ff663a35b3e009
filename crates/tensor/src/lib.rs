//! kiln-tensor: the `Tensor` type, its dtypes, devices and layouts, the closed set of
//! primitive ops (`op::Op`), their CPU kernels (`cpu`) and CUDA back end (`cuda`), the
//! counter-based generator (`rng`) and the trace hook (`Tracer`).
//!
//! Every op goes through `Tensor::apply` (or `apply_inplace`): the shape rule in `op.rs`,
//! the kernel, the autograd record (`GradFn`) and the tracer, in that order.

mod backend;
mod cache;
pub mod codegen;
pub mod collective;
pub mod cpu;
pub mod cuda;
mod device;
mod display;
mod dtype;
mod error;
pub mod fused;
pub mod io;
pub mod lazy;
pub mod log;
pub mod math;
mod mode;
pub mod op;
mod ops;
pub mod profile;
pub mod rng;
pub mod shape;
mod slicing;
pub mod storage;
mod tensor;

pub use cpu::set_flush_denormal;
pub use device::Device;

pub use cache::{cache_dir, cache_put};
pub use dtype::{default_dtype, set_default_dtype, DType, Element};
pub use error::{Error, Result};
pub use mode::{autocast_dtype, is_anomaly_detection, is_grad_enabled, no_grad, set_detect_anomaly, set_grad_enabled, Autocast};
pub use op::{BinaryOp, Distribution, Fused, MatmulEpilogue, Op, ReduceOp, UnaryOp};
pub use ops::{ShapeDim, ShapeSpec};
pub use shape::{AllDims, Dim, Dims, Layout};
pub use slicing::{SliceItem, SliceSpec};
pub use tensor::next_tensor_id;
pub use tensor::{is_tracing, set_tracer, CustomBackward, Flag, GradFn, Tensor, TensorId, Tracer};
