//! CUDA C++ source for Kiln's eager kernels, generated from the op table's scalar expressions
//! (`UnaryOp::c_expr`, `BinaryOp::c_expr`): one definition per op serves the CPU, eager CUDA
//! and, later, fused compiled kernels. Pure text, so it is built and tested without a GPU
//! (CI compiles every kernel family with NVRTC when the library is present).
//!
//! Every kernel starts with `PRELUDE`: storage types for f16/bf16 (converted with PTX, no
//! headers needed), loads to a compute type (float, double or long long), the `k*` math
//! overloads and warp reductions.

use crate::op::{Distribution, Op, ReduceOp, UnaryOp};
use crate::DType;

/// Kernel arguments for elementwise kernels, shared by every family. Mirrors `struct Args`.
pub const MAX_RANK: usize = 8;
/// Operand slots in `Args`: up to three inputs and the output.
pub const SLOTS: usize = 4;

/// Hopper's programmatic dependent launch (`Gpu::launch_ex`): a kernel may be launched while
/// the kernel before it on the stream still runs. So every kernel's first statement waits
/// until that kernel has finished and its writes are visible (before this kernel reads or
/// writes any memory). It then lets the kernel after it be launched early (unless it defines
/// `LATE_NEXT`): that kernel's blocks take room on the SMs once every block of this one has
/// started, and wait there in turn (else once every block of this one has finished). Before
/// sm_90, and in a launch without the attribute, these instructions do nothing.
const PRIOR_WAIT: &str = "\n#if __CUDA_ARCH__ >= 900\n  asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");\n#ifndef LATE_NEXT\n  \
                          asm volatile(\"griddepcontrol.launch_dependents;\" ::: \"memory\");\n#endif\n#endif\n";
/// Defined by the long compute-bound kernels (the Hopper GEMM, attention): they let the next
/// kernel launch only as their blocks finish: the next kernel's blocks waiting beside theirs
/// on the SMs slow the Transformer forward, while the small kernels of a step like MLP b32's
/// gain from launching the next early (BENCHMARKS.md).
pub const LATE_NEXT: &str = "#define LATE_NEXT\n";

/// `src` with `PRIOR_WAIT` as the first statements of every kernel (after
/// the opening brace of each `__global__` function's body: signatures hold no braces).
pub fn waiting_for_prior(src: &str) -> String {
    let mut out = String::with_capacity(src.len() + 256);
    let mut rest = src;
    while let Some(at) = rest.find("__global__") {
        let Some(brace) = rest[at..].find('{') else { break };
        let body = at + brace + 1;
        out.push_str(&rest[..body]);
        out.push_str(PRIOR_WAIT);
        rest = &rest[body..];
    }
    out.push_str(rest);
    out
}

pub const PRELUDE: &str = r#"
struct h16 { unsigned short x; };
struct b16 { unsigned short x; };
struct Args {
  long long n;
  long long off[4];
  long long shape[8];
  long long st[4][8];
  double s;
  unsigned long long seed, roff;
  int rank;
  int pad;
};
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
// Round to nearest even: one instruction from sm_80 (a NaN becomes the canonical one), else
// in integer steps (a NaN keeps its sign and payload, quieted). The software form cost about
// a tenth of the instructions of an instruction-bound BF16 GELU gradient (session 32).
__device__ __forceinline__ unsigned short f2b(float f) {
#if __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
#endif
}
__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ double ld(double v) { return v; }
__device__ __forceinline__ float ld(h16 v) { return h2f(v.x); }
__device__ __forceinline__ float ld(b16 v) { return b2f(v.x); }
__device__ __forceinline__ long long ld(long long v) { return v; }
__device__ __forceinline__ long long ld(unsigned char v) { return v; }
// Stores follow Rust's `as`: float to int saturates and NaN gives 0.
__device__ __forceinline__ long long f2i(double v) {
  if (v != v) return 0;
  if (v >= 9.2233720368547758e18) return 9223372036854775807LL;
  if (v <= -9.2233720368547758e18) return (-9223372036854775807LL - 1);
  return (long long)v;
}
__device__ __forceinline__ unsigned char f2u8(double v) { return v != v ? 0 : v <= 0.0 ? 0 : v >= 255.0 ? 255 : (unsigned char)v; }
__device__ __forceinline__ void st(float* p, double v) { *p = (float)v; }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(float* p, long long v) { *p = (float)v; }
__device__ __forceinline__ void st(double* p, double v) { *p = v; }
__device__ __forceinline__ void st(double* p, long long v) { *p = (double)v; }
__device__ __forceinline__ void st(h16* p, float v) { p->x = f2h(v); }
__device__ __forceinline__ void st(h16* p, double v) { p->x = f2h((float)v); }
__device__ __forceinline__ void st(h16* p, long long v) { p->x = f2h((float)v); }
__device__ __forceinline__ void st(b16* p, float v) { p->x = f2b(v); }
__device__ __forceinline__ void st(b16* p, double v) { p->x = f2b((float)v); }
__device__ __forceinline__ void st(b16* p, long long v) { p->x = f2b((float)v); }
__device__ __forceinline__ void st(long long* p, double v) { *p = f2i(v); }
__device__ __forceinline__ void st(long long* p, long long v) { *p = v; }
__device__ __forceinline__ void st(unsigned char* p, double v) { *p = f2u8(v); }
__device__ __forceinline__ void st(unsigned char* p, long long v) { *p = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v); }
__device__ __forceinline__ float kexp(float x) { return expf(x); }
__device__ __forceinline__ double kexp(double x) { return exp(x); }
// e^x for GELU's density (x <= 0): one `ex2.approx` (about 2 ulp, and 1e-6 relative from the
// scaling at x near -87; subnormal results flushed) where expf's range reduction took eight
// instructions of an instruction-bound kernel. The CPU's generated C keeps the exact exp.
__device__ __forceinline__ float kexp_small(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f)); return y; }
__device__ __forceinline__ double kexp_small(double x) { return exp(x); }
__device__ __forceinline__ float klog(float x) { return logf(x); }
__device__ __forceinline__ double klog(double x) { return log(x); }
__device__ __forceinline__ float ksqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double ksqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float krsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ __forceinline__ double krsqrt(double x) { return 1.0 / sqrt(x); }
__device__ __forceinline__ float ksin(float x) { return sinf(x); }
__device__ __forceinline__ double ksin(double x) { return sin(x); }
__device__ __forceinline__ float kcos(float x) { return cosf(x); }
__device__ __forceinline__ double kcos(double x) { return cos(x); }
__device__ __forceinline__ float ktanh(float x) { return tanhf(x); }
__device__ __forceinline__ double ktanh(double x) { return tanh(x); }
__device__ __forceinline__ float kerf(float x) { return erff(x); }
__device__ __forceinline__ double kerf(double x) { return erf(x); }
__device__ __forceinline__ float kabs(float x) { return fabsf(x); }
__device__ __forceinline__ double kabs(double x) { return fabs(x); }
__device__ __forceinline__ long long kabs(long long x) { return x < 0 ? -x : x; }
__device__ __forceinline__ float kpow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double kpow(double a, double b) { return pow(a, b); }
__device__ __forceinline__ long long kpow(long long a, long long b) {
  unsigned long long r = 1, x = (unsigned long long)a;
  for (long long e = b < 0 ? 0 : b; e > 0; e >>= 1) { if (e & 1) r *= x; x *= x; }
  return (long long)r;
}
__device__ __forceinline__ float kdiv(float a, float b) { return a / b; }
__device__ __forceinline__ double kdiv(double a, double b) { return a / b; }
__device__ __forceinline__ long long kdiv(long long a, long long b) {
  return (b == 0 || (a == (-9223372036854775807LL - 1) && b == -1)) ? 0 : a / b;
}
// The sum over a warp's 32 lanes, in every lane (a fixed order: the same bits every run).
template <class T> __device__ __forceinline__ T kwarp_sum(T x) {
  for (int w = 16; w > 0; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
  return x;
}
template <class T> __device__ __forceinline__ T ksilu_grad(T x) { T s = T(1) / (T(1) + kexp(-x)); return s * (T(1) + x * (T(1) - s)); }
template <class T> __device__ __forceinline__ T kgelu_tanh_grad(T x) {
  T c = T(0.7978845608028654), a = T(0.044715);
  T t = ktanh(c * (x + a * x * x * x));
  return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * c * (T(1) + T(3) * a * x * x);
}
"#;

/// The C++ storage type of a dtype.
pub fn storage_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "h16",
        DType::BF16 => "b16",
        DType::I64 => "long long",
        DType::U8 => "unsigned char",
    }
}

/// The type a dtype computes in: f16/bf16 in float, integers in long long.
pub fn compute_type(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => "float",
        DType::F64 => "double",
        DType::I64 | DType::U8 => "long long",
    }
}

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

/// One elementwise kernel: `out[i] = expr(v0, v1, v2)` over the output's elements, where `vk`
/// is input k loaded in its natural compute type (see `compute_type`); `K(v)` constants are
/// in `compute`. The expression may also use `i` (the linear index) and `a` (the `Args`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Elementwise {
    /// A C++ expression of `v0..v2`, `i` (the element's linear index), `a` (the `Args`).
    pub expr: String,
    pub compute: &'static str,
    pub inputs: Vec<DType>,
    pub out: DType,
    /// Per input: reads `p[off + i]` instead of walking strides.
    pub contiguous: Vec<bool>,
    /// The output walks strides too (in-place updates of a strided destination); the output
    /// is then also input 0's storage (`v0` is read from it).
    pub inplace: bool,
    /// Four elements per thread with aligned vector loads (every operand contiguous, offsets
    /// multiples of four).
    pub vec4: bool,
    /// Four elements per thread over strided operands whose innermost dim is contiguous (or
    /// broadcast) and a multiple of four long: permuted copies, `cat`, slices. Per input, whether
    /// its innermost dim is broadcast (one scalar load for the four). The launcher passes the
    /// innermost dim divided by four and its strides times four.
    pub strided4: Option<Vec<bool>>,
    /// Fewer than 2^32 elements: strided coordinates use 32-bit division (64-bit division
    /// costs several times more, and it is the price of every strided element).
    pub narrow: bool,
}

impl Elementwise {
    /// The kernel's name: readable prefix plus a hash of the whole spec.
    pub fn name(&self, prefix: &str) -> String {
        format!("k_{prefix}_{:012x}", fnv1a(format!("{self:?}").as_bytes()) & 0xffff_ffff_ffff)
    }

    /// The full source (prelude included) and the kernel's name.
    pub fn source(&self, prefix: &str) -> (String, String) {
        let name = self.name(prefix);
        let ot = storage_type(self.out);
        let mut params = vec![format!("{ot}* __restrict__ o")];
        for (k, d) in self.inputs.iter().enumerate() {
            if self.inplace && k == 0 {
                continue; // v0 is read from `o`
            }
            params.push(format!("const {}* __restrict__ p{k}", storage_type(*d)));
        }
        params.push("Args a".into());
        let mut s = format!("{PRELUDE}{PHILOX}\ntypedef {} C;\n#define K(v) ((C)(v))\n", self.compute);
        s += &format!("extern \"C\" __global__ void {name}({}) {{\n", params.join(", "));
        s += "  long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n";
        s += "  long long step = (long long)gridDim.x * blockDim.x;\n";
        if self.vec4 {
            s += &self.vec4_body(ot);
        } else if let Some(bcast) = &self.strided4 {
            s += &self.strided4_body(ot, bcast);
        } else {
            s += &self.scalar_body(ot);
        }
        s += "}\n";
        (s, name)
    }

    fn pointer(&self, k: usize) -> String {
        if self.inplace && k == 0 {
            "o".into()
        } else {
            format!("p{k}")
        }
    }

    /// The element offsets `q{k}` of the strided operands at linear position `var`: one
    /// decomposition over `a.shape` shared by all of them.
    fn strided_offsets(&self, var: &str) -> String {
        let slots: Vec<usize> = (0..self.inputs.len()).filter(|&k| !self.contiguous[k]).collect();
        if slots.is_empty() {
            return String::new();
        }
        let mut b = String::new();
        for &k in &slots {
            b += &format!("    long long q{k} = a.off[{k}];\n");
        }
        if self.narrow {
            b += &format!("    unsigned r = (unsigned){var};\n    for (int d = a.rank - 1; d >= 0; --d) {{\n");
            b += "      unsigned sd = (unsigned)a.shape[d], c = r % sd; r /= sd;\n";
        } else {
            b += &format!("    long long r = {var};\n    for (int d = a.rank - 1; d >= 0; --d) {{\n");
            b += "      long long c = r % a.shape[d]; r /= a.shape[d];\n";
        }
        for &k in &slots {
            b += &format!("      q{k} += (long long)c * a.st[{k}][d];\n");
        }
        b + "    }\n"
    }

    /// Grid-stride loop; strided operands share one decomposition of `i` per element.
    fn scalar_body(&self, ot: &str) -> String {
        let mut b = "  for (long long i = tid; i < a.n; i += step) {\n".to_string();
        b += &self.strided_offsets("i");
        for k in 0..self.inputs.len() {
            let idx = if self.contiguous[k] { format!("a.off[{k}] + i") } else { format!("q{k}") };
            b += &format!("    auto v{k} = ld({}[{idx}]);\n", self.pointer(k));
        }
        let oi = if self.inplace {
            if self.contiguous[0] {
                "a.off[0] + i".to_string()
            } else {
                "q0".into()
            }
        } else {
            "i".into()
        };
        b += &format!("    st(({ot}*)&o[{oi}], {});\n  }}\n", self.expr);
        b
    }

    /// The aligned four-element vector type of each input (`V{k}`) and of the output (`VO`).
    fn vector_types(&self, ot: &str) -> String {
        let mut b = String::new();
        for (k, d) in self.inputs.iter().enumerate() {
            let t = storage_type(*d);
            b += &format!("  struct alignas({}) V{k} {{ {t} v[4]; }};\n", 4 * d.size_in_bytes());
        }
        b + &format!("  struct alignas({}) VO {{ {ot} v[4]; }};\n", 4 * self.out.size_in_bytes())
    }

    /// Four consecutive elements of the innermost dim per step: the strided operands' offsets
    /// are decomposed once per four (`a.shape`'s innermost dim is a quarter of the tensor's).
    fn strided4_body(&self, ot: &str, bcast: &[bool]) -> String {
        let mut b = self.vector_types(ot);
        b += "  long long nv = a.n / 4;\n  for (long long q = tid; q < nv; q += step) {\n";
        b += &self.strided_offsets("q");
        for (k, &bc) in bcast.iter().enumerate() {
            let p = self.pointer(k);
            b += &match (self.contiguous[k], bc) {
                (true, _) => format!("    V{k} x{k} = *reinterpret_cast<const V{k}*>({p} + a.off[{k}] + q * 4);\n"),
                (false, false) => format!("    V{k} x{k} = *reinterpret_cast<const V{k}*>({p} + q{k});\n"),
                (false, true) => format!("    auto s{k} = {p}[q{k}];\n"),
            };
        }
        b += "    VO y;\n#pragma unroll\n    for (int j = 0; j < 4; ++j) {\n      long long i = q * 4 + j;\n";
        for (k, &bc) in bcast.iter().enumerate() {
            let v = if !self.contiguous[k] && bc { format!("s{k}") } else { format!("x{k}.v[j]") };
            b += &format!("      auto v{k} = ld({v});\n");
        }
        b += &format!("      st(&y.v[j], {});\n    }}\n", self.expr);
        let dst = match (self.inplace, self.contiguous[0]) {
            (true, false) => "o + q0",
            (true, true) => "o + a.off[0] + q * 4",
            _ => "o + q * 4",
        };
        b += &format!("    *reinterpret_cast<VO*>({dst}) = y;\n  }}\n");
        b
    }

    /// Four elements per thread through aligned vector types, then a scalar tail.
    fn vec4_body(&self, ot: &str) -> String {
        let mut b = self.vector_types(ot);
        b += "  long long nv = a.n / 4;\n  for (long long q = tid; q < nv; q += step) {\n";
        for k in 0..self.inputs.len() {
            b += &format!("    V{k} x{k} = *reinterpret_cast<const V{k}*>({} + a.off[{k}] + q * 4);\n", self.pointer(k));
        }
        b += "    VO y;\n#pragma unroll\n    for (int j = 0; j < 4; ++j) {\n      long long i = q * 4 + j;\n";
        for k in 0..self.inputs.len() {
            b += &format!("      auto v{k} = ld(x{k}.v[j]);\n");
        }
        b += &format!("      st(&y.v[j], {});\n    }}\n", self.expr);
        let oo = if self.inplace { "a.off[0] + " } else { "" };
        b += &format!("    *reinterpret_cast<VO*>(o + {oo}q * 4) = y;\n  }}\n");
        b += "  for (long long i = nv * 4 + tid; i < a.n; i += step) {\n";
        for k in 0..self.inputs.len() {
            b += &format!("    auto v{k} = ld({}[a.off[{k}] + i]);\n", self.pointer(k));
        }
        b += &format!("    st(&o[{oo}i], {});\n  }}\n", self.expr);
        b
    }
}

/// Philox 4x32-10 and the uniform/normal draws of `rng.rs`, bit for bit.
pub const PHILOX: &str = r#"
__device__ __forceinline__ unsigned int philox_word(unsigned long long seed, unsigned long long n) {
  unsigned long long blk = n / 4;
  unsigned int c0 = (unsigned int)blk, c1 = (unsigned int)(blk >> 32), c2 = 0, c3 = 0;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
    unsigned int n0 = ((unsigned int)(p1 >> 32)) ^ c1 ^ k0, n1 = (unsigned int)p1;
    unsigned int n2 = ((unsigned int)(p0 >> 32)) ^ c3 ^ k1, n3 = (unsigned int)p0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  unsigned int w = n % 4;
  return w == 0 ? c0 : w == 1 ? c1 : w == 2 ? c2 : c3;
}
__device__ __forceinline__ float k_uniform(unsigned long long seed, unsigned long long off, long long i) {
  return (float)(philox_word(seed, off + i) >> 8) * (1.0f / 16777216.0f);
}
__device__ __forceinline__ float k_normal(unsigned long long seed, unsigned long long off, long long i) {
  long long j = i & ~1LL;
  float u1 = 1.0f - k_uniform(seed, off, j), u2 = k_uniform(seed, off, j + 1);
  double r = sqrt(-2.0 * log((double)u1)), th = 6.283185307179586 * (double)u2;
  return (float)((i & 1) == 0 ? r * cos(th) : r * sin(th));
}
"#;

/// How a reduction kernel maps threads to work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceMode {
    /// One warp per output row (short rows).
    Warp,
    /// One block per (row, chunk of the row): long rows, split over blocks when rows are few.
    Block,
    /// One thread per output column, for reductions over outer dims (the kept dim is the
    /// contiguous one): reads are coalesced across threads. Split into chunks over blocks.
    Column,
    /// 32 output columns per block of 32 x 32 threads: each warp reads 32 adjacent columns of
    /// one reduced row, the 32 warps take every 32nd row, and shared memory folds them. For
    /// short column reductions (the partials of `Column`), which one thread per column would
    /// walk serially.
    ColumnTile,
}

/// A reduction: `out[row] = fold(in[row, j] for j < red)` (or, split into chunks, one partial
/// per (row, chunk) that a second pass folds). `one_dim`: the reduced elements of a row sit at
/// `base + j * stride` (else the reduced coordinates walk strides).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reduce {
    pub op: ReduceOp,
    pub input: DType,
    pub out: DType,
    /// The reduced dims coalesce to one (of stride `rst[0]`): no index decomposition.
    pub one_dim: bool,
    pub mode: ReduceMode,
}

/// Arguments of a reduction; mirrors `struct RArgs`.
pub const REDUCE_ARGS: &str = r#"
struct RArgs {
  long long rows, red, off, chunks, chunk_len;
  long long kshape[8], kst[8], rshape[8], rst[8];
  int krank, rrank;
  double scale;
  long long qlen;
};
"#;

const WARP_FOLD: &str = "  for (int w = 16; w > 0; w /= 2) {\n    C bv = __shfl_down_sync(0xffffffffu, av, w); \
                         long long bi = __shfl_down_sync(0xffffffffu, ai, w);\n    comb(av, ai, bv, bi);\n  }\n";

impl Reduce {
    pub fn source(&self) -> (String, String) {
        let name = format!("k_{}_{:012x}", self.op.name(), fnv1a(format!("{self:?}").as_bytes()) & 0xffff_ffff_ffff);
        let (it, ot) = (storage_type(self.input), storage_type(self.out));
        // Accumulate wide (float for half types, double for f64, long long for ints).
        let acc = compute_type(self.input);
        let better = if matches!(self.op, ReduceOp::Max | ReduceOp::ArgMax) { ">" } else { "<" };
        let mut s = format!("{PRELUDE}{REDUCE_ARGS}\ntypedef {acc} C;\n#define K(v) ((C)(v))\n");
        // (value, index) pairs: index -1 is "nothing yet"; NaN wins; ties keep the first index.
        s += &format!(
            "__device__ __forceinline__ void comb(C& av, long long& ai, C bv, long long bi) {{\n{}}}\n",
            if matches!(self.op, ReduceOp::Sum) {
                "  av += bv; ai = 0;\n".to_string()
            } else {
                format!(
                    "  bool take;\n  if (bi < 0) take = false; else if (ai < 0) take = true;\n  \
                     else {{ bool an = av != av, bn = bv != bv;\n    \
                     if (an || bn) take = bn && (!an || bi < ai);\n    \
                     else take = (bv {better} av) || (bv == av && bi < ai); }}\n  \
                     if (take) {{ av = bv; ai = bi; }}\n"
                )
            }
        );
        s += &format!("extern \"C\" __global__ void {name}({ot}* __restrict__ o, const {it}* __restrict__ p, RArgs a) {{\n");
        s += match self.mode {
            ReduceMode::Warp => {
                "  long long row = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32, chunk = 0;\n  \
                 int lane = threadIdx.x % 32, tpr = 32;\n  if (row >= a.rows) return;\n"
            }
            ReduceMode::Block => {
                "  long long row = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;\n  int lane = threadIdx.x, tpr = blockDim.x;\n"
            }
            ReduceMode::Column => {
                "  long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x, chunk = blockIdx.y;\n  \
                 int lane = 0, tpr = 1;\n  if (row >= a.rows) return;\n"
            }
            // Threads past the last column still take part in the block's fold.
            ReduceMode::ColumnTile => {
                "  long long row = blockIdx.x * 32LL + threadIdx.x % 32, chunk = 0;\n  \
                 int lane = threadIdx.x / 32, tpr = 32;\n  bool live = row < a.rows;\n"
            }
        };
        s += "  long long base = a.off, r = row;\n";
        s += "  for (int d = a.krank - 1; d >= 0; --d) { base += (r % a.kshape[d]) * a.kst[d]; r /= a.kshape[d]; }\n";
        s += "  C av = K(0); long long ai = -1;\n";
        s += "  long long j1 = min(a.red, (chunk + 1) * a.chunk_len);\n";
        if self.mode == ReduceMode::ColumnTile {
            s += "  if (!live) j1 = 0;\n";
        }
        // Four loads in flight per thread: a column walk is otherwise bound by load latency.
        s += "#pragma unroll 4\n  for (long long j = chunk * a.chunk_len + lane; j < j1; j += tpr) {\n";
        if self.one_dim {
            s += "    long long q = base + j * a.rst[0];\n";
        } else {
            s += "    long long q = base, t = j;\n";
            s += "    for (int d = a.rrank - 1; d >= 0; --d) { q += (t % a.rshape[d]) * a.rst[d]; t /= a.rshape[d]; }\n";
        }
        s += "    comb(av, ai, (C)ld(p[q]), j);\n  }\n";
        let val = if matches!(self.op, ReduceOp::ArgMax | ReduceOp::ArgMin) { "ai" } else { "av" };
        match self.mode {
            ReduceMode::Column => s += &format!("  st(&o[chunk * a.rows + row], {val});\n}}\n"),
            ReduceMode::Warp => s += &format!("{WARP_FOLD}  if (lane == 0) st(&o[row], {val});\n}}\n"),
            ReduceMode::ColumnTile => {
                s += "  __shared__ C sv[32][33]; __shared__ long long si[32][33];\n";
                s += "  int col = threadIdx.x % 32;\n  sv[lane][col] = av; si[lane][col] = ai;\n  __syncthreads();\n";
                s += "  if (lane != 0 || !live) return;\n";
                s += "  for (int k = 1; k < 32; ++k) comb(av, ai, sv[k][col], si[k][col]);\n";
                s += &format!("  st(&o[row], {val});\n}}\n");
            }
            ReduceMode::Block => {
                s += WARP_FOLD;
                s += "  __shared__ C sv[32]; __shared__ long long si[32];\n";
                s += "  if (lane % 32 == 0) { sv[lane / 32] = av; si[lane / 32] = ai; }\n  __syncthreads();\n";
                s += "  if (lane >= 32) return;\n";
                s += "  av = lane < blockDim.x / 32 ? sv[lane] : K(0); ai = lane < blockDim.x / 32 ? si[lane] : -1;\n";
                s += WARP_FOLD;
                s += &format!("  if (lane == 0) st(&o[blockIdx.x], {val});\n}}\n");
            }
        }
        (s, name)
    }
}

