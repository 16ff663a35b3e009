//! CUDA device memory (feature `cuda`): each GPU's caching allocator, the buffers it hands
//! out and the typed storage a CUDA tensor holds. The back end (`crate::cuda`) launches work
//! on these buffers; this module only owns memory.

use crate::{DType, Device, Error, Result};
use cudarc::driver::{result as dr, CudaContext, CudaStream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Free buffers by size class.
type FreeList = HashMap<usize, Vec<u64>>;

/// One GPU's memory: its context (bound before a driver call) and stream (work on it is
/// ordered, so a freed buffer may be reused at once), the cache of free buffers, and while
/// a CUDA graph is captured the private pool allocations come from.
pub struct DeviceMemory {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Free device buffers by rounded size: an eager step reuses them, no driver call.
    free: Mutex<FreeList>,
    /// While a CUDA graph is captured, allocations come from (and return to) this pool.
    capture_pool: Mutex<Option<Arc<Pool>>>,
    /// Bytes held from the driver (in use or cached).
    held: AtomicU64,
}

/// A private memory pool, as PyTorch gives each CUDA graph: buffers allocated while a graph is
/// captured belong to the pool and go back to it when freed, so the addresses baked into the
/// graph are never handed to other code. Dropping the pool returns its free buffers to the
/// GPU's cache (buffers still alive keep the pool alive).
pub struct Pool {
    free: Mutex<FreeList>,
    mem: Arc<DeviceMemory>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        let mut pool = lock(&self.free);
        let mut free = lock(&self.mem.free);
        for (class, ptrs) in pool.drain() {
            free.entry(class).or_default().extend(ptrs);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static DRIVER_ALLOCS: AtomicU64 = AtomicU64::new(0);

/// How many times Kiln has asked the driver for memory (all GPUs): after a warm-up step an
/// eager training step should add none.
pub fn driver_allocations() -> u64 {
    DRIVER_ALLOCS.load(Ordering::Relaxed)
}

/// Sizes are rounded (512 B granules below 4 KiB, else an eighth of the next power of two) so
/// that buffers of nearby sizes share a cache bucket.
fn size_class(bytes: usize) -> usize {
    let g = (bytes.max(1).next_power_of_two() / 8).max(512);
    bytes.max(1).div_ceil(g) * g
}

fn cuda_err(what: &'static str) -> impl Fn(dr::DriverError) -> Error {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

impl DeviceMemory {
    pub fn new(ordinal: usize, ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> DeviceMemory {
        DeviceMemory { ordinal, ctx, stream, free: Mutex::default(), capture_pool: Mutex::new(None), held: AtomicU64::new(0) }
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// Makes this GPU's context current on the calling thread (a thread-local check first:
    /// every op calls this, and the driver call is only needed when the thread switches).
    pub fn bind(&self) -> Result<()> {
        thread_local! {
            static BOUND: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
        }
        if BOUND.with(|b| b.get()) == self.ordinal {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        BOUND.with(|b| b.set(self.ordinal));
        Ok(())
    }

    /// `bytes` of device memory, from the cache or the driver. Out of memory is an error
    /// naming the request (after the cache has been given back and the request retried).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        let class = size_class(bytes);
        let pool = lock(&self.capture_pool).clone();
        let pooled = pool.as_ref().and_then(|p| lock(&p.free).get_mut(&class).and_then(|v| v.pop()));
        if let Some(ptr) = pooled {
            return Ok(DeviceBuffer { ptr, bytes: class, mem: self.clone(), pool });
        }
        if let Some(ptr) = lock(&self.free).get_mut(&class).and_then(|v| v.pop()) {
            return Ok(DeviceBuffer { ptr, bytes: class, mem: self.clone(), pool });
        }
        self.bind()?;
        // SAFETY: plain driver allocation in the bound context; the pointer is owned by the
        // returned DeviceBuffer (and then by the cache).
        let ptr = match unsafe { dr::malloc_sync(class) } {
            Ok(p) => p,
            Err(_) => {
                self.empty_cache()?;
                // SAFETY: as above.
                unsafe { dr::malloc_sync(class) }.map_err(|e| Error::Device {
                    device: self.device(),
                    msg: format!(
                        "out of memory: cannot allocate {bytes} bytes ({:.1} MiB; {:.1} MiB already held by Kiln): {e}",
                        bytes as f64 / 1048576.0,
                        self.held.load(Ordering::Relaxed) as f64 / 1048576.0
                    ),
                })?
            }
        };
        DRIVER_ALLOCS.fetch_add(1, Ordering::Relaxed);
        self.held.fetch_add(class as u64, Ordering::Relaxed);
        Ok(DeviceBuffer { ptr, bytes: class, mem: self.clone(), pool })
    }

    /// Gives every cached (unused) buffer back to the driver, once the stream has finished.
    pub fn empty_cache(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("stream synchronize"))?;
        let mut free = lock(&self.free);
        for (class, ptrs) in free.drain() {
            for p in ptrs {
                // SAFETY: the pointer came from malloc_sync and no live buffer refers to it.
                unsafe { dr::free_sync(p) }.map_err(cuda_err("freeing device memory"))?;
                self.held.fetch_sub(class as u64, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// A new private pool for a graph capture (see `Pool`).
    pub fn new_pool(self: &Arc<Self>) -> Arc<Pool> {
        Arc::new(Pool { free: Mutex::default(), mem: self.clone() })
    }

    /// Sends allocations to `pool` (a graph capture begins) or back to the cache (`None`).
    pub fn set_capture_pool(&self, pool: Option<Arc<Pool>>) {
        *lock(&self.capture_pool) = pool;
    }

    /// Whether allocations go to a capture's pool.
    pub fn capturing(&self) -> bool {
        lock(&self.capture_pool).is_some()
    }
}

/// A device allocation; dropping it returns it to its GPU's cache.
pub struct DeviceBuffer {
    pub ptr: u64,
    pub bytes: usize,
    pub mem: Arc<DeviceMemory>,
    /// The private pool it came from (a captured graph's), if any.
    pool: Option<Arc<Pool>>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes, cuda:{})", self.ptr, self.bytes, self.mem.ordinal)
    }
}

impl DeviceBuffer {
    /// No memory: stands for a buffer lazy tracing has not computed (`kiln_tensor::lazy`).
    pub fn placeholder(mem: Arc<DeviceMemory>) -> DeviceBuffer {
        DeviceBuffer { ptr: 0, bytes: 0, mem, pool: None }
    }
    /// Real buffers are at least one 512-byte size class.
    pub fn is_placeholder(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.is_placeholder() {
            return;
        }
        // Work on the one stream is ordered, so a later kernel may reuse this memory at once.
        let list = self.pool.as_ref().map_or(&self.mem.free, |p| &p.free);
        lock(list).entry(self.bytes).or_default().push(self.ptr);
    }
}

/// A device buffer holding `len` elements of `dtype`.
#[derive(Debug)]
pub struct CudaStorage {
    pub buf: DeviceBuffer,
    pub dtype: DType,
    pub len: usize,
    /// With a flash attention forward's output: each row's log-sum-exp, for its backward.
    pub lse: Option<RowLse>,
}

impl CudaStorage {
    pub fn alloc(mem: &Arc<DeviceMemory>, dtype: DType, len: usize) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: mem.alloc(len * dtype.size_in_bytes())?, dtype, len, lse: None })
    }
    pub fn device(&self) -> Device {
        self.buf.mem.device()
    }
    pub fn ordinal(&self) -> usize {
        self.buf.mem.ordinal
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
    /// The memory of the GPU it lives on.
    pub fn memory(&self) -> &Arc<DeviceMemory> {
        &self.buf.mem
    }
    /// The device address of element `offset`.
    pub fn ptr_at(&self, offset: usize) -> u64 {
        self.buf.ptr + (offset * self.dtype.size_in_bytes()) as u64
    }
}

/// The per-row log-sum-exp (base 2, of the scaled scores) of the attention forward whose output
/// holds it: `rows` = matrices x T, for this scale and mask. Its backward reads it instead of
/// recomputing every row's scores once more.
#[derive(Debug)]
pub struct RowLse {
    pub buf: DeviceBuffer,
    pub rows: usize,
    pub scale: f64,
    pub causal: bool,
}
