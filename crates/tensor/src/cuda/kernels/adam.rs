//! The optimizer update: Adam and AdamW (with AMSGrad) over many parameters per launch,
//! reading lr and step on the device.

use crate::codegen::compute_type;
use crate::cuda::kernels::prelude::{storage_type, PRELUDE};
use crate::DType;

/// Parameters one fused Adam launch updates (`blockIdx.y` picks one).
pub const ADAM_MAX_TENSORS: usize = 16;

/// The fused Adam/AdamW update of up to `ADAM_MAX_TENSORS` parameters in one launch: p, m,
/// v (and AMSGrad's running max) in one pass from g, block row `blockIdx.y` over parameter
/// `blockIdx.y`. lr and the step count are read from device memory, so the host never reads
/// them (no synchronisation) and a captured graph stays valid as they change.
pub fn adam_source(dtype: DType, amsgrad: bool) -> (String, String) {
    let name = format!("k_adam_{}{}", format!("{dtype:?}").to_lowercase(), if amsgrad { "_amsgrad" } else { "" });
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\ntypedef {t} T;\n#define MAXT {ADAM_MAX_TENSORS}\n");
    s += "struct AdamArgs { long long n[MAXT]; unsigned long long p[MAXT], g[MAXT], m[MAXT], v[MAXT], x[MAXT]; double b1, b2, eps, wd; int decoupled, pad; };\n";
    s += &format!("extern \"C\" __global__ void {name}(const double* lr, const double* step, AdamArgs a) {{\n");
    s += "  const int j = blockIdx.y;\n  T* __restrict__ p = (T*)a.p[j]; const T* __restrict__ g = (const T*)a.g[j];\n";
    s += "  T* __restrict__ m = (T*)a.m[j]; T* __restrict__ v = (T*)a.v[j]; T* __restrict__ x = (T*)a.x[j];\n";
    s += "  double l = *lr, t = *step;\n";
    s += "  C step_size = (C)(l / (1.0 - pow(a.b1, t))), bc2 = (C)sqrt(1.0 - pow(a.b2, t));\n";
    s += "  C decay = a.decoupled ? (C)(1.0 - l * a.wd) : (C)1, l2 = a.decoupled ? (C)0 : (C)a.wd;\n";
    s += "  C b1 = (C)a.b1, b2 = (C)a.b2, eps = (C)a.eps;\n";
    s += "  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < a.n[j]; i += (long long)gridDim.x * blockDim.x) {\n";
    s += "    C pi = ld(p[i]), gi = ld(g[i]) + l2 * pi;\n";
    s += "    pi = pi * decay;\n";
    s += "    C mi = b1 * ld(m[i]) + ((C)1 - b1) * gi, vi = b2 * ld(v[i]) + ((C)1 - b2) * gi * gi;\n";
    s += "    st(&m[i], mi); st(&v[i], vi);\n";
    if amsgrad {
        s += "    C xi = ld(x[i]); if (vi > xi) xi = vi; st(&x[i], xi); vi = xi;\n";
    } else {
        s += "    (void)x;\n";
    }
    s += "    st(&p[i], pi - step_size * mi / (ksqrt(vi) / bc2 + eps));\n  }\n}\n";
    (s, name)
}

