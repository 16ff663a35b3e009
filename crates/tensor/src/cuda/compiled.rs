//! What the compiler's CUDA back end needs from a GPU: buffers as storage cells, a compiled
//! graph's fused kernels (in a few NVRTC programs), the dry run that compiles a step's
//! kernels at once, random draws whose seed and offset live on the device, raw copies, and
//! graph capture with a private memory pool.

use super::gpu::{gpu, Gpu, Kernel};
use super::kernels::fused::{module_prelude, FusedGroup, FusedKernel, FUSED_BLOCK};
use super::kernels::prelude::CudaStorage;
use crate::codegen::Numbers;
use crate::op::{Distribution, OutMeta};
use crate::shape::Layout;
use crate::storage::{Storage, StorageCell};
use crate::{DType, Device, Error, Result};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

pub use super::gpu::{dry_run, Pool, Wanted};
/// A captured CUDA graph: cudarc's, made `Send` so that a compiled program holding one can
/// be shared with the thread pool (compile runs CPU steps there; a GPU step never moves).
pub struct CudaGraph(cudarc::driver::CudaGraph);

// SAFETY: FFI handles. CUgraph and CUgraphExec are driver objects valid on any host thread:
// cudarc's `launch` binds the graph's context to the calling thread first, the destroy calls
// in its `Drop` need no current context, and the stream it holds is `Send + Sync`.
unsafe impl Send for CudaGraph {}

fn ordinal(device: Device) -> Result<usize> {
    match device {
        Device::Cuda(n) => Ok(n),
        Device::Cpu => Err(Error::Msg("compiled CUDA step: a buffer is on the CPU".into())),
    }
}

/// `(pointer, dtype, len)` of a CUDA cell. `write` marks the cell as written (its version
/// moves, so autograd notices tensors saved before the write).
fn raw(cell: &StorageCell, write: bool) -> Result<(u64, DType, usize)> {
    if write {
        raw_of(&cell.write())
    } else {
        raw_of(&cell.read())
    }
}

fn raw_of(s: &Storage) -> Result<(u64, DType, usize)> {
    match s {
        Storage::Cuda(c) => Ok((c.buf.ptr, c.dtype, c.len)),
        Storage::Cpu(c) => Err(Error::Msg(format!("compiled CUDA step: a {:?} buffer of {} elements is on the CPU", c.dtype(), c.len()))),
    }
}

/// The device address of a CUDA cell's buffer.
pub fn address(cell: &StorageCell) -> Result<u64> {
    raw(cell, false).map(|(p, _, _)| p)
}

/// An uninitialised buffer of `len` elements on `device`.
pub fn alloc_cell(device: Device, dtype: DType, len: usize) -> Result<Arc<StorageCell>> {
    let g = gpu(ordinal(device)?)?;
    Ok(Arc::new(StorageCell::new(Storage::Cuda(CudaStorage::alloc(&g.mem, dtype, len)?))))
}

/// Copies all of `src` into `dst` (same dtype and length) on the stream.
pub fn copy_cell(dst: &StorageCell, src: &StorageCell) -> Result<()> {
    let (d, dt, dn) = raw(dst, true)?;
    let (s, st, sn) = raw(src, false)?;
    if dt != st || dn != sn {
        return Err(Error::Msg(format!("compiled CUDA step: cannot copy {sn} x {st:?} into {dn} x {dt:?}")));
    }
    let g = gpu_of(dst)?;
    // SAFETY: both buffers are alive (held by the caller's cells) and hold `dn` elements.
    unsafe { g.copy_d2d(d, s, dn * dt.size_in_bytes()) }
}

fn gpu_of(cell: &StorageCell) -> Result<Arc<Gpu>> {
    match &*cell.read() {
        Storage::Cuda(c) => gpu(c.ordinal()),
        Storage::Cpu(_) => Err(Error::Msg("compiled CUDA step: a buffer is on the CPU".into())),
    }
}

/// Writes `values` into an I64 cell of the same length (staged: no wait).
pub fn write_i64(cell: &StorageCell, values: &[i64]) -> Result<()> {
    let (p, dt, n) = raw(cell, true)?;
    if dt != DType::I64 || n != values.len() {
        return Err(Error::Msg(format!("write_i64: the cell holds {n} x {dt:?}, not {} x I64", values.len())));
    }
    // SAFETY: the cell holds exactly `values.len()` i64 and is kept alive by the caller.
    unsafe { gpu_of(cell)?.write_at(p, values) }
}

