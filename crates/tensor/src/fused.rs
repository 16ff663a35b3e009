//! Hand-fused eager kernels where a chain of primitives would make many passes over memory.
//! Each has a plain reference: the primitive-op path its caller also keeps (and uses while a
//! tracer is active, so compiled steps see primitives). Tests compare the two. Also the one
//! kernel compile runs that writes two buffers (`layer_norm_grads_with_copy`).

use crate::op::{Fused, InMeta, Op, Part, Parts};
use crate::storage::{CpuSlice, Storage};
use crate::{backend, Device, Error, Layout, Result, Tensor};
use rayon::prelude::*;

/// One Adam/AdamW update's scalars, already folded on the host.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Adam's L2 term: `g += l2 * p` (0 for AdamW).
    pub l2: f64,
    /// AdamW's decoupled decay factor `1 - lr * weight_decay` (1 for Adam).
    pub decay: f64,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f64,
}

/// Whether fused kernels may run: outside a trace, on distinct contiguous buffers of one
/// float dtype, shape and device (`cuda`: a GPU; else the CPU, F32/F64 only).
fn fusable(ts: &[&Tensor], cuda: bool) -> bool {
    let first = ts[0];
    let device_ok = if cuda { first.device().is_cuda() } else { first.device() == Device::Cpu };
    let dtype_ok = if cuda { first.dtype().is_float() } else { matches!(first.dtype(), crate::DType::F32 | crate::DType::F64) };
    !crate::tensor::is_tracing()
        && device_ok
        && dtype_ok
        && ts.iter().all(|t| t.device() == first.device() && t.is_contiguous() && t.shape() == first.shape() && t.dtype() == first.dtype())
        && ts.iter().enumerate().all(|(i, a)| ts[i + 1..].iter().all(|b| !a.same_storage(b)))
}

pub use crate::cuda::kernels::adam::AdamHyper;

/// One parameter's tensors for the fused Adam update.
pub struct AdamTensors<'a> {
    pub p: &'a Tensor,
    pub g: &'a Tensor,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    /// AMSGrad's running maximum of `v`.
    pub vmax: Option<&'a Tensor>,
}

impl AdamTensors<'_> {
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        [self.p, self.g, self.m, self.v].into_iter().chain(self.vmax)
    }
}

