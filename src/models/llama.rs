//! A Llama-shaped language model: RMSNorm before attention and the feed-forward, rotary
//! position embeddings, grouped-query attention, SwiGLU and a head (untied, or tied to the embedding), under Hugging
//! Face's parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...).

use kiln_nn::init::normal_;
use kiln_nn::{
    causal_attention_at, cross_entropy, merge_heads, split_heads, Cache, Embedding, Forward, KvCache, Linear, Module, RmsNorm,
    RotaryEmbedding, StaticKvCache, SwiGlu,
};
use kiln_tensor::{default_dtype, Device, Error, Result, Tensor};

/// The shape of a Llama model (Hugging Face's `LlamaConfig` fields by other names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Key/value heads: `n_heads` for multi-head attention, fewer for grouped-query, 1 for
    /// multi-query; it divides `n_heads`.
    pub n_kv_heads: usize,
    /// The SwiGLU's hidden size (`intermediate_size`).
    pub hidden: usize,
    pub max_seq: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    /// The head shares the token embedding (`tie_word_embeddings`, as Llama 3.2 1B).
    pub tied_head: bool,
}

impl LlamaConfig {
    /// A small model for tests and examples: 2 layers, d 64, 4 heads over 2 key/value heads.
    pub fn tiny(vocab: usize) -> LlamaConfig {
        LlamaConfig {
            vocab,
            dim: 64,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            hidden: 176,
            max_seq: 128,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tied_head: false,
        }
    }
}

/// Attention's projections (`self_attn.{q,k,v,o}_proj`, no biases).
#[derive(Debug, Clone, Module)]
pub struct LlamaAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
}

/// One decoder layer, in Hugging Face's parameter order.
#[derive(Debug, Clone, Module)]
pub struct LlamaLayer {
    pub self_attn: LlamaAttention,
    pub mlp: SwiGlu,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
}

#[derive(Debug, Clone, Module)]
pub struct Llama {
    pub config: LlamaConfig,
    #[module(rename = "model.embed_tokens")]
    pub embed_tokens: Embedding,
    #[module(rename = "model.layers")]
    pub layers: Vec<LlamaLayer>,
    #[module(rename = "model.norm")]
    pub norm: RmsNorm,
    pub lm_head: Linear,
    #[module(skip)]
    pub rope: RotaryEmbedding,
}

impl Llama {
    pub fn new(c: LlamaConfig, device: Device) -> Result<Llama> {
        let ok = c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads.is_multiple_of(c.n_kv_heads) && c.dim.is_multiple_of(c.n_heads);
        if !ok {
            return Err(Error::Msg(format!(
                "Llama: n_heads {} must divide dim {} and be a multiple of n_kv_heads {}",
                c.n_heads, c.dim, c.n_kv_heads
            )));
        }
        let hd = c.dim / c.n_heads;
        let layer = || -> Result<LlamaLayer> {
            Ok(LlamaLayer {
                self_attn: LlamaAttention {
                    q_proj: Linear::new(c.dim, c.n_heads * hd, false, device)?,
                    k_proj: Linear::new(c.dim, c.n_kv_heads * hd, false, device)?,
                    v_proj: Linear::new(c.dim, c.n_kv_heads * hd, false, device)?,
                    o_proj: Linear::new(c.n_heads * hd, c.dim, false, device)?,
                },
                mlp: SwiGlu::new(c.dim, c.hidden, device)?,
                input_layernorm: RmsNorm::new(c.dim, Some(c.norm_eps), device)?,
                post_attention_layernorm: RmsNorm::new(c.dim, Some(c.norm_eps), device)?,
            })
        };
        let embed_tokens = Embedding::new(c.vocab, c.dim, device)?;
        let lm_head = match c.tied_head {
            true => Linear { weight: embed_tokens.weight.clone(), bias: None },
            false => Linear::new(c.dim, c.vocab, false, device)?,
        };
        Ok(Llama {
            config: c,
            embed_tokens,
            layers: (0..c.n_layers).map(|_| layer()).collect::<Result<_>>()?,
            norm: RmsNorm::new(c.dim, Some(c.norm_eps), device)?,
            lm_head,
            rope: RotaryEmbedding::new(hd, c.max_seq, c.rope_theta, default_dtype(), device)?,
        })
        .and_then(Llama::init_weights)
    }