/// Random numbers of `meta`'s shape whose seed and base offset are read on the device from
/// `state` (two i64: seed, offset) and shifted by `offset`: a captured graph that draws them
/// gives fresh numbers on each replay once `state` is rewritten. Element `i` equals
/// `Op::Rand { seed, offset: state_offset + offset }`'s.
pub fn rand_from_state(state: &Arc<StorageCell>, dist: Distribution, offset: u64, meta: &OutMeta) -> Result<Arc<StorageCell>> {
    let guard = state.read();
    let Storage::Cuda(s) = &*guard else { return Err(Error::Msg("rand_from_state: the state is on the CPU".into())) };
    if s.dtype != DType::I64 || s.len != 2 {
        return Err(Error::Msg(format!("rand_from_state: the state must be 2 x I64, not {} x {:?}", s.len, s.dtype)));
    }
    let f = match dist {
        Distribution::Uniform => "k_uniform",
        Distribution::Normal => "k_normal",
    };
    let expr = format!("{f}((unsigned long long)p0[0], (unsigned long long)p0[1] + a.roff, i)");
    let one = Layout::contiguous(&[1]);
    let out = super::kernels::elementwise::ew_with(&gpu(s.ordinal())?, "rand_dev", expr, "float", &[(s, &one)], meta, (0.0, 0, offset))?;
    Ok(Arc::new(StorageCell::new(Storage::Cuda(out))))
}

/// Runs `f`, work for `device`, dry (`dry_run`: nothing reaches the device), then compiles
/// every kernel it asked for at once, on threads, so that its real run finds them loaded;
/// cuBLAS starts on a thread beside them if a product of `f` needs it (`blas::start_on_thread`).
/// Returns how many NVRTC programs were compiled (or found in the disk cache); one that
/// fails is left to its first real use, which reports the error.
pub fn prepare<R>(device: Device, f: impl FnOnce() -> R) -> Result<usize> {
    let start = std::time::Instant::now();
    let g = gpu(ordinal(device)?)?;
    let (_, wanted) = dry_run(|| crate::profile::paused(f));
    let dry = start.elapsed();
    let noted = wanted.len();
    let compiled = g.compile(wanted);
    super::blas::wait_started(&g);
    if crate::log::enabled("time") {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "[kiln time] dry run {:.1} ms, then {noted} CUDA programs compiled at once in {:.1} ms",
            ms(dry),
            ms(start.elapsed() - dry)
        );
    }
    if let Err(e) = &compiled {
        eprintln!("kiln: compiling a step's kernels ahead of its first run failed ({e}); they compile as the run reaches them");
    }
    Ok(compiled.unwrap_or(0))
}

/// A compiled graph's fused kernels: their sources are made at once, their NVRTC programs
/// (a share of the kernels each) compiled on threads at the first launch, or noted by a dry
/// run (`dry_run`) to compile together with the step's other kernels.
pub struct FusedModule {
    gpu: Arc<Gpu>,
    specs: Vec<FusedKernel>,
    programs: Vec<Wanted>,
    /// Each kernel's key in the GPU's kernel cache.
    keys: Vec<u64>,
    /// Each kernel's grid (`FusedKernel::blocks`), worked out once rather than at every launch.
    grids: Vec<u32>,
    /// Each kernel's numbers as launch parameters (a generic kernel's sizes; `Numbers`).
    numbers: Vec<Vec<u64>>,
    kernels: OnceLock<Vec<Kernel>>,
    /// A zeroed `u32` per kernel: its ticket (`FusedKernel::ticket`).
    tickets: CudaStorage,
    /// The launch of a kernel with output copies captured last (`launch`, `folded_copies`).
    folded: Mutex<Option<FoldedCopies>>,
}