/// Index kernels (index_select, gather, index_add, scatter_add) over contiguous operands seen
/// as `[outer, dim, inner]`. A bad index writes nothing (or zero) and records itself in the
/// device's error word, reported at the next host read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Index {
    pub kind: IndexKind,
    pub dtype: DType,
    /// `Select` or `Add` a warp a row, its lanes along the row (`select_by_rows`), so the
    /// 64-bit divisions come once a row rather than three times an element (element by
    /// element, GPT's token embedding, 16384 rows of 384, and its gradient are slow).
    pub rows: bool,
}

/// Whether `Index::rows` suits a select (or index_add) of `rows` rows of `inner` elements:
/// rows at least a warp wide, and enough of them to give every warp of a full GPU (`sms`
/// multiprocessors) one.
pub fn select_by_rows(rows: usize, inner: usize, sms: usize) -> bool {
    inner >= 32 && rows >= sms * 64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexKind {
    Select,
    Gather,
    Add,
    ScatterAdd,
}

/// Arguments of index kernels; mirrors `struct IArgs`.
pub const INDEX_ARGS: &str = r#"
struct IArgs {
  long long n, outer, size, inner, nidx, code;
  long long ishape[8], bshape[8];
  int rank, dim;
};
// err[0]: op code (0 = no error), err[1]: the bad index, err[2]: the dim's size.
__device__ __forceinline__ bool check_index(long long* err, long long code, long long v, long long size) {
  if (v >= 0 && v < size) return true;
  if (atomicCAS((unsigned long long*)err, 0ull, (unsigned long long)code) == 0ull) { err[1] = v; err[2] = size; }
  return false;
}
"#;

impl Index {
    pub fn source(&self) -> (String, String) {
        let kind = format!("{:?}", self.kind).to_lowercase();
        let name = format!("k_{kind}_{:012x}", fnv1a(format!("{self:?}").as_bytes()) & 0xffff_ffff_ffff);
        let t = storage_type(self.dtype);
        let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {t} T;\n");
        s += &format!(
            "extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ src, const long long* __restrict__ idx, long long* err, IArgs a) {{\n"
        );
        if matches!(self.kind, IndexKind::Select | IndexKind::Add) && self.rows {
            // Row `row` of [outer, nidx, inner]: the output's (select) or the source's (add).
            s += r#"  {
    const long long rows = a.outer * a.nidx, warps = ((long long)gridDim.x * blockDim.x) / 32;
    const int lane = threadIdx.x % 32;
    for (long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
      const long long j = row % a.nidx, ou = row / a.nidx, v = idx[j];
      const bool ok = check_index(err, a.code, v, a.size);
"#;
            s += if self.kind == IndexKind::Select {
                r#"      const T* from = src + (ok ? (ou * a.size + v) * a.inner : 0);
      T* to = o + row * a.inner;
      for (long long e = lane; e < a.inner; e += 32) to[e] = ok ? from[e] : T();
"#
            } else {
                r#"      const T* from = src + row * a.inner;
      T* to = o + (ou * a.size + v) * a.inner;
      if (ok) for (long long e = lane; e < a.inner; e += 32) atomicAdd(&to[e], from[e]);
"#
            };
            s += "    }
  }
}
";
            return (s, name);
        }
        s += "  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < a.n; i += (long long)gridDim.x * blockDim.x) {\n";
        s += &match self.kind {
            // i walks the output [outer, nidx, inner].
            IndexKind::Select => {
                "    long long in_ = i % a.inner, j = (i / a.inner) % a.nidx, ou = i / (a.inner * a.nidx);\n    \
                 long long v = idx[j];\n    \
                 o[i] = check_index(err, a.code, v, a.size) ? src[(ou * a.size + v) * a.inner + in_] : "
                    .to_string()
                    + "T();\n"
            }
            // i walks src [outer, nidx, inner]; o is [outer, size, inner].
            IndexKind::Add => "    long long in_ = i % a.inner, j = (i / a.inner) % a.nidx, ou = i / (a.inner * a.nidx);\n    \
                 long long v = idx[j];\n    \
                 if (check_index(err, a.code, v, a.size)) atomicAdd(&o[(ou * a.size + v) * a.inner + in_], src[i]);\n"
                .to_string(),
            // i walks the index's shape; the input/base is contiguous with shape ishape.
            IndexKind::Gather | IndexKind::ScatterAdd => {
                let mut b = "    long long r = i, off = 0, mul = 1, v = idx[i];\n".to_string();
                b += "    bool ok = check_index(err, a.code, v, a.size);\n";
                b += "    for (int d = a.rank - 1; d >= 0; --d) {\n";
                b += "      long long c = r % a.ishape[d]; r /= a.ishape[d];\n";
                b += "      off += (d == a.dim ? v : c) * mul; mul *= a.bshape[d];\n    }\n";
                if self.kind == IndexKind::Gather {
                    b += "    o[i] = ok ? src[off] : T();\n";
                } else {
                    b += "    if (ok) atomicAdd(&o[off], src[i]);\n";
                }
                b
            }
        };
        s += "  }\n}\n";
        (s, name)
    }
}

/// Parameters one fused Adam launch updates (`blockIdx.y` picks one).
pub const ADAM_MAX_TENSORS: usize = 16;

/// The fused Adam/AdamW update of up to `ADAM_MAX_TENSORS` parameters in one launch: p, m,
/// v (and AMSGrad's running max) in one pass from g, block row `blockIdx.y` over parameter
/// `blockIdx.y`. lr and the step count are read from device memory, so the host never reads
/// them (no synchronisation) and a captured graph stays valid as they change.
pub fn adam_source(dtype: DType, amsgrad: bool) -> (String, String) {
    let name = format!("k_adam_{}{}", format!("{dtype:?}").to_lowercase(), if amsgrad { "_amsgrad" } else { "" });
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\ntypedef {t} T;\n#define MAXT {ADAM_MAX_TENSORS}\n");
    s += "struct AdamArgs { long long n[MAXT]; unsigned long long p[MAXT], g[MAXT], m[MAXT], v[MAXT], x[MAXT]; double b1, b2, eps, wd; int decoupled, pad; };\n";
    s += &format!("extern \"C\" __global__ void {name}(const double* lr, const double* step, AdamArgs a) {{\n");
    s += "  const int j = blockIdx.y;\n  T* __restrict__ p = (T*)a.p[j]; const T* __restrict__ g = (const T*)a.g[j];\n";
    s += "  T* __restrict__ m = (T*)a.m[j]; T* __restrict__ v = (T*)a.v[j]; T* __restrict__ x = (T*)a.x[j];\n";
    s += "  double l = *lr, t = *step;\n";
    s += "  C step_size = (C)(l / (1.0 - pow(a.b1, t))), bc2 = (C)sqrt(1.0 - pow(a.b2, t));\n";
    s += "  C decay = a.decoupled ? (C)(1.0 - l * a.wd) : (C)1, l2 = a.decoupled ? (C)0 : (C)a.wd;\n";
    s += "  C b1 = (C)a.b1, b2 = (C)a.b2, eps = (C)a.eps;\n";
    s += "  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < a.n[j]; i += (long long)gridDim.x * blockDim.x) {\n";
    s += "    C pi = ld(p[i]), gi = ld(g[i]) + l2 * pi;\n";
    s += "    pi = pi * decay;\n";
    s += "    C mi = b1 * ld(m[i]) + ((C)1 - b1) * gi, vi = b2 * ld(v[i]) + ((C)1 - b2) * gi * gi;\n";
    s += "    st(&m[i], mi); st(&v[i], vi);\n";
    if amsgrad {
        s += "    C xi = ld(x[i]); if (vi > xi) xi = vi; st(&x[i], xi); vi = xi;\n";
    } else {
        s += "    (void)x;\n";
    }
    s += "    st(&p[i], pi - step_size * mi / (ksqrt(vi) / bc2 + eps));\n  }\n}\n";
    (s, name)
}

/// CUDA text that all-reduces `acc` (of type C) over a row's threads: a warp with shuffles,
/// or a block through shared memory `sh` (32 slots). `max` folds NaN-first maxima, else sums.
fn row_allreduce(block: bool, max: bool) -> String {
    let f = |a: &str, b: &str| if max { format!("(({b}) > ({a}) || ({b}) != ({b}) ? ({b}) : ({a}))") } else { format!("(({a}) + ({b}))") };
    let mut r = lanes_allreduce(max, 32);
    if block {
        r += "  __syncthreads();\n  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = acc;\n  __syncthreads();\n";
        r += &format!("  acc = sh[0];\n  for (int w = 1; w < (int)(blockDim.x / 32); ++w) {{ C o_ = sh[w]; acc = {}; }}\n", f("acc", "o_"));
    }
    r
}

/// CUDA text that all-reduces `acc` over aligned groups of `width` lanes (a power of two up to
/// 32; nothing for 1) with shuffles. Every lane of the warp must run it.
fn lanes_allreduce(max: bool, width: usize) -> String {
    let f = if max { "(o_ > acc || o_ != o_ ? o_ : acc)" } else { "(acc + o_)" };
    match width {
        0 | 1 => String::new(),
        w => format!("  for (int w = {}; w > 0; w /= 2) {{ C o_ = __shfl_xor_sync(0xffffffffu, acc, w); acc = {f}; }}\n", w / 2),
    }
}

/// A row kernel's name: `k_<stem>_<dtype>`, with `_block` for its block-per-row form.
fn row_kernel_name(stem: &str, dtype: DType, block: bool) -> String {
    format!("k_{stem}_{}{}", format!("{dtype:?}").to_lowercase(), if block { "_block" } else { "" })
}

/// A kernel name's mark of a second dtype: `_{tag}{other}` where it differs from `base`.
fn other_dtype(tag: &str, base: DType, other: DType) -> String {
    if other == base {
        String::new()
    } else {
        format!("_{tag}{}", format!("{other:?}").to_lowercase())
    }
}

/// The thread mapping shared by the row kernels: a warp per row, or a block per row.
fn row_prologue(block: bool) -> &'static str {
    if block {
        "  __shared__ C sh[32];\n  long long row = blockIdx.x; int lane = threadIdx.x, tpr = blockDim.x;\n"
    } else {
        "  long long row = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; int lane = threadIdx.x % 32, tpr = 32;\n  if (row >= a.rows) return;\n"
    }
}

/// The dtype argsort compares keys in: floats in F32 (F64 for F64), integers as they are.
pub fn sort_key_dtype(d: DType) -> DType {
    match d {
        DType::F64 => DType::F64,
        DType::I64 | DType::U8 => DType::I64,
        _ => DType::F32,
    }
}

/// argsort's kernel (see `kernels::argsort`): `phase` 0 loads each row's keys and positions
/// into `[rows, p]` scratch (positions `>= n` pad the row and sort last), 1 is the bitonic
/// compare-exchange of step `(j, k)`, 2 writes each row's first `n` positions. `before(a, b)`
/// is the strict order: padding last, NaN as the largest value, ties by position.
pub fn argsort_source(dtype: DType, descending: bool) -> (String, String) {
    let name = format!("k_argsort_{}{}", format!("{dtype:?}").to_lowercase(), if descending { "_desc" } else { "" });
    let (t, kt) = (storage_type(dtype), storage_type(sort_key_dtype(dtype)));
    let mut s = format!("{PRELUDE}\ntypedef {kt} K;\n");
    s += "__device__ __forceinline__ bool is_nan(K v) { return v != v; }\n";
    s += "__device__ __forceinline__ bool before(K ka, long long ia, K kb, long long ib, long long n) {\n";
    s += "  if ((ia >= n) != (ib >= n)) return ib >= n;\n  if (ia >= n) return ia < ib;\n";
    s += "  const bool na = is_nan(ka), nb = is_nan(kb);\n";
    s += if descending {
        "  if (na != nb) return na;\n  if (!na && ka != kb) return ka > kb;\n"
    } else {
        "  if (na != nb) return nb;\n  if (!na && ka != kb) return ka < kb;\n"
    };
    s += "  return ia < ib;\n}\n";
    s += &format!(
        "extern \"C\" __global__ void {name}(long long* o, const {t}* __restrict__ x, K* keys, long long* pos, long long total, long long n, long long p, long long j, long long k, int phase) {{\n"
    );
    s += r#"  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / p, c = i % p;
    if (phase == 0) {
      pos[i] = c;
      keys[i] = c < n ? (K)ld(x[row * n + c]) : (K)0;
    } else if (phase == 2) {
      if (c < n) o[row * n + c] = pos[i];
    } else {
      const long long partner = c ^ j;
      if (partner <= c) continue;
      const long long a = i, b = row * p + partner;
      const bool up = (c & k) == 0;
      const bool swap = up ? before(keys[b], pos[b], keys[a], pos[a], n) : before(keys[a], pos[a], keys[b], pos[b], n);
      if (swap) {
        const K tk = keys[a]; keys[a] = keys[b]; keys[b] = tk;
        const long long tp = pos[a]; pos[a] = pos[b]; pos[b] = tp;
      }
    }
  }
}
"#;
    (s, name)
}

/// Softmax (or log-softmax) of `scale * x` over the last dim: one warp per row (`block ==
/// false`) or one block per long row. Three sweeps of the row (max, sum of exponentials,
/// write); the row is read through strides (`RArgs`: kept dims, and the last dim's stride in
/// `rst[0]`), the output is contiguous. `causal`: row `i` of each `[qlen, S]` matrix keeps only
/// entries `j <= i` (the rest are written as 0).
pub fn softmax_source(dtype: DType, log: bool, block: bool, causal: bool) -> (String, String) {
    let stem = if log { "log_softmax" } else { "softmax" };
    let name = format!("{}{}", row_kernel_name(stem, dtype, block), if causal { "_causal" } else { "" });
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}{REDUCE_ARGS}\ntypedef {c} C;\n");
    s += &format!("extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ p, RArgs a) {{\n");
    s += row_prologue(block);
    s += "  long long base = a.off, r = row, st_ = a.rst[0];\n";
    s += "  for (int d = a.krank - 1; d >= 0; --d) { base += (r % a.kshape[d]) * a.kst[d]; r /= a.kshape[d]; }\n";
    s += if causal { "  const long long keep = min(a.red, row % a.qlen + 1);\n" } else { "  const long long keep = a.red;\n" };
    s += "  const C sc = (C)a.scale;\n  C acc = -(C)__longlong_as_double(0x7ff0000000000000LL);\n";
    s += "  for (long long j = lane; j < keep; j += tpr) { C v = sc * (C)ld(p[base + j * st_]); acc = (v > acc || v != v) ? v : acc; }\n";
    s += &row_allreduce(block, true);
    s += "  C m = acc; acc = (C)0;\n";
    s += "  for (long long j = lane; j < keep; j += tpr) acc += kexp(sc * (C)ld(p[base + j * st_]) - m);\n";
    s += &row_allreduce(block, false);
    s += "  C sum = acc, lse = m + klog(sum);\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) {\n";
    s += "    if (j >= keep) { st(&o[row * a.red + j], (C)0); continue; }\n    C v = sc * (C)ld(p[base + j * st_]);\n";
    s += if log { "    st(&o[row * a.red + j], v - lse);\n  }\n}\n" } else { "    st(&o[row * a.red + j], kexp(v - m) / sum);\n  }\n}\n" };
    (s, name)
}

/// Cross-entropy over the rows of dense logits `[rows, red]` against I64 targets: the
/// per-row loss (`o[row]`), or (`backward`) the logits' gradient from the per-row gradient
/// `g` (read at `row * gst`: a broadcast mean's gradient has stride 0). Two sweeps for the
/// log-sum-exp, a third for the sum of the logits under label smoothing, then the write. A
/// target outside `0..red` that is not `ignore` is recorded in the error word (code `code`)
/// and its row counts as ignored.
pub fn cross_entropy_source(dtype: DType, backward: bool, block: bool) -> (String, String) {
    let name = row_kernel_name(if backward { "cross_entropy_backward" } else { "cross_entropy" }, dtype, block);
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {c} C;\n");
    s += XENT_ARGS;
    s += &format!(
        "extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ x, const long long* __restrict__ tg, \
         const {t}* __restrict__ g, long long* err, XArgs a) {{\n"
    );
    s += row_prologue(block);
    s += &xent_row(|max| row_allreduce(block, max));
    if backward {
        s += "  const C gr = skip ? (C)0 : (C)ld(g[row * a.gst]);\n";
        s += &xent_grad_loop("o", "");
        s += "}\n";
    } else {
        s += "  (void)g;\n";
        s += XENT_SMOOTHING_SUM;
        s += &row_allreduce(block, false);
        s += "  if (lane == 0) st(&o[row], skip ? (C)0 : lse - on * (C)ld(x[base + t]) - off * acc);\n}\n";
    }
    (s, name)
}

/// Mirrors `kernels::XArgs`.
const XENT_ARGS: &str = "struct XArgs { long long rows, red, ignore, code, gst; double smoothing; int has_ignore, pad; };\n";

/// The row's sum of logits (this thread's part) into `acc`, which label smoothing needs.
const XENT_SMOOTHING_SUM: &str =
    "  acc = (C)0;\n  if (a.smoothing != 0.0) for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(x[base + j]);\n";

/// A cross-entropy row's gradient into `out[base + j]`: `gr` times the softmax less the
/// (smoothed) one-hot target; 0 for a skipped row. Each store runs under `guard` (a C
/// condition, or none).
fn xent_grad_loop(out: &str, guard: &str) -> String {
    let guard = if guard.is_empty() { String::new() } else { format!("if ({guard}) ") };
    format!(
        "  for (long long j = lane; j < a.red; j += tpr) {{\n    C d = kexp((C)ld(x[base + j]) - lse) - (j == t ? on : (C)0) - off;\n    {guard}st(&{out}[base + j], skip ? (C)0 : gr * d);\n  }}\n"
    )
}

/// A cross-entropy row's target check and log-sum-exp (the row's threads in `lane`/`tpr`,
/// whose values `reduce(max)` all-reduces): defines `base`, `t`, `skip`, `lse`, `on`, `off` and
/// leaves `acc` free.
fn xent_row(reduce: impl Fn(bool) -> String) -> String {
    let mut s = String::from("  const long long base = row * a.red, t = tg[row];\n");
    s += "  bool skip = a.has_ignore && t == a.ignore;\n";
    s += "  if (!skip && (t < 0 || t >= a.red)) { if (lane == 0) check_index(err, a.code, t, a.red); skip = true; }\n";
    s += "  C acc = -(C)__longlong_as_double(0x7ff0000000000000LL);\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) { C v = (C)ld(x[base + j]); acc = (v > acc || v != v) ? v : acc; }\n";
    s += &reduce(true);
    s += "  const C m = acc; acc = (C)0;\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) acc += kexp((C)ld(x[base + j]) - m);\n";
    s += &reduce(false);
    s += "  const C lse = m + klog(acc), on = (C)(1.0 - a.smoothing), off = (C)(a.smoothing / (double)a.red);\n";
    s
}

/// The arguments of the narrow and few-rows product kernels (mirrored by `kernels::PArgs`):
/// sizes, A's, B's and the bias's strides, and the epilogue's flags.
const PRODUCT_ARGS: &str = "struct PArgs { long long m, n, k, sam, sak, sbk, sbn, sbias; int has_bias, relu; };\n";

/// The widest product `matmul_narrow_source` takes.
pub const NARROW_MAX_N: usize = 16;

/// `o [m, n] = a [m, k] b [k, n] (+ bias) (ReLU)` for a narrow output (`n`, compiled in, at
/// most `NARROW_MAX_N`: a classifier head), A's rows contiguous: a warp per row, its lanes
/// striding along the row (coalesced) and keeping `n` partial sums, then a butterfly sum per
/// column. cuBLAS's tiles for such a product (MLP b4096's head, `[4096, 256] x [256, 10]`)
/// leave most of the GPU idle. The ReLU maps NaN to 0, as cuBLASLt's epilogue does.
pub fn matmul_narrow_source(dtype: DType, n: usize) -> (String, String) {
    let name = format!("k_matmul_narrow_{}_n{n}", format!("{dtype:?}").to_lowercase());
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\n#define NN {n}\n");
    s += PRODUCT_ARGS;
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({NARROW_THREADS}) {name}({t}* __restrict__ o, const {t}* __restrict__ a, \
         const {t}* __restrict__ b, const {t}* __restrict__ bias, PArgs g) {{\n"
    );
    s += &format!("  const long long row = blockIdx.x * {}LL + threadIdx.x / 32;\n", NARROW_THREADS / 32);
    s += r#"  const int lane = threadIdx.x % 32;
  if (row >= g.m) return;
  C acc[NN];
#pragma unroll
  for (int j = 0; j < NN; ++j) acc[j] = (C)0;
  const auto* ar = a + row * g.sam;
#pragma unroll 4
  for (long long k = lane; k < g.k; k += 32) {
    const C av = (C)ld(ar[k]);
    const auto* bk = b + k * g.sbk;
#pragma unroll
    for (int j = 0; j < NN; ++j) acc[j] += av * (C)ld(bk[j * g.sbn]);
  }
  C v = (C)0;
#pragma unroll
  for (int j = 0; j < NN; ++j) {
    const C x = kwarp_sum(acc[j]);
    if (lane == j) v = x;
  }
  if (lane < NN) {
    if (g.has_bias) v += (C)ld(bias[lane * g.sbias]);
    if (g.relu) v = v > (C)0 ? v : (C)0;
    st(&o[row * NN + lane], v);
  }
}
"#;
    (s, name)
}

/// The most rows `matmul_short_source` takes, and the shortest contraction worth its two launches.
pub const SHORT_MAX_M: usize = 16;
pub const SHORT_MIN_K: usize = 1024;

/// Threads of a `matmul_short_source` block: one column each.
pub const SHORT_THREADS: usize = 256;

