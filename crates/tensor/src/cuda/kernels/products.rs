//! Kiln's own products where cuBLAS leaves the GPU idle: narrow, short, thin and few-row
//! matmuls with their epilogues, the head product fused with cross-entropy, and the launches
//! of those and of the Hopper F32 GEMM (`wgmma.rs`).

use crate::codegen::compute_type;
use crate::cuda::kernels::prelude::{lanes_allreduce, storage_type, CLUSTER, INDEX_ARGS, PRELUDE, WALK};
use crate::cuda::kernels::rows::{xent_grad_loop, xent_row, XENT_ARGS, XENT_SMOOTHING_SUM};
use crate::DType;

/// The arguments of the narrow and few-rows product kernels (mirrored by `PArgs`):
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

/// Threads of a `matmul_narrow_source` block (a warp per row).
pub const NARROW_THREADS: usize = 256;

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

/// Whether `linear_xent_source` runs `Fused::LinearCrossEntropyMean` at this size (F32 only):
/// spread over a cluster, each block within `LINEAR_XENT_MAX_MACS`; the shared memory within
/// `LINEAR_XENT_MAX_SMEM` in one block too (a GPU without clusters runs it so).
pub fn linear_xent_fits(dtype: DType, n: usize, c: usize, f: usize) -> bool {
    let (per, blocks) = linear_xent_blocks(n, true);
    let macs = 2 * per * c * f + c * f.div_ceil(blocks) * n;
    dtype == DType::F32 && c > 0 && linear_xent_smem_bytes(n, c, f, false) <= LINEAR_XENT_MAX_SMEM && macs <= LINEAR_XENT_MAX_MACS
}

/// `Fused::LinearCrossEntropyMean` in one launch, the rows split over a cluster of blocks
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