impl FusedModule {
    /// Generates every kernel's source, as programs of about equal size (two per core, at most
    /// 32: NVRTC's time grows with a program's source, and a step's first call waits for the
    /// slowest).
    pub fn load(device: Device, specs: Vec<FusedKernel>) -> Result<FusedModule> {
        let g = gpu(ordinal(device)?)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Each kernel's source and numbers, generated once.
        let made: Vec<(String, Numbers)> = specs
            .iter()
            .map(|k| k.source_and_numbers().map_err(|e| Error::Msg(format!("compiled CUDA step: {e}"))))
            .collect::<Result<_>>()?;
        // Longest first, each kernel to the lightest program so far.
        let mut sizes: Vec<(usize, usize)> = made.iter().enumerate().map(|(i, (src, _))| (src.len(), i)).collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let mut bins: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); (2 * cores).clamp(1, 32).min(specs.len())];
        for (size, i) in sizes {
            if let Some(bin) = bins.iter_mut().min_by_key(|b| b.0) {
                bin.0 += size;
                bin.1.push(i);
            }
        }
        let mut keys = vec![0u64; specs.len()];
        let programs: Vec<Wanted> = bins
            .into_iter()
            .map(|(_, members)| {
                let part: Vec<FusedKernel> = members.iter().map(|&i| specs[i].clone()).collect();
                let src = members.iter().fold(module_prelude(&part), |s, &i| s + &made[i].0);
                let base = crate::codegen::fnv1a(src.as_bytes());
                for (j, &i) in members.iter().enumerate() {
                    keys[i] = base.wrapping_add(j as u64);
                }
                let names = part.iter().map(|k| k.name.clone()).collect();
                Ok(Wanted::new(members.iter().map(|&i| keys[i]).collect(), vec![0; part.len()], src, "kiln_fused".to_string(), names))
            })
            .collect::<Result<_>>()?;
        // (Eight bytes a kernel: I64, the narrowest dtype with four-byte alignment.)
        let tickets = CudaStorage::alloc(&g.mem, DType::I64, specs.len().max(1))?;
        g.zero(&tickets)?;
        let grids = specs.iter().map(|k| k.blocks() as u32).collect();
        let numbers =
            made.iter().map(|(_, n)| n.ints.iter().map(|&v| v as u64).chain(n.floats.iter().map(|v| v.to_bits())).collect()).collect();
        Ok(FusedModule { gpu: g, specs, programs, keys, grids, numbers, kernels: OnceLock::new(), tickets, folded: Mutex::new(None) })
    }

    /// Kernel `k`, its programs compiled on first use (a placeholder in a dry run).
    fn kernel(&self, k: usize) -> Result<Kernel> {
        if let Some(ks) = self.kernels.get() {
            return Ok(ks[k]);
        }
        match self.gpu.kernels_listed(&self.keys, || self.programs.clone())? {
            Some(ks) => Ok(self.kernels.get_or_init(|| ks)[k]),
            None => Ok(Kernel::NOTED),
        }
    }

    /// A hash of every kernel's cache key: equal for modules of the same sources.
    pub fn code_key(&self) -> u64 {
        crate::codegen::fnv1a(&self.keys.iter().flat_map(|k| k.to_le_bytes()).collect::<Vec<u8>>())
    }

    /// The name of kernel `k` (for profiles).
    pub fn name(&self, k: usize) -> &str {
        &self.specs[k].name
    }

    /// Output copies kernel `k`'s last block makes (`FusedKernel::copies`).
    pub fn copies(&self, k: usize) -> usize {
        self.specs[k].copies
    }

    /// Launches kernel `k` with the cells its spec was made for: per group, `outs[j]` and
    /// `ins[j]` in order, and its output copies' sources, `(cell, element offset, elements)`
    /// each (their destinations are null: a captured graph's are set by `set_output_copies`).
    pub fn launch(
        &self,
        k: usize,
        outs: &[Vec<Arc<StorageCell>>],
        ins: &[Vec<Arc<StorageCell>>],
        copies: &[(Arc<StorageCell>, usize, usize)],
    ) -> Result<()> {
        let spec = &self.specs[k];
        if outs.len() != spec.groups.len() || ins.len() != spec.groups.len() || copies.len() != spec.copies {
            return Err(Error::Msg(format!(
                "{}: given buffers for {} groups and {} output copies, it runs {} and makes {}",
                spec.name,
                outs.len(),
                copies.len(),
                spec.groups.len(),
                spec.copies
            )));
        }
        let mut ptrs: Vec<u64> = Vec::new();
        for ((gr, outs), ins) in spec.groups.iter().zip(outs).zip(ins) {
            group_pointers(&spec.name, gr, outs, ins, &mut ptrs)?;
        }
        let mut dsts = Vec::with_capacity(copies.len());
        for (cell, offset, len) in copies {
            let (p, dt, n) = raw(cell, false)?;
            if offset + len > n {
                return Err(Error::Msg(format!("{}: output copy of {len} x {dt:?} from element {offset} of a buffer of {n}", spec.name)));
            }
            let size = dt.size_in_bytes() as u64;
            dsts.push(ptrs.len() + 1);
            ptrs.extend([p + *offset as u64 * size, 0, *len as u64 * size]);
        }
        if spec.ticket() {
            ptrs.push(self.tickets.ptr_at(k));
        }
        ptrs.extend(&self.numbers[k]);
        let mut params: Vec<*mut c_void> = ptrs.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
        let (kernel, grid) = (self.kernel(k)?, self.grids[k]);
        // SAFETY: the parameters are each group's outputs then inputs, in the order of the
        // generated signature, then each copy's source, null destination and length, then the
        // ticket (in `tickets`), then the numbers of a generic kernel (8 bytes each); each buffer was checked to be big enough for every index the
        // kernel forms, and the caller's cells keep them alive.
        unsafe { self.gpu.launch(kernel, (grid, 1), FUSED_BLOCK as u32, 0, &mut params)? };
        if spec.copies > 0 && self.gpu.capturing() {
            let node = self.gpu.last_captured()?;
            *self.folded.lock().unwrap_or_else(|e| e.into_inner()) = Some(FoldedCopies { node, kernel, grid, params: ptrs, dsts });
        }
        Ok(())
    }

    /// After a capture: the captured launch of a kernel with output copies, if it is the
    /// graph's last node (so that the copies see every output final).
    pub fn folded_copies(&self) -> Result<Option<FoldedCopies>> {
        let Some(f) = self.folded.lock().unwrap_or_else(|e| e.into_inner()).take() else { return Ok(None) };
        Ok((self.gpu.last_captured()? == f.node).then_some(f))
    }
}