/// A product with few rows and a long contraction, `o [m, n] = a [m, k] b [k, n]` (`m`
/// compiled in, at most `SHORT_MAX_M`: a classifier head's weight gradient `g^T h`), B's rows
/// contiguous, in two kernels and no atomics. `..._part`: block (x, y) takes columns x * 256..
/// (a thread each) over the contraction's chunk y, the chunk of A staged in shared memory, and
/// writes its `m` partial sums per column to `part [chunks, m, ldp]`; with `sums`, block x = 0
/// also writes A's row sums over the chunk to column `n` (a bias gradient, `SumLeft`).
/// `..._fold`: a warp per output adds the chunks' partials in a fixed order. cuBLAS splits the
/// contraction for MLP b4096's `[10, 4096] x [4096, 256]` too, then runs its reduction and the
/// bias gradient as two more kernels.
pub fn matmul_short_source(dtype: DType, m: usize, sums: bool) -> (String, String) {
    let name = format!("k_matmul_short_{}_m{m}{}", format!("{dtype:?}").to_lowercase(), if sums { "_sums" } else { "" });
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\n#define MM {m}\n#define CH {SHORT_CHUNK}\n");
    s += "struct SArgs { long long n, k, sam, sak, sbk, ldp, chunks, tail; };\n";
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({SHORT_THREADS}) {name}_part({t}* __restrict__ part, const {t}* __restrict__ a, \
         const {t}* __restrict__ b, SArgs g) {{\n"
    );
    s += r#"  __shared__ C as[MM][CH];
  const long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x, k0 = blockIdx.y * (long long)CH;
  const int len = (int)(g.k - k0 < CH ? g.k - k0 : CH);
  for (int e = threadIdx.x; e < MM * CH; e += blockDim.x) {
    const int i = e / CH, kk = e % CH;
    as[i][kk] = kk < len ? (C)ld(a[i * g.sam + (k0 + kk) * g.sak]) : (C)0;
  }
  __syncthreads();
  C acc[MM];
#pragma unroll
  for (int i = 0; i < MM; ++i) acc[i] = (C)0;
  if (col < g.n) {
#pragma unroll 4
    for (int kk = 0; kk < len; ++kk) {
      const C bv = (C)ld(b[(k0 + kk) * g.sbk + col]);
#pragma unroll
      for (int i = 0; i < MM; ++i) acc[i] += as[i][kk] * bv;
    }
#pragma unroll
    for (int i = 0; i < MM; ++i) st(&part[(blockIdx.y * MM + i) * g.ldp + col], acc[i]);
  }
"#;
    if sums {
        // A warp a row: lanes stride the chunk, then a butterfly sum.
        s += r#"  if (blockIdx.x == 0) {
    const int lane = threadIdx.x % 32;
    for (int i = threadIdx.x / 32; i < MM; i += blockDim.x / 32) {
      C v = (C)0;
      for (int kk = lane; kk < CH; kk += 32) v += as[i][kk];
      v = kwarp_sum(v);
      if (lane == 0) st(&part[(blockIdx.y * MM + i) * g.ldp + g.n], v);
    }
  }
"#;
    }
    s += "}\n";
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({SHORT_THREADS}) {name}_fold({t}* __restrict__ o, const {t}* __restrict__ part, SArgs g) {{\n"
    );
    // A warp per output: lanes stride the chunks, then a butterfly sum (a fixed order).
    s += r#"  const long long e = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (e >= MM * g.ldp) return;
  const long long i = e / g.ldp, c = e % g.ldp;
  C v = (C)0;
#pragma unroll 4
  for (long long y = lane; y < g.chunks; y += 32) v += (C)ld(part[(y * MM + i) * g.ldp + c]);
  v = kwarp_sum(v);
  if (lane == 0) st(&o[c < g.n ? i * g.n + c : g.tail + i], v);
}
"#;
    (s, name)
}

/// The contraction's chunk a `matmul_short_source` block takes: short, so that many blocks
/// share the work and each walks few rows (a chunk of 64 is slower for MLP b4096's weight
/// gradient).
pub const SHORT_CHUNK: usize = 16;

/// The longest contraction `matmul_thin_source` takes (MLP b32's weight gradients, `g^T x`
/// over the batch, at 32).
pub const THIN_MAX_K: usize = 32;

/// Whether the thin-product kernel takes a product (the CUDA back end's dispatch, and
/// `fuse_matmuls`, which fuses a ReLU's gradient only where it does): F32 or F64, a
/// contraction of at most `THIN_MAX_K`, B's rows contiguous.
pub fn thin_takes(dtype: DType, k: usize, b_rows_contiguous: bool) -> bool {
    matches!(dtype, DType::F32 | DType::F64) && (1..=THIN_MAX_K).contains(&k) && b_rows_contiguous
}

/// A product with a short contraction, `o [m, n] = a [m, k] b [k, n]` (`k` compiled in, at
/// most `THIN_MAX_K`: the product by a classifier head's weight in the backward), with
/// `drelu` times `step(h [m, n])` (`MatmulEpilogue::DRelu`: the ReLU's gradient in the same
/// pass): a thread per output, or with `vec4` per four neighbours in a row (B's rows, h and
/// the output read and written as aligned vectors: `n`, their row strides and offsets
/// multiples of 4, B and h contiguous along rows). Consecutive threads walk a row, so a warp
/// reads B's rows and h along memory and A's row as broadcast values. It replaces a cuBLAS
/// product and the gradient's elementwise kernel.
/// With `sums` (`MatmulEpilogue::SumLeft`: a weight gradient `g^T x` and its bias's `sum(g)`)
/// the thread of a row's first column also writes the row's sum of A at `o[at + r]`, which
/// cuBLASLt runs as a kernel of its own.
pub fn matmul_thin_source(dtype: DType, k: usize, drelu: bool, vec4: bool, sums: bool) -> (String, String) {
    let name = format!(
        "k_matmul_thin_{}_k{k}{}{}{}",
        format!("{dtype:?}").to_lowercase(),
        if drelu { "_drelu" } else { "" },
        if vec4 { "_v4" } else { "" },
        if sums { "_sums" } else { "" }
    );
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let w = if vec4 { 4 } else { 1 };
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\ntypedef {t} T;\n#define KK {k}\n#define W {w}\n");
    s += "struct TArgs { long long m, n, sam, sak, sbk, sbn, shm, shn, at; };\nstruct alignas(W * sizeof(T)) VW { T v[W]; };\n";
    s += &format!(
        "extern \"C\" __global__ void {name}(T* __restrict__ o, const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ h, TArgs g) {{\n"
    );
    // Groups of W outputs along a row; 32-bit coordinates where every index fits (64-bit
    // division costs many instructions). With W = 4 the column strides are 1.
    s += r#"  const long long nw = g.n / W, total = g.m * nw;
  const bool narrow = total < (1LL << 31);
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long r = narrow ? (long long)((unsigned)e / (unsigned)nw) : e / nw, c = (e - r * nw) * W;
    C v[W];
#pragma unroll
    for (int q = 0; q < W; ++q) v[q] = (C)0;
#pragma unroll
    for (int j = 0; j < KK; ++j) {
      const C x = (C)ld(a[r * g.sam + j * g.sak]);
      const VW y = *reinterpret_cast<const VW*>(b + j * g.sbk + c * g.sbn);
#pragma unroll
      for (int q = 0; q < W; ++q) v[q] += x * (C)ld(y.v[q]);
    }
"#;
    if drelu {
        // A product, as the unfused `mul` by `step` (a NaN or infinite gradient stays NaN).
        s += "    const VW z = *reinterpret_cast<const VW*>(h + r * g.shm + c * g.shn);\n";
        s += "#pragma unroll\n    for (int q = 0; q < W; ++q) v[q] *= (C)ld(z.v[q]) > (C)0 ? (C)1 : (C)0;\n";
    } else {
        s += "    (void)h;\n";
    }
    if sums {
        s += "    if (c == 0) {\n      C u = (C)0;\n#pragma unroll\n      for (int j = 0; j < KK; ++j) u += (C)ld(a[r * g.sam + j * g.sak]);\n      st(&o[g.at + r], u);\n    }\n";
    }
    s += "    VW out;\n#pragma unroll\n    for (int q = 0; q < W; ++q) st(&out.v[q], v[q]);\n";
    s += "    *reinterpret_cast<VW*>(o + r * g.n + c) = out;\n  }\n}\n";
    (s, name)
}

/// The most rows `matmul_few_source` takes, its columns a block, its threads, and the blocks
/// of a cluster (each a slice of the contraction).
pub const FEW_MAX_M: usize = 32;
pub const FEW_COLS: usize = 16;
pub const FEW_THREADS: usize = 256;
/// 16 blocks a cluster (Hopper's most, `Gpu::allow_big_clusters`), not 8: the thinner slices
/// of the contraction make MLP b32's first layer and its step faster (BENCHMARKS.md).
pub const FEW_SPLIT: usize = 16;
/// The most of its slice of the contraction a `matmul_few_source` block stages at a time.
const FEW_CHUNK: usize = 128;

/// `o [m, n] = a [m, k] b [k, n] (+ bias) (ReLU)`, F32, for a few rows (at most `FEW_MAX_M`:
/// a small batch through a Linear layer) in one launch of thread block clusters (Hopper),
/// where cuBLAS splits the contraction over blocks and adds the parts in a second kernel
/// (as for MLP b32's `[32, 784] x [784, 256]`). Cluster x takes
/// `FEW_COLS` columns; its `FEW_SPLIT` blocks each a slice of the contraction, staged in
/// shared memory as rows along k (`stage_k`: float4 loads along k where they are aligned, else
/// loads along whichever of an operand's dims is contiguous, every load in flight at once). A
/// thread keeps `RPT` rows of one column, reading float4s along k (A's broadcast to the lanes
/// of one row group; B's rows padded so that a quarter-warp's float4s fall in distinct banks). After the cluster's barrier, block z adds its share of the
/// outputs over the blocks' partial sums in order (the same bits every run) and applies the
/// bias and ReLU (NaN to 0, as cuBLASLt's epilogue). These measure slower (BENCHMARKS.md): a
/// block walking the whole contraction chunk by chunk (a wait on memory each chunk), this
/// cluster with loads across rows (32 sectors a request), 32 columns a cluster (64 blocks)
/// with scalar loads along k (issue-bound: 36 instructions a staged element, 8 warps an SM),
/// and 512 threads a block (one row a thread) rather than 256.
pub fn matmul_few_source() -> (String, String) {
    let name = "k_matmul_few_f32".to_string();
    let mut s = format!("{PRELUDE}{CLUSTER}\n#define NT {FEW_COLS}\n#define KC {FEW_CHUNK}\n#define S {FEW_SPLIT}\n");
    s += &format!("#define MR {FEW_MAX_M}\n#define OUTS (MR * NT)\n#define PER (OUTS / S)\n#define KPMAX (KC + 4)\n#define RPT (OUTS / {FEW_THREADS})\n");
    s += PRODUCT_ARGS;
    s += WALK;
    s += FEW_STAGE;
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({FEW_THREADS}) {name}(float* __restrict__ o, const float* __restrict__ a, \
         const float* __restrict__ b, const float* __restrict__ bias, PArgs g) {{\n"
    );
    s += r#"  __shared__ __align__(16) float as[MR * KPMAX];
  __shared__ __align__(16) float bs[NT * KPMAX];
  __shared__ float part[OUTS];
  const int tid = threadIdx.x, c = tid % NT, rg = tid / NT, rank = blockIdx.z;
  // Slices of a multiple of 4: float4 loads stay aligned.
  const long long col0 = blockIdx.x * (long long)NT, slice = ((g.k + S - 1) / S + 3) & ~3LL;
  const long long k0 = rank * slice, k1 = k0 + slice < g.k ? k0 + slice : g.k;
  const int mrows = (int)(g.m < MR ? g.m : MR), ncols = (int)(g.n - col0 < NT ? g.n - col0 : NT);
  float acc[RPT];
#pragma unroll
  for (int q = 0; q < RPT; ++q) acc[q] = 0.f;
  for (long long c0 = k0; c0 < k1; c0 += KC) {
    const int len = (int)(k1 - c0 < KC ? k1 - c0 : KC), len4 = (len + 3) & ~3, kp = len4 % 8 == 4 ? len4 : len4 + 4;
    stage_k(as, kp, a + c0 * g.sak, g.sam, g.sak, mrows, MR, len, len4, tid, blockDim.x);
    stage_k(bs, kp, b + col0 * g.sbn + c0 * g.sbk, g.sbn, g.sbk, ncols, NT, len, len4, tid, blockDim.x);
    __syncthreads();
    const float* ar = as + rg * RPT * kp;
    const float* br = bs + c * kp;
#pragma unroll 2
    for (int kk = 0; kk < len4; kk += 4) {
      const float4 bv = *reinterpret_cast<const float4*>(br + kk);
#pragma unroll
      for (int q = 0; q < RPT; ++q) {
        const float4 av = *reinterpret_cast<const float4*>(ar + q * kp + kk);
        acc[q] += av.x * bv.x; acc[q] += av.y * bv.y; acc[q] += av.z * bv.z; acc[q] += av.w * bv.w;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < RPT; ++q) part[(rg * RPT + q) * NT + c] = acc[q];
  cluster_sync();
  float v = 0.f;
  const int e = rank * PER + tid, i = e / NT, j = e % NT;
  if (tid < PER) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(&part[e]);
#pragma unroll
    for (int p = 0; p < S; ++p) v += ld_cluster1(at, p);
  }
  // Each block's partial sums stay alive until the others have read them; the output is
  // stored after this barrier, so its release has no global store to wait for.
  cluster_sync();
  const long long col = col0 + j;
  if (tid < PER && i < g.m && col < g.n) {
    if (g.has_bias) v += ld(bias[col * g.sbias]);
    if (g.relu) v = v > 0.f ? v : 0.f;
    st(&o[i * g.n + col], v);
  }
}
"#;
    (s, name)
}

/// `matmul_few_source`'s staging: `dst[r * kp + kk]` = the operand at (r, kk) for `r < rows`
/// and `kk < len`, zero elsewhere up to `rmax` rows and `len4` (the float4 reads' end). Loads
/// run along k when its stride is 1 (a weight read as its transpose), else along the rows;
/// one division a thread, then a running index, unrolled so the loads are in flight together.
const FEW_STAGE: &str = r#"__device__ __forceinline__ void stage_k(float* __restrict__ dst, int kp, const float* __restrict__ src,
    long long sr, long long sk, int rows, int rmax, int len, int len4, int tid, int nt) {
  if (sk == 1 && (sr & 3) == 0 && ((unsigned long long)src & 15) == 0) {
    // float4s: quad kq of row r.
    kiln_walk(rmax, len4 / 4, tid, nt, [&](int r, int kq) {
      const int kk = kq * 4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < rows) {
        const float* p = src + r * sr + kk;
        if (kk + 4 <= len) v = *reinterpret_cast<const float4*>(p);
        else { v.x = ld(p[0]); if (kk + 1 < len) v.y = ld(p[1]); if (kk + 2 < len) v.z = ld(p[2]); }
      }
      *reinterpret_cast<float4*>(&dst[r * kp + kk]) = v;
    });
  } else if (sk == 1) {
    kiln_walk(rmax, len4, tid, nt, [&](int r, int kk) { dst[r * kp + kk] = (r < rows && kk < len) ? ld(src[r * sr + kk]) : 0.f; });
  } else {
    kiln_walk(len4, rmax, tid, nt, [&](int kk, int r) { dst[r * kp + kk] = (r < rows && kk < len) ? ld(src[r * sr + kk * sk]) : 0.f; });
  }
}
"#;

/// Calls `f(o, i)` for a thread's share of an `outer x inner` range, the `nt` threads taking
/// consecutive elements (row-major), each stepping on without a division: the staging loops
/// of the kernels that load their operands into shared memory.
const WALK: &str = r#"template <class F> __device__ __forceinline__ void kiln_walk(int outer, int inner, int tid, int nt, F f) {
  int o = tid / inner, i = tid - o * inner;
  const int dout = nt / inner, din = nt - dout * inner;
#pragma unroll 4
  for (; o < outer;) {
    f(o, i);
    i += din; o += dout;
    if (i >= inner) { i -= inner; ++o; }
  }
}
"#;

/// Threads of a `matmul_narrow_source` block (a warp per row).
pub const NARROW_THREADS: usize = 256;

/// Threads `Op::CrossEntropyMean`'s kernel gives a row of `classes` logits: about four logits
/// each, a power of two up to a warp. (A thread per row of 10 logits left most SMs idle and
/// each thread a long serial chain, as in MLP b4096's 4096 rows.)
pub fn xent_mean_threads_per_row(classes: usize) -> usize {
    classes.div_ceil(4).next_power_of_two().min(32)
}

/// Blocks `Op::CrossEntropyMean`'s kernel may launch (its partial sums), and its threads a
/// block.
pub const XENT_MEAN_BLOCKS: usize = 256;
pub const XENT_MEAN_THREADS: usize = 256;
// The last block reads the partial sums a thread each.
const _: () = assert!(XENT_MEAN_BLOCKS <= XENT_MEAN_THREADS);

/// `Op::CrossEntropyMean` in one launch of blocks of 256 threads, `tpr` threads a row
/// (`xent_mean_threads_per_row`). Every block counts the real targets itself (all of them, in
/// the same order), so each knows the gradient's `1 / count` at once and writes its rows'
/// gradients in the same pass as their losses. The loss sums the blocks' partial sums: the last
/// block to finish (a ticket in the module's memory, reset by that block) reads them a thread
/// each and adds them in a fixed order, the same bits every step.
pub fn cross_entropy_mean_source(dtype: DType, tpr: usize) -> (String, String) {
    let name = format!("k_cross_entropy_mean_{}_t{tpr}", format!("{dtype:?}").to_lowercase());
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {c} C;\n");
    s += XENT_ARGS;
    s += &format!("__device__ unsigned int ticket;\n__device__ C partial[{XENT_MEAN_BLOCKS}];\n");
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({XENT_MEAN_THREADS}) {name}({t}* __restrict__ o, const {t}* __restrict__ x, \
         const long long* __restrict__ tg, long long* err, XArgs a) {{\n"
    );
    s += "  __shared__ C sh[32];\n  __shared__ bool last;\n  C acc = (C)0;\n";
    s += "#pragma unroll 8\n  for (long long r = threadIdx.x; r < a.rows; r += blockDim.x) acc += (a.has_ignore && tg[r] == a.ignore) ? (C)0 : (C)1;\n";
    s += &row_allreduce(true, false);
    s += "  const C count = acc, gr = (C)1 / count;\n  C loss = (C)0;\n  __syncthreads();\n";
    // A row's threads may share a warp with rows past the end: those run on a copy of row 0
    // and store nothing, so that every lane takes part in the shuffles.
    s += &format!("  const int lane = threadIdx.x % {tpr}, tpr = {tpr};\n");
    s += &format!("  long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / {tpr};\n");
    s += "  const bool valid = row < a.rows;\n  if (!valid) row = 0;\n";
    s += "  if (a.rows > 0) {\n";
    s += &xent_row(|max| lanes_allreduce(max, tpr));
    s += XENT_SMOOTHING_SUM;
    s += &lanes_allreduce(false, tpr);
    s += "  if (valid && lane == 0 && !skip) loss = lse - on * (C)ld(x[base + t]) - off * acc;\n";
    s += &format!("  {t}* __restrict__ go = o + {};\n", crate::op::XENT_GRAD_AT);
    s += &xent_grad_loop("go", "valid");
    s += "  }\n";
    s += "  acc = loss;\n";
    s += &row_allreduce(true, false);
    s += "  if (threadIdx.x == 0) { partial[blockIdx.x] = acc; __threadfence(); last = atomicAdd(&ticket, 1u) == gridDim.x - 1; }\n";
    // `last` is the same for the whole block, so the block reduction under it is safe.
    s += "  __syncthreads();\n  if (!last) return;\n  __threadfence();\n";
    s += "  acc = threadIdx.x < gridDim.x ? ((volatile C*)partial)[threadIdx.x] : (C)0;\n";
    s += &row_allreduce(true, false);
    s += "  if (threadIdx.x == 0) { st(&o[0], acc / count); ticket = 0; }\n}\n";
    (s, name)
}

/// Threads of each of `linear_xent_source`'s blocks: 16 warps hide more of each other's
/// latency than 8, and MLP b32's head runs faster on 16 than on 8 or 32 (BENCHMARKS.md).
pub const LINEAR_XENT_THREADS: usize = 512;
/// The most blocks (one cluster: 16, the largest Hopper runs once a kernel allows more than
/// the portable 8, `Gpu::allow_big_clusters`) `linear_xent_source` spreads a head over. MLP
/// b32's head runs faster on 16 blocks of 2 rows than on 8 of 4.
pub const LINEAR_XENT_MAX_BLOCKS: usize = 16;
/// The most shared memory a block of `linear_xent_source` stages (the weight and its rows of h,
/// rows padded by one, its logits and every row's gradient), and the most multiply-adds a
/// block does (its rows' logits and h-gradients, its share of `g^T h`). A single block that
/// does all three products of MLP b32's `[32, 256] x [256, 10]` head (246K multiply-adds) is
/// slower than the five launches it replaces (one SM reads shared memory 32 values a cycle).
pub const LINEAR_XENT_MAX_SMEM: usize = 96 * 1024;
pub const LINEAR_XENT_MAX_MACS: usize = 1 << 16;

/// `linear_xent_source`'s split of `n` rows: (rows a block, blocks); with `cluster` false (no
/// thread block clusters: before Hopper) one block takes every row.
pub fn linear_xent_blocks(n: usize, cluster: bool) -> (usize, usize) {
    let per = if cluster { n.div_ceil(LINEAR_XENT_MAX_BLOCKS).max(1) } else { n.max(1) };
    (per, n.div_ceil(per).max(1))
}

/// Shared memory a block of `linear_xent_source` needs for `n` rows, `c` classes and `f`
/// features: the targets, the weight and its rows of h (padded), their logits, every row's
/// gradient, every row of h in the block's share of the columns, and the bias.
pub fn linear_xent_smem_bytes(n: usize, c: usize, f: usize, cluster: bool) -> usize {
    let (per, blocks) = linear_xent_blocks(n, cluster);
    ((per + c) * (f + 1) + per * c + n * c + n * f.div_ceil(blocks) + c) * 4 + n * 8
}

/// Whether `linear_xent_source` runs `Op::LinearCrossEntropyMean` at this size (F32 only):
/// spread over a cluster, each block within `LINEAR_XENT_MAX_MACS`; the shared memory within
/// `LINEAR_XENT_MAX_SMEM` in one block too (a GPU without clusters runs it so).
pub fn linear_xent_fits(dtype: DType, n: usize, c: usize, f: usize) -> bool {
    let (per, blocks) = linear_xent_blocks(n, true);
    let macs = 2 * per * c * f + c * f.div_ceil(blocks) * n;
    dtype == DType::F32 && c > 0 && linear_xent_smem_bytes(n, c, f, false) <= LINEAR_XENT_MAX_SMEM && macs <= LINEAR_XENT_MAX_MACS
}

/// `Op::LinearCrossEntropyMean` in one launch, the rows split over a cluster of blocks
/// (`linear_xent_blocks`; block z takes rows `z * per ..` and columns `z * ceil(F / blocks) ..`).
/// Each block first stages, all loads in flight at once, the weight `[C, F]`, its rows of h
/// (rows padded by one float: no bank conflicts), its columns of h, the bias and the targets
/// (read later, they would cost a second trip to memory); computes
/// its logits `h w^T + b` (a warp per logit), counts every real target, and takes each of its
/// rows' loss and gradient (`xent_row`, a warp a row, the gradient over the logits in place).
/// After the cluster's barrier each block copies every row's gradient from the blocks' shared
/// memory, then writes h's gradient `g w` for its rows (times `step(h)` with `drelu`) and a
/// share of the weight's gradient `g^T h` (its columns); the last block writes the bias's
/// `sum(g)` and the first the loss, the blocks' partial sums added in order (the same bits
/// every run). Classifier heads at small batches: five launches (the head's product, the loss,
/// two products and a bias-gradient kernel) in one. Without `cluster` (before Hopper) one
/// block runs it all.
pub fn linear_xent_source(dtype: DType, cluster: bool) -> (String, String) {
    let name = format!("k_linear_xent_{}{}", format!("{dtype:?}").to_lowercase(), if cluster { "_cluster" } else { "" });
    let t = storage_type(dtype);
    let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {} C;\n{XENT_ARGS}", compute_type(dtype));
    s += "struct LArgs { long long hs0, hs1, ho, wsc, wsj, wo, bsc, bo, f, dw, db, dh; int drelu, per; };\n";
    if cluster {
        s += CLUSTER;
        s += LINEAR_XENT_REMOTE;
    } else {
        s += LINEAR_XENT_ONE_BLOCK;
    }
    s += WALK;
    s += LINEAR_XENT_STAGE;
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({LINEAR_XENT_THREADS}) {name}({t}* __restrict__ o, const {t}* __restrict__ hp, \
         const {t}* __restrict__ wp, const {t}* __restrict__ bp, const long long* __restrict__ tgp, long long* err, XArgs a, LArgs l) {{\n"
    );
    s += &format!("  extern __shared__ __align__(8) C smem[];\n  __shared__ C sh[32], mine, parts[{LINEAR_XENT_MAX_BLOCKS}];\n");
    s += r#"  const int N = (int)a.rows, NC = (int)a.red, F = (int)l.f, FP = F + 1, tid = threadIdx.x, nt = blockDim.x;
  const int B = (int)gridDim.z, rank = (int)blockIdx.z, PER = l.per, r0 = rank * PER;
  const int R = N - r0 < PER ? (N - r0 > 0 ? N - r0 : 0) : PER;
  long long* tg0 = reinterpret_cast<long long*>(smem);
  C* ws = reinterpret_cast<C*>(tg0 + N);
  C* hs = ws + NC * FP;
  C* lg = hs + PER * FP;
  C* ga = lg + PER * NC;
  C* hc = ga + N * NC;
  C* bs = hc + N * ((F + B - 1) / B);
  const int FB = (F + B - 1) / B, j0 = rank * FB, W = F - j0 < FB ? (F - j0 > 0 ? F - j0 : 0) : FB;
  stage(hs, FP, hp + l.ho + r0 * l.hs0, l.hs0, l.hs1, R, F, tid, nt);
  stage(ws, FP, wp + l.wo, l.wsc, l.wsj, NC, F, tid, nt);
  stage(hc, W, hp + l.ho + j0 * l.hs1, l.hs0, l.hs1, N, W, tid, nt);
  for (int c = tid; c < NC; c += nt) bs[c] = (C)ld(bp[l.bo + c * l.bsc]);
  for (int r = tid; r < N; r += nt) tg0[r] = tgp[r];
  __syncthreads();
  for (int e = tid / 32; e < R * NC; e += nt / 32) {
    const int r = e / NC, c = e - r * NC;
    C acc = (C)0;
    for (int j = tid % 32; j < F; j += 32) acc += hs[r * FP + j] * ws[c * FP + j];
"#;
    s += &lanes_allreduce(false, 32);
    s += "    if (tid % 32 == 0) lg[e] = acc + bs[c];\n  }\n";
    // Every warp counts the real targets itself: no block-wide reduction.
    s += "  C acc = (C)0;\n  for (int r = tid % 32; r < N; r += 32) acc += (a.has_ignore && tg0[r] == a.ignore) ? (C)0 : (C)1;\n";
    s += &lanes_allreduce(false, 32);
    s += "  const C count = acc, gr = (C)1 / count;\n  C loss = (C)0;\n  const long long* tg = tg0 + r0;\n  __syncthreads();\n";
    // A warp a row, its lanes over the classes: `xent_row` reads the logits as `x`, the
    // gradient overwrites them. (A thread a row left the other warps waiting on its serial
    // exponentials.) Lane 0 keeps the warp's loss; thread 0 adds the warps' in order.
    s += "  for (long long row = tid / 32; row < R; row += nt / 32) {\n    const C* x = lg; const int lane = tid % 32, tpr = 32;\n";
    s += &xent_row(|max| lanes_allreduce(max, 32));
    s += XENT_SMOOTHING_SUM;
    s += &lanes_allreduce(false, 32);
    s += "  if (!skip) loss += lse - on * x[base + t] - off * acc;\n";
    s += &xent_grad_loop("lg", "");
    s += "  }\n  if (tid % 32 == 0) sh[tid / 32] = loss;\n  __syncthreads();\n";
    s += r#"  if (tid == 0) { C v = (C)0; for (int w = 0; w < nt / 32; ++w) v += sh[w]; mine = v; }
  // Every global store comes after this block's arrivals at both cluster barriers: their
  // releases then have no store to wait for (an arrival after h's gradient's stores waited
  // for them all to reach memory).
  cluster_sync();
#pragma unroll 4
  for (int e = tid; e < N * NC; e += nt) { const int p = e / (PER * NC); ga[e] = remote(&lg[e - p * PER * NC], p); }
  const C part = rank == 0 && tid < B ? remote(&mine, tid) : (C)0;
  cluster_arrive();
  for (int e = tid; e < R * F; e += nt) {
    const int r = e / F, j = e - r * F;
    C v = (C)0;
#pragma unroll 4
    for (int c = 0; c < NC; ++c) v += lg[r * NC + c] * ws[c * FP + j];
    if (l.drelu) v *= hs[r * FP + j] > (C)0 ? (C)1 : (C)0;
    st(&o[l.dh + (r0 + r) * F + j], v);
  }
  if (tid < B) parts[tid] = part;
  __syncthreads();
  if (rank == 0 && tid == 0) { C v = (C)0; for (int p = 0; p < B; ++p) v += parts[p]; st(&o[0], v / count); }
  for (int e = tid; e < NC * W; e += nt) {
    const int c = e / W, j = e - c * W;
    C v = (C)0;
#pragma unroll 8
    for (int r = 0; r < N; ++r) v += ga[r * NC + c] * hc[r * W + j];
    st(&o[l.dw + c * F + j0 + j], v);
  }
  if (rank == B - 1) for (int c = tid; c < NC; c += nt) {
    C v = (C)0;
    for (int r = 0; r < N; ++r) v += ga[r * NC + c];
    st(&o[l.db + c], v);
  }
  cluster_wait();
}
"#;
    (s, name)
}

/// Thread block clusters (Hopper), for `wgmma.rs`'s split fold and `linear_xent_source`:
/// `cluster_sync()`, every thread of every block arrives, then waits for the rest (the
/// cluster's shared-memory writes before it are visible to its reads after), also split in
/// `cluster_arrive()` and `cluster_wait()`; `ld_cluster(addr, rank)` and `ld_cluster1`, the
/// float4 or float at this block's shared address `addr` in block `rank`'s shared memory.
pub const CLUSTER: &str = r#"__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() { cluster_arrive(); cluster_wait(); }
__device__ __forceinline__ unsigned cluster_addr(unsigned addr, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}
__device__ __forceinline__ float4 ld_cluster(unsigned addr, int rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(cluster_addr(addr, rank)) : "memory");
  return v;
}
__device__ __forceinline__ float ld_cluster1(unsigned addr, int rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(addr, rank)) : "memory");
  return v;
}
"#;

