//! cuBLASLt plans for `blas::matmul`: each GEMM problem (dtype, transposes, sizes, strides,
//! pointer alignment) gets its descriptors and algorithm once, then every call reuses them
//! (cudarc's safe cuBLASLt API rebuilds them per call, which costs host time).
//!
//! The algorithm is cuBLASLt's first heuristic choice, or, while autotuning is on
//! (`Mode::MaxAutotune`'s first run), the fastest of its top candidates timed on the real
//! operands; both kinds of choice are kept on disk (`cache_dir("cublaslt")`) per GPU and
//! library, so that a later process neither queries nor times them again.

use super::gpu::Gpu;
use crate::{DType, Error, Result};
use cudarc::cublaslt::{result as lr, sys as ls};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A column-major GEMM `D[m, n] = op(A)[m, k] op(B)[k, n]`, batched with strides.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// The operands' dtype.
    pub dtype: DType,
    /// D's (and C's) dtype: the operands', or F32 for 16-bit operands summed into an F32 C.
    pub out: DType,
    pub tf32: bool,
    pub trans: (bool, bool),
    pub mnk: (u64, u64, u64),
    /// Leading dimensions of A, B and D.
    pub ld: (i64, i64, i64),
    pub batch: i32,
    /// Batch strides of A, B and D (elements).
    pub strides: (i64, i64, i64),
    /// Alignment in bytes (at most 256) of the A, B and D pointers: algorithms assume it.
    pub align: (u32, u32, u32),
    /// The epilogue (`cublasLtEpilogue_t`; `Epilogue::NONE` for none).
    pub epilogue: Epilogue,
    /// The epilogue vector's dtype where it is not D's (a 16-bit bias of an F32 D).
    pub vector_dtype: Option<DType>,
    /// `D = A B + C` with C a matrix of D's layout (a residual), and C's pointer alignment.
    pub c: Option<u32>,
}

/// A cuBLASLt epilogue and the alignment of its vector: the bias it adds (one value per
/// column-major row of D, the row-major output's last dim), or the bias gradient it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Epilogue {
    pub kind: u32,
    pub vector: Option<u32>,
    /// The aux matrix GELU's epilogues write (the pre-activation) or read: its pointer's
    /// alignment and leading dimension.
    pub aux: Option<(u32, i64)>,
}

impl Epilogue {
    pub const NONE: Epilogue = Epilogue { kind: ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT as u32, vector: None, aux: None };
}

/// A GEMM's device pointers: A, B, D, the epilogue's vector and aux matrix, C (0 if none).
pub type Ptrs = [u64; 6];

/// Descriptors and the chosen algorithm of one `Gemm`.
pub struct Plan {
    desc: ls::cublasLtMatmulDesc_t,
    layouts: [ls::cublasLtMatrixLayout_t; 3],
    algo: ls::cublasLtMatmulAlgo_t,
    /// F64 GEMMs take F64 alpha and beta.
    f64: bool,
    /// The epilogue reads or writes a vector (its pointer is set per call).
    vector: bool,
    /// The epilogue reads or writes an aux matrix (its pointer is set per call).
    aux: bool,
    /// C is a matrix of its own (`Gemm::c`), added with beta 1.
    c: bool,
    /// Whether the algorithm was timed (here or in an earlier process), not just the heuristic's.
    pub tuned: bool,
    /// Whether `run` has launched it (its first launch's host time is counted).
    launched: Cell<bool>,
}

// SAFETY: the descriptors are plain host objects, used only under the GPU's `blas` mutex.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Plan::new` and not used after this.
        unsafe {
            let _ = lr::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lr::destroy_matrix_layout(l);
            }
        }
    }
}

static TUNED: AtomicU64 = AtomicU64::new(0);
static TUNE_NANOS: AtomicU64 = AtomicU64::new(0);
static PLANS: AtomicU64 = AtomicU64::new(0);
static PLAN_NANOS: AtomicU64 = AtomicU64::new(0);
static FIRST_LAUNCH_NANOS: AtomicU64 = AtomicU64::new(0);

/// Shapes tuned so far in this process, and the time spent timing them.
pub fn tuning_stats() -> (u64, std::time::Duration) {
    (TUNED.load(Ordering::Relaxed), std::time::Duration::from_nanos(TUNE_NANOS.load(Ordering::Relaxed)))
}

/// Plans made so far in this process (on any thread), the host time making them took, and the
/// host time of each plan's first launch (`KILN_LOG=time` reports them for a first run).
pub fn planning_stats() -> (u64, std::time::Duration, std::time::Duration) {
    let d = |a: &AtomicU64| std::time::Duration::from_nanos(a.load(Ordering::Relaxed));
    (PLANS.load(Ordering::Relaxed), d(&PLAN_NANOS), d(&FIRST_LAUNCH_NANOS))
}

