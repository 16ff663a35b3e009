//! Basic layers: Linear, Embedding, LayerNorm, RMSNorm, BatchNorm, Dropout, Sequential.

use crate::init::{normal, param, weight_and_bias};
use crate::module::{join, Forward, Module};
use kiln_derive::Module;
use kiln_tensor::{default_dtype, no_grad, DType, Device, Error, Flag, Result, Tensor};

/// `y = x W^T + b`, weight `[out, in]` like PyTorch.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// PyTorch's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
    pub fn new(inp: usize, out: usize, bias: bool, device: Device) -> Result<Linear> {
        let (weight, bias) = weight_and_bias(&[out, inp], inp, bias.then_some(out), device)?;
        Ok(Linear { weight, bias })
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let in_features = self.weight.shape()[1];
        if x.rank() == 0 || x.shape()[x.rank() - 1] != in_features {
            return Err(Error::shape(
                "linear",
                format!("input {:?} does not end in in_features {in_features} (weight {:?})", x.shape(), self.weight.shape()),
            ));
        }
        x.linear(&self.weight, self.bias.as_ref())
    }
}

/// A lookup table `[num_embeddings, dim]`, N(0, 1) initialised like PyTorch. With
/// `padding_idx`, that row starts at zero and gets no gradient (`nn.Embedding(padding_idx=)`).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Embedding {
    pub weight: Tensor,
    pub padding_idx: Option<usize>,
}

impl Embedding {
    pub fn new(num: usize, dim: usize, device: Device) -> Result<Embedding> {
        Ok(Embedding { weight: param(normal(&[num, dim], 1.0, default_dtype(), device)?), padding_idx: None })
    }

    /// `new` with row `padding_idx` zeroed and left out of the gradient.
    pub fn with_padding_idx(num: usize, dim: usize, padding_idx: usize, device: Device) -> Result<Embedding> {
        if padding_idx >= num {
            return Err(Error::Msg(format!("Embedding: padding_idx {padding_idx} is not a row of {num}")));
        }
        let e = Embedding { padding_idx: Some(padding_idx), ..Embedding::new(num, dim, device)? };
        no_grad(|| e.weight.narrow(0usize, padding_idx, 1)?.zero_())?;
        Ok(e)
    }
}

impl Forward for Embedding {
    /// `ids` of any shape (I64) to `[..ids, dim]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let out = self.weight.embedding(ids)?;
        match self.padding_idx {
            // The padding row's value as it is, its gradient cut.
            Some(p) => Tensor::where_cond(&ids.ne_scalar(p as f64)?.unsqueeze(-1)?, &out, &out.detach()),
            None => Ok(out),
        }
    }
}

/// Normalises over the last dim: `(x - mean) / sqrt(var + eps) * weight + bias` (biased var).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(dim: usize, eps: f64, device: Device) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: param(Tensor::ones(&[dim], default_dtype(), device)?),
            bias: param(Tensor::zeros(&[dim], default_dtype(), device)?),
            eps,
        })
    }
}

impl Forward for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = self.weight.shape()[0];
        if x.rank() == 0 || x.shape()[x.rank() - 1] != dim {
            return Err(Error::shape("layer_norm", format!("input {:?} does not end in normalized dim {dim}", x.shape())));
        }
        // One fused pass (and a fused row pass in the backward).
        x.layer_norm(&self.weight, &self.bias, self.eps)
    }
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dim.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    /// `eps` defaults (torch: None) to f32's machine epsilon.
    pub fn new(dim: usize, eps: Option<f64>, device: Device) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: param(Tensor::ones(&[dim], default_dtype(), device)?), eps: eps.unwrap_or(f32::EPSILON as f64) })
    }
}

impl Forward for RmsNorm {
    /// One fused row kernel each way; an input of another dtype than the weight (autocast)
    /// takes the elementwise ops, which promote as PyTorch does.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() == self.weight.dtype() {
            return x.rms_norm(Some(&self.weight), self.eps);
        }
        let ms = x.square()?.mean(&[-1], true)?;
        x.mul(&ms.add_scalar(self.eps)?.rsqrt()?)?.mul(&self.weight)
    }
}

