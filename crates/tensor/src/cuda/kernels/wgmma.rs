//! Kiln's F32 GEMM for Hopper (`sm_90a`): each F32 operand split into two TF32 parts
//! (`x = big + small`), three `wgmma` products a step (`a_big b_big + a_big b_small +
//! a_small b_big`, F32 accumulation), which keeps F32's accuracy to about 2^-21 at the tensor
//! cores' rate. cuBLAS's true-FP32 SGEMM runs on the CUDA cores, and three `mma.sync` TF32
//! products a step cap below its rate: only `wgmma` leaves room (figures in BENCHMARKS.md).
//!
//! A block of two warpgroups computes a `128 x 128` tile of `c = a @ b` and its epilogue.
//! Every thread loads its share of a 32-deep slice of A and B into registers (16-byte loads,
//! whatever the operands' transposes), splits it (`super::prelude::TF32`) and stores both parts in
//! shared memory in the K-major, 128-byte-swizzled layout `wgmma` reads (a transposed operand
//! is turned on the way). Two stages, one barrier a slice: the next slice is stored and the one after loaded
//! while the tensor cores run this one. The tensor cores' F32 accumulation truncates, so each
//! slice's products go to a fresh accumulator that the CUDA cores add to the total (rounded):
//! the error stays below SGEMM's (4096^3: 3.1e-7 relative against cuBLAS's 1.2e-6; 2.9e-5
//! with one accumulator, growing with k).

use super::prelude::{ARCH_SPECIFIC, CLUSTER, LATE_NEXT, PRELUDE, TF32};
use crate::UnaryOp;

/// Rows of a block's tile (two warpgroups of 64).
pub const BM: usize = 128;
/// Columns of a block's tile.
pub const BN: usize = 128;
/// The contraction slice a stage holds: 32 TF32 values, one 128-byte swizzle row.
pub const BK: usize = 32;
/// Shared-memory stages.
pub const STAGES: usize = 2;
/// Threads a block: two warpgroups.
pub const THREADS: usize = 256;

/// How many parts the contraction is split into, so that a product of few tiles still
/// fills the GPU (`sms` multiprocessors, a block each): at most a wave of blocks and
/// `MAX_PARTS` parts (a tile's parts are one cluster), each part at least `MIN_SPLIT_SLICES`
/// slices deep. Returns (parts, depth of a part).
pub fn splits(m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let tiles = m.div_ceil(BM) * n.div_ceil(BN);
    split_into(k, sms / tiles.max(1))
}

/// The contraction `k` in about `want` parts (at most `MAX_PARTS`, each at least
/// `MIN_SPLIT_SLICES` slices deep): (parts, depth of a part).
pub fn split_into(k: usize, want: usize) -> (usize, usize) {
    let slices = k.div_ceil(BK);
    let want = want.clamp(1, (slices / MIN_SPLIT_SLICES).clamp(1, MAX_PARTS));
    let depth = slices.div_ceil(want) * BK;
    (k.div_ceil(depth).max(1), depth)
}

/// The part counts `MaxAutotune` times for a product: one, and each count up to `MAX_PARTS`
/// that `split_into` keeps distinct and within a wave of `sms` blocks.
pub fn split_candidates(m: usize, n: usize, k: usize, sms: usize) -> Vec<usize> {
    let tiles = m.div_ceil(BM) * n.div_ceil(BN);
    let mut parts: Vec<usize> = (1..=MAX_PARTS).map(|w| split_into(k, w).0).filter(|&p| p == 1 || tiles * p <= sms).collect();
    parts.dedup();
    parts
}

/// The shallowest part of a split contraction, in slices of `BK`.
pub const MIN_SPLIT_SLICES: usize = 2;

/// The most parts a contraction is split into: a tile's parts run as one thread block
/// cluster, and 8 is the largest cluster every Hopper part schedules.
pub const MAX_PARTS: usize = 8;

