//! `ProcessGroup`: one rank's view of the ranks that train together, and the collectives on
//! tensors between them (`torch.distributed`'s calls). Across processes the group is an NCCL
//! communicator over CUDA tensors, started by the rendezvous from the launcher's
//! environment (`from_env`); within one process, a thread group over CPU tensors
//! (`threads`), the way the data-parallel code is tested without GPUs.

use crate::env::DistEnv;
use kiln_tensor::collective::{Collective, Group, Reduction};
use kiln_tensor::{no_grad, DType, Device, Error, Result, Tensor};
use std::time::Duration;

/// How long a rank waits for the others at the rendezvous and in a thread group's collectives
/// (PyTorch's default process-group timeout is ten minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Threads,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Nccl,
}

/// One rank's handle on a process group. Dropping it ends this rank's part: a thread group's
/// other ranks then fail at once instead of waiting, an NCCL communicator is destroyed (or
/// aborted, when the thread is unwinding from a panic).
#[derive(Debug)]
pub struct ProcessGroup {
    group: Group,
    device: Device,
    backend: Backend,
}

impl ProcessGroup {
    /// The group of the launcher's environment (`kiln-run` or `torchrun`: `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), on GPU `LOCAL_RANK` over
    /// NCCL; without those variables a group of one rank on `device`. A CPU `device` is only
    /// possible alone: between processes Kiln's collectives run over NCCL.
    pub fn from_env(device: Device, timeout: Duration) -> Result<ProcessGroup> {
        let env = DistEnv::from_env()?;
        // Alone: a group of one on the device asked for.
        let local_rank = if let Device::Cuda(k) = device { k } else { 0 };
        let env = env.unwrap_or(DistEnv { rank: 0, world_size: 1, local_rank, master_addr: String::new(), master_port: 0 });
        match device {
            Device::Cpu if env.world_size == 1 => Ok(ProcessGroup::threads(1, timeout)?.remove(0)),
            Device::Cpu => Err(Error::Msg(format!(
                "ProcessGroup: {} ranks on the CPU: between processes Kiln's collectives run over NCCL, on CUDA devices \
                 (--device cuda); ranks that are threads of one process take ProcessGroup::threads",
                env.world_size
            ))),
            Device::Cuda(_) => nccl_group(&env, timeout),
        }
    }

    /// `world` ranks in this process, one for each thread, over CPU tensors.
    pub fn threads(world: usize, timeout: Duration) -> Result<Vec<ProcessGroup>> {
        let groups = kiln_tensor::cpu::collective::thread_group(world, timeout)?;
        Ok(groups.into_iter().map(|group| ProcessGroup { group, device: Device::Cpu, backend: Backend::Threads }).collect())
    }

    pub fn rank(&self) -> usize {
        self.group.rank
    }

    pub fn world_size(&self) -> usize {
        self.group.world
    }

    /// The device whose tensors the group's collectives take.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The plain handle that ops carry (`Tensor::collective`).
    pub fn group(&self) -> Group {
        self.group
    }

    fn run(&self, t: &Tensor, kind: Collective) -> Result<Tensor> {
        if t.device() != self.device {
            return Err(Error::Msg(format!(
                "{}: the tensor is on {:?}, rank {}'s group on {:?}",
                kind.name(),
                t.device(),
                self.rank(),
                self.device
            )));
        }
        t.collective(self.group, kind)
    }

    /// The elementwise reduction over the ranks of `t` (`dist.all_reduce`), as a new tensor.
    pub fn all_reduce(&self, t: &Tensor, op: Reduction) -> Result<Tensor> {
        self.run(t, Collective::AllReduce(op))
    }

    /// Rank `root`'s `t` on every rank (`dist.broadcast`).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.run(t, Collective::Broadcast { root })
    }

    /// The ranks' `t` stacked along dim 0 in rank order (`dist.all_gather_into_tensor`).
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Collective::AllGather)
    }

    /// This rank's part (along dim 0) of the reduction over ranks (`dist.reduce_scatter_tensor`).
    pub fn reduce_scatter(&self, t: &Tensor, op: Reduction) -> Result<Tensor> {
        self.run(t, Collective::ReduceScatter(op))
    }

    /// `t = all_reduce(t)` in place (the tensor keeps its storage: a parameter or a gradient).
    pub fn all_reduce_(&self, t: &Tensor, op: Reduction) -> Result<()> {
        no_grad(|| t.assign(&self.all_reduce(t, op)?))
    }

    /// `t = broadcast(t, root)` in place.
    pub fn broadcast_(&self, t: &Tensor, root: usize) -> Result<()> {
        no_grad(|| t.assign(&self.broadcast(t, root)?))
    }

    /// Returns once every rank has called it (a one-element all-reduce, read back).
    pub fn barrier(&self) -> Result<()> {
        let one = Tensor::ones(&[1], DType::F32, self.device)?;
        let n = self.all_reduce(&one, Reduction::Sum)?.to_vec::<f32>()?[0];
        if n as usize != self.world_size() {
            return Err(Error::Msg(format!("barrier: {n} ranks answered, the group has {}", self.world_size())));
        }
        Ok(())
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        match self.backend {
            Backend::Threads => kiln_tensor::cpu::collective::leave(&self.group),
            Backend::Nccl => end_nccl(&self.group),
        }
    }
}

#[cfg(feature = "cuda")]
fn nccl_group(env: &DistEnv, timeout: Duration) -> Result<ProcessGroup> {
    use crate::rendezvous::rendezvous;
    use kiln_tensor::cuda::nccl;
    let id = if env.world_size == 1 { nccl::unique_id()?.to_vec() } else { rendezvous(env, || Ok(nccl::unique_id()?.to_vec()), timeout)? };
    let id: [u8; nccl::UNIQUE_ID_BYTES] =
        id.try_into().map_err(|v: Vec<u8>| Error::Msg(format!("rendezvous: rank 0 sent {} bytes, not an NCCL id", v.len())))?;
    let group = nccl::init_group(env.local_rank, env.rank, env.world_size, id)?;
    Ok(ProcessGroup { group, device: Device::Cuda(env.local_rank), backend: Backend::Nccl })
}

#[cfg(not(feature = "cuda"))]
fn nccl_group(env: &DistEnv, timeout: Duration) -> Result<ProcessGroup> {
    let _ = timeout;
    Err(Error::Msg(format!(
        "ProcessGroup: rank {} of {} asks for NCCL, and Kiln was built without feature `cuda`",
        env.rank, env.world_size
    )))
}

#[cfg(feature = "cuda")]
fn end_nccl(group: &Group) {
    let _ = kiln_tensor::cuda::nccl::destroy_group(group, std::thread::panicking());
}

#[cfg(not(feature = "cuda"))]
fn end_nccl(_: &Group) {}
