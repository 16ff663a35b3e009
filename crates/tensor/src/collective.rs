//! Collectives: ops over the ranks of a process group (`Op::Collective`). A `Group` names the
//! ranks; its communication lives with the device back end that runs the op: a group of
//! threads in one process for CPU tensors (`cpu::collective`, the test and single-machine
//! back end), an NCCL communicator for CUDA tensors (`cuda::nccl`). Every rank runs the same
//! collectives with the same shapes and dtypes in the same order.

use std::sync::atomic::{AtomicU32, Ordering};

/// One rank's handle on a process group: which group, this rank, and how many ranks there are.
/// A plain value (ops carry it); the group's communication is found by `id` in the back end of
/// the tensor's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Group {
    pub id: u32,
    pub rank: usize,
    pub world: usize,
}

/// A new group id, unique in this process.
pub fn next_group_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What a collective does (PyTorch's `torch.distributed` calls of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank gets the elementwise reduction of the ranks' tensors.
    AllReduce(Reduction),
    /// Every rank gets rank `root`'s tensor.
    Broadcast { root: usize },
    /// The ranks' tensors stacked along dim 0 in rank order: `[world * n, ..]`.
    AllGather,
    /// The reduction over ranks (as `AllReduce`), cut along dim 0 into `world` equal parts:
    /// rank `r` gets part `r`, `[n / world, ..]`.
    ReduceScatter(Reduction),
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "all_reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter(_) => "reduce_scatter",
        }
    }

    /// The reduction, for the kinds that reduce.
    pub fn reduction(self) -> Option<Reduction> {
        match self {
            Collective::AllReduce(r) | Collective::ReduceScatter(r) => Some(r),
            Collective::Broadcast { .. } | Collective::AllGather => None,
        }
    }
}

/// How a collective combines the ranks' elements (`torch.distributed.ReduceOp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reduction {
    Sum,
    /// The sum divided by the world size (`ReduceOp.AVG`).
    Mean,
    Max,
    Min,
}

impl Reduction {
    /// Combines one element of every rank, in rank order.
    pub fn combine(self, values: impl Iterator<Item = f64>, world: usize) -> f64 {
        match self {
            Reduction::Sum => values.sum(),
            Reduction::Mean => values.sum::<f64>() / world as f64,
            Reduction::Max => values.fold(f64::NEG_INFINITY, f64::max),
            Reduction::Min => values.fold(f64::INFINITY, f64::min),
        }
    }
}