/// `nn.GroupNorm`: the channels (dim 1) of `[N, C, ..]` split into `groups` runs, each run of
/// each sample normalised over its channels and positions (one fused row pass), then a
/// per-channel affine `weight [C]`, `bias [C]`. Train and eval behave the same.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct GroupNorm {
    pub groups: usize,
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl GroupNorm {
    /// PyTorch's defaults: eps 1e-5, weight 1, bias 0.
    pub fn new(groups: usize, channels: usize, device: Device) -> Result<GroupNorm> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(Error::Msg(format!("GroupNorm: {channels} channels do not split into {groups} groups")));
        }
        Ok(GroupNorm {
            groups,
            weight: param(Tensor::ones(&[channels], default_dtype(), device)?),
            bias: param(Tensor::zeros(&[channels], default_dtype(), device)?),
            eps: 1e-5,
        })
    }
}

impl Forward for GroupNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.shape()[0];
        if x.rank() < 2 || x.shape()[1] != c {
            return Err(Error::shape("group_norm", format!("needs [N, {c}, ..], got {:?}", x.shape())));
        }
        let n = x.shape()[0];
        let normed = x.reshape(&[n * self.groups, x.numel() / (n * self.groups).max(1)])?.normalize(self.eps)?.reshape(x.shape())?;
        let mut shape = vec![1; x.rank()];
        shape[1] = c;
        normed.mul(&self.weight.reshape(&shape)?)?.add(&self.bias.reshape(&shape)?)
    }
}

/// Batch normalisation over dim 1 (`nn.BatchNorm1d` for `[N, C]` or `[N, C, L]`,
/// `nn.BatchNorm2d` for `[N, C, H, W]`): in training each channel is normalised by its batch
/// mean and biased variance, and the running statistics move by `momentum` (the variance's
/// unbiased); in eval the running statistics are used. Buffers `running_mean`,
/// `running_var`, `num_batches_tracked` as in PyTorch's state dict.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct BatchNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    #[module(buffer)]
    pub running_mean: Tensor,
    #[module(buffer)]
    pub running_var: Tensor,
    #[module(buffer)]
    pub num_batches_tracked: Tensor,
    pub eps: f64,
    pub momentum: f64,
    pub training: Flag,
}

impl BatchNorm {
    /// PyTorch's defaults: eps 1e-5, momentum 0.1, weight 1, bias 0.
    pub fn new(channels: usize, device: Device) -> Result<BatchNorm> {
        let dtype = default_dtype();
        Ok(BatchNorm {
            weight: param(Tensor::ones(&[channels], dtype, device)?),
            bias: param(Tensor::zeros(&[channels], dtype, device)?),
            running_mean: Tensor::zeros(&[channels], dtype, device)?,
            running_var: Tensor::ones(&[channels], dtype, device)?,
            num_batches_tracked: Tensor::zeros(&[], DType::I64, device)?,
            eps: 1e-5,
            momentum: 0.1,
            training: Flag::new(true),
        })
    }

    /// Moves the running statistics towards this batch's (no gradient flows into them).
    fn track(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let m = self.momentum;
        no_grad(|| {
            let c = self.running_mean.shape()[0];
            let (mean, var) =
                (mean.reshape(&[c])?.to_dtype(self.running_mean.dtype())?, var.reshape(&[c])?.to_dtype(self.running_var.dtype())?);
            self.running_mean.assign(&self.running_mean.mul_scalar(1.0 - m)?.add(&mean.mul_scalar(m)?)?)?;
            let unbiased = var.mul_scalar(n as f64 / (n - 1) as f64)?;
            self.running_var.assign(&self.running_var.mul_scalar(1.0 - m)?.add(&unbiased.mul_scalar(m)?)?)?;
            self.num_batches_tracked.add_scalar_(1.0)
        })
    }
}

impl Forward for BatchNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.shape()[0];
        if !(2..=4).contains(&x.rank()) || x.shape()[1] != c {
            return Err(Error::shape("batch_norm", format!("needs [N, {c}], [N, {c}, L] or [N, {c}, H, W]; got {:?}", x.shape())));
        }
        // Per-channel values broadcast over the other dims: `[1, C, 1, ..]`.
        let mut shape = vec![1; x.rank()];
        shape[1] = c;
        let dims: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
        let (centred, var) = if self.training.get() {
            let n = x.numel() / c.max(1);
            if n < 2 {
                return Err(Error::shape(
                    "batch_norm",
                    format!("needs more than one value per channel in training, got input {:?}", x.shape()),
                ));
            }
            let mean = x.mean(&dims[..], true)?;
            let centred = x.sub(&mean)?;
            let var = centred.square()?.mean(&dims[..], true)?;
            self.track(&mean, &var, n)?;
            (centred, var)
        } else {
            (x.sub(&self.running_mean.reshape(&shape)?)?, self.running_var.reshape(&shape)?)
        };
        let scale = var.add_scalar(self.eps)?.rsqrt()?.mul(&self.weight.reshape(&shape)?)?;
        centred.mul(&scale)?.add(&self.bias.reshape(&shape)?)
    }
}

