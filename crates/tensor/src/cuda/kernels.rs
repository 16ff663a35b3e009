//! Every primitive op on CUDA: which generated kernel runs it and with what arguments. The
//! kernels' text comes from `codegen`, the scalar math from the op table.

use super::codegen::{
    compute_type, elementwise_expr, AttnKernel, Elementwise, Index, IndexKind, Reduce, ReduceMode, ADAM_MAX_TENSORS, MAX_RANK, SLOTS,
};
use super::gpu::{DeviceBuffer, Gpu, Kernel};
use crate::op::{Op, OutMeta, ReduceOp};
use crate::shape::Layout;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// A device buffer holding `len` elements of `dtype`.
#[derive(Debug)]
pub struct CudaStorage {
    pub buf: DeviceBuffer,
    pub dtype: DType,
    pub len: usize,
    /// With a flash attention forward's output: each row's log-sum-exp, for its backward.
    pub lse: Option<RowLse>,
}

/// The per-row log-sum-exp (base 2, of the scaled scores) of the attention forward whose output
/// holds it: `rows` = matrices x T, for this scale and mask. Its backward reads it instead of
/// recomputing every row's scores once more.
#[derive(Debug)]
pub struct RowLse {
    buf: DeviceBuffer,
    rows: usize,
    scale: f64,
    causal: bool,
}

impl CudaStorage {
    pub fn alloc(g: &Arc<Gpu>, dtype: DType, len: usize) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: g.alloc(len * dtype.size_in_bytes())?, dtype, len, lse: None })
    }
    pub fn device(&self) -> Device {
        Device::Cuda(self.buf.gpu.ordinal)
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.buf.gpu
    }
    /// The device address of element `offset`.
    pub fn ptr_at(&self, offset: usize) -> u64 {
        self.buf.ptr + (offset * self.dtype.size_in_bytes()) as u64
    }
}

/// A kernel's parameter array: the address of each argument, in order.
macro_rules! kernel_params {
    ($($x:ident),*) => { [$(&mut $x as *mut _ as *mut c_void),*] };
}

/// Mirrors `struct Args` in the kernel prelude.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Args {
    n: i64,
    off: [i64; SLOTS],
    shape: [i64; MAX_RANK],
    st: [[i64; MAX_RANK]; SLOTS],
    s: f64,
    seed: u64,
    roff: u64,
    rank: i32,
    pad: i32,
}

/// Drops size-1 dims and merges dims that every operand walks as one.
fn coalesce(shape: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
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

fn too_many_dims(shape: &[usize]) -> Error {
    Error::shape("cuda kernel", format!("shape {shape:?} has more than {MAX_RANK} dims that cannot be merged"))
}

fn storages<'a>(ins: &[&'a Storage]) -> Result<Vec<&'a CudaStorage>> {
    ins.iter()
        .map(|s| match s {
            Storage::Cuda(c) => Ok(c),
            Storage::Cpu(_) => Err(Error::Msg("a CPU buffer reached a CUDA kernel".into())),
        })
        .collect()
}

/// Launches one elementwise kernel. `ins` are read through their layouts (broadcast to
/// `shape`); the output is a fresh contiguous buffer, or with `inplace` the first input.
#[allow(clippy::too_many_arguments)]
fn launch_ew(
    g: &Arc<Gpu>,
    prefix: &str,
    expr: String,
    compute: &'static str,
    ins: &[(&CudaStorage, &Layout)],
    shape: &[usize],
    out: &CudaStorage,
    inplace: bool,
    extra: (f64, u64, u64),
) -> Result<()> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(());
    }
    let strides: Vec<Vec<usize>> = ins.iter().map(|(_, l)| l.broadcast_strides(shape)).collect();
    let contiguous: Vec<bool> =
        strides.iter().map(|st| Layout { shape: shape.to_vec(), strides: st.clone(), offset: 0 }.is_contiguous()).collect();
    let (cs, cst) = coalesce(shape, &strides);
    if cs.len() > MAX_RANK {
        return Err(too_many_dims(shape));
    }
    let offsets: Vec<usize> = ins.iter().map(|(_, l)| l.offset).collect();
    let vec4 = contiguous.iter().all(|&c| c) && offsets.iter().all(|o| o % 4 == 0) && n >= 4;
    let strided4 = if vec4 { None } else { strided4(&cs, &cst, &contiguous, &offsets) };
    let four_strided = strided4.is_some();
    let narrow = n <= u32::MAX as usize;
    let spec = Elementwise {
        expr,
        compute,
        inputs: ins.iter().map(|(s, _)| s.dtype).collect(),
        out: out.dtype,
        contiguous,
        inplace,
        vec4,
        strided4,
        narrow,
    };
    let k = g.kernel(super::spec_key(prefix, &spec), || spec.source(prefix))?;
    let mut a = Args { n: n as i64, rank: cs.len() as i32, s: extra.0, seed: extra.1, roff: extra.2, ..Args::default() };
    for (d, &x) in cs.iter().enumerate() {
        a.shape[d] = x as i64;
    }
    for (slot, st) in cst.iter().enumerate() {
        a.off[slot] = offsets[slot] as i64;
        for (d, &x) in st.iter().enumerate() {
            a.st[slot][d] = x as i64;
        }
    }
    if four_strided {
        // Positions count groups of four along the innermost dim.
        let last = cs.len() - 1;
        a.shape[last] /= 4;
        for st in a.st.iter_mut().take(cst.len()) {
            st[last] *= 4;
        }
    }
    let mut ptrs: Vec<u64> = vec![out.buf.ptr];
    ptrs.extend(ins.iter().enumerate().filter(|(i, _)| !(inplace && *i == 0)).map(|(_, (s, _))| s.buf.ptr));
    let mut params: Vec<*mut c_void> = ptrs.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
    params.push(&mut a as *mut Args as *mut c_void);
    let work = if vec4 || four_strided { n / 4 } else { n };
    // SAFETY: the parameters match the generated signature (output, inputs, Args); every
    // buffer is alive for the call and sized by the shape rule; the stream orders later use.
    unsafe { g.launch(k, (g.grid_for(work), 1), 256, 0, &mut params) }
}

/// Whether an elementwise kernel over the coalesced `shape` can move four elements at a time
/// through strided operands: the innermost dim is a multiple of four long, and every operand
/// either is contiguous, or reads it with stride 1 (then its other strides and its offset are
/// multiples of four, so the vectors are aligned), or broadcasts it (stride 0). Gives, per
/// operand, whether it broadcasts the innermost dim.
fn strided4(shape: &[usize], strides: &[Vec<usize>], contiguous: &[bool], offsets: &[usize]) -> Option<Vec<bool>> {
    let last = shape.len().checked_sub(1)?;
    if shape[last] % 4 != 0 {
        return None;
    }
    let mut bcast = Vec::with_capacity(strides.len());
    for ((st, &c), &off) in strides.iter().zip(contiguous).zip(offsets) {
        let aligned = off % 4 == 0 && st[..last].iter().all(|s| s % 4 == 0);
        match (c, st[last]) {
            (true, _) if off % 4 == 0 => bcast.push(false),
            (false, 1) if aligned => bcast.push(false),
            (false, 0) => bcast.push(true),
            _ => return None,
        }
    }
    Some(bcast)
}

/// Kernel arguments beyond the inputs: the scalar, and a draw's seed and offset.
const NO_EXTRA: (f64, u64, u64) = (0.0, 0, 0);

/// Makes a fresh buffer and fills it with `expr` over `ins`.
pub(crate) fn ew_with(
    g: &Arc<Gpu>,
    prefix: &str,
    expr: String,
    compute: &'static str,
    ins: &[(&CudaStorage, &Layout)],
    meta: &OutMeta,
    extra: (f64, u64, u64),
) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(g, meta.dtype, meta.shape.iter().product())?;
    launch_ew(g, prefix, expr, compute, ins, &meta.shape, &out, false, extra)?;
    Ok(out)
}

/// A dense row-major copy of `s` read through `l`.
pub fn dense_copy(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let meta = OutMeta { shape: l.shape.clone(), dtype: s.dtype };
    ew_with(g, "copy", "v0".into(), compute_type(s.dtype), &[(s, l)], &meta, NO_EXTRA)
}

