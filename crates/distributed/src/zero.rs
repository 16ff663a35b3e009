//! `Zero1`: ZeRO stage 1 (DeepSpeed's, and llm.c's): the optimizer's state split over the
//! ranks. Each dtype's gradients are one flat buffer, padded to a multiple of the world size
//! and reduce-scattered (averaged): rank `r` gets part `r`, updates its part of a flat copy of
//! the parameters with the inner optimizer (whose state is then a `1/world` share), and the
//! updated parts are all-gathered back into every parameter. The optimizer's memory shrinks
//! by the world size; the arithmetic is `Ddp`'s with the same optimizer.

use crate::ddp::{flat_grads, flatten, plan_buckets, scatter_back, Bucket, Owner};
use crate::group::ProcessGroup;
use kiln_nn::Module;
use kiln_optim::Optimizer;
use kiln_tensor::collective::{Collective, Group, Reduction};
use kiln_tensor::{no_grad, Error, Result, Tensor};

/// A data-parallel optimizer over a model whose state is split over the ranks.
pub struct Zero1<O> {
    group: Group,
    params: Vec<(String, Tensor)>,
    plain: Vec<Tensor>,
    /// One bucket per dtype, with its padding and this rank's part of the flat parameters.
    buckets: Vec<(Bucket, usize, Tensor)>,
    inner: O,
    max_grad_norm: Option<f64>,
}

impl<O: Optimizer> Zero1<O> {
    /// Copies rank 0's parameters to every rank, cuts them into parts and makes the inner
    /// optimizer over this rank's parts (`make`, e.g. `|p| AdamW::new(p, config)`). With
    /// `max_grad_norm`, each step first clips the averaged gradients to that global norm (as
    /// `clip_grad_norm` over all parameters would).
    pub fn new<M: Module + ?Sized>(
        model: &M,
        pg: &ProcessGroup,
        max_grad_norm: Option<f64>,
        make: impl FnOnce(Vec<Tensor>) -> Result<O>,
    ) -> Result<Zero1<O>> {
        let params: Vec<(String, Tensor)> = model.named_parameters().into_iter().filter(|(_, p)| p.requires_grad()).collect();
        let (rank, world) = (pg.rank(), pg.world_size());
        let sizes: Vec<_> = params.iter().map(|(_, p)| (p.numel(), p.dtype())).collect();
        let mut buckets = Vec::new();
        no_grad(|| -> Result<()> {
            for (_, p) in &params {
                pg.broadcast_(p, 0)?;
            }
            for b in plan_buckets(&sizes, usize::MAX, usize::MAX) {
                let n = b.slots(&params).1;
                let (per, pad) = (n.div_ceil(world), n.div_ceil(world) * world - n);
                let flat: Vec<Tensor> = b.params.iter().map(|&i| params[i].1.reshape(&[params[i].1.numel()])).collect::<Result<_>>()?;
                let all = flatten(&params, &b, flat, pad)?;
                let part = all.narrow(0usize, rank * per, per)?.contiguous()?.detach();
                part.set_requires_grad(true);
                buckets.push((b, pad, part));
            }
            Ok(())
        })?;
        let inner = make(buckets.iter().map(|(_, _, part)| part.clone()).collect())?;
        let plain = params.iter().map(|(_, p)| p.clone()).collect();
        Ok(Zero1 { group: pg.group(), params, plain, buckets, inner, max_grad_norm })
    }

    /// The inner optimizer (over this rank's parts).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// Scales this rank's averaged gradient parts so that the global norm is at most `max`.
    fn clip(&self, max: f64) -> Result<()> {
        let mut sq: Option<Tensor> = None;
        for (_, _, part) in &self.buckets {
            let g = part.grad().ok_or_else(|| Error::Msg("Zero1: a part lost its gradient".into()))?;
            let s = g.to_dtype(kiln_tensor::DType::F32)?.square()?.sum_all()?.reshape(&[1])?;
            sq = Some(match sq {
                Some(t) => t.add(&s)?,
                None => s,
            });
        }
        let Some(sq) = sq else { return Ok(()) };
        let total = sq.collective(self.group, Collective::AllReduce(Reduction::Sum))?.sqrt()?;
        let coef = kiln_optim::clip_coefficient(&total, max)?;
        for (_, _, part) in &self.buckets {
            let g = part.grad().expect("checked above");
            g.mul_(&coef.to_dtype(g.dtype())?)?;
        }
        Ok(())
    }
}

impl<O: Optimizer> Optimizer for Zero1<O> {
    /// Reduce-scatters the gradients, steps the inner optimizer on this rank's parts and
    /// all-gathers the updated parts into the parameters.
    fn step(&mut self) -> Result<()> {
        no_grad(|| {
            for (b, pad, part) in &self.buckets {
                let flat = flat_grads(&self.params, b, Owner::Zero1, self.group.rank, *pad)?;
                part.set_grad(Some(flat.collective(self.group, Collective::ReduceScatter(Reduction::Mean))?));
            }
            if let Some(max) = self.max_grad_norm {
                self.clip(max)?;
            }
            self.inner.step()?;
            for (b, _, part) in &self.buckets {
                let all = part.collective(self.group, Collective::AllGather)?;
                scatter_back(&self.params, b, &all, |p, new| p.assign(&new))?;
            }
            Ok(())
        })
    }

    fn zero_grad_with(&mut self, set_to_none: bool) -> Result<()> {
        for p in &self.plain {
            match p.grad() {
                Some(g) if !set_to_none => no_grad(|| g.zero_())?,
                _ => p.set_grad(None),
            }
        }
        self.inner.zero_grad_with(set_to_none)
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.inner.set_lr(lr)
    }

    /// The model's parameters (the inner optimizer holds this rank's parts of them).
    fn params(&self) -> &[Tensor] {
        &self.plain
    }

    /// This rank's share of the state (each rank's differs: save one file per rank).
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.inner.state_tensors()
    }

    fn load_state_tensors(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        self.inner.load_state_tensors(tensors)
    }
}