/// The one-pass update on a GPU for every parameter in `items` that qualifies, in
/// multi-tensor launches (up to 16 parameters each), reading `(lr, step)` (0-dim F64 on the
/// same GPU) there, so the host never waits. Says which parameters it updated; the caller
/// runs its primitive-op path for the others.
pub fn adam_step_device_(items: &[AdamTensors<'_>], (lr, step): (&Tensor, &Tensor), h: AdamHyper) -> Result<Vec<bool>> {
    let scalars_ok = |p: &Tensor| [lr, step].iter().all(|t| t.dtype() == crate::DType::F64 && t.numel() == 1 && t.device() == p.device());
    let ok: Vec<bool> = items.iter().map(|it| fusable(&it.tensors().collect::<Vec<_>>(), true) && scalars_ok(it.p)).collect();
    #[cfg(feature = "cuda")]
    {
        let chosen: Vec<&AdamTensors<'_>> = items.iter().zip(&ok).filter(|(_, &o)| o).map(|(it, _)| it).collect();
        if chosen.is_empty() {
            return Ok(ok);
        }
        chosen.iter().flat_map(|it| it.tensors()).chain([lr, step]).try_for_each(|t| crate::lazy::check_cell(t.storage()))?;
        adam_device_batches(&chosen, (lr, step), h)?;
        Ok(ok)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = h;
        Ok(vec![false; ok.len()])
    }
}

/// The fused Adam update of every parameter in `items` (checked by the caller: contiguous,
/// one dtype, shape and GPU per parameter), in launches of up to `ADAM_MAX_TENSORS`
/// parameters of one dtype and AMSGrad setting whose storages are all distinct (each launch
/// holds every buffer's lock).
#[cfg(feature = "cuda")]
fn adam_device_batches(items: &[&AdamTensors<'_>], scalars: (&Tensor, &Tensor), h: AdamHyper) -> Result<()> {
    use crate::cuda::kernels::adam::ADAM_MAX_TENSORS;
    let mut batch: Vec<&AdamTensors<'_>> = Vec::new();
    for &it in items {
        let fits = batch.first().is_none_or(|b| b.p.dtype() == it.p.dtype() && b.vmax.is_some() == it.vmax.is_some())
            && batch.len() < ADAM_MAX_TENSORS
            && batch.iter().all(|b| b.tensors().all(|x| it.tensors().all(|y| !x.same_storage(y))));
        if !fits {
            adam_device_launch(&batch, scalars, h)?;
            batch.clear();
        }
        batch.push(it);
    }
    adam_device_launch(&batch, scalars, h)
}

/// One launch over `batch` (distinct storages, one dtype and AMSGrad setting), every buffer
/// locked until the launch is queued.
#[cfg(feature = "cuda")]
fn adam_device_launch(batch: &[&AdamTensors<'_>], (lr, step): (&Tensor, &Tensor), h: AdamHyper) -> Result<()> {
    use crate::cuda::kernels::adam::{adam_launch, AdamBuffers};
    let Some(first) = batch.first() else { return Ok(()) };
    let Device::Cuda(ordinal) = first.p.device() else { return Err(crate::Error::Msg("adam_step: expected CUDA tensors".into())) };
    let address = |s: &Storage, t: &Tensor| match s {
        Storage::Cuda(c) => Ok(c.ptr_at(t.layout().offset)),
        Storage::Cpu(_) => Err(crate::Error::Msg("adam_step: expected CUDA tensors".into())),
    };
    let (mut writes, mut reads, mut parts) = (Vec::new(), Vec::new(), Vec::new());
    for it in batch {
        let (ps, ms, vs) = (it.p.storage().write(), it.m.storage().write(), it.v.storage().write());
        let gs = it.g.storage().read();
        let mut b = AdamBuffers { n: it.p.numel() as i64, p: address(&ps, it.p)?, g: address(&gs, it.g)?, m: 0, v: 0, vmax: 0 };
        (b.m, b.v) = (address(&ms, it.m)?, address(&vs, it.v)?);
        if let Some(x) = it.vmax {
            let xs = x.storage().write();
            b.vmax = address(&xs, x)?;
            writes.push(xs);
        }
        writes.extend([ps, ms, vs]);
        reads.push(gs);
        parts.push(b);
    }
    let (ls, ss) = (lr.storage().read(), step.storage().read());
    let scalars = (address(&ls, lr)?, address(&ss, step)?);
    adam_launch(ordinal, (first.p.dtype(), first.vmax.is_some()), &parts, scalars, h)
}

/// `p, m, v (, vmax)` updated in one pass from `g`. Returns `Ok(false)` (nothing written) when
/// the tensors do not qualify; the caller then runs its primitive-op path.
pub fn adam_step_(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, vmax: Option<&Tensor>, s: AdamStep) -> Result<bool> {
    let mut all = vec![p, g, m, v];
    all.extend(vmax);
    if !fusable(&all, false) {
        return Ok(false);
    }
    match p.dtype() {
        crate::DType::F32 => adam_typed::<f32>(p, g, m, v, vmax, s)?,
        _ => adam_typed::<f64>(p, g, m, v, vmax, s)?,
    }
    Ok(true)
}

/// The element types the fused update runs on, computing in their own precision with the
/// op table's float arithmetic.
trait AdamFloat: CpuSlice + crate::op::Float {}
impl AdamFloat for f32 {}
impl AdamFloat for f64 {}

fn slice_mut<'a, T: CpuSlice>(s: &'a mut Storage, t: &Tensor) -> Result<&'a mut [T]> {
    let n = t.numel();
    let off = t.layout().offset;
    match s {
        Storage::Cpu(c) => {
            T::slice_mut(c).map(|v| &mut v[off..off + n]).ok_or_else(|| crate::Error::Msg("adam_step_: dtype mismatch".into()))
        }
        #[cfg(feature = "cuda")]
        Storage::Cuda(_) => Err(crate::Error::Msg("adam_step_: CUDA tensor".into())),
    }
}

fn adam_typed<T: AdamFloat>(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, vmax: Option<&Tensor>, s: AdamStep) -> Result<()> {
    let (mut ps, mut ms, mut vs) = (p.storage().write(), m.storage().write(), v.storage().write());
    let mut xs = vmax.map(|t| t.storage().write());
    let gs = g.storage().read();
    let gv: &[T] = {
        let c = gs.as_cpu()?;
        let all = T::slice(c).ok_or_else(|| crate::Error::Msg("adam_step_: dtype mismatch".into()))?;
        &all[g.layout().offset..g.layout().offset + g.numel()]
    };
    let (pv, mv, vv) = (slice_mut::<T>(&mut ps, p)?, slice_mut::<T>(&mut ms, m)?, slice_mut::<T>(&mut vs, v)?);
    let xv = match (&mut xs, vmax) {
        (Some(x), Some(t)) => Some(slice_mut::<T>(x, t)?),
        _ => None,
    };
    let k = Consts {
        b1: T::c(s.beta1),
        b2: T::c(s.beta2),
        c1: T::c(1.0 - s.beta1),
        c2: T::c(1.0 - s.beta2),
        eps: T::c(s.eps),
        l2: T::c(s.l2),
        decay: T::c(s.decay),
        step: T::c(s.step_size),
        bc2: T::c(s.bc2_sqrt),
    };
    // NOTE: chunks of 16K elements keep each worker's slices in its own cache.
    const CHUNK: usize = 1 << 14;
    if pv.len() < crate::cpu::PAR_THRESHOLD {
        adam_chunk(pv, mv, vv, xv, gv, &k);
    } else if let Some(x) = xv {
        let parts = pv.par_chunks_mut(CHUNK).zip(mv.par_chunks_mut(CHUNK)).zip(vv.par_chunks_mut(CHUNK)).zip(x.par_chunks_mut(CHUNK));
        parts.zip(gv.par_chunks(CHUNK)).for_each(|((((p, m), v), x), g)| adam_chunk(p, m, v, Some(x), g, &k));
    } else {
        let parts = pv.par_chunks_mut(CHUNK).zip(mv.par_chunks_mut(CHUNK)).zip(vv.par_chunks_mut(CHUNK));
        parts.zip(gv.par_chunks(CHUNK)).for_each(|(((p, m), v), g)| adam_chunk(p, m, v, None, g, &k));
    }
    Ok(())
}

struct Consts<T> {
    b1: T,
    b2: T,
    c1: T,
    c2: T,
    eps: T,
    l2: T,
    decay: T,
    step: T,
    bc2: T,
}

/// The update over one chunk, written as zipped slices so the compiler vectorises it.
fn adam_chunk<T: AdamFloat>(p: &mut [T], m: &mut [T], v: &mut [T], x: Option<&mut [T]>, g: &[T], k: &Consts<T>) {
    let moments = |p: &mut T, m: &mut T, v: &mut T, g: T| {
        let grad = g + k.l2 * *p;
        *p = *p * k.decay;
        *m = k.b1 * *m + k.c1 * grad;
        *v = k.b2 * *v + k.c2 * grad * grad;
    };
    match x {
        None => {
            for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                moments(p, m, v, g);
                *p = *p - k.step * *m / (v.sqrt() / k.bc2 + k.eps);
            }
        }
        Some(x) => {
            for ((((p, m), v), x), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(x.iter_mut()).zip(g) {
                moments(p, m, v, g);
                if *v > *x {
                    *x = *v;
                }
                *p = *p - k.step * *m / (x.sqrt() / k.bc2 + k.eps);
            }
        }
    }
}

/// `op`, a `Fused::LayerNormGrads` with `copy: Some(t)`, on `ins` (x, g, w and maybe r): its
/// flat output, and x's gradient (plus r) cast to `t` in x's shape. On CUDA one kernel writes
/// both (compile's `ln_dx_copies` pass); elsewhere the cast follows the op.
/// Records no autograd history and is not deferred by a lazy trace: compile runs it after
/// autograd, on computed buffers.
pub fn layer_norm_grads_with_copy(op: &Op, ins: &[&Tensor]) -> Result<(Tensor, Tensor)> {
    let (Op::Fused(Fused::LayerNormGrads { sums, copy: Some(t), .. }), Some(x)) = (op, ins.first()) else {
        return Err(Error::Msg(format!("layer_norm_grads_with_copy: needs layer norm's grads with a copy, got {op:?}")));
    };
    let device = x.device();
    if let Some(other) = ins.iter().find(|i| i.device() != device) {
        return Err(Error::DeviceMismatch { op: op.name(), lhs: device, rhs: other.device() });
    }
    let metas: Vec<InMeta> = ins.iter().map(|t| InMeta { shape: t.shape(), dtype: t.dtype() }).collect();
    let meta = op.infer(&metas)?;
    if device.is_cuda() {
        let layouts: Vec<&Layout> = ins.iter().map(|t| t.layout()).collect();
        let (flat, copy) = crate::tensor::profiled(op, &meta, device, || {
            backend::with_storages(ins, |storages| crate::cuda::layer_norm_grads_with_copy(op, storages, &layouts, device))
        })?;
        return Ok((Tensor::from_storage(flat, &meta.shape), Tensor::from_storage(copy, x.shape())));
    }
    let flat = Tensor::apply(op.clone(), ins, device)?;
    let copy = flat.part(&Parts::layer_norm_grads(x.shape(), sums.is_some()), Part::Dx)?.to_dtype(*t)?;
    Ok((flat, copy))
}
