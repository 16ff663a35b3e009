//! One op on the buffers of one device: the dispatch between the CPU kernels (`cpu`) and the
//! CUDA back end (`cuda`). Below `Tensor` and the lazy queue, which both run kernels here.

use crate::cpu;
use crate::op::{Op, OutMeta};
use crate::shape::Layout;
use crate::storage::{Storage, StorageCell};
use crate::{Device, Result};
use std::sync::Arc;

/// A buffer read through a layout.
pub(crate) type View<'a> = (&'a Arc<StorageCell>, &'a Layout);

/// Runs `f` on the storages of `cells`, each distinct storage locked once.
pub(crate) fn with_storages<R>(cells: &[&Arc<StorageCell>], f: impl FnOnce(&[&Storage]) -> Result<R>) -> Result<R> {
    let mut distinct: Vec<&Arc<StorageCell>> = Vec::new();
    let slot: Vec<usize> = cells
        .iter()
        .map(|c| match distinct.iter().position(|d| Arc::ptr_eq(d, c)) {
            Some(i) => i,
            None => {
                distinct.push(c);
                distinct.len() - 1
            }
        })
        .collect();
    let guards: Vec<_> = distinct.iter().map(|c| c.read()).collect();
    let storages: Vec<&Storage> = slot.iter().map(|&i| &*guards[i]).collect();
    f(&storages)
}

/// Runs the kernel of `op` on `inputs`, for an output on `device`.
pub(crate) fn run(op: &Op, inputs: &[View], meta: &OutMeta, device: Device) -> Result<Storage> {
    let cells: Vec<&Arc<StorageCell>> = inputs.iter().map(|v| v.0).collect();
    let layouts: Vec<&Layout> = inputs.iter().map(|v| v.1).collect();
    with_storages(&cells, |storages| match device {
        Device::Cpu => {
            let mut ins = Vec::with_capacity(inputs.len());
            for (s, l) in storages.iter().zip(&layouts) {
                match s {
                    Storage::Cpu(s) => ins.push((s, *l)),
                    #[cfg(feature = "cuda")]
                    Storage::Cuda(c) => return Err(crate::Error::DeviceMismatch { op: op.name(), lhs: Device::Cpu, rhs: c.device() }),
                }
            }
            Ok(Storage::Cpu(cpu::run(op, &ins, meta)?))
        }
        Device::Cuda(_) => crate::cuda::run(op, storages, &layouts, meta, device),
    })
}

/// The kernel of an in-place op writing into `dst` (read from `src`, if any); `counted`: the
/// write bumps the storage's version (autograd's saved-tensor check).
pub(crate) fn run_inplace(op: &Op, dst: View, src: Option<View>, counted: bool) -> Result<()> {
    let src_guard = src.map(|s| s.0.read());
    let mut dst_guard = if counted { dst.0.write() } else { dst.0.write_uncounted() };
    let src_layout = src.map(|s| s.1);
    match (&mut *dst_guard, src_guard.as_deref()) {
        (Storage::Cpu(d), None) => cpu::run_inplace(op, d, dst.1, None),
        (Storage::Cpu(d), Some(Storage::Cpu(s))) => cpu::run_inplace(op, d, dst.1, Some((s, src_layout.unwrap_or(dst.1)))),
        #[cfg(feature = "cuda")]
        (d, s) => crate::cuda::run_inplace(op, d, dst.1, s.zip(src_layout)),
    }
}
