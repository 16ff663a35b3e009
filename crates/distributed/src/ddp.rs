//! `Ddp`: data-parallel training as PyTorch's `DistributedDataParallel` does it. Every rank
//! holds the whole model and trains on its own part of the batch; the parameters start equal
//! (broadcast from rank 0) and stay equal because every rank applies the same averaged
//! gradients. The gradients travel in buckets (PyTorch's plan: about 25 MiB each, filled in
//! reverse parameter order, where the backward produces them first, a small first bucket,
//! one dtype per bucket), each bucket one flat all-reduce, started as soon as its last
//! gradient is in. Under `compile`, those all-reduces are nodes of the step's graph, placed
//! inside the backward where their gradients are ready and captured into its CUDA graph.

use crate::group::ProcessGroup;
use kiln_autograd::{register_post_accumulate_grad_hook, HookHandle};
use kiln_nn::Module;
use kiln_tensor::collective::{Collective, Group, Reduction};
use kiln_tensor::{no_grad, DType, Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// `Ddp`'s settings, PyTorch's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct DdpOptions {
    /// A bucket closes once it holds this many MiB of gradients.
    pub bucket_cap_mb: f64,
    /// The first bucket's cap (the gradients the backward makes first start travelling early).
    pub first_bucket_mb: f64,
    /// Parameters the loss did not use get zero gradients in the all-reduce instead of an
    /// error (the other ranks may have used them).
    pub find_unused_parameters: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions { bucket_cap_mb: 25.0, first_bucket_mb: 1.0, find_unused_parameters: false }
    }
}

/// Gradients all-reduced together: positions in the parameter list, their dtype, their bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub params: Vec<usize>,
    pub dtype: DType,
    pub bytes: usize,
}

/// PyTorch's bucket assignment: parameters (`(elements, dtype)` each) taken in reverse order,
/// one open bucket per dtype, a bucket closed once it reaches its cap (`first_cap` bytes for
/// a dtype's first bucket, `cap` after), buckets in the order of their first parameter.
pub fn plan_buckets(params: &[(usize, DType)], cap: usize, first_cap: usize) -> Vec<Bucket> {
    let mut closed: Vec<Bucket> = Vec::new();
    let mut open: Vec<Bucket> = Vec::new();
    let mut firsts_done: Vec<DType> = Vec::new();
    for i in (0..params.len()).rev() {
        let (n, dtype) = params[i];
        let at = match open.iter().position(|b| b.dtype == dtype) {
            Some(at) => at,
            None => {
                open.push(Bucket { params: Vec::new(), dtype, bytes: 0 });
                open.len() - 1
            }
        };
        open[at].params.push(i);
        open[at].bytes += n * dtype.size_in_bytes();
        let limit = if firsts_done.contains(&dtype) { cap } else { first_cap };
        if open[at].bytes >= limit {
            closed.push(open.remove(at));
            if !firsts_done.contains(&dtype) {
                firsts_done.push(dtype);
            }
        }
    }
    closed.extend(open);
    // In the order the reversed walk met each bucket's first parameter.
    closed.sort_by_key(|b| std::cmp::Reverse(b.params[0]));
    closed
}

/// A model made data-parallel over a process group (`DistributedDataParallel`). Train as
/// usual and call `sync_gradients` between `backward` and the optimizer's step. During the
/// backward, each bucket's all-reduce starts as soon as the last of its gradients is in
/// (buckets in order, the same on every rank; `register_post_accumulate_grad_hook`);
/// `sync_gradients` starts the rest and hands every parameter its averaged gradient.
pub struct Ddp {
    shared: Arc<Shared>,
    device: Device,
    _hooks: Vec<HookHandle>,
}

/// What the gradient hooks and `sync_gradients` share.
struct Shared {
    group: Group,
    params: Vec<(String, Tensor)>,
    buckets: Vec<Bucket>,
    options: DdpOptions,
    skip: AtomicBool,
    flight: Mutex<Flight>,
}

/// The buckets of the backward in progress.
#[derive(Default)]
struct Flight {
    /// Gradients in, per bucket.
    ready: Vec<usize>,
    /// Buckets whose all-reduce has started (always a prefix: they start in order).
    started: usize,
    reduced: Vec<Option<Tensor>>,
    /// A second backward came before `sync_gradients`: the early all-reduces missed part of
    /// the gradients, so `sync_gradients` runs them all again.
    stale: bool,
}

