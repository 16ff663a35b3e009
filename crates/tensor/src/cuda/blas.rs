//! Matmul through cuBLASLt plans (`lt.rs`), else plain cuBLAS: batched, strided operands read
//! in place (a transposed view is a transpose flag, not a copy), F32 in full FP32 unless TF32
//! is switched on (as in PyTorch), F16/BF16 on tensor cores with F32 accumulation.

use super::gpu::Gpu;
use super::kernels::elementwise::dense_copy;
use super::kernels::prelude::CudaStorage;
use super::lt::{alignment, Epilogue, Gemm, Plan, Ptrs};
use crate::op::OutMeta;
use crate::op::{InMeta, MatmulEpilogue};
use crate::shape::Layout;
use crate::{DType, Error, Result};
use cudarc::cublas::{result as br, sys as bs};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// cuBLAS and cuBLASLt handles bound to the GPU's stream, with one workspace (so that neither
/// allocates while a CUDA graph is being captured; calls on one stream never overlap), and
/// the cuBLASLt plans made so far.
pub struct Blas {
    h: bs::cublasHandle_t,
    /// None when libcublasLt is missing: plain cuBLAS runs every GEMM.
    lt: Option<cudarc::cublaslt::sys::cublasLtHandle_t>,
    ws: super::gpu::DeviceBuffer,
    /// A plan per problem; None where cuBLASLt had none (plain cuBLAS runs it).
    plans: std::collections::HashMap<Gemm, Option<Plan>>,
}

impl Blas {
    /// The GPU's cuBLAS handle (on its stream, with its own workspace) and cuBLASLt's.
    fn new(g: &Arc<Gpu>) -> Result<Blas> {
        let started = std::time::Instant::now();
        if !super::library::held_open(&cudarc::get_lib_name_candidates("cublas")) {
            return Err(Error::Cuda("cuBLAS (libcublas.so) not found; it runs Kiln's CUDA matmuls".into()));
        }
        g.bind()?;
        let h = br::create_handle().map_err(blas_err)?;
        // SAFETY: a fresh handle and this GPU's live stream.
        unsafe { br::set_stream(h, g.stream.cu_stream() as _) }.map_err(blas_err)?;
        let ws = g.alloc(WORKSPACE)?;
        // SAFETY: `ws` is a live buffer of WORKSPACE bytes owned by the handle's `Blas`.
        unsafe { bs::cublasSetWorkspace_v2(h, ws.ptr as *mut c_void, WORKSPACE) }.result().map_err(blas_err)?;
        // (On a thread of its own beside cuBLAS's handle it is no faster: the two
        // libraries load one after the other.)
        let lt = start_lt(g, started);
        Ok(Blas { h, lt, ws, plans: Default::default() })
    }
}

