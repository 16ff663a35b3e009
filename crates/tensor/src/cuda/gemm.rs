//! Kiln's own F32 GEMM on the tensor cores: `C = A B (+ bias) (ReLU)` with each product taken
//! as three TF32 products (`x = big + small`, both TF32; `a b ~ a_big b_big + a_big b_small +
//! a_small b_big`), which keeps about F32's precision (CUTLASS's `OpMultiplyAddFastF32`, the
//! arithmetic of PyTorch's F32 memory-efficient attention and of Kiln's F32 flash kernels).
//! cuBLAS's true-FP32 SGEMM runs on the FMA units, at most about 51 TFLOP/s on an H200.
//! `Mode::MaxAutotune` times these kernels beside cuBLASLt's candidates and keeps the fastest
//! (`lt.rs`). Pure text, so CI compiles every variant with NVRTC without a GPU.
//!
//! Layout: row-major `C [m, n]` (row stride `ldc`), `A (i, k) = a[i sam + k sak]`, `B (k, j) =
//! b[k sbk + j sbn]`, each operand contiguous along one dim (`GemmTile::a_k`, `b_k`: along the
//! contraction), its other stride a multiple of 4 and its pointer 16-byte aligned, so that tiles
//! stream into shared memory by `cp.async` 16 bytes at a time (zeros past the edges). A block
//! owns a `bm x bn` tile of C, each of its warps a `wm x wn` part held in registers as `m16n8k8`
//! accumulators; the contraction advances `bk` at a time through `stages` shared buffers.

/// One kernel variant: tile sizes and the operands' contiguous dims (`a_k`: A contiguous along
/// k, else along m; `b_k`: B contiguous along k, else along n).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmTile {
    pub bm: usize,
    pub bn: usize,
    pub bk: usize,
    pub wm: usize,
    pub wn: usize,
    pub stages: usize,
    pub a_k: bool,
    pub b_k: bool,
}

/// Mirrors `struct GArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GemmArgs {
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub sam: i64,
    pub sak: i64,
    pub sbk: i64,
    pub sbn: i64,
    pub ldc: i64,
    pub has_bias: i32,
    pub relu: i32,
}

/// The tiles `Mode::MaxAutotune` times (for the operands' layout): a wide tile for large
/// problems, narrower ones that give a small problem's blocks to more SMs.
pub fn candidates(a_k: bool, b_k: bool) -> Vec<GemmTile> {
    let t = |bm, bn, wm, wn| GemmTile { bm, bn, bk: 16, wm, wn, stages: 3, a_k, b_k };
    vec![t(128, 128, 64, 32), t(128, 64, 64, 32), t(64, 64, 32, 32)]
}

impl GemmTile {
    pub fn threads(&self) -> usize {
        (self.bm / self.wm) * (self.bn / self.wn) * 32
    }

    /// Floats of one stage's A and B tiles (padded so that fragment reads hit 32 banks).
    fn tile_floats(&self) -> (usize, usize) {
        let a = if self.a_k { self.bm * (self.bk + 4) } else { self.bk * (self.bm + 8) };
        let b = if self.b_k { self.bn * (self.bk + 4) } else { self.bk * (self.bn + 8) };
        (a, b)
    }

    /// Dynamic shared memory of a launch.
    pub fn smem_bytes(&self) -> usize {
        let (a, b) = self.tile_floats();
        self.stages * (a + b) * 4
    }

    /// Whether the tile is one this generator supports: warps tile the block, `m16n8k8`
    /// fragments tile the warp, and each thread copies whole 16-byte chunks.
    pub fn valid(&self) -> bool {
        let chunks = |r: usize, c: usize| r * c / 4;
        let t = self.threads();
        self.bm % self.wm == 0
            && self.bn % self.wn == 0
            && self.wm % 16 == 0
            && self.wn % 8 == 0
            && self.bk % 8 == 0
            && self.bm % 4 == 0
            && self.bn % 4 == 0
            && self.stages >= 2
            && chunks(self.bm, self.bk) % t == 0
            && chunks(self.bn, self.bk) % t == 0
    }

