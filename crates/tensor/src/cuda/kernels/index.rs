//! Indexing kernels: gather, scatter-add, index-select and index-add, concatenation, and the
//! bitonic row sort behind `argsort`, with their launches.

use crate::codegen::fnv1a;
use crate::cuda::kernels::prelude::{storage_type, INDEX_ARGS, PRELUDE};
use crate::DType;

/// Index kernels (index_select, gather, index_add, scatter_add) over contiguous operands seen
/// as `[outer, dim, inner]`. A bad index writes nothing (or zero) and records itself in the
/// device's error word, reported at the next host read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Index {
    pub kind: IndexKind,
    pub dtype: DType,
    /// `Select` a warp a row, its lanes along the row (`select_by_rows`), so the 64-bit
    /// divisions come once a row rather than three times an element (element by element,
    /// GPT's token embedding, 16384 rows of 384, is slow). `Add` is always by rows
    /// (`index_add_source`).
    pub rows: bool,
}

/// Whether `Index::rows` suits a select of `rows` rows of `inner` elements:
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

impl Index {
    pub fn source(&self) -> (String, String) {
        let kind = format!("{:?}", self.kind).to_lowercase();
        let name = format!("k_{kind}_{:012x}", fnv1a(format!("{self:?}").as_bytes()) & 0xffff_ffff_ffff);
        let t = storage_type(self.dtype);
        let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {t} T;\n");
        s += &format!(
            "extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ src, const long long* __restrict__ idx, long long* err, IArgs a) {{\n"
        );
        if self.kind == IndexKind::Select && self.rows {
            // Row `row` of the output [outer, nidx, inner].
            s += r#"  {
    const long long rows = a.outer * a.nidx, warps = ((long long)gridDim.x * blockDim.x) / 32;
    const int lane = threadIdx.x % 32;
    for (long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
      const long long j = row % a.nidx, ou = row / a.nidx, v = idx[j];
      const bool ok = check_index(err, a.code, v, a.size);
"#;
            s += r#"      const T* from = src + (ok ? (ou * a.size + v) * a.inner : 0);
      T* to = o + row * a.inner;
      for (long long e = lane; e < a.inner; e += 32) to[e] = ok ? from[e] : T();
"#;
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
            IndexKind::Add => return index_add_source(self.dtype),
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

/// index_add's kernel, deterministic: `perm` is the stable order of the indices (argsort; null
/// for a single index), so equal indices form runs, and at the start of each run (of each
/// `outer` slice) a warp for each 32 columns adds the run's source rows to the output row in
/// index order. No two warps write one row, and the sums come in one order every run (atomic
/// adds would give last bits that change from run to run, and training that cannot be
/// replayed).
pub fn index_add_source(dtype: DType) -> (String, String) {
    let name = format!("k_index_add_{}", format!("{dtype:?}").to_lowercase());
    let t = storage_type(dtype);
    let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {t} T;\n");
    s += &format!(
        "extern \"C\" __global__ void {name}(T* __restrict__ o, const T* __restrict__ src, const long long* __restrict__ idx, const long long* __restrict__ perm, long long* err, IArgs a) {{\n"
    );
    s += r#"  const long long chunks = (a.inner + 31) / 32, units = a.outer * a.nidx * chunks;
  const long long warps = ((long long)gridDim.x * blockDim.x) / 32;
  const int lane = threadIdx.x % 32;
  for (long long u = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; u < units; u += warps) {
    // The warp's unit: sorted position k of slice ou, columns chunk * 32 ...
    const long long row = u / chunks, e = (u % chunks) * 32 + lane;
    const long long k = row % a.nidx, ou = row / a.nidx, v = idx[perm ? perm[k] : k];
    if (k > 0 && idx[perm[k - 1]] == v) continue;
    if (!check_index(err, a.code, v, a.size)) continue;
    const bool col = e < a.inner;
    const T* from = src + ou * a.nidx * a.inner + (col ? e : 0);
    T* to = o + (ou * a.size + v) * a.inner + (col ? e : 0);
    T acc = col ? *to : T();
    // The run's source rows, 32 at a time: each lane finds one, then all add them in order
    // (the loads independent of each other).
    for (long long r0 = k;; r0 += 32) {
      long long j = -1;
      if (r0 + lane < a.nidx) {
        j = perm ? perm[r0 + lane] : r0 + lane;
        if (idx[j] != v) j = -1;
      }
      const int found = __popc(__ballot_sync(0xffffffffu, j >= 0));
      for (int q = 0; q < found; ++q) {
        const long long jq = __shfl_sync(0xffffffffu, j, q);
        if (col) acc += from[jq * a.inner];
      }
      if (found < 32) break;
    }
    if (col) *to = acc;
  }
}
"#;
    (s, name)
}

/// The dtype argsort compares keys in: floats in F32 (F64 for F64), integers as they are.
pub fn sort_key_dtype(d: DType) -> DType {
    match d {
        DType::F64 => DType::F64,
        DType::I64 | DType::U8 => DType::I64,
        _ => DType::F32,
    }
}

/// The elements a block of argsort's shared-memory phase sorts (two a thread).
pub const SORT_TILE: usize = 2048;

/// argsort's kernel (see `argsort`): `phase` 0 loads each row's keys and positions
/// into `[rows, p]` scratch (positions `>= n` pad the row and sort last), 1 is the bitonic
/// compare-exchange of step `(j, k)`, 2 writes each row's first `n` positions, and 3 runs in
/// shared memory every step of merge `k` whose partners lie in one tile of `SORT_TILE` (all of
/// merges 2..=tile when `k` is 0). `before(a, b)` is the strict order: padding last, NaN as
/// the largest value, ties by position.
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
        "extern \"C\" __global__ void __launch_bounds__(1024) {name}(long long* o, const {t}* __restrict__ x, K* keys, long long* pos, long long total, long long n, long long p, long long j, long long k, int phase) {{\n"
    );
    s += &format!("  __shared__ K sk[{SORT_TILE}];\n  __shared__ long long sp[{SORT_TILE}];\n  const long long tile = p < {SORT_TILE} ? p : {SORT_TILE};\n");
    s += r#"  if (phase == 3) {
    for (long long t0 = blockIdx.x * tile; t0 < total; t0 += (long long)gridDim.x * tile) {
      for (long long c = threadIdx.x; c < tile; c += blockDim.x) { sk[c] = keys[t0 + c]; sp[c] = pos[t0 + c]; }
      __syncthreads();
      for (long long kk = k == 0 ? 2 : k; kk <= (k == 0 ? tile : k); kk *= 2) {
        for (long long j2 = (kk < tile ? kk : tile) / 2; j2 > 0; j2 /= 2) {
          for (long long q = threadIdx.x; q < tile / 2; q += blockDim.x) {
            const long long a = 2 * j2 * (q / j2) + q % j2, b = a + j2;
            const bool up = (((t0 % p) + a) & kk) == 0;
            const bool swap = up ? before(sk[b], sp[b], sk[a], sp[a], n) : before(sk[a], sp[a], sk[b], sp[b], n);
            if (swap) {
              const K tk = sk[a]; sk[a] = sk[b]; sk[b] = tk;
              const long long tp = sp[a]; sp[a] = sp[b]; sp[b] = tp;
            }
          }
          __syncthreads();
        }
      }
      for (long long c = threadIdx.x; c < tile; c += blockDim.x) { keys[t0 + c] = sk[c]; pos[t0 + c] = sp[c]; }
      __syncthreads();
    }
    return;
  }
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
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

#[cfg(feature = "cuda")]
pub(crate) use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::*;
    use crate::codegen::compute_type;
    use crate::cuda::gpu::Gpu;
    use crate::cuda::kernels::elementwise::{cast, dense, launch_ew, Dense, NO_EXTRA};
    use crate::cuda::kernels::prelude::{kernel_params, too_many_dims, CudaStorage, MAX_RANK};
    use crate::op::{Op, OutMeta};
    use crate::shape::Layout;
    use crate::{DType, Result};
    use std::sync::Arc;

