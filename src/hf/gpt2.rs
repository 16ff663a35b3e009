//! GPT-2 as `transformers`' `GPT2LMHeadModel` stores it: `wte`, `wpe`, `h.{i}.ln_1`,
//! `h.{i}.attn.c_attn`, `h.{i}.attn.c_proj`, `h.{i}.ln_2`, `h.{i}.mlp.c_fc`,
//! `h.{i}.mlp.c_proj`, `ln_f` (with or without the `transformer.` prefix), the products'
//! weights as `Conv1D`'s `[in, out]`, the head tied to `wte` unless `tie_word_embeddings` is
//! false; the `attn.bias` mask buffers are skipped.

use super::dir::{f64_field, load_into, read_dir, stored_tensors, torch_dtype, usize_field, write_dir, Stored};
use crate::models::{Gpt, GptConfig};
use kiln_nn::{Activation, Module};
use kiln_tensor::{Device, Error, Result};
use serde_json::{json, Value};
use std::path::Path;

/// Kiln's name of a GPT tensor to its name in a GPT-2 checkpoint (without the
/// `transformer.` prefix, the head's `lm_head.weight` apart).
fn stored(name: &str) -> Option<Stored> {
    let plain = |n: &str| Some(Stored { name: n.to_string(), transposed: false });
    match name {
        "tok_emb.weight" => return plain("wte.weight"),
        "pos_emb.weight" => return plain("wpe.weight"),
        "head.weight" => return plain("lm_head.weight"),
        _ => {}
    }
    if let Some(rest) = name.strip_prefix("ln_f.") {
        return plain(&format!("ln_f.{rest}"));
    }
    let rest = name.strip_prefix("blocks.")?;
    let (layer, part) = rest.split_once('.')?;
    let (module, field) = part.rsplit_once('.')?;
    let (hf, conv1d) = match module {
        "ln1" => ("ln_1", false),
        "ln2" => ("ln_2", false),
        "attn.qkv" => ("attn.c_attn", true),
        "attn.proj" => ("attn.c_proj", true),
        "mlp.fc" => ("mlp.c_fc", true),
        "mlp.proj" => ("mlp.c_proj", true),
        _ => return None,
    };
    Some(Stored { name: format!("h.{layer}.{hf}.{field}"), transposed: conv1d && field == "weight" })
}

/// The head is stored at the top level; everything else under `transformer.` when saved.
fn saved_name(s: Stored) -> Stored {
    match s.name.as_str() {
        "lm_head.weight" => s,
        _ => Stored { name: format!("transformer.{}", s.name), ..s },
    }
}

/// The causal-mask buffers older checkpoints carry; nothing to load.
fn ignored(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

/// A `GptConfig` from a GPT-2 `config.json`; settings Kiln's GPT does not model are errors.
pub fn gpt2_config(c: &Value) -> Result<GptConfig> {
    let what = "GPT-2 config.json";
    let bad = |msg: String| Error::Format { what: what.into(), msg };
    let d_model = usize_field(c, "n_embd", what)?;
    if let Some(inner) = c.get("n_inner").and_then(Value::as_u64) {
        if inner as usize != 4 * d_model {
            return Err(bad(format!("n_inner {inner} is not 4 * n_embd ({}), which Kiln's GPT assumes", 4 * d_model)));
        }
    }
    let activation = match c.get("activation_function").and_then(Value::as_str).unwrap_or("gelu_new") {
        "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
        "gelu" => Activation::Gelu,
        other => return Err(bad(format!("activation_function \"{other}\" is not supported (gelu_new, gelu_pytorch_tanh, gelu)"))),
    };
    let eps = f64_field(c, "layer_norm_epsilon", 1e-5);
    if (eps - 1e-5).abs() > 1e-12 {
        return Err(bad(format!("layer_norm_epsilon {eps} is not supported (Kiln's GPT uses 1e-5)")));
    }
    for flag in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if c.get(flag).and_then(Value::as_bool) == Some(true) {
            return Err(bad(format!("{flag} is not supported")));
        }
    }
    Ok(GptConfig {
        vocab: usize_field(c, "vocab_size", what)?,
        context: usize_field(c, "n_positions", what)?,
        d_model,
        n_layer: usize_field(c, "n_layer", what)?,
        n_head: usize_field(c, "n_head", what)?,
        dropout: f64_field(c, "resid_pdrop", 0.0),
        tied_head: c.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true),
        activation,
    })
}

/// The `config.json` `transformers` needs to build `c` as a `GPT2LMHeadModel`.
pub fn gpt2_config_json(c: &GptConfig, dtype: kiln_tensor::DType) -> Result<Value> {
    let activation = match c.activation {
        Activation::GeluTanh => "gelu_new",
        Activation::Gelu => "gelu",
        other => return Err(Error::Msg(format!("save_pretrained: GPT-2 has no activation {other:?} (Gelu or GeluTanh)"))),
    };
    let mut v = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab,
        "n_positions": c.context,
        "n_ctx": c.context,
        "n_embd": c.d_model,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": null,
        "activation_function": activation,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": c.tied_head,
        "torch_dtype": torch_dtype(dtype),
    });
    if c.vocab > 50256 {
        v["bos_token_id"] = json!(50256);
        v["eos_token_id"] = json!(50256);
    }
    Ok(v)
}

impl Gpt {
    /// A GPT-2 checkpoint directory (`config.json` and safetensors, as `transformers`'
    /// `save_pretrained` writes) as a Kiln GPT on `device`, in the default dtype.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: Device) -> Result<Gpt> {
        let ck = read_dir(dir.as_ref())?;
        let model = Gpt::new(gpt2_config(&ck.config)?, device)?;
        load_into(&model, &ck, stored, &["transformer.", ""], ignored)?;
        model.set_training(false);
        Ok(model)
    }

    /// Writes this model as a GPT-2 checkpoint directory that `transformers`'
    /// `GPT2LMHeadModel.from_pretrained(dir)` loads.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_pretrained_sharded(dir, None)
    }

    /// `save_pretrained` in shards of about `max_shard_bytes` each with their index.
    pub fn save_pretrained_sharded(&self, dir: impl AsRef<Path>, max_shard_bytes: Option<usize>) -> Result<()> {
        let config = gpt2_config_json(&self.config, self.tok_emb.weight.dtype())?;
        let tensors = stored_tensors(self, |n| stored(n).map(saved_name))?;
        write_dir(dir.as_ref(), &config, &tensors, max_shard_bytes)
    }
}