impl Ddp {
    /// Takes `model`'s parameters, copies rank 0's parameters and buffers to every rank, plans
    /// the buckets and hooks the parameters' gradients. Every rank calls it with the same model.
    pub fn new<M: Module + ?Sized>(model: &M, pg: &ProcessGroup, options: DdpOptions) -> Result<Ddp> {
        let params: Vec<(String, Tensor)> = model.named_parameters().into_iter().filter(|(_, p)| p.requires_grad()).collect();
        let mut state = params.clone();
        model.visit_buffers("", &mut |name, t| state.push((name, t.clone())));
        for (name, t) in &state {
            if t.device() != pg.device() {
                return Err(Error::Msg(format!(
                    "Ddp: '{name}' is on {:?}, rank {}'s process group on {:?}",
                    t.device(),
                    pg.rank(),
                    pg.device()
                )));
            }
            pg.broadcast_(t, 0)?;
        }
        let mib = |m: f64| (m * 1024.0 * 1024.0) as usize;
        let sizes: Vec<(usize, DType)> = params.iter().map(|(_, p)| (p.numel(), p.dtype())).collect();
        let buckets = plan_buckets(&sizes, mib(options.bucket_cap_mb), mib(options.first_bucket_mb));
        let flight = Flight { ready: vec![0; buckets.len()], reduced: vec![None; buckets.len()], ..Flight::default() };
        let shared =
            Arc::new(Shared { group: pg.group(), params, buckets, options, skip: AtomicBool::new(false), flight: Mutex::new(flight) });
        let mut hooks = Vec::new();
        for (k, b) in shared.buckets.iter().enumerate() {
            for &i in &b.params {
                let s = shared.clone();
                hooks.push(register_post_accumulate_grad_hook(&shared.params[i].1, move |_| s.gradient_in(k)));
            }
        }
        Ok(Ddp { shared, device: pg.device(), _hooks: hooks })
    }

    /// The parameters, in the model's order, with their names.
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.shared.params
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.shared.buckets
    }

    /// The buckets, one line each: how many parameters, their bytes, the first and last names.
    pub fn explain(&self) -> String {
        let s = &self.shared;
        let mut out = format!("Ddp over {} ranks on {:?}: {} buckets\n", s.group.world, self.device, s.buckets.len());
        for (k, b) in s.buckets.iter().enumerate() {
            let (first, last) = (&s.params[b.params[0]].0, &s.params[*b.params.last().expect("a bucket is never empty")].0);
            let mib = b.bytes as f64 / (1024.0 * 1024.0);
            out += &format!("  bucket {k}: {} params, {mib:.2} MiB {:?}, {first} .. {last}\n", b.params.len(), b.dtype);
        }
        out
    }

    /// Buckets whose all-reduce has started since the last `sync_gradients` (for logs and
    /// tests: during a backward, the buckets whose gradients are all in).
    pub fn started(&self) -> usize {
        self.shared.flight.lock().map_or(0, |f| f.started)
    }

    /// Runs `f` (forward and backward of a micro-batch) without averaging gradients across
    /// ranks: no bucket starts in its backward and `sync_gradients` inside it does nothing, so
    /// gradients accumulate locally until a step outside it (`no_sync`).
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        let before = self.shared.skip.swap(true, Ordering::SeqCst);
        let out = f();
        self.shared.skip.store(before, Ordering::SeqCst);
        out
    }

    /// Averages every parameter's gradient over the ranks: the buckets not started during
    /// the backward start now, and every parameter gets its part of its bucket's result. After
    /// it every rank holds the same gradients. Call it after `backward`, before the optimizer's
    /// step.
    pub fn sync_gradients(&self) -> Result<()> {
        let s = &self.shared;
        if s.skip.load(Ordering::SeqCst) {
            return Ok(());
        }
        no_grad(|| {
            let mut f = s.flight.lock().map_err(|_| Error::Msg("Ddp: a gradient hook panicked".into()))?;
            if std::mem::take(&mut f.stale) {
                f.started = 0;
            }
            s.start_in_order(&mut f, true)?;
            for (k, b) in s.buckets.iter().enumerate() {
                let mean = f.reduced[k].take().expect("every bucket was reduced");
                scatter_back(&s.params, b, &mean, |p, part| {
                    p.set_grad(Some(part));
                    Ok(())
                })?;
            }
            f.started = 0;
            f.ready.iter_mut().for_each(|r| *r = 0);
            Ok(())
        })
    }
}