/// `linear_xent_source`'s reads of block `rank`'s shared memory at this block's pointer `p`:
/// through the cluster, or (one block, no clusters) its own, with `CLUSTER`'s barriers as the
/// block's.
/// A `rows x cols` block of a strided operand into shared memory (row stride `dld`): one
/// division a thread, then a running (row, column) for each element, so that the copy costs
/// few instructions (a division and 64-bit index an element made the head's staging issue-bound:
/// 630 instructions a warp); unrolled, so each thread's loads are in flight together.
const LINEAR_XENT_STAGE: &str = r#"template <typename T> __device__ __forceinline__ void stage(C* __restrict__ dst, int dld, const T* __restrict__ src,
    long long s0, long long s1, int rows, int cols, int tid, int nt) {
  if (rows <= 0 || cols <= 0) return;
  kiln_walk(rows, cols, tid, nt, [&](int r, int j) { dst[r * dld + j] = (C)ld(src[r * s0 + j * s1]); });
}
"#;
const LINEAR_XENT_REMOTE: &str = "__device__ __forceinline__ float remote(const float* p, int rank) { return ld_cluster1((unsigned)__cvta_generic_to_shared(p), rank); }\n";
const LINEAR_XENT_ONE_BLOCK: &str = r#"__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
__device__ __forceinline__ void cluster_arrive() {}
__device__ __forceinline__ void cluster_wait() {}
__device__ __forceinline__ float remote(const float* p, int) { return *p; }
"#;

/// The gradient of a softmax (`log`: log-softmax) of `scale * x` over the last dim of dense
/// `[rows, red]` buffers, from its output `y` and the output's gradient `g`: one sweep for
/// `sum(g y)` (or `sum(g)`), one for the write.
pub fn softmax_backward_source(dtype: DType, log: bool, block: bool) -> (String, String) {
    let name = row_kernel_name(if log { "log_softmax_backward" } else { "softmax_backward" }, dtype, block);
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\nstruct SArgs {{ long long rows, red; double scale; }};\n");
    s += &format!(
        "extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ y, const {t}* __restrict__ g, SArgs a) {{\n"
    );
    s += row_prologue(block);
    s += "  const long long base = row * a.red; const C sc = (C)a.scale;\n  C acc = (C)0;\n";
    if log {
        s += "  for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(g[base + j]);\n";
        s += &row_allreduce(block, false);
        s += "  for (long long j = lane; j < a.red; j += tpr) st(&o[base + j], sc * ((C)ld(g[base + j]) - kexp((C)ld(y[base + j])) * acc));\n}\n";
    } else {
        s += "  for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(g[base + j]) * (C)ld(y[base + j]);\n";
        s += &row_allreduce(block, false);
        s += "  for (long long j = lane; j < a.red; j += tpr) { C yv = (C)ld(y[base + j]); st(&o[base + j], sc * yv * ((C)ld(g[base + j]) - acc)); }\n}\n";
    }
    (s, name)
}

/// Warps a `column_sums_source` block: each takes every `COLSUM_WARPS`-th row of its chunk.
pub const COLSUM_WARPS: usize = 8;

/// Sums over the rows of `x [rows, n]` (columns contiguous, rows `stride` apart), first pass:
/// block (x, y) folds chunk y's rows of a tile of `32 * v` columns (`v` neighbours a lane,
/// one 16-byte load where `v` is 16 bytes of T) into `part[y * n + c]`, F32 (F64 for F64),
/// adding its warps' sums in a fixed order. A bias's gradient `sum(g)` beside the weight's
/// `g^T x`: cuBLASLt's BGRAD epilogue runs it as a kernel of its own, slower than this one
/// (BENCHMARKS.md). `column_sums_fold_source` adds the chunks. With `gate` (`Op::GatedSums`, x
/// dense): the summed values are made here, `y = x * gate(h)` with the gate's value stored
/// as T first, and stored to `y` as they are summed.
pub fn column_sums_source(dtype: DType, v: usize, gate: Option<UnaryOp>) -> (String, String) {
    let name =
        format!("k_column_sums_{}_v{v}{}", format!("{dtype:?}").to_lowercase(), gate.map_or(String::new(), |u| format!("_{}", u.name())));
    let mut s = format!(
        "{PRELUDE}\ntypedef {} T;\ntypedef {} A;\ntypedef {} C;\n#define K(v) ((C)(v))\n#define V {v}\n#define WARPS {COLSUM_WARPS}\n",
        storage_type(dtype),
        compute_type(dtype),
        compute_type(dtype)
    );
    s += "struct alignas(V * sizeof(T)) VT { T v[V]; };\n";
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__(WARPS * 32) {name}(A* __restrict__ part, const T* __restrict__ x, long long rows, long long n, long long stride, long long chunk, const T* __restrict__ h, T* __restrict__ y) {{\n"
    );
    s += r#"  __shared__ A sums[WARPS][32 * V];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long c = ((long long)blockIdx.x * 32 + lane) * V;
  const long long r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  A acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = (A)0;
  if (c < n) {
#pragma unroll 4
    for (long long r = r0 + warp; r < r1; r += WARPS) {
"#;
    match gate {
        None => {
            s += "      const VT xv = *reinterpret_cast<const VT*>(x + r * stride + c);\n";
            s += "#pragma unroll\n      for (int j = 0; j < V; ++j) acc[j] += (A)ld(xv.v[j]);\n";
        }
        Some(u) => {
            s += "      const VT xv = *reinterpret_cast<const VT*>(x + r * stride + c);\n";
            s += "      const VT hv = *reinterpret_cast<const VT*>(h + r * stride + c);\n      VT yv;\n";
            s += &format!(
                "#pragma unroll\n      for (int j = 0; j < V; ++j) {{\n        const C v0 = (C)ld(hv.v[j]); T q; st(&q, {});\n",
                u.c_expr("v0")
            );
            s += "        st(&yv.v[j], (C)ld(xv.v[j]) * (C)ld(q)); acc[j] += (A)ld(yv.v[j]);\n      }\n";
            s += "      *reinterpret_cast<VT*>(y + r * stride + c) = yv;\n";
        }
    }
    s += r#"    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) sums[warp][lane * V + j] = acc[j];
  __syncthreads();
  for (int t = threadIdx.x; t < 32 * V; t += WARPS * 32) {
    const long long col = (long long)blockIdx.x * 32 * V + t;
    if (col < n) {
      A u = (A)0;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) u += sums[w][t];
      part[blockIdx.y * n + col] = u;
    }
  }
}
"#;
    (s, name)
}

/// Warps a `column_sums_fold_source` block: 32, so that each thread walks few chunks (with 8,
/// GPT's 384 bias columns take 12 blocks of 8 warps walking 66 chunks each, which is slower).
pub const COLSUM_FOLD_WARPS: usize = 32;

/// Sums over the rows, second pass: `o[c] = sum_y part[y * n + c]` over the `chunks`, stored
/// as T. A block takes 32 columns: warp w adds chunks w, w + WARPS, .. (eight loads in flight),
/// then the warps' sums are added in order, so the bits never change; a thread a column
/// walking every chunk would wait on 512 loads in turn for GPT's 384 bias columns.
pub fn column_sums_fold_source(dtype: DType) -> (String, String) {
    let name = format!("k_column_sums_fold_{}", format!("{dtype:?}").to_lowercase());
    let mut s =
        format!("{PRELUDE}\ntypedef {} T;\ntypedef {} A;\n#define WARPS {COLSUM_FOLD_WARPS}\n", storage_type(dtype), compute_type(dtype));
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__(WARPS * 32) {name}(T* __restrict__ o, const A* __restrict__ part, long long n, long long chunks) {{\n"
    );
    s += r#"  __shared__ A sums[WARPS][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long c = (long long)blockIdx.x * 32 + lane;
  A u = (A)0;
  if (c < n) {
#pragma unroll 8
    for (long long y = warp; y < chunks; y += WARPS) u += part[y * n + c];
  }
  sums[warp][lane] = u;
  __syncthreads();
  if (warp == 0 && c < n) {
    A t = (A)0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) t += sums[w][lane];
    st(&o[c], t);
  }
}
"#;
    (s, name)
}

/// What `layer_norm_param_grads_source`'s kernel writes beside the parameter gradients'
/// partials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LnGradsParts {
    /// x's gradient (with the weight `w`).
    pub dx: bool,
    /// A residual gradient `r` added to dx as it is stored.
    pub resid: bool,
    /// A third row of partials: dx's column sums, each value rounded to this dtype first.
    pub sums: Option<DType>,
    /// dx also stored in this dtype.
    pub copy: Option<DType>,
}

/// The longest row `layer_norm_param_grads_source` takes (32 values per lane).
pub const LN_GRADS_MAX_N: usize = 1024;

/// Warps a block of `layer_norm_param_grads_source`'s kernel has (two blocks an SM).
pub const LN_GRADS_WARPS: usize = 8;

/// Dynamic shared memory of a staged `layer_norm_param_grads_source` kernel over rows of `n`
/// values: two row slots a warp, each x's and g's row (and with `LnStage::RowsAndResidual`, r's).
pub fn ln_grads_stage_bytes(n: usize, dtype: DType, gdt: DType, stage: LnStage) -> usize {
    let xs = match stage {
        LnStage::Off => return 0,
        LnStage::Rows => 1,
        LnStage::RowsAndResidual => 2,
    };
    LN_GRADS_WARPS * 2 * n * (xs * dtype.size_in_bytes() + gdt.size_in_bytes())
}

/// What a `layer_norm_param_grads_source` kernel copies ahead into shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LnStage {
    /// Nothing: rows are loaded straight into registers.
    Off,
    /// x's and g's rows.
    Rows,
    /// x's, g's and the residual gradient r's rows (with `LnGradsParts::resid`).
    RowsAndResidual,
}

/// Layer norm's parameter gradients, first pass: block `b` folds rows `b * chunk ..` into
/// `part[b] = [sum g * xhat | sum g]` (`2 n` values of the compute type). Each warp takes a
/// row at a time (mean and variance as `normalize_source` computes them), each lane keeps its
/// `tiles` columns' sums in registers, and the warps add theirs in a fixed order, so the
/// result does not depend on scheduling. With `dx`, the same pass also writes the input's
/// gradient (`normalize_source`'s backward with the weight `w`) from the row it holds, so the
/// layer norm's whole backward reads x and g once. Staged (`stage`; rows of whole 16-byte pieces,
/// 16-byte aligned, `ln_grads_stage_bytes` of dynamic shared memory): each warp copies its
/// next row into shared memory asynchronously while it works on this one; loaded straight into
/// registers, a warp's row would wait on memory between its reductions (BENCHMARKS.md).
/// `LnStage::RowsAndResidual`: r's next row comes with them (read at the store, it would be a
/// wait on memory at the end of every row, which slows GPT BF16's step). `parts.sums` (with dx): a third row of partials, the column sums of dx (plus r) as
/// rounded to that dtype (`Op::NormalizeParamGrads`'s `sums`); the weight is then read from
/// shared memory, so that the row's accumulators take the registers it held. `parts.copy`
/// (with dx): dx (plus r) also stored in that dtype to `cp` (the op's `copy`).
pub fn layer_norm_param_grads_source(dtype: DType, tiles: usize, parts: LnGradsParts, gdt: DType, stage: LnStage) -> (String, String) {
    // g may be in another float dtype (a BF16 product's gradient under autocast), read as C.
    let LnGradsParts { dx, resid, sums, copy } = parts;
    let (sums, copy) = (sums.filter(|_| dx), copy.filter(|_| dx));
    let (staged, stage_r) = (stage != LnStage::Off, stage == LnStage::RowsAndResidual && dx && resid);
    let tag = |what: &str, t: Option<DType>| t.map_or(String::new(), |t| format!("_{what}_{}", storage_type(t).replace(' ', "_")));
    let name = format!(
        "k_ln_{}grads_{}_{tiles}{}{}{}{}{}",
        if dx { "" } else { "param_" },
        storage_type(dtype).replace(' ', "_"),
        other_dtype("g", dtype, gdt),
        if stage_r {
            "_staged_r"
        } else if staged {
            "_staged"
        } else {
            ""
        },
        if resid { "_residual" } else { "" },
        tag("sums", sums),
        tag("copy", copy)
    );
    let (t, c, gt) = (storage_type(dtype), compute_type(dtype), storage_type(gdt));
    let rows = 2 + sums.is_some() as usize;
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\ntypedef {t} X;\ntypedef {gt} G;\nstruct NArgs {{ long long rows, red; double eps; }};\n#define TILES {tiles}\n#define PROWS {rows}\n");
    if let Some(st) = sums {
        s += &format!("typedef {} S;\n", storage_type(st));
    }
    s += &format!("typedef {} Q;\n", storage_type(copy.unwrap_or(dtype)));
    if resid {
        s += "__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }\n";
        s += "__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }\n";
    }
    s += &format!("extern \"C\" __global__ void __launch_bounds__({}) {name}(C* __restrict__ part, const X* __restrict__ x, const G* __restrict__ g, NArgs a, long long chunk, X* __restrict__ dx, const X* __restrict__ w, const X* __restrict__ r, Q* __restrict__ cp) {{\n", LN_GRADS_WARPS * 32);
    s += "  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;\n";
    s += "  const long long r1 = min(a.rows, (blockIdx.x + 1) * chunk); const C n = (C)a.red;\n";
    s += "  C dw[TILES], db[TILES];\n#pragma unroll\n  for (int t = 0; t < TILES; ++t) { dw[t] = (C)0; db[t] = (C)0; }\n";
    if sums.is_some() {
        // The weights in shared memory (registers go to the sums), zeros past the row.
        s += "  C ds[TILES];\n#pragma unroll\n  for (int t = 0; t < TILES; ++t) ds[t] = (C)0;\n";
        s += "  __shared__ C wsh[32 * TILES];\n  for (int j = threadIdx.x; j < 32 * TILES; j += blockDim.x) wsh[j] = j < a.red ? (C)ld(w[j]) : (C)0;\n";
        s += "  __syncthreads();\n#define WR(t) wsh[lane + 32 * (t)]\n";
    } else if dx {
        // The lane's columns are the same in every row: their weights are loaded once.
        s += "  C wr[TILES];\n#pragma unroll\n  for (int t = 0; t < TILES; ++t) wr[t] = lane + 32LL * t < a.red ? (C)ld(w[lane + 32LL * t]) : (C)0;\n";
        s += "#define WR(t) wr[t]\n";
    }
    let (xrow, grow) = if staged {
        // Slot s of this warp: the row's x, then its g (then its r). A fetch always commits a
        // group (empty past the warp's rows), so that waiting for all but the newest is this row's.
        s += "  extern __shared__ __align__(16) unsigned char dyn[];\n";
        s += &format!("  const int x_bytes = (int)a.red * (int)sizeof(X), g_bytes = (int)a.red * (int)sizeof(G), slot_bytes = {} * x_bytes + g_bytes;\n", 1 + stage_r as u8);
        s += "  unsigned char* mine = dyn + warp * 2 * slot_bytes;\n";
        s += "  auto fetch = [&](long long row, int slot) {\n    if (row < r1) {\n";
        s += "      const unsigned dst = (unsigned)__cvta_generic_to_shared(mine + slot * slot_bytes);\n";
        s += "      const char* xs = (const char*)(x + row * a.red); const char* gs = (const char*)(g + row * a.red);\n";
        s += "      for (int o = lane * 16; o < x_bytes; o += 512) asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(dst + o), \"l\"(xs + o));\n";
        s += "      for (int o = lane * 16; o < g_bytes; o += 512) asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(dst + x_bytes + o), \"l\"(gs + o));\n";
        if stage_r {
            s += "      const char* rs = (const char*)(r + row * a.red);\n";
            s += "      for (int o = lane * 16; o < x_bytes; o += 512) asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(dst + x_bytes + g_bytes + o), \"l\"(rs + o));\n";
        }
        s += "    }\n    asm volatile(\"cp.async.commit_group;\" ::);\n  };\n";
        s += "  int slot = 0;\n  fetch(blockIdx.x * chunk + warp, 0);\n";
        s += "  for (long long row = blockIdx.x * chunk + warp; row < r1; row += nw, slot ^= 1) {\n";
        s += "    fetch(row + nw, slot ^ 1);\n    asm volatile(\"cp.async.wait_group 1;\" ::: \"memory\");\n    __syncwarp();\n";
        s += "    const X* xs = (const X*)(mine + slot * slot_bytes); const G* gs = (const G*)(mine + slot * slot_bytes + x_bytes);\n";
        if stage_r {
            s += "    const X* rs = (const X*)(mine + slot * slot_bytes + x_bytes + g_bytes);\n";
        }
        ("xs[j]", "gs[j]")
    } else {
        s += "  for (long long row = blockIdx.x * chunk + warp; row < r1; row += nw) {\n";
        ("x[base + j]", "g[base + j]")
    };
    // The row's x and g are loaded once into registers (all loads in flight together); the
    // mean and variance sum them in `normalize_source`'s order (warp sums).
    s += "    const long long base = row * a.red; C xr[TILES], gr[TILES], acc = (C)0;\n";
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) {\n      const long long j = lane + 32LL * t;\n";
    s += &format!("      xr[t] = j < a.red ? (C)ld({xrow}) : (C)0; gr[t] = j < a.red ? (C)ld({grow}) : (C)0;\n    }}\n");
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) if (lane + 32LL * t < a.red) acc += xr[t];\n";
    s += &row_allreduce(false, false);
    s += "    const C mean = acc / n; acc = (C)0;\n";
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) if (lane + 32LL * t < a.red) { C d = xr[t] - mean; acc += d * d; }\n";
    s += &row_allreduce(false, false);
    s += "    const C rstd = (C)1 / ksqrt(acc / n + (C)a.eps);\n";
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) { xr[t] = (xr[t] - mean) * rstd; dw[t] += gr[t] * xr[t]; db[t] += gr[t]; }\n";
    if dx {
        // dx = rstd (gw - mean(gw) - xhat mean(gw xhat)), xr now holding xhat.
        s += "    acc = (C)0;\n#pragma unroll\n    for (int t = 0; t < TILES; ++t) acc += gr[t] * WR(t);\n";
        s += &row_allreduce(false, false);
        s += "    const C mg = acc / n; acc = (C)0;\n";
        s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) acc += gr[t] * WR(t) * xr[t];\n";
        s += &row_allreduce(false, false);
        s += "    const C mgx = acc / n;\n";
        s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) {\n      const long long j = lane + 32LL * t;\n";
        // With a residual gradient, added after dx is rounded as eager stores it (no FMA).
        s += "      if (j < a.red) {\n        X v; st(&v, rstd * (gr[t] * WR(t) - mg - xr[t] * mgx));\n";
        if resid {
            s += &format!("        st(&v, add_rn(ld(v), ld({})));\n", if stage_r { "rs[j]" } else { "r[base + j]" });
        }
        s += "        dx[base + j] = v;\n";
        if sums.is_some() {
            // Summed as the product's operand holds it: rounded to S.
            s += "        S q; st(&q, ld(v)); ds[t] += (C)ld(q);\n";
        }
        if copy.is_some() {
            s += "        { Q c; st(&c, ld(v)); cp[base + j] = c; }\n";
        }
        s += "      }\n    }\n";
    }
    if staged {
        // Every lane has read the slot before the next iteration's fetch refills it.
        s += "    __syncwarp();\n";
    }
    s += "  }\n";
    s += "  __shared__ C sh[PROWS * 32 * TILES];\n";
    s += "  for (int w = 0; w < nw; ++w) {\n    if (warp == w) {\n#pragma unroll\n      for (int t = 0; t < TILES; ++t) {\n";
    s += "        const long long j = lane + 32LL * t;\n        if (j < a.red) { sh[j] = (w ? sh[j] : (C)0) + dw[t]; sh[a.red + j] = (w ? sh[a.red + j] : (C)0) + db[t];";
    s += if sums.is_some() { " sh[2 * a.red + j] = (w ? sh[2 * a.red + j] : (C)0) + ds[t]; }\n" } else { " }\n" };
    s += "      }\n    }\n    __syncthreads();\n  }\n";
    s += "  for (long long j = threadIdx.x; j < PROWS * a.red; j += blockDim.x) part[blockIdx.x * PROWS * a.red + j] = sh[j];\n}\n";
    (s, name)
}