/// Adds the time since `start` to `counter`.
fn count_since(counter: &AtomicU64, start: Instant) {
    counter.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

fn lt_err(what: &'static str) -> impl Fn(cudarc::cublaslt::result::CublasError) -> Error {
    move |e| Error::Cuda(format!("cuBLASLt {what}: {e:?}"))
}

/// Largest power of two (at most 256) dividing the address.
pub fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

fn cuda_type(d: DType) -> Result<(ls::cudaDataType, ls::cublasComputeType_t, ls::cudaDataType)> {
    use ls::cublasComputeType_t as C;
    use ls::cudaDataType as T;
    Ok(match d {
        DType::F32 => (T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        DType::F64 => (T::CUDA_R_64F, C::CUBLAS_COMPUTE_64F, T::CUDA_R_64F),
        DType::F16 => (T::CUDA_R_16F, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        DType::BF16 => (T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        other => return Err(Error::dtype("matmul", format!("not defined for {other:?}"))),
    })
}

fn layout(t: ls::cudaDataType, rows: u64, cols: u64, ld: i64, batch: i32, stride: i64) -> Result<ls::cublasLtMatrixLayout_t> {
    let l = lr::create_matrix_layout(t, rows, cols, ld).map_err(lt_err("layout"))?;
    if batch > 1 {
        use ls::cublasLtMatrixLayoutAttribute_t as A;
        // SAFETY: `l` is live; each buffer is the attribute's documented type.
        unsafe {
            lr::set_matrix_layout_attribute(l, A::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch as *const i32 as _, 4)
                .map_err(lt_err("batch"))?;
            lr::set_matrix_layout_attribute(l, A::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const i64 as _, 8)
                .map_err(lt_err("stride"))?;
        }
    }
    Ok(l)
}

/// cuBLASLt's top heuristic candidates `MaxAutotune` times per new problem.
const CANDIDATES: usize = 16;

impl Plan {
    /// Descriptors for `g` and its algorithm: heuristic, from the disk cache, or timed on
    /// `ptrs` (A, B, D, the epilogue's vector and aux matrix, C) when autotuning.
    pub(crate) fn new(lt: ls::cublasLtHandle_t, gpu: &Arc<Gpu>, g: &Gemm, ptrs: Ptrs, ws: (u64, usize)) -> Result<Plan> {
        let start = Instant::now();
        let plan = Plan::make(lt, gpu, g, ptrs, ws);
        PLANS.fetch_add(1, Ordering::Relaxed);
        count_since(&PLAN_NANOS, start);
        plan
    }

    fn make(lt: ls::cublasLtHandle_t, gpu: &Arc<Gpu>, g: &Gemm, ptrs: Ptrs, ws: (u64, usize)) -> Result<Plan> {
        let (t, mut compute, scale) = cuda_type(g.dtype)?;
        if g.tf32 && g.dtype == DType::F32 {
            compute = ls::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32;
        }
        let desc = lr::create_matmul_desc(compute, scale).map_err(lt_err("descriptor"))?;
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: ls::cublasLtMatmulAlgo_t { data: [0; 8] },
            f64: g.dtype == DType::F64,
            vector: g.epilogue.vector.is_some(),
            aux: g.epilogue.aux.is_some(),
            c: g.c.is_some(),
            tuned: false,
            launched: Cell::new(false),
        };
        // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |tr: bool| tr as i32;
        use ls::cublasLtMatmulDescAttributes_t as D;
        // SAFETY: `desc` is live; the buffers are cublasOperation_t values (i32).
        unsafe {
            let (ta, tb) = (op(g.trans.0), op(g.trans.1));
            lr::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const _ as _, 4).map_err(lt_err("transa"))?;
            lr::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const _ as _, 4).map_err(lt_err("transb"))?;
            if g.epilogue != Epilogue::NONE {
                let e = g.epilogue.kind;
                lr::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &e as *const u32 as _, 4)
                    .map_err(lt_err("epilogue"))?;
            }
            if let Some((_, ld)) = g.epilogue.aux {
                lr::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld as *const i64 as _, 8)
                    .map_err(lt_err("aux ld"))?;
            }
            if let Some(v) = g.vector_dtype {
                let vt = cuda_type(v)?.0 as i32;
                lr::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &vt as *const i32 as _, 4)
                    .map_err(lt_err("bias dtype"))?;
            }
        }
        let (m, n, k) = g.mnk;
        let (ar, ac) = if g.trans.0 { (k, m) } else { (m, k) };
        let (br, bc) = if g.trans.1 { (n, k) } else { (k, n) };
        plan.layouts = [
            layout(t, ar, ac, g.ld.0, g.batch, g.strides.0)?,
            layout(t, br, bc, g.ld.1, g.batch, g.strides.1)?,
            layout(cuda_type(g.out)?.0, m, n, g.ld.2, g.batch, g.strides.2)?,
        ];
        // (A dry run launches nothing, so it has nothing to time.)
        let tune = super::tune::autotune() && !super::gpu::is_dry();
        // The tuned algorithm an earlier process kept, else (not tuning) the heuristic's
        // choice one kept: a warm cache needs no heuristic query, whose library set-up alone
        // is slow. A stale or damaged file falls through to the heuristic.
        let key = disk_key(gpu, g, ws.1);
        let heuristic_key = key.as_ref().map(|p| p.with_extension("heuristic"));
        for (file, tuned) in [(&key, true), (&heuristic_key, false)] {
            if let Some(algo) = file.as_ref().filter(|_| tuned || !tune).and_then(|p| read_algo(p)) {
                if plan.accepts(lt, &algo, ws.1) {
                    (plan.algo, plan.tuned) = (algo, tuned);
                    return Ok(plan);
                }
            }
        }
        let candidates = plan.heuristics(lt, g, ws.1, if tune { CANDIDATES } else { 1 })?;
        plan.algo = candidates[0];
        if tune {
            let start = Instant::now();
            let mut best = (f64::INFINITY, candidates[0]);
            for &algo in candidates.iter().filter(|_| candidates.len() > 1) {
                plan.algo = algo;
                if let Ok(secs) = plan.time(lt, gpu, ptrs, ws) {
                    if secs < best.0 {
                        best = (secs, algo);
                    }
                }
            }
            (plan.algo, plan.tuned) = (best.1, true);
            TUNED.fetch_add(1, Ordering::Relaxed);
            count_since(&TUNE_NANOS, start);
            if let Some(p) = key {
                write_algo(&p, &plan.algo);
            }
        } else if let Some(p) = heuristic_key {
            write_algo(&p, &plan.algo);
        }
        Ok(plan)
    }

    /// Whether cuBLASLt confirms `algo` for this problem within the workspace.
    fn accepts(&self, lt: ls::cublasLtHandle_t, algo: &ls::cublasLtMatmulAlgo_t, ws: usize) -> bool {
        let mut r = std::mem::MaybeUninit::<ls::cublasLtMatmulHeuristicResult_t>::zeroed();
        let l = self.layouts;
        // SAFETY: live descriptors; `r` is written by cuBLASLt on success.
        let status = unsafe { ls::cublasLtMatmulAlgoCheck(lt, self.desc, l[0], l[1], l[2], l[2], algo, r.as_mut_ptr()) };
        // SAFETY: zero-initialised, and filled in on success.
        let r = unsafe { r.assume_init() };
        status == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= ws
    }

    fn heuristics(&self, lt: ls::cublasLtHandle_t, g: &Gemm, ws: usize, want: usize) -> Result<Vec<ls::cublasLtMatmulAlgo_t>> {
        use ls::cublasLtMatmulPreferenceAttributes_t as P;
        let pref = lr::create_matmul_pref().map_err(lt_err("preference"))?;
        let mut found = vec![std::mem::MaybeUninit::<ls::cublasLtMatmulHeuristicResult_t>::zeroed(); want];
        let mut count = 0i32;
        // SAFETY: `pref` and the descriptors are live; `found` has room for `want` results.
        let status = unsafe {
            // The workspace limit is a u64 attribute, the alignments u32.
            let ws = ws as u64;
            let mut r = lr::set_matmul_pref_attribute(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as _, 8);
            let aligns = [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, g.align.0),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.align.1),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, g.c.unwrap_or(g.align.2)),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, g.align.2),
            ];
            for (a, v) in aligns {
                r = r.and(lr::set_matmul_pref_attribute(pref, a, &v as *const u32 as _, 4));
            }
            let l = self.layouts;
            r.and(
                ls::cublasLtMatmulAlgoGetHeuristic(
                    lt,
                    self.desc,
                    l[0],
                    l[1],
                    l[2],
                    l[2],
                    pref,
                    want as i32,
                    found[0].as_mut_ptr(),
                    &mut count,
                )
                .result(),
            )
        };
        // SAFETY: `pref` was created above.
        let _ = unsafe { lr::destroy_matmul_pref(pref) };
        status.map_err(lt_err("heuristic"))?;
        // SAFETY: cuBLASLt filled the first `count` results.
        let ok: Vec<_> = found[..count.max(0) as usize]
            .iter()
            .map(|r| unsafe { r.assume_init() })
            .filter(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if ok.is_empty() {
            return Err(Error::Cuda(format!("cuBLASLt has no algorithm for {g:?}")));
        }
        Ok(ok)
    }

    /// Seconds per run of the current algorithm as a replayed step sees it (`tune::time_graph`).
    fn time(&self, lt: ls::cublasLtHandle_t, gpu: &Arc<Gpu>, ptrs: Ptrs, ws: (u64, usize)) -> Result<f64> {
        super::tune::time_graph(gpu, || self.run(lt, gpu, ptrs, ws))
    }

    /// `D = A B (+ C)` and the epilogue on the GPU's stream: `ptrs` are A, B, D, the
    /// epilogue's vector, its aux matrix and C (0 if none).
    pub(crate) fn run(&self, lt: ls::cublasLtHandle_t, gpu: &Arc<Gpu>, ptrs: Ptrs, ws: (u64, usize)) -> Result<()> {
        if super::gpu::is_dry() {
            return Ok(());
        }
        let first = (!self.launched.replace(true)).then(Instant::now);
        let (alpha, zero) = one_and_zero(self.f64);
        // C of its own is added (beta 1); else C is D and beta 0.
        let (beta, c) = if self.c { (alpha, ptrs[5]) } else { (zero, ptrs[2]) };
        let l = self.layouts;
        if self.vector {
            use ls::cublasLtMatmulDescAttributes_t as D;
            let p = ptrs[3];
            // SAFETY: `desc` is live and used only under the GPU's `blas` mutex; the buffer is
            // a device pointer (8 bytes) to the bias or bias gradient, kept alive by the caller
            // for the call.
            unsafe { lr::set_matmul_desc_attribute(self.desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p as *const u64 as _, 8) }
                .map_err(lt_err("bias"))?;
        }
        if self.aux {
            use ls::cublasLtMatmulDescAttributes_t as D;
            let p = ptrs[4];
            // SAFETY: as for the bias pointer: a device pointer to the aux matrix, alive for
            // the call.
            unsafe { lr::set_matmul_desc_attribute(self.desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p as *const u64 as _, 8) }
                .map_err(lt_err("aux"))?;
        }
        // SAFETY: the pointers are live device buffers of this GPU sized for the layouts
        // (checked by the caller's shape rule); `ws` is the handle's workspace; alpha/beta
        // are host scalars of the scale type.
        let launched = unsafe {
            lr::matmul(
                lt,
                self.desc,
                alpha,
                beta,
                ptrs[0] as *const c_void,
                l[0],
                ptrs[1] as *const c_void,
                l[1],
                c as *const c_void,
                l[2],
                ptrs[2] as *mut c_void,
                l[2],
                &self.algo,
                ws.0 as *mut c_void,
                ws.1,
                gpu.stream.cu_stream() as _,
            )
        }
        .map_err(lt_err("matmul"));
        if let Some(t) = first {
            count_since(&FIRST_LAUNCH_NANOS, t);
        }
        launched
    }
}