/// `out += x` over a dense `out` of `shape`, `x` broadcast to it: a matmul's bias (`[n]`) or
/// residual where no epilogue added it.
pub(super) fn add_into(g: &Arc<Gpu>, out: &CudaStorage, shape: &[usize], bias: (&CudaStorage, &Layout)) -> Result<()> {
    let op = Op::UpdateBinary(crate::BinaryOp::Add);
    let (prefix, expr, c) = elementwise_expr(&op, &[out.dtype]).ok_or_else(|| Error::Msg("matmul bias: no kernel".into()))?;
    let lo = Layout::contiguous(shape);
    launch_ew(g, prefix, expr, c, &[(out, &lo), bias], shape, out, true, NO_EXTRA)
}

/// `out = u(out)` over a dense `out` of `shape`: a fused matmul's activation where no
/// epilogue applied it.
pub(super) fn unary_in_place(g: &Arc<Gpu>, out: &CudaStorage, shape: &[usize], u: crate::UnaryOp) -> Result<()> {
    let (prefix, expr, c) =
        elementwise_expr(&Op::Unary(u), &[out.dtype]).ok_or_else(|| Error::Msg(format!("matmul {}: no kernel", u.name())))?;
    let lo = Layout::contiguous(shape);
    launch_ew(g, prefix, expr, c, &[(out, &lo)], shape, out, true, NO_EXTRA)
}

/// `out *= u(x)` over a dense `out` of `shape` (the product of a fused matmul by an
/// activation's gradient), as the unfused `mul` computes it.
pub(super) fn mul_by_unary(g: &Arc<Gpu>, out: &CudaStorage, shape: &[usize], u: crate::UnaryOp, x: (&CudaStorage, &Layout)) -> Result<()> {
    let (prefix, expr, c) =
        elementwise_expr(&Op::Unary(u), &[x.0.dtype]).ok_or_else(|| Error::Msg(format!("matmul {}: no kernel", u.name())))?;
    let grad = ew_with(g, prefix, expr, c, &[x], &OutMeta { shape: shape.to_vec(), dtype: out.dtype }, NO_EXTRA)?;
    let op = Op::UpdateBinary(crate::BinaryOp::Mul);
    let (prefix, expr, c) = elementwise_expr(&op, &[out.dtype]).ok_or_else(|| Error::Msg("matmul: no mul kernel".into()))?;
    let lo = Layout::contiguous(shape);
    launch_ew(g, prefix, expr, c, &[(out, &lo), (&grad, &lo)], shape, out, true, NO_EXTRA)
}

/// The sums of a 2-D `s` (read through `l`) over `dim`, in `s`'s dtype.
pub(super) fn sum_dim(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout, dim: usize) -> Result<CudaStorage> {
    let meta = OutMeta { shape: vec![l.shape[1 - dim]], dtype: s.dtype };
    reduce(g, ReduceOp::Sum, (s, l), &[dim], &meta)
}

/// The fewest elements `reduce_into` hands to `column_sums` (two launches, worth it when the
/// read is long).
const COLUMN_SUMS_MIN: usize = 1 << 20;

/// Whether `column_sums` takes the sums over dim `dim` of the 2-D view `l`: the other dim
/// contiguous, and short enough for the grid (its blocks along x).
pub(super) fn column_sums_fit(l: &Layout, dim: usize) -> bool {
    l.rank() == 2 && dim < 2 && (l.strides[1 - dim] == 1 || l.shape[1 - dim] == 1) && l.shape[1 - dim] < 1 << 31
}

/// `out[at..at + n]` = the sums over dim `dim` of the 2-D view `(s, l)` (`n` the other dim's
/// length; `column_sums_fit`): chunks of rows into F32 partials, then the chunks added in
/// order (`codegen::column_sums_source`: the same bits every run of one chunking). By
/// default 16-byte loads where the columns allow and about one resident wave of blocks;
/// `MaxAutotune` times half-width loads too and other chunk counts (`tune::choice`).
pub(super) fn column_sums(g: &Arc<Gpu>, (s, l): (&CudaStorage, &Layout), dim: usize, out: &CudaStorage, at: usize) -> Result<()> {
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

/// `Op::GatedSums`: `y = a * gate(h)` and its sums over the rows in one pass over a and h
/// (`column_sums` reading a and h and storing y), the sums after `op::matmul_tail_offset`.
fn gated_sums(g: &Arc<Gpu>, a: View, h: View, gate: crate::op::UnaryOp) -> Result<CudaStorage> {
    let (dtype, numel) = (a.0.dtype, a.1.numel());
    let n = a.1.shape[a.1.rank() - 1];
    let at = crate::op::matmul_tail_offset(numel);
    let out = CudaStorage::alloc(g, dtype, at + n)?;
    let rows = numel.checked_div(n).unwrap_or(0);
    if rows == 0 || n == 0 {
        return zero(g, &out).map(|_| out);
    }
    let (ad, hd) = (dense(g, a.0, a.1)?, dense(g, h.0, h.1)?);
    let wide = 16 / dtype.size_in_bytes();
    let aligned = n % wide == 0 && [ad.ptr(), hd.ptr()].iter().all(|p| p % 16 == 0);
    let sums = ColumnSums { x: (a.0, ad.ptr()), rows, n, ld: n, out: (dtype, out.ptr_at(at)), gate: Some((gate, hd.ptr(), out.buf.ptr)) };
    sums.tuned(g, if aligned { wide } else { 1 })?;
    Ok(out)
}

impl ColumnSums<'_> {
    /// Both launches, with the vector width and chunk count `tune::choice` keeps (by default
    /// `v` columns a lane and about one resident wave of blocks).
    fn tuned(&self, g: &Arc<Gpu>, v: usize) -> Result<()> {
        use super::codegen::COLSUM_WARPS;
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
        let choice = super::tune::choice(g, ("column_sums", &problem), pack(chunks_for(v), v), candidates, |c| {
            let (chunks, v) = unpack(c);
            let part = CudaStorage::alloc(g, acc, chunks * n)?;
            super::tune::time_graph(g, || self.launch(g, v, chunks, part.buf.ptr))
        });
        let (chunks, v) = unpack(choice);
        let part = CudaStorage::alloc(g, acc, chunks * n)?;
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
    /// `Op::GatedSums`: the gate, h's address and y's (dense, x's shape): x * gate(h) is
    /// summed and stored to y.
    gate: Option<(crate::op::UnaryOp, u64, u64)>,
}

impl ColumnSums<'_> {
    /// Both launches, reading `v` columns a lane (a vector width the columns allow), with
    /// about `chunks` chunks of rows, partials in `part` (room for `chunks x n` accumulators).
    fn launch(&self, g: &Arc<Gpu>, v: usize, chunks: usize, part: u64) -> Result<()> {
        use super::codegen::{column_sums_fold_source, column_sums_source, COLSUM_FOLD_WARPS, COLSUM_WARPS};
        debug_assert!(v == 1 || self.n % v == 0, "the kernel reads whole vectors of columns");
        debug_assert!(self.gate.is_none() || self.ld == self.n, "a gated kernel's x, h and y are dense");
        let (dtype, out_dtype) = (self.x.0.dtype, self.out.0);
        let gate = self.gate.map(|(u, _, _)| u);
        let kf = g.kernel(super::spec_key("column_sums", &(dtype, v, gate)), || column_sums_source(dtype, v, gate))?;
        let kfold = g.kernel(super::spec_key("column_sums_fold", &out_dtype), || column_sums_fold_source(out_dtype))?;
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

/// `s` through `l` as a dense buffer: the same memory where the view is dense and starts on
/// 16 bytes (a part of a flat output, such as layer norm's dx, is read where it lies), else a
/// dense copy.
enum Dense<'a> {
    /// The first element's address in memory the caller's storage keeps.
    Borrowed(u64, std::marker::PhantomData<&'a CudaStorage>),
    Owned(CudaStorage),
}
impl Dense<'_> {
    /// The address of the first element.
    fn ptr(&self) -> u64 {
        match self {
            Dense::Borrowed(p, _) => *p,
            Dense::Owned(s) => s.buf.ptr,
        }
    }
}
fn dense<'a>(g: &Arc<Gpu>, s: &'a CudaStorage, l: &Layout) -> Result<Dense<'a>> {
    let p = s.ptr_at(l.offset);
    if l.is_contiguous() && p % 16 == 0 {
        Ok(Dense::Borrowed(p, std::marker::PhantomData))
    } else {
        Ok(Dense::Owned(dense_copy(g, s, l)?))
    }
}

