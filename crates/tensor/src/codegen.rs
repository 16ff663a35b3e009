//! Device-neutral code generation: the C text of each scalar op's expression (shared by the
//! CPU back end's generated C and every CUDA kernel), exact double literals, strided index
//! arithmetic, and the stable hash that keys generated code on disk.

use crate::op::{Distribution, Op};
use crate::DType;

/// A 64-bit FNV-1a hash: stable across Rust versions, so disk-cache keys stay valid.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// An elementwise op's kernel recipe: name prefix, expression of `v0..v2` and the compute
/// type of its `K(..)` constants. Scalars, seeds and offsets are read from `Args` at run time,
/// so one compiled kernel serves every value. `dtypes` are the inputs' dtypes.
pub fn elementwise_expr(op: &Op, dtypes: &[DType]) -> Option<(&'static str, String, &'static str)> {
    let c0 = || dtypes.first().map(|&d| compute_type(d)).unwrap_or("float");
    Some(match op {
        Op::Full { .. } => ("full", "a.s".into(), "double"),
        Op::Arange { .. } => ("arange", "(double)i".into(), "double"),
        Op::Rand { dist: Distribution::Uniform, .. } => ("rand", "k_uniform(a.seed, a.roff, i)".into(), "float"),
        Op::Rand { dist: Distribution::Normal, .. } => ("randn", "k_normal(a.seed, a.roff, i)".into(), "float"),
        Op::Unary(u) => (u.name(), u.c_expr("v0"), c0()),
        Op::Binary(b) => (b.name(), b.c_expr("v0", "v1"), c0()),
        Op::Scalar { op: b, scalar_lhs: true, .. } => (b.name(), b.c_expr("K(a.s)", "v0"), c0()),
        Op::Scalar { op: b, scalar_lhs: false, .. } => (b.name(), b.c_expr("v0", "K(a.s)"), c0()),
        Op::Where => ("where", "(v0 != 0 ? v1 : v2)".into(), compute_type(*dtypes.get(1)?)),
        Op::Cast(_) | Op::Contiguous => ("copy", "v0".into(), c0()),
        Op::Assign => ("assign", "v1".into(), c0()),
        Op::UpdateBinary(b) => (b.name(), b.c_expr("v0", "v1"), c0()),
        Op::UpdateScalar(b, _) => (b.name(), b.c_expr("v0", "K(a.s)"), c0()),
        _ => return None,
    })
}

/// An exact C++ double literal (the bits, so that infinities, NaN and -0.0 survive).
pub(crate) fn double_literal(v: f64) -> String {
    format!("__longlong_as_double({:#x}LL)", v.to_bits() as i64)
}

/// The sizes, offsets and scalars a generated kernel names. A kernel specialised to its
/// shapes writes them as literals; a size-generic one (a dynamic-shape program's) names
/// parameters instead, `z{k}` (64-bit integers) and `f{k}` (doubles), whose values this
/// collects in order, so that one source serves every size and only the values change from
/// launch to launch. Slots go by position, never by value: the text must not depend on which
/// sizes happen to be equal.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Numbers {
    pub generic: bool,
    pub ints: Vec<i64>,
    pub floats: Vec<f64>,
}

impl Numbers {
    pub fn new(generic: bool) -> Numbers {
        Numbers { generic, ints: Vec::new(), floats: Vec::new() }
    }

    /// An integer: `v` with `suffix` (`""`, `"LL"` or `"u"`), or the next integer parameter
    /// (as 32-bit unsigned with the suffix `"u"`).
    pub fn int(&mut self, v: usize, suffix: &str) -> String {
        if !self.generic {
            return format!("{v}{suffix}");
        }
        self.ints.push(v as i64);
        let k = self.ints.len() - 1;
        if suffix == "u" {
            format!("((unsigned)z{k})")
        } else {
            format!("z{k}")
        }
    }

    /// A double: `literal(v)`, or the next double parameter.
    pub fn float(&mut self, v: f64, literal: impl Fn(f64) -> String) -> String {
        if !self.generic {
            return literal(v);
        }
        self.floats.push(v);
        format!("f{}", self.floats.len() - 1)
    }

    /// The parameters' declarations: `long long z0, ..., double f0, ...` (each with `prefix`).
    pub fn params(&self, prefix: &str) -> Vec<String> {
        let ints = (0..self.ints.len()).map(|k| format!("{prefix}long long z{k}"));
        ints.chain((0..self.floats.len()).map(|k| format!("{prefix}double f{k}"))).collect()
    }
}

/// The linear index of element `var` (a linear index over `shape`) in a strided input. With
/// `narrow` (every linear index below 2^32) coordinates use 32-bit division, which is much
/// cheaper on a GPU than 64-bit. A size-generic kernel (`nums.generic`) keeps a coordinate
/// for every dim that moves (a dim of one at this size may be longer at the next).
pub fn strided_index(var: &str, offset: usize, shape: &[usize], strides: &[usize], narrow: bool, nums: &mut Numbers) -> String {
    let mut terms = vec![nums.int(offset, "")];
    let mut inner = 1usize;
    let (v, suffix) = if narrow { (format!("((unsigned)({var}))"), "u") } else { (var.to_string(), "LL") };
    let last = shape.len().saturating_sub(1);
    for d in (0..shape.len()).rev() {
        if (shape[d] > 1 || nums.generic) && strides[d] != 0 {
            let innermost = if nums.generic { d == last } else { inner == 1 };
            let coord = if innermost { v.clone() } else { format!("({v} / {})", nums.int(inner, suffix)) };
            let coord = if d == 0 { coord } else { format!("({coord} % {})", nums.int(shape[d], suffix)) };
            terms.push(format!("(long long){coord} * {}", nums.int(strides[d], "LL")));
        }
        inner *= shape[d];
    }
    terms.join(" + ")
}

/// The type a dtype computes in: f16/bf16 in float, integers in long long.
pub fn compute_type(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => "float",
        DType::F64 => "double",
        DType::I64 | DType::U8 => "long long",
    }
}