#[cfg(feature = "cuda")]
pub(crate) use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::*;
    use crate::cuda::gpu::Gpu;
    use crate::cuda::kernels::elementwise::dense;
    use crate::cuda::kernels::prelude::{kernel_params, CudaStorage};
    use crate::cuda::kernels::rows::XArgs;
    use crate::op::Part;
    use crate::shape::Layout;
    use crate::{Error, Result};
    use std::sync::Arc;

    /// Mirrors `struct LArgs` (`linear_xent_source`): h's, the weight's and the bias's
    /// strides and offsets, the features, where the output's parts start, `drelu` and the rows a
    /// block takes.
    #[repr(C)]
    struct LArgs {
        hs0: i64,
        hs1: i64,
        ho: i64,
        wsc: i64,
        wsj: i64,
        wo: i64,
        bsc: i64,
        bo: i64,
        f: i64,
        dw: i64,
        db: i64,
        dh: i64,
        drelu: i32,
        per: i32,
    }

    /// `Fused::LinearCrossEntropyMean` in one launch (`linear_xent_source`): a cluster of
    /// blocks on Hopper, one block before.
    pub(crate) fn linear_cross_entropy_mean(
        g: &Arc<Gpu>,
        x: &[(&CudaStorage, &Layout)],
        ignore: Option<i64>,
        smoothing: f64,
        drelu: bool,
    ) -> Result<CudaStorage> {
        let [(sh, lh), (sw, lw), (sb, lb), (st, lt)] = [x[0], x[1], x[2], x[3]];
        let (n, c, f) = (lh.shape[0], lw.shape[0], lh.shape[1]);
        if !linear_xent_fits(sh.dtype, n, c, f) {
            return Err(Error::shape(
            "linear_cross_entropy_mean",
            format!(
                "h {:?} and weight {:?} in {:?}: the fused head takes F32 heads of up to {LINEAR_XENT_MAX_SMEM} bytes staged and {LINEAR_XENT_MAX_MACS} multiply-adds a block",
                lh.shape, lw.shape, sh.dtype
            ),
        ));
        }
        let cluster = g.has_clusters();
        let (per, blocks) = linear_xent_blocks(n, cluster);
        let parts = crate::op::Parts::linear_cross_entropy_mean(n, c, f);
        let [dw, db, dh] = [Part::Dw, Part::Db, Part::Dx].map(|p| parts.offset(p));
        let (dw, db, dh) = (dw?, db?, dh?);
        let out = CudaStorage::alloc(&g.mem, sh.dtype, parts.len())?;
        let targets = dense(g, st, lt)?;
        let k = g.kernel_shared(crate::cuda::gpu::spec_key("linear_xent", &(sh.dtype, cluster)), LINEAR_XENT_MAX_SMEM as u32, || {
            linear_xent_source(sh.dtype, cluster)
        })?;
        let i = |v: usize| v as i64;
        let mut l = LArgs {
            hs0: i(lh.strides[0]),
            hs1: i(lh.strides[1]),
            ho: 0,
            wsc: i(lw.strides[0]),
            wsj: i(lw.strides[1]),
            wo: 0,
            bsc: i(lb.strides[0]),
            bo: 0,
            f: i(f),
            dw: i(dw),
            db: i(db),
            dh: i(dh),
            drelu: drelu as i32,
            per: per as i32,
        };
        let mut a = XArgs::new(n, c, ignore, smoothing, 0);
        let (mut o, mut ph, mut pw, mut pb) = (out.buf.ptr, sh.ptr_at(lh.offset), sw.ptr_at(lw.offset), sb.ptr_at(lb.offset));
        let (mut pt, mut pe) = (targets.ptr(), g.err);
        let mut params = kernel_params![o, ph, pw, pb, pt, pe, a, l];
        let smem = linear_xent_smem_bytes(n, c, f, cluster) as u32;
        let (threads, z) = (LINEAR_XENT_THREADS as u32, blocks as u32);
        // SAFETY: (out, h, w, bias, targets, err, XArgs, LArgs) matches the generated signature;
        // h, w and the bias are read through their own strides from their first elements within
        // their shapes, the targets are dense [n], `out` holds `parts`' length, and
        // `smem` (at most the limit the kernel was loaded with: `linear_xent_fits`) holds a
        // block's staged operands for `per` rows, `blocks` of which cover the n rows.
        unsafe {
            if cluster {
                g.launch_cluster(k, (1, 1, z), z, threads, smem, &mut params)?
            } else {
                g.launch(k, (1, 1), threads, smem, &mut params)?
            }
        };
        Ok(out)
    }

    /// Mirrors `struct PArgs` (`PRODUCT_ARGS`): the narrow and few-rows products.
    #[repr(C)]
    struct PArgs {
        m: i64,
        n: i64,
        k: i64,
        sam: i64,
        sak: i64,
        sbk: i64,
        sbn: i64,
        sbias: i64,
        has_bias: i32,
        relu: i32,
    }

    /// `out [m, n] = a [m, k] b [k, n] (+ bias) (ReLU)` on 2-D views of A and B, a bias `[n]`,
    /// `out` dense: with `few`, by the few-rows kernel (F32; the caller checks `m <= FEW_MAX_M`
    /// and that the GPU has clusters), else by the narrow kernel (the caller checks
    /// `n <= NARROW_MAX_N` and that A's rows are contiguous; `blas::own_product`).
    pub(crate) fn matmul_small(
        g: &Arc<Gpu>,
        few: bool,
        (sa, la): (&CudaStorage, &Layout),
        (sb, lb): (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
        relu: bool,
        out: &CudaStorage,
    ) -> Result<()> {
        let (m, n) = (la.shape[0], lb.shape[1]);
        // The kernel and its grid: a cluster of FEW_SPLIT blocks per FEW_COLS columns, each
        // block all of the m rows; or a warp per row of A, NARROW_THREADS / 32 rows a block.
        let (k_fn, grid, threads, cluster) = if few {
            let k_fn = g.kernel(crate::cuda::gpu::spec_key("matmul_few", &()), matmul_few_source)?;
            (k_fn, (n.div_ceil(FEW_COLS) as u32, 1, FEW_SPLIT as u32), FEW_THREADS, Some(FEW_SPLIT as u32))
        } else {
            let k_fn = g.kernel(crate::cuda::gpu::spec_key("matmul_narrow", &(out.dtype, n)), || matmul_narrow_source(out.dtype, n))?;
            (k_fn, (m.div_ceil(NARROW_THREADS / 32) as u32, 1, 1), NARROW_THREADS, None)
        };
        let i = |v: usize| v as i64;
        let mut a = PArgs {
            m: i(m),
            n: i(n),
            k: i(la.shape[1]),
            sam: i(la.strides[0]),
            sak: i(la.strides[1]),
            sbk: i(lb.strides[0]),
            sbn: i(lb.strides[1]),
            sbias: bias.map_or(0, |(_, l)| i(l.strides[0])),
            has_bias: bias.is_some() as i32,
            relu: relu as i32,
        };
        let (mut po, mut pa, mut pb) = (out.buf.ptr, sa.ptr_at(la.offset), sb.ptr_at(lb.offset));
        let mut pbias = bias.map_or(po, |(s, l)| s.ptr_at(l.offset));
        let mut params = kernel_params![po, pa, pb, pbias, a];
        // SAFETY: (out, a, b, bias, PArgs) matches both kernels' signatures; they read A and B
        // only within (m, k) and (k, n) of their views, which lie inside their buffers (the
        // caller's shape rule), the bias (n values) only when has_bias, and write only the m x n
        // values of `out`; the grid covers the output as said above.
        unsafe {
            match cluster {
                Some(z) => g.launch_cluster(k_fn, grid, z, threads as u32, 0, &mut params),
                None => g.launch3(k_fn, grid, threads as u32, 0, &mut params),
            }
        }
    }

    /// Mirrors `struct SArgs` (`matmul_short_source`).
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct SArgs {
        n: i64,
        k: i64,
        sam: i64,
        sak: i64,
        sbk: i64,
        ldp: i64,
        chunks: i64,
        tail: i64,
    }

    /// `out [m, n] = a [m, k] b [k, n]` by the short-product kernels (`matmul_short_source`):
    /// 2-D views of A (any strides) and B (rows contiguous); with `sums` at `Some(at)`, A's row
    /// sums written from `out[at]` too (`MatmulEpilogue::SumLeft`). The caller checks
    /// `m <= SHORT_MAX_M` and B's layout (`blas::own_product`).
    pub(crate) fn matmul_short(
        g: &Arc<Gpu>,
        (sa, la): (&CudaStorage, &Layout),
        (sb, lb): (&CudaStorage, &Layout),
        sums: Option<usize>,
        out: &CudaStorage,
    ) -> Result<()> {
        let (m, k, n) = (la.shape[0], la.shape[1], lb.shape[1]);
        let [part_k, fold_k] = g.kernel_set(crate::cuda::gpu::spec_key("matmul_short", &(out.dtype, m, sums.is_some())), || {
            let (src, name) = matmul_short_source(out.dtype, m, sums.is_some());
            (src, name.clone(), [format!("{name}_part"), format!("{name}_fold")])
        })?;
        let (chunks, ldp) = (k.div_ceil(SHORT_CHUNK), n + sums.is_some() as usize);
        let part = CudaStorage::alloc(&g.mem, out.dtype, chunks * m * ldp)?;
        let mut a = SArgs {
            n: n as i64,
            k: k as i64,
            sam: la.strides[0] as i64,
            sak: la.strides[1] as i64,
            sbk: lb.strides[0] as i64,
            ldp: ldp as i64,
            chunks: chunks as i64,
            tail: sums.unwrap_or(0) as i64,
        };
        let (mut pp, mut pa, mut pb, mut po) = (part.buf.ptr, sa.ptr_at(la.offset), sb.ptr_at(lb.offset), out.buf.ptr);
        let mut params = kernel_params![pp, pa, pb, a];
        let grid = (n.div_ceil(SHORT_THREADS) as u32, chunks as u32);
        // SAFETY: (part, a, b, SArgs) matches the generated signature; the views lie inside their
        // buffers (the caller's shape rule), `part` holds chunks x m x ldp values; block (x, y)
        // takes columns x * 256.. of chunk y.
        unsafe { g.launch(part_k, grid, SHORT_THREADS as u32, 0, &mut params)? };
        let mut params = kernel_params![po, pp, a];
        // SAFETY: (out, part, SArgs) matches the fold's signature; a warp per output, m x ldp of
        // them: `out` holds m x n values and, with the sums, m more from `tail`.
        unsafe { g.launch(fold_k, ((m * ldp * 32).div_ceil(SHORT_THREADS) as u32, 1), SHORT_THREADS as u32, 0, &mut params) }
    }

    /// Mirrors `struct TArgs` (`matmul_thin_source`).
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct TArgs {
        m: i64,
        n: i64,
        sam: i64,
        sak: i64,
        sbk: i64,
        sbn: i64,
        shm: i64,
        shn: i64,
        at: i64,
    }

    /// `out [m, n] = a [m, k] b [k, n]`, with `drelu` times `step(h)` and with `sums_at` A's row
    /// sums at `out[sums_at..]` (`MatmulEpilogue::SumLeft`), by the thin-product kernel:
    /// 2-D views of A, B and h (any strides); `out` dense. The caller checks `k <= THIN_MAX_K`
    /// (`blas::own_product`).
    pub(crate) fn matmul_thin(
        g: &Arc<Gpu>,
        (sa, la): (&CudaStorage, &Layout),
        (sb, lb): (&CudaStorage, &Layout),
        drelu: Option<(&CudaStorage, &Layout)>,
        sums_at: Option<usize>,
        out: &CudaStorage,
    ) -> Result<()> {
        let (m, k, n) = (la.shape[0], la.shape[1], lb.shape[1]);
        // Four neighbours a thread where B's rows and h are aligned vectors along memory.
        let rows4 = |l: &Layout| l.strides[1] == 1 && l.strides[0].is_multiple_of(4) && l.offset.is_multiple_of(4);
        let vec4 = n % 4 == 0 && rows4(lb) && drelu.is_none_or(|(_, l)| rows4(l));
        let (dr, sums) = (drelu.is_some(), sums_at.is_some());
        let key = crate::cuda::gpu::spec_key("matmul_thin", &(out.dtype, k, dr, vec4, sums));
        let kf = g.kernel(key, || matmul_thin_source(out.dtype, k, dr, vec4, sums))?;
        let hs = |d: usize| drelu.map_or(0, |(_, l)| l.strides[d] as i64);
        let mut a = TArgs {
            m: m as i64,
            n: n as i64,
            sam: la.strides[0] as i64,
            sak: la.strides[1] as i64,
            sbk: lb.strides[0] as i64,
            sbn: lb.strides[1] as i64,
            shm: hs(0),
            shn: hs(1),
            at: sums_at.unwrap_or(0) as i64,
        };
        let (mut po, mut pa, mut pb) = (out.buf.ptr, sa.ptr_at(la.offset), sb.ptr_at(lb.offset));
        let mut ph = drelu.map_or(po, |(s, l)| s.ptr_at(l.offset));
        let mut params = kernel_params![po, pa, pb, ph, a];
        // SAFETY: (out, a, b, h, TArgs) matches the generated signature; the views lie inside
        // their buffers (the caller's shape rule), `out` holds m x n values (and with `sums_at`
        // m more from there); h is read only with `drelu`; with `vec4`, B's and h's rows are
        // contiguous and every vector aligned (buffers start 256-byte aligned; offsets and row
        // strides are multiples of 4); the grid strides over every output (or group of four).
        unsafe { g.launch(kf, (g.grid_for(m * n / if vec4 { 4 } else { 1 }), 1), 256, 0, &mut params) }
    }

    /// Products run by `matmul_wgmma` in this process (`cuda::wgmma_launches`).
    pub(crate) static WGMMA_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    /// Mirrors `struct GArgs` (`wgmma.rs`).
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct GArgs {
        lda: i64,
        ldb: i64,
        ldc: i64,
        ldx: i64,
        a_outer: i64,
        m: i32,
        n: i32,
        k: i32,
        kc: i32,
        splits: i32,
        a_inner: i32,
    }

    /// `out [m, n] = a [m, k] b [k, n]` and `spec`'s epilogue by Kiln's Hopper GEMM
    /// (`wgmma.rs`): 2-D views of A and B, each with the unit stride `spec` says and the other a
    /// multiple of 4, 16-byte aligned; `bias` a dense `[n]`; `aux` (GELU's pre-activation
    /// written, or an activation's input read) an address with rows `ldx` apart; `residual` a
    /// dense `[m, n]` added last; `out` dense.
    /// The caller checks all of it (`blas::own_product`). `a_rows` (inner, outer) says A's rows are
    /// a batch that does not lie as rows: row `r` at `(r % inner) * lda + (r / inner) * outer`
    /// (A K-contiguous, `outer` a multiple of 4). A product of few tiles splits its
    /// contraction (`wgmma::splits`), each tile's parts one thread block cluster that adds
    /// them in order through its shared memory and applies the epilogue.
    pub(crate) fn matmul_wgmma(
        g: &Arc<Gpu>,
        spec: crate::cuda::kernels::wgmma::Spec,
        (sa, la, a_rows): (&CudaStorage, &Layout, Option<(usize, usize)>),
        (sb, lb): (&CudaStorage, &Layout),
        (bias, aux, residual): (Option<u64>, Option<(u64, usize)>, Option<u64>),
        out: &CudaStorage,
    ) -> Result<()> {
        use crate::cuda::kernels::wgmma::{BM, BN, THREADS};
        let spec = crate::cuda::kernels::wgmma::Spec { map_a: a_rows.is_some(), ..spec };
        WGMMA_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (m, k, n) = (la.shape[0], la.shape[1], lb.shape[1]);
        let shared = spec.shared_bytes() as u32;
        let gemm = g.kernel_shared(crate::cuda::gpu::spec_key("matmul_wgmma", &spec), shared, || spec.source())?;
        let (pa, pb, pc) = (sa.ptr_at(la.offset), sb.ptr_at(lb.offset), out.buf.ptr);
        let (pbias, paux, pres) = (bias.unwrap_or(0), aux.map_or(0, |(p, _)| p), residual.unwrap_or(0));
        // The product with its contraction in `parts` parts (`wgmma::split_into`).
        let run = |parts: usize| -> Result<()> {
            let (splits, depth) = crate::cuda::kernels::wgmma::split_into(k, parts);
            let mut a = GArgs {
                lda: la.strides[spec.ta as usize] as i64,
                ldb: lb.strides[spec.tb as usize] as i64,
                ldc: n as i64,
                ldx: aux.map_or(0, |(_, ld)| ld as i64),
                a_outer: a_rows.map_or(0, |(_, outer)| outer as i64),
                m: m as i32,
                n: n as i32,
                k: k as i32,
                kc: depth as i32,
                splits: splits as i32,
                a_inner: a_rows.map_or(m, |(inner, _)| inner) as i32,
            };
            let (mut pa, mut pb, mut pc, mut pbias, mut paux, mut pres) = (pa, pb, pc, pbias, paux, pres);
            let mut params = kernel_params![pa, pb, pc, pbias, paux, pres, a];
            let grid = (n.div_ceil(BN) as u32, m.div_ceil(BM) as u32, splits as u32);
            // SAFETY: (a, b, c, bias, aux, residual, GArgs) matches the generated signature; the
            // views lie inside their buffers with the strides given (the caller's checks; with
            // `a_rows`, every row the map names), `out` and the residual hold m x n values, bias n,
            // aux m rows of ldx (each read or written only when the spec says so); a block per
            // 128 x 128 tile and part of the contraction, with the shared memory the spec asks
            // for, a tile's parts one cluster (at most 8).
            unsafe {
                match splits {
                    1 => g.launch3(gemm, grid, THREADS as u32, shared, &mut params),
                    _ => g.launch_cluster(gemm, grid, splits as u32, THREADS as u32, shared, &mut params),
                }
            }
        };
        // The parts that fill about a wave of blocks, or under `MaxAutotune` the fastest of each
        // count within a wave. (Every run writes the same output: the product is read-only input
        // to nothing it writes; `out` is fresh, never the residual.)
        let sms = g.sms as usize;
        let default = crate::cuda::kernels::wgmma::splits(m, n, k, sms).0;
        let candidates = || crate::cuda::kernels::wgmma::split_candidates(m, n, k, sms);
        let problem = (spec, m, n, k, a_rows);
        let parts =
            crate::cuda::tune::choice(g, ("matmul_wgmma", &problem), default, candidates, |p| crate::cuda::tune::time_graph(g, || run(p)));
        run(parts)
    }

    /// The products' argument structs against their C twins (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::layout_check;
        vec![
            layout_check!(PRODUCT_ARGS, "PArgs", PArgs, {
                m => m, n => n, k => k, sam => sam, sak => sak, sbk => sbk, sbn => sbn, sbias => sbias, has_bias => has_bias, relu => relu
            }),
            layout_check!(matmul_short_source(DType::F32, 4, false).0, "SArgs", SArgs, {
                n => n, k => k, sam => sam, sak => sak, sbk => sbk, ldp => ldp, chunks => chunks, tail => tail
            }),
            layout_check!(matmul_thin_source(DType::F32, 16, false, false, false).0, "TArgs", TArgs, {
                m => m, n => n, sam => sam, sak => sak, sbk => sbk, sbn => sbn, shm => shm, shn => shn, at => at
            }),
            layout_check!(linear_xent_source(DType::F32, false).0, "LArgs", LArgs, {
                hs0 => hs0, hs1 => hs1, ho => ho, wsc => wsc, wsj => wsj, wo => wo, bsc => bsc, bo => bo, f => f, dw => dw, db => db,
                dh => dh, drelu => drelu, per => per
            }),
            layout_check!(crate::cuda::kernels::wgmma::BODY, "GArgs", GArgs, {
                lda => lda, ldb => ldb, ldc => ldc, ldx => ldx, a_outer => a_outer, m => m, n => n, k => k, kc => kc, splits => splits,
                a_inner => a_inner
            }),
        ]
    }
}
