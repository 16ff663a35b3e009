//! One op on the buffers of one device: the dispatch between the CPU kernels (`cpu`) and the
//! CUDA back end (`cuda`). Below `Tensor` and the lazy queue, which both run kernels here.

use crate::cpu;
use crate::op::{Op, OutMeta};
use crate::shape::Layout;
use crate::storage::{Storage, StorageCell};
use crate::{Device, Result};
use std::sync::Arc;

/// A buffer read through a layout: what a kernel's input or output is to the back end
/// (`Tensor`, and the lazy queue's held buffers).
pub(crate) trait Buffer {
    fn cell(&self) -> &Arc<StorageCell>;
    fn layout(&self) -> &Layout;
}

/// Runs `f` on the storages of `inputs`, each distinct storage locked once.
pub(crate) fn with_storages<B: Buffer + ?Sized, R>(inputs: &[&B], f: impl FnOnce(&[&Storage]) -> Result<R>) -> Result<R> {
    let mut distinct: Vec<&Arc<StorageCell>> = Vec::with_capacity(inputs.len());
    let slot: Vec<usize> = inputs
        .iter()
        .map(|b| match distinct.iter().position(|d| Arc::ptr_eq(d, b.cell())) {
            Some(i) => i,
            None => {
                distinct.push(b.cell());
                distinct.len() - 1
            }
        })
        .collect();
    let guards: Vec<_> = distinct.iter().map(|c| c.read()).collect();
    let storages: Vec<&Storage> = slot.iter().map(|&i| &*guards[i]).collect();
    f(&storages)
}

/// Runs the kernel of `op` on `inputs`, for an output on `device`.
pub(crate) fn run<B: Buffer + ?Sized>(op: &Op, inputs: &[&B], meta: &OutMeta, device: Device) -> Result<Storage> {
    with_storages(inputs, |storages| match device {
        Device::Cpu => {
            let mut ins = Vec::with_capacity(inputs.len());
            for (s, b) in storages.iter().zip(inputs) {
                match s {
                    Storage::Cpu(s) => ins.push((s, b.layout())),
                    #[cfg(feature = "cuda")]
                    Storage::Cuda(c) => return Err(crate::Error::DeviceMismatch { op: op.name(), lhs: Device::Cpu, rhs: c.device() }),
                }
            }
            Ok(Storage::Cpu(cpu::run(op, &ins, meta)?))
        }
        Device::Cuda(_) => {
            let layouts: Vec<&Layout> = inputs.iter().map(|b| b.layout()).collect();
            crate::cuda::run(op, storages, &layouts, meta, device)
        }
    })
}

/// The kernel of an in-place op writing into `dst` (read from `src`, if any); `counted`: the
/// write bumps the storage's version (autograd's saved-tensor check).
pub(crate) fn run_inplace<B: Buffer + ?Sized>(op: &Op, dst: &B, src: Option<&B>, counted: bool) -> Result<()> {
    let src_guard = src.map(|s| s.cell().read());
    let mut dst_guard = if counted { dst.cell().write() } else { dst.cell().write_uncounted() };
    let src_layout = src.map(|s| s.layout());
    match (&mut *dst_guard, src_guard.as_deref()) {
        (Storage::Cpu(d), None) => cpu::run_inplace(op, d, dst.layout(), None),
        (Storage::Cpu(d), Some(Storage::Cpu(s))) => cpu::run_inplace(op, d, dst.layout(), Some((s, src_layout.unwrap_or(dst.layout())))),
        #[cfg(feature = "cuda")]
        (d, s) => crate::cuda::run_inplace(op, d, dst.layout(), s.zip(src_layout)),
    }
}
