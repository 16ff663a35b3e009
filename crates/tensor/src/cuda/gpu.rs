//! One GPU as Kiln uses it: its context and single stream, the caching allocator, the kernel
//! cache (NVRTC to CUBIN, in memory and on disk), raw launches, and the device error word
//! that index kernels set instead of crashing.

use crate::storage::cuda::CudaStorage;
pub use crate::storage::cuda::{DeviceBuffer, DeviceMemory, Pool};
use crate::{Device, Error, Result};
use cudarc::driver::{result as dr, sys as ds, CudaContext, CudaStream};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The kernels that set the device error word, in code order (code = position + 1; 0
/// means no error): the index kernels, then cross-entropy's target check.
const ERROR_SOURCES: [&str; 5] = ["index_select", "index_add", "gather", "scatter_add", "cross_entropy (a target class)"];

/// The error code of a cross-entropy target out of range.
pub const XENT_CODE: i64 = ERROR_SOURCES.len() as i64;

/// The op an error code in the device error word stands for.
pub fn index_op_name(code: i64) -> &'static str {
    ERROR_SOURCES.get((code - 1).max(0) as usize).copied().unwrap_or("an index kernel")
}

/// A hash of a kernel spec: the in-memory kernel cache's key.
pub fn spec_key<T: std::hash::Hash>(kind: &str, spec: &T) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    kind.hash(&mut h);
    spec.hash(&mut h);
    h.finish()
}

/// A compiled kernel (its module stays loaded for the life of the process).
#[derive(Clone, Copy)]
pub struct Kernel(ds::CUfunction);
// SAFETY: a CUfunction is a handle into a module that is never unloaded; the driver allows
// launching it from any thread that has the context current.
unsafe impl Send for Kernel {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// What a dry run hands out for a kernel it has only noted (never launched).
    pub(crate) const NOTED: Kernel = Kernel(std::ptr::null_mut());
}

#[derive(Clone)]
/// Kernels to compile together (one NVRTC program each, on threads of their own): what a
/// dry run noted, or what a lookup missed.
pub struct Wanted {
    /// The in-memory cache's key of each kernel of the program, in the order of `names`.
    keys: Vec<u64>,
    /// Dynamic shared memory each kernel is launched with.
    shared: Vec<u32>,
    /// The source and the program's name (`nvrtc::cubins`'s job).
    job: (String, String),
    names: Vec<String>,
}

impl Wanted {
    /// One program of kernels `names`, kept under `keys`, launched with `shared` bytes each.
    pub fn new(keys: Vec<u64>, shared: Vec<u32>, src: String, module: String, names: Vec<String>) -> Wanted {
        Wanted { keys, shared, job: (super::kernels::prelude::waiting_for_prior(&src), module), names }
    }

    /// A program of one kernel, named as the program.
    fn one(key: u64, shared: u32, (src, name): (String, String)) -> Wanted {
        Wanted::new(vec![key], vec![shared], src, name.clone(), vec![name])
    }
}

thread_local! {
    /// While this thread is in `dry_run`: the kernels asked for that were not loaded.
    static DRY: std::cell::RefCell<Option<Vec<Wanted>>> = const { std::cell::RefCell::new(None) };
}

/// Whether this thread is in `dry_run`.
pub fn is_dry() -> bool {
    DRY.with(|d| d.borrow().is_some())
}

/// Runs `f` dry: every kernel it asks for that is not loaded yet is noted instead of
/// compiled, and nothing it queues reaches the device (no launch, device copy, memset or
/// GEMM; allocations and host-to-device writes happen, and host reads read whatever the
/// buffers hold). Returns `f`'s result, meaningless as data, and the kernels noted, which
/// `Gpu::compile` then compiles all at once. A compiled step's first call runs itself dry
/// first so that its kernels compile in parallel. Nested in another dry run, its notes are
/// the outer run's too.
pub fn dry_run<R>(f: impl FnOnce() -> R) -> (R, Vec<Wanted>) {
    /// Puts back the outer run's list (with this run's notes added), or ends the dry run.
    struct Restore(Option<Vec<Wanted>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            DRY.with(|d| {
                let mut d = d.borrow_mut();
                let inner = d.take().unwrap_or_default();
                *d = outer.map(|mut o| {
                    merge(&mut o, &inner);
                    o
                });
            });
        }
    }
    let outer = DRY.with(|d| d.borrow_mut().replace(Vec::new()));
    let restore = Restore(outer);
    let r = f();
    let wanted = DRY.with(|d| d.borrow().clone()).unwrap_or_default();
    drop(restore);
    (r, wanted)
}

