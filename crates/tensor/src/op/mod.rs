//! The closed set of primitive ops. Each row here is one op: its name, what it does to shapes
//! and dtypes (`Op::infer`), and for elementwise ops its scalar expression, once for the CPU
//! (`UnaryOp::eval`) and once as C source for generated CUDA kernels (`UnaryOp::c_expr`).
//! Backward rules live in `kiln-autograd`, CPU kernels in `cpu/`. No `_ =>` arms: adding a
//! variant is a list of compile errors that says where to go.

mod fused;
mod parts;
mod shapes;

pub use parts::{Part, Parts};

use crate::collective::{Collective, Group};
use crate::{DType, Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sin,
    Cos,
    Tanh,
    Sigmoid,
    Relu,
    /// GELU with the exact erf form.
    Gelu,
    /// GELU with the tanh approximation.
    GeluTanh,
    Silu,
    Erf,
    Square,
    Sign,
    /// 1 where x > 0, else 0: the derivative of relu.
    Step,
    /// d/dx gelu(x) = Phi(x) + x phi(x).
    GeluGrad,
    /// d/dx of the tanh-approximated gelu.
    GeluTanhGrad,
    /// d/dx silu(x) = s (1 + x (1 - s)), s = sigmoid(x).
    SiluGrad,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const INV_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// Floating-point math the CPU kernels compute in (f32 for f32/f16/bf16, f64 for f64).
pub trait Float:
    Copy
    + Send
    + Sync
    + 'static
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
{
    fn c(v: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! float_impl {
    ($t:ty, $exp:path, $erf:path, $tanh:path) => {
        impl Float for $t {
            #[inline(always)]
            fn c(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                $tanh(self)
            }
            #[inline(always)]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}
// f32 uses Kiln's branch-free `exp`/`erf`/`tanh` (`math.rs`), which vectorise; f64 the C library's
// (Rust's std has no erf). Generated CPU kernels (kiln-compile's `cpu_codegen`) compute the
// same functions, so eager and compiled results agree bit for bit.
float_impl!(f32, crate::math::exp_f32, crate::math::erf_f32, crate::math::tanh_f32);
float_impl!(f64, f64::exp, c_erf, f64::tanh);

#[cfg_attr(unix, link(name = "m"))]
unsafe extern "C" {
    fn erf(x: f64) -> f64;
}

#[inline]
fn c_erf(x: f64) -> f64 {
    // SAFETY: a pure C99 math function, defined for every input.
    unsafe { erf(x) }
}

impl UnaryOp {
    /// Every unary op (for tests and kernel tables).
    pub const ALL: [UnaryOp; 22] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Erf,
        UnaryOp::Square,
        UnaryOp::Sign,
        UnaryOp::Step,
        UnaryOp::GeluGrad,
        UnaryOp::GeluTanhGrad,
        UnaryOp::SiluGrad,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Recip => "recip",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
            UnaryOp::Erf => "erf",
            UnaryOp::Square => "square",
            UnaryOp::Sign => "sign",
            UnaryOp::Step => "step",
            UnaryOp::GeluGrad => "gelu_grad",
            UnaryOp::GeluTanhGrad => "gelu_tanh_grad",
            UnaryOp::SiluGrad => "silu_grad",
        }
    }

    /// Whether the op computes Kiln's f32 `exp`, `erf` or `tanh` (`math.rs`), whose
    /// vectorised loops gain most from wider vectors.
    pub fn uses_math(self) -> bool {
        use UnaryOp as U;
        matches!(
            self,
            U::Exp | U::Sigmoid | U::Tanh | U::Gelu | U::GeluTanh | U::Silu | U::Erf | U::GeluGrad | U::GeluTanhGrad | U::SiluGrad
        )
    }

    /// The op on one value (CPU).
    #[inline(always)]
    pub fn eval<F: Float>(self, x: F) -> F {
        let one = F::c(1.0);
        let zero = F::c(0.0);
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => one / x.sqrt(),
            UnaryOp::Recip => one / x,
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Sigmoid => one / (one + (-x).exp()),
            UnaryOp::Relu => {
                if x > zero || x.is_nan() {
                    x
                } else {
                    zero
                }
            }
            UnaryOp::Gelu => F::c(0.5) * x * (one + (x * F::c(INV_SQRT_2)).erf()),
            UnaryOp::GeluTanh => F::c(0.5) * x * (one + (F::c(SQRT_2_OVER_PI) * (x + F::c(0.044715) * x * x * x)).tanh()),
            UnaryOp::Silu => x / (one + (-x).exp()),
            UnaryOp::Erf => x.erf(),
            UnaryOp::Square => x * x,
            UnaryOp::Sign => {
                if x > zero {
                    one
                } else if x < zero {
                    -one
                } else {
                    x
                }
            }
            UnaryOp::Step => {
                if x > zero {
                    one
                } else {
                    zero
                }
            }
            UnaryOp::GeluGrad => {
                let cdf = F::c(0.5) * (one + (x * F::c(INV_SQRT_2)).erf());
                cdf + x * F::c(INV_SQRT_2PI) * (F::c(-0.5) * x * x).exp()
            }
            UnaryOp::GeluTanhGrad => {
                let inner = F::c(SQRT_2_OVER_PI) * (x + F::c(0.044715) * x * x * x);
                let t = inner.tanh();
                let dinner = F::c(SQRT_2_OVER_PI) * (one + F::c(3.0 * 0.044715) * x * x);
                F::c(0.5) * (one + t) + F::c(0.5) * x * (one - t * t) * dinner
            }
            UnaryOp::SiluGrad => {
                let s = one / (one + (-x).exp());
                s * (one + x * (one - s))
            }
        }
    }

    /// The op as a C++ expression of `x` for generated CUDA kernels. It is generic over the
    /// kernel's compute type `C` (float, double or long long): math goes through the prelude's
    /// overloaded `k*` helpers and constants through `K(v)`, so one text serves every dtype.
    pub fn c_expr(self, x: &str) -> String {
        let (h, s2, s2pi, a) = ("K(0.5)", format!("K({INV_SQRT_2})"), format!("K({SQRT_2_OVER_PI})"), "K(0.044715)");
        match self {
            UnaryOp::Neg => format!("(-{x})"),
            UnaryOp::Abs => format!("kabs({x})"),
            UnaryOp::Exp => format!("kexp({x})"),
            UnaryOp::Log => format!("klog({x})"),
            UnaryOp::Sqrt => format!("ksqrt({x})"),
            UnaryOp::Rsqrt => format!("krsqrt({x})"),
            UnaryOp::Recip => format!("(K(1)/{x})"),
            UnaryOp::Sin => format!("ksin({x})"),
            UnaryOp::Cos => format!("kcos({x})"),
            UnaryOp::Tanh => format!("ktanh({x})"),
            UnaryOp::Sigmoid => format!("(K(1)/(K(1)+kexp(-{x})))"),
            UnaryOp::Relu => format!("({x} > K(0) ? {x} : ({x} != {x} ? {x} : K(0)))"),
            UnaryOp::Gelu => format!("({h}*{x}*(K(1)+kerf({x}*{s2})))"),
            UnaryOp::GeluTanh => format!("({h}*{x}*(K(1)+ktanh({s2pi}*({x}+{a}*{x}*{x}*{x}))))"),
            UnaryOp::Silu => format!("({x}/(K(1)+kexp(-{x})))"),
            UnaryOp::Erf => format!("kerf({x})"),
            UnaryOp::Square => format!("({x}*{x})"),
            UnaryOp::Sign => format!("({x} > K(0) ? K(1) : ({x} < K(0) ? K(-1) : {x}))"),
            UnaryOp::Step => format!("({x} > K(0) ? K(1) : K(0))"),
            // h + h erf is h (1 + erf) exactly (h = 1/2), one FMA on a GPU where two ops.
            UnaryOp::GeluGrad => format!("({h}+{h}*kerf({x}*{s2}) + {x}*K({INV_SQRT_2PI})*kexp_small(K(-0.5)*{x}*{x}))"),
            UnaryOp::GeluTanhGrad => format!("kgelu_tanh_grad({x})"),
            UnaryOp::SiluGrad => format!("ksilu_grad({x})"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl BinaryOp {
    /// Every binary op (for tests and kernel tables).
    pub const ALL: [BinaryOp; 13] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
        }
    }
    /// Comparisons give a U8 mask; arithmetic keeps the input dtype.
    pub fn is_comparison(self) -> bool {
        matches!(self, BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge)
    }

    /// The op on two values (CPU, floats). Comparisons return 1 or 0.
    #[inline(always)]
    pub fn eval<F: Float>(self, a: F, b: F) -> F {
        let bit = |c: bool| if c { F::c(1.0) } else { F::c(0.0) };
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Pow => a.powf(b),
            // NaN propagates, as in torch.maximum.
            BinaryOp::Maximum => {
                if a.is_nan() || a > b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Minimum => {
                if a.is_nan() || a < b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Eq => bit(a == b),
            BinaryOp::Ne => bit(a != b),
            BinaryOp::Lt => bit(a < b),
            BinaryOp::Le => bit(a <= b),
            BinaryOp::Gt => bit(a > b),
            BinaryOp::Ge => bit(a >= b),
        }
    }

    /// The op on two integers (I64 and U8 tensors).
    #[inline(always)]
    pub fn eval_int(self, a: i64, b: i64) -> i64 {
        match self {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            BinaryOp::Div => a.checked_div(b).unwrap_or(0),
            BinaryOp::Pow => a.wrapping_pow(b.clamp(0, u32::MAX as i64) as u32),
            BinaryOp::Maximum => a.max(b),
            BinaryOp::Minimum => a.min(b),
            BinaryOp::Eq => (a == b) as i64,
            BinaryOp::Ne => (a != b) as i64,
            BinaryOp::Lt => (a < b) as i64,
            BinaryOp::Le => (a <= b) as i64,
            BinaryOp::Gt => (a > b) as i64,
            BinaryOp::Ge => (a >= b) as i64,
        }
    }

    /// The op as a C++ expression in the kernel's compute type `C` (see `UnaryOp::c_expr`).
    /// Comparisons give 1 or 0; integer division by zero gives 0, as on the CPU.
    pub fn c_expr(self, a: &str, b: &str) -> String {
        match self {
            BinaryOp::Add => format!("({a}+{b})"),
            BinaryOp::Sub => format!("({a}-{b})"),
            BinaryOp::Mul => format!("({a}*{b})"),
            BinaryOp::Div => format!("kdiv({a},{b})"),
            BinaryOp::Pow => format!("kpow({a},{b})"),
            BinaryOp::Maximum => format!("(({a}!={a}||{a}>{b})?{a}:{b})"),
            BinaryOp::Minimum => format!("(({a}!={a}||{a}<{b})?{a}:{b})"),
            BinaryOp::Eq => format!("({a}=={b}?K(1):K(0))"),
            BinaryOp::Ne => format!("({a}!={b}?K(1):K(0))"),
            BinaryOp::Lt => format!("({a}<{b}?K(1):K(0))"),
            BinaryOp::Le => format!("({a}<={b}?K(1):K(0))"),
            BinaryOp::Gt => format!("({a}>{b}?K(1):K(0))"),
            BinaryOp::Ge => format!("({a}>={b}?K(1):K(0))"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// Index of the largest value (first on ties), as I64. One dim only.
    ArgMax,
    ArgMin,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }
}

/// Which distribution a random source op draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Distribution {
    /// Uniform on [0, 1).
    Uniform,
    /// Standard normal.
    Normal,
}

/// What `Fused::Matmul` does besides `a @ b (+ bias)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulEpilogue {
    /// `relu(a @ b + bias)`: cuBLASLt's RELU(_BIAS) epilogue (which maps NaN to 0, as
    /// PyTorch's fused `addmm` + ReLU does).
    Relu,
    /// `gelu_tanh(a @ b + bias)` and the pre-activation `a @ b + bias` (which the backward
    /// reads) as one flat buffer (`Parts::with_tail`): cuBLASLt's
    /// GELU_AUX(_BIAS) epilogue, whose GELU is this tanh form.
    GeluTanh,
    /// `(a @ b) * gelu_tanh_grad(h)` (inputs a, b, h): the gradient through a `GeluTanh` whose
    /// pre-activation is `h` (cuBLASLt's DGELU epilogue).
    DGeluTanh,
    /// `(a @ b) * step(h)` (inputs a, b, h): the gradient through a ReLU whose output is `h`
    /// (autograd's `g * step(y)`). cuBLASLt's DRELU wants a bit mask instead, so the CUDA
    /// back end multiplies in a kernel, or, for a contraction of at most 16 (the product by a
    /// classifier head's weight), in its own product kernel.
    DRelu,
    /// `a @ b` of 2-D operands, then the sums of `a` over its columns (the contraction), as one
    /// flat buffer (`Parts::with_tail`): the product `[m, n]`, then the `m` sums. A weight's gradient `g^T x` and its bias's gradient `sum(g)`
    /// in one GEMM (cuBLASLt's BGRADB epilogue).
    SumLeft,
    /// As `SumLeft`, with the `n` sums of `b` over its rows (BGRADA).
    SumRight,
    /// `a @ b (+ bias) + r` (inputs a, b, r and the bias last, if any; r the product's shape):
    /// a residual connection's add in the product's epilogue (a GEMM's `beta C`).
    Residual,
}

impl MatmulEpilogue {
    /// The activation gradient a `D*` epilogue multiplies the product by (of its third input).
    pub fn activation_grad(self) -> Option<UnaryOp> {
        match self {
            MatmulEpilogue::DGeluTanh => Some(UnaryOp::GeluTanhGrad),
            MatmulEpilogue::DRelu => Some(UnaryOp::Step),
            MatmulEpilogue::Relu
            | MatmulEpilogue::GeluTanh
            | MatmulEpilogue::SumLeft
            | MatmulEpilogue::SumRight
            | MatmulEpilogue::Residual => None,
        }
    }
}

/// A primitive op. Inputs are passed separately; parameters that shape the result live here.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    // Sources (no tensor inputs).
    /// A tensor filled with one value.
    Full {
        shape: Vec<usize>,
        value: f64,
        dtype: DType,
    },
    /// 0, 1, ..., n-1 as `dtype`.
    Arange {
        n: usize,
        dtype: DType,
    },
    /// Counter-based random numbers: element i is draw `offset + i` of stream `seed`.
    Rand {
        shape: Vec<usize>,
        dist: Distribution,
        seed: u64,
        offset: u64,
        dtype: DType,
    },
    // Elementwise.
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `x op value`, or `value op x` when `scalar_lhs`.
    Scalar {
        op: BinaryOp,
        value: f64,
        scalar_lhs: bool,
    },
    /// `cond ? a : b` with broadcasting; cond is any dtype, nonzero is true.
    Where,
    Cast(DType),
    // Reductions.
    Reduce {
        op: ReduceOp,
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// Softmax (or log-softmax) of `scale * x` over the last dim, in one pass over each row:
    /// the max shift, the sum of exponentials and the normalisation, accumulated wide. With
    /// `causal` (softmax only, rank >= 2), entry `j` of row `i` of each `[.., T, S]` matrix is
    /// left out (probability 0) when `j > i`, as attention's causal mask does.
    Softmax {
        log: bool,
        scale: f64,
        causal: bool,
    },
    /// The input gradient of `Softmax` from its output `y` and the output's gradient `g`, one
    /// pass per row: `scale y (g - sum(g y))`, or for log-softmax `scale (g - exp(y) sum(g))`.
    /// (A causal softmax's masked entries have `y = 0`, so their gradient is 0 too.)
    SoftmaxBackward {
        log: bool,
        scale: f64,
    },
    /// `(x - mean) / sqrt(var + eps)` over the last dim (biased variance), one pass per row;
    /// with inputs x, weight, bias (each `[n]`), layer norm with its affine part. `rms`: RMS
    /// norm, `x / sqrt(mean(x^2) + eps)` (no mean taken), with inputs x or x and a weight `[n]`.
    Normalize {
        eps: f64,
        rms: bool,
    },
    /// The gradient of `Normalize` with respect to its input (inputs: x, the output's
    /// gradient, and optionally the weight `w`, `[n]`, which scales g):
    /// `rstd (gw - mean(gw) - xhat mean(gw xhat))`, without the `mean(gw)` term for RMS norm,
    /// one pass per row.
    NormalizeBackward {
        eps: f64,
        rms: bool,
    },
    /// Layer norm's parameter gradients from its input `x` and output gradient `g` (one
    /// shape, last dim `n`; g in any float dtype, read as x's): `[2, n]`, the sums over rows of
    /// `g * normalize(x)` (the weight's) and of `g` (the bias's). On CUDA one pass reads x and
    /// g once, with no normalised copy. With the weight `w` (`[n]`) as a third input, the
    /// whole backward in that pass: one flat buffer (`Parts::layer_norm_grads`), the `[2, n]`
    /// then x's gradient (as `NormalizeBackward` with `w` computes it).
    LayerNormGrads {
        eps: f64,
    },
    /// Scaled dot-product attention without storing the scores (flash-style): q `[.., T, D]`, k
    /// and v `[.., S, D]` (S = T in the backward); `out = softmax(scale * q k^T) v`, where with
    /// `causal` key `j` is left out of query `i`'s softmax when `j > i + S - T` (the queries
    /// are the last T positions). Grouped-query attention: q `[B, H, T, D]` with k and v `[B,
    /// H_kv, S, D]`, query head `h` reading key/value head `h / (H / H_kv)`
    /// (`attention_kv_repeat`), with no repeated copy of k and v.
    Attention {
        scale: f64,
        causal: bool,
    },
    /// The gradients of `Attention` (inputs q, k, v, its output, the output's gradient),
    /// packed the way a fused projection lays out q, k and v (under grouped-query attention,
    /// dk and dv per query head, which the backward rule sums over each group): for q of shape `[B, H.., T, D]`,
    /// `[B, T, 3, H.., D]` (`[T, 3, D]` for rank 2; `attention_grads_shape`), so that the
    /// gradient of a `[B, T, 3 H D]` projection cut into heads is this buffer, with no copy.
    AttentionBackward {
        scale: f64,
        causal: bool,
    },
    /// Cross-entropy per row (inputs: logits `[N, C]`, class indices `[N]` of I64):
    /// `lse - (1 - smoothing) x[t] - smoothing / C sum_j x[j]`, and 0 for rows whose target is
    /// `ignore_index`. One pass per row: the loss never materialises log-probabilities.
    CrossEntropy {
        ignore_index: Option<i64>,
        smoothing: f64,
    },
    /// The logits' gradient of `CrossEntropy` (inputs: logits, targets, the per-row gradient
    /// `[N]`): `g[i] (softmax(x)[i, j] - (1 - smoothing) [j == t] - smoothing / C)`.
    CrossEntropyBackward {
        ignore_index: Option<i64>,
        smoothing: f64,
    },
    // Contractions.
    /// Batched matrix product `[..., m, k] x [..., k, n]` with broadcast batch dims; with a
    /// third input, a bias `[n]` added to every row (`addmm`: a cuBLASLt epilogue on CUDA, the
    /// GEMM's accumulate-into-output on the CPU, so the sum costs no extra pass).
    Matmul,
    // Views: no kernel, a new layout over the same storage.
    Reshape(Vec<usize>),
    Permute(Vec<usize>),
    Narrow {
        dim: usize,
        start: usize,
        len: usize,
    },
    Expand(Vec<usize>),
    /// A row-major copy.
    Contiguous,
    // Indexing.
    /// `out = input.index_select(dim, index)`, index I64 of rank 1.
    IndexSelect {
        dim: usize,
    },
    /// `out = base; out.index_select(dim, index) += src` (inputs: base, index, src).
    IndexAdd {
        dim: usize,
    },
    /// `out[i][j] = input[i][index[i][j]]` along `dim` (inputs: input, index).
    Gather {
        dim: usize,
    },
    /// `out = base; out[.. index[i][j] ..] += src[i][j]` along `dim` (inputs: base, index, src).
    ScatterAdd {
        dim: usize,
    },
    /// The I64 positions that sort each row of the last dim (stable: ties keep their order;
    /// NaN counts as the largest value, as in PyTorch).
    ArgSort {
        descending: bool,
    },
    /// Concatenation along `dim` of any number of inputs.
    Cat {
        dim: usize,
    },
    // In-place updates: the only mutation. The first input is the destination.
    /// `dst = src` (src broadcasts to dst).
    Assign,
    /// `dst = dst op src`.
    UpdateBinary(BinaryOp),
    /// `dst = dst op value`.
    UpdateScalar(BinaryOp, f64),
    /// A collective over the ranks of `group` (`crate::collective`): the one input is this
    /// rank's tensor, the output what the collective gives this rank. Run by the back end of
    /// the input's device (a thread group on the CPU, NCCL on CUDA).
    Collective {
        group: Group,
        kind: Collective,
    },
    /// A fused form that compile's passes make from primitives (`fused.rs` lists them).
    Fused(Fused),
}

/// The fused ops: forms that compile's passes make from primitives after autograd, never a
/// user's program (`Op::Fused`). Their name, arity and shape rule are in `fused.rs`, their CPU
/// reference kernels in `cpu/mod.rs`'s `fused` arm, their CUDA launches in their kernel
/// family's file, the rules that make them in `kiln-compile`'s `passes/`. None has a
/// backward rule.
#[derive(Debug, Clone, PartialEq)]
pub enum Fused {
    /// A matmul with work folded into it (`MatmulEpilogue`); on CUDA one cuBLASLt call with an
    /// epilogue (or Kiln's own product kernel), elsewhere the product and then the rest.
    Matmul(MatmulEpilogue),
    /// An activation's backward with its bias gradient (on a GPU): inputs `a` and `h` of one
    /// float shape `[.., n]` and dtype; one flat output of that dtype, `y = a * gate(h)` (the
    /// gate's value stored in the dtype first, as the two ops store it), then
    /// (`Parts::with_tail`) the `n` sums of y over its rows (the bias gradient of the
    /// product y feeds). GPT's `fc1` under autocast: the GELU's gradient and its bias sums in
    /// one pass over a and h.
    GatedSums { gate: UnaryOp },
    /// Layer norm's forward writing `to` instead of x's dtype (on a GPU, after autograd: BF16
    /// autocast's cast of an F32 layer norm before a product, folded in). Inputs as `Normalize`.
    NormalizeTo { eps: f64, to: DType },
    /// Layer norm's whole backward (`Op::LayerNormGrads` with the weight: inputs x, g, w) with
    /// more folded in on a GPU. A fourth input `r` (x's shape and dtype) is added to x's
    /// gradient as it is stored: a residual connection's gradient (F32 and F64). `sums:
    /// Some(t)` adds a third row after the two parameter gradients (`Part::Sums`): the sums
    /// over rows of that gradient (plus r) as rounded to `t`, the bias gradient of the product
    /// it feeds, read from here instead of summing a copy. `copy: Some(t)` leaves the output as
    /// it is: it tells a caller of `fused::layer_norm_grads_with_copy` that x's gradient (plus
    /// r) is also wanted cast to `t`, which the CUDA kernel then writes in the same pass.
    LayerNormGrads { eps: f64, sums: Option<DType>, copy: Option<DType> },
    /// `Attention` written with the heads after T (on a GPU, for q `[B, H, T, D]`): the output
    /// is `[B, T, H, D]`, each row holding the heads' outputs side by side, as an output
    /// projection reads them.
    AttentionHeadsLast { scale: f64, causal: bool },
    /// A mean cross-entropy and its gradient in one op (inputs: logits `[N, C]`, targets
    /// `[N]`), from `cross_entropy`'s mean and its backward: element 0 is the loss (the
    /// `CrossEntropy` rows summed over the `K` targets that are not `ignore_index`, divided by
    /// `K`), then the logits' gradient `[N, C]` of that loss (`CrossEntropyBackward` with
    /// every row's gradient `1 / K`; `Parts::cross_entropy_mean`).
    CrossEntropyMean { ignore_index: Option<i64>, smoothing: f64 },
    /// A linear classifier head, its mean cross-entropy and the head's backward in one op (on
    /// a GPU: one launch, a cluster of blocks; a small batch's head is five launches of latency
    /// otherwise). Inputs: h `[N, H]`, the weight w `[C, H]`, the bias `[C]` and the targets
    /// `[N]`; the logits are `h w^T + bias`. Output (`Parts::linear_cross_entropy_mean`): the loss (as
    /// `CrossEntropyMean`), the weight's gradient `g^T h` `[C, H]` followed
    /// by the bias's `sum(g)` (`MatmulEpilogue::SumLeft`'s layout), then h's gradient `g w`
    /// `[N, H]`, times `step(h)` with `drelu` (h is a ReLU's output).
    LinearCrossEntropyMean { ignore_index: Option<i64>, smoothing: f64, drelu: bool },
}

/// What an op produces: shape and dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct OutMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// Shape and dtype of an op's input, as the shape rules see it.
#[derive(Clone, Copy)]
pub struct InMeta<'a> {
    pub shape: &'a [usize],
    pub dtype: DType,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Full { .. } => "full",
            Op::Arange { .. } => "arange",
            Op::Rand { .. } => "rand",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Scalar { op, .. } => op.name(),
            Op::Where => "where",
            Op::Cast(_) => "to_dtype",
            Op::Reduce { op, .. } => op.name(),
            Op::Softmax { log: false, .. } => "softmax",
            Op::Softmax { log: true, .. } => "log_softmax",
            Op::Normalize { rms: false, .. } => "normalize",
            Op::Normalize { rms: true, .. } => "rms_norm",
            Op::NormalizeBackward { rms: false, .. } => "normalize_backward",
            Op::NormalizeBackward { rms: true, .. } => "rms_norm_backward",
            Op::LayerNormGrads { .. } => "layer_norm_grads",
            Op::SoftmaxBackward { .. } => "softmax_backward",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Op::Matmul => "matmul",
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Narrow { .. } => "narrow",
            Op::Expand(_) => "expand",
            Op::Contiguous => "contiguous",
            Op::IndexSelect { .. } => "index_select",
            Op::IndexAdd { .. } => "index_add",
            Op::Gather { .. } => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::ArgSort { .. } => "argsort",
            Op::Cat { .. } => "cat",
            Op::Assign => "assign",
            Op::UpdateBinary(_) => "update",
            Op::UpdateScalar(..) => "update_scalar",
            Op::Collective { kind, .. } => kind.name(),
            Op::Fused(f) => f.name(),
        }
    }

    /// Views share their input's storage and run no kernel.
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Reshape(_) | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_))
    }

    /// In-place ops write into their first input.
    pub fn is_inplace(&self) -> bool {
        matches!(self, Op::Assign | Op::UpdateBinary(_) | Op::UpdateScalar(..))
    }
}