/// Checks one group's buffers against its spec and appends their pointers.
fn group_pointers(name: &str, gr: &FusedGroup, outs: &[Arc<StorageCell>], ins: &[Arc<StorageCell>], ptrs: &mut Vec<u64>) -> Result<()> {
    // A fed product with a right operand reads two buffers.
    let cells: usize = gr.inputs.iter().map(|x| 1 + x.fed.as_ref().is_some_and(|f| f.b.is_some()) as usize).sum();
    if outs.len() != gr.outputs.len() || ins.len() != cells {
        return Err(Error::Msg(format!("{name}: given {} outputs and {} input buffers", outs.len(), ins.len())));
    }
    for ((c, &m), len) in outs.iter().zip(&gr.outputs).zip(gr.output_lens()) {
        let (p, dt, n) = raw(c, true)?;
        let want = gr.members[m].dtype;
        if dt != want || n < len {
            return Err(Error::Msg(format!("{name}: output needs {len} x {want:?}, got {n} x {dt:?}")));
        }
        ptrs.push(p);
    }
    let mut cells = ins.iter();
    for x in &gr.inputs {
        let (last, b_last) = match (&x.strided, &x.fed) {
            (_, Some(f)) => f.extents(x.offset, gr.n),
            (None, None) => (x.offset + gr.n, None),
            (Some((shape, st)), None) => (crate::shape::last_index(x.offset, shape, st) + 1, None),
        };
        for last in std::iter::once(last).chain(b_last) {
            let c = cells.next().ok_or_else(|| Error::Msg(format!("{name}: an input buffer is missing")))?;
            let (p, dt, n) = raw(c, false)?;
            if dt != x.dtype || (gr.n > 0 && n < last) {
                return Err(Error::Msg(format!("{name}: input needs {last} x {:?}, got {n} x {dt:?}", x.dtype)));
            }
            ptrs.push(p);
        }
    }
    Ok(())
}

/// A new private memory pool on `device` for a graph capture.
pub fn new_pool(device: Device) -> Result<Arc<Pool>> {
    Ok(gpu(ordinal(device)?)?.new_pool())
}

/// Captures the work `f` queues on `device` into a CUDA graph (nothing runs); allocations in
/// `f` come from `pool`, which must outlive the graph.
pub fn capture<R>(device: Device, pool: &Arc<Pool>, f: impl FnOnce() -> Result<R>) -> Result<(CudaGraph, R)> {
    let (graph, r) = gpu(ordinal(device)?)?.capture(pool, f)?;
    Ok((CudaGraph(graph), r))
}

/// Replays a captured graph on its GPU's stream.
pub fn launch_graph(graph: &CudaGraph) -> Result<()> {
    graph.0.launch().map_err(super::gpu::cuda_err("graph launch"))
}

/// The copy of one output of a captured step into the caller's buffer, inside the graph: a
/// kernel node whose destination each replay sets (`set_output_copies`), so that no copy is
/// launched after the graph and a later replay never writes what an earlier caller holds.
pub struct OutputCopy {
    node: super::gpu::GraphNode,
    kernel: Kernel,
    grid: u32,
    src: u64,
    bytes: u64,
}

/// Threads a block of the output copy, and the most blocks it takes.
const COPY_OUT_BLOCK: u32 = 256;
const COPY_OUT_MAX_BLOCKS: u64 = 1024;