/// cuBLASLt's handle; None when libcublasLt is missing or fails to start (plain cuBLAS then
/// runs every GEMM). Its own slow first-use set-up comes with the
/// first plan: `plan_ahead`'s, beside the rest of a step's first call.
fn start_lt(g: &Arc<Gpu>, started: std::time::Instant) -> Option<cudarc::cublaslt::sys::cublasLtHandle_t> {
    if !super::library::held_open(&cudarc::get_lib_name_candidates("cublasLt")) || g.bind().is_err() {
        return None;
    }
    let lt = cudarc::cublaslt::result::create_handle().ok()?;
    if crate::log::enabled("time") {
        eprintln!("[kiln time] cuBLAS started in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    }
    Some(lt)
}

/// cuBLAS on one GPU: its handles once started, the thread starting them (`start_on_thread`)
/// until `wait_started` joins it, and the cuBLASLt problems a dry run met before they had
/// started, for that thread to plan.
#[derive(Default)]
struct OnGpu {
    blas: Mutex<Option<Blas>>,
    starting: Mutex<Option<std::thread::JoinHandle<()>>>,
    noted: Mutex<Vec<Gemm>>,
}

/// The cuBLAS state of `g` (made on first use, kept for the process, as the GPU is).
/// (A thread-local note of the last one first: every product asks.)
fn on(g: &Gpu) -> &'static OnGpu {
    static ALL: OnceLock<Mutex<HashMap<usize, &'static OnGpu>>> = OnceLock::new();
    thread_local! {
        static LAST: std::cell::Cell<Option<(usize, &'static OnGpu)>> = const { std::cell::Cell::new(None) };
    }
    if let Some((ordinal, state)) = LAST.with(|l| l.get()) {
        if ordinal == g.ordinal {
            return state;
        }
    }
    let state: &'static OnGpu = lock(ALL.get_or_init(Default::default)).entry(g.ordinal).or_insert_with(|| Box::leak(Box::default()));
    LAST.with(|l| l.set(Some((g.ordinal, state))));
    state
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts cuBLAS and cuBLASLt on `g` (loading the libraries and making the handles is a long
/// set-up) on a thread, unless they have started or are starting: a dry run calls it at its
/// first product that needs cuBLAS, so that the start overlaps the rest of the dry run and
/// NVRTC. Its error, if any, comes back at the first product of the real run.
pub(crate) fn start_on_thread(g: &Arc<Gpu>) {
    let state = on(g);
    let mut slot = lock(&state.starting);
    if slot.is_some() || state.blas.try_lock().is_ok_and(|b| b.is_some()) {
        return;
    }
    let g = g.clone();
    *slot = Some(std::thread::spawn(move || {
        let mut guard = lock(&on(&g).blas);
        if let Ok(blas) = get(&mut guard, &g) {
            plan_ahead(&g, blas);
        }
    }));
}

/// Waits for `start_on_thread`'s thread, if one runs, then plans the problems noted after
/// that thread took its list (if cuBLAS has started).
pub(crate) fn wait_started(g: &Arc<Gpu>) {
    let state = on(g);
    let handle = lock(&state.starting).take();
    if let Some(h) = handle {
        let _ = h.join();
    }
    if let Some(blas) = lock(&state.blas).as_mut() {
        plan_ahead(g, blas);
    }
}

/// Notes a cuBLASLt problem for the thread starting cuBLAS to plan (`plan_ahead`).
fn note(g: &Gpu, gemm: Gemm) {
    let mut list = lock(&on(g).noted);
    if !list.contains(&gemm) {
        list.push(gemm);
    }
}

/// Plans the cuBLASLt problems a dry run noted (`note`) on the thread that
/// started cuBLAS, beside the step's NVRTC programs loading. Made in the first real run, a GPT
/// BF16 step's 15 plans would take a large part of it (the library's set-up with the first,
/// then a few milliseconds each, disk-cached algorithms or not); made here, they shorten the
/// warm-cache first call (BENCHMARKS.md). The heuristic's choice only: tuning times real
/// operands, and `MaxAutotune`'s run re-plans what was not tuned.
fn plan_ahead(g: &Arc<Gpu>, blas: &mut Blas) {
    let (problems, start) = (std::mem::take(&mut *lock(&on(g).noted)), std::time::Instant::now());
    let Some(lt) = blas.lt else { return };
    let mut made = 0;
    for gemm in problems {
        if let Entry::Vacant(v) = blas.plans.entry(gemm) {
            // (Autotuning is per thread and off on this one: the pointers are not read.)
            let plan = Plan::new(lt, g, v.key(), [0; 6], (blas.ws.ptr, WORKSPACE));
            v.insert(plan_or_log(plan));
            made += 1;
        }
    }
    if made > 0 && crate::log::enabled("time") {
        eprintln!("[kiln time] {made} cuBLASLt plans made ahead in {:.1} ms", start.elapsed().as_secs_f64() * 1e3);
    }
}

/// The GPU's `Blas` in `slot`, made on first use.
fn get<'a>(slot: &'a mut Option<Blas>, g: &Arc<Gpu>) -> Result<&'a mut Blas> {
    if slot.is_none() {
        *slot = Some(Blas::new(g)?);
    }
    slot.as_mut().ok_or_else(|| Error::Cuda("no cuBLAS handle".into()))
}

/// cuBLAS's workspace: what PyTorch gives it on Hopper.
const WORKSPACE: usize = 32 << 20;
// SAFETY: the handle is only used under the GPU's `blas` mutex.
unsafe impl Send for Blas {}

static ALLOW_TF32: AtomicBool = AtomicBool::new(false);

/// Lets F32 matmuls use TF32 tensor cores (10-bit mantissa inputs, F32 accumulation), like
/// `torch.backends.cuda.matmul.allow_tf32 = True`. Off by default: full FP32.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, Ordering::Relaxed);
}

pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

fn blas_err(e: br::CublasError) -> Error {
    Error::Cuda(format!("cuBLAS: {e:?}"))
}

/// How cuBLAS (column-major) sees one row-major operand `[rows, cols]` with strides.
struct Operand {
    ptr: u64,
    /// Transpose flag for the column-major view of the row-major matrix.
    trans: bool,
    ld: i64,
    batch_stride: i64,
    _owned: Option<CudaStorage>,
}

/// The single stride of the (broadcast) batch dims, if one stride describes them.
fn batch_stride(shape: &[usize], strides: &[usize]) -> Option<i64> {
    let dims: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
    let Some(&inner) = dims.last() else { return Some(0) };
    for w in dims.windows(2) {
        if strides[w[0]] != strides[w[1]] * shape[w[1]] {
            return None;
        }
    }
    Some(strides[inner] as i64)
}

/// Reads `s` through `l` (already broadcast to the output's batch dims) as cuBLAS operands;
/// a layout cuBLAS cannot express is copied to a dense buffer first.
fn operand(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout) -> Result<Operand> {
    let r = l.rank();
    let (rows, cols) = (l.shape[r - 2], l.shape[r - 1]);
    let (rs, cs) = (l.strides[r - 2], l.strides[r - 1]);
    let ptr = s.ptr_at(l.offset);
    if let Some(bst) = batch_stride(&l.shape[..r - 2], &l.strides[..r - 2]) {
        // Row-major in memory: cuBLAS sees the transpose with no flag.
        if (cols == 1 || cs == 1) && (rows == 1 || rs >= cols.max(1)) {
            let ld = if rows == 1 { cols.max(1) } else { rs };
            return Ok(Operand { ptr, trans: false, ld: ld as i64, batch_stride: bst, _owned: None });
        }
        if (rows == 1 || rs == 1) && (cols == 1 || cs >= rows.max(1)) {
            let ld = if cols == 1 { rows.max(1) } else { cs };
            return Ok(Operand { ptr, trans: true, ld: ld as i64, batch_stride: bst, _owned: None });
        }
    }
    let bst = if r > 2 && l.shape[..r - 2].iter().product::<usize>() > 1 { (rows * cols) as i64 } else { 0 };
    // A transposed view (a key's `k^T` in attention) is copied as it lies, the transpose
    // left to cuBLAS: the copy then reads and writes along rows, four elements at a time.
    if rs == 1 && cs != 1 {
        let mut lt = l.clone();
        lt.shape.swap(r - 2, r - 1);
        lt.strides.swap(r - 2, r - 1);
        let owned = dense_copy(g, s, &lt)?;
        return Ok(Operand { ptr: owned.buf.ptr, trans: true, ld: rows.max(1) as i64, batch_stride: bst, _owned: Some(owned) });
    }
    let owned = dense_copy(g, s, l)?;
    let ptr = owned.buf.ptr;
    Ok(Operand { ptr, trans: false, ld: cols.max(1) as i64, batch_stride: bst, _owned: Some(owned) })
}

/// The plan, or None (plain cuBLAS) with the reason under `KILN_LOG=kernels`.
fn plan_or_log(plan: Result<Plan>) -> Option<Plan> {
    plan.map_err(|e| {
        if crate::log::enabled("kernels") {
            eprintln!("kiln: cuBLASLt has no plan ({e}); using cuBLAS");
        }
    })
    .ok()
}

fn data_type(d: DType) -> Result<(bs::cudaDataType, bs::cublasComputeType_t)> {
    use bs::cublasComputeType_t as C;
    use bs::cudaDataType as T;
    Ok(match d {
        DType::F32 if allow_tf32() => (T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F_FAST_TF32),
        DType::F32 => (T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F),
        DType::F64 => (T::CUDA_R_64F, C::CUBLAS_COMPUTE_64F),
        DType::F16 => (T::CUDA_R_16F, C::CUBLAS_COMPUTE_32F),
        DType::BF16 => (T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F),
        other => return Err(Error::dtype("matmul", format!("not defined for {other:?}"))),
    })
}

/// `out[..., m, n] = a[..., m, k] @ b[..., k, n] (+ bias[n])` with broadcast batch dims.
pub fn matmul(
    g: &Arc<Gpu>,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
    meta: &OutMeta,
) -> Result<CudaStorage> {
    matmul_fused(g, a, b, bias.as_slice(), None, meta)
}

/// What is left of a fused matmul after the GEMM: the bias, the ReLU, the operand's sums.
struct Rest<'a> {
    bias: Option<(&'a CudaStorage, &'a Layout)>,
    relu: bool,
    /// GELU (tanh form), its pre-activation kept from this offset on.
    gelu: Option<usize>,
    /// An activation's gradient (`MatmulEpilogue::activation_grad`) of the input that
    /// multiplies the product: GELU's of its pre-activation, or a ReLU's `step` of its output.
    dact: Option<(crate::UnaryOp, (&'a CudaStorage, &'a Layout))>,
    /// The operand, the dim summed and where the sums go in the output.
    sums: Option<((&'a CudaStorage, &'a Layout), usize, usize)>,
    /// A residual added last (`MatmulEpilogue::Residual`), the product's shape.
    residual: Option<(&'a CudaStorage, &'a Layout)>,
}

