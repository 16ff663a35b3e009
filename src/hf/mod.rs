//! Hugging Face checkpoints in and out: a directory with `config.json` and the weights as
//! `model.safetensors`, or as shards listed by `model.safetensors.index.json`, as
//! `transformers`' `save_pretrained` writes and `from_pretrained` reads.
//!
//! `Gpt::from_pretrained(dir, device)` and `Llama::from_pretrained(dir, device)` build the
//! model from the config and load every tensor (names, shapes and the index checked, nothing
//! written on any error); `save_pretrained(dir)` writes a directory `transformers` loads.

mod dir;
mod gpt2;
mod llama;

pub use dir::{read_dir, write_dir, Checkpoint};
pub use gpt2::{gpt2_config, gpt2_config_json};
pub use llama::{llama_config, llama_config_json};
