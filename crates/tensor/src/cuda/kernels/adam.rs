//! The optimizer update: Adam and AdamW (with AMSGrad) over many parameters per launch,
//! reading lr and step on the device.

use crate::codegen::compute_type;
use crate::cuda::kernels::prelude::{storage_type, PRELUDE};
use crate::DType;

/// Adam's hyper-parameters for the device-side update (lr and the step count stay on the
/// device).
#[derive(Debug, Clone, Copy)]
pub struct AdamHyper {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW's decoupled decay (else Adam's L2 term).
    pub decoupled: bool,
}

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
    // `1 - beta` rounded once from f64: `1 - (float)0.999` would be 1.3e-5 off.
    s += "  C b1 = (C)a.b1, b2 = (C)a.b2, eps = (C)a.eps, omb1 = (C)(1.0 - a.b1), omb2 = (C)(1.0 - a.b2);\n";
    s += "  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < a.n[j]; i += (long long)gridDim.x * blockDim.x) {\n";
    s += "    C pi = ld(p[i]), gi = ld(g[i]) + l2 * pi;\n";
    s += "    pi = pi * decay;\n";
    s += "    C mi = b1 * ld(m[i]) + omb1 * gi, vi = b2 * ld(v[i]) + omb2 * gi * gi;\n";
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

    /// One parameter's part of a launch: its length and the device addresses of its first
    /// elements in p, g, m, v (and AMSGrad's running maximum; 0 without).
    #[derive(Debug, Clone, Copy)]
    pub struct AdamBuffers {
        pub n: i64,
        pub p: u64,
        pub g: u64,
        pub m: u64,
        pub v: u64,
        pub vmax: u64,
    }

    /// One launch of the fused Adam update over `batch` (at most `ADAM_MAX_TENSORS`
    /// parameters of one dtype and AMSGrad setting, in distinct live buffers of this GPU),
    /// reading lr and the step count at device addresses `lr` and `step` (0-dim F64).
    pub fn adam_launch(
        ordinal: usize,
        (dtype, amsgrad): (DType, bool),
        batch: &[AdamBuffers],
        (lr, step): (u64, u64),
        h: AdamHyper,
    ) -> Result<()> {
        if batch.len() > ADAM_MAX_TENSORS {
            return Err(Error::Msg(format!("adam_launch: {} parameters, at most {ADAM_MAX_TENSORS} per launch", batch.len())));
        }
        let most = batch.iter().map(|b| b.n).max().unwrap_or(0) as usize;
        if most == 0 {
            return Ok(());
        }
        let mut a =
            AdamArgs { b1: h.beta1, b2: h.beta2, eps: h.eps, wd: h.weight_decay, decoupled: h.decoupled as i32, ..AdamArgs::default() };
        for (j, b) in batch.iter().enumerate() {
            (a.n[j], a.p[j], a.g[j], a.m[j], a.v[j], a.x[j]) = (b.n, b.p, b.g, b.m, b.v, b.vmax);
        }
        let gpu = crate::cuda::gpu::gpu(ordinal)?;
        let k = gpu.kernel(crate::cuda::gpu::spec_key("adam", &(dtype, amsgrad)), || adam_source(dtype, amsgrad))?;
        let (mut pl, mut pst) = (lr, step);
        let mut params = kernel_params![pl, pst, a];
        // SAFETY: (lr, step, AdamArgs) as the generated signature; block row j updates parameter j,
        // its `n` elements from its addresses in p, g, m, v (and x), live buffers of this GPU
        // (the caller's contract); threads past a parameter's length do nothing.
        unsafe { gpu.launch(k, (gpu.grid_for(most), batch.len() as u32), 256, 0, &mut params) }
    }

    /// `AdamArgs` against its C twin (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::layout_check;
        vec![layout_check!(adam_source(DType::F32, false).0, "AdamArgs", AdamArgs, {
            n => n, p => p, g => g, m => m, v => v, x => x, b1 => b1, b2 => b2, eps => eps, wd => wd, decoupled => decoupled, pad => pad
        })]
    }
}