/// `Op::Matmul`, or with `epi` an `Fused::Matmul`: one cuBLASLt call (or Kiln kernel) with
/// the epilogue where it applies, else the plain product and the rest as kernels after it.
/// `more`: the op's inputs after a and b.
pub fn matmul_fused(
    g: &Arc<Gpu>,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    more: &[(&CudaStorage, &Layout)],
    epi: Option<MatmulEpilogue>,
    meta: &OutMeta,
) -> Result<CudaStorage> {
    // The product's shape (a fused sum's or GELU's output is flat: the product, then more).
    let shape: Vec<usize> = match epi {
        Some(MatmulEpilogue::SumLeft | MatmulEpilogue::SumRight | MatmulEpilogue::GeluTanh) => {
            let ins = [InMeta { shape: &la.shape, dtype: sa.dtype }, InMeta { shape: &lb.shape, dtype: sb.dtype }];
            crate::Op::Matmul.infer(&ins)?.shape
        }
        _ => meta.shape.clone(),
    };
    let r = shape.len();
    let (m, n, k) = (shape[r - 2], shape[r - 1], la.shape[la.rank() - 1]);
    let batch: usize = shape[..r - 2].iter().product();
    let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
    // The operands' dtype: the output's, or 16 bits under an F32 residual's sum (`Residual`).
    let dtype = sa.dtype;
    let tail = crate::op::Parts::with_tail(&shape, &[]).offset(crate::op::Part::Tail)?;
    // A `D*` epilogue's third input is the activation's, a residual's the residual (the bias
    // after it); else the third is the bias.
    let dact = epi.and_then(MatmulEpilogue::activation_grad);
    let (bias, dact, residual) = match (epi, dact) {
        (_, Some(u)) => (None, more.first().map(|&h| (u, h)), None),
        (Some(MatmulEpilogue::Residual), None) => (more.get(1).copied(), None, more.first().copied()),
        _ => (more.first().copied(), None, None),
    };
    let rest = Rest {
        bias,
        relu: epi == Some(MatmulEpilogue::Relu),
        gelu: (epi == Some(MatmulEpilogue::GeluTanh)).then_some(tail),
        dact,
        sums: match epi {
            Some(MatmulEpilogue::SumLeft) => Some(((sa, la), 1, tail)),
            Some(MatmulEpilogue::SumRight) => Some(((sb, lb), 0, tail)),
            _ => None,
        },
        residual,
    };
    if out.len == 0 {
        return Ok(out);
    }
    // No contraction (a zero product) or no product at all (only a fused op's sums or
    // pre-activation remain): no GEMM to run.
    if k == 0 || m * n * batch == 0 {
        g.zero(&out)?;
        return finish(g, out, rest, &shape);
    }
    // Broadcast both operands to the output's batch dims (stride 0 where they repeat).
    let expand = |l: &Layout, rows: usize, cols: usize| {
        let mut to = shape[..r - 2].to_vec();
        to.extend([rows, cols]);
        Layout { strides: l.broadcast_strides(&to), shape: to, offset: l.offset }
    };
    let (mut la, lb) = (expand(la, m, k), expand(lb, k, n));
    let (mut m, mut batch) = (m, batch);
    // A shared B (a Linear's weight) against a batch of A's rows is one GEMM with the batch
    // folded into M, as PyTorch does: far faster than a strided batch of small GEMMs.
    // When A's rows cannot be folded as they lie (a permuted view, e.g. a sequence-first
    // batch), Kiln's Hopper GEMM reads them through a row map (`a_rows`); else one dense
    // copy of A and one GEMM still beat `batch` GEMMs of a few rows.
    let mut dense_a: Option<CudaStorage> = None;
    let mut a_rows: Option<(usize, usize)> = None;
    let mut mapped: Option<OwnProduct> = None;
    if batch > 1 && lb.strides[..r - 2].iter().all(|&s| s == 0) {
        let folded = match la.reshaped(&[batch * m, k]) {
            Some(f) => f,
            None => match mapped_rows(g, dtype, (sa, &la), (sb, &lb), &rest) {
                Some(own) => {
                    a_rows = Some((m, la.strides[0]));
                    let a = own.a.clone();
                    mapped = Some(own);
                    a
                }
                None => {
                    dense_a = Some(dense_copy(g, sa, &la)?);
                    Layout::contiguous(&[batch * m, k])
                }
            },
        };
        (la, m, batch) = (folded, batch * m, 1);
    }
    let sa = dense_a.as_ref().unwrap_or(sa);
    // (Only the Hopper GEMM reads a row map: `mapped` is its product.)
    let own = mapped.or_else(|| own_product(g, dtype, batch, (sa, &la), (sb, &lb), &rest));
    if let Some(own) = own {
        run_own(g, own, (sa, a_rows), sb, &rest, (m, n, k), &out)?;
        return Ok(out);
    }
    run_blas(g, (sa, &la), (sb, &lb), (m, n, k, batch), meta, rest, out, &shape)
}

