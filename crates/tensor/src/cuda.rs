//! The CUDA back end. Without the `cuda` feature (or until its kernels land) every CUDA
//! request is a clear error; the CPU path never depends on it.

use crate::op::{Op, OutMeta};
use crate::shape::Layout;
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

/// Whether `Device::Cuda(ordinal)` can be used.
pub fn is_available(_ordinal: usize) -> bool {
    false
}

fn unavailable(device: Device) -> Error {
    let msg = if cfg!(feature = "cuda") {
        "CUDA kernels are not implemented yet in this build of Kiln; use Device::Cpu"
    } else {
        "Kiln was built without the `cuda` feature; rebuild with `--features cuda`"
    };
    Error::Device { device, msg: msg.into() }
}

pub(crate) fn to_device(t: &Tensor, device: Device) -> Result<Tensor> {
    Err(unavailable(if device.is_cuda() { device } else { t.device() }))
}

pub(crate) fn run(_op: &Op, _ins: &[&Storage], _layouts: &[&Layout], _meta: &OutMeta, device: Device) -> Result<Storage> {
    Err(unavailable(device))
}

#[cfg(feature = "cuda")]
pub(crate) fn run_inplace(_op: &Op, dst: &mut Storage, _l: &Layout, _src: Option<(&Storage, &Layout)>) -> Result<()> {
    Err(unavailable(dst.device()))
}

/// A CUDA buffer (filled in by the CUDA back end).
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct CudaStorage {
    device: Device,
    dtype: crate::DType,
}

#[cfg(feature = "cuda")]
impl CudaStorage {
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn dtype(&self) -> crate::DType {
        self.dtype
    }
    pub fn len(&self) -> usize {
        0
    }
    pub fn is_empty(&self) -> bool {
        true
    }
}