/// Adds to `list` the programs of `wanted` it lacks (by first key).
fn merge(list: &mut Vec<Wanted>, wanted: &[Wanted]) {
    for w in wanted {
        if !list.iter().any(|x| x.keys[0] == w.keys[0]) {
            list.push(w.clone());
        }
    }
}

/// In a dry run, notes `wanted` (once per first key) and returns true; else false.
fn note(wanted: &[Wanted]) -> bool {
    DRY.with(|d| d.borrow_mut().as_mut().map(|list| merge(list, wanted)).is_some())
}

/// Whether this thread is in a dry run that has already noted the program of `key`.
fn noted(key: u64) -> bool {
    DRY.with(|d| d.borrow().as_ref().is_some_and(|list| list.iter().any(|w| w.keys[0] == key)))
}

pub struct Gpu {
    pub ordinal: usize,
    pub stream: Arc<CudaStream>,
    pub sms: u32,
    pub arch: (i32, i32),
    /// Its memory: the caching allocator every buffer on this GPU comes from.
    pub mem: Arc<DeviceMemory>,
    kernels: Mutex<HashMap<u64, Kernel>>,
    /// Three i64 on the device: op code, bad index, dim size (0 when no error).
    pub err: u64,
    /// Whether kernels are launched with programmatic stream serialization (`launch_ex`):
    /// on Hopper and later.
    early_launch: bool,
}

