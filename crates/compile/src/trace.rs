//! The tracer: while a step runs for the first time (its kernels queued, see
//! `kiln_tensor::lazy`), it records every op with the
//! storages and layouts of its inputs and output, which storages it created, which leaves
//! (parameters) it saw, and any host read.

use kiln_tensor::storage::StorageCell;
use kiln_tensor::{DType, Flag, Layout, Op, Result, Tensor, Tracer};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// A tensor as an op saw it: which storage, read through which layout.
#[derive(Debug, Clone)]
pub struct TRef {
    pub storage: u64,
    pub layout: Layout,
    pub dtype: DType,
}

#[derive(Debug, Clone)]
pub struct Event {
    pub op: Op,
    pub inputs: Vec<TRef>,
    pub output: TRef,
}

/// What the trace knows about a storage.
pub struct StorageInfo {
    pub cell: Weak<StorageCell>,
    pub len: usize,
    pub dtype: DType,
    /// The event that created it, when it was made inside the step.
    pub created_by: Option<usize>,
}

/// A parameter's gradient when the step first touched it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradAtStart {
    Absent,
    Present,
    /// Set to None by the step (`zero_grad`) before anything read it: what it held when the
    /// step was called does not matter.
    Cleared,
}

#[derive(Default)]
pub struct Recording {
    pub events: Vec<Event>,
    pub storages: HashMap<u64, StorageInfo>,
    /// Leaves that require grad (parameters), with their gradient's state when first seen.
    pub leaves: Vec<(Tensor, GradAtStart)>,
    pub host_reads: Vec<String>,
    /// Flags read (train/eval modes), each once, with the value first read.
    pub flags: Vec<(Flag, bool)>,
}

pub struct Recorder {
    pub rec: RefCell<Recording>,
    pub fullgraph: bool,
    /// Tensors with this id or more were made inside the step: a leaf among them (an input
    /// detached to take its gradient, as adversarial training does) is a temporary of the
    /// step, not a parameter whose gradient outlives it and guards the graph.
    pub first_tensor: u64,
}

impl Recorder {
    fn tref(&self, t: &Tensor, created_by: Option<usize>) -> TRef {
        let mut rec = self.rec.borrow_mut();
        let id = t.storage().id();
        rec.storages.entry(id).or_insert_with(|| StorageInfo {
            cell: Arc::downgrade(t.storage()),
            len: t.storage().len(),
            dtype: t.dtype(),
            created_by,
        });
        drop(rec);
        self.first_sight(t, false);
        TRef { storage: id, layout: t.layout().clone(), dtype: t.dtype() }
    }

    /// Notes a parameter (a leaf requiring grad made before the trace) the first time the step
    /// touches it, with its gradient's state then (`cleared`: the step sets it to None).
    fn first_sight(&self, t: &Tensor, cleared: bool) {
        let parameter = t.is_leaf() && t.requires_grad() && t.id().0 < self.first_tensor;
        let mut rec = self.rec.borrow_mut();
        if parameter && !rec.leaves.iter().any(|(l, _)| l.id() == t.id()) {
            let grad = match (cleared, t.grad().is_some()) {
                (true, _) => GradAtStart::Cleared,
                (false, true) => GradAtStart::Present,
                (false, false) => GradAtStart::Absent,
            };
            rec.leaves.push((t.clone(), grad));
        }
    }
}

impl Tracer for Recorder {
    fn grad_set(&self, t: &Tensor, cleared: bool) {
        if cleared {
            self.first_sight(t, true);
        }
    }

    fn record(&self, op: &Op, inputs: &[&Tensor], output: &Tensor) {
        let index = self.rec.borrow().events.len();
        let ins: Vec<TRef> = inputs.iter().map(|t| self.tref(t, None)).collect();
        let out = self.tref(output, Some(index));
        self.rec.borrow_mut().events.push(Event { op: op.clone(), inputs: ins, output: out });
    }

    fn host_read(&self, what: &'static str, t: &Tensor) -> Result<()> {
        let msg = format!("{what} of a {:?} tensor inside the compiled step (after {} ops)", t.shape(), self.rec.borrow().events.len());
        self.rec.borrow_mut().host_reads.push(msg.clone());
        if self.fullgraph {
            return Err(kiln_tensor::Error::GraphBreak(format!(
                "{msg}; fullgraph forbids host reads: return the tensor from the step instead"
            )));
        }
        Ok(())
    }

    fn flag_read(&self, flag: &Flag, value: bool) {
        let mut rec = self.rec.borrow_mut();
        if !rec.flags.iter().any(|(f, _)| f.same(flag)) {
            rec.flags.push((flag.share(), value));
        }
    }
}