/// One compiled variant of the GEMM: the operands' layouts and the epilogue, applied to each
/// output `v` at row `r`, column `j` in this order: `v += bias[j]`; with `keep`, `aux[r, j] = v`
/// (GELU's pre-activation for its backward); `v = act(v)`; `v *= dact(aux[r, j])` (an
/// activation's gradient at its input, `MatmulEpilogue::DGelu` and `DRelu`); with `residual`,
/// `v += res[r, j]` (`MatmulEpilogue::Residual`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Spec {
    /// A is stored `[k, m]` (its rows are M): `a^T` as a view.
    pub ta: bool,
    /// B is stored `[n, k]` (K contiguous): `w^T` as a view, as in a Linear's forward.
    pub tb: bool,
    pub bias: bool,
    pub keep: bool,
    pub act: Option<UnaryOp>,
    pub dact: Option<UnaryOp>,
    pub residual: bool,
    /// A's rows are read through the row map (`GArgs::a_inner`, `a_outer`): a batch folded
    /// into M that does not lie as rows. Its own variant, so that plain products keep their
    /// address arithmetic.
    pub map_a: bool,
}

impl Spec {
    /// Dynamic shared memory a block takes: the stages plus 1 KiB to align them to the
    /// swizzle's 1024-byte period.
    pub fn shared_bytes(&self) -> usize {
        STAGES * 2 * (BM + BN) * BK * 4 + 1024
    }

    pub fn name(&self) -> String {
        let op = |u: Option<UnaryOp>| u.map_or(String::new(), |u| format!("_{}", format!("{u:?}").to_lowercase()));
        format!(
            "k_gemm_tf32x3_{}{}{}{}{}{}{}{}",
            if self.ta { "t" } else { "n" },
            if self.tb { "t" } else { "n" },
            if self.bias { "_bias" } else { "" },
            if self.keep { "_keep" } else { "" },
            op(self.act),
            op(self.dact).replace('_', "_d"),
            if self.residual { "_residual" } else { "" },
            if self.map_a { "_rowmap" } else { "" },
        )
    }

    /// The CUDA source and the GEMM kernel's name (for `sm_90a`: the source starts with
    /// `ARCH_SPECIFIC`).
    pub fn source(&self) -> (String, String) {
        let name = self.name();
        let mut s = format!("{ARCH_SPECIFIC}{PRELUDE}{LATE_NEXT}\ntypedef float C;\n#define K(v) ((C)(v))\n");
        s += &format!("#define BM {BM}\n#define BN {BN}\n#define BK {BK}\n#define STAGES {STAGES}\n");
        s += &format!("#define TA {}\n#define TB {}\n#define MAP_A {}\n", self.ta as u8, self.tb as u8, self.map_a as u8);
        s += TF32;
        s += CLUSTER;
        s += BODY;
        s += &mma_fn(BN);
        s += "__device__ __forceinline__ float epilogue(float v, const float* bias, float* aux, const float* res, long long xat, long long cat, int col) {\n";
        if self.bias {
            s += "  v += __ldg(bias + col);\n";
        }
        if self.keep {
            s += "  aux[xat] = v;\n";
        }
        if let Some(u) = self.act {
            s += &format!("  v = {};\n", u.c_expr("v"));
        }
        if let Some(u) = self.dact {
            s += &format!("  {{ const float h = aux[xat]; v *= {}; }}\n", u.c_expr("h"));
        }
        if self.residual {
            s += "  v += res[cat];\n";
        }
        s += "  return v;\n}\n";
        s += &format!(
            "extern \"C\" __global__ void __launch_bounds__({THREADS}, 1) {name}(const float* __restrict__ a, \
             const float* __restrict__ b, float* __restrict__ c, const float* __restrict__ bias, float* aux, const float* __restrict__ res, GArgs g) {{\n  \
             gemm(a, b, c, bias, aux, res, g);\n}}\n"
        );
        (s, name)
    }
}