/// Zeroes each element with probability `p` in training and scales the rest by 1/(1-p).
/// Masks come from the counter-based generator, so they can be reproduced on any device.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Dropout {
    pub p: f64,
    pub training: Flag,
}

impl Dropout {
    pub fn new(p: f64) -> Dropout {
        Dropout { p, training: Flag::new(true) }
    }
}

/// Dropout as a function (what modules call).
pub fn dropout(x: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    if !training || p == 0.0 {
        return Ok(x.clone());
    }
    if !(0.0..1.0).contains(&p) {
        return Err(Error::Msg(format!("dropout: p must be in [0, 1), got {p}")));
    }
    let keep = Tensor::rand(x.shape(), x.dtype(), x.device())?.ge_scalar(p)?.to_dtype(x.dtype())?;
    x.mul(&keep)?.mul_scalar(1.0 / (1.0 - p))
}

impl Forward for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        dropout(x, self.p, self.training.get())
    }
}

/// A module that is both `Module` and `Forward` (what `Sequential` holds).
pub trait Layer: Module + Forward + Send + Sync {
    /// The layer as its own type, for `Module::apply`'s `downcast_ref`.
    fn as_any(&self) -> &dyn std::any::Any;
}
impl<T: Module + Forward + Send + Sync + 'static> Layer for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Layers applied in order; parameters are named by position (`0.weight`, `2.bias`). A clone
/// shares the layers (and so the parameters), as a clone of any module shares its tensors.
/// `seq![a, b, c]` builds one as PyTorch's `nn.Sequential(a, b, c)`:
///
/// ```
/// use kiln_nn::{seq, Gelu, Linear, Module};
/// use kiln_tensor::Device;
/// let mlp = seq![Linear::new(4, 16, true, Device::Cpu)?, Gelu, Linear::new(16, 4, true, Device::Cpu)?];
/// let names: Vec<String> = mlp.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
/// # Ok::<(), kiln_tensor::Error>(())
/// ```
#[derive(Default, Clone)]
pub struct Sequential {
    pub layers: Vec<std::sync::Arc<dyn Layer>>,
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Layer + 'static) -> Sequential {
        self.layers.push(std::sync::Arc::new(layer));
        self
    }
}

/// A `Sequential` of the layers given, in order (`nn.Sequential(a, b, c)`).
#[macro_export]
macro_rules! seq {
    ($($layer:expr),* $(,)?) => {
        $crate::Sequential::new()$(.add($layer))*
    };
}

impl Forward for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }
}

impl Module for Sequential {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (i, l) in self.layers.iter().enumerate() {
            l.visit(&join(prefix, &i.to_string()), f);
        }
    }
    /// Each layer in place; a layer shared with a clone of this `Sequential` cannot be.
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        for (i, l) in self.layers.iter_mut().enumerate() {
            let Some(layer) = std::sync::Arc::get_mut(l) else {
                return Err(Error::Msg(format!(
                    "Sequential: layer {i} is shared with a clone of this Sequential and cannot change in place; move the model before cloning it"
                )));
            };
            layer.visit_mut(f)?;
        }
        Ok(())
    }
    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (i, l) in self.layers.iter().enumerate() {
            l.visit_buffers(&join(prefix, &i.to_string()), f);
        }
    }
    fn set_training(&self, training: bool) {
        for l in &self.layers {
            l.set_training(training);
        }
    }
    fn visit_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn std::any::Any)) {
        for (i, l) in self.layers.iter().enumerate() {
            let name = join(prefix, &i.to_string());
            l.visit_modules(&name, f);
            f(&name, l.as_any());
        }
    }
}

/// Llama's feed-forward: `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases
/// (Hugging Face's `LlamaMLP` names).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct SwiGlu {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl SwiGlu {
    pub fn new(dim: usize, hidden: usize, device: Device) -> Result<SwiGlu> {
        Ok(SwiGlu {
            gate_proj: Linear::new(dim, hidden, false, device)?,
            up_proj: Linear::new(dim, hidden, false, device)?,
            down_proj: Linear::new(hidden, dim, false, device)?,
        })
    }
}

impl Forward for SwiGlu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down_proj.forward(&(self.gate_proj.forward(x)?.silu()? * self.up_proj.forward(x)?)?)
    }
}
