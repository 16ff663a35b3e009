//! Basic layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout, Sequential.

use crate::init::{linear_bound, normal, param, uniform};
use crate::{join, Forward, Module};
use kiln_tensor::{default_dtype, Device, Error, Result, Tensor};

/// `y = x W^T + b`, weight `[out, in]` like PyTorch.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// PyTorch's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
    pub fn new(inp: usize, out: usize, bias: bool, device: Device) -> Result<Linear> {
        let b = linear_bound(inp);
        Ok(Linear {
            weight: param(uniform(&[out, inp], b, default_dtype(), device)?),
            bias: if bias { Some(param(uniform(&[out], b, default_dtype(), device)?)) } else { None },
        })
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

impl Module for Linear {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(join(prefix, "bias"), b);
        }
    }
}

/// A lookup table `[num_embeddings, dim]`, N(0, 1) initialised like PyTorch.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub weight: Tensor,
}

impl Embedding {
    pub fn new(num: usize, dim: usize, device: Device) -> Result<Embedding> {
        Ok(Embedding { weight: param(normal(&[num, dim], 1.0, default_dtype(), device)?) })
    }
}

impl Forward for Embedding {
    /// `ids` of any shape (I64) to `[..ids, dim]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.weight.embedding(ids)
    }
}

impl Module for Embedding {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(join(prefix, "weight"), &self.weight);
    }
}

/// Normalises over the last dim: `(x - mean) / sqrt(var + eps) * weight + bias` (biased var).
#[derive(Debug, Clone)]
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

impl Module for LayerNorm {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(join(prefix, "weight"), &self.weight);
        f(join(prefix, "bias"), &self.bias);
    }
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dim.
#[derive(Debug, Clone)]
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
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ms = x.square()?.mean(&[-1], true)?;
        x.mul(&ms.add_scalar(self.eps)?.rsqrt()?)?.mul(&self.weight)
    }
}

impl Module for RmsNorm {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(join(prefix, "weight"), &self.weight);
    }
}

/// Zeroes each element with probability `p` in training and scales the rest by 1/(1-p).
/// Masks come from the counter-based generator, so they can be reproduced on any device.
#[derive(Debug, Clone)]
pub struct Dropout {
    pub p: f64,
    pub training: bool,
}

impl Dropout {
    pub fn new(p: f64) -> Dropout {
        Dropout { p, training: true }
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
        dropout(x, self.p, self.training)
    }
}

impl Module for Dropout {
    fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}

/// A module that is both `Module` and `Forward` (what `Sequential` holds).
pub trait Layer: Module + Forward + Send + Sync {}
impl<T: Module + Forward + Send + Sync> Layer for T {}

/// Layers applied in order; parameters are named by position (`0.weight`, `2.bias`).
#[derive(Default)]
pub struct Sequential {
    pub layers: Vec<Box<dyn Layer>>,
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Layer + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }
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
    fn set_training(&mut self, training: bool) {
        for l in &mut self.layers {
            l.set_training(training);
        }
    }
}