fn cast(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout, to: DType) -> Result<CudaStorage> {
    let meta = OutMeta { shape: l.shape.clone(), dtype: to };
    ew_with(g, "cast", "v0".into(), compute_type(s.dtype), &[(s, l)], &meta, NO_EXTRA)
}

/// Runs an op that makes a new tensor on `device`.
pub fn run(op: &Op, ins: &[&Storage], layouts: &[&Layout], meta: &OutMeta, device: Device) -> Result<Storage> {
    let Device::Cuda(ordinal) = device else { return Err(Error::Msg("cuda::run on a CPU device".into())) };
    let g = super::gpu::gpu(ordinal)?;
    let cs = storages(ins)?;
    let x: Vec<(&CudaStorage, &Layout)> = cs.iter().copied().zip(layouts.iter().copied()).collect();
    let dtypes: Vec<DType> = x.iter().map(|(s, _)| s.dtype).collect();
    let extra = match op {
        Op::Full { value, .. } | Op::Scalar { value, .. } => (*value, 0, 0),
        Op::Rand { seed, offset, .. } => (0.0, *seed, *offset),
        _ => NO_EXTRA,
    };
    let out = match op {
        // Also a reshape the strides cannot express: the copy is read back in the new shape.
        Op::Contiguous => dense_copy(&g, x[0].0, x[0].1)?,
        // Zeros (every dtype's zero is all zero bytes) need no kernel: a memset.
        Op::Full { value, .. } if value.to_bits() == 0 => {
            let out = CudaStorage::alloc(&g, meta.dtype, meta.shape.iter().product())?;
            zero(&g, &out)?;
            out
        }
        Op::Full { .. }
        | Op::Arange { .. }
        | Op::Rand { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Scalar { .. }
        | Op::Where
        | Op::Cast(_) => {
            let (prefix, expr, compute) = elementwise_expr(op, &dtypes).ok_or_else(|| Error::Msg(format!("{}: no kernel", op.name())))?;
            ew_with(&g, prefix, expr, compute, &x, meta, extra)?
        }
        Op::Reduce { op: r, dims, .. } => reduce(&g, *r, x[0], dims, meta)?,
        Op::Softmax { log, scale, causal } => softmax(&g, x[0], (*log, *scale, *causal))?,
        Op::Normalize { eps, to } => normalize(&g, x[0], None, &x[1..], (*eps, *to))?,
        Op::NormalizeBackward { eps } => normalize(&g, x[0], Some(x[1]), &x[2..], (*eps, None))?,
        Op::GatedSums { gate } => gated_sums(&g, x[0], x[1], *gate)?,
        Op::NormalizeParamGrads { eps, sums, .. } => {
            layer_norm_param_grads(&g, x[0], x[1], (x.get(2).copied(), x.get(3).copied()), (*eps, *sums), None)?
        }
        Op::SoftmaxBackward { log, scale } => softmax_backward(&g, x[0], x[1], *log, *scale)?,
        Op::Attention { scale, causal, heads_last } => attention(&g, &x, (*scale, *causal), false, *heads_last)?,
        Op::AttentionBackward { scale, causal } => attention(&g, &x, (*scale, *causal), true, false)?,
        Op::CrossEntropy { ignore_index, smoothing } => cross_entropy(&g, &x, *ignore_index, *smoothing)?,
        Op::CrossEntropyBackward { ignore_index, smoothing } => cross_entropy(&g, &x, *ignore_index, *smoothing)?,
        Op::CrossEntropyMean { ignore_index, smoothing } => cross_entropy_mean(&g, &x, *ignore_index, *smoothing)?,
        Op::LinearCrossEntropyMean { ignore_index, smoothing, drelu } => {
            linear_cross_entropy_mean(&g, &x, *ignore_index, *smoothing, *drelu)?
        }
        Op::Matmul => super::blas::matmul(&g, x[0], x[1], x.get(2).copied(), meta)?,
        Op::MatmulFused(e) => super::blas::matmul_fused(&g, x[0], x[1], &x[2..], Some(*e), meta)?,
        Op::IndexSelect { dim } => index_read(&g, IndexKind::Select, x[0], x[1], *dim, meta)?,
        Op::Gather { dim } => index_read(&g, IndexKind::Gather, x[0], x[1], *dim, meta)?,
        Op::IndexAdd { dim } | Op::ScatterAdd { dim } => index_add(&g, op, x[0], x[1], x[2], *dim)?,
        Op::ArgSort { descending } => argsort(&g, x[0], *descending)?,
        Op::Cat { dim } => cat(&g, &x, *dim, meta)?,
        Op::Reshape(_) | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_) => {
            return Err(Error::Msg(format!("{}: a view runs no kernel", op.name())))
        }
        Op::Assign | Op::UpdateBinary(_) | Op::UpdateScalar(..) => {
            return Err(Error::Msg(format!("{}: in-place ops go through run_inplace", op.name())))
        }
    };
    Ok(Storage::Cuda(out))
}

/// Runs an in-place op on `dst` (read and written through `ld`).
pub fn run_inplace(op: &Op, dst: &mut Storage, ld: &Layout, src: Option<(&Storage, &Layout)>) -> Result<()> {
    let Storage::Cuda(d) = dst else { return Err(Error::Msg("cuda::run_inplace on a CPU buffer".into())) };
    let g = super::gpu::gpu(d.gpu().ordinal)?;
    let source = || -> Result<(&CudaStorage, &Layout)> {
        match src {
            Some((Storage::Cuda(s), l)) => Ok((s, l)),
            _ => Err(Error::Msg(format!("{}: needs a CUDA source tensor", op.name()))),
        }
    };
    let (second, extra) = match op {
        Op::Assign | Op::UpdateBinary(_) => (Some(source()?), 0.0),
        Op::UpdateScalar(_, v) => (None, *v),
        _ => return Err(Error::Msg(format!("{}: not an in-place op", op.name()))),
    };
    let (prefix, expr, c) = elementwise_expr(op, &[d.dtype]).ok_or_else(|| Error::Msg(format!("{}: no kernel", op.name())))?;
    let mut ins: Vec<(&CudaStorage, &Layout)> = vec![(&*d, ld)];
    ins.extend(second);
    launch_ew(&g, prefix, expr, c, &ins, &ld.shape, d, true, (extra, 0, 0))
}

/// Mirrors `struct RArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RArgs {
    rows: i64,
    red: i64,
    off: i64,
    chunks: i64,
    chunk_len: i64,
    kshape: [i64; MAX_RANK],
    kst: [i64; MAX_RANK],
    rshape: [i64; MAX_RANK],
    rst: [i64; MAX_RANK],
    krank: i32,
    rrank: i32,
    scale: f64,
    qlen: i64,
}

fn reduce(g: &Arc<Gpu>, op: ReduceOp, (s, l): (&CudaStorage, &Layout), dims: &[usize], meta: &OutMeta) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(g, meta.dtype, meta.shape.iter().product())?;
    reduce_into(g, op, s, l, dims, &out, true)?;
    Ok(out)
}