pub(crate) fn cuda_err(what: impl std::fmt::Display) -> impl Fn(dr::DriverError) -> Error {
    let what = what.to_string();
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// The GPU `ordinal`, opened on first use.
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let device = Device::Cuda(ordinal);
    if !super::library::driver_present() {
        return Err(Error::Device { device, msg: "no NVIDIA driver on this machine (libcuda.so.1 not found)".into() });
    }
    thread_local! {
        static LAST: std::cell::RefCell<Option<Arc<Gpu>>> = const { std::cell::RefCell::new(None) };
    }
    if let Some(g) = LAST.with(|l| l.borrow().as_ref().filter(|g| g.ordinal == ordinal).cloned()) {
        g.bind()?;
        return Ok(g);
    }
    let mut map = GPUS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = map.get(&ordinal) {
        g.bind()?;
        LAST.with(|l| *l.borrow_mut() = Some(g.clone()));
        return Ok(g.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| Error::Device { device, msg: format!("cannot open the GPU: {e}") })?;
    // SAFETY: Kiln issues all work on one stream per device, so cudarc's cross-stream event
    // tracking is not needed (and it would break CUDA graph capture).
    unsafe { ctx.disable_event_tracking() };
    // A created stream, not the legacy default one: only a created stream can be captured.
    let stream = ctx.new_stream().map_err(cuda_err("creating the stream"))?;
    let sms = ctx.attribute(ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(cuda_err("device query"))? as u32;
    let arch = ctx.compute_capability().map_err(cuda_err("device query"))?;
    // SAFETY: a fresh 32-byte allocation in the current context, zeroed before use.
    let err = unsafe {
        let p = dr::malloc_sync(32).map_err(cuda_err("allocating the error word"))?;
        dr::memset_d8_sync(p, 0, 32).map_err(cuda_err("clearing the error word"))?;
        p
    };
    let g = Arc::new(Gpu {
        ordinal,
        stream: stream.clone(),
        sms,
        arch,
        mem: Arc::new(DeviceMemory::new(ordinal, ctx, stream.clone())),
        kernels: Mutex::default(),
        err,
        early_launch: arch.0 >= 9,
    });
    map.insert(ordinal, g.clone());
    g.bind()?;
    LAST.with(|l| *l.borrow_mut() = Some(g.clone()));
    Ok(g)
}

impl Gpu {
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// Makes this GPU's context current on the calling thread (`DeviceMemory::bind`).
    pub fn bind(&self) -> Result<()> {
        self.mem.bind()
    }

    /// `bytes` of device memory (`DeviceMemory::alloc`).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.mem.alloc(bytes)
    }

    /// Zeros all of `s` (on the stream).
    pub fn zero(&self, s: &CudaStorage) -> Result<()> {
        if is_dry() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `s` owns `len` elements of its dtype on this GPU.
        unsafe { dr::memset_d8_async(s.buf.ptr, 0, s.len * s.dtype.size_in_bytes(), self.stream.cu_stream()) }.map_err(cuda_err("memset"))
    }

    /// A new private pool for a graph capture (see `Pool`).
    pub fn new_pool(&self) -> Arc<Pool> {
        self.mem.new_pool()
    }

    /// Runs `f` with this GPU's stream captured into a CUDA graph, allocating from `pool`.
    /// Nothing runs during the capture; the returned graph replays the work. The capture is
    /// relaxed, so kernels may still be loaded and memory allocated while it runs.
    pub fn capture<R>(&self, pool: &Arc<Pool>, f: impl FnOnce() -> Result<R>) -> Result<(cudarc::driver::CudaGraph, R)> {
        self.bind()?;
        self.stream.begin_capture(ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(cuda_err("begin graph capture"))?;
        self.mem.set_capture_pool(Some(pool.clone()));
        let r = f();
        self.mem.set_capture_pool(None);
        let graph = self.stream.end_capture(ds::CUgraphInstantiate_flags(0)).map_err(cuda_err("end graph capture"));
        let (r, graph) = (r?, graph?);
        let graph = graph.ok_or_else(|| Error::Cuda("graph capture recorded nothing".into()))?;
        graph.upload().map_err(cuda_err("uploading the graph"))?;
        Ok((graph, r))
    }

    /// Copies `bytes` bytes between device buffers on the stream.
    ///
    /// # Safety
    /// Both ranges must lie in live buffers of this GPU until the stream has run the copy.
    pub unsafe fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if is_dry() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: forwarded from this function's contract.
        unsafe { dr::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(cuda_err("device to device copy"))
    }

    /// Writes `data` to device memory at `dst` on the stream (staged: `data` may be dropped).
    ///
    /// # Safety
    /// `dst` must hold `size_of_val(data)` bytes of a live buffer of this GPU.
    pub unsafe fn write_at<T>(&self, dst: u64, data: &[T]) -> Result<()> {
        self.bind()?;
        // SAFETY: forwarded from this function's contract.
        unsafe { dr::memcpy_htod_async(dst, data, self.stream.cu_stream()) }.map_err(cuda_err("host to device copy"))
    }

    /// Gives every cached (unused) buffer back to the driver.
    pub fn empty_cache(&self) -> Result<()> {
        self.mem.empty_cache()
    }

    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("stream synchronize"))
    }

    /// Host to device (the host slice may be dropped on return: pageable copies are staged).
    pub fn upload<T>(&self, data: &[T]) -> Result<DeviceBuffer> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: `buf` holds at least `size_of_val(data)` bytes; pageable sources are
            // copied to staging memory before the call returns.
            unsafe { dr::memcpy_htod_async(buf.ptr, data, self.stream.cu_stream()) }.map_err(cuda_err("host to device copy"))?;
        }
        Ok(buf)
    }

    /// Device to host of `len` elements at `ptr` (synchronises), then reports any error an
    /// index kernel recorded since the last read.
    pub fn download<T: Default + Clone>(&self, ptr: u64, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        self.bind()?;
        if len > 0 {
            // SAFETY: `ptr` holds `len` elements of T (the caller's storage); `out` is that big.
            unsafe { dr::memcpy_dtoh_async(&mut out, ptr, self.stream.cu_stream()) }.map_err(cuda_err("device to host copy"))?;
        }
        self.sync()?;
        self.check_errors()?;
        Ok(out)
    }

    /// Reads (and clears) the error word; an index kernel that saw a bad index set it.
    pub fn check_errors(&self) -> Result<()> {
        let mut w = [0i64; 3];
        // SAFETY: `err` is the 32-byte error word of this context.
        unsafe { dr::memcpy_dtoh_sync(&mut w, self.err) }.map_err(cuda_err("reading the error word"))?;
        if w[0] == 0 {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe { dr::memset_d8_sync(self.err, 0, 32) }.map_err(cuda_err("clearing the error word"))?;
        let op = index_op_name(w[0]);
        Err(Error::Msg(format!(
            "{op} on {}: index {} is out of range for a dim of size {} (found by the kernel; reported at this host read)",
            self.device(),
            w[1],
            w[2]
        )))
    }

    /// The kernel for `key` (a hash of its spec), compiled on first use from `source()`, which
    /// gives the source and the kernel's name (the CUBIN is cached on disk too).
    pub fn kernel(&self, key: u64, source: impl FnOnce() -> (String, String)) -> Result<Kernel> {
        self.kernel_shared(key, 0, source)
    }

    /// `kernel`, for a kernel launched with up to `shared` bytes of dynamic shared memory: the
    /// limit is raised once, when the kernel is loaded.
    pub fn kernel_shared(&self, key: u64, shared: u32, source: impl FnOnce() -> (String, String)) -> Result<Kernel> {
        self.kernels_ready([key], || vec![Wanted::one(key, shared, source())]).map(|[k]| k)
    }

    /// `kernel_shared` for kernels needed together (an attention's forward and its two
    /// backward kernels, `shared` bytes each): those not loaded yet compile on threads at once,
    /// `source(i)` giving kernel `i`'s source and name. Returns them in the order of `keys`.
    pub fn kernels_together<const N: usize>(
        &self,
        keys: [u64; N],
        shared: u32,
        source: impl Fn(usize) -> (String, String),
    ) -> Result<[Kernel; N]> {
        self.kernels_ready(keys, || (0..N).map(|i| Wanted::one(keys[i], shared, source(i))).collect())
    }

    /// Kernels `names` of one module (compiled once from `source()`, which gives the source,
    /// the module's name and the kernels' names), kept under `key`, `key + 1`, ...
    pub fn kernel_set<const N: usize>(&self, key: u64, source: impl FnOnce() -> (String, String, [String; N])) -> Result<[Kernel; N]> {
        self.kernel_set_shared(key, [0; N], source)
    }

    /// `kernel_set` for kernels launched with `shared[i]` bytes of dynamic shared memory each.
    pub fn kernel_set_shared<const N: usize>(
        &self,
        key: u64,
        shared: [u32; N],
        source: impl FnOnce() -> (String, String, [String; N]),
    ) -> Result<[Kernel; N]> {
        let keys: [u64; N] = std::array::from_fn(|i| key.wrapping_add(i as u64));
        self.kernels_ready(keys, || {
            let (src, module, names) = source();
            vec![Wanted::new(keys.to_vec(), shared.to_vec(), src, module, names.to_vec())]
        })
    }

    /// The kernels under `keys`. Any not loaded: `wanted()` says how to make them, and they
    /// are compiled now (at once, on threads), or only noted in a dry run (placeholders).
    /// Looked up on every launch: no allocation once loaded.
    pub fn kernels_ready<const N: usize>(&self, keys: [u64; N], wanted: impl FnOnce() -> Vec<Wanted>) -> Result<[Kernel; N]> {
        let found =
            |map: &HashMap<u64, Kernel>| -> Option<[Kernel; N]> { keys.iter().all(|k| map.contains_key(k)).then(|| keys.map(|k| map[&k])) };
        if let Some(ks) = found(&self.kernels.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(ks);
        }
        if self.make(keys[0], wanted)? {
            return Ok([Kernel::NOTED; N]);
        }
        found(&self.kernels.lock().unwrap_or_else(|e| e.into_inner()))
            .ok_or_else(|| Error::Msg(format!("compiled kernels do not cover the keys asked for ({keys:x?})")))
    }

    /// `kernels_ready` for any number of kernels (allocates: for callers that keep what it
    /// returns); `None` in a dry run, which only notes them (once).
    pub fn kernels_listed(&self, keys: &[u64], wanted: impl FnOnce() -> Vec<Wanted>) -> Result<Option<Vec<Kernel>>> {
        let found = |map: &HashMap<u64, Kernel>| -> Option<Vec<Kernel>> { keys.iter().map(|k| map.get(k).copied()).collect() };
        if let Some(ks) = found(&self.kernels.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(Some(ks));
        }
        if keys.first().map_or(Ok(false), |&k| self.make(k, wanted))? {
            return Ok(None);
        }
        let ks = found(&self.kernels.lock().unwrap_or_else(|e| e.into_inner()));
        ks.map(Some).ok_or_else(|| Error::Msg("compiled kernels do not cover the keys asked for".into()))
    }

    /// After a lookup of the program whose first key is `first` missed: in a dry run notes
    /// `wanted()` (once) and returns true; else compiles it and returns false.
    fn make(&self, first: u64, wanted: impl FnOnce() -> Vec<Wanted>) -> Result<bool> {
        if noted(first) {
            return Ok(true);
        }
        let wanted = wanted();
        if note(&wanted) {
            return Ok(true);
        }
        self.compile(wanted)?;
        Ok(false)
    }

    /// Compiles (through the CUBIN disk cache), loads and keeps every program of `wanted` not
    /// loaded yet, the programs on threads at once. Returns how many programs that was; a
    /// program that fails does not stop the others, and the first failure is the error.
    pub fn compile(&self, wanted: Vec<Wanted>) -> Result<usize> {
        let todo: Vec<Wanted> = {
            let map = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
            wanted.into_iter().filter(|w| w.keys.iter().any(|k| !map.contains_key(k))).collect()
        };
        let jobs: Vec<(String, String)> = todo.iter().map(|w| w.job.clone()).collect();
        if crate::log::enabled("kernels") {
            jobs.iter().for_each(|(src, name)| crate::log::log("kernels", &format!("{name}:\n{src}")));
        }
        let cubins = super::nvrtc::cubins(&jobs, self.arch);
        let mut map = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        let mut first_error = None;
        for (w, cubin) in todo.iter().zip(cubins) {
            let names: Vec<&str> = w.names.iter().map(String::as_str).collect();
            let loaded = cubin.and_then(|c| self.load_cubin(&c, &w.job.1, &names)).and_then(|ks| {
                for (k, &bytes) in ks.iter().zip(&w.shared) {
                    // Any request: a kernel's static shared memory counts toward the 48 KiB it
                    // has without the opt-in (the staged layer-norm backward: 48 + 3 KiB).
                    if bytes > 0 {
                        self.allow_shared(*k, bytes)?;
                    }
                    if self.has_clusters() {
                        self.allow_big_clusters(*k)?;
                    }
                }
                Ok(ks)
            });
            match loaded {
                Ok(ks) => map.extend(w.keys.iter().copied().zip(ks)),
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        first_error.map_or(Ok(todo.len()), Err)
    }

    /// Loads a CUBIN made by NVRTC for this GPU and returns the kernels `names` in order.
    pub fn load_cubin(&self, cubin: &[u8], name: &str, names: &[&str]) -> Result<Vec<Kernel>> {
        self.bind()?;
        // SAFETY: `cubin` is a complete CUBIN image produced by NVRTC for this device's arch.
        let module = unsafe { dr::module::load_data(cubin.as_ptr() as *const c_void) }.map_err(cuda_err(format!("loading {name}")))?;
        names
            .iter()
            .map(|n| {
                let cname = CString::new(*n).map_err(|_| Error::Msg("kernel name has a NUL".into()))?;
                // SAFETY: the module was just loaded and is never unloaded.
                let f = unsafe { dr::module::get_function(module, cname) }.map_err(cuda_err(format!("finding {n}")))?;
                Ok(Kernel(f))
            })
            .collect()
    }

    /// Lets `k` take `bytes` of dynamic shared memory beside its static shared memory, past
    /// the default 48 KiB for both.
    fn allow_shared(&self, k: Kernel, bytes: u32) -> Result<()> {
        self.bind()?;
        let attr = ds::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: `k` is a function of a module loaded in this context and never unloaded.
        unsafe { dr::function::set_function_attribute(k.0, attr, bytes as i32) }
            .map_err(cuda_err(format!("allowing {bytes} bytes of shared memory")))
    }

    /// Lets `k` run in clusters of up to 16 blocks (Hopper; 8 is the portable most).
    fn allow_big_clusters(&self, k: Kernel) -> Result<()> {
        self.bind()?;
        let attr = ds::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED;
        // SAFETY: `k` is a function of a module loaded in this context and never unloaded.
        unsafe { dr::function::set_function_attribute(k.0, attr, 1) }.map_err(cuda_err("allowing clusters of 16 blocks"))
    }

    /// Whether this GPU runs thread block clusters (compute capability 9.0 on: Hopper).
    pub fn has_clusters(&self) -> bool {
        self.arch.0 >= 9
    }

    /// A grid-stride launch over `work` items with 256 threads a block.
    pub fn grid_for(&self, work: usize) -> u32 {
        (work.div_ceil(256)).clamp(1, self.sms as usize * 16) as u32
    }

    /// Launches `k` on this GPU's stream. `params` point at the kernel's arguments in order.
    ///
    /// # Safety
    /// `params` must match the kernel's signature, and every device pointer among them must
    /// stay valid (owned by a live buffer) until the stream has run the kernel.
    pub unsafe fn launch(&self, k: Kernel, grid: (u32, u32), block: u32, shmem: u32, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.launch3(k, (grid.0, grid.1, 1), block, shmem, params) }
    }

    /// `launch` with a three-dimensional grid.
    ///
    /// # Safety
    /// As for `launch`.
    pub unsafe fn launch3(&self, k: Kernel, grid: (u32, u32, u32), block: u32, shmem: u32, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.launch_ex(k, grid, None, block, shmem, params) }
    }

    /// `launch3` with the grid's blocks in clusters of `cluster_z` along z (Hopper's thread
    /// block clusters: the blocks of one cluster run at once and read each other's shared
    /// memory). `grid.2` must be a multiple of `cluster_z`, at most 16 (`allow_big_clusters`).
    ///
    /// # Safety
    /// As for `launch`.
    pub unsafe fn launch_cluster(
        &self,
        k: Kernel,
        grid: (u32, u32, u32),
        cluster_z: u32,
        block: u32,
        shmem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.launch_ex(k, grid, Some(cluster_z), block, shmem, params) }
    }

    /// Every launch: on Hopper with programmatic stream serialization, so the kernel may be
    /// launched before the one ahead of it on the stream has finished (each kernel waits for
    /// it first: `waiting_for_prior`), hiding the launch latency between kernels.
    ///
    /// # Safety
    /// As for `launch`.
    unsafe fn launch_ex(
        &self,
        k: Kernel,
        grid: (u32, u32, u32),
        cluster_z: Option<u32>,
        block: u32,
        shmem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if launch_skipped(k)? {
            return Ok(());
        }
        self.bind()?;
        let mut attrs: [ds::CUlaunchAttribute; 2] = [launch_attr(ds::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_IGNORE); 2];
        let mut count = 0;
        if let Some(z) = cluster_z {
            let mut attr = launch_attr(ds::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
            attr.value.clusterDim = ds::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z };
            attrs[count] = attr;
            count += 1;
        }
        if self.early_launch {
            let mut attr = launch_attr(ds::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
            attr.value.programmaticStreamSerializationAllowed = 1;
            attrs[count] = attr;
            count += 1;
        }
        let config = ds::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shmem,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: count as u32,
        };
        // SAFETY: `config` and `attrs` outlive the call; the rest is this function's contract.
        let launched = unsafe { ds::cuLaunchKernelEx(&config, k.0, params.as_mut_ptr(), std::ptr::null_mut()) }.result();
        // (The message is formatted only on failure: no allocation a launch.)
        launched.map_err(|e| {
            let (x, y, z) = grid;
            cuda_err(format!("kernel launch ({x} x {y} x {z} blocks of {block} threads, clusters of {cluster_z:?}, {shmem} bytes shared)"))(
                e,
            )
        })
    }
}