/// `wgmma m64n{bn}k8` on TF32 from two shared-memory descriptors, accumulating into `d`.
fn mma_fn(bn: usize) -> String {
    let regs = bn / 2;
    let list: Vec<String> = (0..regs).map(|i| format!("%{i}")).collect();
    let outs: Vec<String> = (0..regs).map(|i| format!("\"+f\"(d[{i}])")).collect();
    format!(
        "__device__ __forceinline__ void mma(float (&d)[{regs}], unsigned long long da, unsigned long long db, int acc) {{\n  asm volatile(\
         \"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{}, 0;\\nwgmma.mma_async.sync.aligned.m64n{bn}k8.f32.tf32.tf32 {{{}}}, %{regs}, %{}, p, 1, 1;\\n}}\\n\"\n    : {}\n    : \"l\"(da), \"l\"(db), \"r\"(acc));\n}}\n",
        regs + 2,
        list.join(", "),
        regs + 1,
        outs.join(", ")
    )
}

/// Everything but the tile constants, the `wgmma` wrapper, the epilogue and the entry points.
pub(crate) const BODY: &str = r#"
#define A_PART (BM * BK * 4)
#define B_PART (BN * BK * 4)
#define STAGE_BYTES (2 * A_PART + 2 * B_PART)
#define ACC (BN / 2)
// kc: the contraction each blockIdx.z takes (a multiple of BK); with splits > 1 the grid's
// z is the parts and each tile's parts are one cluster, which adds them up (cluster_fold).
// With MAP_A, A's row r lies at
// (r % a_inner) * lda + (r / a_inner) * a_outer: a batch folded into M that does not lie as
// rows (a sequence-first view read batch-first).
struct GArgs { long long lda, ldb, ldc, ldx, a_outer; int m, n, k, kc, splits, a_inner; };

// Byte offset of element (r, k) in a K-major slice (a row is BK values, 128 bytes): the
// 16-byte chunk c of row r lies at chunk c ^ (r % 8), the 128-byte swizzle.
__device__ __forceinline__ unsigned swz(int r, int k) { return r * 128 + ((((k >> 2) ^ r) & 7) << 4) + (k & 3) * 4; }
// A shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long desc(const unsigned char* p) {
  const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void split_store(unsigned char* big, unsigned char* small, unsigned off, float x) {
  const unsigned hi = tf32_big(x);
  *(unsigned*)(big + off) = hi;
  *(unsigned*)(small + off) = tf32_small(x, hi);
}
__device__ __forceinline__ void split_store4(unsigned char* big, unsigned char* small, unsigned off, float4 x) {
  const uint4 hi = make_uint4(tf32_big(x.x), tf32_big(x.y), tf32_big(x.z), tf32_big(x.w));
  *(uint4*)(big + off) = hi;
  *(uint4*)(small + off) = make_uint4(tf32_small(x.x, hi.x), tf32_small(x.y, hi.y), tf32_small(x.z, hi.z), tf32_small(x.w, hi.w));
}

