//! Hugging Face checkpoints in and out: a directory with `config.json` and the weights as
//! `model.safetensors`, or as shards listed by `model.safetensors.index.json`, as
//! `transformers`' `save_pretrained` writes and `from_pretrained` reads.
//!
//! `Gpt::from_pretrained(dir, device)` and `Llama::from_pretrained(dir, device)` build the
//! model from the config and load every tensor (names, shapes and the index checked, nothing
//! written on any error); `save_pretrained(dir)` writes a directory `transformers` loads.
//!
//! ```
//! use kiln::models::Gpt;
//! use kiln::prelude::*;
//! // A tiny GPT-2 that `transformers` saved (`benches/pytorch/hf_reference.py make`).
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/hf/gpt2");
//! let model = Gpt::from_pretrained(dir, Device::Cpu)?;
//! let ids = Tensor::from_vec(vec![3i64, 17, 42], &[1, 3], Device::Cpu)?;
//! let logits = no_grad(|| model.forward(&ids))?;
//! assert_eq!(logits.shape(), &[1, 3, 96]);
//! let out = std::env::temp_dir().join(format!("kiln-doc-gpt2-{}", std::process::id()));
//! model.save_pretrained(&out)?; // config.json + model.safetensors
//! assert!(out.join("config.json").exists());
//! # Ok::<(), kiln::Error>(())
//! ```

mod any;
mod dir;
mod gpt2;
mod llama;

pub use any::AnyLm;
pub use dir::{model_type, read_dir, write_dir, Checkpoint};
pub use gpt2::{gpt2_config, gpt2_config_json};
pub use llama::{llama_config, llama_config_json};