/// Layer norm's normalisation over the last dim of a dense buffer (`affine`: times `w`, plus
/// `b`, per column), or (`backward`) its input gradient from `x` and the output gradient `g`
/// (`affine`: g times `w`): the row's mean and variance (two sweeps), then for the backward
/// the sums of `g` and `g xhat`, then the write. Arguments: out, x, g (backward), args, w,
/// b (the forward's `affine`). The output is written in `out` (x's dtype, or the forward's
/// folded cast: `Op::Normalize`'s `to`).
pub fn normalize_source(dtype: DType, backward: bool, affine: bool, block: bool, out: DType) -> (String, String) {
    let kind = match (backward, affine) {
        (true, true) => "layer_norm_backward",
        (true, false) => "normalize_backward",
        (false, true) => "layer_norm",
        (false, false) => "normalize",
    };
    let name = row_kernel_name(kind, dtype, block) + &other_dtype("to_", dtype, out);
    let (t, c, ot) = (storage_type(dtype), compute_type(dtype), storage_type(out));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\nstruct NArgs {{ long long rows, red; double eps; }};\n");
    s += &format!(
        "extern \"C\" __global__ void {name}({ot}* __restrict__ o, const {t}* __restrict__ x, const {t}* __restrict__ g, NArgs a, const {t}* __restrict__ w, const {t}* __restrict__ b) {{\n"
    );
    s += row_prologue(block);
    s += "  const long long base = row * a.red; const C n = (C)a.red;\n  C acc = (C)0;\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(x[base + j]);\n";
    s += &row_allreduce(block, false);
    s += "  const C mean = acc / n; acc = (C)0;\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) { C d = (C)ld(x[base + j]) - mean; acc += d * d; }\n";
    s += &row_allreduce(block, false);
    s += "  const C rstd = (C)1 / ksqrt(acc / n + (C)a.eps);\n";
    if backward {
        // The gradient of xhat: g, times the weight with `affine`.
        let gj = if affine { "((C)ld(g[base + j]) * (C)ld(w[j]))" } else { "(C)ld(g[base + j])" };
        s += &format!("#define GJ {gj}\n");
        s += "  acc = (C)0;\n  for (long long j = lane; j < a.red; j += tpr) acc += GJ;\n";
        s += &row_allreduce(block, false);
        s += "  const C mg = acc / n; acc = (C)0;\n";
        s += "  for (long long j = lane; j < a.red; j += tpr) acc += GJ * (((C)ld(x[base + j]) - mean) * rstd);\n";
        s += &row_allreduce(block, false);
        s += "  const C mgx = acc / n;\n";
        s += "  for (long long j = lane; j < a.red; j += tpr) {\n";
        s += "    C xh = ((C)ld(x[base + j]) - mean) * rstd;\n    st(&o[base + j], rstd * (GJ - mg - xh * mgx));\n  }\n}\n";
    } else {
        let affine = if affine { " * (C)ld(w[j]) + (C)ld(b[j])" } else { "" };
        s += &format!("  (void)g;\n  for (long long j = lane; j < a.red; j += tpr) st(&o[base + j], ((C)ld(x[base + j]) - mean) * rstd{affine});\n}}\n");
    }
    (s, name)
}

/// The widest F32 row `normalize_rows_source` holds in registers (eight float4s a lane).
pub const LN_ROWS_MAX_N: usize = 1024;

/// Layer norm's forward for F32 rows of `32 * 4 * tiles` values (`tiles <= 8`), a warp per row
/// held in registers: each lane loads its `tiles` float4s at once, so the row costs one trip to
/// memory where `normalize_source`'s loop makes one a value (faster for rows such as the
/// Transformer's 320 of 512). Same arguments; all pointers 16-byte aligned. The output is
/// written in `out`: F32, or F16/BF16 (a folded cast, four values as one 8-byte store).
pub fn normalize_rows_source(tiles: usize, affine: bool, out: DType) -> (String, String) {
    let name = format!("k_layer_norm_rows{tiles}_f32{}{}", if affine { "" } else { "_plain" }, other_dtype("to_", DType::F32, out));
    let ot = storage_type(out);
    let mut s = format!("{PRELUDE}\ntypedef float C;\nstruct NArgs {{ long long rows, red; double eps; }};\n#define T {tiles}\n");
    s += match out {
        DType::BF16 => "__device__ __forceinline__ unsigned pack2(float a, float b) { return f2b(a) | ((unsigned)f2b(b) << 16); }\n",
        DType::F16 => "__device__ __forceinline__ unsigned pack2(float a, float b) { return f2h(a) | ((unsigned)f2h(b) << 16); }\n",
        _ => "",
    };
    s += &format!(
        "extern \"C\" __global__ void {name}({ot}* __restrict__ o, const float* __restrict__ x, const float* __restrict__ g, NArgs a, const float* __restrict__ w, const float* __restrict__ b) {{\n"
    );
    s += "  (void)g;\n  const long long row = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; const int lane = threadIdx.x % 32;\n";
    s += "  if (row >= a.rows) return;\n  const float4* xr = (const float4*)(x + row * a.red);\n  float4 v[T];\n  C acc = 0.f;\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) v[t] = __ldg(xr + lane + 32 * t);\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) acc += (v[t].x + v[t].y) + (v[t].z + v[t].w);\n";
    s += &row_allreduce(false, false);
    s += "  const C n = (C)a.red, mean = acc / n;\n  acc = 0.f;\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) {\n    const float4 d = make_float4(v[t].x - mean, v[t].y - mean, v[t].z - mean, v[t].w - mean);\n";
    s += "    acc += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);\n  }\n";
    s += &row_allreduce(false, false);
    s += "  const C rstd = 1.f / ksqrt(acc / n + (C)a.eps);\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) {\n    const int j = lane + 32 * t;\n";
    s += "    float4 y = make_float4((v[t].x - mean) * rstd, (v[t].y - mean) * rstd, (v[t].z - mean) * rstd, (v[t].w - mean) * rstd);\n";
    if affine {
        s += "    const float4 wj = __ldg((const float4*)w + j), bj = __ldg((const float4*)b + j);\n";
        s += "    y = make_float4(y.x * wj.x + bj.x, y.y * wj.y + bj.y, y.z * wj.z + bj.z, y.w * wj.w + bj.w);\n";
    }
    s += if out == DType::F32 {
        "    ((float4*)(o + row * a.red))[j] = y;\n  }\n}\n"
    } else {
        "    ((uint2*)(o + row * a.red))[j] = make_uint2(pack2(y.x, y.y), pack2(y.z, y.w));\n  }\n}\n"
    };
    (s, name)
}

/// Where a fused member's argument comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedSrc {
    Input(usize),
    Member(usize),
}

/// An input of a fused kernel: read at `offset + i` when `strides` is `None`, else at
/// `offset + sum(coord_d * strides_d)` over `shape` (broadcasts have stride 0). With `lead`,
/// the value is output `r` of the kernel's lead group, read from a register (its buffer is
/// still passed: the kernel's last block writes it). With `fed`, the value is a short
/// product computed where it is read, its left operand at `offset` of this input's buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FusedInput {
    pub dtype: DType,
    pub offset: usize,
    pub strided: Option<(Vec<usize>, Vec<usize>)>,
    pub lead: Option<usize>,
    pub fed: Option<Fed>,
}

/// A product with a short contraction computed by the group that reads it (a weight gradient
/// `g^T x` at a small batch, fed to its optimizer update: no launch of its own, and the
/// gradient never written out and read back). Element `i` of the group, at row `r = i / cols`
/// and column `c = i % cols`, is `sum_t a[r sa[0] + t sa[1]] b[t sb[0] + c sb[1]]` over the
/// `k` terms in order (as the thin-product kernel adds them), a from the input's `offset` and
/// b (passed right after a) from `b.0`; with `b` None it is the sum of a's row `r`
/// (`MatmulEpilogue::SumLeft`'s sums, `cols` 1). F32 or F64.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fed {
    pub k: usize,
    pub cols: usize,
    pub a: [usize; 2],
    pub b: Option<(usize, [usize; 2])>,
}

impl Fed {
    /// The elements of a and of b a group of `n` elements reads up to (exclusive), from the
    /// offsets.
    pub fn extents(&self, offset: usize, n: usize) -> (usize, Option<usize>) {
        let (rows, last_t) = (n.div_ceil(self.cols.max(1)).max(1), self.k.max(1) - 1);
        let a = offset + (rows - 1) * self.a[0] + last_t * self.a[1] + 1;
        (a, self.b.map(|(at, sb)| at + last_t * sb[0] + (self.cols.max(1) - 1) * sb[1] + 1))
    }

    /// Whether four neighbouring elements can be made from aligned vector reads: four columns
    /// of one row from b's rows, or four rows' sums from a's columns.
    fn vec4(&self, offset: usize) -> bool {
        match self.b {
            Some((at, sb)) => self.cols % 4 == 0 && sb[1] == 1 && at % 4 == 0 && sb[0] % 4 == 0,
            None => self.cols == 1 && self.a[0] == 1 && offset % 4 == 0 && self.a[1] % 4 == 0,
        }
    }

    /// The value (or with `vec` four values as `VI{k}`) of input `k` of group `j` at linear
    /// element `i`.
    fn value(&self, x: &FusedInput, (j, k): (usize, usize), i: &str, narrow: bool, vec: bool) -> String {
        let (r, c) = match narrow {
            true => (format!("((unsigned)({i}) / {}u)", self.cols), format!("((unsigned)({i}) % {}u)", self.cols)),
            false => (format!("(({i}) / {}LL)", self.cols), format!("(({i}) % {}LL)", self.cols)),
        };
        let t = storage_type(x.dtype);
        let (w, one) = if vec { (format!("4, VI{k}"), "") } else { (format!("1, kiln_v1<{t}>"), ".v[0]") };
        let a = format!("p{j}_{k} + {} + (long long){r} * {}LL", x.offset, self.a[0]);
        let call = match self.b {
            Some((at, sb)) => {
                let b = format!("p{j}_{k}b + {at} + (long long){c} * {}LL", sb[1]);
                format!("kiln_fed_dot<{}, {w}>({a}, {}LL, {b}, {}LL)", self.k, self.a[1], sb[0])
            }
            None => format!("kiln_fed_sum<{}, {w}>({a}, {}LL)", self.k, self.a[1]),
        };
        call + one
    }
}

/// One op of a fused kernel: an elementwise `Op` over earlier members or inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedMember {
    pub op: Op,
    pub args: Vec<FusedSrc>,
    pub dtype: DType,
}

impl FusedMember {
    /// A reduction member: a folding group's sum (`fold_loop`).
    fn is_sum(&self) -> bool {
        matches!(self.op, Op::Reduce { .. })
    }
}

/// A compiled graph's fusion group: per element, each input is loaded once, the members run
/// in order in registers, and `outputs` (member indices) are stored densely. Shapes and
/// strides are literals: a compiled graph is specialised to its shapes.
///
/// A group may end in full sums (`Op::Reduce` members: every element of one member or input
/// into one value), followed by scalar members over those sums: then one block loops over the
/// `n` elements, folds each sum across its threads, and thread 0 runs the scalar members
/// (`after_fold`). That is how a mean loss (per-row losses, the count of real targets, the
/// division and its gradient's scale) becomes one launch.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedGroup {
    pub n: usize,
    pub inputs: Vec<FusedInput>,
    pub members: Vec<FusedMember>,
    pub outputs: Vec<usize>,
}

/// One kernel running one or more independent groups, each over its own range of blocks
/// (horizontal fusion: e.g. every parameter's optimizer update in one launch). Parameters
/// are each group's outputs then inputs, group after group.
///
/// With `lead`, `groups[0]` is a scalar group (one element, no sums, e.g. AdamW's step count
/// and bias corrections) that every thread computes first, and the other groups read its
/// outputs from registers (`FusedInput::lead`). It gets no blocks: the grid's last block to
/// finish stores its outputs, counted by a ticket (a `u32` that is zero between launches,
/// passed last), since an output may be state the lead reads (the step count).
///
/// With `copies`, that last block also copies `copies` byte ranges (parameters `c{i}s`,
/// `c{i}d`, `c{i}n` before the ticket; none where `c{i}d` is null): the step's outputs into
/// the caller's tensors when this is a captured step's last launch, so that the graph needs
/// no copy node after it.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedKernel {
    pub name: String,
    pub groups: Vec<FusedGroup>,
    pub lead: bool,
    pub copies: usize,
}

/// Threads per block of fused kernels, and the most blocks one group gets (grid-stride beyond).
pub const FUSED_BLOCK: usize = 256;
const FUSED_MAX_BLOCKS: usize = 2048;

impl FusedGroup {
    /// Elements per thread of the vector path (aligned vector loads and stores), or 1 for the
    /// scalar loop: 8 where every input loaded is 16-bit (a 16-byte load each, as an F32
    /// input's four make: with 8-byte loads too few bytes are in flight to reach the
    /// bandwidth), else 4; the length a multiple of it and every input read that many at a
    /// time (`vec_read`).
    pub fn width(&self) -> usize {
        if self.folds() {
            return 1;
        }
        let loads_16bit = self.inputs.iter().filter(|x| x.lead.is_none()).all(|x| x.dtype.size_in_bytes() == 2);
        let fits = |w: usize| self.n >= w && self.n % w == 0 && self.inputs.iter().all(|x| vec_read(x, w).is_some());
        [8, 4].into_iter().filter(|&w| w == 4 || loads_16bit).find(|&w| fits(w)).unwrap_or(1)
    }

    /// Whether the group takes the vector path (`width` above 1).
    pub fn vectorised(&self) -> bool {
        self.width() > 1
    }

    /// Whether the group ends in sums folded by one block.
    pub fn folds(&self) -> bool {
        self.members.iter().any(FusedMember::is_sum)
    }

    /// Elements of each output: one for a value computed after the fold, else `n`.
    pub fn output_lens(&self) -> Vec<usize> {
        let after = if self.folds() { self.after_fold() } else { vec![] };
        self.outputs.iter().map(|&m| if after.get(m) == Some(&true) { 1 } else { self.n }).collect()
    }

    /// Members computed once after the fold: the sums and every member reading one.
    fn after_fold(&self) -> Vec<bool> {
        let mut after = vec![false; self.members.len()];
        for (q, m) in self.members.iter().enumerate() {
            after[q] = m.is_sum() || m.args.iter().any(|a| matches!(*a, FusedSrc::Member(j) if after[j]));
        }
        after
    }

    /// Whether element indices fit 32 bits (cheaper index arithmetic).
    fn narrow(&self) -> bool {
        self.n <= u32::MAX as usize
    }

    /// Blocks this group gets in its kernel's grid.
    pub fn blocks(&self) -> usize {
        if self.folds() {
            return 1;
        }
        let items = self.n / self.width();
        items.div_ceil(FUSED_BLOCK).clamp(1, FUSED_MAX_BLOCKS)
    }
}

/// An exact C++ double literal (the bits, so that infinities, NaN and -0.0 survive).
fn double_literal(v: f64) -> String {
    format!("__longlong_as_double({:#x}LL)", v.to_bits() as i64)
}

/// How the vector path reads an input `w` elements at a time: `w` aligned neighbours
/// (`Dense` from its offset, or `Rows`: a strided input whose last dim is contiguous, a
/// multiple of `w` long and aligned), or one value for all `w` (`Splat`: broadcast along
/// a last dim that is a multiple of `w` long, such as a bias over rows).
enum VecRead {
    Dense,
    Rows,
    Splat,
    /// Four values of a fed product (`Fed::vec4`).
    Fed,
}

fn vec_read(x: &FusedInput, w: usize) -> Option<VecRead> {
    if x.lead.is_some() {
        return Some(VecRead::Splat);
    }
    if let Some(f) = &x.fed {
        return (w == 4 && f.vec4(x.offset)).then_some(VecRead::Fed);
    }
    let Some((shape, strides)) = &x.strided else { return (x.offset % w == 0).then_some(VecRead::Dense) };
    let last = shape.len().checked_sub(1)?;
    if shape[last] % w != 0 {
        return None;
    }
    let aligned = x.offset % w == 0 && strides[..last].iter().zip(shape).all(|(s, n)| *n == 1 || s % w == 0);
    match strides[last] {
        0 => Some(VecRead::Splat),
        1 if aligned => Some(VecRead::Rows),
        _ => None,
    }
}

/// The linear index of element `var` (a linear index over `shape`) in a strided input. With
/// `narrow` (every linear index below 2^32) coordinates use 32-bit division, which is much
/// cheaper on a GPU than 64-bit.
pub fn strided_index(var: &str, offset: usize, shape: &[usize], strides: &[usize], narrow: bool) -> String {
    let mut terms = vec![offset.to_string()];
    let mut inner = 1usize;
    let (v, suffix) = if narrow { (format!("((unsigned)({var}))"), "u") } else { (var.to_string(), "LL") };
    for d in (0..shape.len()).rev() {
        if shape[d] > 1 && strides[d] != 0 {
            let coord = if inner == 1 { v.clone() } else { format!("({v} / {inner}{suffix})") };
            let coord = if d == 0 { coord } else { format!("({coord} % {}{suffix})", shape[d]) };
            terms.push(format!("(long long){coord} * {}LL", strides[d]));
        }
        inner *= shape[d];
    }
    terms.join(" + ")
}

impl FusedKernel {
    /// Blocks of the whole launch (none for a lead).
    pub fn blocks(&self) -> usize {
        self.groups.iter().skip(self.lead as usize).map(FusedGroup::blocks).sum()
    }

    /// The kernel's source (without the prelude: `fused_module` adds it once per module).
    pub fn source(&self) -> Result<String, String> {
        let mut params: Vec<String> = Vec::new();
        for (j, gr) in self.groups.iter().enumerate() {
            for (k, &m) in gr.outputs.iter().enumerate() {
                let d = gr.members.get(m).ok_or_else(|| format!("{}: output {k} names no member", self.name))?.dtype;
                params.push(format!("{}* o{j}_{k}", storage_type(d)));
            }
            for (k, x) in gr.inputs.iter().enumerate() {
                params.push(format!("const {}* p{j}_{k}", storage_type(x.dtype)));
                if x.fed.as_ref().is_some_and(|f| f.b.is_some()) {
                    params.push(format!("const {}* p{j}_{k}b", storage_type(x.dtype)));
                }
            }
        }
        for i in 0..self.copies {
            params.push(format!("const unsigned char* c{i}s, unsigned char* c{i}d, unsigned long long c{i}n"));
        }
        if self.ticket() {
            params.push("unsigned int* kiln_ticket".into());
        }
        let mut s = format!("extern \"C\" __global__ void {}({}) {{\n", self.name, params.join(", "));
        s += "  long long blk = blockIdx.x;\n";
        let lead = self.groups.first().filter(|_| self.lead);
        if let Some(lead) = lead {
            s += &lead_values(lead)?;
        }
        let mut first = 0usize;
        for (j, gr) in self.groups.iter().enumerate().skip(self.lead as usize) {
            let nb = gr.blocks();
            s += &format!("  if (blk >= {first} && blk < {}) {{\n", first + nb);
            let start = format!("(blk - {first}) * {FUSED_BLOCK}LL + threadIdx.x");
            if gr.folds() {
                s += &fold_loop(gr, j)?;
            } else if gr.vectorised() {
                s += &vector_loop(gr, j, &start, nb * FUSED_BLOCK)?;
            } else {
                s += &format!("  for (long long i = {start}; i < {}LL; i += {}LL) {{\n", gr.n, nb * FUSED_BLOCK);
                let stores: Vec<String> = (0..gr.outputs.len()).map(|k| format!("o{j}_{k}[i]")).collect();
                s += &group_body(gr, &element_loads(gr, j), &stores)?;
                s += "  }\n";
            }
            s += "  }\n";
            first += nb;
        }
        if self.ticket() {
            s += &last_block(lead, self.copies);
        }
        s += "}\n";
        Ok(s)
    }

    /// Whether the launch counts its finished blocks (`last_block`): it takes a ticket.
    pub fn ticket(&self) -> bool {
        self.lead || self.copies > 0
    }
}

/// A lead group's outputs `L{r}` (stored values, so that readers see what memory would hold),
/// computed by every thread from element 0 of its inputs.
fn lead_values(gr: &FusedGroup) -> Result<String, String> {
    if gr.n != 1 || gr.folds() || gr.inputs.iter().any(|x| x.lead.is_some()) {
        return Err(format!("a lead group must be one element without sums or leads of its own (n = {}, sums: {})", gr.n, gr.folds()));
    }
    let mut s = String::new();
    for (r, &m) in gr.outputs.iter().enumerate() {
        let d = gr.members.get(m).ok_or_else(|| format!("lead output {r} names no member"))?.dtype;
        s += &format!("  {} L{r};\n", storage_type(d));
    }
    let loads: Vec<String> = gr.inputs.iter().enumerate().map(|(k, x)| format!("p0_{k}[{}]", x.offset)).collect();
    let stores: Vec<String> = (0..gr.outputs.len()).map(|r| format!("L{r}")).collect();
    s += "  {\n";
    s += &group_body(gr, &loads, &stores)?;
    s += "  }\n";
    Ok(s)
}