/// The dtype partial results are kept in between the two passes of a split reduction.
fn accumulator(d: DType) -> DType {
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
fn reduce_into(g: &Arc<Gpu>, op: ReduceOp, s: &CudaStorage, l: &Layout, dims: &[usize], out: &CudaStorage, split: bool) -> Result<()> {
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
    let partial = if chunks > 1 { Some(CudaStorage::alloc(g, accumulator(s.dtype), rows * chunks)?) } else { None };
    let dst = partial.as_ref().unwrap_or(out);
    let spec = Reduce { op, input: s.dtype, out: dst.dtype, one_dim: rs.len() <= 1, mode };
    let k = g.kernel(super::spec_key("reduce", &spec), || spec.source())?;
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

/// Fused attention: the forward (with `heads_last`, written `[B, T, H, D]`), or the backward's
/// dq, dk and dv packed as `[B, T, 3, H.., D]` (`op::attention_grads_shape`). The tensor-core
/// kernels read each input where it lies when its rows can be addressed as `Mat` (a head cut
/// from a fused projection) and write where `Mat` says; otherwise, and for the FMA kernels, an
/// input is first copied dense, and an output copied into place after.
fn attention(
    g: &Arc<Gpu>,
    x: &[(&CudaStorage, &Layout)],
    (scale, causal): (f64, bool),
    backward: bool,
    heads_last: bool,
) -> Result<CudaStorage> {
    use super::codegen::{flash_supported, ATTN_FMA_MAX_MATRICES, ATTN_MAX_D, ATTN_SHORT_MAX_T};
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
    let out = CudaStorage::alloc(g, dtype, if backward { 3 * len } else { len })?;
    if len == 0 {
        return Ok(out);
    }
    let heads = crate::op::attention_heads(&l0.shape);
    // The heads last: matrix b*H + h's row i at b T H D + i H D + h D.
    let last = Mat { b: (t * heads * d) as i64, h: d as i64, t: (heads * d) as i64, nh: heads as i64 };
    let mout = if heads_last { last } else { Mat::dense(t, d) };
    if short {
        let (ins, _copies) = attention_inputs(g, x, (t, d), Some(1))?;
        attention_short(g, out.buf.ptr, mout, &ins, (n, t, d), dtype, (scale, causal))?;
        return Ok(out);
    }
    let (ins, copies) = attention_inputs(g, x, (t, d), flash.then(|| super::codegen::flash_vec(dtype)))?;
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
    let packed = Mat { b: (t * 3 * heads * d) as i64, h: d as i64, t: (3 * heads * d) as i64, nh: heads as i64 };
    let e = (heads * d * dtype.size_in_bytes()) as u64;
    if flash {
        let lse = forward_lse(x[3], (n, t, d), (scale, causal));
        attention_kernels(g, &[out.buf.ptr, out.buf.ptr + e, out.buf.ptr + 2 * e], packed, &ins, (n, t, d), dtype, (scale, causal, lse))?;
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
pub(super) static ATTN_LSE_REUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Attention inputs as the kernels take them (`attention_inputs`), and the copies they read.
type AttnInputs<'a> = (Vec<(u64, Mat)>, Vec<Dense<'a>>);

/// Each attention input as a pointer to its first element and its `Mat` where its rows can be
/// addressed so with `vec`-element alignment (`None`: never), else a dense copy (kept alive in
/// the second list).
fn attention_inputs<'a>(
    g: &Arc<Gpu>,
    x: &[(&'a CudaStorage, &Layout)],
    (t, d): (usize, usize),
    vec: Option<usize>,
) -> Result<AttnInputs<'a>> {
    let mut copies: Vec<Dense> = Vec::new();
    let mut ins: Vec<(u64, Mat)> = Vec::new();
    for &(s, l) in x {
        match vec.and_then(|v| Mat::of(l, (t, d), v)) {
            Some(m) => ins.push((s.ptr_at(l.offset), m)),
            None => {
                let c = dense(g, s, l)?;
                ins.push((c.ptr(), Mat::dense(t, d)));
                copies.push(c);
            }
        }
    }
    Ok((ins, copies))
}

/// `codegen::attention_short_source`'s forward: a block per matrix, `ins` q, k, v.
fn attention_short(
    g: &Arc<Gpu>,
    out: u64,
    mout: Mat,
    ins: &[(u64, Mat)],
    (n, t, d): (usize, usize, usize),
    dtype: DType,
    (scale, causal): (f64, bool),
) -> Result<()> {
    use super::codegen::{attention_short_smem, attention_short_source, ATTN_SHORT_MAX_T};
    let most = attention_short_smem(ATTN_SHORT_MAX_T, d) as u32;
    let k = g.kernel_shared(super::spec_key("attn_short", &(dtype, d, causal)), most, || attention_short_source(dtype, d, causal))?;
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

/// Where the rows of one `[T, D]` matrix of an attention batch lie (`codegen::flash_source`'s
/// `struct Mat`): matrix `n`'s row `i` starts `(n / nh) * b + (n % nh) * h + i * t` elements
/// from the operand's first element.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Mat {
    b: i64,
    h: i64,
    t: i64,
    nh: i64,
}

impl Mat {
    fn dense(t: usize, d: usize) -> Mat {
        Mat { b: (t * d) as i64, h: 0, t: d as i64, nh: 1 }
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
        aligned.then_some(Mat { b: b as i64, h: h as i64, t: row as i64, nh: nh as i64 })
    }
}

/// A loaded attention kernel with its block size and dynamic shared memory: the
/// tensor-core kernels (`codegen::flash_source`) where `flash_supported`, else the tiled
/// FMA kernels (`codegen::tiled_source`).
fn attention_kernel(g: &Arc<Gpu>, kind: AttnKernel, dtype: DType, d: usize, causal: bool) -> Result<(Kernel, u32, u32)> {
    use super::codegen::{flash_smem_bytes, flash_source, flash_supported, tiled_smem_floats, tiled_source, TILED_THREADS};
    if flash_supported(dtype, d) {
        // A training step needs all three, so a cold cache compiles them at once (F32's are
        // slow to compile on a small machine; an inference-only process builds the backward
        // two for nothing, once, into the disk cache).
        const KINDS: [AttnKernel; 3] = [AttnKernel::Fwd, AttnKernel::Dq, AttnKernel::Dkv];
        let bytes = flash_smem_bytes(dtype, d) as u32;
        let keys = KINDS.map(|k| super::spec_key("flash", &(k, dtype, d, causal)));
        let ks = g.kernels_together(keys, bytes, |i| flash_source(KINDS[i], dtype, d, causal))?;
        return Ok((ks[KINDS.iter().position(|&k| k == kind).unwrap_or(0)], 128, bytes));
    }
    let bytes = (tiled_smem_floats(kind, d) * 4) as u32;
    let k = g.kernel_shared(super::spec_key("attention", &(kind, dtype, d, causal)), bytes, || tiled_source(kind, dtype, d, causal))?;
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
    let flash = super::codegen::flash_supported(dtype, d);
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
    let stats = CudaStorage::alloc(g, DType::F32, n * t * 2)?;
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

/// Softmax over the last dim of `s` read through `l`, into a contiguous buffer.
fn softmax(g: &Arc<Gpu>, (s, l): (&CudaStorage, &Layout), (log, scale, causal): (bool, f64, bool)) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(g, s.dtype, l.numel())?;
    let r = l.rank();
    let (ks, kst) = coalesce(&l.shape[..r - 1], &[l.strides[..r - 1].to_vec()]);
    if ks.len() > MAX_RANK {
        return Err(too_many_dims(&l.shape));
    }
    let (rows, n): (usize, usize) = (ks.iter().product(), l.shape[r - 1]);
    if rows == 0 || n == 0 {
        return Ok(out);
    }
    let (block, grid, threads) = row_launch(rows, n);
    let k = g.kernel(super::spec_key("softmax", &(s.dtype, log, block, causal)), || {
        super::codegen::softmax_source(s.dtype, log, block, causal)
    })?;
    let qlen = if r >= 2 { l.shape[r - 2].max(1) as i64 } else { 1 };
    let mut a = RArgs {
        rows: rows as i64,
        red: n as i64,
        off: l.offset as i64,
        chunks: 1,
        chunk_len: n as i64,
        krank: ks.len() as i32,
        rrank: 1,
        scale,
        qlen,
        ..RArgs::default()
    };
    for (d, (&x, &y)) in ks.iter().zip(&kst[0]).enumerate() {
        (a.kshape[d], a.kst[d]) = (x as i64, y as i64);
    }
    (a.rshape[0], a.rst[0]) = (n as i64, l.strides[r - 1] as i64);
    let (mut o, mut p) = (out.buf.ptr, s.buf.ptr);
    let mut params = kernel_params![o, p, a];
    // SAFETY: (out, input, RArgs) matches the generated signature; the output holds every
    // element and the input is read within its layout.
    unsafe { g.launch(k, grid, threads, 0, &mut params)? };
    Ok(out)
}

/// The launch shape of the row kernels (`codegen::row_prologue`): a warp per row, eight rows
/// a block, or a 1024-thread block per row longer than 1024. Returns (block mode, grid, threads).
fn row_launch(rows: usize, n: usize) -> (bool, (u32, u32), u32) {
    if n > 1024 {
        (true, (rows as u32, 1), 1024)
    } else {
        (false, (rows.div_ceil(8) as u32, 1), 256)
    }
}

/// Mirrors `struct NArgs` and `struct SArgs`: rows, row length, and the op's one scalar.
#[repr(C)]
struct RowArgs {
    rows: i64,
    red: i64,
    value: f64,
}

/// A row kernel over the last dim of `x` and (if given) a gradient of its shape, both read as
/// dense copies, with `(out, x, g, RowArgs)` parameters; `kernel` picks the kernel for block
/// mode or not, and whether every pointer (extras included) is 16-byte aligned.
fn row_pair(
    g: &Arc<Gpu>,
    (s, l): (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
    (value, extra): (f64, [u64; 2]),
    out_dtype: DType,
    kernel: impl FnOnce(bool, bool) -> Result<super::gpu::Kernel>,
) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(g, out_dtype, l.numel())?;
    let n = l.shape[l.rank() - 1];
    let rows = l.numel().checked_div(n).unwrap_or(0);
    if rows == 0 {
        return Ok(out);
    }
    let x = dense(g, s, l)?;
    let gd = grad.map(|(sg, lg)| dense(g, sg, lg)).transpose()?;
    let (block, grid, threads) = row_launch(rows, n);
    let (mut o, mut px) = (out.buf.ptr, x.ptr());
    let mut pg = gd.as_ref().map_or(0, |d| d.ptr());
    let k = kernel(block, [o, px, pg, extra[0], extra[1]].iter().all(|p| p % 16 == 0))?;
    let mut a = RowArgs { rows: rows as i64, red: n as i64, value };
    let [mut e0, mut e1] = extra;
    let mut params = kernel_params![o, px, pg, a, e0, e1];
    // SAFETY: (out, x, g, RowArgs) matches the generated signatures, followed by layer norm's
    // weight and bias (null unless its kernel reads them: `[n]` and dense; the other kernels
    // take four arguments and the driver reads no more); x and g are dense with `rows * n` elements,
    // and so is the output (g is unused, and may be null, in layer norm's forward).
    unsafe { g.launch(k, grid, threads, 0, &mut params)? };
    Ok(out)
}

/// Zeros all of `s` (on the stream).
pub(super) fn zero(g: &Arc<Gpu>, s: &CudaStorage) -> Result<()> {
    if super::gpu::is_dry() {
        return Ok(());
    }
    g.bind()?;
    // SAFETY: `s` owns `len` elements of its dtype on this GPU.
    unsafe { cudarc::driver::result::memset_d8_async(s.buf.ptr, 0, s.len * s.dtype.size_in_bytes(), g.stream.cu_stream()) }
        .map_err(|e| Error::Cuda(format!("memset: {e}")))
}

/// A buffer read through a layout.
type View<'a> = (&'a CudaStorage, &'a Layout);

/// `Op::NormalizeParamGrads` with `copy: Some(t)`: the flat output, and x's gradient (plus r)
/// stored in `t` by the same kernel.
pub(crate) fn layer_norm_grads_with_copy(op: &Op, ins: &[&Storage], layouts: &[&Layout], device: Device) -> Result<(Storage, Storage)> {
    let (Device::Cuda(ordinal), Op::NormalizeParamGrads { eps, sums, copy: Some(t) }) = (device, op) else {
        return Err(Error::Msg(format!("layer_norm_grads_with_copy: {op:?} on {device:?}")));
    };
    let g = super::gpu::gpu(ordinal)?;
    let cs = storages(ins)?;
    let x: Vec<View> = cs.iter().copied().zip(layouts.iter().copied()).collect();
    if x.len() < 3 {
        return Err(Error::Msg("layer_norm_grads_with_copy: the copy needs the weight".into()));
    }
    let copy = CudaStorage::alloc(&g, *t, x[0].1.numel())?;
    let flat = layer_norm_param_grads(&g, x[0], x[1], (x.get(2).copied(), x.get(3).copied()), (*eps, *sums), Some(&copy))?;
    Ok((Storage::Cuda(flat), Storage::Cuda(copy)))
}

/// Layer norm's parameter gradients `[2, n]` from x and the output gradient: per-block
/// partial sums in one pass over both (`codegen::layer_norm_param_grads_source`), then one
/// column sum of the partials. With the weight `w`, the same pass writes the input's gradient
/// too, after the `[2, n]` (`[3, n]` with `sums`: dx's column sums as rounded to that dtype)
/// from `op::ln_grads_dx_at` (`Op::NormalizeParamGrads`'s flat form). With `copy` (dense,
/// x's shape) and the weight, the pass also stores dx (plus r) to it in its dtype.
fn layer_norm_param_grads(
    g: &Arc<Gpu>,
    x: (&CudaStorage, &Layout),
    grad: (&CudaStorage, &Layout),
    (w, r): (Option<View>, Option<View>),
    (eps, sums): (f64, Option<DType>),
    copy: Option<&CudaStorage>,
) -> Result<CudaStorage> {
    let (dtype, n) = (x.0.dtype, x.1.shape[x.1.rank() - 1]);
    let rows = x.1.numel().checked_div(n).unwrap_or(0);
    let sums = sums.filter(|_| w.is_some());
    let dx_at = crate::op::ln_grads_dx_at(n, sums.is_some());
    // Rows of partials each block writes: dw, db (and the sums).
    let rows_k = 2 + sums.is_some() as usize;
    let out = CudaStorage::alloc(g, dtype, if w.is_some() { dx_at + x.1.numel() } else { 2 * n })?;
    let tiles = n.div_ceil(32);
    if n > super::codegen::LN_GRADS_MAX_N {
        return Err(Error::shape("layer_norm_param_grads", format!("rows of {n} exceed the kernel's {}", super::codegen::LN_GRADS_MAX_N)));
    }
    if rows == 0 || n == 0 {
        zero(g, &out)?;
        return Ok(out);
    }
    let (xd, gd) = (dense(g, x.0, x.1)?, dense(g, grad.0, grad.1)?);
    let wd = w.map(|(s, l)| dense(g, s, l)).transpose()?;
    // The residual gradient added to x's (only with the weight: the op's shape rule).
    let rd = r.filter(|_| w.is_some()).map(|(s, l)| dense(g, s, l)).transpose()?;
    let with_dx = wd.is_some();
    let gdt = grad.0.dtype;
    let (px, pg, pr) = (xd.ptr(), gd.ptr(), rd.as_ref().map_or(0, |r| r.ptr()));
    // Staged (each warp's next rows copied to shared memory while it works on this one) where
    // F32 rows of x, g (and r) are whole, aligned 16-byte pieces, and two blocks' slots fit an SM.
    use super::codegen::{ln_grads_stage_bytes, LnStage};
    let resid = rd.is_some();
    let pieces = dtype == DType::F32 && gdt.is_float() && [dtype, gdt].iter().all(|d| (n * d.size_in_bytes()) % 16 == 0);
    // With the kernel's static arrays (the partials' rows, and with sums the weights), within
    // 96 KiB: two blocks an SM on Hopper, and under the 99 KiB a block of sm_86/89 may take.
    let fixed = (rows_k + sums.is_some() as usize) * 32 * tiles * accumulator(dtype).size_in_bytes();
    let fits = |s: LnStage| ln_grads_stage_bytes(32 * tiles, dtype, gdt, s) + fixed <= 96 * 1024;
    let stage_r = resid && pr % 16 == 0;
    let stage = match (pieces && (px | pg) % 16 == 0, stage_r) {
        (true, true) if fits(LnStage::RowsAndResidual) => LnStage::RowsAndResidual,
        (true, _) if fits(LnStage::Rows) => LnStage::Rows,
        _ => LnStage::Off,
    };
    let (most, shared) = (ln_grads_stage_bytes(32 * tiles, dtype, gdt, stage), ln_grads_stage_bytes(n, dtype, gdt, stage));
    let copy = copy.filter(|_| with_dx);
    let parts = super::codegen::LnGradsParts { dx: with_dx, resid, sums, copy: copy.map(|c| c.dtype) };
    let k = g.kernel_shared(super::spec_key("ln_param_grads", &(dtype, tiles, gdt, stage, parts)), most as u32, || {
        super::codegen::layer_norm_param_grads_source(dtype, tiles, parts, gdt, stage)
    })?;
    let pc = copy.map_or(0, |c| c.buf.ptr);
    let (pdx, pw) = match &wd {
        Some(w) => (out.ptr_at(dx_at), w.ptr()),
        None => (0, 0),
    };
    // The kernel on about `want` blocks, each folding a run of rows into `part` (room for
    // `want x rows_k n` partials), then the partials added in order into `out`.
    let run = |want: usize, part: &CudaStorage| -> Result<()> {
        let chunk = rows.div_ceil(want.clamp(1, rows));
        let blocks = rows.div_ceil(chunk);
        let mut a = RowArgs { rows: rows as i64, red: n as i64, value: eps };
        let (mut o, mut ch, mut px, mut pg, mut pdx, mut pw, mut pr) = (part.buf.ptr, chunk as i64, px, pg, pdx, pw, pr);
        let mut pc = pc;
        let mut params = kernel_params![o, px, pg, a, ch, pdx, pw, pr, pc];
        // SAFETY: (part, x, g, NArgs, chunk, dx, w, r, cp) matches the generated signature; x
        // and g are dense `rows * n` buffers, `part` holds `blocks * rows_k n` partials of the
        // compute type (blocks at most `want`), and with the weight (dense, `n`) `out` holds
        // `rows * n` more elements from `dx_at`; without it the kernel reads neither dx nor w;
        // r (dense, x's shape and dtype) is read only by the kernel made for it, and cp (the
        // caller's dense `rows * n` copy of its dtype) written only by the kernel made for it.
        // Staged, `shared` bytes hold the warps' row slots (the kernel loaded with room for
        // `most`), and x's, g's and r's rows are 16-byte aligned.
        unsafe { g.launch(k, (blocks as u32, 1), (super::codegen::LN_GRADS_WARPS * 32) as u32, shared as u32, &mut params)? };
        reduce_into(g, ReduceOp::Sum, part, &Layout::contiguous(&[blocks, rows_k * n]), &[0], &out, false)
    };
    // About two blocks of 8 warps per SM by default. (Four blocks of 16 warps are no
    // faster, and F64's 32 tiles need more registers than 16 warps have.) `MaxAutotune` times
    // one to six blocks an SM.
    let sms = g.sms as usize;
    let default = rows.min(sms * 2);
    let candidates = || [2, 1, 3, 4, 6].iter().map(|b| (b * sms).min(rows)).collect();
    let problem = (dtype, gdt, rows, n, stage, parts);
    let want = super::tune::choice(g, ("ln_param_grads", &problem), default, candidates, |b| {
        let part = CudaStorage::alloc(g, accumulator(dtype), b * rows_k * n)?;
        super::tune::time_graph(g, || run(b, &part))
    });
    let part = CudaStorage::alloc(g, accumulator(dtype), want * rows_k * n)?;
    run(want, &part)?;
    Ok(out)
}

/// Layer norm's normalisation over the last dim, with its affine part when `affine` holds
/// the weight and bias (or, with `grad`, the input gradient, the weight scaling `grad` when
/// `affine` holds it).
fn normalize(
    g: &Arc<Gpu>,
    x: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
    affine: &[(&CudaStorage, &Layout)],
    (eps, to): (f64, Option<DType>),
) -> Result<CudaStorage> {
    let (dtype, backward) = (x.0.dtype, grad.is_some());
    let out = to.unwrap_or(dtype);
    let wb: Vec<Dense> = affine.iter().map(|(s, l)| dense(g, s, l)).collect::<Result<_>>()?;
    let extra = match &wb[..] {
        [w, b] => [w.ptr(), b.ptr()],
        [w] => [w.ptr(), 0],
        _ => [0, 0],
    };
    let has = extra[0] != 0;
    let n = x.1.shape[x.1.rank() - 1];
    // Rows that fit in registers as float4s take the one-trip kernel (F32 forward, with the
    // weight and bias or neither).
    let rows_kernel = dtype == DType::F32 && !backward && n % 128 == 0 && n <= super::codegen::LN_ROWS_MAX_N && (extra[1] != 0) == has;
    row_pair(g, x, grad, (eps, extra), out, |block, aligned| {
        if rows_kernel && !block && aligned {
            return g
                .kernel(super::spec_key("normalize_rows", &(n, has, out)), || super::codegen::normalize_rows_source(n / 128, has, out));
        }
        g.kernel(super::spec_key("normalize", &(dtype, backward, has, block, out)), || {
            super::codegen::normalize_source(dtype, backward, has, block, out)
        })
    })
}

/// A softmax's (or log-softmax's) input gradient over the last dim, from its output `y` and
/// the output's gradient.
fn softmax_backward(g: &Arc<Gpu>, y: (&CudaStorage, &Layout), grad: (&CudaStorage, &Layout), log: bool, scale: f64) -> Result<CudaStorage> {
    let dtype = y.0.dtype;
    row_pair(g, y, Some(grad), (scale, [0, 0]), dtype, |block, _| {
        g.kernel(super::spec_key("softmax_backward", &(dtype, log, block)), || super::codegen::softmax_backward_source(dtype, log, block))
    })
}

/// Mirrors `struct XArgs`.
#[repr(C)]
struct XArgs {
    rows: i64,
    red: i64,
    ignore: i64,
    code: i64,
    gst: i64,
    smoothing: f64,
    has_ignore: i32,
    pad: i32,
}

/// Cross-entropy per row of dense logits (`x`: logits, targets, and for the backward the
/// per-row gradient, read through its stride): `[rows]` losses or the `[rows, C]` gradient.
fn cross_entropy(g: &Arc<Gpu>, x: &[(&CudaStorage, &Layout)], ignore: Option<i64>, smoothing: f64) -> Result<CudaStorage> {
    let ((s, l), (st, lt)) = (x[0], x[1]);
    let (rows, n) = (l.shape[0], l.shape[1]);
    let backward = x.len() == 3;
    let out = CudaStorage::alloc(g, s.dtype, if backward { rows * n } else { rows })?;
    if rows == 0 {
        return Ok(out);
    }
    if n == 0 {
        return Err(Error::shape("cross_entropy", format!("needs at least one class, got logits {:?}", l.shape)));
    }
    let (logits, targets) = (dense(g, s, l)?, dense(g, st, lt)?);
    let (block, grid, threads) = row_launch(rows, n);
    let k = g.kernel(super::spec_key("cross_entropy", &(s.dtype, backward, block)), || {
        super::codegen::cross_entropy_source(s.dtype, backward, block)
    })?;
    let (mut pg, gst) =
        x.get(2).map_or((0, 0), |(sg, lg)| (sg.buf.ptr + (lg.offset * sg.dtype.size_in_bytes()) as u64, lg.strides[0] as i64));
    let mut a = XArgs::new(rows, n, ignore, smoothing, gst);
    let (mut o, mut px, mut pt, mut pe) = (out.buf.ptr, logits.ptr(), targets.ptr(), g.err);
    let mut params = kernel_params![o, px, pt, pg, pe, a];
    // SAFETY: (out, logits, targets, grad, err, XArgs) matches the generated signature; logits
    // are dense [rows, n], targets dense [rows]; the gradient (backward only; null and unread in
    // the forward) holds `rows` values at stride `gst` from its offset; `err` is the error word.
    unsafe { g.launch(k, grid, threads, 0, &mut params)? };
    Ok(out)
}

impl XArgs {
    fn new(rows: usize, n: usize, ignore: Option<i64>, smoothing: f64, gst: i64) -> XArgs {
        let (has_ignore, ignore) = (ignore.is_some() as i32, ignore.unwrap_or(0));
        XArgs { rows: rows as i64, red: n as i64, ignore, code: XENT_CODE, gst, smoothing, has_ignore, pad: 0 }
    }
}

/// `Op::CrossEntropyMean`: the loss and the logits' gradient in one launch
/// (`codegen::cross_entropy_mean_source`).
fn cross_entropy_mean(g: &Arc<Gpu>, x: &[(&CudaStorage, &Layout)], ignore: Option<i64>, smoothing: f64) -> Result<CudaStorage> {
    let ((s, l), (st, lt)) = (x[0], x[1]);
    let (rows, n) = (l.shape[0], l.shape[1]);
    let out = CudaStorage::alloc(g, s.dtype, crate::op::XENT_GRAD_AT + rows * n)?;
    if n == 0 && rows > 0 {
        return Err(Error::shape("cross_entropy_mean", format!("needs at least one class, got logits {:?}", l.shape)));
    }
    let (logits, targets) = (dense(g, s, l)?, dense(g, st, lt)?);
    let tpr = super::codegen::xent_mean_threads_per_row(n);
    let threads = super::codegen::XENT_MEAN_THREADS;
    let blocks = (rows * tpr).div_ceil(threads).max(1);
    if blocks > super::codegen::XENT_MEAN_BLOCKS {
        let most = super::codegen::XENT_MEAN_BLOCKS;
        return Err(Error::shape(
            "cross_entropy_mean",
            format!("logits {:?} need {blocks} blocks, more than the kernel's {most}", l.shape),
        ));
    }
    let k = g.kernel(super::spec_key("cross_entropy_mean", &(s.dtype, tpr)), || super::codegen::cross_entropy_mean_source(s.dtype, tpr))?;
    let mut a = XArgs::new(rows, n, ignore, smoothing, 0);
    let (mut o, mut px, mut pt, mut pe) = (out.buf.ptr, logits.ptr(), targets.ptr(), g.err);
    let mut params = kernel_params![o, px, pt, pe, a];
    // SAFETY: (out, logits, targets, err, XArgs) matches the generated signature; logits are
    // dense [rows, n], targets dense [rows], `out` holds the loss and, from XENT_GRAD_AT,
    // rows x n values; `err` is the error word. `blocks` covers the rows (a thread or a warp
    // each) and fits the module's partial sums.
    unsafe { g.launch(k, (blocks as u32, 1), threads as u32, 0, &mut params)? };
    Ok(out)
}

/// Mirrors `struct LArgs` (`codegen::linear_xent_source`): h's, the weight's and the bias's
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

/// `Op::LinearCrossEntropyMean` in one launch (`codegen::linear_xent_source`): a cluster of
/// blocks on Hopper, one block before.
fn linear_cross_entropy_mean(
    g: &Arc<Gpu>,
    x: &[(&CudaStorage, &Layout)],
    ignore: Option<i64>,
    smoothing: f64,
    drelu: bool,
) -> Result<CudaStorage> {
    use super::codegen::{
        linear_xent_blocks, linear_xent_fits, linear_xent_smem_bytes, LINEAR_XENT_MAX_MACS, LINEAR_XENT_MAX_SMEM, LINEAR_XENT_THREADS,
    };
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
    let (dw, db, dh, len) = crate::op::linear_xent_parts(n, c, f);
    let out = CudaStorage::alloc(g, sh.dtype, len)?;
    let targets = dense(g, st, lt)?;
    let k = g.kernel_shared(super::spec_key("linear_xent", &(sh.dtype, cluster)), LINEAR_XENT_MAX_SMEM as u32, || {
        super::codegen::linear_xent_source(sh.dtype, cluster)
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
    // their shapes, the targets are dense [n], `out` holds `linear_xent_parts`' length, and
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

/// Mirrors `struct PArgs` (`codegen::PRODUCT_ARGS`): the narrow and few-rows products.
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
pub(super) fn matmul_small(
    g: &Arc<Gpu>,
    few: bool,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
    relu: bool,
    out: &CudaStorage,
) -> Result<()> {
    use super::codegen::{FEW_COLS, FEW_SPLIT, FEW_THREADS, NARROW_THREADS};
    let (m, n) = (la.shape[0], lb.shape[1]);
    // The kernel and its grid: a cluster of FEW_SPLIT blocks per FEW_COLS columns, each
    // block all of the m rows; or a warp per row of A, NARROW_THREADS / 32 rows a block.
    let (k_fn, grid, threads, cluster) = if few {
        let k_fn = g.kernel(super::spec_key("matmul_few", &()), super::codegen::matmul_few_source)?;
        (k_fn, (n.div_ceil(FEW_COLS) as u32, 1, FEW_SPLIT as u32), FEW_THREADS, Some(FEW_SPLIT as u32))
    } else {
        let k_fn = g.kernel(super::spec_key("matmul_narrow", &(out.dtype, n)), || super::codegen::matmul_narrow_source(out.dtype, n))?;
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

/// Mirrors `struct SArgs` (`codegen::matmul_short_source`).
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

/// `out [m, n] = a [m, k] b [k, n]` by the short-product kernels (`codegen::matmul_short_source`):
/// 2-D views of A (any strides) and B (rows contiguous); with `sums` at `Some(at)`, A's row
/// sums written from `out[at]` too (`MatmulEpilogue::SumLeft`). The caller checks
/// `m <= SHORT_MAX_M` and B's layout (`blas::own_product`).
pub(super) fn matmul_short(
    g: &Arc<Gpu>,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    sums: Option<usize>,
    out: &CudaStorage,
) -> Result<()> {
    use super::codegen::{SHORT_CHUNK, SHORT_THREADS};
    let (m, k, n) = (la.shape[0], la.shape[1], lb.shape[1]);
    let [part_k, fold_k] = g.kernel_set(super::spec_key("matmul_short", &(out.dtype, m, sums.is_some())), || {
        let (src, name) = super::codegen::matmul_short_source(out.dtype, m, sums.is_some());
        (src, name.clone(), [format!("{name}_part"), format!("{name}_fold")])
    })?;
    let (chunks, ldp) = (k.div_ceil(SHORT_CHUNK), n + sums.is_some() as usize);
    let part = CudaStorage::alloc(g, out.dtype, chunks * m * ldp)?;
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

/// Mirrors `struct TArgs` (`codegen::matmul_thin_source`).
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
pub(super) fn matmul_thin(
    g: &Arc<Gpu>,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    drelu: Option<(&CudaStorage, &Layout)>,
    sums_at: Option<usize>,
    out: &CudaStorage,
) -> Result<()> {
    let (m, k, n) = (la.shape[0], la.shape[1], lb.shape[1]);
    // Four neighbours a thread where B's rows and h are aligned vectors along memory.
    let rows4 = |l: &Layout| l.strides[1] == 1 && l.strides[0] % 4 == 0 && l.offset % 4 == 0;
    let vec4 = n % 4 == 0 && rows4(lb) && drelu.is_none_or(|(_, l)| rows4(l));
    let (dr, sums) = (drelu.is_some(), sums_at.is_some());
    let key = super::spec_key("matmul_thin", &(out.dtype, k, dr, vec4, sums));
    let kf = g.kernel(key, || super::codegen::matmul_thin_source(out.dtype, k, dr, vec4, sums))?;
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

/// The index kernels in error-code order (code = position + 1; 0 means no error).
const INDEX_OPS: [(IndexKind, &str); 4] = [
    (IndexKind::Select, "index_select"),
    (IndexKind::Add, "index_add"),
    (IndexKind::Gather, "gather"),
    (IndexKind::ScatterAdd, "scatter_add"),
];

/// The error code of a cross-entropy target out of range (after the index kernels' codes).
const XENT_CODE: i64 = INDEX_OPS.len() as i64 + 1;

/// The op an error code in the device error word stands for.
pub fn index_op_name(code: i64) -> &'static str {
    if code == XENT_CODE {
        return "cross_entropy (a target class)";
    }
    INDEX_OPS.get((code - 1).max(0) as usize).map_or("an index kernel", |(_, name)| name)
}

fn index_code(kind: IndexKind) -> i64 {
    INDEX_OPS.iter().position(|(k, _)| *k == kind).map_or(0, |p| p as i64 + 1)
}

/// Launches an index kernel: `o` written from `src` at `idx` (all dense).
fn launch_index(g: &Arc<Gpu>, kind: IndexKind, o: &CudaStorage, src: u64, idx: u64, mut a: IArgs) -> Result<()> {
    let rows = matches!(kind, IndexKind::Select | IndexKind::Add)
        && super::codegen::select_by_rows((a.outer * a.nidx) as usize, a.inner as usize, g.sms as usize);
    if a.n == 0 {
        return Ok(());
    }
    if a.rank as usize > MAX_RANK {
        return Err(too_many_dims(&[]));
    }
    a.code = index_code(kind);
    let spec = Index { kind, dtype: o.dtype, rows };
    let k = g.kernel(super::spec_key("index", &spec), || spec.source())?;
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
fn index_read(
    g: &Arc<Gpu>,
    kind: IndexKind,
    (s, l): (&CudaStorage, &Layout),
    (si, li): (&CudaStorage, &Layout),
    dim: usize,
    meta: &OutMeta,
) -> Result<CudaStorage> {
    let (src, idx) = (dense(g, s, l)?, dense(g, si, li)?);
    let out = CudaStorage::alloc(g, meta.dtype, meta.shape.iter().product())?;
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
fn index_add(
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
fn cat(g: &Arc<Gpu>, x: &[(&CudaStorage, &Layout)], dim: usize, meta: &OutMeta) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(g, meta.dtype, meta.shape.iter().product())?;
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

/// Mirrors `struct AdamArgs`.
#[repr(C)]
#[derive(Default)]
struct AdamArgs {
    n: [i64; ADAM_MAX_TENSORS],
    p: [u64; ADAM_MAX_TENSORS],
    g: [u64; ADAM_MAX_TENSORS],
    m: [u64; ADAM_MAX_TENSORS],
    v: [u64; ADAM_MAX_TENSORS],
    x: [u64; ADAM_MAX_TENSORS],
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
    decoupled: i32,
    pad: i32,
}

/// The device address of a tensor's first element (its storage must be on a GPU).
fn address(s: &Storage, t: &crate::Tensor) -> Result<u64> {
    match s {
        Storage::Cuda(c) => Ok(c.ptr_at(t.layout().offset)),
        Storage::Cpu(_) => Err(Error::Msg("expected a CUDA tensor".into())),
    }
}

/// The fused Adam update of every parameter in `items` (checked by the caller: contiguous,
/// one dtype, shape and GPU per parameter), in launches of up to `ADAM_MAX_TENSORS`
/// parameters of one dtype and AMSGrad setting whose storages are all distinct (each launch
/// holds every buffer's lock).
pub fn adam_step(
    items: &[&crate::fused::AdamTensors<'_>],
    lr: &crate::Tensor,
    step: &crate::Tensor,
    h: crate::fused::AdamHyper,
) -> Result<()> {
    let mut batch: Vec<&crate::fused::AdamTensors<'_>> = Vec::new();
    for &it in items {
        let fits = batch.first().is_none_or(|b| b.p.dtype() == it.p.dtype() && b.vmax.is_some() == it.vmax.is_some())
            && batch.len() < ADAM_MAX_TENSORS
            && batch.iter().all(|b| b.tensors().all(|x| it.tensors().all(|y| !x.same_storage(y))));
        if !fits {
            adam_launch(&batch, lr, step, h)?;
            batch.clear();
        }
        batch.push(it);
    }
    adam_launch(&batch, lr, step, h)
}

/// One launch over `batch` (distinct storages, one dtype and AMSGrad setting).
fn adam_launch(
    batch: &[&crate::fused::AdamTensors<'_>],
    lr: &crate::Tensor,
    step: &crate::Tensor,
    h: crate::fused::AdamHyper,
) -> Result<()> {
    let Some(first) = batch.first() else { return Ok(()) };
    let mut a = AdamArgs { b1: h.beta1, b2: h.beta2, eps: h.eps, wd: h.weight_decay, decoupled: h.decoupled as i32, ..AdamArgs::default() };
    // Every buffer stays locked until the launch is queued.
    let mut writes = Vec::new();
    let mut reads = Vec::new();
    for (j, it) in batch.iter().enumerate() {
        let (ps, ms, vs) = (it.p.storage().write(), it.m.storage().write(), it.v.storage().write());
        let gs = it.g.storage().read();
        (a.n[j], a.p[j], a.g[j]) = (it.p.numel() as i64, address(&ps, it.p)?, address(&gs, it.g)?);
        (a.m[j], a.v[j]) = (address(&ms, it.m)?, address(&vs, it.v)?);
        if let Some(x) = it.vmax {
            let xs = x.storage().write();
            a.x[j] = address(&xs, x)?;
            writes.push(xs);
        }
        writes.extend([ps, ms, vs]);
        reads.push(gs);
    }
    let (ls, ss) = (lr.storage().read(), step.storage().read());
    let (mut pl, mut pst) = (address(&ls, lr)?, address(&ss, step)?);
    let Storage::Cuda(pc) = &*writes[0] else { return Err(Error::Msg("adam_step: expected CUDA tensors".into())) };
    let gpu = super::gpu::gpu(pc.gpu().ordinal)?;
    let most = a.n[..batch.len()].iter().copied().max().unwrap_or(0) as usize;
    if most == 0 {
        return Ok(());
    }
    let (dtype, ams) = (first.p.dtype(), first.vmax.is_some());
    let k = gpu.kernel(super::spec_key("adam", &(dtype, ams)), || super::codegen::adam_source(dtype, ams))?;
    let mut params = kernel_params![pl, pst, a];
    // SAFETY: (lr, step, AdamArgs) as the generated signature; block row j updates parameter j,
    // its `n` elements from its address in p, g, m, v (and x) on this GPU, locked until queued;
    // threads past a parameter's length do nothing.
    unsafe { gpu.launch(k, (gpu.grid_for(most), batch.len() as u32), 256, 0, &mut params) }
}

/// Products run by `matmul_wgmma` in this process (`cuda::wgmma_launches`).
pub(super) static WGMMA_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
pub(super) fn matmul_wgmma(
    g: &Arc<Gpu>,
    spec: super::wgmma::Spec,
    (sa, la, a_rows): (&CudaStorage, &Layout, Option<(usize, usize)>),
    (sb, lb): (&CudaStorage, &Layout),
    (bias, aux, residual): (Option<u64>, Option<(u64, usize)>, Option<u64>),
    out: &CudaStorage,
) -> Result<()> {
    use super::wgmma::{BM, BN, THREADS};
    let spec = super::wgmma::Spec { map_a: a_rows.is_some(), ..spec };
    WGMMA_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (m, k, n) = (la.shape[0], la.shape[1], lb.shape[1]);
    let shared = spec.shared_bytes() as u32;
    let gemm = g.kernel_shared(super::spec_key("matmul_wgmma", &spec), shared, || spec.source())?;
    let (pa, pb, pc) = (sa.ptr_at(la.offset), sb.ptr_at(lb.offset), out.buf.ptr);
    let (pbias, paux, pres) = (bias.unwrap_or(0), aux.map_or(0, |(p, _)| p), residual.unwrap_or(0));
    // The product with its contraction in `parts` parts (`wgmma::split_into`).
    let run = |parts: usize| -> Result<()> {
        let (splits, depth) = super::wgmma::split_into(k, parts);
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
    let default = super::wgmma::splits(m, n, k, sms).0;
    let candidates = || super::wgmma::split_candidates(m, n, k, sms);
    let problem = (spec, m, n, k, a_rows);
    let parts = super::tune::choice(g, ("matmul_wgmma", &problem), default, candidates, |p| super::tune::time_graph(g, || run(p)));
    run(parts)
}

/// argsort of the rows of the last dim: a bitonic sort of (key, position) pairs over each row
/// padded to a power of two `p` in scratch buffers, one launch per merge step (the kernel's
/// phases: 0 fills the scratch, 1 is a compare-exchange step, 2 writes the first `n`
/// positions of each row). Ties are ordered by position, so the result is the stable order.
fn argsort(g: &Arc<Gpu>, (s, l): (&CudaStorage, &Layout), descending: bool) -> Result<CudaStorage> {
    let n = l.shape[l.rank() - 1];
    let rows = l.numel().checked_div(n).unwrap_or(0);
    let out = CudaStorage::alloc(g, DType::I64, rows * n)?;
    if rows == 0 {
        return Ok(out);
    }
    let p = n.next_power_of_two();
    let key_dtype = super::codegen::sort_key_dtype(s.dtype);
    let src = dense(g, s, l)?;
    let (keys, pos) = (CudaStorage::alloc(g, key_dtype, rows * p)?, CudaStorage::alloc(g, DType::I64, rows * p)?);
    let k = g.kernel(super::spec_key("argsort", &(s.dtype, descending)), || super::codegen::argsort_source(s.dtype, descending))?;
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
