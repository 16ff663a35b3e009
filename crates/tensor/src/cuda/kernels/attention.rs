//! Fused attention: flash attention on tensor cores (`mma.sync`), the tiled FMA kernels for
//! other head dims, the short-sequence kernel, forward and backward, with their launches.

use crate::cuda::kernels::prelude::{storage_type, LATE_NEXT, PRELUDE, TF32};
use crate::DType;

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
    d.is_multiple_of(step) && d > 0 && d <= ATTN_MAX_D
}

/// Device helpers of the flash kernels: shared tiles, `Mat`, async copies, quad reductions,
/// the MMA and its fragments for the dtype (`flash_frags_16` or `flash_frags_f32`, each with its
/// `put2`), then the accumulator store.
/// Each kernel body sees `KS` (the MMA's depth), `AW` (words of one A fragment) and `EXP`.
fn flash_helpers(dtype: DType) -> String {
    let mut s = format!("#define SD (D + {})\n#define VEC {}\n", flash_vec(dtype), flash_vec(dtype));
    s += "__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }\n";
    // One [T, D] matrix of a batch: row t of matrix n at `(n / nh) * b + (n % nh) * h + t * t`
    // elements (a head of a fused projection is read where it lies, with no copy; `n` is the
    // block's matrix over `rep`, `MAT`).
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

/// One `[T, D]` matrix of an attention batch (`Mat`), and where block `blockIdx.x`'s
/// starts. In 32 bits (the matrix is a block index, `nh` at most their count): a 64-bit division
/// is a long subroutine, and a kernel places up to six matrices.
/// Under grouped-query attention a key or value operand has `rep` > 1: block `n` reads its
/// matrix `n / rep`.
const MAT: &str = "struct Mat { long long b, h, t, nh, rep; };
__device__ __forceinline__ long long mat_base(Mat m) { const unsigned n = blockIdx.x / (unsigned)m.rep, nh = (unsigned)m.nh; return (long long)(n / nh) * m.b + (long long)(n % nh) * m.h; }
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

/// The threads of `attention_rows_source`'s block.
pub const ATTN_ROWS_THREADS: usize = 256;

/// The forward of attention with S keys for T queries, S and T apart (a decoding step's few
/// queries over the key/value cache), in FP32 on the CUDA cores: a block per (matrix, query
/// row) with the row's scores in shared memory. A warp per key scores it (lanes along D, the
/// key's row read coalesced), the block takes the softmax, then groups of D threads sum the
/// output's columns over interleaved keys. With `causal`, query `i` sees keys `0..=i + S - T`
/// (its position when the queries are the last T of the S). Kernel
/// `k_attn_rows_{dtype}_d{d}[_causal](o, q, k, v, mq, mk, mv, mo, T, S, scale)`, grid (matrices,
/// T), `ATTN_ROWS_THREADS` threads, `attention_rows_smem(S, D)` bytes of dynamic shared memory.
pub fn attention_rows_source(dtype: DType, d: usize, causal: bool) -> (String, String) {
    let t = storage_type(dtype);
    let name = format!("k_attn_rows_{}_d{d}{}", format!("{dtype:?}").to_lowercase(), if causal { "_causal" } else { "" });
    let mut s = format!("{PRELUDE}{LATE_NEXT}\ntypedef {t} T;\n#define D {d}\n#define CAUSAL {}\n", causal as i32);
    s += MAT;
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({ATTN_ROWS_THREADS}) {name}(T* __restrict__ o, const T* __restrict__ q, \
         const T* __restrict__ k, const T* __restrict__ v, Mat mq, Mat mk, Mat mv, Mat mo, long long Tn, long long Sn, float scale) {{\n"
    );
    s += r#"  extern __shared__ float sm[];
  __shared__ float red[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const long long i = blockIdx.y;
  const long long keys = CAUSAL ? min(Sn, max(0LL, i + 1 + Sn - Tn)) : Sn;
  float* qs = sm;
  float* sc = qs + D;
  float* part = sc + Sn;
  q += mat_base(mq) + i * mq.t; k += mat_base(mk); v += mat_base(mv); o += mat_base(mo) + i * mo.t;
  for (int c = threadIdx.x; c < D; c += blockDim.x) qs[c] = ld(q[c]) * scale;
  __syncthreads();
  float mx = __int_as_float(0xff800000);
  for (long long j = warp; j < keys; j += warps) {
    const T* kr = k + j * mk.t;
    float acc = 0.f;
    for (int c = lane; c < D; c += 32) acc = fmaf(qs[c], ld(kr[c]), acc);
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
    if (lane == 0) sc[j] = acc;
    mx = fmaxf(mx, acc);
  }
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < warps; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float sum = 0.f;
  for (long long j = threadIdx.x; j < keys; j += blockDim.x) {
    const float p = expf(sc[j] - mx);
    sc[j] = p;
    sum += p;
  }
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < warps; ++w) sum += red[w];
  const int groups = blockDim.x / D, g = threadIdx.x / D, c = threadIdx.x % D;
  float acc = 0.f;
  if (g < groups)
    for (long long j = g; j < keys; j += groups) acc = fmaf(sc[j], ld(v[j * mv.t + c]), acc);
  if (g < groups) part[g * D + c] = acc;
  __syncthreads();
  if (threadIdx.x < D) {
    float total = 0.f;
    for (int h = 0; h < groups; ++h) total += part[h * D + threadIdx.x];
    st(&o[threadIdx.x], keys > 0 ? total / sum : 0.f);
  }
}
"#;
    (s, name)
}

/// Dynamic shared memory of `attention_rows_source`'s kernel: the query, S scores and a
/// column sum per group of D threads.
pub fn attention_rows_smem(s: usize, d: usize) -> usize {
    4 * (d + s + (ATTN_ROWS_THREADS / d.max(1)).max(1) * d)
}

/// The most dynamic shared memory `attention_rows_source`'s kernel asks for: within every
/// GPU since Ampere (99 KiB a block on the smallest), so about 24k keys.
pub const ATTN_ROWS_MAX_SMEM: usize = 96 * 1024;

/// Whether `attention_rows_source`'s kernel takes T queries over S keys of head dim D (its
/// grid has a block row per query, its scores live in shared memory).
pub fn attention_rows_fit(t: usize, s: usize, d: usize) -> bool {
    t <= 65535 && attention_rows_smem(s, d) <= ATTN_ROWS_MAX_SMEM
}

/// Dynamic shared memory of `attention_short_source`'s kernel: q and v `[T, D]`, k `[T, D + 1]`.
pub fn attention_short_smem(t: usize, d: usize) -> usize {
    4 * (2 * t * d + t * (d + 1))
}

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

#[cfg(feature = "cuda")]
pub(crate) use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::*;
    use crate::cuda::gpu::{Gpu, Kernel};
    use crate::cuda::kernels::elementwise::{dense, dense_copy, Dense};
    use crate::cuda::kernels::prelude::{coalesce, kernel_params, CudaStorage, RowLse};
    use crate::shape::Layout;
    use crate::{DType, Error, Result};
    use std::ffi::c_void;
    use std::sync::Arc;

    /// Fused attention: the forward (with `heads_last`, written `[B, T, H, D]`), or the backward's
    /// dq, dk and dv packed as `[B, T, 3, H.., D]` (`op::attention_grads_shape`). The tensor-core
    /// kernels read each input where it lies when its rows can be addressed as `Mat` (a head cut
    /// from a fused projection) and write where `Mat` says; otherwise, and for the FMA kernels, an
    /// input is first copied dense, and an output copied into place after.
    pub(crate) fn attention(
        g: &Arc<Gpu>,
        x: &[(&CudaStorage, &Layout)],
        (scale, causal): (f64, bool),
        backward: bool,
        heads_last: bool,
    ) -> Result<CudaStorage> {
        let (s0, l0) = x[0];
        let r = l0.rank();
        let (n, t, d) = (l0.shape[..r - 2].iter().product::<usize>(), l0.shape[r - 2], l0.shape[r - 1]);
        let dtype = s0.dtype;
        let (flash, short) = (flash_supported(dtype, d), !backward && t <= ATTN_SHORT_MAX_T);
        let most = if flash || short { i32::MAX as usize } else { ATTN_FMA_MAX_MATRICES };
        if d > ATTN_MAX_D || n > most || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::Msg(format!(
            "attention on CUDA: {:?} in {dtype:?} is not supported (head dim at most {ATTN_MAX_D}, at most {most} batch matrices, f32/f16/bf16); use the unfused ops",
            l0.shape
        )));
        }
        let len = n * t * d;
        let out = CudaStorage::alloc(&g.mem, dtype, if backward { 3 * len } else { len })?;
        if len == 0 {
            return Ok(out);
        }
        let heads = crate::op::attention_heads(&l0.shape);
        // The heads last: matrix b*H + h's row i at b T H D + i H D + h D.
        let last = Mat { b: (t * heads * d) as i64, h: d as i64, t: (heads * d) as i64, nh: heads as i64, rep: 1 };
        let mout = if heads_last { last } else { Mat::dense(t, d) };
        let keys = x[1].1.shape[r - 2];
        if keys != t {
            if backward {
                return Err(Error::Msg(format!(
                    "attention_backward on CUDA: {keys} keys for {t} queries (the fused backward takes one length)"
                )));
            }
            let (ins, _copies) = attention_inputs(g, x, d, Some(1))?;
            attention_rows(g, out.buf.ptr, mout, &ins, (n, t, keys, d), dtype, (scale, causal))?;
            return Ok(out);
        }
        if short {
            let (ins, _copies) = attention_inputs(g, x, d, Some(1))?;
            attention_short(g, out.buf.ptr, mout, &ins, (n, t, d), dtype, (scale, causal))?;
            return Ok(out);
        }
        let (ins, copies) = attention_inputs(g, x, d, flash.then(|| flash_vec(dtype)))?;
        if !backward {
            if flash {
                let mut out = out;
                let lse = RowLse { buf: g.alloc(n * t * 4)?, rows: n * t, scale, causal };
                attention_kernels(g, &[out.buf.ptr], mout, &ins, (n, t, d), dtype, (scale, causal, lse.buf.ptr))?;
                out.lse = Some(lse);
                return Ok(out);
            }
            if !heads_last {
                attention_kernels(g, &[out.buf.ptr], mout, &ins, (n, t, d), dtype, (scale, causal, 0))?;
                return Ok(out);
            }
            attention_kernels(g, &[out.buf.ptr], Mat::dense(t, d), &ins, (n, t, d), dtype, (scale, causal, 0))?;
            return dense_copy(g, &out, &Layout::contiguous(&[n / heads, heads, t, d]).permuted(&[0, 2, 1, 3]));
        }
        // The gradients, packed as `[B, T, 3, H.., D]` (`op::attention_grads_shape`): batch matrix
        // b*H + h of dq starts at b T 3 H D + h D, its rows 3 H D apart; dk and dv follow dq.
        let packed = Mat { b: (t * 3 * heads * d) as i64, h: d as i64, t: (3 * heads * d) as i64, nh: heads as i64, rep: 1 };
        let e = (heads * d * dtype.size_in_bytes()) as u64;
        if flash {
            let lse = forward_lse(x[3], (n, t, d), (scale, causal));
            attention_kernels(
                g,
                &[out.buf.ptr, out.buf.ptr + e, out.buf.ptr + 2 * e],
                packed,
                &ins,
                (n, t, d),
                dtype,
                (scale, causal, lse),
            )?;
            return Ok(out);
        }
        // The FMA kernels write dense [3, n, T, D]; one copy packs it.
        let bytes = (len * dtype.size_in_bytes()) as u64;
        attention_kernels(
            g,
            &[out.buf.ptr, out.buf.ptr + bytes, out.buf.ptr + 2 * bytes],
            Mat::dense(t, d),
            &ins,
            (n, t, d),
            dtype,
            (scale, causal, 0),
        )?;
        let outer = n / heads.max(1);
        let l = Layout { shape: vec![outer, t, 3, heads, d], strides: vec![heads * t * d, d, len, t * d, 1], offset: 0 };
        let packed_out = dense_copy(g, &out, &l);
        drop(copies);
        packed_out
    }

    /// The device address of the per-row log-sum-exp that the flash forward kept with `o` (the
    /// backward's `o`: that forward's output, whole, for the same matrices, scale and mask), or 0.
    fn forward_lse((s, l): (&CudaStorage, &Layout), (n, t, d): (usize, usize, usize), (scale, causal): (f64, bool)) -> u64 {
        match &s.lse {
            Some(x) if x.rows == n * t && x.scale == scale && x.causal == causal && l.offset == 0 && l.numel() == n * t * d => {
                ATTN_LSE_REUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                x.buf.ptr
            }
            _ => 0,
        }
    }

    /// How many attention backwards read their forward's log-sum-exp (`forward_lse`).
    pub(crate) static ATTN_LSE_REUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    /// Attention inputs as the kernels take them (`attention_inputs`), and the copies they read.
    type AttnInputs<'a> = (Vec<(u64, Mat)>, Vec<Dense<'a>>);

    /// Each attention input as a pointer to its first element and its `Mat` where its rows can be
    /// addressed so with `vec`-element alignment (`None`: never), else a dense copy (kept alive in
    /// the second list).
    /// Under grouped-query attention (k and v with fewer heads than q), k and v are read where
    /// they lie with their `Mat`'s `rep`, or copied dense with each head repeated.
    fn attention_inputs<'a>(g: &Arc<Gpu>, x: &[(&'a CudaStorage, &Layout)], d: usize, vec: Option<usize>) -> Result<AttnInputs<'a>> {
        let rep = crate::op::attention_kv_repeat(&x[0].1.shape, &x[1].1.shape).unwrap_or(1);
        let mut copies: Vec<Dense> = Vec::new();
        let mut ins: Vec<(u64, Mat)> = Vec::new();
        for (i, &(s, l)) in x.iter().enumerate() {
            let kv_rep = if i == 1 || i == 2 { rep } else { 1 };
            let t = l.shape[l.rank() - 2];
            match vec.and_then(|v| Mat::of(l, (t, d), v)) {
                Some(m) => ins.push((s.ptr_at(l.offset), Mat { rep: kv_rep as i64, ..m })),
                None => {
                    let c = if kv_rep > 1 { dense(g, s, &repeat_heads(l, kv_rep))? } else { dense(g, s, l)? };
                    ins.push((c.ptr(), Mat::dense(t, d)));
                    copies.push(c);
                }
            }
        }
        Ok((ins, copies))
    }

    /// `[B, H_kv, T, D]` as `[B, H_kv, rep, T, D]` with the new dim of stride 0: each head
    /// `rep` times, in q's head order.
    fn repeat_heads(l: &Layout, rep: usize) -> Layout {
        let (sh, st) = (&l.shape, &l.strides);
        Layout { shape: vec![sh[0], sh[1], rep, sh[2], sh[3]], strides: vec![st[0], st[1], 0, st[2], st[3]], offset: l.offset }
    }

    /// `attention_short_source`'s forward: a block per matrix, `ins` q, k, v.
    fn attention_short(
        g: &Arc<Gpu>,
        out: u64,
        mout: Mat,
        ins: &[(u64, Mat)],
        (n, t, d): (usize, usize, usize),
        dtype: DType,
        (scale, causal): (f64, bool),
    ) -> Result<()> {
        let most = attention_short_smem(ATTN_SHORT_MAX_T, d) as u32;
        let k = g.kernel_shared(crate::cuda::gpu::spec_key("attn_short", &(dtype, d, causal)), most, || {
            attention_short_source(dtype, d, causal)
        })?;
        let ([mut q, mut kp, mut v], [mut mq, mut mk, mut mv]) = ([ins[0].0, ins[1].0, ins[2].0], [ins[0].1, ins[1].1, ins[2].1]);
        let (mut o, mut mo, mut tt, mut sc) = (out, mout, t as i64, scale as f32);
        let mut params = kernel_params![o, q, kp, v, mq, mk, mv, mo, tt, sc];
        let smem = attention_short_smem(t, d) as u32;
        // SAFETY: (o, q, k, v, mq, mk, mv, mo, T, scale) matches the generated signature; each Mat
        // addresses n matrices of T rows of D elements inside its buffer (the output's `mout`
        // inside the n T D output), a block per matrix and a warp per row (T <= 32), with the
        // shared memory the kernel asks for (its limit raised to T = 32's when loaded).
        unsafe { g.launch(k, (n as u32, 1), 32 * t as u32, smem, &mut params) }
    }

    /// `attention_rows_source`'s forward: a block per (matrix, query row), `ins` q, k, v; the
    /// scores of `s` keys must fit in shared memory.
    fn attention_rows(
        g: &Arc<Gpu>,
        out: u64,
        mout: Mat,
        ins: &[(u64, Mat)],
        (n, t, s, d): (usize, usize, usize, usize),
        dtype: DType,
        (scale, causal): (f64, bool),
    ) -> Result<()> {
        if !attention_rows_fit(t, s, d) {
            return Err(Error::Msg(format!(
                "attention on CUDA: {s} keys for {t} queries do not fit the kernel of unequal lengths (at most 65535 queries and {} keys at head dim {d}); use the unfused ops",
                (ATTN_ROWS_MAX_SMEM / 4).saturating_sub(d + (ATTN_ROWS_THREADS / d) * d)
            )));
        }
        let smem = attention_rows_smem(s, d);
        let k = g.kernel_shared(crate::cuda::gpu::spec_key("attn_rows", &(dtype, d, causal)), ATTN_ROWS_MAX_SMEM as u32, || {
            attention_rows_source(dtype, d, causal)
        })?;
        let ([mut q, mut kp, mut v], [mut mq, mut mk, mut mv]) = ([ins[0].0, ins[1].0, ins[2].0], [ins[0].1, ins[1].1, ins[2].1]);
        let (mut o, mut mo, mut tt, mut ss, mut sc) = (out, mout, t as i64, s as i64, scale as f32);
        let mut params = kernel_params![o, q, kp, v, mq, mk, mv, mo, tt, ss, sc];
        // SAFETY: (o, q, k, v, mq, mk, mv, mo, T, S, scale) matches the generated signature; mq
        // and mo address n matrices of T rows of D elements, mk and mv n / rep matrices of S rows,
        // inside their buffers; a block per (matrix, query row) with `smem` bytes of dynamic
        // shared memory, within the limit raised when the kernel was loaded.
        unsafe { g.launch(k, (n as u32, t as u32), ATTN_ROWS_THREADS as u32, smem as u32, &mut params) }
    }

    /// Where the rows of one `[T, D]` matrix of an attention batch lie (`flash_source`'s
    /// `struct Mat`): matrix `n`'s row `i` starts `(n / nh) * b + (n % nh) * h + i * t` elements
    /// from the operand's first element, where block `m` reads matrix `n = m / rep`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    struct Mat {
        b: i64,
        h: i64,
        t: i64,
        nh: i64,
        rep: i64,
    }

    impl Mat {
        fn dense(t: usize, d: usize) -> Mat {
            Mat { b: (t * d) as i64, h: 0, t: d as i64, nh: 1, rep: 1 }
        }

        /// The matrices of `l` (shape `[.., T, D]`) when its rows are contiguous, its leading
        /// dims coalesce to at most two, and every row starts 16 bytes aligned (the kernels'
        /// vector loads): `vec` elements.
        fn of(l: &Layout, (t, d): (usize, usize), vec: usize) -> Option<Mat> {
            let r = l.rank();
            if l.strides[r - 1] != 1 && d > 1 {
                return None;
            }
            let (lead, st) = coalesce(&l.shape[..r - 2], &[l.strides[..r - 2].to_vec()]);
            let st = &st[0];
            let (b, h, nh) = match lead.len() {
                0 => (0, 0, 1),
                1 => (st[0], 0, 1),
                2 => (st[0], st[1], lead[1]),
                _ => return None,
            };
            let row = if t > 1 { l.strides[r - 2] } else { d };
            let aligned = [b, h, row, l.offset].iter().all(|&x| x % vec == 0);
            aligned.then_some(Mat { b: b as i64, h: h as i64, t: row as i64, nh: nh as i64, rep: 1 })
        }
    }

    /// A loaded attention kernel with its block size and dynamic shared memory: the
    /// tensor-core kernels (`flash_source`) where `flash_supported`, else the tiled
    /// FMA kernels (`tiled_source`).
    fn attention_kernel(g: &Arc<Gpu>, kind: AttnKernel, dtype: DType, d: usize, causal: bool) -> Result<(Kernel, u32, u32)> {
        if flash_supported(dtype, d) {
            // A training step needs all three, so a cold cache compiles them at once (F32's are
            // slow to compile on a small machine; an inference-only process builds the backward
            // two for nothing, once, into the disk cache).
            const KINDS: [AttnKernel; 3] = [AttnKernel::Fwd, AttnKernel::Dq, AttnKernel::Dkv];
            let bytes = flash_smem_bytes(dtype, d) as u32;
            let keys = KINDS.map(|k| crate::cuda::gpu::spec_key("flash", &(k, dtype, d, causal)));
            let ks = g.kernels_together(keys, bytes, |i| flash_source(KINDS[i], dtype, d, causal))?;
            return Ok((ks[KINDS.iter().position(|&k| k == kind).unwrap_or(0)], 128, bytes));
        }
        let bytes = (tiled_smem_floats(kind, d) * 4) as u32;
        let k = g.kernel_shared(crate::cuda::gpu::spec_key("attention", &(kind, dtype, d, causal)), bytes, || {
            tiled_source(kind, dtype, d, causal)
        })?;
        Ok((k, TILED_THREADS as u32, bytes))
    }

    /// The attention kernels on inputs `ins` (q, k, v; for the backward also o and g, each a
    /// pointer to its first element and its `Mat`; dense for the FMA kernels), writing `outs`
    /// (o, or dq, dk, dv, where `mout` places them; the FMA kernels write them dense). `lse`
    /// (tensor-core kernels; 0 for none): the per-row log-sum-exp the forward writes and dq reads.
    /// Each block owns 64 rows: the tensor-core kernels' grid is (matrix, row block), the FMA
    /// kernels' (row block, matrix).
    fn attention_kernels(
        g: &Arc<Gpu>,
        outs: &[u64],
        mout: Mat,
        ins: &[(u64, Mat)],
        (n, t, d): (usize, usize, usize),
        dtype: DType,
        (scale, causal, mut lse): (f64, bool, u64),
    ) -> Result<()> {
        let flash = flash_supported(dtype, d);
        let grid = if flash { (n as u32, t.div_ceil(64) as u32) } else { (t.div_ceil(64) as u32, n as u32) };
        let (mut tt, mut sc) = (t as i64, scale as f32);
        let (ti, si) = (&mut tt as *mut i64 as *mut c_void, &mut sc as *mut f32 as *mut c_void);
        let (mut o0, mut o1, mut o2) = (outs[0], outs.get(1).copied().unwrap_or(0), outs.get(2).copied().unwrap_or(0));
        let mut mout = mout;
        let mo = &mut mout as *mut Mat as *mut c_void;
        let arg = |x: &mut u64| x as *mut u64 as *mut c_void;
        // (outputs, inputs, [each input's Mat, then the output's: tensor-core kernels only], T,
        // scale)
        let params = |mut p: Vec<*mut c_void>, ptrs: &mut [u64], mats: &mut [Mat]| -> Vec<*mut c_void> {
            p.extend(ptrs.iter_mut().map(arg));
            if flash {
                p.extend(mats.iter_mut().map(|m| m as *mut Mat as *mut c_void));
                p.push(mo);
            }
            p.extend([ti, si]);
            p
        };
        let (mut ptrs, mut mats): (Vec<u64>, Vec<Mat>) = ins.iter().copied().unzip();
        if ins.len() == 3 {
            let (k, threads, smem) = attention_kernel(g, AttnKernel::Fwd, dtype, d, causal)?;
            let first = if flash { vec![arg(&mut o0), arg(&mut lse)] } else { vec![arg(&mut o0)] };
            let mut p = params(first, &mut ptrs, &mut mats);
            // SAFETY: (out, [lse], q, k, v, [Mats], T, scale) matches the generated signature; each
            // Mat addresses n matrices of T rows of D elements inside its input, and `mout` inside
            // the n T D output (dense for the FMA kernels); `lse` is null or holds n T floats; the
            // grid covers n x T rows.
            return unsafe { g.launch(k, grid, threads, smem, &mut p) };
        }
        if ins.len() != 5 {
            return Err(Error::Msg("attention_backward: expected q, k, v, out, grad".into()));
        }
        let stats = CudaStorage::alloc(&g.mem, DType::F32, n * t * 2)?;
        let mut sp = stats.buf.ptr;
        let (kq, tq, mq) = attention_kernel(g, AttnKernel::Dq, dtype, d, causal)?;
        let (kkv, tkv, mkv) = attention_kernel(g, AttnKernel::Dkv, dtype, d, causal)?;
        let first = if flash { vec![arg(&mut o0), arg(&mut sp), arg(&mut lse)] } else { vec![arg(&mut o0), arg(&mut sp)] };
        let mut dq = params(first, &mut ptrs, &mut mats);
        // SAFETY: as above, with (dq, stats, [lse], q, k, v, o, g, [5 Mats, packed], T, scale), `packed`
        // addressing n matrices inside the [3 n T D] output from dq's start; `stats` holds 2
        // floats per row, written by the dq kernel and read by the dk/dv kernel after it on the
        // same stream; the output holds dq, dk, dv in turn.
        unsafe { g.launch(kq, grid, tq, mq, &mut dq)? };
        // The dk/dv kernel does not read o.
        let (mut ptrs, mut mats) = ([ptrs[0], ptrs[1], ptrs[2], ptrs[4]], [mats[0], mats[1], mats[2], mats[4]]);
        let mut dkv = params(vec![arg(&mut o1), arg(&mut o2), arg(&mut sp)], &mut ptrs, &mut mats);
        // SAFETY: as above, with (dk, dv, stats, q, k, v, g, [4 Mats, packed], T, scale).
        unsafe { g.launch(kkv, grid, tkv, mkv, &mut dkv)? };
        drop(stats);
        Ok(())
    }

    /// `Mat` against its C twin (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::layout_check;
        vec![layout_check!(MAT, "Mat", Mat, { b => b, h => h, t => t, nh => nh, rep => rep })]
    }
}
