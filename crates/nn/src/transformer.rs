//! Transformer encoder/decoder layers and `Transformer`, with PyTorch's `nn.Transformer`
//! semantics (post-norm by default, `norm_first` for pre-norm) and parameter names.

use crate::activation::Activation;
use crate::attention::{AttnMasks, MultiheadAttention};
use crate::init::xavier_uniform;
use crate::layers::{dropout, LayerNorm, Linear};
use crate::module::{Forward, Module};
use kiln_derive::Module;
use kiln_tensor::{no_grad, Device, Flag, Result, Tensor};

#[derive(Debug, Clone, Copy)]
pub struct TransformerConfig {
    pub d_model: usize,
    pub nhead: usize,
    pub num_encoder_layers: usize,
    pub num_decoder_layers: usize,
    pub dim_feedforward: usize,
    pub dropout: f64,
    pub activation: Activation,
    pub layer_norm_eps: f64,
    pub batch_first: bool,
    pub norm_first: bool,
}

impl Default for TransformerConfig {
    /// `nn.Transformer()`'s defaults.
    fn default() -> Self {
        TransformerConfig {
            d_model: 512,
            nhead: 8,
            num_encoder_layers: 6,
            num_decoder_layers: 6,
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: Activation::Relu,
            layer_norm_eps: 1e-5,
            batch_first: false,
            norm_first: false,
        }
    }
}

/// The feed-forward block: `linear2(dropout(act(linear1(x))))`.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
struct FeedForward {
    linear1: Linear,
    linear2: Linear,
}

impl FeedForward {
    fn new(c: &TransformerConfig, device: Device) -> Result<FeedForward> {
        Ok(FeedForward {
            linear1: Linear::new(c.d_model, c.dim_feedforward, true, device)?,
            linear2: Linear::new(c.dim_feedforward, c.d_model, true, device)?,
        })
    }
    fn forward(&self, x: &Tensor, act: Activation, p: f64, training: bool) -> Result<Tensor> {
        let h = dropout(&act.apply(&self.linear1.forward(x)?)?, p, training)?;
        self.linear2.forward(&h)
    }
}

#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct TransformerEncoderLayer {
    pub self_attn: MultiheadAttention,
    #[module(flatten)]
    linear: FeedForward,
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    pub config: TransformerConfig,
    pub training: Flag,
}

impl TransformerEncoderLayer {
    pub fn new(c: TransformerConfig, device: Device) -> Result<TransformerEncoderLayer> {
        Ok(TransformerEncoderLayer {
            self_attn: MultiheadAttention::new(c.d_model, c.nhead, c.dropout, c.batch_first, device)?,
            linear: FeedForward::new(&c, device)?,
            norm1: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
            norm2: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
            config: c,
            training: Flag::new(true),
        })
    }

    fn drop(&self, x: &Tensor) -> Result<Tensor> {
        dropout(x, self.config.dropout, self.training.get())
    }

    pub fn forward(&self, src: &Tensor, masks: &AttnMasks) -> Result<Tensor> {
        let c = &self.config;
        let sa = |x: &Tensor| self.drop(&self.self_attn.forward(x, x, x, masks)?);
        let ff = |x: &Tensor| self.drop(&self.linear.forward(x, c.activation, c.dropout, self.training.get())?);
        if c.norm_first {
            let x = src.add(&sa(&self.norm1.forward(src)?)?)?;
            x.add(&ff(&self.norm2.forward(&x)?)?)
        } else {
            let x = self.norm1.forward(&src.add(&sa(src)?)?)?;
            self.norm2.forward(&x.add(&ff(&x)?)?)
        }
    }
}

#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct TransformerDecoderLayer {
    pub self_attn: MultiheadAttention,
    pub multihead_attn: MultiheadAttention,
    #[module(flatten)]
    linear: FeedForward,
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    pub norm3: LayerNorm,
    pub config: TransformerConfig,
    pub training: Flag,
}

