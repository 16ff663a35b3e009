//! Where the numbers are: a CPU buffer or a CUDA buffer, shared between views and mutated
//! only by in-place ops (which bump the version so autograd can catch stale saved tensors).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod pool;

use crate::{DType, Device, Element};
use half::{bf16, f16};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A CPU buffer of one dtype.
#[derive(Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

/// Runs `$body` with `$v` bound to the typed Vec (or slice) inside a `CpuStorage`.
#[macro_export]
#[doc(hidden)]
macro_rules! with_cpu {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::storage::CpuStorage::F32($v) => $body,
            $crate::storage::CpuStorage::F64($v) => $body,
            $crate::storage::CpuStorage::F16($v) => $body,
            $crate::storage::CpuStorage::BF16($v) => $body,
            $crate::storage::CpuStorage::I64($v) => $body,
            $crate::storage::CpuStorage::U8($v) => $body,
        }
    };
}

/// Builds a `CpuStorage` from a `Vec<T>` of any element type.
pub trait IntoCpuStorage {
    fn into_storage(self) -> CpuStorage;
}
macro_rules! into_storage {
    ($t:ty, $v:ident) => {
        impl IntoCpuStorage for Vec<$t> {
            fn into_storage(self) -> CpuStorage {
                CpuStorage::$v(self)
            }
        }
    };
}
into_storage!(f32, F32);
into_storage!(f64, F64);
into_storage!(f16, F16);
into_storage!(bf16, BF16);
into_storage!(i64, I64);
into_storage!(u8, U8);

/// Typed access to a `CpuStorage`.
pub trait CpuSlice: Element {
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}
macro_rules! cpu_slice {
    ($t:ty, $v:ident) => {
        impl CpuSlice for $t {
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
cpu_slice!(f32, F32);
cpu_slice!(f64, F64);
cpu_slice!(f16, F16);
cpu_slice!(bf16, BF16);
cpu_slice!(i64, I64);
cpu_slice!(u8, U8);

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
        }
    }
    pub fn len(&self) -> usize {
        with_cpu!(self, v => v.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A buffer of `len` elements whose contents the caller overwrites (taken from the pool).
    pub fn uninit(dtype: DType, len: usize) -> CpuStorage {
        match dtype {
            DType::F32 => CpuStorage::F32(pool::take(len)),
            DType::F64 => CpuStorage::F64(pool::take(len)),
            DType::F16 => CpuStorage::F16(pool::take(len)),
            DType::BF16 => CpuStorage::BF16(pool::take(len)),
            DType::I64 => CpuStorage::I64(pool::take(len)),
            DType::U8 => CpuStorage::U8(pool::take(len)),
        }
    }
}

impl Drop for CpuStorage {
    fn drop(&mut self) {
        with_cpu!(self, v => pool::give(std::mem::take(v)))
    }
}

/// The device-specific buffer.
#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaStorage),
}

impl Storage {
    pub fn as_cpu(&self) -> crate::Result<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Err(crate::Error::Msg(format!("expected a CPU tensor, got one on {:?}", s.device()))),
        }
    }
    pub fn as_cpu_mut(&mut self) -> crate::Result<&mut CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Err(crate::Error::Msg(format!("expected a CPU tensor, got one on {:?}", s.device()))),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.dtype(),
        }
    }
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.device(),
        }
    }
}

static NEXT_STORAGE_ID: AtomicU64 = AtomicU64::new(1);

/// The id the next storage will get: storages with smaller ids existed before this call.
pub fn next_storage_id() -> u64 {
    NEXT_STORAGE_ID.load(Ordering::Relaxed)
}

static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
static PEAK_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes held by all live storages (every device), and the peak since `reset_peak_bytes`.
pub fn live_bytes() -> u64 {
    LIVE_BYTES.load(Ordering::Relaxed)
}
pub fn peak_bytes() -> u64 {
    PEAK_BYTES.load(Ordering::Relaxed)
}
pub fn reset_peak_bytes() {
    PEAK_BYTES.store(live_bytes(), Ordering::Relaxed);
}

fn storage_bytes(s: &Storage) -> u64 {
    match s {
        Storage::Cpu(c) => (c.len() * c.dtype().size_in_bytes()) as u64,
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) if c.buf.is_placeholder() => 0,
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => (c.len() * c.dtype().size_in_bytes()) as u64,
    }
}

/// A storage shared by a tensor and its views, with a version counter for in-place writes.
#[derive(Debug)]
pub struct StorageCell {
    id: u64,
    data: RwLock<Storage>,
    version: AtomicU64,
    bytes: AtomicU64,
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(*self.bytes.get_mut(), Ordering::Relaxed);
    }
}

fn add_live(bytes: u64) {
    let live = LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
}

impl StorageCell {
    pub fn new(s: Storage) -> StorageCell {
        let bytes = storage_bytes(&s);
        add_live(bytes);
        StorageCell {
            id: NEXT_STORAGE_ID.fetch_add(1, Ordering::Relaxed),
            data: RwLock::new(s),
            version: AtomicU64::new(0),
            bytes: AtomicU64::new(bytes),
        }
    }
    /// A process-unique id (the compiler keys state buffers by it); ids only grow.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Elements in the buffer (not in any one view of it).
    pub fn len(&self) -> usize {
        match &*self.read() {
            Storage::Cpu(s) => s.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }
    pub fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.version.fetch_add(1, Ordering::Relaxed);
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }
    /// Write access that does not count as an in-place write: lazy tracing filling a buffer
    /// whose write was already counted (or that is an op's fresh output).
    pub(crate) fn write_uncounted(&self) -> RwLockWriteGuard<'_, Storage> {
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }
    /// Swaps in a storage of the same dtype and length (lazy tracing giving a placeholder its
    /// computed buffer), keeping the live-bytes count right. Not an in-place write.
    pub(crate) fn replace(&self, s: Storage) {
        let bytes = storage_bytes(&s);
        let old = self.bytes.swap(bytes, Ordering::Relaxed);
        add_live(bytes);
        LIVE_BYTES.fetch_sub(old, Ordering::Relaxed);
        *self.write_uncounted() = s;
    }
    /// Counts an in-place write that lazy tracing queued.
    pub(crate) fn count_write(&self) {
        self.version.fetch_add(1, Ordering::Relaxed);
    }
    /// How many in-place writes this storage has seen.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }
}