/// The tuned algorithm's file: problem, GPU name and cuBLASLt version in the key.
fn disk_key(gpu: &Arc<Gpu>, g: &Gemm, ws: usize) -> Option<std::path::PathBuf> {
    // SAFETY: a plain version query.
    let version = unsafe { ls::cublasLtGetVersion() };
    let key = crate::codegen::fnv1a(format!("{g:?} sm_{}{} {} SMs {version} ws {ws}", gpu.arch.0, gpu.arch.1, gpu.sms).as_bytes());
    crate::cache::cache_dir("cublaslt").map(|d| d.join(format!("{key:016x}.algo")))
}

fn read_algo(p: &std::path::Path) -> Option<ls::cublasLtMatmulAlgo_t> {
    let bytes = std::fs::read(p).ok()?;
    let words: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect();
    Some(ls::cublasLtMatmulAlgo_t { data: words.try_into().ok()? })
}

fn write_algo(p: &std::path::Path, algo: &ls::cublasLtMatmulAlgo_t) {
    let bytes: Vec<u8> = algo.data.iter().flat_map(|w| w.to_le_bytes()).collect();
    crate::cache::cache_put(p, &bytes);
}

/// Host pointers to alpha = 1 and beta = 0 in the GEMM's scale type (F64 for F64 GEMMs,
/// else F32): `D = A B`, nothing accumulated.
pub(super) fn one_and_zero(f64: bool) -> (*const c_void, *const c_void) {
    static ONE_ZERO_F32: [f32; 2] = [1.0, 0.0];
    static ONE_ZERO_F64: [f64; 2] = [1.0, 0.0];
    if f64 {
        (&ONE_ZERO_F64[0] as *const f64 as _, &ONE_ZERO_F64[1] as *const f64 as _)
    } else {
        (&ONE_ZERO_F32[0] as *const f32 as _, &ONE_ZERO_F32[1] as *const f32 as _)
    }
}
