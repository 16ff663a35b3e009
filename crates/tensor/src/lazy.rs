//! Lazy tracing: while `kiln-compile` traces a step, kernels are queued instead of run, so the
//! first call of a compiled step needs no eager kernels (on a GPU each one would first be
//! compiled by NVRTC, one after another). Outputs get buffers of the right size and dtype
//! (on a GPU, placeholders holding no memory until their kernel runs; reading one that never
//! ran is an error naming it);
//! shapes, autograd and the tracer work as in eager mode. A host read (`to_vec`, `item`,
//! moving to another device) runs the queue first, so every value read is the eager one;
//! the trace then continues lazily.
//!
//! `end(Keep::Sources)` drops the queue but runs its fills (`Full`, `Arange`): buffers such
//! as optimizer moments that the step creates and keeps must start from those values when the
//! compiled program first runs. `end(Keep::All)` runs everything (the step then behaves as if
//! it had run eagerly).

use crate::op::{Op, OutMeta};
use crate::storage::{Storage, StorageCell};
use crate::{Device, Result, Tensor};
use std::cell::RefCell;
use std::sync::Arc;

/// A kernel waiting to run, holding its inputs alive.
enum Pending {
    Out { op: Op, inputs: Vec<Tensor>, meta: OutMeta, device: Device, out: Arc<StorageCell> },
    InPlace { op: Op, dst: Tensor, src: Option<Tensor> },
}

thread_local! {
    static QUEUE: RefCell<Option<Vec<Pending>>> = const { RefCell::new(None) };
}

/// What `end` runs of the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Everything: the step's effects happen as in eager mode.
    All,
    /// Only fills (`Full`, `Arange`), for buffers the step creates and keeps.
    Sources,
}

/// Starts queueing kernels on this thread (not under anomaly detection, which reads values).
pub fn begin() {
    if !crate::is_anomaly_detection() {
        QUEUE.with(|q| *q.borrow_mut() = Some(Vec::new()));
    }
}

/// Whether kernels are being queued on this thread.
pub fn active() -> bool {
    QUEUE.with(|q| q.borrow().is_some())
}

/// Stops queueing and runs what `keep` asks for, in order.
pub fn end(keep: Keep) -> Result<()> {
    let queue = QUEUE.with(|q| q.borrow_mut().take()).unwrap_or_default();
    let keep_job = |p: &Pending| keep == Keep::All || matches!(p, Pending::Out { op: Op::Full { .. } | Op::Arange { .. }, .. });
    queue.into_iter().filter(keep_job).try_for_each(run)
}

/// Runs every queued kernel now (before a host read); queueing goes on afterwards.
pub fn flush() -> Result<()> {
    let queue = QUEUE.with(|q| q.borrow_mut().as_mut().map(std::mem::take)).unwrap_or_default();
    queue.into_iter().try_for_each(run)
}

/// Gives a buffer left unwritten by the trace real memory (a compiled program's state cells).
pub fn materialize(cell: &StorageCell) -> Result<()> {
    let real = crate::cuda::materialized(&cell.read())?; // the read guard ends here
    if let Some(s) = real {
        cell.replace(s);
    }
    Ok(())
}

/// Queues `op` when lazy: returns the output's (not yet written) buffer.
pub(crate) fn defer(op: &Op, inputs: &[&Tensor], meta: &OutMeta, device: Device) -> Result<Option<Arc<StorageCell>>> {
    if !active() {
        return Ok(None);
    }
    let len = meta.shape.iter().product();
    let storage = match device {
        Device::Cpu => Storage::Cpu(crate::storage::CpuStorage::uninit(meta.dtype, len)),
        // No GPU memory until the kernel runs: a trace keeps every queued output alive.
        Device::Cuda(_) => crate::cuda::placeholder(device, meta.dtype, len)?,
    };
    let out = Arc::new(StorageCell::new(storage));
    let job = Pending::Out {
        op: op.clone(),
        inputs: inputs.iter().map(|t| (*t).clone()).collect(),
        meta: meta.clone(),
        device,
        out: out.clone(),
    };
    push(job);
    Ok(Some(out))
}

/// Queues an in-place update when lazy; returns whether it was queued.
pub(crate) fn defer_inplace(op: &Op, dst: &Tensor, src: Option<&Tensor>) -> bool {
    if !active() {
        return false;
    }
    dst.storage().count_write(); // autograd's saved-version checks see the write now, as in eager
    push(Pending::InPlace { op: op.clone(), dst: dst.clone(), src: src.cloned() });
    true
}

fn push(job: Pending) {
    QUEUE.with(|q| q.borrow_mut().as_mut().map(|v| v.push(job)));
}

fn run(job: Pending) -> Result<()> {
    match job {
        Pending::Out { op, inputs, meta, device, out } => {
            let refs: Vec<&Tensor> = inputs.iter().collect();
            let s = crate::tensor::run_kernel(&op, &refs, &meta, device)?;
            out.replace(s);
            Ok(())
        }
        Pending::InPlace { op, dst, src } => dst.run_inplace_kernel(&op, src.as_ref(), false),
    }
}
