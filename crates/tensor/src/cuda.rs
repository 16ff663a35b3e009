//! The CUDA back end (feature `cuda`). This step holds device buffers and host/device copies;
//! kernels come next (issue 5): until then an op on a CUDA tensor is a clear error. Without
//! the feature, or without a driver or GPU, every CUDA request is an `Error::Device`, never a
//! panic (cudarc panics when a library it loads lazily is missing, so the driver is probed
//! first).

use crate::op::{Op, OutMeta};
use crate::shape::Layout;
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

#[cfg(feature = "cuda")]
pub use imp::CudaStorage;

/// Whether `Device::Cuda(ordinal)` can be used.
pub fn is_available(ordinal: usize) -> bool {
    #[cfg(feature = "cuda")]
    return imp::stream(ordinal).is_ok();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        false
    }
}

#[cfg(not(feature = "cuda"))]
fn unavailable(device: Device) -> Error {
    Error::Device { device, msg: "Kiln was built without the `cuda` feature; rebuild with `--features cuda`".into() }
}

pub(crate) fn to_device(t: &Tensor, device: Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return imp::to_device(t, device);
    #[cfg(not(feature = "cuda"))]
    Err(unavailable(if device.is_cuda() { device } else { t.device() }))
}

pub(crate) fn run(op: &Op, _ins: &[&Storage], _layouts: &[&Layout], _meta: &OutMeta, device: Device) -> Result<Storage> {
    #[cfg(feature = "cuda")]
    imp::stream(match device {
        Device::Cuda(n) => n,
        Device::Cpu => 0,
    })?;
    let _ = _meta;
    #[cfg(feature = "cuda")]
    return Err(Error::Device {
        device,
        msg: format!("{}: CUDA kernels are not implemented yet; move the tensors to Device::Cpu", op.name()),
    });
    #[cfg(not(feature = "cuda"))]
    {
        let _ = op;
        Err(unavailable(device))
    }
}

#[cfg(feature = "cuda")]
pub(crate) fn run_inplace(op: &Op, dst: &mut Storage, _l: &Layout, _src: Option<(&Storage, &Layout)>) -> Result<()> {
    Err(Error::Device { device: dst.device(), msg: format!("{}: CUDA kernels are not implemented yet", op.name()) })
}

#[cfg(feature = "cuda")]
mod imp {
    use crate::storage::{CpuStorage, IntoCpuStorage, Storage};
    use crate::{with_cpu, DType, Device, Error, Result, Tensor};
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    /// A device buffer of one dtype.
    #[derive(Debug)]
    pub enum CudaBuf {
        F32(CudaSlice<f32>),
        F64(CudaSlice<f64>),
        F16(CudaSlice<half::f16>),
        BF16(CudaSlice<half::bf16>),
        I64(CudaSlice<i64>),
        U8(CudaSlice<u8>),
    }

    #[derive(Debug)]
    pub struct CudaStorage {
        pub buf: CudaBuf,
        pub ordinal: usize,
    }