// One operand's slice: R rows (M for A, N for B) by BK, element (r, k) at p[r * ld + k] when
// KC (K contiguous), else at p[k * ld + r]. A thread holds R / 32 float4s of it: with KC, four
// neighbours along k of row r (one 16-byte store a part); else four neighbours along r at k
// (four 4-byte stores a part, two-way bank conflicts; a quad's shuffle transpose to 16-byte
// stores measured slower). MAP: rows through the row map (KC only).
template <int R, bool KC, bool MAP> struct Slice {
  float4 v[R / 32];
  __device__ __forceinline__ static void at(int idx, int& r, int& k) {
    if (KC) { r = idx >> 3; k = 4 * (idx & 7); }
    else { r = 4 * ((idx >> 3) % (R / 4)); k = (idx & 7) + 8 * (idx / (2 * R)); }
  }
  __device__ __forceinline__ void load(const float* p, long long ld, int r0, int rows, int k0, int K, const GArgs& g) {
#pragma unroll
    for (int i = 0; i < R / 32; ++i) {
      int r, k;
      at(threadIdx.x + 256 * i, r, k);
      const int gr = r0 + r, gk = k0 + k;
      const long long row = MAP ? (long long)(gr % g.a_inner) * ld + (long long)(gr / g.a_inner) * g.a_outer : (long long)gr * ld;
      v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (gr < rows && gk < K) v[i] = __ldg((const float4*)(KC ? p + row + gk : p + (long long)gk * ld + gr));
    }
  }
  __device__ __forceinline__ void store(unsigned char* big, unsigned char* small) const {
#pragma unroll
    for (int i = 0; i < R / 32; ++i) {
      int r, k;
      at(threadIdx.x + 256 * i, r, k);
      if (KC) {
        split_store4(big, small, swz(r, k), v[i]);
      } else {
        split_store(big, small, swz(r, k), v[i].x);
        split_store(big, small, swz(r + 1, k), v[i].y);
        split_store(big, small, swz(r + 2, k), v[i].z);
        split_store(big, small, swz(r + 3, k), v[i].w);
      }
    }
  }
};

__device__ __forceinline__ void mma(float (&d)[ACC], unsigned long long da, unsigned long long db, int acc);

__device__ __forceinline__ float epilogue(float v, const float* bias, float* aux, const float* res, long long xat, long long cat, int col);

// The epilogue's operands: bias [n], aux (rows ldx apart), the residual (rows ldc apart).
struct Epi { const float* bias; float* aux; const float* res; };

// Outputs (r, col) and (r, col + 1) after the epilogue.
__device__ __forceinline__ void put2(float* c, const Epi& e, const GArgs& g, int r, int col, float x, float y) {
  const long long xat = (long long)r * g.ldx + col, cat = (long long)r * g.ldc + col;
  *(float2*)(c + cat) = make_float2(epilogue(x, e.bias, e.aux, e.res, xat, cat, col), epilogue(y, e.bias, e.aux, e.res, xat + 1, cat + 1, col + 1));
}

// A split contraction's fold without a trip through global memory: each block of the tile's
// cluster (block z holds part z) leaves its sums in its shared memory, then folds a share of
// the tile, adding the parts in split order (the same bits every run) from the blocks' shared
// memory, and applies the epilogue. (row, col): this thread's first accumulator element.
#define FOLD_LD (BN + 8)
__device__ __forceinline__ void cluster_fold(const float (&d)[ACC], unsigned char* smem, float* __restrict__ c, const Epi& e,
                                             const GArgs& g, int m0, int n0, int row, int col) {
  float* tile = (float*)smem;
  // Both warpgroups' last products have read the stages the tile overwrites.
  __syncthreads();
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) *(float2*)(tile + (row + 8 * h) * FOLD_LD + col + 8 * j) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  }
  cluster_sync();
  const unsigned base = (unsigned)__cvta_generic_to_shared(tile);
  const int quads = BM * BN / 4, share = (quads + g.splits - 1) / g.splits;
  const int end = min(quads, ((int)blockIdx.z + 1) * share);
  for (int i = blockIdx.z * share + threadIdx.x; i < end; i += 256) {
    const int r = i / (BN / 4), q = 4 * (i % (BN / 4)), gr = m0 + r, gc = n0 + q;
    if (gr >= g.m || gc >= g.n) continue;
    const unsigned at = base + (unsigned)(r * FOLD_LD + q) * 4;
    float4 w[8];
#pragma unroll
    for (int p = 0; p < 8; ++p)
      if (p < g.splits) w[p] = ld_cluster(at, p);
    float4 v = w[0];
#pragma unroll
    for (int p = 1; p < 8; ++p)
      if (p < g.splits) { v.x += w[p].x; v.y += w[p].y; v.z += w[p].z; v.w += w[p].w; }
    put2(c, e, g, gr, gc, v.x, v.y);
    if (gc + 2 < g.n) put2(c, e, g, gr, gc + 2, v.z, v.w);
  }
  // No block leaves (and frees its shared memory) while another still reads it.
  cluster_sync();
}

