//! Element types and the `Element` trait that CPU kernels are generic over.

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    /// Indices and labels.
    I64,
    /// Masks (0 or 1), the result of comparisons.
    U8,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
    /// The name used in safetensors files and in `Display`.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }
}

static DEFAULT_FLOAT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The float dtype new parameters get (like `torch.set_default_dtype`): F32 unless changed.
pub fn default_dtype() -> DType {
    match DEFAULT_FLOAT.load(std::sync::atomic::Ordering::Relaxed) {
        1 => DType::F64,
        2 => DType::F16,
        3 => DType::BF16,
        _ => DType::F32,
    }
}

/// Sets the float dtype for new parameters (process-wide). Non-float dtypes are ignored.
pub fn set_default_dtype(d: DType) {
    let code = match d {
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        _ => 0,
    };
    DEFAULT_FLOAT.store(code, std::sync::atomic::Ordering::Relaxed);
}

/// A scalar type a CPU buffer can hold. Arithmetic goes through `Acc`, the type kernels
/// compute in: f32 for f16/bf16/f32 (like PyTorch's CPU kernels), f64 for f64 and i64.
pub trait Element: Copy + Send + Sync + 'static + std::fmt::Debug + PartialOrd + bytemuck::Zeroable {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn zero() -> Self;
}

macro_rules! element {
    ($t:ty, $dt:ident, $to:expr, $from:expr, $zero:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dt;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to(self)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline(always)]
            fn zero() -> Self {
                $zero
            }
        }
    };
}
element!(f32, F32, |x: f32| x as f64, |v: f64| v as f32, 0.0);
element!(f64, F64, |x: f64| x, |v: f64| v, 0.0);
element!(f16, F16, |x: f16| x.to_f64(), f16::from_f64, f16::ZERO);
element!(bf16, BF16, |x: bf16| x.to_f64(), bf16::from_f64, bf16::ZERO);
element!(i64, I64, |x: i64| x as f64, |v: f64| v as i64, 0);
element!(u8, U8, |x: u8| x as f64, |v: f64| v as u8, 0);
