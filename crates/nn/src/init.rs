//! PyTorch's default initialisations, drawn from Kiln's counter-based generator.

use kiln_tensor::{default_dtype, no_grad, DType, Device, Error, Result, Tensor};

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

// ---- in place, as `torch.nn.init` (each runs under `no_grad` itself) ----

/// `torch.nn.init.calculate_gain`: the gain a nonlinearity's initialisation scales by
/// (`param`: leaky ReLU's negative slope, 0.01 when `None`).
pub fn calculate_gain(nonlinearity: &str, param: Option<f64>) -> Result<f64> {
    Ok(match nonlinearity {
        "linear" | "conv1d" | "conv2d" | "conv3d" | "conv_transpose1d" | "conv_transpose2d" | "sigmoid" => 1.0,
        "tanh" => 5.0 / 3.0,
        "relu" => 2f64.sqrt(),
        "leaky_relu" => (2.0 / (1.0 + param.unwrap_or(0.01).powi(2))).sqrt(),
        "selu" => 0.75,
        other => return Err(Error::Msg(format!("calculate_gain: unknown nonlinearity {other:?}"))),
    })
}

/// `(fan_in, fan_out)` of a weight: dim 1 and dim 0 times the receptive field (the dims
/// after the first two), as PyTorch counts them; fewer than two dims is an error.
pub fn fans(t: &Tensor, what: &str) -> Result<(usize, usize)> {
    let s = t.shape();
    if s.len() < 2 {
        return Err(Error::shape("init", format!("{what}: fan in and fan out need a tensor of at least 2 dims, got {s:?}")));
    }
    let receptive: usize = s[2..].iter().product();
    Ok((s[1] * receptive, s[0] * receptive))
}

/// Which fan `kaiming_*` scales by: `FanIn` keeps the forward's variance, `FanOut` the
/// backward's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FanMode {
    FanIn,
    FanOut,
}

/// Overwrites `t` with `fresh`'s values (drawn in `t`'s shape, dtype and device) under
/// `no_grad`, so that a parameter can be re-initialised in place.
fn overwrite(t: &Tensor, fresh: impl FnOnce() -> Result<Tensor>) -> Result<()> {
    no_grad(|| t.assign(&fresh()?))
}

/// `nn.init.uniform_`: U(a, b).
pub fn uniform_(t: &Tensor, a: f64, b: f64) -> Result<()> {
    overwrite(t, || Tensor::rand(t.shape(), t.dtype(), t.device())?.mul_scalar(b - a)?.add_scalar(a))
}

/// `nn.init.normal_`: N(mean, std^2).
pub fn normal_(t: &Tensor, mean: f64, std: f64) -> Result<()> {
    overwrite(t, || Tensor::randn(t.shape(), t.dtype(), t.device())?.mul_scalar(std)?.add_scalar(mean))
}

/// `nn.init.constant_`.
pub fn constant_(t: &Tensor, value: f64) -> Result<()> {
    no_grad(|| t.fill_(value))
}

/// `nn.init.zeros_`.
pub fn zeros_(t: &Tensor) -> Result<()> {
    constant_(t, 0.0)
}

/// `nn.init.ones_`.
pub fn ones_(t: &Tensor) -> Result<()> {
    constant_(t, 1.0)
}

/// `nn.init.xavier_uniform_`: U(-b, b), `b = gain sqrt(6 / (fan_in + fan_out))`.
pub fn xavier_uniform_(t: &Tensor, gain: f64) -> Result<()> {
    let (fan_in, fan_out) = fans(t, "xavier_uniform_")?;
    let b = gain * (6.0 / (fan_in + fan_out) as f64).sqrt();
    uniform_(t, -b, b)
}

/// `nn.init.xavier_normal_`: N(0, std^2), `std = gain sqrt(2 / (fan_in + fan_out))`.
pub fn xavier_normal_(t: &Tensor, gain: f64) -> Result<()> {
    let (fan_in, fan_out) = fans(t, "xavier_normal_")?;
    normal_(t, 0.0, gain * (2.0 / (fan_in + fan_out) as f64).sqrt())
}

/// The standard deviation `kaiming_*` draw with: `gain / sqrt(fan)`.
fn kaiming_std(t: &Tensor, what: &str, a: f64, mode: FanMode, nonlinearity: &str) -> Result<f64> {
    let (fan_in, fan_out) = fans(t, what)?;
    let fan = if mode == FanMode::FanIn { fan_in } else { fan_out };
    Ok(calculate_gain(nonlinearity, Some(a))? / (fan as f64).sqrt())
}

/// `nn.init.kaiming_uniform_(t, a, mode, nonlinearity)`: U(-b, b), `b = sqrt(3) std`.
pub fn kaiming_uniform_(t: &Tensor, a: f64, mode: FanMode, nonlinearity: &str) -> Result<()> {
    let b = 3f64.sqrt() * kaiming_std(t, "kaiming_uniform_", a, mode, nonlinearity)?;
    uniform_(t, -b, b)
}

/// `nn.init.kaiming_normal_(t, a, mode, nonlinearity)`: N(0, std^2).
pub fn kaiming_normal_(t: &Tensor, a: f64, mode: FanMode, nonlinearity: &str) -> Result<()> {
    normal_(t, 0.0, kaiming_std(t, "kaiming_normal_", a, mode, nonlinearity)?)
}