/// The grid's last block to finish (every other block has read what the lead read, and its
/// writes are visible) stores the lead's outputs, makes the copies, and resets the ticket for
/// the next launch.
fn last_block(lead: Option<&FusedGroup>, copies: usize) -> String {
    let mut s = String::from("  __shared__ bool kiln_last;\n  __syncthreads();\n  if (threadIdx.x == 0) {\n    __threadfence();\n");
    s += "    kiln_last = atomicAdd(kiln_ticket, 1u) == gridDim.x - 1;\n  }\n  __syncthreads();\n  if (kiln_last) {\n";
    s += "    __threadfence();\n    if (threadIdx.x == 0) {\n";
    for r in 0..lead.map_or(0, |gr| gr.outputs.len()) {
        s += &format!("      o0_{r}[0] = L{r};\n");
    }
    s += "      *kiln_ticket = 0u;\n    }\n";
    for i in 0..copies {
        s += &format!("    kiln_copy_out(c{i}s, c{i}d, c{i}n);\n");
    }
    s += "  }\n";
    s
}

/// Group `j`'s loop over `width` elements per thread: vector loads, the members per element,
/// vector stores.
fn vector_loop(gr: &FusedGroup, j: usize, start: &str, stride: usize) -> Result<String, String> {
    let (mut s, w) = (String::new(), gr.width());
    let vec_type =
        |name: String, d: DType| format!("  struct alignas({}) {name} {{ {} v[{w}]; }};\n", w * d.size_in_bytes(), storage_type(d));
    for (k, x) in gr.inputs.iter().enumerate() {
        s += &vec_type(format!("VI{k}"), x.dtype);
    }
    for (k, &m) in gr.outputs.iter().enumerate() {
        let d = gr.members.get(m).ok_or_else(|| format!("output {k} names no member"))?.dtype;
        s += &vec_type(format!("VO{k}"), d);
    }
    s += &format!("  for (long long q = {start}; q < {}LL; q += {stride}LL) {{\n", gr.n / w);
    let mut loads: Vec<String> = Vec::new();
    for (k, x) in gr.inputs.iter().enumerate() {
        let at = |(shape, strides): &(Vec<usize>, Vec<usize>)| strided_index(&format!("q * {w}"), x.offset, shape, strides, gr.narrow());
        if let Some(r) = x.lead {
            loads.push(format!("L{r}"));
            continue;
        }
        match (vec_read(x, w), &x.strided, &x.fed) {
            // (`Fed::value` makes four values: `vec_read` offers a fed input only at width 4.)
            (Some(VecRead::Fed), _, Some(f)) if w == 4 => {
                s += &format!("    const VI{k} a{k} = {};\n", f.value(x, (j, k), "q * 4", gr.narrow(), true));
            }
            (_, _, Some(_)) => return Err(format!("input {k}: a fed product read {w} at a time (it takes four, from aligned rows)")),
            (Some(VecRead::Splat), Some(st), None) => {
                s += &format!("    const auto a{k} = p{j}_{k}[{}];\n", at(st));
                loads.push(format!("a{k}"));
                continue;
            }
            (Some(VecRead::Rows), Some(st), None) => {
                s += &format!("    VI{k} a{k} = *reinterpret_cast<const VI{k}*>(p{j}_{k} + {});\n", at(st))
            }
            _ => s += &format!("    VI{k} a{k} = *reinterpret_cast<const VI{k}*>(p{j}_{k} + {} + q * {w});\n", x.offset),
        }
        loads.push(format!("a{k}.v[e]"));
    }
    for k in 0..gr.outputs.len() {
        s += &format!("    VO{k} b{k};\n");
    }
    s += &format!("#pragma unroll\n    for (int e = 0; e < {w}; ++e) {{\n");
    let stores: Vec<String> = (0..gr.outputs.len()).map(|k| format!("b{k}.v[e]")).collect();
    s += &group_body(gr, &loads, &stores)?;
    s += "    }\n";
    for k in 0..gr.outputs.len() {
        s += &format!("    *reinterpret_cast<VO{k}*>(o{j}_{k} + q * {w}) = b{k};\n");
    }
    s += "  }\n";
    Ok(s)
}

/// Element `i` of each input of group `j`.
fn element_loads(gr: &FusedGroup, j: usize) -> Vec<String> {
    let at = |(k, x): (usize, &FusedInput)| match (&x.strided, x.lead, &x.fed) {
        (_, Some(r), _) => format!("L{r}"),
        (_, None, Some(f)) => f.value(x, (j, k), "i", gr.narrow(), false),
        (None, None, None) => format!("p{j}_{k}[{} + i]", x.offset),
        (Some((shape, strides)), None, None) => format!("p{j}_{k}[{}]", strided_index("i", x.offset, shape, strides, gr.narrow())),
    };
    gr.inputs.iter().enumerate().map(at).collect()
}

/// One element of a group: `loads[k]` reads input k, the members run in order, output k is
/// stored to `stores[k]`.
fn group_body(gr: &FusedGroup, loads: &[String], stores: &[String]) -> Result<String, String> {
    let mut s = String::new();
    for (k, load) in loads.iter().enumerate() {
        s += &format!("    auto x{k} = ld({load});\n");
    }
    for q in 0..gr.members.len() {
        s += &member_code(gr, q)?;
    }
    for (store, &m) in stores.iter().zip(&gr.outputs) {
        s += &format!("    st(&{store}, m{m});\n");
    }
    Ok(s)
}

/// Member `q` (elementwise) as `m{q}`, from inputs `x{k}` and earlier members `m{k}`.
fn member_code(gr: &FusedGroup, q: usize) -> Result<String, String> {
    let m = &gr.members[q];
    let dtype_of = |src: &FusedSrc| match *src {
        FusedSrc::Input(k) => gr.inputs.get(k).map(|x| x.dtype),
        FusedSrc::Member(m) => gr.members.get(m).map(|x| x.dtype),
    };
    let dtypes: Vec<DType> =
        m.args.iter().map(|a| dtype_of(a).ok_or_else(|| format!("member {q} reads a missing value"))).collect::<Result<_, _>>()?;
    let (_, expr, compute) = elementwise_expr(&m.op, &dtypes).ok_or_else(|| format!("{}: not elementwise", m.op.name()))?;
    let scalar = match &m.op {
        Op::Scalar { value, .. } => *value,
        _ => 0.0,
    };
    let mut s = format!("    {} m{q};\n    {{\n      typedef {compute} C;\n", compute_type(m.dtype));
    s += &format!("      struct {{ double s; }} a = {{ {} }}; (void)a;\n", double_literal(scalar));
    for (v, src) in m.args.iter().enumerate() {
        s += &format!("      auto v{v} = {};\n", src_name(*src));
    }
    s += &format!("      m{q} = {expr};\n    }}\n");
    Ok(s)
}

fn src_name(src: FusedSrc) -> String {
    match src {
        FusedSrc::Input(k) => format!("x{k}"),
        FusedSrc::Member(k) => format!("m{k}"),
    }
}

/// A group ending in sums (`FusedGroup::folds`), run by one block: the threads stride over
/// the elements (members before the fold, sums accumulated in registers), `kiln_block_sum`
/// folds each sum, and thread 0 runs the members after the fold and stores their values.
fn fold_loop(gr: &FusedGroup, j: usize) -> Result<String, String> {
    let after = gr.after_fold();
    check_fold(gr, &after)?;
    let sums: Vec<usize> = (0..gr.members.len()).filter(|&q| gr.members[q].is_sum()).collect();
    // The inputs read inside the loop (`in_loop`) or after the fold.
    let reads = |in_loop: bool| {
        let mut used = vec![false; gr.inputs.len()];
        for (q, m) in gr.members.iter().enumerate() {
            // A sum reads its argument inside the loop.
            let inside = !after[q] || m.is_sum();
            for a in &m.args {
                if let FusedSrc::Input(k) = *a {
                    used[k] |= inside == in_loop;
                }
            }
        }
        used
    };
    let mut s = String::new();
    for &q in &sums {
        s += &format!("  {} r{q} = 0;\n", compute_type(gr.members[q].dtype));
    }
    s += &format!("  for (long long i = threadIdx.x; i < {}LL; i += {FUSED_BLOCK}LL) {{\n", gr.n);
    let loads = element_loads(gr, j);
    for (k, used) in reads(true).into_iter().enumerate() {
        if used {
            s += &format!("    auto x{k} = ld({});\n", loads[k]);
        }
    }
    for q in (0..gr.members.len()).filter(|&q| !after[q]) {
        s += &member_code(gr, q)?;
    }
    for &q in &sums {
        let arg = gr.members[q].args.first().ok_or_else(|| format!("sum member {q} has no argument"))?;
        s += &format!("    r{q} += {};\n", src_name(*arg));
    }
    for (k, &m) in gr.outputs.iter().enumerate() {
        if !after[m] {
            s += &format!("    st(&o{j}_{k}[i], m{m});\n");
        }
    }
    s += "  }\n";
    for &q in &sums {
        s += &format!("  r{q} = kiln_block_sum(r{q});\n");
    }
    s += "  if (threadIdx.x == 0) {\n";
    // Inputs read after the fold are single values broadcast over the group: element 0.
    for (k, used) in reads(false).into_iter().enumerate() {
        if used {
            let x = &gr.inputs[k];
            if x.fed.is_some() {
                return Err(format!("input {k}: a fed product read after the fold"));
            }
            let value = x.lead.map_or_else(|| format!("p{j}_{k}[{}]", x.offset), |r| format!("L{r}"));
            s += &format!("    auto x{k} = ld({value});\n");
        }
    }
    for q in (0..gr.members.len()).filter(|&q| after[q]) {
        s += &match gr.members[q].is_sum() {
            true => format!("    {} m{q} = r{q};\n", compute_type(gr.members[q].dtype)),
            false => member_code(gr, q)?,
        };
    }
    for (k, &m) in gr.outputs.iter().enumerate() {
        if after[m] {
            s += &format!("    st(&o{j}_{k}[0], m{m});\n");
        }
    }
    s += "  }\n";
    Ok(s)
}

/// What `fold_loop` can generate: sums (of inputs or loop values) and, after them, members
/// reading only sums, later scalars and inputs.
fn check_fold(gr: &FusedGroup, after: &[bool]) -> Result<(), String> {
    let reads_loop = |a: &FusedSrc| matches!(*a, FusedSrc::Member(j) if !after[j]);
    let reads_loop_or_input = |a: &FusedSrc| matches!(*a, FusedSrc::Input(_)) || reads_loop(a);
    for (q, m) in gr.members.iter().enumerate().filter(|&(q, _)| after[q]) {
        match &m.op {
            Op::Reduce { op: ReduceOp::Sum, .. } if !m.args.iter().all(reads_loop_or_input) => {
                return Err(format!("member {q} sums a value computed after the fold"))
            }
            Op::Reduce { op: ReduceOp::Sum, .. } => {}
            Op::Reduce { op, .. } => return Err(format!("member {q}: a fused group folds sums only, not {}", op.name())),
            _ if m.args.iter().any(reads_loop) => return Err(format!("member {q} runs after the fold but reads a per-element value")),
            _ => {}
        }
    }
    Ok(())
}

/// A block's sum of one value per thread (the whole block calls it; the result is thread 0's).
/// Fixed order, so a step gives the same bits every time.
const BLOCK_SUM: &str = r#"
template <typename T> __device__ __forceinline__ T kiln_block_sum(T v) {
  __shared__ T part[32];
  for (int w = 16; w > 0; w /= 2) v += __shfl_down_sync(0xffffffffu, v, w);
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : (T)0;
  if (threadIdx.x < 32)
    for (int w = 16; w > 0; w /= 2) v += __shfl_down_sync(0xffffffffu, v, w);
  return v;
}
"#;

/// A fed product's `W` neighbouring values (`Fed::value`): `kiln_fed_dot`, columns of one
/// row (b's rows read as vectors of `V`), and `kiln_fed_sum`, the sums of neighbouring rows
/// (a's columns read as vectors). Each term is added in order, as the thin-product kernel does.
const FED: &str = r#"
template <class T> struct kiln_v1 { T v[1]; };
template <int K, int W, class V, class T>
__device__ __forceinline__ V kiln_fed_dot(const T* __restrict__ a, long long sa, const T* __restrict__ b, long long sb) {
  V acc;
#pragma unroll
  for (int e = 0; e < W; ++e) acc.v[e] = (T)0;
#pragma unroll
  for (int t = 0; t < K; ++t) {
    const T u = a[t * sa];
    const V w = *reinterpret_cast<const V*>(b + t * sb);
#pragma unroll
    for (int e = 0; e < W; ++e) acc.v[e] += u * w.v[e];
  }
  return acc;
}
template <int K, int W, class V, class T>
__device__ __forceinline__ V kiln_fed_sum(const T* __restrict__ a, long long sa) {
  V acc;
#pragma unroll
  for (int e = 0; e < W; ++e) acc.v[e] = (T)0;
#pragma unroll
  for (int t = 0; t < K; ++t) {
    const V w = *reinterpret_cast<const V*>(a + t * sa);
#pragma unroll
    for (int e = 0; e < W; ++e) acc.v[e] += w.v[e];
  }
  return acc;
}
"#;

/// A copy of `n` bytes from `s` to `d`, this thread taking pieces `i`, `i + step`, ...: 16
/// bytes a piece where both ends are 16-byte aligned, else one. Loads bypass L1, since other
/// blocks of the launch may have written `s`. (Output copies: a graph node's whole grid,
/// `copy_out_source`, or a fused kernel's last block, `COPY_OUT`.)
const COPY_BYTES: &str = r#"
__device__ __forceinline__ void kiln_copy_bytes(const unsigned char* s, unsigned char* d, unsigned long long n,
                                                unsigned long long i, unsigned long long step) {
  const unsigned long long words = (((unsigned long long)s | (unsigned long long)d) % 16 == 0) ? n / 16 : 0;
  for (unsigned long long w = i; w < words; w += step) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(s + 16 * w));
    reinterpret_cast<uint4*>(d)[w] = v;
  }
  for (unsigned long long b = words * 16 + i; b < n; b += step) d[b] = ((const volatile unsigned char*)s)[b];
}
"#;

/// The output-copy node's kernel (`compiled::capture_output_copy`): `bytes` bytes from `src`
/// to `dst` over the whole grid.
pub fn copy_out_source() -> (String, String) {
    let s = format!(
        "{COPY_BYTES}extern \"C\" __global__ void kiln_copy_out(const unsigned char* src, unsigned char* dst, unsigned long long bytes) {{\n  \
         kiln_copy_bytes(src, dst, bytes, blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x, gridDim.x * (unsigned long long)blockDim.x);\n}}\n"
    );
    (s, "kiln_copy_out".to_string())
}

/// A block's copy of `n` bytes (`kiln_copy_bytes`), none where `d` is null.
const COPY_OUT: &str = r#"
__device__ __forceinline__ void kiln_copy_out(const unsigned char* s, unsigned char* d, unsigned long long n) {
  if (d != 0) kiln_copy_bytes(s, d, n, threadIdx.x, blockDim.x);
}
"#;

/// One CUDA module holding every fused kernel of a compiled graph (one NVRTC call).
pub fn fused_module(kernels: &[FusedKernel]) -> Result<String, String> {
    let mut s = format!("{PRELUDE}\n#define K(v) ((C)(v))\n");
    if kernels.iter().any(|k| k.groups.iter().any(FusedGroup::folds)) {
        s += BLOCK_SUM;
    }
    if kernels.iter().any(|k| k.groups.iter().any(|g| g.inputs.iter().any(|x| x.fed.is_some()))) {
        s += FED;
    }
    if kernels.iter().any(|k| k.copies > 0) {
        s += COPY_BYTES;
        s += COPY_OUT;
    }
    for k in kernels {
        s += &k.source()?;
    }
    Ok(s)
}

/// The kernels of fused attention over dense `[n, T, D]` buffers (`Op::Attention` and its
/// backward), one enum for both families: `Fwd` (online softmax), `Dq` (each query row's
/// log-sum-exp `L` and `Dsum = g . o`, kept in `stats` for `Dkv`, then dq) and `Dkv` (per key
/// tile, dk and dv over the queries that see it, recomputing `p = exp(scale q.k - L)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnKernel {
    Fwd,
    Dq,
    Dkv,
}

/// The largest head dim the attention kernels take.
pub const ATTN_MAX_D: usize = 128;
/// The most batch matrices the FMA attention kernels (`tiled_source`) take: their grid has them
/// along y. The tensor-core and short-sequence kernels have them along x.
pub const ATTN_FMA_MAX_MATRICES: usize = 65535;

/// Rows of a score tile each thread of a tiled attention kernel owns (4 columns each), and
/// the block size that covers a 64 x 64 tile. (8 rows on 128 threads are slower at the GPT
/// shapes: fewer warps to hide the tile loads.)
pub const TILED_ROWS: usize = 4;
pub const TILED_THREADS: usize = 64 * 64 / (TILED_ROWS * 4);

/// Floats of dynamic shared memory a tiled attention kernel takes (see `tiled_source`).
pub fn tiled_smem_floats(kind: AttnKernel, d: usize) -> usize {
    let (sp, sw) = (68, d.div_ceil(64) * 64 + 4);
    let (tq, tn, tp) = (d * sp, 64 * sw, 64 * sp);
    match kind {
        AttnKernel::Fwd => 2 * tq + tn + tp,
        AttnKernel::Dq => 4 * tq + tn + tp,
        AttnKernel::Dkv => 4 * tq + 2 * tn + tp + 128,
    }
}

/// The FMA-unit (SIMT) kernels of fused attention for any float dtype and head dim up to
/// `ATTN_MAX_D`, computed in f32: F32 everywhere, and f16/bf16 where the tensor-core kernels
/// do not apply. A block owns 64 rows; every product is a 64 x 64 (or 64 x D) tile product
/// from shared memory, each thread an `RM` x 4 register tile per 64 columns (rows `ty*RM..`,
/// columns `tx*4..`, so a row's reductions are 16-lane shuffles; `TILED_ROWS`). Both
/// operands sit in shared memory along the reduced dim (`[k][m]`, `[k][n]`), read four at
/// a time; an operand that arrives along its other dim is stored transposed. The `[T, T]`
/// scores never leave the block.
pub fn tiled_source(kind: AttnKernel, dtype: DType, d: usize, causal: bool) -> (String, String) {
    let t = storage_type(dtype);
    let name = format!(
        "k_attn_{}_{}_d{d}{}",
        format!("{kind:?}").to_lowercase(),
        format!("{dtype:?}").to_lowercase(),
        if causal { "_causal" } else { "" }
    );
    let mut s = format!("{PRELUDE}{LATE_NEXT}\ntypedef {t} T;\n#define D {d}\n#define CAUSAL {}\n", causal as i32);
    s += &format!("#define RM {TILED_ROWS}\n#define NT {TILED_THREADS}\n");
    s += TILED_HELPERS;
    let sig = match kind {
        AttnKernel::Fwd => "T* __restrict__ o, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v",
        AttnKernel::Dq => "T* __restrict__ dq, float* __restrict__ stats, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ o, const T* __restrict__ g",
        AttnKernel::Dkv => "T* __restrict__ dk, T* __restrict__ dv, const float* __restrict__ stats, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g",
    };
    s += &format!("extern \"C\" __global__ void __launch_bounds__(NT) {name}({sig}, long long Tn, float scale) {{\n");
    s += "  extern __shared__ __align__(16) float sm[];\n";
    s += "  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;\n";
    s += "  const long long base = (long long)blockIdx.y * Tn * D, rb = (long long)blockIdx.x * 64;\n";
    s += match kind {
        AttnKernel::Fwd => TILED_FWD,
        AttnKernel::Dq => TILED_DQ,
        AttnKernel::Dkv => TILED_DKV,
    };
    s += "}\n";
    (s, name)
}

/// Device helpers of the tiled attention kernels. `SP`: the row stride of a tile along 64
/// rows (`[k][64]`); `SW`: of a `[64][D]` tile, D padded to whole 64-column halves `NH`.
const TILED_HELPERS: &str = r#"
#define NEG_INF __int_as_float(0xff800000)
#define SP 68
#define NH ((D + 63) / 64)
#define SW (NH * 64 + 4)
#define TQ (D * SP)
#define TN (64 * SW)
#define TP (64 * SP)
// c (+)= a b over KN: a along k as [k][m] (stride la), b as [k][n] (stride lb).
template <int KN>
__device__ __forceinline__ void mm(float (*c)[4], const float* a, int la, const float* b, int lb, int ty, int tx) {
#pragma unroll 8
  for (int k = 0; k < KN; ++k) {
    float xa[RM];
#pragma unroll
    for (int u = 0; u < RM / 4; ++u) {
      const float4 x = *(const float4*)(a + k * la + ty * RM + u * 4);
      xa[u * 4] = x.x; xa[u * 4 + 1] = x.y; xa[u * 4 + 2] = x.z; xa[u * 4 + 3] = x.w;
    }
    const float4 y = *(const float4*)(b + k * lb + tx * 4);
    const float ya[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) c[i][j] = fmaf(xa[i], ya[j], c[i][j]);
  }
}
__device__ __forceinline__ void zero(float (*c)[4]) {
#pragma unroll
  for (int i = 0; i < RM; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}
// Rows r0.. of a [Tn, D] matrix into a [64][SW] tile (zeros past Tn and past D).
__device__ __forceinline__ void load_rows(float* dst, const T* src, long long r0, long long Tn) {
  for (int e = threadIdx.x; e < 64 * NH * 64; e += NT) {
    const int r = e / (NH * 64), c = e % (NH * 64);
    dst[r * SW + c] = (r0 + r < Tn && c < D) ? (float)ld(src[(r0 + r) * D + c]) : 0.f;
  }
}
// The same rows transposed, into a [D][SP] tile.
__device__ __forceinline__ void load_cols(float* dst, const T* src, long long r0, long long Tn) {
  for (int e = threadIdx.x; e < 64 * D; e += NT) {
    const int r = e / D, c = e % D;
    dst[c * SP + r] = r0 + r < Tn ? (float)ld(src[(r0 + r) * D + c]) : 0.f;
  }
}
// A thread's RM x 4 tile, transposed, into a [64][SP] tile.
__device__ __forceinline__ void store_t(float* dst, const float (*c)[4], int ty, int tx) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int u = 0; u < RM / 4; ++u)
      *(float4*)(dst + (tx * 4 + j) * SP + ty * RM + u * 4) = make_float4(c[u * 4][j], c[u * 4 + 1][j], c[u * 4 + 2][j], c[u * 4 + 3][j]);
}
__device__ __forceinline__ float row_max(float x) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
// Scales scores (query rows r0.., key columns c0.. when `keys_are_cols`, else the
// transpose) and masks keys past Tn, queries past Tn (transposed) and, causal, later keys.
__device__ __forceinline__ void mask(float (*s)[4], long long r0, long long c0, int ty, int tx, long long Tn, float scale, bool keys_are_cols) {
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long r = r0 + ty * RM + i, c = c0 + tx * 4 + j;
      const long long key = keys_are_cols ? c : r, query = keys_are_cols ? r : c;
      s[i][j] = (c >= Tn || (CAUSAL && key > query)) ? NEG_INF : s[i][j] * scale;
    }
}
// c = a b over the head dim, both [D][SP] tiles along it.
__device__ __forceinline__ void product(float (*c)[4], const float* a, const float* b, int ty, int tx) {
  zero(c);
  mm<D>(c, a, SP, b, SP, ty, tx);
}
// A tile of scaled, masked scores (see `mask`).
__device__ __forceinline__ void scores(float (*s)[4], const float* a, const float* b, long long r0, long long c0, int ty, int tx, long long Tn, float scale, bool keys_are_cols) {
  product(s, a, b, ty, tx);
  mask(s, r0, c0, ty, tx, Tn, scale, keys_are_cols);
}
// Online softmax over one tile of scores: updates each row's max m and partial sum l,
// rescales acc, and leaves the tile's probabilities (relative to the new max) in s.
__device__ __forceinline__ void online(float (*s)[4], float* m, float* l, float (*acc)[RM][4]) {
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const float mx = row_max(fmaxf(fmaxf(s[i][0], s[i][1]), fmaxf(s[i][2], s[i][3])));
    const float mn = fmaxf(m[i], mx), ms = mn == NEG_INF ? 0.f : mn, corr = expf(m[i] - ms);
    m[i] = mn;
    l[i] *= corr;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[i][j] = expf(s[i][j] - ms);
      l[i] += s[i][j];
    }
    if (acc)