    pub fn name(&self) -> String {
        let side = |k: bool, other: &str| if k { "k".to_string() } else { other.to_string() };
        format!(
            "k_gemm3xtf32_{}x{}x{}_w{}x{}_s{}_a{}_b{}",
            self.bm,
            self.bn,
            self.bk,
            self.wm,
            self.wn,
            self.stages,
            side(self.a_k, "m"),
            side(self.b_k, "n")
        )
    }
}

/// The kernel's source and name. Launch: `threads()` threads, grid `(ceil(n / bn), ceil(m /
/// bm))`, `smem_bytes()` of dynamic shared memory; arguments `(c, a, b, bias, GemmArgs)`.
pub fn source(t: &GemmTile) -> (String, String) {
    let name = t.name();
    let (a_floats, b_floats) = t.tile_floats();
    let mut s = format!(
        "#define BM {}\n#define BN {}\n#define BK {}\n#define WM {}\n#define WN {}\n#define STAGES {}\n#define THREADS {}\n",
        t.bm,
        t.bn,
        t.bk,
        t.wm,
        t.wn,
        t.stages,
        t.threads()
    );
    s += &format!("#define A_K {}\n#define B_K {}\n#define A_TILE {a_floats}\n#define B_TILE {b_floats}\n", t.a_k as u8, t.b_k as u8);
    s += GEMM_BODY.replace("KERNEL_NAME", &name).as_str();
    (s, name)
}

