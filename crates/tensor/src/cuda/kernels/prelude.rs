//! What every CUDA kernel family shares: the device prelude every kernel starts with (storage
//! types for f16/bf16 converted with PTX, loads to a compute type, the `k*` math overloads,
//! warp reductions, programmatic dependent launch), the row kernels' common text, and on the
//! host the device storage and the argument helpers every launcher uses.

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

/// Marks a source that must be compiled for the architecture-specific target (`sm_90a`):
/// `wgmma` exists nowhere else. `nvrtc::target` reads it.
pub const ARCH_SPECIFIC: &str = "// kiln: arch-specific (sm_90a)\n";

/// Defined by the long compute-bound kernels (the Hopper GEMM, attention): they let the next
/// kernel launch only as their blocks finish: the next kernel's blocks waiting beside theirs
/// on the SMs slow the Transformer forward, while the small kernels of a step like MLP b32's
/// gain from launching the next early (BENCHMARKS.md).
pub const LATE_NEXT: &str = "#define LATE_NEXT\n";

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
// in integer steps (a NaN keeps its sign and payload, quieted). The software form costs about
// a tenth of the instructions of an instruction-bound BF16 GELU gradient.
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

/// CUDA text that all-reduces `acc` (of type C) over a row's threads: a warp with shuffles,
/// or a block through shared memory `sh` (32 slots). `max` folds NaN-first maxima, else sums.
pub(crate) fn row_allreduce(block: bool, max: bool) -> String {
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
pub(crate) fn lanes_allreduce(max: bool, width: usize) -> String {
    let f = if max { "(o_ > acc || o_ != o_ ? o_ : acc)" } else { "(acc + o_)" };
    match width {
        0 | 1 => String::new(),
        w => format!("  for (int w = {}; w > 0; w /= 2) {{ C o_ = __shfl_xor_sync(0xffffffffu, acc, w); acc = {f}; }}\n", w / 2),
    }
}

/// A row kernel's name: `k_<stem>_<dtype>`, with `_block` for its block-per-row form.
pub(crate) fn row_kernel_name(stem: &str, dtype: DType, block: bool) -> String {
    format!("k_{stem}_{}{}", format!("{dtype:?}").to_lowercase(), if block { "_block" } else { "" })
}

/// A kernel name's mark of a second dtype: `_{tag}{other}` where it differs from `base`.
pub(crate) fn other_dtype(tag: &str, base: DType, other: DType) -> String {
    if other == base {
        String::new()
    } else {
        format!("_{tag}{}", format!("{other:?}").to_lowercase())
    }
}

/// The thread mapping shared by the row kernels: a warp per row, or a block per row.
pub(crate) fn row_prologue(block: bool) -> &'static str {
    if block {
        "  __shared__ C sh[32];\n  long long row = blockIdx.x; int lane = threadIdx.x, tpr = blockDim.x;\n"
    } else {
        "  long long row = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; int lane = threadIdx.x % 32, tpr = 32;\n  if (row >= a.rows) return;\n"
    }
}

/// Calls `f(o, i)` for a thread's share of an `outer x inner` range, the `nt` threads taking
/// consecutive elements (row-major), each stepping on without a division: the staging loops
/// of the kernels that load their operands into shared memory.
pub(crate) const WALK: &str = r#"template <class F> __device__ __forceinline__ void kiln_walk(int outer, int inner, int tid, int nt, F f) {
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

#[cfg(feature = "cuda")]
pub use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::MAX_RANK;

    use crate::shape::Layout;
    pub use crate::storage::cuda::{CudaStorage, RowLse};
    use crate::storage::Storage;
    use crate::{Error, Result};

    /// A kernel's parameter array: the address of each argument, in order.
    macro_rules! kernel_params {
    ($($x:ident),*) => { [$(&mut $x as *mut _ as *mut ::std::ffi::c_void),*] };
}
    pub(crate) use kernel_params;

    /// An argument struct and its C twin, for `kernels::argument_layouts`' test: the C text
    /// of `struct {c_name} {{ .. }};` as a kernel's source declares it (after the source's
    /// `#define`s its array lengths may name), and the Rust struct's size and, by the C
    /// twin's field names, its offsets.
    #[derive(Debug)]
    pub struct ArgLayout {
        pub rust: &'static str,
        pub c_name: &'static str,
        pub c_text: String,
        pub size: usize,
        pub offsets: Vec<(&'static str, usize)>,
    }

    /// The `#define` lines of `src`, then its `struct name { .. };` (empty if it has none).
    pub(crate) fn c_struct(src: &str, name: &str) -> String {
        let defines: String = src.lines().filter(|l| l.trim_start().starts_with("#define")).map(|l| format!("{l}\n")).collect();
        let Some(at) = src.find(&format!("struct {name} {{")) else { return String::new() };
        let end = src[at..].find("};").map_or(src.len(), |e| at + e + 2);
        format!("{defines}{}\n", &src[at..end])
    }

    /// An `ArgLayout` of Rust struct `$t` and the C struct `$c` in `$src`, fields paired as
    /// `rust_field => c_field`.
    macro_rules! layout_check {
        ($src:expr, $c:literal, $t:ty, { $($rf:ident => $cf:ident),* $(,)? }) => {
            $crate::cuda::kernels::prelude::ArgLayout {
                rust: stringify!($t),
                c_name: $c,
                c_text: $crate::cuda::kernels::prelude::c_struct(&$src, $c),
                size: std::mem::size_of::<$t>(),
                offsets: vec![$((stringify!($cf), std::mem::offset_of!($t, $rf))),*],
            }
        };
    }
    pub(crate) use layout_check;

    /// Drops size-1 dims and merges dims that every operand walks as one.
    pub(crate) fn coalesce(shape: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
        let mut s: Vec<usize> = Vec::new();
        let mut st: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
        for d in (0..shape.len()).filter(|&d| shape[d] != 1) {
            let merge = !s.is_empty() && strides.iter().zip(&st).all(|(x, y)| y[y.len() - 1] == x[d] * shape[d]);
            if merge {
                *s.last_mut().unwrap_or(&mut 0) *= shape[d];
                for (x, y) in strides.iter().zip(st.iter_mut()) {
                    let last = y.len() - 1;
                    y[last] = x[d];
                }
            } else {
                s.push(shape[d]);
                for (x, y) in strides.iter().zip(st.iter_mut()) {
                    y.push(x[d]);
                }
            }
        }
        (s, st)
    }

    pub(crate) fn too_many_dims(shape: &[usize]) -> Error {
        Error::shape("cuda kernel", format!("shape {shape:?} has more than {MAX_RANK} dims that cannot be merged"))
    }

    pub(crate) fn storages<'a>(ins: &[&'a Storage]) -> Result<Vec<&'a CudaStorage>> {
        ins.iter()
            .map(|s| match s {
                Storage::Cuda(c) => Ok(c),
                Storage::Cpu(_) => Err(Error::Msg("a CPU buffer reached a CUDA kernel".into())),
            })
            .collect()
    }

    /// A buffer read through a layout.
    pub(crate) type View<'a> = (&'a CudaStorage, &'a Layout);
}