/// A node of a captured CUDA graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphNode(ds::CUgraphNode);
// SAFETY: a handle into a graph; the driver allows using it from any thread, and Kiln uses it
// only with the graph (held beside it) that owns it.
unsafe impl Send for GraphNode {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for GraphNode {}

impl Gpu {
    /// Whether this GPU's stream is being captured into a graph (`capture`).
    pub(crate) fn capturing(&self) -> bool {
        self.mem.capturing()
    }

    /// While the stream is being captured: the node its last queued work became.
    pub fn last_captured(&self) -> Result<GraphNode> {
        let mut status = ds::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut deps, mut count): (*const ds::CUgraphNode, usize) = (std::ptr::null(), 0);
        let (mut id, mut graph, mut edges): (u64, ds::CUgraph, *const ds::CUgraphEdgeData) = (0, std::ptr::null_mut(), std::ptr::null());
        // SAFETY: every out-pointer is a live local; `deps` points into the driver's capture
        // state, read at once below, before anything else is queued on the stream.
        unsafe {
            ds::cuStreamGetCaptureInfo_v3(self.stream.cu_stream(), &mut status, &mut id, &mut graph, &mut deps, &mut edges, &mut count)
        }
        .result()
        .map_err(cuda_err("capture info"))?;
        if status != ds::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || count != 1 || deps.is_null() {
            return Err(Error::Cuda(format!("the stream is not capturing after one node ({status:?}, {count} dependencies)")));
        }
        // SAFETY: `deps` holds `count` (1) nodes.
        Ok(GraphNode(unsafe { *deps }))
    }
}