    impl CudaStorage {
        pub fn device(&self) -> Device {
            Device::Cuda(self.ordinal)
        }
        pub fn dtype(&self) -> DType {
            match &self.buf {
                CudaBuf::F32(_) => DType::F32,
                CudaBuf::F64(_) => DType::F64,
                CudaBuf::F16(_) => DType::F16,
                CudaBuf::BF16(_) => DType::BF16,
                CudaBuf::I64(_) => DType::I64,
                CudaBuf::U8(_) => DType::U8,
            }
        }
        pub fn len(&self) -> usize {
            match &self.buf {
                CudaBuf::F32(s) => s.len(),
                CudaBuf::F64(s) => s.len(),
                CudaBuf::F16(s) => s.len(),
                CudaBuf::BF16(s) => s.len(),
                CudaBuf::I64(s) => s.len(),
                CudaBuf::U8(s) => s.len(),
            }
        }
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }
    }

    /// Whether the driver library can be loaded at all (cudarc would panic on first use).
    fn driver_present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        *PRESENT.get_or_init(|| {
            ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
                // SAFETY: loading the NVIDIA driver library runs its initialisers; it is the
                // same library cudarc loads, and we only test that it loads.
                unsafe { libloading::Library::new(*name) }.is_ok()
            })
        })
    }

    /// The default stream of GPU `ordinal` (one per device, made on first use).
    pub fn stream(ordinal: usize) -> Result<Arc<CudaStream>> {
        static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<CudaStream>>>> = OnceLock::new();
        let device = Device::Cuda(ordinal);
        if !driver_present() {
            return Err(Error::Device { device, msg: "no NVIDIA driver on this machine (libcuda.so.1 not found)".into() });
        }
        let mut map = STREAMS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map.get(&ordinal) {
            return Ok(s.clone());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::Device { device, msg: format!("cannot open the GPU: {e}") })?;
        let s = ctx.default_stream();
        map.insert(ordinal, s.clone());
        Ok(s)
    }

    fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
        move |e| Error::Cuda(format!("{what}: {e}"))
    }

    fn upload(t: &Tensor, ordinal: usize) -> Result<Tensor> {
        let s = stream(ordinal)?;
        let c = t.contiguous()?;
        let buf = c.with_cpu_storage(|st, l| -> Result<CudaBuf> {
            let (a, b) = (l.offset, l.offset + l.numel());
            let e = cuda_err("host to device copy");
            Ok(match st {
                CpuStorage::F32(v) => CudaBuf::F32(s.clone_htod(&v[a..b]).map_err(e)?),
                CpuStorage::F64(v) => CudaBuf::F64(s.clone_htod(&v[a..b]).map_err(e)?),
                CpuStorage::F16(v) => CudaBuf::F16(s.clone_htod(&v[a..b]).map_err(e)?),
                CpuStorage::BF16(v) => CudaBuf::BF16(s.clone_htod(&v[a..b]).map_err(e)?),
                CpuStorage::I64(v) => CudaBuf::I64(s.clone_htod(&v[a..b]).map_err(e)?),
                CpuStorage::U8(v) => CudaBuf::U8(s.clone_htod(&v[a..b]).map_err(e)?),
            })
        })??;
        Ok(Tensor::from_storage(Storage::Cuda(CudaStorage { buf, ordinal }), t.shape()))
    }

    /// The whole device buffer on the host, then the tensor's layout applied there.
    fn download(t: &Tensor) -> Result<Tensor> {
        let guard = t.storage().read();
        let Storage::Cuda(c) = &*guard else { return Err(Error::Msg("download: not a CUDA tensor".into())) };
        let s = stream(c.ordinal)?;
        let e = cuda_err("device to host copy");
        let host: CpuStorage = match &c.buf {
            CudaBuf::F32(b) => s.clone_dtoh(b).map_err(e)?.into_storage(),
            CudaBuf::F64(b) => s.clone_dtoh(b).map_err(e)?.into_storage(),
            CudaBuf::F16(b) => s.clone_dtoh(b).map_err(e)?.into_storage(),
            CudaBuf::BF16(b) => s.clone_dtoh(b).map_err(e)?.into_storage(),
            CudaBuf::I64(b) => s.clone_dtoh(b).map_err(e)?.into_storage(),
            CudaBuf::U8(b) => s.clone_dtoh(b).map_err(e)?.into_storage(),
        };
        let layout = t.layout();
        let out = with_cpu!(&host, v => crate::cpu::elementwise::map1(v, layout, |x| x).into_storage());
        Ok(Tensor::from_storage(Storage::Cpu(out), t.shape()))
    }

    pub fn to_device(t: &Tensor, device: Device) -> Result<Tensor> {
        match (t.device(), device) {
            (Device::Cpu, Device::Cuda(n)) => upload(t, n),
            (Device::Cuda(_), Device::Cpu) => download(t),
            (Device::Cuda(_), Device::Cuda(n)) => upload(&download(t)?, n),
            (Device::Cpu, Device::Cpu) => Ok(t.clone()),
        }
    }
}
