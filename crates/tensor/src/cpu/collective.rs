//! Collectives over CPU tensors between the threads of one process: a thread group
//! (`thread_group`), one rank per thread, as PyTorch tests its distributed code with threads.
//! Each collective is one round: every rank leaves a row-major copy of its tensor, the last
//! to arrive completes the round, and each rank computes its own result from the copies in
//! rank order (so every rank gets the same bits). A rank that leaves the group or stays away
//! longer than the group's timeout ends the others' waits with an error.

use super::elementwise::map1;
use crate::collective::{next_group_id, Collective, Group, Reduction};
use crate::op::OutMeta;
use crate::shape::Layout;
use crate::storage::{CpuSlice, CpuStorage, IntoCpuStorage};
use crate::{with_cpu, Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One rank's contribution to a round: its shape and a row-major copy of its data.
type Deposit = (Vec<usize>, Arc<CpuStorage>);

#[derive(Default)]
struct Round {
    /// Rounds completed so far.
    done: u64,
    slots: Vec<Option<Deposit>>,
    /// The last completed round's deposits, in rank order (kept until the next completes,
    /// which needs every rank back, so each has read them by then).
    last: Vec<Deposit>,
    left: Vec<usize>,
}

struct Peers {
    world: usize,
    timeout: Duration,
    round: Mutex<Round>,
    wake: Condvar,
}

fn groups() -> &'static Mutex<HashMap<u32, Arc<Peers>>> {
    static GROUPS: OnceLock<Mutex<HashMap<u32, Arc<Peers>>>> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

fn peers(group: &Group) -> Result<Arc<Peers>> {
    let found = groups().lock().map_err(|_| Error::Msg("thread groups: a rank panicked".into()))?.get(&group.id).cloned();
    found.ok_or_else(|| {
        Error::Msg(format!(
            "group {} has no CPU back end: CPU tensors need a thread group (cpu::collective::thread_group); \
             an NCCL group takes CUDA tensors",
            group.id
        ))
    })
}

/// A group of `world` ranks in this process, one `Group` per rank, each for one thread. A rank
/// that waits longer than `timeout` for the others gets an error.
pub fn thread_group(world: usize, timeout: Duration) -> Result<Vec<Group>> {
    if world == 0 {
        return Err(Error::Msg("thread_group: a group needs at least one rank".into()));
    }
    let id = next_group_id();
    let round = Round { slots: vec![None; world], ..Round::default() };
    let p = Arc::new(Peers { world, timeout, round: Mutex::new(round), wake: Condvar::new() });
    groups().lock().map_err(|_| Error::Msg("thread groups: a rank panicked".into()))?.insert(id, p);
    Ok((0..world).map(|rank| Group { id, rank, world }).collect())
}

/// Marks `group.rank` gone (its thread ended, or failed): the others' collectives fail at once
/// instead of waiting out the timeout. Once every rank has left, the group is forgotten.
pub fn leave(group: &Group) {
    let Ok(p) = peers(group) else { return };
    let all_gone = match p.round.lock() {
        Ok(mut r) => {
            if !r.left.contains(&group.rank) {
                r.left.push(group.rank);
            }
            r.left.len() == p.world
        }
        Err(_) => false,
    };
    p.wake.notify_all();
    if all_gone {
        if let Ok(mut g) = groups().lock() {
            g.remove(&group.id);
        }
    }
}

impl Peers {
    /// Leaves `mine` for this round and returns every rank's deposit once all have come.
    fn exchange(&self, rank: usize, what: &str, mine: Deposit) -> Result<Vec<Deposit>> {
        let poisoned = || Error::Msg(format!("{what}: a rank of the thread group panicked"));
        let mut r = self.round.lock().map_err(|_| poisoned())?;
        let round = r.done;
        r.slots[rank] = Some(mine);
        if r.slots.iter().all(Option::is_some) {
            r.last = r.slots.iter_mut().map(|s| s.take().expect("every slot is filled")).collect();
            r.done += 1;
            self.wake.notify_all();
            return Ok(r.last.clone());
        }
        let deadline = Instant::now() + self.timeout;
        while r.done == round {
            if let Some(gone) = r.left.first() {
                return Err(Error::Msg(format!("{what} on rank {rank}: rank {gone} left the group before joining the collective")));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.world).filter(|&i| r.slots[i].is_none()).collect();
                return Err(Error::Msg(format!(
                    "{what} on rank {rank}: timed out after {:?} waiting for rank(s) {missing:?}",
                    self.timeout
                )));
            }
            r = self.wake.wait_timeout(r, deadline - now).map_err(|_| poisoned())?.0;
        }
        Ok(r.last.clone())
    }
}

/// Runs collective `kind` for `group.rank`, whose tensor is `x`.
pub fn run(group: &Group, kind: Collective, x: (&CpuStorage, &Layout), meta: &OutMeta) -> Result<CpuStorage> {
    let p = peers(group)?;
    let what = kind.name();
    let copy = with_cpu!(x.0, v => map1(v, x.1, |e| e).into_storage());
    let all = p.exchange(group.rank, what, (x.1.shape.clone(), Arc::new(copy)))?;
    for (i, (shape, s)) in all.iter().enumerate() {
        if shape != &x.1.shape || s.dtype() != x.0.dtype() {
            return Err(Error::shape(
                what,
                format!("rank {i} gave {:?} {shape:?}, rank {} gave {:?} {:?}", s.dtype(), group.rank, x.0.dtype(), x.1.shape),
            ));
        }
    }
    let parts: Vec<&CpuStorage> = all.iter().map(|(_, s)| &**s).collect();
    with_cpu!(x.0, v => combine(v, &parts, group, kind, meta).map(IntoCpuStorage::into_storage))
}

/// One rank's result from every rank's data (`_like` only names the element type).
fn combine<T: CpuSlice>(_like: &[T], parts: &[&CpuStorage], group: &Group, kind: Collective, meta: &OutMeta) -> Result<Vec<T>> {
    let data: Vec<&[T]> = parts.iter().map(|s| T::slice(s).expect("dtypes checked")).collect();
    let n = data[0].len();
    let reduce = |r: Reduction, range: std::ops::Range<usize>| -> Vec<T> {
        range.map(|i| T::from_f64(r.combine(data.iter().map(|d| d[i].to_f64()), group.world))).collect()
    };
    let out = match kind {
        Collective::AllReduce(r) => reduce(r, 0..n),
        Collective::Broadcast { root } => data[root].to_vec(),
        Collective::AllGather => data.concat(),
        Collective::ReduceScatter(r) => {
            let part = n / group.world;
            reduce(r, group.rank * part..(group.rank + 1) * part)
        }
    };
    debug_assert_eq!(out.len(), meta.shape.iter().product::<usize>());
    Ok(out)
}