fn copy_out_kernel(g: &Gpu) -> Result<Kernel> {
    let (src, name) = super::kernels::fused::copy_out_source();
    g.kernel(crate::codegen::fnv1a(src.as_bytes()), || (src, name))
}

/// Loads the output-copy kernel (a dry run notes it, to compile with the step's kernels).
pub fn want_output_copies(device: Device) -> Result<()> {
    let g = gpu(ordinal(device)?)?;
    copy_out_kernel(&g).map(|_| ())
}

/// Inside a capture: queues the copy of `len` elements of `cell` from element `offset` as a
/// graph node (to the same buffer until `set_output_copies` gives it a destination).
pub fn capture_output_copy(cell: &StorageCell, offset: usize, len: usize) -> Result<OutputCopy> {
    let (p, dt, n) = raw(cell, false)?;
    if offset + len > n {
        return Err(Error::Msg(format!("output copy: {len} x {dt:?} from element {offset} of a buffer of {n}")));
    }
    let g = gpu_of(cell)?;
    let kernel = copy_out_kernel(&g)?;
    let (src, bytes) = (p + (offset * dt.size_in_bytes()) as u64, (len * dt.size_in_bytes()) as u64);
    let grid = (bytes / 16).div_ceil(COPY_OUT_BLOCK as u64).clamp(1, COPY_OUT_MAX_BLOCKS) as u32;
    let (mut s, mut d, mut b) = (src, src, bytes);
    let mut params: Vec<*mut c_void> = vec![&mut s as *mut u64 as _, &mut d as *mut u64 as _, &mut b as *mut u64 as _];
    // SAFETY: kiln_copy_out's three parameters; the range lies in `cell`, which the graph's
    // outputs keep alive, and the copy to itself is never run (each replay sets `dst` first).
    unsafe { g.launch(kernel, (grid, 1), COPY_OUT_BLOCK, 0, &mut params)? };
    let node = g.last_captured()?;
    Ok(OutputCopy { node, kernel, grid, src, bytes })
}

/// A captured step's last fused kernel, which also copies the step's outputs
/// (`FusedKernel::copies`): its node and parameters, and which of them are the destinations.
pub struct FoldedCopies {
    node: super::gpu::GraphNode,
    kernel: Kernel,
    grid: u32,
    params: Vec<u64>,
    dsts: Vec<usize>,
}

/// What copies a captured step's outputs into the caller's tensors: a node each, or the
/// step's last kernel.
pub enum OutputCopies {
    Nodes(Vec<OutputCopy>),
    Folded(FoldedCopies),
}

/// Points each of `graph`'s output copies at its destination, for its next replay.
///
/// # Safety
/// `copies` were captured into `graph`; each `dsts[i]` holds output `i`'s bytes in a live
/// buffer of the graph's GPU until the replay has run.
pub unsafe fn set_output_copies(graph: &CudaGraph, copies: &OutputCopies, dsts: &[u64]) -> Result<()> {
    let copies = match copies {
        OutputCopies::Nodes(nodes) => nodes,
        OutputCopies::Folded(f) => {
            if dsts.len() != f.dsts.len() {
                return Err(Error::Msg(format!("output copies: {} destinations for {} outputs", dsts.len(), f.dsts.len())));
            }
            let mut vals = f.params.clone();
            for (&slot, &dst) in f.dsts.iter().zip(dsts) {
                vals[slot] = dst;
            }
            let mut params: Vec<*mut c_void> = vals.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
            // SAFETY: forwarded from this function's contract; the node is the kernel node of
            // this graph that `f` was captured from, given the parameters it was captured with
            // but for the destinations (read before the call returns).
            return unsafe {
                super::gpu::set_kernel_node(graph.0.cu_graph_exec(), f.node, f.kernel, f.grid, FUSED_BLOCK as u32, &mut params)
            };
        }
    };
    for (c, &dst) in copies.iter().zip(dsts) {
        let (mut s, mut d, mut b) = (c.src, dst, c.bytes);
        let mut params: [*mut c_void; 3] = [&mut s as *mut u64 as _, &mut d as *mut u64 as _, &mut b as *mut u64 as _];
        // SAFETY: forwarded from this function's contract; the node is a kernel node of this
        // graph running `c.kernel`, whose parameters are read before the call returns.
        unsafe { super::gpu::set_kernel_node(graph.0.cu_graph_exec(), c.node, c.kernel, c.grid, COPY_OUT_BLOCK, &mut params)? };
    }
    Ok(())
}