#pragma unroll
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[h][i][j] *= corr;
  }
}
// Stores rows r0 + ty*RM + i of a [64][D] accumulator, times mul (per row when `per_row`).
__device__ __forceinline__ void store_rows(T* dst, const float (*acc)[RM][4], long long r0, int ty, int tx, long long Tn, const float* mul, bool per_row) {
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const long long r = r0 + ty * RM + i;
    if (r >= Tn) continue;
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = h * 64 + tx * 4 + j;
        if (c < D) st(&dst[r * D + c], acc[h][i][j] * mul[per_row ? i : 0]);
      }
  }
}
"#;

const TILED_FWD: &str = r#"  float *qt = sm, *kt = qt + TQ, *vs = kt + TQ, *pt = vs + TN;
  q += base; k += base; v += base; o += base;
  load_cols(qt, q, rb, Tn);
  float acc[NH][RM][4], m[RM], l[RM];
#pragma unroll
  for (int h = 0; h < NH; ++h) zero(acc[h]);
#pragma unroll
  for (int i = 0; i < RM; ++i) { m[i] = NEG_INF; l[i] = 0.f; }
  const long long kend = CAUSAL ? (rb + 64 < Tn ? rb + 64 : Tn) : Tn;
  for (long long k0 = 0; k0 < kend; k0 += 64) {
    __syncthreads();
    load_cols(kt, k, k0, Tn);
    load_rows(vs, v, k0, Tn);
    __syncthreads();
    float sc[RM][4];
    scores(sc, qt, kt, rb, k0, ty, tx, Tn, scale, true);
    online(sc, m, l, acc);
    store_t(pt, sc, ty, tx);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < NH; ++h) mm<64>(acc[h], pt, SP, vs + h * 64, SW, ty, tx);
  }
  float inv[RM];
#pragma unroll
  for (int i = 0; i < RM; ++i) inv[i] = 1.f / row_sum(l[i]);
  store_rows(o, acc, rb, ty, tx, Tn, inv, true);
"#;

const TILED_DQ: &str = r#"  float *qt = sm, *gt = qt + TQ, *kt = gt + TQ, *vt = kt + TQ, *ks = vt + TQ, *pt = ks + TN;
  q += base; k += base; v += base; o += base; g += base; dq += base;
  load_cols(qt, q, rb, Tn);
  load_cols(gt, g, rb, Tn);
  const long long kend = CAUSAL ? (rb + 64 < Tn ? rb + 64 : Tn) : Tn;
  // Pass 1: each row's log-sum-exp L and Dsum = g . o.
  float m[RM], l[RM], L[RM], Ds[RM];
#pragma unroll
  for (int i = 0; i < RM; ++i) { m[i] = NEG_INF; l[i] = 0.f; }
  for (long long k0 = 0; k0 < kend; k0 += 64) {
    __syncthreads();
    load_cols(kt, k, k0, Tn);
    __syncthreads();
    float sc[RM][4];
    scores(sc, qt, kt, rb, k0, ty, tx, Tn, scale, true);
    online(sc, m, l, (float (*)[RM][4])0);
  }
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const long long r = rb + ty * RM + i;
    float acc = 0.f;
    if (r < Tn) for (int c = tx; c < D; c += 16) acc += (float)ld(g[r * D + c]) * (float)ld(o[r * D + c]);
    Ds[i] = row_sum(acc);
    L[i] = (m[i] == NEG_INF ? 0.f : m[i]) + logf(row_sum(l[i]));
    if (r < Tn && tx == 0) { const long long at = ((long long)blockIdx.y * Tn + r) * 2; stats[at] = L[i]; stats[at + 1] = Ds[i]; }
  }
  // Pass 2: dq = scale * sum_j p (g.v_j - Dsum) k_j.
  float acc[NH][RM][4];
#pragma unroll
  for (int h = 0; h < NH; ++h) zero(acc[h]);
  for (long long k0 = 0; k0 < kend; k0 += 64) {
    __syncthreads();
    load_cols(kt, k, k0, Tn);
    load_cols(vt, v, k0, Tn);
    load_rows(ks, k, k0, Tn);
    __syncthreads();
    float sc[RM][4], dp[RM][4];
    scores(sc, qt, kt, rb, k0, ty, tx, Tn, scale, true);
    product(dp, gt, vt, ty, tx);
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[i][j] = expf(sc[i][j] - L[i]) * (dp[i][j] - Ds[i]);
    store_t(pt, sc, ty, tx);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < NH; ++h) mm<64>(acc[h], pt, SP, ks + h * 64, SW, ty, tx);
  }
  store_rows(dq, acc, rb, ty, tx, Tn, &scale, false);
"#;

// Here the block's 64 rows are keys and a score tile's columns are queries.
const TILED_DKV: &str = r#"  float *kt = sm, *vt = kt + TQ, *qt = vt + TQ, *gt = qt + TQ, *qs = gt + TQ, *gs = qs + TN, *pt = gs + TN, *Ls = pt + TP, *Dl = Ls + 64;
  q += base; k += base; v += base; g += base; dk += base; dv += base;
  stats += (long long)blockIdx.y * Tn * 2;
  load_cols(kt, k, rb, Tn);
  load_cols(vt, v, rb, Tn);
  float gk[NH][RM][4], gv[NH][RM][4];
#pragma unroll
  for (int h = 0; h < NH; ++h) { zero(gk[h]); zero(gv[h]); }
  for (long long q0 = CAUSAL ? rb : 0; q0 < Tn; q0 += 64) {
    __syncthreads();
    load_cols(qt, q, q0, Tn);
    load_cols(gt, g, q0, Tn);
    load_rows(qs, q, q0, Tn);
    load_rows(gs, g, q0, Tn);
    if (threadIdx.x < 64) {
      const bool in = q0 + threadIdx.x < Tn;
      Ls[threadIdx.x] = in ? stats[(q0 + threadIdx.x) * 2] : 0.f;
      Dl[threadIdx.x] = in ? stats[(q0 + threadIdx.x) * 2 + 1] : 0.f;
    }
    __syncthreads();
    float p[RM][4], ds[RM][4];
    scores(p, kt, qt, rb, q0, ty, tx, Tn, scale, false);
    product(ds, vt, gt, ty, tx);
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int qi = tx * 4 + j;
        p[i][j] = expf(p[i][j] - Ls[qi]);
        ds[i][j] = p[i][j] * (ds[i][j] - Dl[qi]);
      }
    store_t(pt, p, ty, tx);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < NH; ++h) mm<64>(gv[h], pt, SP, gs + h * 64, SW, ty, tx);
    __syncthreads();
    store_t(pt, ds, ty, tx);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < NH; ++h) mm<64>(gk[h], pt, SP, qs + h * 64, SW, ty, tx);
  }
  const float one = 1.f;
  store_rows(dk, gk, rb, ty, tx, Tn, &scale, false);
  store_rows(dv, gv, rb, ty, tx, Tn, &one, false);
"#;

/// Elements in 16 bytes: a `flash_source` tile row's padding (against bank conflicts, keeping
/// the rows' 16-byte copies aligned) and the alignment, in elements, its operands' rows need.
pub fn flash_vec(dtype: DType) -> usize {
    16 / dtype.size_in_bytes()
}

/// The dynamic shared memory of a `flash_source` kernel: four tiles of 64 padded rows of D.
pub fn flash_smem_bytes(dtype: DType, d: usize) -> usize {
    4 * 64 * (d + flash_vec(dtype)) * dtype.size_in_bytes()
}

/// Whether the tensor-core attention kernels (`flash_source`) take this dtype and head dim:
/// f16/bf16 with D a multiple of 16, F32 (three TF32 products each) with D a multiple of 8.
pub fn flash_supported(dtype: DType, d: usize) -> bool {
    let step = match dtype {
        DType::F16 | DType::BF16 => 16,
        DType::F32 => 8,
        _ => return false,
    };
    d % step == 0 && d > 0 && d <= ATTN_MAX_D
}

/// Device helpers of the flash kernels: shared tiles, `Mat`, async copies, quad reductions,
/// the MMA and its fragments for the dtype (`flash_frags_16` or `flash_frags_f32`, each with its
/// `put2`), then the accumulator store.
/// Each kernel body sees `KS` (the MMA's depth), `AW` (words of one A fragment) and `EXP`.
fn flash_helpers(dtype: DType) -> String {
    let mut s = format!("#define SD (D + {})\n#define VEC {}\n", flash_vec(dtype), flash_vec(dtype));
    s += "__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }\n";
    // One [T, D] matrix of a batch: row t of matrix n at `(n / nh) * b + (n % nh) * h + t * t`
    // elements (a head of a fused projection is read where it lies, with no copy).
    s += MAT;
    // Rows row0..row0+64 (row0 < T) of a [T, D] matrix with row stride st into a shared tile,
    // copied by the async copy engine 16 bytes at a time (zeros past T), so that a block loads
    // the next tile while it computes on this one; `async_wait<N>` waits for all but the last N
    // groups. Where a row's CPR pieces divide the block's 128 threads, each thread copies one
    // column of pieces, its addresses stepped (the general loop's divisions and 64-bit index
    // products take about 40 instructions a piece, a third of the 16-bit forward's). Not for
    // F32: its kernels then spill (the forward at D = 64 by 440 bytes, unrolled or not).
    s += &format!("#define CPR (D / VEC)\n#define F32_TILES {}\n", (dtype == DType::F32) as i32);
    s += "__device__ __forceinline__ void load_tile_async(T (*tile)[SD], const T* p, long long st, long long row0, long long Tn) {\n";
    s += "#if 128 % CPR == 0 && CPR >= 2 && !F32_TILES\n";
    s += "  constexpr int RS = 128 / CPR;\n  const int r = threadIdx.x / CPR, c = (threadIdx.x % CPR) * VEC;\n";
    s += "  const long long rows = Tn - row0;\n  const int left = rows < 64 ? (int)rows : 64;\n";
    s += "  const T* src = p + (row0 + r) * st + c;\n  const long long step = RS * st;\n  const unsigned dst = smem(&tile[r][c]);\n";
    s += "#pragma unroll\n  for (int i = 0; i < 64 / RS; ++i, src += step) {\n    const bool in = r + i * RS < left;\n";
    s += "    asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16, %2;\" :: \"r\"(dst + i * RS * SD * (unsigned)sizeof(T)), \"l\"(in ? src : p), \"r\"(in ? 16 : 0));\n  }\n";
    s += "#else\n";
    s += "  for (int e = threadIdx.x; e < 64 * CPR; e += blockDim.x) {\n    const int r = e / CPR, c = (e % CPR) * VEC;\n";
    s += "    const bool in = row0 + r < Tn;\n    const T* src = in ? p + (row0 + r) * st + c : p;\n";
    s += "    asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16, %2;\" :: \"r\"(smem(&tile[r][c])), \"l\"(src), \"r\"(in ? 16 : 0));\n  }\n";
    s += "#endif\n}\n";
    s += "__device__ __forceinline__ void async_commit() { asm volatile(\"cp.async.commit_group;\" ::); }\n";
    s += "template <int N> __device__ __forceinline__ void async_wait() { asm volatile(\"cp.async.wait_group %0;\" :: \"n\"(N)); }\n";
    // Sum and max over the 4 threads that share a row.
    s += "__device__ __forceinline__ float quad_sum(float x) { x += __shfl_xor_sync(0xffffffffu, x, 1); return x + __shfl_xor_sync(0xffffffffu, x, 2); }\n";
    s += "__device__ __forceinline__ float quad_max(float x) { x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1)); return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2)); }\n";
    s += "#define ZERO(acc) _Pragma(\"unroll\") for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f\n";
    s += &match dtype {
        DType::F32 => flash_frags_f32(),
        _ => flash_frags_16(dtype),
    };
    // Stores a warp's 16 x D accumulator tile (rows gq and gq + 8 times mul0 / mul1) at rows
    // r0.. of o: through the warp's 16 rows of a free shared tile, so that each row goes out
    // in 16-byte pieces (straight from the fragments, a 16-bit row takes 16 stores of 4 bytes).
    s += "__device__ __forceinline__ void store(T* o, long long st, const float (*acc)[4], long long r0, int gq, int tq, long long Tn, float mul0, float mul1, T (*stage)[SD], int lane) {\n";
    s += "#pragma unroll\n  for (int j = 0; j < D / 8; ++j) {\n    const int c = j * 8 + tq * 2;\n";
    s += "    put2(&stage[gq][c], acc[j][0] * mul0, acc[j][1] * mul0);\n    put2(&stage[gq + 8][c], acc[j][2] * mul1, acc[j][3] * mul1);\n  }\n";
    s += "  __syncwarp();\n  for (int e = lane; e < 16 * (D / VEC); e += 32) {\n    const int r = e / (D / VEC), c = (e % (D / VEC)) * VEC;\n";
    s += "    if (r0 + r < Tn) *(uint4*)(o + (r0 + r) * st + c) = *(const uint4*)&stage[r][c];\n  }\n  __syncwarp();\n}\n";
    s
}

/// One `[T, D]` matrix of an attention batch (`kernels::Mat`), and where block `blockIdx.x`'s
/// starts. In 32 bits (the matrix is a block index, `nh` at most their count): a 64-bit division
/// is a long subroutine, and a kernel places up to six matrices.
const MAT: &str = "struct Mat { long long b, h, t, nh; };
__device__ __forceinline__ long long mat_base(Mat m) { const unsigned n = blockIdx.x, nh = (unsigned)m.nh; return (long long)(n / nh) * m.b + (long long)(n % nh) * m.h; }
";

/// The f16/bf16 MMA (`m16n8k16`) and fragments. A fragment register holds two neighbouring
/// 16-bit values, the lower column in the low half.
fn flash_frags_16(dtype: DType) -> String {
    let ty = if dtype == DType::F16 { "f16" } else { "bf16" };
    // Exponentials use the fast `__expf` (ex2.approx): their arguments are scores minus a row
    // maximum or log-sum-exp, so at most about 0, and the results are rounded to 16 bits; it
    // is faster per kernel than `expf`, with the same error against the f64 reference.
    let mut s = String::from("#define KS 16\n#define AW 4\n");
    s += "__device__ __forceinline__ float EXP2(float x) { float y; asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x)); return y; }\n";
    s += "__device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {\n";
    s += &format!("  asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\"\n");
    s += "    : \"+f\"(c[0]), \"+f\"(c[1]), \"+f\"(c[2]), \"+f\"(c[3]) : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));\n}\n";
    s += "__device__ __forceinline__ unsigned pack(float lo, float hi) {\n  unsigned r;\n";
    s += &format!("  asm(\"cvt.rn.{ty}x2.f32 %0, %1, %2;\" : \"=r\"(r) : \"f\"(hi), \"f\"(lo));\n  return r;\n}}\n");
    // Loads by 32-bit shared addresses: a row's base found once, the rest constant offsets.
    s += "__device__ __forceinline__ void ldsm4(unsigned* r, unsigned at) {\n";
    s += "  asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\" : \"=r\"(r[0]), \"=r\"(r[1]), \"=r\"(r[2]), \"=r\"(r[3]) : \"r\"(at));\n}\n";
    s += "__device__ __forceinline__ void ldsm4t(unsigned* r, unsigned at) {\n";
    s += "  asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\" : \"=r\"(r[0]), \"=r\"(r[1]), \"=r\"(r[2]), \"=r\"(r[3]) : \"r\"(at));\n}\n";
    // Two neighbouring columns c, c+1 of row `row` (0 past the last row).
    s += "__device__ __forceinline__ unsigned ld2(const T* p, long long st, long long row, int c, long long Tn) {\n";
    s += "  return row < Tn ? *(const unsigned*)(p + row * st + c) : 0u;\n}\n";
    // The A fragments (16 rows from r0, all of D) of a [T, D] matrix with row stride st.
    s += "__device__ __forceinline__ void load_a(unsigned (*a)[AW], const T* p, long long st, long long r0, int gq, int tq, long long Tn) {\n";
    s += "#pragma unroll\n  for (int ks = 0; ks < D / 16; ++ks) {\n    const int c = ks * 16 + tq * 2;\n";
    s += "    a[ks][0] = ld2(p, st, r0 + gq, c, Tn); a[ks][1] = ld2(p, st, r0 + gq + 8, c, Tn);\n";
    s += "    a[ks][2] = ld2(p, st, r0 + gq, c + 8, Tn); a[ks][3] = ld2(p, st, r0 + gq + 8, c + 8, Tn);\n  }\n}\n";
    // s[0..2] = A (16 x D, registers) times the transpose of tile rows sub..sub+16: B comes
    // straight from the tile's rows (ldmatrix: keys 0-7 and 8-15, low and high 8 columns).
    s += "__device__ __forceinline__ void scores(float (*s)[4], const unsigned (*a)[AW], T (*tile)[SD], int sub, int lane) {\n";
    s += "#pragma unroll\n  for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;\n";
    s += "  const int mi = lane >> 3, row = sub + (mi >> 1) * 8 + (lane & 7), col = (mi & 1) * 8;\n";
    s += "  const unsigned at = smem(&tile[row][col]);\n";
    s += "#pragma unroll\n  for (int ks = 0; ks < D / 16; ++ks) {\n    unsigned b[4];\n    ldsm4(b, at + ks * 32);\n";
    s += "    mma(s[0], a[ks], b);\n    mma(s[1], a[ks], b + 2);\n  }\n}\n";
    // acc (16 x D) += P (16 x 16, as score accumulators) times tile rows sub..sub+16 (B along
    // the tile's rows: ldmatrix.trans, two 8-column tiles per load).
    s += "__device__ __forceinline__ void accumulate(float (*acc)[4], const float (*pr)[4], T (*tile)[SD], int sub, int lane) {\n";
    s += "  const unsigned a[4] = {pack(pr[0][0], pr[0][1]), pack(pr[0][2], pr[0][3]), pack(pr[1][0], pr[1][1]), pack(pr[1][2], pr[1][3])};\n";
    s += "  const int mi = lane >> 3, row = sub + (mi & 1) * 8 + (lane & 7), col = (mi >> 1) * 8;\n";
    s += "  const unsigned at = smem(&tile[row][col]);\n";
    s += "#pragma unroll\n  for (int j = 0; j < D / 8; j += 2) {\n    unsigned b[4];\n    ldsm4t(b, at + j * 16);\n";
    s += "    mma(acc[j], a, b);\n    mma(acc[j + 1], a, b + 2);\n  }\n}\n";
    // Two neighbouring values of a row, stored as one 32-bit word.
    s += "__device__ __forceinline__ void put2(T* p, float lo, float hi) { *(unsigned*)p = pack(lo, hi); }\n";
    s
}

/// The longest sequence `attention_short_source` takes: a lane per key.
pub const ATTN_SHORT_MAX_T: usize = 32;

/// The forward of attention over short sequences (T at most `ATTN_SHORT_MAX_T`, any head
/// dim up to `ATTN_MAX_D`) in FP32 on the CUDA cores: a block per matrix (a head of a batch
/// item) with a warp per query row, q, k and v in shared memory (k's rows padded a float, so
/// that lanes reading one column of it hit 32 banks); lane `j` scores key `j`, the warp's
/// shuffles take the softmax, and the lanes sum the output's columns. The tensor-core kernels'
/// 64-row tiles would be mostly padding (as for a 10-token sequence). Inputs and the
/// output are addressed through `Mat` (heads cut from a fused projection; the output with the
/// heads last). Kernel `k_attn_short_{dtype}_d{d}[_causal](o, q, k, v, mq, mk, mv, mo, T,
/// scale)`, 32 T threads, `attention_short_smem(T, D)` bytes of dynamic shared memory.
pub fn attention_short_source(dtype: DType, d: usize, causal: bool) -> (String, String) {
    let t = storage_type(dtype);
    let name = format!("k_attn_short_{}_d{d}{}", format!("{dtype:?}").to_lowercase(), if causal { "_causal" } else { "" });
    let mut s = format!("{PRELUDE}{LATE_NEXT}\ntypedef {t} T;\n#define D {d}\n#define CAUSAL {}\n", causal as i32);
    s += MAT;
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({}) {name}(T* __restrict__ o, const T* __restrict__ q, const T* __restrict__ k, \
         const T* __restrict__ v, Mat mq, Mat mk, Mat mv, Mat mo, long long Tn, float scale) {{\n",
        32 * ATTN_SHORT_MAX_T
    );
    s += r#"  extern __shared__ float sm[];
  const int tn = (int)Tn, row = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = sm;
  float* ks = qs + tn * D;
  float* vs = ks + tn * (D + 1);
  q += mat_base(mq); k += mat_base(mk); v += mat_base(mv); o += mat_base(mo);
  for (int i = threadIdx.x; i < tn * D; i += blockDim.x) {
    const int r = i / D, c = i % D;
    qs[i] = ld(q[r * mq.t + c]);
    ks[r * (D + 1) + c] = ld(k[r * mk.t + c]);
    vs[i] = ld(v[r * mv.t + c]);
  }
  __syncthreads();
  // Lane j's score against key j (the query's values broadcast from one address).
  const bool live = lane < tn && !(CAUSAL && lane > row);
  float sc = 0.f;
  if (lane < tn) {
    const float* qr = qs + row * D;
    const float* kr = ks + lane * (D + 1);
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < D; ++c) part[c % 4] = fmaf(qr[c], kr[c], part[c % 4]);
    sc = (part[0] + part[1]) + (part[2] + part[3]);
  }
  sc = live ? sc * scale : __int_as_float(0xff800000);
  float mx = sc;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
  const float p = live ? expf(sc - mx) : 0.f;
  float sum = p;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  const float inv = 1.f / sum;
  // (Every lane shuffles, also past D.)
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += 32) {
    const int c = c0 + lane;
    float acc = 0.f;
    for (int j = 0; j < tn; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      if (c < D) acc = fmaf(pj, vs[j * D + c], acc);
    }
    if (c < D) st(&o[row * mo.t + c], acc * inv);
  }
}
"#;
    (s, name)
}

/// Dynamic shared memory of `attention_short_source`'s kernel: q and v `[T, D]`, k `[T, D + 1]`.
pub fn attention_short_smem(t: usize, d: usize) -> usize {
    4 * (2 * t * d + t * (d + 1))
}

/// The three-TF32 split of an F32 `x` (`x = big + small`) that the F32 flash kernels and
/// `wgmma.rs`'s GEMM use, as TF32 operands' bits. `tf32_big(x)`: `x` rounded to TF32 by adding
/// half a TF32 ulp to its bits and clearing the 13 bits TF32 lacks (two integer ops, where
/// `cvt.rna` takes four with its inf/NaN test; an infinity keeps its bits, a NaN stays one in
/// the small part). `tf32_small(x, big)`: `x - big`, exact in F32 and passed whole: the tensor
/// cores read a TF32 operand's top 19 bits and truncate the rest, which costs it 2^-11 of its
/// own size (2^-23 of x's), as CUTLASS's fast F32 products do. (This cuts the instructions
/// of the GEMM's slice and raises its throughput, with the same error; BENCHMARKS.md.)
pub const TF32: &str = "__device__ __forceinline__ unsigned tf32_big(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ unsigned tf32_small(float x, unsigned big) { return __float_as_uint(x - __uint_as_float(big)); }
";

