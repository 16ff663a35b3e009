//! Llama as `transformers`' `LlamaForCausalLM` stores it: Kiln's `Llama` already uses its
//! names (`model.embed_tokens`, `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
//! `mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`, `model.norm`,
//! `lm_head`); a tied head is stored once, as `model.embed_tokens.weight`.

use super::dir::{f64_field, load_into, read_dir, stored_tensors, torch_dtype, usize_field, write_dir, Stored};
use crate::models::{Llama, LlamaConfig};
use kiln_tensor::{Device, Error, Result};
use serde_json::{json, Value};
use std::path::Path;

/// A `LlamaConfig` from a Llama `config.json`; settings Kiln's Llama does not model (another
/// activation, biases, RoPE scaling, a head dim other than hidden / heads) are errors.
pub fn llama_config(c: &Value) -> Result<LlamaConfig> {
    let what = "Llama config.json";
    let bad = |msg: String| Error::Format { what: what.into(), msg };
    if let Some(act) = c.get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu") {
        return Err(bad(format!("hidden_act \"{act}\" is not supported (silu)")));
    }
    for flag in ["attention_bias", "mlp_bias"] {
        if c.get(flag).and_then(Value::as_bool) == Some(true) {
            return Err(bad(format!("{flag} is not supported")));
        }
    }
    if c.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        return Err(bad("rope_scaling is not supported".into()));
    }
    let dim = usize_field(c, "hidden_size", what)?;
    let n_heads = usize_field(c, "num_attention_heads", what)?;
    if let Some(hd) = c.get("head_dim").and_then(Value::as_u64) {
        if n_heads == 0 || hd as usize * n_heads != dim {
            return Err(bad(format!("head_dim {hd} is not hidden_size {dim} / num_attention_heads {n_heads}")));
        }
    }
    Ok(LlamaConfig {
        vocab: usize_field(c, "vocab_size", what)?,
        dim,
        n_layers: usize_field(c, "num_hidden_layers", what)?,
        n_heads,
        n_kv_heads: c.get("num_key_value_heads").and_then(Value::as_u64).map_or(n_heads, |v| v as usize),
        hidden: usize_field(c, "intermediate_size", what)?,
        max_seq: usize_field(c, "max_position_embeddings", what)?,
        rope_theta: f64_field(c, "rope_theta", 10000.0),
        norm_eps: f64_field(c, "rms_norm_eps", 1e-6),
        tied_head: c.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
    })
}

/// The `config.json` `transformers` needs to build `c` as a `LlamaForCausalLM`.
pub fn llama_config_json(c: &LlamaConfig, dtype: kiln_tensor::DType) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab,
        "hidden_size": c.dim,
        "intermediate_size": c.hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.dim / c.n_heads.max(1),
        "max_position_embeddings": c.max_seq,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tied_head,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "rope_scaling": null,
        "torch_dtype": torch_dtype(dtype),
    })
}

/// Every tensor under its own name; a tied head is not stored.
fn stored(tied: bool) -> impl Fn(&str) -> Option<Stored> {
    move |name: &str| (!(tied && name == "lm_head.weight")).then(|| Stored { name: name.to_string(), transposed: false })
}

/// Rotary tables older checkpoints carry; Kiln recomputes them.
fn ignored(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

impl Llama {
    /// A Llama checkpoint directory (`config.json` and safetensors, one file or shards with
    /// their index) as a Kiln Llama on `device`, in the default dtype.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: Device) -> Result<Llama> {
        let ck = read_dir(dir.as_ref())?;
        let model = Llama::new(llama_config(&ck.config)?, device)?;
        load_into(&model, &ck, stored(model.config.tied_head), &[""], ignored)?;
        Ok(model)
    }

    /// Writes this model as a checkpoint directory that `transformers`'
    /// `LlamaForCausalLM.from_pretrained(dir)` loads.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_pretrained_sharded(dir, None)
    }

    /// `save_pretrained` in shards of about `max_shard_bytes` each with their index.
    pub fn save_pretrained_sharded(&self, dir: impl AsRef<Path>, max_shard_bytes: Option<usize>) -> Result<()> {
        let config = llama_config_json(&self.config, self.embed_tokens.weight.dtype());
        let tensors = stored_tensors(self, stored(self.config.tied_head))?;
        write_dir(dir.as_ref(), &config, &tensors, max_shard_bytes)
    }
}
