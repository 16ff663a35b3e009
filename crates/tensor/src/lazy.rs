//! Lazy tracing: while `kiln-compile` traces a step, kernels are queued instead of run, so the
//! first call of a compiled step needs no eager kernels (on a GPU each one would first be
//! compiled by NVRTC, one after another). Outputs get buffers of the right size and dtype
//! (on a GPU, placeholders holding no memory until their kernel runs; reading one that never
//! ran is an error naming it);
//! shapes, autograd and the tracer work as in eager mode. A host read (`to_vec`, `item`,
//! moving to another device) runs the queue first, so every value read is the eager one;
//! the trace then continues lazily.
//!
//! `Lazy::stop` ends queueing and hands back the queue: `run_fills` runs its fills (`Full`,
//! `Arange`; buffers such as optimizer moments that the step creates and keeps must start
//! from those values when the compiled program first runs), `run_all` everything (the step
//! then behaves as if it had run eagerly); what is not run is dropped.

use crate::backend::{self, Buffer};
use crate::op::{Op, OutMeta};
use crate::shape::Layout;
use crate::storage::{Storage, StorageCell};
use crate::{Device, Error, Result};
use std::cell::RefCell;
use std::sync::Arc;

/// A buffer read through a layout, held alive.
struct Held {
    cell: Arc<StorageCell>,
    layout: Layout,
}

impl Buffer for Held {
    fn cell(&self) -> &Arc<StorageCell> {
        &self.cell
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
}

/// A kernel waiting to run, holding its inputs alive.
enum Pending {
    Out { op: Op, inputs: Vec<Held>, meta: OutMeta, device: Device, out: Arc<StorageCell> },
    InPlace { op: Op, dst: Held, src: Option<Held> },
}

fn held<B: Buffer + ?Sized>(b: &B) -> Held {
    Held { cell: b.cell().clone(), layout: b.layout().clone() }
}

/// The queue, and whether a flush ran part of it (the step then has eager effects).
#[derive(Default)]
struct Queue {
    jobs: Vec<Pending>,
    flushed: bool,
}

thread_local! {
    static QUEUE: RefCell<Option<Queue>> = const { RefCell::new(None) };
}

/// Queueing on this thread while it lives (dropped without `stop`, e.g. by a panic, it
/// drops the queue).
pub struct Lazy {
    /// The queue is per thread: the guard stays on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

/// What a trace queued, after `Lazy::stop`.
pub struct Stopped {
    jobs: Vec<Pending>,
    /// A flush (a host read, a device copy) ran the jobs queued before it.
    pub flushed: bool,
}

/// Starts queueing kernels on this thread. Not under anomaly detection, which reads every
/// value (then kernels run as usual); an error when a queue is already active (a compiled
/// step called inside another one's trace).
pub fn begin() -> Result<Lazy> {
    if active() {
        return Err(Error::Msg("compile: a compiled step was called while another step was being traced; call it outside".into()));
    }
    if !crate::is_anomaly_detection() {
        QUEUE.with(|q| *q.borrow_mut() = Some(Queue::default()));
    }
    Ok(Lazy { _not_send: std::marker::PhantomData })
}

/// Whether kernels are being queued on this thread.
pub fn active() -> bool {
    QUEUE.with(|q| q.borrow().is_some())
}

impl Lazy {
    /// Stops queueing; the queued kernels are returned, not run.
    pub fn stop(self) -> Stopped {
        let q = QUEUE.with(|q| q.borrow_mut().take()).unwrap_or_default();
        Stopped { jobs: q.jobs, flushed: q.flushed }
    }
}

impl Drop for Lazy {
    fn drop(&mut self) {
        QUEUE.with(|q| q.borrow_mut().take());
    }
}

impl Stopped {
    /// Runs every queued kernel in order: the step's effects happen as in eager mode.
    pub fn run_all(self) -> Result<()> {
        self.jobs.into_iter().try_for_each(|j| run(&j))
    }

    /// Runs only the fills (`Full`, `Arange`) of buffers the step creates and keeps, such as
    /// optimizer moments made on the first step, and drops the rest. A fill whose buffer
    /// nothing but its own job holds once the other jobs are dropped made a temporary: the
    /// compiled program computes it, so it is dropped too.
    /// Returns how many fills ran, of how many queued.
    pub fn run_fills(self) -> Result<(usize, usize)> {
        let fill = |p: &Pending| matches!(p, Pending::Out { op: Op::Full { .. } | Op::Arange { .. }, .. });
        let (fills, rest): (Vec<Pending>, Vec<Pending>) = self.jobs.into_iter().partition(fill);
        drop(rest);
        let kept = |p: &&Pending| matches!(p, Pending::Out { out, .. } if Arc::strong_count(out) > 1);
        let ran = fills.iter().filter(kept).map(run).collect::<Result<Vec<()>>>()?.len();
        Ok((ran, fills.len()))
    }
}

/// Runs every queued kernel now (before a host read); queueing goes on afterwards.
pub fn flush() -> Result<()> {
    let jobs = QUEUE.with(|q| {
        q.borrow_mut().as_mut().map(|q| {
            q.flushed |= !q.jobs.is_empty();
            std::mem::take(&mut q.jobs)
        })
    });
    jobs.unwrap_or_default().iter().try_for_each(run)
}

/// An error when `cell` is a trace's output that was never computed (on a GPU).
pub fn check_cell(cell: &StorageCell) -> Result<()> {
    crate::cuda::check_computed(&cell.read())
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
pub(crate) fn defer<B: Buffer>(op: &Op, inputs: &[&B], meta: &OutMeta, device: Device) -> Result<Option<Arc<StorageCell>>> {
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
    let job =
        Pending::Out { op: op.clone(), inputs: inputs.iter().copied().map(held).collect(), meta: meta.clone(), device, out: out.clone() };
    push(job);
    Ok(Some(out))
}

/// Queues an in-place update when lazy; returns whether it was queued.
pub(crate) fn defer_inplace<B: Buffer>(op: &Op, dst: &B, src: Option<&B>) -> bool {
    if !active() {
        return false;
    }
    dst.cell().count_write(); // autograd's saved-version checks see the write now, as in eager
    push(Pending::InPlace { op: op.clone(), dst: held(dst), src: src.map(held) });
    true
}

fn push(job: Pending) {
    QUEUE.with(|q| q.borrow_mut().as_mut().map(|q| q.jobs.push(job)));
}

fn run(job: &Pending) -> Result<()> {
    match job {
        Pending::Out { op, inputs, meta, device, out } => {
            let refs: Vec<&Held> = inputs.iter().collect();
            out.replace(backend::run(op, &refs, meta, *device)?);
            Ok(())
        }
        Pending::InPlace { op, dst, src } => backend::run_inplace(op, dst, src.as_ref(), false),
    }
}