/// Kiln's kernel `own` makes all that is left of the fused op into `out` (A read through
/// `a_rows` where `mapped_rows` chose a row map).
fn run_own(
    g: &Arc<Gpu>,
    own: OwnProduct,
    (sa, a_rows): (&CudaStorage, Option<(usize, usize)>),
    sb: &CudaStorage,
    rest: &Rest,
    (m, n, k): (usize, usize, usize),
    out: &CudaStorage,
) -> Result<()> {
    let (a, b) = ((sa, &own.a), (sb, &own.b));
    match own.kind {
        Own::Hopper(spec, turn_b) => {
            // B turned: a dense copy of B^T read as B with K contiguous.
            let turned;
            let b = if turn_b {
                let l = b.1;
                let t = Layout { shape: vec![n, k], strides: vec![l.strides[1], l.strides[0]], offset: l.offset };
                turned = (dense_copy(g, sb, &t)?, Layout { shape: vec![k, n], strides: vec![1, k], offset: 0 });
                (&turned.0, &turned.1)
            } else {
                b
            };
            let bias = rest.bias.map(|(s, l)| s.ptr_at(l.offset));
            let aux = match (rest.gelu, rest.dact) {
                (Some(at), _) => Some((out.ptr_at(at), n)),
                (None, Some((_, (s, l)))) => aux_rows(l, m, n).map(|(at, ld)| (s.ptr_at(at), ld)),
                _ => None,
            };
            let residual = rest.residual.and_then(|(s, l)| aux_rows(l, m, n).map(|(at, _)| s.ptr_at(at)));
            super::kernels::products::matmul_wgmma(g, spec, (a.0, a.1, a_rows), b, (bias, aux, residual), out)?
        }
        Own::Thin => {
            let h = rest.dact.map(|(_, (s, l))| (s, view2(l, m, n)));
            super::kernels::products::matmul_thin(g, a, b, h.as_ref().map(|(s, l)| (*s, l)), rest.sums.map(|(_, _, at)| at), out)?
        }
        Own::Short => super::kernels::products::matmul_short(g, a, b, rest.sums.map(|(_, _, at)| at), out)?,
        Own::Narrow => super::kernels::products::matmul_small(g, false, a, b, rest.bias, rest.relu, out)?,
        Own::Few => super::kernels::products::matmul_small(g, true, a, b, rest.bias, rest.relu, out)?,
    }
    Ok(())
}