    /// Hugging Face's initialisation (`initializer_range` 0.02): every product's and the
    /// embedding's weight N(0, 0.02); the norms' scales stay ones.
    fn init_weights(self) -> Result<Llama> {
        for (name, p) in self.named_parameters() {
            if !name.contains("norm") {
                normal_(&p, 0.0, 0.02)?;
            }
        }
        Ok(self)
    }

    /// Token ids `[B, T]` (I64) to logits `[B, T, vocab]`, causal.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, None)
    }

    /// Logits of `ids` `[B, T]` at positions `cache.len()..`, attending over the cached
    /// positions too; their keys and values are appended to `cache` (one entry a layer).
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.run(ids, Some(Cache::growing(cache)))
    }

    /// Logits of `ids` `[B, T]` at `positions` (I64 `[T]`) over `cache` (as
    /// `Gpt::forward_static`: one compiled decode step serves every position).
    pub fn forward_static(&self, ids: &Tensor, positions: &Tensor, cache: &StaticKvCache) -> Result<Tensor> {
        self.run(ids, Some(Cache::Static { cache, positions }))
    }

    fn run(&self, ids: &Tensor, mut cache: Option<Cache>) -> Result<Tensor> {
        let &[_, t] = ids.shape() else {
            return Err(Error::shape("llama", format!("token ids must be [B, T], got {:?}", ids.shape())));
        };
        match &cache {
            Some(c) => c.check_room(t, self.config.max_seq)?,
            None if t > self.config.max_seq => {
                return Err(Error::shape("llama", format!("{t} tokens exceed max_seq {}", self.config.max_seq)));
            }
            None => {}
        }
        let mut x = self.embed_tokens.forward(ids)?;
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(&x, &self.rope, &self.config, cache.as_mut().map(|c| (c, i)))?;
        }
        self.lm_head.forward(&self.norm.forward(&x)?)
    }

    /// Mean next-token cross-entropy of `ids` against `targets` (both `[B, T]`).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.forward(ids)?;
        cross_entropy(&logits.reshape(&(-1, self.config.vocab))?, &targets.reshape(&(-1,))?)
    }
}

impl LlamaLayer {
    fn forward(&self, x: &Tensor, rope: &RotaryEmbedding, c: &LlamaConfig, cache: Option<(&mut Cache, usize)>) -> Result<Tensor> {
        let h = (x + self.self_attn.forward(&self.input_layernorm.forward(x)?, rope, c, cache)?)?;
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?
    }
}

impl LlamaAttention {
    /// Causal grouped-query attention over `x` `[B, T, dim]`, rotary embeddings on q and k;
    /// with `cache` (the cache and this layer) over the cached keys and values too, this
    /// layer's added.
    fn forward(&self, x: &Tensor, rope: &RotaryEmbedding, c: &LlamaConfig, cache: Option<(&mut Cache, usize)>) -> Result<Tensor> {
        let t = x.shape()[1];
        let (q, k) = (split_heads(&self.q_proj.forward(x)?, c.n_heads)?, split_heads(&self.k_proj.forward(x)?, c.n_kv_heads)?);
        let v = split_heads(&self.v_proj.forward(x)?, c.n_kv_heads)?;
        // Grouped-query: each k/v head serves n_heads / n_kv_heads query heads, in the fused
        // kernels without a repeated copy (`scaled_dot_product_attention`).
        let att = match cache {
            Some((cache, layer)) => {
                let pos = cache.positions(t, x.device())?;
                cache.attend(layer, &rope.apply_at(&q, &pos)?, &rope.apply_at(&k, &pos)?, &v)?
            }
            None => causal_attention_at(&rope.apply(&q, 0)?, &rope.apply(&k, 0)?, &v, 0)?,
        };
        self.o_proj.forward(&merge_heads(&att)?)
    }
}
