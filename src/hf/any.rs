//! `AnyLm`: a GPT-2 or a Llama, for programs that take either (an `--arch` flag, or a Hugging
//! Face directory of either kind).

use super::dir::model_type;
use crate::models::{CausalLm, Gpt, Llama};
use kiln_nn::Module;
use kiln_tensor::{Device, Result, Tensor};
use std::path::Path;

/// One of the two language models.
pub enum AnyLm {
    Gpt(Gpt),
    Llama(Llama),
}

impl AnyLm {
    /// The model saved in `dir`, of the kind its `config.json` names (`model_type`).
    pub fn from_pretrained(dir: impl AsRef<Path>, device: Device) -> Result<AnyLm> {
        let dir = dir.as_ref();
        Ok(if model_type(dir)? == "llama" {
            AnyLm::Llama(Llama::from_pretrained(dir, device)?)
        } else {
            AnyLm::Gpt(Gpt::from_pretrained(dir, device)?)
        })
    }

    pub fn module(&self) -> &dyn Module {
        match self {
            AnyLm::Gpt(m) => m,
            AnyLm::Llama(m) => m,
        }
    }

    pub fn lm(&self) -> &dyn CausalLm {
        match self {
            AnyLm::Gpt(m) => m,
            AnyLm::Llama(m) => m,
        }
    }

    /// Mean next-token cross-entropy of `x` against `y` (both `[B, T]`).
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        match self {
            AnyLm::Gpt(m) => m.loss(x, y),
            AnyLm::Llama(m) => m.loss(x, y),
        }
    }

    /// Writes a Hugging Face checkpoint directory.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        match self {
            AnyLm::Gpt(m) => m.save_pretrained(dir),
            AnyLm::Llama(m) => m.save_pretrained(dir),
        }
    }

    /// Layers and width.
    pub fn layers_and_width(&self) -> (usize, usize) {
        match self {
            AnyLm::Gpt(m) => (m.config.n_layer, m.config.d_model),
            AnyLm::Llama(m) => (m.config.n_layers, m.config.dim),
        }
    }

    /// "GPT-2" or "Llama".
    pub fn arch(&self) -> &'static str {
        match self {
            AnyLm::Gpt(_) => "GPT-2",
            AnyLm::Llama(_) => "Llama",
        }
    }
}