/// The kernel for every variant (`source` prepends the variant's `#define`s). Fragment
/// layouts are PTX's `m16n8k8` TF32 ones: lane `g = lane / 4`, `q = lane % 4`; A holds rows
/// g, g + 8 at columns q, q + 4; B column g at rows q, q + 4; C rows g, g + 8, columns 2q, 2q + 1.
const GEMM_BODY: &str = r#"
#define MI (WM / 16)
#define NI (WN / 8)
// A tile: [BM][BK + 4] along k, else [BK][BM + 8]; B tile: [BN][BK + 4] along k, else [BK][BN + 8].
#define A_LD (A_K ? BK + 4 : BM + 8)
#define B_LD (B_K ? BK + 4 : BN + 8)
struct GArgs { long long m, n, k, sam, sak, sbk, sbn, ldc; int has_bias, relu; };
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes from global to shared memory, of which the first `bytes` are read (the rest zero).
__device__ __forceinline__ void cp16(float* dst, const float* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ unsigned tf32(float x) { unsigned r; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x)); return r; }
__device__ __forceinline__ void mma8(float* c, const unsigned* a, const unsigned* b) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Bytes of a 16-byte chunk starting at element `at` of a line of `len` elements that lie inside it.
__device__ __forceinline__ int inside(long long at, long long len) {
  const long long r = (len - at) * 4;
  return r <= 0 ? 0 : r >= 16 ? 16 : (int)r;
}
// One operand tile (rows `r0`.., `ROWS` of them, along the contiguous dim from `c0`, `COLS` of
// them) into shared memory: `rows`/`cols` bound the matrix, `st` is its row stride.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ void load_tile(float* tile, const float* p, long long st, long long r0, long long c0, long long rows, long long cols) {
#pragma unroll
  for (int e = threadIdx.x; e < ROWS * COLS / 4; e += THREADS) {
    const int r = e / (COLS / 4), c = (e % (COLS / 4)) * 4;
    const int bytes = r0 + r < rows ? inside(c0 + c, cols) : 0;
    cp16(tile + r * LD + c, bytes ? p + (r0 + r) * st + c0 + c : p, bytes);
  }
}
__device__ __forceinline__ void load_stage(float* as, float* bs, const float* a, const float* b, const GArgs& g, long long m0, long long n0, long long k0) {
  if (A_K) load_tile<BM, BK, A_LD>(as, a, g.sam, m0, k0, g.m, g.k);
  else load_tile<BK, BM, A_LD>(as, a, g.sak, k0, m0, g.k, g.m);
  if (B_K) load_tile<BN, BK, B_LD>(bs, b, g.sbn, n0, k0, g.n, g.k);
  else load_tile<BK, BN, B_LD>(bs, b, g.sbk, k0, n0, g.k, g.n);
}
__device__ __forceinline__ float a_at(const float* as, int i, int k) { return A_K ? as[i * A_LD + k] : as[k * A_LD + i]; }
__device__ __forceinline__ float b_at(const float* bs, int k, int j) { return B_K ? bs[j * B_LD + k] : bs[k * B_LD + j]; }
__device__ __forceinline__ void split(float x, unsigned& big, unsigned& small) {
  big = tf32(x);
  small = tf32(x - __uint_as_float(big));
}
extern "C" __global__ void __launch_bounds__(THREADS) KERNEL_NAME(float* __restrict__ c, const float* __restrict__ a,
    const float* __restrict__ b, const float* __restrict__ bias, GArgs g) {
  extern __shared__ __align__(16) float sm[];
  float* as = sm;
  float* bs = sm + STAGES * A_TILE;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const long long m0 = (long long)blockIdx.y * BM, n0 = (long long)blockIdx.x * BN;
  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  const long long kt = (g.k + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < kt) load_stage(as + s * A_TILE, bs + s * B_TILE, a, b, g, m0, n0, s * BK);
    asm volatile("cp.async.commit_group;" ::);
  }
  for (long long t = 0; t < kt; ++t) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
    __syncthreads();
    // The stage read in step t - 1 is free once every thread has passed the barrier above.
    const long long next = t + STAGES - 1;
    if (next < kt) load_stage(as + (next % STAGES) * A_TILE, bs + (next % STAGES) * B_TILE, a, b, g, m0, n0, next * BK);
    asm volatile("cp.async.commit_group;" ::);
    const float* at = as + (t % STAGES) * A_TILE;
    const float* bt = bs + (t % STAGES) * B_TILE;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      unsigned ab[MI][4], asl[MI][4], bb[NI][2], bsl[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int r = wm0 + i * 16 + gq;
        split(a_at(at, r, kk + tq), ab[i][0], asl[i][0]);
        split(a_at(at, r + 8, kk + tq), ab[i][1], asl[i][1]);
        split(a_at(at, r, kk + tq + 4), ab[i][2], asl[i][2]);
        split(a_at(at, r + 8, kk + tq + 4), ab[i][3], asl[i][3]);
      }
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int col = wn0 + j * 8 + gq;
        split(b_at(bt, kk + tq, col), bb[j][0], bsl[j][0]);
        split(b_at(bt, kk + tq + 4, col), bb[j][1], bsl[j][1]);
      }
      // The small products first, so that they are not lost against the big one.
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) { mma8(acc[i][j], asl[i], bb[j]); mma8(acc[i][j], ab[i], bsl[j]); }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma8(acc[i][j], ab[i], bb[j]);
    }
  }
  asm volatile("cp.async.wait_group 0;" ::);
  // Epilogue: bias, ReLU (NaN to 0, as cuBLASLt's), stores of neighbouring pairs.
  const bool pairs = g.ldc % 2 == 0 && ((unsigned long long)c & 7) == 0;
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) {
      const long long col = n0 + wn0 + j * 8 + 2 * tq;
      const float b0 = g.has_bias && col < g.n ? bias[col] : 0.f;
      const float b1 = g.has_bias && col + 1 < g.n ? bias[col + 1] : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long row = m0 + wm0 + i * 16 + gq + h * 8;
        if (row >= g.m) continue;
        float v0 = acc[i][j][2 * h] + b0, v1 = acc[i][j][2 * h + 1] + b1;
        if (g.relu) { v0 = fmaxf(v0, 0.f); v1 = fmaxf(v1, 0.f); }
        float* p = c + row * g.ldc + col;
        if (pairs && col + 1 < g.n) *(float2*)p = make_float2(v0, v1);
        else { if (col < g.n) p[0] = v0; if (col + 1 < g.n) p[1] = v1; }
      }
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_valid_and_named_apart() {
        let mut names = std::collections::HashSet::new();
        for (a_k, b_k) in [(true, true), (true, false), (false, true), (false, false)] {
            for t in candidates(a_k, b_k) {
                assert!(t.valid(), "{t:?}");
                assert!(t.smem_bytes() <= 227 * 1024, "{t:?}: {} bytes", t.smem_bytes());
                assert!(names.insert(t.name()));
                let (src, name) = source(&t);
                assert!(src.contains(&format!("#define THREADS {}\n", t.threads())) && src.contains(&format!(" {name}(")));
            }
        }
        let bad = GemmTile { wm: 48, ..candidates(true, true)[0] };
        assert!(!bad.valid());
    }
}
