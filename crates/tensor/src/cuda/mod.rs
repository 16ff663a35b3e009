//! The CUDA back end (feature `cuda`): device buffers from a caching allocator, every
//! primitive op as a kernel generated from the op table (`codegen`, compiled by NVRTC to a
//! CUBIN cached on disk), matmul through cuBLASLt/cuBLAS, one stream per GPU. Without the feature, or
//! without a driver or GPU, every CUDA request is an `Error::Device`, never a panic (cudarc
//! panics when a library it loads lazily is missing, so each library is probed first).
//!
//! Nothing synchronises except a host read (`to_vec`, `item`, moving to the CPU). An index
//! kernel that meets a bad index records it on the device; the next host read returns the
//! error.

#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
pub mod compiled;
#[cfg(feature = "cuda")]
mod gpu;
pub mod kernels;
#[cfg(feature = "cuda")]
mod library;
#[cfg(feature = "cuda")]
pub mod lt;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod tune;

use crate::op::{Op, OutMeta};
use crate::shape::Layout;
use crate::storage::Storage;
#[cfg(not(feature = "cuda"))]
use crate::Error;
use crate::{Device, Result};

#[cfg(feature = "cuda")]
pub use crate::storage::cuda::driver_allocations;
#[cfg(feature = "cuda")]
pub use crate::storage::cuda::CudaStorage;
#[cfg(feature = "cuda")]
pub use blas::{allow_tf32, f32_gemm, set_allow_tf32, set_f32_gemm, F32Gemm};

impl Device {
    /// `Cuda(ordinal)` when the `cuda` feature is built and a GPU answers, else `Cpu`.
    pub fn cuda_if_available(ordinal: usize) -> Device {
        if is_available(ordinal) {
            Device::Cuda(ordinal)
        } else {
            Device::Cpu
        }
    }
}

/// Whether `Device::Cuda(ordinal)` can be used.
pub fn is_available(ordinal: usize) -> bool {
    #[cfg(feature = "cuda")]
    return gpu::gpu(ordinal).is_ok();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        false
    }
}

/// Starts cuBLAS for `Device::Cuda(ordinal)` on a thread (a long set-up), unless it has
/// started: for a compiled step that will need it, as soon as its trace shows so. Does
/// nothing without the `cuda` feature or the device.
pub fn start_blas(ordinal: usize) {
    #[cfg(feature = "cuda")]
    if let Ok(g) = gpu::gpu(ordinal) {
        blas::start_on_thread(&g);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = ordinal;
}

/// Whether `Device::Cuda(ordinal)` runs thread block clusters (compute capability 9.0 on:
/// Hopper); false without the `cuda` feature or the device.
pub fn has_clusters(ordinal: usize) -> bool {
    #[cfg(feature = "cuda")]
    return gpu::gpu(ordinal).is_ok_and(|g| g.has_clusters());
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        false
    }
}

/// The compute capability of `Device::Cuda(ordinal)` (e.g. (9, 0) for an H100 or H200).
#[cfg(feature = "cuda")]
pub fn compute_capability(ordinal: usize) -> Result<(i32, i32)> {
    Ok(gpu::gpu(ordinal)?.arch)
}

/// How many products Kiln's Hopper F32 GEMM (`wgmma.rs`) has run in this process (the rest
/// ran on cuBLAS or Kiln's small-product kernels; a compiled step's replays are not counted).
#[cfg(feature = "cuda")]
pub fn wgmma_launches() -> u64 {
    kernels::products::WGMMA_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

/// How many attention backwards in this process read the per-row log-sum-exp their flash
/// forward kept with its output, instead of recomputing it (outside a compiled step's replays).
#[cfg(feature = "cuda")]
pub fn attention_lse_reuses() -> u64 {
    kernels::attention::ATTN_LSE_REUSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Waits until all work queued on the GPU has run (for timing; ops never need it).
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => gpu::gpu(n)?.sync(),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(unavailable(device)),
    }
}

/// Gives cached, unused device memory back to the driver (like `torch.cuda.empty_cache`).
pub fn empty_cache(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => gpu::gpu(n)?.empty_cache(),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(unavailable(device)),
    }
}

#[cfg(not(feature = "cuda"))]
fn unavailable(device: Device) -> Error {
    Error::Device { device, msg: "Kiln was built without the `cuda` feature; rebuild with `--features cuda`".into() }
}

/// The elements of a view (`s` read through `l`) as a dense buffer on `device`, another
/// device than `s`'s. A CPU view must be contiguous.
pub(crate) fn to_device(s: &Storage, l: &Layout, device: Device) -> Result<Storage> {
    #[cfg(feature = "cuda")]
    return copies::to_device(s, l, device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = l;
        Err(unavailable(if device.is_cuda() { device } else { s.device() }))
    }
}