    /// Mirrors `struct IArgs`.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct IArgs {
        n: i64,
        outer: i64,
        size: i64,
        inner: i64,
        nidx: i64,
        code: i64,
        ishape: [i64; MAX_RANK],
        bshape: [i64; MAX_RANK],
        rank: i32,
        dim: i32,
    }

    /// Launches an index kernel: `o` written from `src` at `idx` (all dense).
    fn launch_index(g: &Arc<Gpu>, kind: IndexKind, o: &CudaStorage, src: u64, idx: u64, mut a: IArgs) -> Result<()> {
        let rows = kind == IndexKind::Select && select_by_rows((a.outer * a.nidx) as usize, a.inner as usize, g.sms as usize);
        if a.n == 0 {
            return Ok(());
        }
        if a.rank as usize > MAX_RANK {
            return Err(too_many_dims(&[]));
        }
        a.code = index_code(kind);
        let spec = Index { kind, dtype: o.dtype, rows };
        let k = g.kernel(crate::cuda::gpu::spec_key("index", &spec), || spec.source())?;
        let (mut po, mut ps, mut pi, mut pe) = (o.buf.ptr, src, idx, g.err);
        let mut params = kernel_params![po, ps, pi, pe, a];
        // SAFETY: (out, src, idx, err, IArgs) matches the generated signature; the buffers are
        // dense and sized by the shape rule; `err` is the GPU's error word.
        unsafe { g.launch(k, (g.grid_for(a.n as usize), 1), 256, 0, &mut params) }
    }

    fn split3(shape: &[usize], dim: usize) -> (i64, i64, i64) {
        (shape[..dim].iter().product::<usize>() as i64, shape[dim] as i64, shape[dim + 1..].iter().product::<usize>() as i64)
    }

    fn shapes_args(idx_shape: &[usize], base_shape: &[usize], dim: usize, n: usize) -> IArgs {
        let mut a = IArgs { n: n as i64, size: base_shape[dim] as i64, rank: idx_shape.len() as i32, dim: dim as i32, ..IArgs::default() };
        for d in 0..idx_shape.len().min(MAX_RANK) {
            (a.ishape[d], a.bshape[d]) = (idx_shape[d] as i64, base_shape[d] as i64);
        }
        a
    }

    /// index_select and gather: a fresh buffer read from dense copies of input and index.
    pub(crate) fn index_read(
        g: &Arc<Gpu>,
        kind: IndexKind,
        (s, l): (&CudaStorage, &Layout),
        (si, li): (&CudaStorage, &Layout),
        dim: usize,
        meta: &OutMeta,
    ) -> Result<CudaStorage> {
        let (src, idx) = (dense(g, s, l)?, dense(g, si, li)?);
        let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
        let a = if kind == IndexKind::Select {
            let (outer, size, inner) = split3(&l.shape, dim);
            IArgs { n: out.len as i64, outer, size, inner, nidx: li.shape[0] as i64, ..IArgs::default() }
        } else {
            shapes_args(&li.shape, &l.shape, dim, out.len)
        };
        launch_index(g, kind, &out, src.ptr(), idx.ptr(), a)?;
        Ok(out)
    }

    /// index_add and scatter_add: a copy of `base`, then the adds of `src` (in F32 or F64:
    /// other dtypes are cast there and back); index_add's in a fixed order (`add_sorted`),
    /// scatter_add's atomic.
    pub(crate) fn index_add(
        g: &Arc<Gpu>,
        op: &Op,
        (sb, lb): (&CudaStorage, &Layout),
        (si, li): (&CudaStorage, &Layout),
        (ss, ls): (&CudaStorage, &Layout),
        dim: usize,
    ) -> Result<CudaStorage> {
        let wide = match sb.dtype {
            DType::F32 | DType::F16 | DType::BF16 => DType::F32,
            _ => DType::F64,
        };
        let out = cast(g, sb, lb, wide)?;
        // (A dense source already wide is read where it lies: a copy would move GPT's 25 MB
        // embedding gradient for nothing every step.)
        let src = if ss.dtype == wide { dense(g, ss, ls)? } else { Dense::Owned(cast(g, ss, ls, wide)?) };
        let idx = dense(g, si, li)?;
        if matches!(op, Op::IndexAdd { .. }) {
            let (outer, size, inner) = split3(&lb.shape, dim);
            let a = IArgs { n: ls.numel() as i64, outer, size, inner, nidx: li.shape[0] as i64, ..IArgs::default() };
            add_sorted(g, &out, src.ptr(), (&idx, si.dtype), a)?;
        } else {
            launch_index(g, IndexKind::ScatterAdd, &out, src.ptr(), idx.ptr(), shapes_args(&li.shape, &lb.shape, dim, ls.numel()))?;
        }
        if wide == sb.dtype {
            return Ok(out);
        }
        cast(g, &out, &Layout::contiguous(&lb.shape), sb.dtype)
    }

    /// index_add through the stable order of its indices (`index_add_source`).
    fn add_sorted(g: &Arc<Gpu>, o: &CudaStorage, src: u64, (idx, idx_dtype): (&Dense, DType), mut a: IArgs) -> Result<()> {
        if a.n == 0 {
            return Ok(());
        }
        // One index (a decoding step's cache write) needs no sort: a null `perm` is the identity.
        let perm = if a.nidx > 1 { Some(sort_rows(g, idx.ptr(), idx_dtype, (1, a.nidx as usize), false)?) } else { None };
        a.code = index_code(IndexKind::Add);
        let k = g.kernel(crate::cuda::gpu::spec_key("index_add", &o.dtype), || index_add_source(o.dtype))?;
        let pp = perm.as_ref().map_or(0, |p| p.buf.ptr);
        let (mut po, mut ps, mut pi, mut pp, mut pe) = (o.buf.ptr, src, idx.ptr(), pp, g.err);
        let mut params = kernel_params![po, ps, pi, pp, pe, a];
        // SAFETY: (out, src, idx, perm, err, IArgs) matches the generated signature; out is
        // [outer, size, inner], src [outer, nidx, inner], idx and perm nidx long longs, all
        // dense; `err` is the GPU's error word.
        unsafe { g.launch(k, (g.grid_for((a.outer * a.nidx) as usize * (a.inner as usize).div_ceil(32) * 32), 1), 256, 0, &mut params) }
    }

    /// Each input copied into its slice of the output.
    pub(crate) fn cat(g: &Arc<Gpu>, x: &[(&CudaStorage, &Layout)], dim: usize, meta: &OutMeta) -> Result<CudaStorage> {
        let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
        let full = Layout::contiguous(&meta.shape);
        let mut start = 0;
        for (s, l) in x {
            let len = l.shape[dim];
            let mut dst = full.clone();
            dst.offset = start * full.strides[dim];
            dst.shape[dim] = len;
            start += len;
            launch_ew(g, "cat", "v1".into(), compute_type(meta.dtype), &[(&out, &dst), (s, l)], &dst.shape, &out, true, NO_EXTRA)?;
        }
        Ok(out)
    }

    /// argsort of the rows of the last dim: a bitonic sort of (key, position) pairs over each row
    /// padded to a power of two `p` in scratch buffers, one launch per merge step (the kernel's
    /// phases: 0 fills the scratch, 1 is a compare-exchange step, 2 writes the first `n`
    /// positions of each row). Ties are ordered by position, so the result is the stable order.
    pub(crate) fn argsort(g: &Arc<Gpu>, (s, l): (&CudaStorage, &Layout), descending: bool) -> Result<CudaStorage> {
        let n = l.shape[l.rank() - 1];
        let rows = l.numel().checked_div(n).unwrap_or(0);
        if rows == 0 {
            return CudaStorage::alloc(&g.mem, DType::I64, 0);
        }
        sort_rows(g, dense(g, s, l)?.ptr(), s.dtype, (rows, n), descending)
    }

    /// The stable sorting permutation of each of `rows` dense rows of `n` `dtype` values at `x`.
    fn sort_rows(g: &Arc<Gpu>, x: u64, dtype: DType, (rows, n): (usize, usize), descending: bool) -> Result<CudaStorage> {
        let out = CudaStorage::alloc(&g.mem, DType::I64, rows * n)?;
        let p = n.next_power_of_two();
        let key_dtype = sort_key_dtype(dtype);
        let (keys, pos) = (CudaStorage::alloc(&g.mem, key_dtype, rows * p)?, CudaStorage::alloc(&g.mem, DType::I64, rows * p)?);
        let k = g.kernel(crate::cuda::gpu::spec_key("argsort", &(dtype, descending)), || argsort_source(dtype, descending))?;
        let tile = p.min(SORT_TILE);
        let run = |phase: i32, (j, kk): (i64, i64)| -> Result<()> {
            let (mut po, mut px, mut pk, mut pp) = (out.buf.ptr, x, keys.buf.ptr, pos.buf.ptr);
            let (mut total, mut nn, mut pw, mut jj, mut kkk, mut ph) = ((rows * p) as i64, n as i64, p as i64, j, kk, phase);
            let mut params = kernel_params![po, px, pk, pp, total, nn, pw, jj, kkk, ph];
            // SAFETY: (out, x, keys, pos, total, n, p, j, k, phase) matches the generated
            // signature; x holds rows x n dense values, keys and pos rows x p, out rows x n; every
            // thread's index stays below total = rows x p; a phase-3 block sorts whole tiles of
            // `tile` elements (p is a multiple of it).
            unsafe {
                if phase == 3 {
                    let grid = (rows * p / tile).clamp(1, g.sms as usize * 8) as u32;
                    g.launch(k, (grid, 1), (tile as u32 / 2).clamp(1, 1024), 0, &mut params)
                } else {
                    g.launch(k, (g.grid_for(rows * p), 1), 256, 0, &mut params)
                }
            }
        };
        run(0, (0, 0))?;
        // Every merge up to the tile in shared memory, then each larger merge as its global
        // steps (partners a tile or more apart) and one shared-memory launch for the rest.
        run(3, (0, 0))?;
        let mut kk = 2 * tile;
        while kk <= p {
            let mut j = kk / 2;
            while j >= tile {
                run(1, (j as i64, kk as i64))?;
                j /= 2;
            }
            run(3, (0, kk as i64))?;
            kk *= 2;
        }
        run(2, (0, 0))?;
        Ok(out)
    }

    /// The device error word's code for `kind` (`gpu::index_op_name` names it back).
    fn index_code(kind: IndexKind) -> i64 {
        match kind {
            IndexKind::Select => 1,
            IndexKind::Add => 2,
            IndexKind::Gather => 3,
            IndexKind::ScatterAdd => 4,
        }
    }

    /// `IArgs` against its C twin (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::{layout_check, INDEX_ARGS};
        vec![layout_check!(INDEX_ARGS, "IArgs", IArgs, {
            n => n, outer => outer, size => size, inner => inner, nidx => nidx, code => code, ishape => ishape, bshape => bshape,
            rank => rank, dim => dim
        })]
    }
}