/// Replaces the parameters of kernel node `node` of the instantiated graph `exec` (its kernel
/// `k`, `grid` blocks of `block` threads, no shared memory) for the replays that follow.
///
/// # Safety
/// `node` is a kernel node of `exec`'s graph, and `params` are `k`'s parameters, valid for
/// every replay that runs with them.
pub unsafe fn set_kernel_node(
    exec: ds::CUgraphExec,
    node: GraphNode,
    k: Kernel,
    grid: u32,
    block: u32,
    params: &mut [*mut c_void],
) -> Result<()> {
    let p = ds::CUDA_KERNEL_NODE_PARAMS {
        func: k.0,
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        kernelParams: params.as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: `p` outlives the call (the driver copies the parameters); the rest is this
    // function's contract.
    unsafe { ds::cuGraphExecKernelNodeSetParams_v2(exec, node.0, &p) }.result().map_err(cuda_err("setting a graph node's parameters"))
}

/// A launch attribute `id` with all 64 bytes of its value's union zeroed.
fn launch_attr(id: ds::CUlaunchAttributeID) -> ds::CUlaunchAttribute {
    ds::CUlaunchAttribute { id, pad: [0; 4], value: ds::CUlaunchAttributeValue { pad: [0; 64] } }
}

/// Whether a launch of `k` is skipped (in a dry run); a placeholder outside one is an error.
fn launch_skipped(k: Kernel) -> Result<bool> {
    if is_dry() {
        return Ok(true);
    }
    if k.0.is_null() {
        return Err(Error::Msg("a kernel noted in a dry run was launched before it was compiled".into()));
    }
    Ok(false)
}
