//! A GPT-style language model: token + position embeddings, pre-norm blocks with causal
//! self-attention (one fused qkv projection) and a GELU MLP, a final LayerNorm and a head
//! (untied, or tied to the token embedding). Shapes: B batch, T time, C d_model, H heads,
//! V vocab. Parameter names match scripts/make_golden.py's PyTorch model; `kiln::hf` reads and
//! writes Hugging Face's GPT-2 checkpoints.

use kiln_nn::init::{normal_, zeros_};
use kiln_nn::{
    cross_entropy, dropout, merge_heads, scaled_dot_product_attention, split_heads, Activation, AttnMasks, Cache, Embedding, Forward,
    KvCache, LayerNorm, Linear, Module, StaticKvCache,
};
use kiln_tensor::{DType, Device, Error, Flag, Result, Tensor};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    pub vocab: usize,
    pub context: usize,
    pub d_model: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub dropout: f64,
    /// Share the token embedding with the output head.
    pub tied_head: bool,
    /// The MLP's activation: `Gelu` as nanoGPT, `GeluTanh` as Hugging Face's GPT-2
    /// (`gelu_new`).
    pub activation: Activation,
}

impl GptConfig {
    /// A GPT of the given sizes: nanoGPT's defaults otherwise (no dropout, untied head, exact
    /// GELU); change fields with struct update syntax (`GptConfig { dropout: 0.1, ..c }`).
    pub fn new(vocab: usize, context: usize, d_model: usize, n_layer: usize, n_head: usize) -> GptConfig {
        GptConfig { vocab, context, d_model, n_layer, n_head, dropout: 0.0, tied_head: false, activation: Activation::Gelu }
    }

    /// OpenAI's GPT-2 at `d_model`, `n_layer` and `n_head` (124M: 768, 12, 12; 350M: 1024, 24,
    /// 16) as Hugging Face builds it: vocab 50257, context 1024, tied head, tanh GELU.
    pub fn gpt2(d_model: usize, n_layer: usize, n_head: usize) -> GptConfig {
        GptConfig { vocab: 50257, context: 1024, d_model, n_layer, n_head, dropout: 0.0, tied_head: true, activation: Activation::GeluTanh }
    }
}

#[derive(Debug, Clone, Module)]
pub struct Block {
    pub ln1: LayerNorm,
    #[module(rename = "attn.qkv")]
    pub qkv: Linear,
    #[module(rename = "attn.proj")]
    pub proj: Linear,
    pub ln2: LayerNorm,
    #[module(rename = "mlp.fc")]
    pub fc: Linear,
    #[module(rename = "mlp.proj")]
    pub fc_proj: Linear,
}

#[derive(Debug, Clone, Module)]
pub struct Gpt {
    pub config: GptConfig,
    pub tok_emb: Embedding,
    pub pos_emb: Embedding,
    pub blocks: Vec<Block>,
    pub ln_f: LayerNorm,
    pub head: Option<Linear>,
    pub training: Flag,
    /// Activation checkpointing: each block's activations are recomputed in backward instead
    /// of kept (`kiln_autograd::checkpoint`; Hugging Face's `gradient_checkpointing_enable`).
    /// Off by default.
    pub checkpointing: Flag,
}

impl Block {
    fn new(c: &GptConfig, device: Device) -> Result<Block> {
        let d = c.d_model;
        Ok(Block {
            ln1: LayerNorm::new(d, 1e-5, device)?,
            qkv: Linear::new(d, 3 * d, true, device)?,
            proj: Linear::new(d, d, true, device)?,
            ln2: LayerNorm::new(d, 1e-5, device)?,
            fc: Linear::new(d, 4 * d, true, device)?,
            fc_proj: Linear::new(4 * d, d, true, device)?,
        })
    }

    /// x: [B, T, C] -> [B, T, C]
    fn forward(&self, x: &Tensor, c: &GptConfig, training: bool) -> Result<Tensor> {
        self.forward_at(x, c, training, None)
    }

    /// `forward`, or with `cache` (the cache and this block's layer) attending over the cached
    /// keys and values too, this block's added.
    fn forward_at(&self, x: &Tensor, c: &GptConfig, training: bool, cache: Option<(&mut Cache, usize)>) -> Result<Tensor> {
        let d = c.d_model;
        let p = if training { c.dropout } else { 0.0 };
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?; // [B, T, 3C]
        let heads = |i: usize| split_heads(&qkv.narrow(2, i * d, d)?, c.n_head);
        let att = match cache {
            None => scaled_dot_product_attention(&heads(0)?, &heads(1)?, &heads(2)?, &AttnMasks::causal(), p)?,
            Some((cache, layer)) => cache.attend(layer, &heads(0)?, &heads(1)?, &heads(2)?)?,
        }; // [B, H, T, D]
        let x = x.add(&dropout(&self.proj.forward(&merge_heads(&att)?)?, p, training)?)?;
        let h = self.fc_proj.forward(&c.activation.apply(&self.fc.forward(&self.ln2.forward(&x)?)?)?)?;
        x.add(&dropout(&h, p, training)?)
    }
}