__device__ __forceinline__ void gemm(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                                     const float* __restrict__ bias, float* aux, const float* __restrict__ res, GArgs g) {
  const Epi e = {bias, aux, res};
  extern __shared__ unsigned char smem_raw[];
  // Aligned by pointer arithmetic, so that the compiler knows it for shared memory (STS; an
  // integer round trip made every store generic).
  unsigned char* smem = smem_raw + ((1024u - ((unsigned)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  Slice<BM, !TA, MAP_A> sa;
  Slice<BN, TB, false> sb;
  // This block's share of the contraction: [k0, kend).
  const int k0 = blockIdx.z * g.kc, kend = min(g.k, k0 + g.kc);
  const int kt_count = (kend - k0 + BK - 1) / BK;
  const int wg = threadIdx.x / 128;
  // The tensor cores' F32 accumulation truncates: each slice's products are summed apart
  // (t) and added to d with the CUDA cores' rounding, which keeps the error near SGEMM's
  // instead of growing with k.
  float d[ACC], t[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) d[i] = 0.f;

  sa.load(a, g.lda, m0, g.m, k0, kend, g);
  sb.load(b, g.ldb, n0, g.n, k0, kend, g);
  sa.store(smem, smem + A_PART);
  sb.store(smem + 2 * A_PART, smem + 2 * A_PART + B_PART);
  if (kt_count > 1) {
    sa.load(a, g.lda, m0, g.m, k0 + BK, kend, g);
    sb.load(b, g.ldb, n0, g.n, k0 + BK, kend, g);
  }
  for (int kt = 0; kt < kt_count; ++kt) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const unsigned char* st = smem + (kt % STAGES) * STAGE_BYTES;
    const unsigned long long a_big = desc(st + wg * 64 * 128), a_small = desc(st + A_PART + wg * 64 * 128);
    const unsigned long long b_big = desc(st + 2 * A_PART), b_small = desc(st + 2 * A_PART + B_PART);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < BK / 8; ++s) {
      // Each k-step of 8 TF32 values is 32 bytes further along the swizzled rows (2 in the
      // descriptor's 16-byte units). The slice's first product overwrites t.
      mma(t, a_small + 2 * s, b_big + 2 * s, s);
      mma(t, a_big + 2 * s, b_small + 2 * s, 1);
      mma(t, a_big + 2 * s, b_big + 2 * s, 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (kt + 1 < kt_count) {
      // Stage (kt + 1) % STAGES was last read by slice kt - 1, whose products every
      // warpgroup waited for before this slice's barrier.
      unsigned char* nx = smem + ((kt + 1) % STAGES) * STAGE_BYTES;
      sa.store(nx, nx + A_PART);
      sb.store(nx + 2 * A_PART, nx + 2 * A_PART + B_PART);
    }
    if (kt + 2 < kt_count) {
      sa.load(a, g.lda, m0, g.m, k0 + (kt + 2) * BK, kend, g);
      sb.load(b, g.ldb, n0, g.n, k0 + (kt + 2) * BK, kend, g);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
      asm volatile("" : "+f"(t[i])::"memory");
      d[i] += t[i];
    }
  }
  // The accumulator's layout: warp w of the warpgroup holds rows 16 w.. (lane / 4, and 8
  // below it), columns 8 j + 2 (lane % 4) and the next, for each j.
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  if (g.splits > 1) {
    cluster_fold(d, smem, c, e, g, m0, n0, wg * 64 + warp * 16 + lane / 4, 2 * (lane % 4));
    return;
  }
  const int row = m0 + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = n0 + 8 * j + 2 * (lane % 4);
    if (col >= g.n) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      if (r >= g.m) continue;
      put2(c, e, g, r, col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    }
  }
}

"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts cover the contraction exactly, each a whole number of slices and at least
    /// `MIN_SPLIT_SLICES` deep where split, and the blocks never pass a wave.
    #[test]
    fn splits_cover_the_contraction_within_a_wave() {
        for (m, n, k) in
            [(320, 512, 512), (320, 512, 2048), (4096, 256, 784), (16384, 1536, 384), (132, 8, 200), (4, 4, 4), (1, 2, 100_000)]
        {
            let (parts, depth) = splits(m, n, k, 132);
            let tiles = m.div_ceil(BM) * n.div_ceil(BN);
            assert_eq!(depth % BK, 0, "{m} {n} {k}");
            assert!(parts * depth >= k && (parts - 1) * depth < k, "{m} {n} {k}: {parts} x {depth}");
            assert!(parts == 1 || depth >= MIN_SPLIT_SLICES * BK, "{m} {n} {k}: {depth}");
            assert!(parts == 1 || tiles * parts <= 132, "{m} {n} {k}: {tiles} x {parts}");
            assert!(parts <= MAX_PARTS, "{m} {n} {k}: {parts}");
        }
        // The Transformer's `[320, 512] x [512, 512]`: 12 tiles, eight parts of 64.
        assert_eq!(splits(320, 512, 512, 132), (8, 64));
        // A lone tile takes at most a cluster's parts.
        assert_eq!(splits(64, 64, 100_000, 132), (MAX_PARTS, 12512));
        // A full wave of tiles is not split.
        assert_eq!(splits(16384, 1536, 384, 132), (1, 384));
        // What `MaxAutotune` times: every distinct part count within a wave.
        assert_eq!(split_candidates(320, 512, 512, 132), [1, 2, 3, 4, 6, 8]);
        assert_eq!(split_candidates(320, 2048, 512, 132), [1, 2]);
        assert_eq!(split_candidates(320, 512, 64, 132), [1]);
        for (m, n, k) in [(320, 512, 512), (320, 512, 2048), (64, 64, 100_000), (4, 4, 100)] {
            for p in split_candidates(m, n, k, 132) {
                let (parts, depth) = split_into(k, p);
                assert!(parts == p && parts * depth >= k && (parts - 1) * depth < k, "{m} {n} {k}: {p} -> {parts} x {depth}");
            }
        }
    }

    /// `cluster_fold`'s tile (rows of `BN + 8` floats, `FOLD_LD`) fits in the stages it reuses.
    #[test]
    fn the_fold_tile_fits_in_the_stages() {
        let spec = Spec { ta: false, tb: true, bias: false, keep: false, act: None, dact: None, residual: false, map_a: false };
        assert!(BM * (BN + 8) * 4 <= spec.shared_bytes() - 1024);
        assert!(spec.source().0.contains("#define FOLD_LD (BN + 8)"));
    }

    #[test]
    fn names_say_layout_and_epilogue() {
        let spec =
            Spec { ta: false, tb: true, bias: true, keep: true, act: Some(UnaryOp::GeluTanh), dact: None, residual: false, map_a: false };
        assert_eq!(spec.name(), "k_gemm_tf32x3_nt_bias_keep_gelutanh");
        let spec =
            Spec { ta: true, tb: false, bias: false, keep: false, act: None, dact: Some(UnaryOp::Step), residual: false, map_a: true };
        assert_eq!(spec.name(), "k_gemm_tf32x3_tn_dstep_rowmap");
        let spec = Spec { ta: false, tb: true, bias: true, keep: false, act: None, dact: None, residual: true, map_a: true };
        assert_eq!(spec.name(), "k_gemm_tf32x3_nt_bias_residual_rowmap");
        assert!(spec.source().0.starts_with(ARCH_SPECIFIC));
    }
}