impl TransformerDecoderLayer {
    pub fn new(c: TransformerConfig, device: Device) -> Result<TransformerDecoderLayer> {
        Ok(TransformerDecoderLayer {
            self_attn: MultiheadAttention::new(c.d_model, c.nhead, c.dropout, c.batch_first, device)?,
            multihead_attn: MultiheadAttention::new(c.d_model, c.nhead, c.dropout, c.batch_first, device)?,
            linear: FeedForward::new(&c, device)?,
            norm1: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
            norm2: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
            norm3: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
            config: c,
            training: Flag::new(true),
        })
    }

    fn drop(&self, x: &Tensor) -> Result<Tensor> {
        dropout(x, self.config.dropout, self.training.get())
    }

    pub fn forward(&self, tgt: &Tensor, memory: &Tensor, tgt_masks: &AttnMasks, memory_masks: &AttnMasks) -> Result<Tensor> {
        let c = &self.config;
        let sa = |x: &Tensor| self.drop(&self.self_attn.forward(x, x, x, tgt_masks)?);
        let ca = |x: &Tensor| self.drop(&self.multihead_attn.forward(x, memory, memory, memory_masks)?);
        let ff = |x: &Tensor| self.drop(&self.linear.forward(x, c.activation, c.dropout, self.training.get())?);
        if c.norm_first {
            let x = tgt.add(&sa(&self.norm1.forward(tgt)?)?)?;
            let x = x.add(&ca(&self.norm2.forward(&x)?)?)?;
            x.add(&ff(&self.norm3.forward(&x)?)?)
        } else {
            let x = self.norm1.forward(&tgt.add(&sa(tgt)?)?)?;
            let x = self.norm2.forward(&x.add(&ca(&x)?)?)?;
            self.norm3.forward(&x.add(&ff(&x)?)?)
        }
    }
}

/// Masks for `Transformer::forward` (all optional, as in PyTorch).
#[derive(Debug, Clone, Default)]
pub struct TransformerMasks<'a> {
    pub src: AttnMasks<'a>,
    pub tgt: AttnMasks<'a>,
    pub memory: AttnMasks<'a>,
}

/// `nn.Transformer`: an encoder stack and a decoder stack, each ending in a LayerNorm.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Transformer {
    #[module(rename = "encoder.layers")]
    pub encoder_layers: Vec<TransformerEncoderLayer>,
    #[module(rename = "encoder.norm")]
    pub encoder_norm: LayerNorm,
    #[module(rename = "decoder.layers")]
    pub decoder_layers: Vec<TransformerDecoderLayer>,
    #[module(rename = "decoder.norm")]
    pub decoder_norm: LayerNorm,
}

impl Transformer {
    /// Like PyTorch, every parameter with more than one dim is re-drawn Xavier-uniform.
    pub fn new(c: TransformerConfig, device: Device) -> Result<Transformer> {
        let t = Transformer {
            encoder_layers: (0..c.num_encoder_layers).map(|_| TransformerEncoderLayer::new(c, device)).collect::<Result<_>>()?,
            encoder_norm: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
            decoder_layers: (0..c.num_decoder_layers).map(|_| TransformerDecoderLayer::new(c, device)).collect::<Result<_>>()?,
            decoder_norm: LayerNorm::new(c.d_model, c.layer_norm_eps, device)?,
        };
        for p in t.parameters() {
            if p.rank() > 1 {
                no_grad(|| p.assign(&xavier_uniform(p.shape(), p.dtype(), p.device())?))?;
            }
        }
        Ok(t)
    }

    pub fn encode(&self, src: &Tensor, masks: &AttnMasks) -> Result<Tensor> {
        let mut x = src.clone();
        for l in &self.encoder_layers {
            x = l.forward(&x, masks)?;
        }
        self.encoder_norm.forward(&x)
    }

    pub fn decode(&self, tgt: &Tensor, memory: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        let mut x = tgt.clone();
        for l in &self.decoder_layers {
            x = l.forward(&x, memory, &masks.tgt, &masks.memory)?;
        }
        self.decoder_norm.forward(&x)
    }

    pub fn forward(&self, src: &Tensor, tgt: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        let memory = self.encode(src, &masks.src)?;
        self.decode(tgt, &memory, masks)
    }
}