fn check_dim(op: &'static str, dim: usize, shape: &[usize]) -> Result<()> {
    if dim >= shape.len() {
        return Err(Error::Dim { op, dim: dim as isize, rank: shape.len(), shape: shape.to_vec() });
    }
    Ok(())
}

/// The heads of attention inputs of shape `[B, H.., T, D]`: the product of `H..` (1 below rank 4).
pub fn attention_heads(q: &[usize]) -> usize {
    q[1.min(q.len().saturating_sub(2))..q.len().saturating_sub(2)].iter().product()
}

/// The dtype of `Op::CrossEntropy`'s losses (and of its backward's per-row gradient): F64
/// for F64 logits, else F32, as each row's log-sum-exp is computed; BF16 and F16 logits are
/// read as they are, never copied to F32.
pub fn cross_entropy_loss_dtype(logits: DType) -> DType {
    if logits == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// How many query heads share each key/value head when `Attention`'s q is `[B, H, T, D]` and
/// its k (and v) `[B, H_kv, S, D]` with `H_kv` dividing `H` (grouped-query attention; 1 for
/// equal heads); `None` for shapes that do not pair so. The key length S may differ from T
/// (a decoding step's queries over the cache); for other ranks the leading dims and D match.
pub fn attention_kv_repeat(q: &[usize], k: &[usize]) -> Option<usize> {
    let r = q.len();
    if r < 2 || k.len() != r || q[r - 1] != k[r - 1] {
        return None;
    }
    if q[..r - 2] == k[..r - 2] {
        return Some(1);
    }
    (r == 4 && q[0] == k[0]).then(|| kv_head_repeat(q[1], k[1])).flatten()
}

/// How many of `heads` query heads share each of `kv_heads` key/value heads (grouped-query
/// attention's rule: `kv_heads` divides `heads`), or `None`.
pub fn kv_head_repeat(heads: usize, kv_heads: usize) -> Option<usize> {
    (kv_heads > 0 && heads.is_multiple_of(kv_heads)).then(|| heads / kv_heads)
}

/// The shape of `AttentionBackward`'s output for q of shape `[B, H.., T, D]`: `[B, T, 3, H.., D]`
/// (`[T, 3, D]` for rank 2). dq, dk and dv are its slices along the dim of size 3.
pub fn attention_grads_shape(q: &[usize]) -> Vec<usize> {
    let r = q.len();
    match r {
        0 | 1 => vec![3],
        2 => vec![q[0], 3, q[1]],
        _ => [&[q[0], q[r - 2], 3], &q[1..r - 2], &[q[r - 1]]].concat(),
    }
}