impl Gpt {
    pub fn new(c: GptConfig, device: Device) -> Result<Gpt> {
        if c.n_head == 0 || !c.d_model.is_multiple_of(c.n_head) {
            return Err(Error::shape("gpt", format!("d_model {} is not divisible by n_head {}", c.d_model, c.n_head)));
        }
        Ok(Gpt {
            config: c,
            tok_emb: Embedding::new(c.vocab, c.d_model, device)?,
            pos_emb: Embedding::new(c.context, c.d_model, device)?,
            blocks: (0..c.n_layer).map(|_| Block::new(&c, device)).collect::<Result<_>>()?,
            ln_f: LayerNorm::new(c.d_model, 1e-5, device)?,
            head: if c.tied_head { None } else { Some(Linear::new(c.d_model, c.vocab, false, device)?) },
            training: Flag::new(true),
            checkpointing: Flag::new(false),
        })
        .and_then(Gpt::init_gpt2)
    }

    /// GPT-2's initialisation (as nanoGPT's `_init_weights`): products' and embeddings'
    /// weights N(0, 0.02), the residual projections' N(0, 0.02 / sqrt(2 n_layer)), biases
    /// zero; layer norms stay ones and zeros.
    fn init_gpt2(self) -> Result<Gpt> {
        let residual = 0.02 / (2.0 * self.config.n_layer as f64).sqrt();
        for (name, p) in self.named_parameters() {
            if name.ends_with(".bias") && !name.contains("ln") {
                zeros_(&p)?;
            } else if name.ends_with("proj.weight") && name.starts_with("blocks.") && !name.contains("qkv") {
                normal_(&p, 0.0, residual)?;
            } else if !name.contains("ln") {
                normal_(&p, 0.0, 0.02)?;
            }
        }
        Ok(self)
    }

    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.tok_emb.weight.device()
    }

    /// tokens: [B, T] (I64, T <= context) -> logits [B, T, V]
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.run(tokens, None)
    }

    /// Logits of `tokens` `[B, T]` at positions `cache.len()..`, attending over the cached
    /// positions too; their keys and values are appended to `cache` (one entry a block).
    pub fn forward_cached(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.run(tokens, Some(Cache::growing(cache)))
    }

    /// Logits of `tokens` `[B, T]` at `positions` (I64 `[T]`), attending over `cache`'s
    /// positions up to each; their keys and values are written into `cache`. The shapes do
    /// not depend on the position, so one compiled decode step serves them all.
    pub fn forward_static(&self, tokens: &Tensor, positions: &Tensor, cache: &StaticKvCache) -> Result<Tensor> {
        self.run(tokens, Some(Cache::Static { cache, positions }))
    }

    fn run(&self, tokens: &Tensor, mut cache: Option<Cache>) -> Result<Tensor> {
        let t = tokens.shape().get(1).copied().unwrap_or(0);
        if tokens.rank() != 2 || t > self.config.context {
            return Err(Error::shape(
                "gpt",
                format!("tokens must be [B, T] with T <= context {}, got {:?}", self.config.context, tokens.shape()),
            ));
        }
        let pos = match &cache {
            Some(c) => {
                c.check_room(t, self.config.context)?;
                c.positions(t, tokens.device())?
            }
            None => Tensor::arange(t, DType::I64, tokens.device())?,
        };
        let mut x = self.tok_emb.forward(tokens)?.add(&self.pos_emb.forward(&pos)?)?;
        x = dropout(&x, self.config.dropout, self.training.get())?;
        let (c, training) = (self.config, self.training.get());
        for (i, blk) in self.blocks.iter().enumerate() {
            x = match cache.as_mut() {
                Some(cache) => blk.forward_at(&x, &c, training, Some((cache, i)))?,
                None if self.checkpointing.get() => {
                    let blk = blk.clone();
                    kiln_autograd::checkpoint(move |v| blk.forward(&v[0], &c, training), &[&x])?
                }
                None => blk.forward(&x, &c, training)?,
            };
        }
        let x = self.ln_f.forward(&x)?;
        match &self.head {
            Some(h) => h.forward(&x),
            None => x.matmul(&self.tok_emb.weight.t()?),
        }
    }

    /// Mean cross-entropy of next-token predictions. tokens, targets: [B, T].
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.forward(tokens)?;
        let v = self.config.vocab;
        cross_entropy(&logits.reshape(&[-1, v as i64])?, &targets.reshape(&[-1])?)
    }
}