/// The product through cuBLASLt (a cached plan, the epilogue doing what it can of the fused
/// op) or plain cuBLAS, then the rest of the fused op (`finish`).
#[allow(clippy::too_many_arguments)]
fn run_blas(
    g: &Arc<Gpu>,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    (m, n, k, batch): (usize, usize, usize, usize),
    meta: &OutMeta,
    mut rest: Rest,
    out: CudaStorage,
    shape: &[usize],
) -> Result<CudaStorage> {
    let dtype = sa.dtype;
    let a = operand(g, sa, la)?;
    let b = operand(g, sb, lb)?;
    let b = if batch == 1 { Operand { batch_stride: 0, ..b } } else { b };
    // The operands' and the output's cuBLAS types (an unsupported dtype fails here, first).
    let types = (data_type(dtype)?, data_type(meta.dtype)?.0);
    let scalars = super::lt::one_and_zero(meta.dtype == DType::F64);
    let (epilogue, vector, aux) = lt_epilogue(&rest, batch, n, &out);
    // The residual as C (beta 1) where it is dense rows of the output's and aligned.
    let c = rest.residual.filter(|_| batch == 1).and_then(|(s, l)| match aux_rows(l, m, n) {
        // (Not D itself: `MaxAutotune` runs a plan many times, and D = A B + D would grow.)
        Some((at, ld)) if ld == n && alignment(s.ptr_at(at)) >= 16 && s.ptr_at(at) != out.buf.ptr => Some(s.ptr_at(at)),
        _ => None,
    });
    let vector_dtype = rest.bias.filter(|_| vector != 0).map(|(s, _)| s.dtype).filter(|&d| d != meta.dtype);
    // cuBLASLt's problem, when it can express the batch (it cannot repeat an operand with
    // batch stride 0).
    let gemm = (batch == 1 || (a.batch_stride != 0 && b.batch_stride != 0)).then(|| Gemm {
        dtype,
        out: meta.dtype,
        tf32: allow_tf32(),
        trans: (b.trans, a.trans),
        mnk: (n as u64, m as u64, k as u64),
        ld: (b.ld, a.ld, n as i64),
        batch: batch as i32,
        strides: (b.batch_stride, a.batch_stride, (m * n) as i64),
        align: (alignment(b.ptr), alignment(a.ptr), alignment(out.buf.ptr)),
        epilogue,
        vector_dtype,
        c: c.map(alignment),
    });
    // A dry run does not wait for cuBLAS to start: it starts it on another thread (once),
    // which then plans the problems the run noted (`plan_ahead`), asks for the kernels the
    // cuBLAS path could need and is done.
    let state = on(g);
    if super::gpu::is_dry() && !state.blas.try_lock().is_ok_and(|b| b.is_some()) {
        if let Some(gemm) = gemm {
            note(g, gemm);
        }
        start_on_thread(g);
        return finish(g, out, rest, shape);
    }
    let mut guard = lock(&state.blas);
    let blas = get(&mut guard, g)?;
    g.bind()?;
    let ptrs = [b.ptr, a.ptr, out.buf.ptr, vector, aux, c.unwrap_or(0)];
    if gemm.is_some_and(|gemm| blas.run_planned(g, gemm, ptrs)) {
        drop(guard);
        rest.done_by(epilogue);
        if c.is_some() {
            rest.residual = None;
        }
        return finish(g, out, rest, shape);
    }
    if !super::gpu::is_dry() {
        blas.gemm_strided((&a, &b), (m, n, k, batch), types, scalars, out.buf.ptr)?;
    }
    drop(guard);
    finish(g, out, rest, shape)
}

impl Blas {
    /// `gemm` through cuBLASLt with its cached plan (made the first time it is seen, made
    /// again under autotuning when it was the heuristic's): whether it ran. A problem
    /// cuBLASLt refuses is remembered as None and a plan whose kernel fails to launch is
    /// dropped; cuBLAS computes those.
    fn run_planned(&mut self, g: &Arc<Gpu>, gemm: Gemm, ptrs: Ptrs) -> bool {
        let Some(lt) = self.lt else { return false };
        let ws = (self.ws.ptr, WORKSPACE);
        let slot = match self.plans.entry(gemm) {
            Entry::Occupied(mut o) => {
                if super::tune::autotune() && o.get().as_ref().is_some_and(|p| !p.tuned) {
                    let plan = Plan::new(lt, g, o.key(), ptrs, ws);
                    o.insert(plan_or_log(plan));
                }
                o.into_mut()
            }
            Entry::Vacant(v) => {
                let plan = Plan::new(lt, g, v.key(), ptrs, ws);
                v.insert(plan_or_log(plan))
            }
        };
        match slot {
            Some(plan) if plan.run(lt, g, ptrs, ws).is_ok() => true,
            _ => {
                *slot = None;
                false
            }
        }
    }