#[cfg(feature = "cuda")]
pub use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::*;
    use crate::cuda::kernels::prelude::kernel_params;
    use crate::storage::Storage;
    use crate::{Error, Result};

    /// Mirrors `struct AdamArgs`.
    #[repr(C)]
    #[derive(Default)]
    struct AdamArgs {
        n: [i64; ADAM_MAX_TENSORS],
        p: [u64; ADAM_MAX_TENSORS],
        g: [u64; ADAM_MAX_TENSORS],
        m: [u64; ADAM_MAX_TENSORS],
        v: [u64; ADAM_MAX_TENSORS],
        x: [u64; ADAM_MAX_TENSORS],
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
        decoupled: i32,
        pad: i32,
    }

    /// The device address of a tensor's first element (its storage must be on a GPU).
    fn address(s: &Storage, t: &crate::Tensor) -> Result<u64> {
        match s {
            Storage::Cuda(c) => Ok(c.ptr_at(t.layout().offset)),
            Storage::Cpu(_) => Err(Error::Msg("expected a CUDA tensor".into())),
        }
    }

    /// The fused Adam update of every parameter in `items` (checked by the caller: contiguous,
    /// one dtype, shape and GPU per parameter), in launches of up to `ADAM_MAX_TENSORS`
    /// parameters of one dtype and AMSGrad setting whose storages are all distinct (each launch
    /// holds every buffer's lock).
    pub fn adam_step(
        items: &[&crate::fused::AdamTensors<'_>],
        lr: &crate::Tensor,
        step: &crate::Tensor,
        h: crate::fused::AdamHyper,
    ) -> Result<()> {
        let mut batch: Vec<&crate::fused::AdamTensors<'_>> = Vec::new();
        for &it in items {
            let fits = batch.first().is_none_or(|b| b.p.dtype() == it.p.dtype() && b.vmax.is_some() == it.vmax.is_some())
                && batch.len() < ADAM_MAX_TENSORS
                && batch.iter().all(|b| b.tensors().all(|x| it.tensors().all(|y| !x.same_storage(y))));
            if !fits {
                adam_launch(&batch, lr, step, h)?;
                batch.clear();
            }
            batch.push(it);
        }
        adam_launch(&batch, lr, step, h)
    }

    /// One launch over `batch` (distinct storages, one dtype and AMSGrad setting).
    fn adam_launch(
        batch: &[&crate::fused::AdamTensors<'_>],
        lr: &crate::Tensor,
        step: &crate::Tensor,
        h: crate::fused::AdamHyper,
    ) -> Result<()> {
        let Some(first) = batch.first() else { return Ok(()) };
        let mut a =
            AdamArgs { b1: h.beta1, b2: h.beta2, eps: h.eps, wd: h.weight_decay, decoupled: h.decoupled as i32, ..AdamArgs::default() };
        // Every buffer stays locked until the launch is queued.
        let mut writes = Vec::new();
        let mut reads = Vec::new();
        for (j, it) in batch.iter().enumerate() {
            let (ps, ms, vs) = (it.p.storage().write(), it.m.storage().write(), it.v.storage().write());
            let gs = it.g.storage().read();
            (a.n[j], a.p[j], a.g[j]) = (it.p.numel() as i64, address(&ps, it.p)?, address(&gs, it.g)?);
            (a.m[j], a.v[j]) = (address(&ms, it.m)?, address(&vs, it.v)?);
            if let Some(x) = it.vmax {
                let xs = x.storage().write();
                a.x[j] = address(&xs, x)?;
                writes.push(xs);
            }
            writes.extend([ps, ms, vs]);
            reads.push(gs);
        }
        let (ls, ss) = (lr.storage().read(), step.storage().read());
        let (mut pl, mut pst) = (address(&ls, lr)?, address(&ss, step)?);
        let Storage::Cuda(pc) = &*writes[0] else { return Err(Error::Msg("adam_step: expected CUDA tensors".into())) };
        let gpu = crate::cuda::gpu::gpu(pc.gpu().ordinal)?;
        let most = a.n[..batch.len()].iter().copied().max().unwrap_or(0) as usize;
        if most == 0 {
            return Ok(());
        }
        let (dtype, ams) = (first.p.dtype(), first.vmax.is_some());
        let k = gpu.kernel(crate::cuda::spec_key("adam", &(dtype, ams)), || adam_source(dtype, ams))?;
        let mut params = kernel_params![pl, pst, a];
        // SAFETY: (lr, step, AdamArgs) as the generated signature; block row j updates parameter j,
        // its `n` elements from its address in p, g, m, v (and x) on this GPU, locked until queued;
        // threads past a parameter's length do nothing.
        unsafe { gpu.launch(k, (gpu.grid_for(most), batch.len() as u32), 256, 0, &mut params) }
    }
}
