//! PyTorch's default initialisations, drawn from Kiln's counter-based generator.

use kiln_tensor::{default_dtype, DType, Device, Result, Tensor};

/// A fresh parameter leaf (requires grad).
pub fn param(t: Tensor) -> Tensor {
    t.set_requires_grad(true);
    t
}

/// Uniform on [-bound, bound).
pub fn uniform(shape: &[usize], bound: f64, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::rand(shape, dtype, device)?.mul_scalar(2.0 * bound)?.sub_scalar(bound)
}

/// `nn.Linear`'s default: kaiming_uniform(a = sqrt 5) for the weight, which is
/// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the same bound for the bias.
pub fn linear_bound(fan_in: usize) -> f64 {
    if fan_in == 0 {
        0.0
    } else {
        1.0 / (fan_in as f64).sqrt()
    }
}

/// PyTorch's default init of a Linear or (transposed) Conv layer: weight `weight_shape` and,
/// with `bias` `Some(len)`, a bias `[len]`, both U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as
/// parameters.
pub fn weight_and_bias(weight_shape: &[usize], fan_in: usize, bias: Option<usize>, device: Device) -> Result<(Tensor, Option<Tensor>)> {
    let b = linear_bound(fan_in);
    let weight = param(uniform(weight_shape, b, default_dtype(), device)?);
    let bias = bias.map(|len| uniform(&[len], b, default_dtype(), device).map(param)).transpose()?;
    Ok((weight, bias))
}

/// Standard normal (nn.Embedding's default).
pub fn normal(shape: &[usize], std: f64, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::randn(shape, dtype, device)?.mul_scalar(std)
}

/// Xavier/Glorot uniform (nn.MultiheadAttention's in_proj_weight).
pub fn xavier_uniform(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let (fan_out, fan_in) = (shape[0], shape[1..].iter().product::<usize>());
    uniform(shape, (6.0 / (fan_in + fan_out) as f64).sqrt(), dtype, device)
}
