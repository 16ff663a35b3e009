//! Gradient clipping (`torch.nn.utils.clip_grad_norm_` / `clip_grad_value_`), in place and
//! without reading values on the host, so a compiled step can trace it.

use kiln_tensor::{no_grad, DType, Device, Result, Tensor};

/// Scales every gradient by `min(max_norm / (total + 1e-6), 1)`, where `total` is the 2-norm
/// of all gradients together, and returns `total` (0-dim). Parameters without a gradient are
/// skipped; with none at all the norm is 0. The norm is computed in f64 when every gradient
/// is f64 and in f32 otherwise (half-precision squares would overflow).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    no_grad(|| {
        let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
        let Some(first) = grads.first() else {
            return Tensor::scalar(0.0, DType::F32, Device::Cpu);
        };
        let total = total_norm(&grads, first.device())?;
        let coef = clip_coefficient(&total, max_norm)?;
        for g in &grads {
            g.mul_(&coef.to_device(g.device())?.to_dtype(g.dtype())?)?;
        }
        Ok(total)
    })
}

/// The factor that brings a total norm down to `max_norm` (1 when it is below): PyTorch's
/// `max_norm / (total + 1e-6)`, capped at 1. It stays a tensor: no host read, no branch on
/// its value.
pub fn clip_coefficient(total: &Tensor, max_norm: f64) -> Result<Tensor> {
    total.add_scalar(1e-6)?.rdiv_scalar(max_norm)?.minimum_scalar(1.0)
}

/// `sqrt(sum over grads of sum(g^2))` on `device`.
fn total_norm(grads: &[Tensor], device: Device) -> Result<Tensor> {
    let dtype = if grads.iter().all(|g| g.dtype() == DType::F64) { DType::F64 } else { DType::F32 };
    let mut total: Option<Tensor> = None;
    for g in grads {
        let acc = if g.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let sq = g.to_dtype(acc)?.square()?.sum_all()?.to_device(device)?.to_dtype(dtype)?;
        total = Some(match total {
            Some(t) => t.add(&sq)?,
            None => sq,
        });
    }
    match total {
        Some(t) => t.sqrt(),
        None => Tensor::scalar(0.0, dtype, device),
    }
}

/// Clamps every gradient to `[-clip, clip]` in place.
pub fn clip_grad_value(params: &[Tensor], clip: f64) -> Result<()> {
    no_grad(|| params.iter().filter_map(Tensor::grad).try_for_each(|g| g.assign(&g.clamp(-clip, clip)?)))
}
