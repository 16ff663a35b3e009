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

/// The dtype argsort compares keys in: floats in F32 (F64 for F64), integers as they are.
pub fn sort_key_dtype(d: DType) -> DType {
    match d {
        DType::F64 => DType::F64,
        DType::I64 | DType::U8 => DType::I64,
        _ => DType::F32,
    }
}

/// argsort's kernel (see `argsort`): `phase` 0 loads each row's keys and positions
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
        let rows = matches!(kind, IndexKind::Select | IndexKind::Add)
            && select_by_rows((a.outer * a.nidx) as usize, a.inner as usize, g.sms as usize);
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

    /// index_add and scatter_add: a copy of `base`, then atomic adds of `src` (in F32 or F64:
    /// other dtypes are cast there and back).
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
        let (kind, a) = if matches!(op, Op::IndexAdd { .. }) {
            let (outer, size, inner) = split3(&lb.shape, dim);
            (IndexKind::Add, IArgs { n: ls.numel() as i64, outer, size, inner, nidx: li.shape[0] as i64, ..IArgs::default() })
        } else {
            (IndexKind::ScatterAdd, shapes_args(&li.shape, &lb.shape, dim, ls.numel()))
        };
        launch_index(g, kind, &out, src.ptr(), idx.ptr(), a)?;
        if wide == sb.dtype {
            return Ok(out);
        }
        cast(g, &out, &Layout::contiguous(&lb.shape), sb.dtype)
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
        let out = CudaStorage::alloc(&g.mem, DType::I64, rows * n)?;
        if rows == 0 {
            return Ok(out);
        }
        let p = n.next_power_of_two();
        let key_dtype = sort_key_dtype(s.dtype);
        let src = dense(g, s, l)?;
        let (keys, pos) = (CudaStorage::alloc(&g.mem, key_dtype, rows * p)?, CudaStorage::alloc(&g.mem, DType::I64, rows * p)?);
        let k = g.kernel(crate::cuda::gpu::spec_key("argsort", &(s.dtype, descending)), || argsort_source(s.dtype, descending))?;
        let run = |phase: i32, (j, kk): (i64, i64)| -> Result<()> {
            let (mut po, mut px, mut pk, mut pp) = (out.buf.ptr, src.ptr(), keys.buf.ptr, pos.buf.ptr);
            let (mut total, mut nn, mut pw, mut jj, mut kkk, mut ph) = ((rows * p) as i64, n as i64, p as i64, j, kk, phase);
            let mut params = kernel_params![po, px, pk, pp, total, nn, pw, jj, kkk, ph];
            // SAFETY: (out, x, keys, pos, total, n, p, j, k, phase) matches the generated
            // signature; x holds rows x n dense values, keys and pos rows x p, out rows x n; every
            // thread's index stays below total = rows x p.
            unsafe { g.launch(k, (g.grid_for(rows * p), 1), 256, 0, &mut params) }
        };
        run(0, (0, 0))?;
        let mut kk = 2;
        while kk <= p {
            let mut j = kk / 2;
            while j > 0 {
                run(1, (j as i64, kk as i64))?;
                j /= 2;
            }
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
