//! One error type for all of Kiln. Messages name the op, the shapes, dtypes and devices involved.

use crate::{DType, Device};

/// Every fallible Kiln operation returns this error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit together (broadcasting, matmul, reshape, cat, ...).
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// A dimension index outside the tensor's rank.
    #[error("{op}: dim {dim} out of range for a tensor of rank {rank} (shape {shape:?})")]
    Dim { op: &'static str, dim: isize, rank: usize, shape: Vec<usize> },
    /// An index value outside its dimension (gather, index_select, embedding).
    #[error("{op}: index {index} out of range for dim {dim} of size {size}")]
    Index { op: &'static str, index: i64, dim: usize, size: usize },
    /// The op does not support this dtype, or its inputs' dtypes differ.
    #[error("{op}: {msg}")]
    DType { op: &'static str, msg: String },
    /// Inputs live on different devices.
    #[error("{op}: tensors are on different devices ({lhs:?} and {rhs:?}); move them with .to_device()")]
    DeviceMismatch { op: &'static str, lhs: Device, rhs: Device },
    /// The device is not usable (no CUDA support compiled in, no driver, no such GPU).
    #[error("device {device:?}: {msg}")]
    Device { device: Device, msg: String },
    /// A failure inside the CUDA driver, NVRTC or cuBLAS, with the call that failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// Reading or writing files (safetensors, data sets, checkpoints).
    #[error("io: {0}")]
    Io(String),
    /// A file whose content is malformed.
    #[error("{what}: {msg}")]
    Format { what: String, msg: String },
    /// Reading a value on the host inside a traced (compiled) step.
    #[error("graph break: {0}")]
    GraphBreak(String),
    /// Anything else, with a message that says what went wrong.
    #[error("{0}")]
    Msg(String),
}

/// `Result` with Kiln's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

impl Error {
    /// The same error as raised by `op`: a fused op's shape rule names itself, not the
    /// primitive whose rule it reuses.
    pub fn in_op(self, op: &'static str) -> Self {
        match self {
            Error::Shape { msg, .. } => Error::Shape { op, msg },
            Error::Dim { dim, rank, shape, .. } => Error::Dim { op, dim, rank, shape },
            Error::Index { index, dim, size, .. } => Error::Index { op, index, dim, size },
            Error::DType { msg, .. } => Error::DType { op, msg },
            Error::DeviceMismatch { lhs, rhs, .. } => Error::DeviceMismatch { op, lhs, rhs },
            other => other,
        }
    }
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape { op, msg: msg.into() }
    }
    pub fn dtype(op: &'static str, msg: impl Into<String>) -> Self {
        Error::DType { op, msg: msg.into() }
    }
    /// An error for an op that needs two equal dtypes.
    pub fn dtype_mismatch(op: &'static str, lhs: DType, rhs: DType) -> Self {
        Error::DType { op, msg: format!("dtype mismatch: {lhs:?} vs {rhs:?}; cast one side with .to_dtype()") }
    }
}

/// Shorthand for returning an [`Error::Msg`].
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::Error::Msg(format!($($arg)*))) };
}