/// A storage of `len` elements on `device` holding no memory yet: lazy tracing's outputs,
/// given memory when their kernel runs (or by `materialize`).
pub(crate) fn placeholder(device: Device, dtype: crate::DType, len: usize) -> Result<Storage> {
    #[cfg(feature = "cuda")]
    {
        let Device::Cuda(n) = device else { return Err(crate::Error::Msg(format!("cuda::placeholder: {device} is not a GPU"))) };
        Ok(Storage::Cuda(kernels::prelude::CudaStorage {
            buf: gpu::DeviceBuffer::placeholder(gpu::gpu(n)?.mem.clone()),
            dtype,
            len,
            lse: None,
        }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (dtype, len);
        Err(unavailable(device))
    }
}

/// For a placeholder, a real (unwritten) buffer to replace it; None for other storages.
pub(crate) fn materialized(s: &Storage) -> Result<Option<Storage>> {
    #[cfg(feature = "cuda")]
    if let Storage::Cuda(c) = s {
        if c.buf.is_placeholder() && c.len > 0 {
            return Ok(Some(Storage::Cuda(kernels::prelude::CudaStorage::alloc(c.memory(), c.dtype, c.len)?)));
        }
    }
    let _ = s;
    Ok(None)
}

/// An error for a placeholder read as data: a tensor made while a compiled step was traced,
/// kept outside the step and never computed.
pub(crate) fn check_computed(s: &Storage) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Storage::Cuda(c) = s {
        if c.buf.is_placeholder() && c.len > 0 {
            return Err(crate::Error::Msg(format!(
                "a {:?} tensor of {} elements made while a compiled step was traced holds no value (the trace does not compute); return it from the step instead of keeping it",
                c.dtype, c.len
            )));
        }
    }
    let _ = s;
    Ok(())
}

pub(crate) fn run(op: &Op, ins: &[&Storage], layouts: &[&Layout], meta: &OutMeta, device: Device) -> Result<Storage> {
    ins.iter().try_for_each(|s| check_computed(s))?;
    #[cfg(feature = "cuda")]
    return kernels::run(op, ins, layouts, meta, device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (op, ins, layouts, meta);
        Err(unavailable(device))
    }
}

/// `Fused::LayerNormGrads` with its `copy`: the flat output and the copy of x's gradient,
/// from one kernel (`fused::layer_norm_grads_with_copy`).
pub(crate) fn layer_norm_grads_with_copy(op: &Op, ins: &[&Storage], layouts: &[&Layout], device: Device) -> Result<(Storage, Storage)> {
    ins.iter().try_for_each(|s| check_computed(s))?;
    #[cfg(feature = "cuda")]
    return kernels::rows::layer_norm_grads_with_copy(op, ins, layouts, device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (op, ins, layouts);
        Err(unavailable(device))
    }
}

#[cfg(feature = "cuda")]
pub(crate) fn run_inplace(op: &Op, dst: &mut Storage, l: &Layout, src: Option<(&Storage, &Layout)>) -> Result<()> {
    check_computed(dst)?;
    src.map_or(Ok(()), |(s, _)| check_computed(s))?;
    kernels::run_inplace(op, dst, l, src)
}

#[cfg(feature = "cuda")]
mod copies {
    use super::gpu::gpu;
    use super::kernels::elementwise::dense_copy;
    use crate::shape::Layout;
    use crate::storage::cuda::CudaStorage;
    use crate::storage::{CpuStorage, IntoCpuStorage, Storage};
    use crate::{DType, Device, Error, Result};

    /// The elements of a contiguous view of a CPU buffer, on GPU `ordinal`.
    fn upload(s: &CpuStorage, l: &Layout, ordinal: usize) -> Result<Storage> {
        let g = gpu(ordinal)?;
        let (a, b) = (l.offset, l.offset + l.numel());
        let buf = crate::with_cpu!(s, v => g.upload(&v[a..b]))?;
        Ok(Storage::Cuda(CudaStorage { buf, dtype: s.dtype(), len: l.numel(), lse: None }))
    }

    /// The view's elements in row-major order on the host (a strided view is made dense on
    /// the device first, so only its own elements cross the bus).
    fn download(c: &CudaStorage, l: &Layout) -> Result<CpuStorage> {
        let owned;
        let (src, off) = if l.is_contiguous() {
            (c, l.offset)
        } else {
            owned = dense_copy(&gpu(c.ordinal())?, c, l)?;
            (&owned, 0)
        };
        let (g, n) = (gpu(src.ordinal())?, l.numel());
        let ptr = src.ptr_at(off);
        Ok(match src.dtype {
            DType::F32 => g.download::<f32>(ptr, n)?.into_storage(),
            DType::F64 => g.download::<f64>(ptr, n)?.into_storage(),
            DType::F16 => g.download::<half::f16>(ptr, n)?.into_storage(),
            DType::BF16 => g.download::<half::bf16>(ptr, n)?.into_storage(),
            DType::I64 => g.download::<i64>(ptr, n)?.into_storage(),
            DType::U8 => g.download::<u8>(ptr, n)?.into_storage(),
        })
    }

    pub fn to_device(s: &Storage, l: &Layout, device: Device) -> Result<Storage> {
        super::check_computed(s)?;
        match (s, device) {
            // (No elements: no layout to check; a zero-length dim breaks row-major strides.)
            (Storage::Cpu(c), Device::Cuda(n)) if l.is_contiguous() || l.numel() == 0 => upload(c, l, n),
            (Storage::Cpu(_), Device::Cuda(_)) => {
                Err(Error::Msg(format!("to_device: a CPU view of strides {:?} (made dense first)", l.strides)))
            }
            (Storage::Cuda(c), Device::Cpu) => Ok(Storage::Cpu(download(c, l)?)),
            (Storage::Cuda(c), Device::Cuda(n)) => upload(&download(c, l)?, &Layout::contiguous(&l.shape), n),
            (Storage::Cpu(_), Device::Cpu) => Err(Error::Msg("to_device: a CPU buffer to the CPU".into())),
        }
    }
}