/// The F32 MMA and fragments: `m16n8k8` on TF32, three products per step (`x = big + small`,
/// each part a TF32 value; `a b ~ a_big b_big + a_big b_small + a_small b_big`), which keeps
/// about F32's precision at tensor-core speed, as PyTorch's F32 memory-efficient attention
/// does (CUTLASS's `OpMultiplyAddFastF32`). An A fragment is split once (words 0-3 the big
/// parts, 4-7 the small); B values are split as they are read from the shared tile, with no
/// `ldmatrix`. The score accumulators hold columns `2 tq, 2 tq + 1` where the next product's A
/// wants `tq, tq + 4`: that product's depth is taken in that permuted order, on both sides.
/// (Faster at the GPT shapes than each of these variants: A fragments kept raw and split per
/// use, products grouped so that neighbours feed other accumulators, a whole 64-key score tile
/// at once, three or four blocks per SM. BENCHMARKS.md.)
fn flash_frags_f32() -> String {
    let mut s = String::from("#define KS 8\n#define AW 8\n#define EXP2 exp2f\n");
    s += TF32;
    s += "__device__ __forceinline__ void split(unsigned* a, float x0, float x1, float x2, float x3) {\n";
    s += "  const float x[4] = {x0, x1, x2, x3};\n";
    s += "#pragma unroll\n  for (int i = 0; i < 4; ++i) { a[i] = tf32_big(x[i]); a[i + 4] = tf32_small(x[i], a[i]); }\n}\n";
    s += "__device__ __forceinline__ void mma8(float* c, const unsigned* a, const unsigned* b) {\n";
    s += "  asm volatile(\"mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\"\n";
    s += "    : \"+f\"(c[0]), \"+f\"(c[1]), \"+f\"(c[2]), \"+f\"(c[3]) : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));\n}\n";
    // c += a (split) times the B fragment (b0, b1); the small products first.
    s += "__device__ __forceinline__ void mma(float* c, const unsigned* a, float b0, float b1) {\n";
    s += "  const unsigned big[2] = {tf32_big(b0), tf32_big(b1)};\n";
    s += "  const unsigned small[2] = {tf32_small(b0, big[0]), tf32_small(b1, big[1])};\n";
    s += "  mma8(c, a + 4, big);\n  mma8(c, a, small);\n  mma8(c, a, big);\n}\n";
    s += "__device__ __forceinline__ float ldf(const T* p, long long st, long long row, int c, long long Tn) { return row < Tn ? p[row * st + c] : 0.f; }\n";
    // The A fragments (16 rows from r0, all of D) of a [T, D] matrix with row stride st, split.
    s += "__device__ __forceinline__ void load_a(unsigned (*a)[AW], const T* p, long long st, long long r0, int gq, int tq, long long Tn) {\n";
    s += "#pragma unroll\n  for (int ks = 0; ks < D / 8; ++ks) {\n    const int c = ks * 8 + tq;\n";
    s += "    split(a[ks], ldf(p, st, r0 + gq, c, Tn), ldf(p, st, r0 + gq + 8, c, Tn), ldf(p, st, r0 + gq, c + 4, Tn), ldf(p, st, r0 + gq + 8, c + 4, Tn));\n  }\n}\n";
    // s[0..2] = A (16 x D) times the transpose of tile rows sub..sub+16: B(k, n) is the tile's
    // row sub + 8 nt + n, column k (rows 68 floats apart for D = 64: no bank conflicts).
    s += "__device__ __forceinline__ void scores(float (*s)[4], const unsigned (*a)[AW], T (*tile)[SD], int sub, int lane) {\n";
    s += "  const int gq = lane >> 2, tq = lane & 3;\n";
    s += "#pragma unroll\n  for (int nt = 0; nt < 2; ++nt) {\n    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;\n";
    s += "    const float* b = &tile[sub + nt * 8 + gq][tq];\n";
    s += "#pragma unroll\n    for (int ks = 0; ks < D / 8; ++ks) mma(s[nt], a[ks], b[ks * 8], b[ks * 8 + 4]);\n  }\n}\n";
    // acc (16 x D) += P (16 x 16, as score accumulators) times tile rows sub..sub+16, the
    // depth permuted: depth tq is row 2 tq, depth tq + 4 row 2 tq + 1 (of each 8).
    s += "__device__ __forceinline__ void accumulate(float (*acc)[4], const float (*pr)[4], T (*tile)[SD], int sub, int lane) {\n";
    s += "  const int gq = lane >> 2, tq = lane & 3;\n";
    s += "#pragma unroll\n  for (int kc = 0; kc < 2; ++kc) {\n    unsigned a[8];\n    split(a, pr[kc][0], pr[kc][2], pr[kc][1], pr[kc][3]);\n";
    s += "    const float* b0 = &tile[sub + kc * 8 + 2 * tq][gq];\n    const float* b1 = b0 + SD;\n";
    s += "#pragma unroll\n    for (int j = 0; j < D / 8; ++j) mma(acc[j], a, b0[j * 8], b1[j * 8]);\n  }\n}\n";
    // Two neighbouring values of a row, stored as one 64-bit word.
    s += "__device__ __forceinline__ void put2(T* p, float lo, float hi) { *(float2*)p = make_float2(lo, hi); }\n";
    s
}

/// The tensor-core kernels of fused attention for f16/bf16 (`mma.sync m16n8k16`) and F32
/// (three TF32 `m16n8k8` products each) where `flash_supported`, FlashAttention-2 style with
/// f32 accumulation. A block of 4 warps owns 64 rows, each warp 16, whose
/// operands stay in registers; the other side streams through shared memory in tiles of 64
/// rows (padded against bank conflicts), read with `ldmatrix` (16-bit; `.trans` where it is
/// the product's right operand along rows) or plain loads (F32). A score tile's accumulator layout is the next
/// product's A-operand layout, so probabilities never leave registers. The grid is (matrix,
/// 64-row block); the forward and dq take an optional per-row log-sum-exp (`lse`, null for
/// none) that the forward writes and dq reads instead of recomputing it.
pub fn flash_source(kind: AttnKernel, dtype: DType, d: usize, causal: bool) -> (String, String) {
    let t = storage_type(dtype);
    let name = format!(
        "k_flash_{}_{}_d{d}{}",
        format!("{kind:?}").to_lowercase(),
        format!("{dtype:?}").to_lowercase(),
        if causal { "_causal" } else { "" }
    );
    let mut s = format!("{PRELUDE}{LATE_NEXT}\ntypedef {t} T;\n#define D {d}\n#define CAUSAL {}\n", causal as i32);
    s += &format!("#define NEG_INF __int_as_float(0xff800000)\n#define HEAVY_LAST {}\n", (kind != AttnKernel::Dkv) as i32);
    s += &flash_helpers(dtype);
    s += FLASH_COMMON;
    // Registers bound occupancy: four blocks per SM are faster for the 16-bit forward and
    // dq kernels (128 registers, no spills); the dk/dv kernel spills at four (and is slower
    // there at the GPT's shape than with three, which it is held to), and so would the F32 ones, whose A
    // fragments take twice the registers (split). The F32 forward fits three blocks' 168
    // registers with no spill up to D = 64 (three blocks' shared memory fits there), faster
    // than two at the GPT shapes. No bound asks for more blocks than an SM's
    // shared memory (227 KiB a block at most, 228 an SM) holds: at D = 128 three 16-bit blocks
    // or one F32 block fit, and registers held down for a fourth or second only spilled.
    let fit = (228 * 1024 / (flash_smem_bytes(dtype, d) + 1024)).max(1);
    let wide = (if dtype == DType::F32 { 2 } else { 4 }).min(fit);
    let fwd = match dtype {
        DType::F32 if d <= 64 => 3,
        DType::F32 => 2,
        _ => 4,
    }
    .min(fit);
    let (sig, body, min_blocks) = match kind {
        AttnKernel::Fwd => (
            format!("{t}* __restrict__ o, float* __restrict__ lse, const {t}* __restrict__ q, const {t}* __restrict__ k, const {t}* __restrict__ v, Mat mq, Mat mk, Mat mv, Mat mo"),
            FLASH_FWD,
            fwd,
        ),
        AttnKernel::Dq => (
            format!("{t}* __restrict__ dq, float* __restrict__ stats, const float* __restrict__ lse, const {t}* __restrict__ q, const {t}* __restrict__ k, const {t}* __restrict__ v, const {t}* __restrict__ o, const {t}* __restrict__ g, Mat mq, Mat mk, Mat mv, Mat mo, Mat mg, Mat mout"),
            FLASH_DQ,
            wide,
        ),
        AttnKernel::Dkv => (
            format!("{t}* __restrict__ dk, {t}* __restrict__ dv, const float* __restrict__ stats, const {t}* __restrict__ q, const {t}* __restrict__ k, const {t}* __restrict__ v, const {t}* __restrict__ g, Mat mq, Mat mk, Mat mv, Mat mg, Mat mout"),
            FLASH_DKV,
            if dtype != DType::F32 && d <= 64 { 3 } else { 1 },
        ),
    };
    s += &format!("extern \"C\" __global__ void __launch_bounds__(128, {min_blocks}) {name}({sig}, long long Tn, float scale) {{\n{FLASH_HEAD}{body}}}\n");
    (s, name)
}

// Score tiles: element e of n-tile nt is row rows0 + gq (+8 for e >= 2), column cols0 + nt * 8
// + tq * 2 + (e & 1). Only tiles on the causal diagonal or past T are masked; the others are
// only scaled.
const FLASH_COMMON: &str = r#"
// Offsets from the tile's corner are 32-bit (the tile's rows and columns lie within T of each
// other): the mask's integer work was the kernels' busiest pipe.
template <int NT> __device__ __forceinline__ void mask(float (*s)[4], long long rows0, long long cols0, int gq, int tq, long long Tn, float scale, bool keys_are_cols) {
  const long long left = Tn - cols0;
  const int width = left < NT * 8 ? (int)left : NT * 8, ahead = (int)(cols0 - rows0);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = gq + (e >= 2 ? 8 : 0), c = nt * 8 + tq * 2 + (e & 1);
      // key > query, with the key a column (c + ahead > r) or a row (r > c + ahead).
      const bool later = keys_are_cols ? c + ahead > r : r > c + ahead;
      s[nt][e] = (c >= width || (CAUSAL && later)) ? NEG_INF : s[nt][e] * scale;
    }
}
// Scales the scores of a warp's 16 rows from r0 against NT * 8 columns from c0, masking them
// only where some column lies past T or (causal) some key comes after its query.
template <int NT> __device__ __forceinline__ void scale_mask(float (*s)[4], long long r0, long long c0, int gq, int tq, long long Tn, float scale, bool keys_are_cols) {
  const long long last = c0 + NT * 8 - 1;
  const bool edge = last >= Tn || (CAUSAL && (keys_are_cols ? last > r0 : r0 + 15 > c0));
  if (edge) { mask<NT>(s, r0, c0, gq, tq, Tn, scale, keys_are_cols); return; }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] *= scale;
}
// g.o over quarter tq of a row (a quad's four threads sum the row): by 16-byte pieces where a
// quarter is whole pieces (rows are aligned to them), else a column in four.
__device__ __forceinline__ float quarter_dot(const T* g, const T* o, int tq) {
  float acc = 0.f;
#if (D / 4) % VEC == 0
  struct alignas(16) V { T v[VEC]; };
#pragma unroll
  for (int c = tq * (D / 4); c < (tq + 1) * (D / 4); c += VEC) {
    const V a = *(const V*)(g + c), b = *(const V*)(o + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc += ld(a.v[e]) * ld(b.v[e]);
  }
#else
  for (int c = tq; c < D; c += 4) acc += ld(g[c]) * ld(o[c]);
#endif
  return acc;
}
// The kernels' four shared tiles (two matrices, two buffers each), in dynamic shared memory:
// `flash_smem_bytes`.
__device__ __forceinline__ T (*tiles())[64][SD] {
  extern __shared__ __align__(16) unsigned char dyn[];
  return reinterpret_cast<T (*)[64][SD]>(dyn);
}
// Tiles stream through two shared buffers: `stream_start` loads tile rows row0.. of one or two
// matrices into buffer 0; `stream_next` starts loading the next tile (at `next`, if below `end`)
// into the other buffer, waits for the current one and syncs the block. Each loop iteration ends
// with a barrier, so a buffer is refilled only after every warp has read it.
__device__ __forceinline__ void stream_start(T (*a)[64][SD], const T* pa, long long sa, T (*b)[64][SD], const T* pb, long long sb, long long row0, long long Tn) {
  load_tile_async(a[0], pa, sa, row0, Tn);
  if (b) load_tile_async(b[0], pb, sb, row0, Tn);
  async_commit();
}
__device__ __forceinline__ void stream_next(T (*a)[64][SD], const T* pa, long long sa, T (*b)[64][SD], const T* pb, long long sb, int buf, long long next, long long end, long long Tn) {
  if (next < end) {
    load_tile_async(a[buf ^ 1], pa, sa, next, Tn);
    if (b) load_tile_async(b[buf ^ 1], pb, sb, next, Tn);
    async_commit();
    async_wait<1>();
  } else {
    async_wait<0>();
  }
  __syncthreads();
}
// The scores of a warp's 16 rows (A fragments a) against the 64 rows of a shared tile whose
// first is row c0: sub-tiles from `end` on are not computed and keep what s held. Every caller
// masks next, and a sub-tile past `end` (past T, or causal keys after all the warp's queries)
// is wholly masked there: writing -inf here too cost a move per score.
__device__ __forceinline__ void tile_scores(float (*s)[4], const unsigned (*a)[AW], T (*tile)[SD], long long c0, long long end, int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (c0 + 16 * i < end) scores(s + 2 * i, a, tile, 16 * i, lane);
}
// The scaled and masked scores of a warp's 16 query rows (from r0) against a 64-key tile from
// kt; and this thread's maximum over one row half h (rows gq, gq + 8) of such a tile.
__device__ __forceinline__ void key_tile_scores(float (*s)[4], const unsigned (*a)[AW], T (*tile)[SD], long long r0, long long kt, long long mine, int gq, int tq, long long Tn, float scale, int lane) {
  tile_scores(s, a, tile, kt, mine, lane);
  scale_mask<8>(s, r0, kt, gq, tq, Tn, scale, true);
}
__device__ __forceinline__ float tile_max(const float (*s)[4], int h) {
  float mx = NEG_INF;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
  return mx;
}
"#;

// Every warp stays to the end: the shared tiles need all of them at each barrier. Query rows
// stream over key tiles: the block up to its last row's keys, each warp up to its own.
// The matrix is blockIdx.x and the 64-row block blockIdx.y, numbered so that the blocks with the
// most tiles to stream (under a causal mask: the last query blocks, the first key blocks)
// start first and the last wave holds the shortest. Scores are scaled into base-2 units
// (`sl`), so that each exponential is one `ex2`.
const FLASH_HEAD: &str = r#"  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane >> 2, tq = lane & 3;
  const long long blk = CAUSAL && HEAVY_LAST ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  const long long rb = blk * 64, r0 = rb + warp * 16;
  const float sl = scale * 1.4426950408889634f;
  // Where the warp stages its results: its own 16 rows of the first shared tile, free once the
  // loops end (each iteration ends at a barrier, and the last wait leaves no copy in flight).
  T (*stage)[SD] = tiles()[0] + warp * 16;
  const long long kend = CAUSAL ? (rb + 64 < Tn ? rb + 64 : Tn) : Tn, mine = CAUSAL ? (r0 + 16 < Tn ? r0 + 16 : Tn) : Tn;
"#;

// The forward: a running max and sum per row, updated once per 64-key tile; with `lse`, each
// row's log-sum-exp (base 2, of the scaled scores) kept for the backward's dq.
const FLASH_FWD: &str = r#"  T (*ks)[64][SD] = tiles(), (*vs)[64][SD] = ks + 2;
  q += mat_base(mq); k += mat_base(mk); v += mat_base(mv); o += mat_base(mo);
  stream_start(ks, k, mk.t, vs, v, mv.t, 0, Tn);
  unsigned qa[D / KS][AW];
  load_a(qa, q, mq.t, r0, gq, tq, Tn);
  float acc[D / 8][4];
  ZERO(acc);
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  float sc[8][4] = {};  // scores; zeroed once, as sub-tiles that `tile_scores` skips keep theirs
  int buf = 0;
  for (long long kt = 0; kt < kend; kt += 64, buf ^= 1) {
    stream_next(ks, k, mk.t, vs, v, mv.t, buf, kt + 64, kend, Tn);
    if (kt < mine) {
      key_tile_scores(sc, qa, ks[buf], r0, kt, mine, gq, tq, Tn, sl, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = tile_max(sc, h);
        mx = quad_max(mx);
        const float mn = fmaxf(m[h], mx), ms = mn == NEG_INF ? 0.f : mn, corr = EXP2(m[h] - ms);
        m[h] = mn;
        l[h] *= corr;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) { acc[j][2 * h] *= corr; acc[j][2 * h + 1] *= corr; }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          sc[nt][2 * h] = EXP2(sc[nt][2 * h] - ms);
          sc[nt][2 * h + 1] = EXP2(sc[nt][2 * h + 1] - ms);
          l[h] += sc[nt][2 * h] + sc[nt][2 * h + 1];
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (kt + 16 * i < mine) accumulate(acc, sc + 2 * i, vs[buf], 16 * i, lane);
    }
    __syncthreads();
  }
  const float l0 = quad_sum(l[0]), l1 = quad_sum(l[1]);
  store(o, mo.t, acc, r0, gq, tq, Tn, 1.f / l0, 1.f / l1, stage, lane);
  if (lse && tq == 0) {
    const long long at = (long long)blockIdx.x * Tn + r0 + gq;
    if (r0 + gq < Tn) lse[at] = (m[0] == NEG_INF ? 0.f : m[0]) + log2f(l0);
    if (r0 + gq + 8 < Tn) lse[at + 8] = (m[1] == NEG_INF ? 0.f : m[1]) + log2f(l1);
  }
"#;

// dq = scale * sum_j p (g.v_j - Dsum) k_j. Each row's log-sum-exp comes from the forward
// (`lse`) or, without it, from a first pass (a running max and sum per thread, per 64-key
// tile, joined over the row's 4 threads after); it and Dsum = g.o go to `stats` for the dk/dv
// kernel.
const FLASH_DQ: &str = r#"  T (*ks)[64][SD] = tiles(), (*vs)[64][SD] = ks + 2;
  q += mat_base(mq); k += mat_base(mk); v += mat_base(mv); o += mat_base(mo); g += mat_base(mg); dq += mat_base(mout);
  unsigned qa[D / KS][AW];
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  int buf = 0;
  if (!lse) stream_start(ks, k, mk.t, nullptr, nullptr, 0, 0, Tn);
  load_a(qa, q, mq.t, r0, gq, tq, Tn);
  float sc[8][4] = {};  // as in the forward
  for (long long kt = 0; !lse && kt < kend; kt += 64, buf ^= 1) {
    stream_next(ks, k, mk.t, nullptr, nullptr, 0, buf, kt + 64, kend, Tn);
    if (kt < mine) {
      key_tile_scores(sc, qa, ks[buf], r0, kt, mine, gq, tq, Tn, sl, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mx = tile_max(sc, h), mn = fmaxf(m[h], mx), ms = mn == NEG_INF ? 0.f : mn;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) sum += EXP2(sc[nt][2 * h] - ms) + EXP2(sc[nt][2 * h + 1] - ms);
        l[h] = l[h] * EXP2(m[h] - ms) + sum;
        m[h] = mn;
      }
    }
    __syncthreads();
  }
  stream_start(ks, k, mk.t, vs, v, mv.t, 0, Tn);
  float L[2], Ds[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long r = r0 + gq + 8 * h;
    if (lse) {
      L[h] = r < Tn ? lse[(long long)blockIdx.x * Tn + r] : 0.f;
    } else {
      const float mx = quad_max(m[h]), ms = mx == NEG_INF ? 0.f : mx;
      L[h] = ms + log2f(quad_sum(l[h] * EXP2(m[h] - ms)));
    }
    Ds[h] = quad_sum(r < Tn ? quarter_dot(g + r * mg.t, o + r * mo.t, tq) : 0.f);
    if (r < Tn && tq == 0) { const long long at = ((long long)blockIdx.x * Tn + r) * 2; stats[at] = L[h]; stats[at + 1] = Ds[h]; }
  }
  unsigned ga[D / KS][AW];
  load_a(ga, g, mg.t, r0, gq, tq, Tn);
  float acc[D / 8][4];
  ZERO(acc);
  buf = 0;
  for (long long kt = 0; kt < kend; kt += 64, buf ^= 1) {
    stream_next(ks, k, mk.t, vs, v, mv.t, buf, kt + 64, kend, Tn);
#pragma unroll 1
    for (int sub = 0; sub < 64; sub += 16) {
      const long long kb = kt + sub;
      if (kb >= mine) break;
      float sc[2][4], dp[2][4];
      scores(sc, qa, ks[buf], sub, lane);
      scale_mask<2>(sc, r0, kb, gq, tq, Tn, sl, true);
      scores(dp, ga, vs[buf], sub, lane);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = EXP2(sc[nt][e] - L[e / 2]) * (dp[nt][e] - Ds[e / 2]);
      accumulate(acc, sc, ks[buf], sub, lane);
    }
    __syncthreads();
  }
  store(dq, mout.t, acc, r0, gq, tq, Tn, scale, scale, stage, lane);
"#;

// dk and dv: here a warp's rows (from r0) are keys and a score tile's columns are queries.
const FLASH_DKV: &str = r#"  T (*qs)[64][SD] = tiles(), (*gs)[64][SD] = qs + 2;
  __shared__ float2 LD[2][64];  // each query row's log-sum-exp and Dsum
  q += mat_base(mq); k += mat_base(mk); v += mat_base(mv); g += mat_base(mg); dk += mat_base(mout); dv += mat_base(mout);
  stats += (long long)blockIdx.x * Tn * 2;
  const long long q0 = CAUSAL ? rb : 0;
  // Each query tile's (log-sum-exp, Dsum) pairs go with it, an 8-byte async copy a row in the
  // tile's group (zeros past T). Plain loads stalled two warps, and so the block's barrier, on
  // a trip to memory every tile.
  auto load_stats = [&](int b, long long qt) {
    if (threadIdx.x < 64) {
      const bool in = qt + threadIdx.x < Tn;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(smem(&LD[b][threadIdx.x])), "l"(in ? stats + (qt + threadIdx.x) * 2 : stats), "r"(in ? 8 : 0));
    }
  };
  load_stats(0, q0);
  stream_start(qs, q, mq.t, gs, g, mg.t, q0, Tn);
  unsigned ka[D / KS][AW], va[D / KS][AW];
  load_a(ka, k, mk.t, r0, gq, tq, Tn);
  load_a(va, v, mv.t, r0, gq, tq, Tn);
  float gk[D / 8][4], gv[D / 8][4];
  ZERO(gk);
  ZERO(gv);
  int buf = 0;
  for (long long qt = q0; qt < Tn; qt += 64, buf ^= 1) {
    if (qt + 64 < Tn) load_stats(buf ^ 1, qt + 64);
    stream_next(qs, q, mq.t, gs, g, mg.t, buf, qt + 64, Tn, Tn);
#pragma unroll 1
    for (int sub = 0; sub < 64; sub += 16) {
      const long long qb = qt + sub;
      if (qb >= Tn) break;
      if (CAUSAL && qb + 15 < r0) continue;  // every query here comes before this warp's keys
      float pt[2][4], dpt[2][4];
      scores(pt, ka, qs[buf], sub, lane);
      scale_mask<2>(pt, r0, qb, gq, tq, Tn, sl, false);
      scores(dpt, va, gs[buf], sub, lane);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = sub + nt * 8 + tq * 2 + (e & 1);
          const float2 ld = LD[buf][qi];
          pt[nt][e] = EXP2(pt[nt][e] - ld.x);
          dpt[nt][e] = pt[nt][e] * (dpt[nt][e] - ld.y);
        }
      accumulate(gv, pt, gs[buf], sub, lane);
      accumulate(gk, dpt, qs[buf], sub, lane);
    }
    __syncthreads();
  }
  store(dk, mout.t, gk, r0, gq, tq, Tn, scale, scale, stage, lane);
  store(dv, mout.t, gv, r0, gq, tq, Tn, 1.f, 1.f, stage, lane);
"#;
