//! Reductions: sums, means, maxima and arg-maxima along any dims, and the column sums of a
//! matrix (a bias gradient, optionally gated by an activation's gradient), with their launches.

use crate::codegen::{compute_type, fnv1a};
use crate::cuda::kernels::prelude::{storage_type, PRELUDE};
use crate::op::{ReduceOp, UnaryOp};
use crate::DType;

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

/// Warps a `column_sums_source` block: each takes every `COLSUM_WARPS`-th row of its chunk.
pub const COLSUM_WARPS: usize = 8;

/// Sums over the rows of `x [rows, n]` (columns contiguous, rows `stride` apart), first pass:
/// block (x, y) folds chunk y's rows of a tile of `32 * v` columns (`v` neighbours a lane,
/// one 16-byte load where `v` is 16 bytes of T) into `part[y * n + c]`, F32 (F64 for F64),
/// adding its warps' sums in a fixed order. A bias's gradient `sum(g)` beside the weight's
/// `g^T x`: cuBLASLt's BGRAD epilogue runs it as a kernel of its own, slower than this one
/// (BENCHMARKS.md). `column_sums_fold_source` adds the chunks. With `gate` (`Fused::GatedSums`, x
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

#[cfg(feature = "cuda")]
pub(crate) use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::*;
    use crate::cuda::gpu::Gpu;
    use crate::cuda::kernels::elementwise::dense;
    use crate::cuda::kernels::prelude::{coalesce, kernel_params, too_many_dims, CudaStorage, View, MAX_RANK};
    use crate::op::{OutMeta, ReduceOp};
    use crate::shape::Layout;
    use crate::{DType, Result};
    use std::sync::Arc;

    /// The sums of a 2-D `s` (read through `l`) over `dim`, in `s`'s dtype.
    pub(crate) fn sum_dim(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout, dim: usize) -> Result<CudaStorage> {
        let meta = OutMeta { shape: vec![l.shape[1 - dim]], dtype: s.dtype };
        reduce(g, ReduceOp::Sum, (s, l), &[dim], &meta)
    }

    /// The fewest elements `reduce_into` hands to `column_sums` (two launches, worth it when the
    /// read is long).
    const COLUMN_SUMS_MIN: usize = 1 << 20;

    /// Whether `column_sums` takes the sums over dim `dim` of the 2-D view `l`: the other dim
    /// contiguous, and short enough for the grid (its blocks along x).
    pub(crate) fn column_sums_fit(l: &Layout, dim: usize) -> bool {
        l.rank() == 2 && dim < 2 && (l.strides[1 - dim] == 1 || l.shape[1 - dim] == 1) && l.shape[1 - dim] < 1 << 31
    }

    /// `out[at..at + n]` = the sums over dim `dim` of the 2-D view `(s, l)` (`n` the other dim's
    /// length; `column_sums_fit`): chunks of rows into F32 partials, then the chunks added in
    /// order (`column_sums_source`: the same bits every run of one chunking). By
    /// default 16-byte loads where the columns allow and about one resident wave of blocks;
    /// `MaxAutotune` times half-width loads too and other chunk counts (`tune::choice`).
    pub(crate) fn column_sums(g: &Arc<Gpu>, (s, l): (&CudaStorage, &Layout), dim: usize, out: &CudaStorage, at: usize) -> Result<()> {
        let (rows, n, ld) = (l.shape[dim], l.shape[1 - dim], l.strides[dim]);
        if n == 0 {
            return Ok(());
        }
        // 16 bytes a lane where every row's columns are aligned vectors.
        let wide = 16 / s.dtype.size_in_bytes();
        let v = if n % wide == 0 && ld % wide == 0 && l.offset % wide == 0 { wide } else { 1 };
        let sums = ColumnSums { x: (s, s.ptr_at(l.offset)), rows, n, ld, out: (out.dtype, out.ptr_at(at)), gate: None };
        sums.tuned(g, v)
    }

    /// `Fused::GatedSums`: `y = a * gate(h)` and its sums over the rows in one pass over a and h
    /// (`column_sums` reading a and h and storing y), the sums after (`Parts::with_tail`).
    pub(crate) fn gated_sums(g: &Arc<Gpu>, a: View, h: View, gate: crate::op::UnaryOp) -> Result<CudaStorage> {
        let (dtype, numel) = (a.0.dtype, a.1.numel());
        let n = a.1.shape[a.1.rank() - 1];
        let parts = crate::op::Parts::with_tail(&a.1.shape, &[n]);
        let (out, at) = (CudaStorage::alloc(&g.mem, dtype, parts.len())?, parts.offset(crate::op::Part::Tail)?);
        let rows = numel.checked_div(n).unwrap_or(0);
        if rows == 0 || n == 0 {
            return g.zero(&out).map(|_| out);
        }
        let (ad, hd) = (dense(g, a.0, a.1)?, dense(g, h.0, h.1)?);
        let wide = 16 / dtype.size_in_bytes();
        let aligned = n.is_multiple_of(wide) && [ad.ptr(), hd.ptr()].iter().all(|p| p % 16 == 0);
        let sums =
            ColumnSums { x: (a.0, ad.ptr()), rows, n, ld: n, out: (dtype, out.ptr_at(at)), gate: Some((gate, hd.ptr(), out.buf.ptr)) };
        sums.tuned(g, if aligned { wide } else { 1 })?;
        Ok(out)
    }

    impl ColumnSums<'_> {
        /// Both launches, with the vector width and chunk count `tune::choice` keeps (by default
        /// `v` columns a lane and about one resident wave of blocks).
        fn tuned(&self, g: &Arc<Gpu>, v: usize) -> Result<()> {
            let (rows, n, ld) = (self.rows, self.n, self.ld);
            // Each chunk at least a row a warp.
            let most = rows.div_ceil(COLSUM_WARPS).max(1);
            let chunks_for = |v: usize| (g.sms as usize * 8 / n.div_ceil(32 * v)).clamp(1, most);
            // A choice is `chunks * 32 + v` (v at most 16).
            let (pack, unpack) = (|chunks: usize, v: usize| chunks * 32 + v, |c: usize| (c / 32, c % 32));
            let problem = (self.x.0.dtype, rows, n, ld, v, self.gate.map(|(u, _, _)| u));
            let candidates = || {
                let widths = if v > 1 { vec![v, v / 2] } else { vec![1] };
                let counts =
                    |w: usize| [chunks_for(w), 32, 64, 128, 256, 512, 1024].into_iter().filter(|&c| c <= most).map(move |c| pack(c, w));
                widths.into_iter().flat_map(counts).collect()
            };
            let acc = accumulator(self.x.0.dtype);
            let choice = crate::cuda::tune::choice(g, ("column_sums", &problem), pack(chunks_for(v), v), candidates, |c| {
                let (chunks, v) = unpack(c);
                let part = CudaStorage::alloc(&g.mem, acc, chunks * n)?;
                crate::cuda::tune::time_graph(g, || self.launch(g, v, chunks, part.buf.ptr))
            });
            let (chunks, v) = unpack(choice);
            let part = CudaStorage::alloc(&g.mem, acc, chunks * n)?;
            self.launch(g, v, chunks, part.buf.ptr)
        }
    }

    /// One column-sum problem's operands (`column_sums`).
    struct ColumnSums<'a> {
        /// The summed storage and its first row's address, rows `ld` apart.
        x: (&'a CudaStorage, u64),
        rows: usize,
        n: usize,
        ld: usize,
        /// The sums' dtype and where the `n` of them go.
        out: (DType, u64),
        /// `Fused::GatedSums`: the gate, h's address and y's (dense, x's shape): x * gate(h) is
        /// summed and stored to y.
        gate: Option<(crate::op::UnaryOp, u64, u64)>,
    }

    impl ColumnSums<'_> {
        /// Both launches, reading `v` columns a lane (a vector width the columns allow), with
        /// about `chunks` chunks of rows, partials in `part` (room for `chunks x n` accumulators).
        fn launch(&self, g: &Arc<Gpu>, v: usize, chunks: usize, part: u64) -> Result<()> {
            debug_assert!(v == 1 || self.n.is_multiple_of(v), "the kernel reads whole vectors of columns");
            debug_assert!(self.gate.is_none() || self.ld == self.n, "a gated kernel's x, h and y are dense");
            let (dtype, out_dtype) = (self.x.0.dtype, self.out.0);
            let gate = self.gate.map(|(u, _, _)| u);
            let kf = g.kernel(crate::cuda::gpu::spec_key("column_sums", &(dtype, v, gate)), || column_sums_source(dtype, v, gate))?;
            let kfold = g.kernel(crate::cuda::gpu::spec_key("column_sums_fold", &out_dtype), || column_sums_fold_source(out_dtype))?;
            let chunk = self.rows.div_ceil(chunks.max(1)).max(1);
            let chunks = self.rows.div_ceil(chunk).max(1);
            let tiles = self.n.div_ceil(32 * v);
            let (mut pp, mut px) = (part, self.x.1);
            let (mut r, mut nn, mut lda, mut ch) = (self.rows as i64, self.n as i64, self.ld as i64, chunk as i64);
            let (mut ph, mut py) = self.gate.map_or((0, 0), |(_, h, y)| (h, y));
            let mut params = kernel_params![pp, px, r, nn, lda, ch, ph, py];
            // SAFETY: (part, x, rows, n, ld, chunk, h, y) matches the generated signature; the view
            // lies in its storage (the caller's shape rule), its kept dim contiguous, and with
            // vectors every row's columns start aligned to them (buffers are 256-byte aligned;
            // offset and ld multiples of the widest vector, and so of half of it); with a gate, x,
            // h and y are dense `rows x n` buffers of one dtype (ld = n), their addresses checked
            // 16-byte aligned by `gated_sums` before it picks vectors, h and y read only by the
            // gated kernel; `part` holds chunks x n values (chunks rounded down by the chunk
            // length, never up); the grid covers every tile and chunk.
            unsafe { g.launch(kf, (tiles as u32, chunks as u32), (COLSUM_WARPS * 32) as u32, 0, &mut params)? };
            let (mut po, mut pp, mut nn, mut ch) = (self.out.1, part, self.n as i64, chunks as i64);
            let mut params = kernel_params![po, pp, nn, ch];
            // SAFETY: (o, part, n, chunks) matches the generated signature; `out` holds the n sums
            // from its address (the caller's shape rule) and `part` chunks x n, live until the
            // stream has run this (freed buffers are reused only in stream order); a block covers
            // 32 columns.
            unsafe { g.launch(kfold, (self.n.div_ceil(32) as u32, 1), (COLSUM_FOLD_WARPS * 32) as u32, 0, &mut params) }
        }
    }

    /// Mirrors `struct RArgs`.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub(crate) struct RArgs {
        pub(crate) rows: i64,
        pub(crate) red: i64,
        pub(crate) off: i64,
        pub(crate) chunks: i64,
        pub(crate) chunk_len: i64,
        pub(crate) kshape: [i64; MAX_RANK],
        pub(crate) kst: [i64; MAX_RANK],
        pub(crate) rshape: [i64; MAX_RANK],
        pub(crate) rst: [i64; MAX_RANK],
        pub(crate) krank: i32,
        pub(crate) rrank: i32,
        pub(crate) scale: f64,
        pub(crate) qlen: i64,
    }

    pub(crate) fn reduce(
        g: &Arc<Gpu>,
        op: ReduceOp,
        (s, l): (&CudaStorage, &Layout),
        dims: &[usize],
        meta: &OutMeta,
    ) -> Result<CudaStorage> {
        let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
        reduce_into(g, op, s, l, dims, &out, true)?;
        Ok(out)
    }

    /// The dtype partial results are kept in between the two passes of a split reduction.
    pub(crate) fn accumulator(d: DType) -> DType {
        match d {
            DType::F32 | DType::F16 | DType::BF16 => DType::F32,
            DType::F64 => DType::F64,
            DType::I64 | DType::U8 => DType::I64,
        }
    }

    /// Reduces `dims` of `s` (read through `l`) into `out`. Picks the thread mapping (warp per
    /// row, block per row, or thread per column for outer-dim reductions) and, when there are too
    /// few rows to fill the GPU, splits each row into chunks whose partials a second pass folds
    /// (`split` is false for that pass: it runs as one kernel).
    pub(crate) fn reduce_into(
        g: &Arc<Gpu>,
        op: ReduceOp,
        s: &CudaStorage,
        l: &Layout,
        dims: &[usize],
        out: &CudaStorage,
        split: bool,
    ) -> Result<()> {
        let dims_of = |keep: bool| -> (Vec<usize>, Vec<usize>) {
            let ds: Vec<usize> = (0..l.rank()).filter(|d| dims.contains(d) != keep).collect();
            (ds.iter().map(|&d| l.shape[d]).collect(), ds.iter().map(|&d| l.strides[d]).collect())
        };
        let ((ks, kst), (rs, rst)) = (dims_of(true), dims_of(false));
        let (ks, kst) = coalesce(&ks, &[kst]);
        let (rs, rst) = coalesce(&rs, &[rst]);
        if ks.len() > MAX_RANK || rs.len() > MAX_RANK {
            return Err(too_many_dims(&l.shape));
        }
        let (rows, red): (usize, usize) = (ks.iter().product(), rs.iter().product());
        if rows == 0 {
            return Ok(());
        }
        let is_arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
        // A large sum over leading dims of contiguous columns (an eager bias gradient, GPT's
        // position-embedding gradient, 25 MB, slow as a column reduction): 16-byte loads.
        // (Columns enough for whole warps: a few columns over many rows stay with `Block` below.)
        let wide_columns = op == ReduceOp::Sum && split && ks.len() == 1 && kst[0] == [1] && rs.len() == 1 && rows >= 256;
        if wide_columns && out.dtype == s.dtype && s.dtype.is_float() && rows * red >= COLUMN_SUMS_MIN {
            let view = Layout { shape: vec![red, rows], strides: vec![rst[0][0], 1], offset: l.offset };
            if column_sums_fit(&view, 0) {
                return column_sums(g, (s, &view), 0, out, 0);
            }
        }
        let inner_contiguous = rs.is_empty() || (rs.len() == 1 && rst[0][0] == 1);
        let threads_wanted = g.sms as usize * 2048;
        let columns = !inner_contiguous && kst[0].last() == Some(&1) && rows >= 32;
        let (mode, chunks) = if split && !is_arg && columns {
            // Each thread folds at least 32 elements of its column (four loads in flight at a
            // time) before the partials pass.
            (ReduceMode::Column, (threads_wanted / rows).clamp(1, red.div_ceil(32).max(1)))
        } else if columns && red <= 4096 {
            // The partials pass (or a short column reduction): 32 threads down each column.
            (ReduceMode::ColumnTile, 1)
        } else if red > 1024 {
            let pieces =
                if !split || is_arg || rows >= g.sms as usize * 2 { 1 } else { (g.sms as usize * 4 / rows).clamp(1, red.div_ceil(4096)) };
            (ReduceMode::Block, pieces)
        } else {
            (ReduceMode::Warp, 1)
        };
        let partial = if chunks > 1 { Some(CudaStorage::alloc(&g.mem, accumulator(s.dtype), rows * chunks)?) } else { None };
        let dst = partial.as_ref().unwrap_or(out);
        let spec = Reduce { op, input: s.dtype, out: dst.dtype, one_dim: rs.len() <= 1, mode };
        let k = g.kernel(crate::cuda::gpu::spec_key("reduce", &spec), || spec.source())?;
        let chunk_len = red.div_ceil(chunks).max(1);
        let mut a = RArgs {
            rows: rows as i64,
            red: red as i64,
            off: l.offset as i64,
            chunks: chunks as i64,
            chunk_len: chunk_len as i64,
            krank: ks.len() as i32,
            rrank: rs.len() as i32,
            ..RArgs::default()
        };
        for (d, (&x, &y)) in ks.iter().zip(&kst[0]).enumerate() {
            (a.kshape[d], a.kst[d]) = (x as i64, y as i64);
        }
        a.rst[0] = 1;
        for (d, (&x, &y)) in rs.iter().zip(&rst[0]).enumerate() {
            (a.rshape[d], a.rst[d]) = (x as i64, y as i64);
        }
        let (mut o, mut p) = (dst.buf.ptr, s.buf.ptr);
        let mut params = kernel_params![o, p, a];
        let (grid, threads) = match mode {
            ReduceMode::Warp => ((rows.div_ceil(8) as u32, 1), 256),
            ReduceMode::Block => (((rows * chunks) as u32, 1), 1024),
            ReduceMode::Column => ((rows.div_ceil(256) as u32, chunks as u32), 256),
            ReduceMode::ColumnTile => ((rows.div_ceil(32) as u32, 1), 1024),
        };
        // SAFETY: (out, input, RArgs) matches the generated signature; both buffers are alive and
        // sized by the shape rule (the partial buffer holds rows * chunks).
        unsafe { g.launch(k, grid, threads, 0, &mut params)? };
        let Some(part) = partial else { return Ok(()) };
        match mode {
            ReduceMode::Column => reduce_into(g, op, &part, &Layout::contiguous(&[chunks, rows]), &[0], out, false),
            _ => reduce_into(g, op, &part, &Layout::contiguous(&[rows, chunks]), &[1], out, false),
        }
    }

    /// `RArgs` against its C twin (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::layout_check;
        vec![layout_check!(REDUCE_ARGS, "RArgs", RArgs, {
            rows => rows, red => red, off => off, chunks => chunks, chunk_len => chunk_len, kshape => kshape, kst => kst,
            rshape => rshape, rst => rst, krank => krank, rrank => rrank, scale => scale, qlen => qlen
        })]
    }
}