    /// Row-major `out = a b` (batched by the operands' strides) through cuBLAS: as
    /// column-major `out^T = b^T a^T`, so B goes first.
    fn gemm_strided(
        &self,
        (a, b): (&Operand, &Operand),
        (m, n, k, batch): (usize, usize, usize, usize),
        ((dt, compute), dt_out): ((bs::cudaDataType, bs::cublasComputeType_t), bs::cudaDataType),
        (alpha, beta): (*const c_void, *const c_void),
        out: u64,
    ) -> Result<()> {
        let op = |t: bool| if t { bs::cublasOperation_t::CUBLAS_OP_T } else { bs::cublasOperation_t::CUBLAS_OP_N };
        // SAFETY: every pointer is a live device buffer of this GPU sized for the shapes given
        // (checked by the shape rule); alpha/beta are host scalars of the compute type.
        unsafe {
            br::gemm_strided_batched_ex(
                self.h,
                op(b.trans),
                op(a.trans),
                n as i32,
                m as i32,
                k as i32,
                alpha,
                b.ptr as *const c_void,
                dt,
                b.ld as i32,
                b.batch_stride,
                a.ptr as *const c_void,
                dt,
                a.ld as i32,
                a.batch_stride,
                beta,
                out as *mut c_void,
                dt_out,
                n as i32,
                (m * n) as i64,
                batch as i32,
                compute,
                bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }
}

/// Which of Kiln's own kernels takes a product: cuBLAS's FP32 is slower (`Hopper`), or its
/// tiles would leave most of the GPU idle (the rest).
enum Own {
    /// F32 on the tensor cores, three TF32 products a step (`wgmma.rs`), with the fused op's
    /// bias, activation or activation gradient; with `true`, B is copied transposed first.
    Hopper(super::kernels::wgmma::Spec, bool),
    /// A contraction of at most 32, with `DRelu`'s mask or `SumLeft`'s sums (`super::kernels::products::matmul_thin`).
    Thin,
    /// At most 16 rows over a long contraction, with `SumLeft`'s sums at most (`matmul_short`).
    Short,
    /// At most 16 columns, A's rows contiguous, with a bias and ReLU at most (`matmul_small`).
    Narrow,
    /// F32, at most 32 rows, with a bias and ReLU at most, on Hopper (`matmul_small`).
    Few,
}

/// An `Own` kernel for a product, with 2-D views of A and B.
struct OwnProduct {
    kind: Own,
    a: Layout,
    b: Layout,
}

/// The `Own` kernel that takes this product, if any: F32 or F64, one GEMM, and nothing left in
/// `rest` that the kernel cannot do.
fn own_product(
    g: &Gpu,
    dtype: DType,
    batch: usize,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    rest: &Rest,
) -> Option<OwnProduct> {
    use super::kernels::products::{FEW_COLS, FEW_MAX_M, NARROW_MAX_N, SHORT_CHUNK, SHORT_MAX_M, SHORT_MIN_K, THIN_MAX_K};
    if !matches!(dtype, DType::F32 | DType::F64) || batch != 1 {
        return None;
    }
    let (r, rb) = (la.rank(), lb.rank());
    let (m, k, n) = (la.shape[r - 2], la.shape[r - 1], lb.shape[rb - 1]);
    let (a, b) = (view2(la, m, k), view2(lb, k, n));
    if let Some((spec, turn_b)) = hopper_spec(g, dtype, (sa, &a), (sb, &b), rest) {
        return Some(OwnProduct { kind: Own::Hopper(spec, turn_b), a, b });
    }
    if rest.gelu.is_some() || rest.residual.is_some() {
        return None;
    }
    let b_rows = lb.strides[rb - 1] == 1 || n == 1;
    let (bias_relu, sums) = (rest.bias.is_some() || rest.relu, rest.sums.map(|(_, dim, _)| dim));
    // The thin kernel takes only `DRelu`'s mask (h as wide as the product).
    let mask = match rest.dact {
        None => Some(true),
        Some((u, (_, l))) => (u == crate::UnaryOp::Step && l.rank() >= 2 && l.shape[l.rank() - 2..] == [m, n]).then_some(false),
    };
    // (Its sums ride on each row's first column: a product of no columns leaves them to `finish`.)
    let kind =
        if mask.is_some() && !bias_relu && sums.is_none_or(|d| d == 1 && n > 0) && super::kernels::products::thin_takes(dtype, k, b_rows) {
            Own::Thin
        } else if mask == Some(true)
            && !bias_relu
            && sums.is_none_or(|d| d == 1)
            && (1..=SHORT_MAX_M).contains(&m)
            && k >= SHORT_MIN_K
            && k.div_ceil(SHORT_CHUNK) * m * (n + 1) <= SHORT_MAX_PARTIALS
            && b_rows
        {
            Own::Short
        } else if mask == Some(true)
            && sums.is_none()
            && (1..=NARROW_MAX_N).contains(&n)
            && (1..=NARROW_MAX_K).contains(&k)
            && (la.strides[r - 1] == 1 || k == 1)
        {
            Own::Narrow
        } else if mask == Some(true)
            && dtype == DType::F32
            && g.has_clusters()
            && sums.is_none()
            && (1..=FEW_MAX_M).contains(&m)
            && k > THIN_MAX_K
            && n.div_ceil(FEW_COLS) * m * k <= FEW_MAX_READS
        {
            Own::Few
        } else {
            return None;
        };
    Some(OwnProduct { kind, a, b })
}

/// A `[batch, m, k]` A whose batch does not fold into its rows (a sequence-first view read
/// batch-first), as Kiln's Hopper GEMM's product of the `[batch m, k]` view it reads through
/// its row map (`super::kernels::products::matmul_wgmma`'s `a_rows`: the rows' stride is the inner one), if
/// that GEMM takes it with A K-contiguous.
fn mapped_rows(
    g: &Gpu,
    dtype: DType,
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    rest: &Rest,
) -> Option<OwnProduct> {
    if la.rank() != 3 || la.strides[2] != 1 || la.strides[0] % 4 != 0 {
        return None;
    }
    let (b, m, k) = (la.shape[0], la.shape[1], la.shape[2]);
    let a = Layout { shape: vec![b * m, k], strides: vec![la.strides[1], 1], offset: la.offset };
    let b2 = view2(lb, k, lb.shape[lb.rank() - 1]);
    let (spec, turn_b) = hopper_spec(g, dtype, (sa, &a), (sb, &b2), rest)?;
    (!spec.ta).then_some(OwnProduct { kind: Own::Hopper(spec, turn_b), a, b: b2 })
}

/// An activation input or residual `[.., m, n]` as rows of `n` with unit stride: (offset, row
/// stride).
fn aux_rows(l: &Layout, m: usize, n: usize) -> Option<(usize, usize)> {
    let v = l.reshaped(&[m, n])?;
    (v.strides[1] == 1 || n == 1).then_some((v.offset, v.strides[0]))
}

/// Which F32 GEMM runs products on a Hopper GPU (`set_f32_gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F32Gemm {
    /// Kiln's (`wgmma.rs`) where it is faster than cuBLAS (BENCHMARKS.md): at least half a
    /// wave of blocks (tiles times the contraction's parts), and not `a^T b` with B's rows
    /// contiguous (there it is slower).
    Auto,
    /// Kiln's wherever its layout rules allow (for tests).
    Kiln,
    /// cuBLAS's always (as `KILN_F32_GEMM=cublas` asks).
    Cublas,
}

static F32_GEMM: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(u8::MAX);

/// Chooses the F32 GEMM for products on Hopper GPUs from now on.
pub fn set_f32_gemm(choice: F32Gemm) {
    F32_GEMM.store(choice as u8, Ordering::Relaxed);
}

/// The choice set by `set_f32_gemm`, else `KILN_F32_GEMM` (`kiln` or `cublas`, read once),
/// else `Auto`.
pub fn f32_gemm() -> F32Gemm {
    static FROM_ENV: std::sync::OnceLock<F32Gemm> = std::sync::OnceLock::new();
    match F32_GEMM.load(Ordering::Relaxed) {
        0 => F32Gemm::Auto,
        1 => F32Gemm::Kiln,
        2 => F32Gemm::Cublas,
        _ => *FROM_ENV.get_or_init(|| match std::env::var("KILN_F32_GEMM").as_deref() {
            Ok("kiln") => F32Gemm::Kiln,
            Ok("cublas") => F32Gemm::Cublas,
            _ => F32Gemm::Auto,
        }),
    }
}

/// The `wgmma` GEMM's variant for a product (2-D views `a`, `b`), if it takes it: F32 in full
/// FP32 (with TF32 allowed, cuBLAS's TF32 is faster), an `sm_90` GPU, each operand with a unit
/// stride, its other stride and contiguous extent multiples of 4 and its start 16-byte
/// aligned (16-byte loads), `n` even (8-byte stores), and an epilogue it can do. With `true`,
/// B is to be copied transposed first.
fn hopper_spec(
    g: &Gpu,
    dtype: DType,
    (sa, a): (&CudaStorage, &Layout),
    (sb, b): (&CudaStorage, &Layout),
    rest: &Rest,
) -> Option<(super::kernels::wgmma::Spec, bool)> {
    if dtype != DType::F32 || g.arch != (9, 0) || allow_tf32() {
        return None;
    }
    let choice = f32_gemm();
    if choice == F32Gemm::Cublas {
        return None;
    }
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    if m.max(n).max(k) >= i32::MAX as usize || n % 2 != 0 || rest.sums.is_some() {
        return None;
    }
    // Whether a 2-D view `[rows, cols]` is read transposed (along its unit stride), if the
    // kernel can read it at all.
    let unit = |s: &CudaStorage, l: &Layout| -> Option<bool> {
        let (rows, cols) = (l.shape[0], l.shape[1]);
        let trans = if l.strides[1] == 1 && cols % 4 == 0 {
            false
        } else if l.strides[0] == 1 && rows % 4 == 0 {
            true
        } else {
            return None;
        };
        let ld = l.strides[if trans { 1 } else { 0 }];
        (ld.is_multiple_of(4) && ld >= if trans { rows } else { cols } && s.ptr_at(l.offset).is_multiple_of(16)).then_some(trans)
    };
    let (ta, tb) = (unit(sa, a)?, unit(sb, b)?);
    // B with its rows contiguous (`g @ w`, a Linear's input gradient) is turned first where
    // it is small beside the product: the kernel reads K-contiguous operands faster.
    let turn_b = !tb && k % 4 == 0 && m >= TURN_B_MIN_M;
    let tb = tb || turn_b;
    let bias = match rest.bias {
        Some((_, l)) if l.strides.last() != Some(&1) && n > 1 => return None,
        b => b.is_some(),
    };
    let dact = match rest.dact {
        Some((_, (_, l))) if aux_rows(l, m, n).is_none() => return None,
        d => d.map(|(u, _)| u),
    };
    let act = match (rest.relu, rest.gelu) {
        (true, _) => Some(crate::UnaryOp::Relu),
        (false, Some(_)) => Some(crate::UnaryOp::GeluTanh),
        _ => None,
    };
    // The residual as dense rows of the output's.
    let residual = match rest.residual {
        Some((_, l)) if aux_rows(l, m, n).is_none_or(|(_, ld)| ld != n) => return None,
        r => r.is_some(),
    };
    let spec = super::kernels::wgmma::Spec { ta, tb, bias, keep: rest.gelu.is_some(), act, dact, residual, map_a: false };
    // Blocks: tiles times the contraction's parts.
    let blocks = m.div_ceil(super::kernels::wgmma::BM)
        * n.div_ceil(super::kernels::wgmma::BN)
        * super::kernels::wgmma::splits(m, n, k, g.sms as usize).0;
    let fast = 2 * blocks >= g.sms as usize && (tb || !ta);
    (choice == F32Gemm::Kiln || fast).then_some((spec, turn_b))
}

/// The fewest rows of A for which `hopper_spec` copies a row-major B transposed: the copy
/// moves `k n` values against the product's `m n k` multiply-adds.
const TURN_B_MIN_M: usize = 1024;

/// The most partial sums `Own::Short` lets its first kernel write (16 MiB of F32): past it, cuBLAS.
const SHORT_MAX_PARTIALS: usize = 1 << 22;

/// The longest contraction `Own::Narrow` takes (a warp walks it serially).
const NARROW_MAX_K: usize = 8192;

/// The most elements of A the few-rows kernel's clusters read in all (each cluster of 16
/// columns reads all of A, so a wide product reads A many times; cuBLAS's tiles share it better).
const FEW_MAX_READS: usize = 1 << 22;

/// The last two dims of a layout as a 2-D view `[rows, cols]`.
fn view2(l: &Layout, rows: usize, cols: usize) -> Layout {
    let r = l.rank();
    Layout { shape: vec![rows, cols], strides: vec![l.strides[r - 2], l.strides[r - 1]], offset: l.offset }
}

/// The cuBLASLt epilogue for `rest` and the addresses of its vector and aux matrix (0 if
/// none). Epilogues need one GEMM (a batch would need the vector's batch stride), a dense,
/// 16-byte aligned vector and aux matrix; the aux matrix's rows are the output's, `n` long.
fn lt_epilogue(rest: &Rest, batch: usize, n: usize, out: &CudaStorage) -> (Epilogue, u64, u64) {
    use cudarc::cublaslt::sys::cublasLtEpilogue_t as E;
    let aligned = |p: u64| (batch == 1 && alignment(p) >= 16).then_some(p);
    let dense = |v: Option<(&CudaStorage, &Layout)>| v.filter(|(_, l)| l.is_contiguous()).and_then(|(s, l)| aligned(s.ptr_at(l.offset)));
    let bias = dense(rest.bias);
    let dgelu = rest.dact.filter(|(u, _)| *u == crate::UnaryOp::GeluTanhGrad).map(|(_, h)| h);
    let (kind, vector, aux) = match (rest.bias, bias, rest.relu, rest.gelu, dgelu, rest.sums) {
        (Some(_), Some(p), true, ..) => (E::CUBLASLT_EPILOGUE_RELU_BIAS, p, 0),
        (Some(_), Some(p), _, Some(at), ..) => match aligned(out.ptr_at(at)) {
            Some(x) => (E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, p, x),
            None => return (Epilogue::NONE, 0, 0),
        },
        (Some(_), Some(p), false, None, ..) => (E::CUBLASLT_EPILOGUE_BIAS, p, 0),
        // A bias the epilogue cannot read must be added before the activation: nothing fused.
        (Some(_), None, ..) => return (Epilogue::NONE, 0, 0),
        (None, _, true, ..) if batch == 1 => (E::CUBLASLT_EPILOGUE_RELU, 0, 0),
        (None, _, _, Some(at), ..) => match aligned(out.ptr_at(at)) {
            Some(x) => (E::CUBLASLT_EPILOGUE_GELU_AUX, 0, x),
            None => return (Epilogue::NONE, 0, 0),
        },
        (None, _, _, _, Some(h), _) => match dense(Some(h)) {
            Some(x) => (E::CUBLASLT_EPILOGUE_DGELU, 0, x),
            None => return (Epilogue::NONE, 0, 0),
        },
        // cuBLASLt's A is Kiln's right operand (it computes the column-major transpose). Its
        // BGRAD epilogue is a kernel of its own, slower than `super::kernels::reduce::column_sums`, which
        // `finish` runs where it fits.
        (None, _, _, _, _, Some(((_, l), dim, _))) if super::kernels::reduce::column_sums_fit(l, dim) => return (Epilogue::NONE, 0, 0),
        (None, _, _, _, _, Some((_, dim, at))) => match aligned(out.ptr_at(at)) {
            Some(p) => (if dim == 1 { E::CUBLASLT_EPILOGUE_BGRADB } else { E::CUBLASLT_EPILOGUE_BGRADA }, p, 0),
            None => return (Epilogue::NONE, 0, 0),
        },
        _ => return (Epilogue::NONE, 0, 0),
    };
    let epilogue = Epilogue {
        kind: kind as u32,
        vector: (vector != 0).then(|| alignment(vector)),
        aux: (aux != 0).then(|| (alignment(aux), n as i64)),
    };
    (epilogue, vector, aux)
}

impl Rest<'_> {
    /// Drops what `epilogue` did.
    fn done_by(&mut self, epilogue: Epilogue) {
        if epilogue != Epilogue::NONE {
            *self = Rest { bias: None, relu: false, gelu: None, dact: None, sums: None, residual: self.residual };
        }
    }
}

