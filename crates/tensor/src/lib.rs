//! kiln-tensor: the `Tensor` type, its dtypes, devices and layouts, the closed set of
//! primitive ops (`op::Op`), their CPU kernels (`cpu`) and CUDA back end (`cuda`), the
//! counter-based generator (`rng`) and the trace hook (`Tracer`).
//!
//! Every op goes through `Tensor::apply` (or `apply_inplace`): the shape rule in `op.rs`,
//! the kernel, the autograd record (`GradFn`) and the tracer, in that order.

mod backend;
pub mod codegen;
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
pub mod storage;
mod tensor;

pub use cpu::set_flush_denormal;
pub use device::Device;

/// Kiln's disk cache for compiled kernels, folder `kind`: `$KILN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
pub fn cache_dir(kind: &str) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let base = std::env::var_os("KILN_CACHE_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(|x| PathBuf::from(x).join("kiln"))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kiln")))
    })?;
    Some(base.join(kind))
}

/// Writes a cache file whole or not at all (a temporary renamed into place), best effort: a
/// cache that cannot be written only costs the work again next time.
pub fn cache_put(path: &std::path::Path, bytes: &[u8]) {
    // (Beside the file's own name: `x.algo` and `x.heuristic` must not share one.)
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    if path.parent().map(std::fs::create_dir_all).transpose().is_ok() && std::fs::write(&tmp, bytes).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}
pub use dtype::{default_dtype, set_default_dtype, DType, Element};
pub use error::{Error, Result};
pub use mode::{autocast_dtype, is_anomaly_detection, is_grad_enabled, no_grad, set_detect_anomaly, set_grad_enabled, Autocast};
pub use op::{BinaryOp, Distribution, MatmulEpilogue, Op, ReduceOp, UnaryOp};
pub use ops::ShapeSpec;
pub use shape::{AllDims, Dim, Dims, Layout};
pub use tensor::next_tensor_id;
pub use tensor::{is_tracing, set_tracer, CustomBackward, Flag, GradFn, Tensor, TensorId, Tracer};