impl Shared {
    /// A gradient of bucket `k` is in: starts every bucket, in order, whose gradients all are.
    fn gradient_in(&self, k: usize) -> Result<()> {
        if self.skip.load(Ordering::SeqCst) {
            return Ok(());
        }
        let mut f = self.flight.lock().map_err(|_| Error::Msg("Ddp: a gradient hook panicked".into()))?;
        f.ready[k] += 1;
        if f.ready[k] > self.buckets[k].params.len() {
            f.stale = true;
        }
        if f.stale {
            return Ok(());
        }
        no_grad(|| self.start_in_order(&mut f, false))
    }

    /// Starts the buckets after the last started one, in order: all of them with `all`, else
    /// while the next one has all its gradients in.
    fn start_in_order(&self, f: &mut Flight, all: bool) -> Result<()> {
        while f.started < self.buckets.len() && (all || f.ready[f.started] == self.buckets[f.started].params.len()) {
            let k = f.started;
            f.reduced[k] = Some(self.reduce(k)?);
            f.started += 1;
        }
        Ok(())
    }

    /// The all-reduced mean of bucket `k`'s gradients, flat.
    fn reduce(&self, k: usize) -> Result<Tensor> {
        let owner = Owner::Ddp { find_unused_parameters: self.options.find_unused_parameters };
        let flat = flat_grads(&self.params, &self.buckets[k], owner, self.group.rank, 0)?;
        flat.collective(self.group, Collective::AllReduce(Reduction::Mean))
    }
}

/// The byte alignment of each parameter's slot in a flat bucket: a fresh buffer's. A compiled
/// step writes a weight's gradient product straight into its slot; on a GPU, cuBLASLt picks its
/// algorithm by the output's alignment, and another algorithm sums in another order, so an
/// unaligned slot would change the gradient's last bits against the run without `Ddp`.
pub const SLOT_ALIGN_BYTES: usize = 256;

impl Bucket {
    /// Where each of the bucket's parameters (`params[i]`'s element counts) starts in the
    /// flat bucket, in elements, each on `SLOT_ALIGN_BYTES`, and the flat length.
    pub fn slots(&self, params: &[(String, Tensor)]) -> (Vec<usize>, usize) {
        let align = (SLOT_ALIGN_BYTES / self.dtype.size_in_bytes()).max(1);
        let mut at = 0;
        let starts = self
            .params
            .iter()
            .map(|&i| {
                let start = at;
                at = (start + params[i].1.numel()).next_multiple_of(align);
                start
            })
            .collect();
        (starts, at)
    }
}

/// `parts` (one flat tensor a parameter of bucket `b`) laid out in the bucket's slots, zeros
/// between them and `pad` more after.
pub(crate) fn flatten(params: &[(String, Tensor)], b: &Bucket, parts: Vec<Tensor>, pad: usize) -> Result<Tensor> {
    let (starts, len) = b.slots(params);
    let device = params[b.params[0]].1.device();
    let mut flat = Vec::with_capacity(2 * parts.len() + 1);
    for (k, part) in parts.into_iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(len);
        let gap = end - starts[k] - part.numel();
        flat.push(part);
        if gap > 0 {
            flat.push(Tensor::zeros(&[gap], b.dtype, device)?);
        }
    }
    if pad > 0 {
        flat.push(Tensor::zeros(&[pad], b.dtype, device)?);
    }
    if flat.len() == 1 {
        return Ok(flat.remove(0));
    }
    Tensor::cat(&flat.iter().collect::<Vec<_>>(), 0usize)
}

/// Who flattens a bucket's gradients, which decides what a missing gradient is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Owner {
    /// `Ddp`: with `find_unused_parameters`, a missing gradient reads as zeros.
    Ddp {
        find_unused_parameters: bool,
    },
    Zero1,
}