/// `out` with what no epilogue did: the bias added to its rows, the ReLU, the sums written
/// after the product.
fn finish(g: &Arc<Gpu>, out: CudaStorage, rest: Rest, shape: &[usize]) -> Result<CudaStorage> {
    if let Some(b) = rest.bias {
        super::kernels::elementwise::add_into(g, &out, shape, b)?;
    }
    if rest.relu {
        super::kernels::elementwise::unary_in_place(g, &out, shape, crate::UnaryOp::Relu)?;
    }
    let bytes = shape.iter().product::<usize>() * out.dtype.size_in_bytes();
    if let Some(at) = rest.gelu {
        // SAFETY: `out` holds the product and, from `at`, room for a copy of it (the shape
        // rule); the stream runs the copy before the GELU below overwrites the product.
        unsafe { g.copy_d2d(out.ptr_at(at), out.buf.ptr, bytes)? };
        super::kernels::elementwise::unary_in_place(g, &out, shape, crate::UnaryOp::GeluTanh)?;
    }
    if let Some((u, h)) = rest.dact {
        super::kernels::elementwise::mul_by_unary(g, &out, shape, u, h)?;
    }
    if let Some(r) = rest.residual {
        super::kernels::elementwise::add_into(g, &out, shape, r)?;
    }
    match rest.sums {
        Some(((s, l), dim, at)) if super::kernels::reduce::column_sums_fit(l, dim) => {
            super::kernels::reduce::column_sums(g, (s, l), dim, &out, at)?
        }
        Some(((s, l), dim, at)) => {
            let len = l.shape[1 - dim];
            let sums = super::kernels::reduce::sum_dim(g, s, l, dim)?;
            // SAFETY: `out` holds `at + len` elements (the shape rule) and `sums` `len`, both live
            // until the stream has run the copy (the caller keeps `out`; freed buffers are reused
            // only in stream order).
            unsafe { g.copy_d2d(out.ptr_at(at), sums.buf.ptr, len * out.dtype.size_in_bytes())? };
        }
        None => {}
    }
    Ok(out)
}
