//! kiln-distributed: data-parallel training. `ProcessGroup` (collectives between ranks: NCCL
//! between processes, threads within one), the rendezvous that starts it from the launcher's
//! environment (`torchrun`'s variables; `kiln-run` is Kiln's launcher), and `Ddp`,
//! `DistributedDataParallel`'s bucketed gradient averaging, eager or inside a compiled step.

pub mod ddp;
pub mod env;
pub mod group;
pub mod launch;
pub mod rendezvous;
pub mod zero;

pub use ddp::{plan_buckets, Bucket, Ddp, DdpOptions};
pub use env::DistEnv;
pub use group::{ProcessGroup, DEFAULT_TIMEOUT};
pub use kiln_tensor::collective::Reduction;
pub use rendezvous::rendezvous;
pub use zero::Zero1;