/// The gradients of bucket `b`'s parameters in one flat tensor (`flatten`), followed by `pad`
/// zeros; a parameter without a gradient reads as zeros where `owner` allows, else is an error
/// naming it (on `rank`).
pub(crate) fn flat_grads(params: &[(String, Tensor)], b: &Bucket, owner: Owner, rank: usize, pad: usize) -> Result<Tensor> {
    let who = match owner {
        Owner::Ddp { .. } => "Ddp",
        Owner::Zero1 => "Zero1",
    };
    let mut flat = Vec::with_capacity(b.params.len());
    for &i in &b.params {
        let (name, p) = &params[i];
        let g = match (p.grad(), owner) {
            (Some(g), _) => g,
            (None, Owner::Ddp { find_unused_parameters: true }) => p.zeros_like()?,
            (None, _) => {
                let hint = if matches!(owner, Owner::Ddp { .. }) { "pass find_unused_parameters: true, or " } else { "" };
                return Err(Error::Msg(format!(
                    "{who}: '{name}' has no gradient on rank {rank} after backward (the loss did not use it): {hint}leave it out of the model"
                )));
            }
        };
        if g.dtype() != b.dtype || g.shape() != p.shape() {
            let (gd, gs, ps) = (g.dtype(), g.shape().to_vec(), p.shape().to_vec());
            return Err(Error::Msg(format!("{who}: '{name}''s gradient is {gd:?} {gs:?}, the parameter {:?} {ps:?}", b.dtype)));
        }
        flat.push(g.reshape(&[p.numel()])?);
    }
    flatten(params, b, flat, pad)
}

/// Hands each parameter of bucket `b` its slot of `flat` (`Bucket::slots`), shaped as the
/// parameter.
pub(crate) fn scatter_back(
    params: &[(String, Tensor)],
    b: &Bucket,
    flat: &Tensor,
    mut give: impl FnMut(&Tensor, Tensor) -> Result<()>,
) -> Result<()> {
    for (&i, at) in b.params.iter().zip(b.slots(params).0) {
        let p = &params[i].1;
        give(p, flat.narrow(0usize, at, p.numel())?.reshape(p.shape())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_pytorch_s_plan() {
        let f = DType::F32;
        // Six parameters of 1 KiB (256 floats): caps of 2 KiB after a first of 1 KiB.
        let b = plan_buckets(&[(256, f); 6], 2048, 1024);
        let groups: Vec<Vec<usize>> = b.iter().map(|b| b.params.clone()).collect();
        assert_eq!(groups, vec![vec![5], vec![4, 3], vec![2, 1], vec![0]]);
        assert_eq!(b.iter().map(|b| b.bytes).collect::<Vec<_>>(), vec![1024, 2048, 2048, 1024]);
        // Dtypes never share a bucket; each dtype has its own small first bucket.
        let h = DType::BF16;
        let b = plan_buckets(&[(256, f), (512, h), (256, f), (512, h), (512, h)], 2048, 1024);
        let got: Vec<(Vec<usize>, DType)> = b.iter().map(|b| (b.params.clone(), b.dtype)).collect();
        assert_eq!(got, vec![(vec![4], h), (vec![3, 1], h), (vec![2], f), (vec![0], f)]);
        // A parameter larger than the cap is a bucket of its own.
        let b = plan_buckets(&[(10, f), (100_000, f), (10, f)], 4096, 4096);
        assert_eq!(b.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![2, 1], vec![0]]);
    }

    #[test]
    fn slots_start_on_256_bytes_and_flatten_fills_the_gaps_with_zeros() {
        let params: Vec<(String, Tensor)> = [3usize, 64, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("p{i}"), Tensor::full((i + 1) as f64, &[n], DType::F32, kiln_tensor::Device::Cpu).unwrap()))
            .collect();
        let b = Bucket { params: vec![2, 0, 1], dtype: DType::F32, bytes: 68 * 4 };
        // 256 bytes are 64 floats: p2 at 0, p0 at 64, p1 at 128; 192 in all.
        assert_eq!(b.slots(&params), (vec![0, 64, 128], 192));
        let parts = b.params.iter().map(|&i| params[i].1.clone()).collect();
        let flat = flatten(&params, &b, parts, 8).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(flat.len(), 200);
        let want = |i: usize| match i {
            0 => 3.0,
            64..=66 => 1.0,
            128..=191 => 2.0,
            _ => 0.0,
        };
        assert!(flat.iter().enumerate().all(|(i, &v)| v == want(i)), "{flat:?}");
        let mut back = Vec::new();
        scatter_back(&params, &b, &Tensor::from_vec(flat, &[200], kiln_tensor::Device::Cpu).unwrap(), |p, part| {
            back.push((p.numel(), part.to_vec::<f32>()?));
            Ok(())
        })
        .unwrap();
        assert_eq!(back, vec![(1, vec![3.0]), (3, vec![1.0; 3]), (64, vec![2.0; 64])]);
    }
}
