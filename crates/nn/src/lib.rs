//! kiln-nn: the `Module` trait, layers (Linear, Conv2d and pooling, Embedding, LayerNorm,
//! RMSNorm, BatchNorm, Dropout, activations, Sequential, MultiheadAttention, Transformer), losses,
//! PyTorch-default initialisation and safetensors state dicts.
//!
//! Parameters are tensor leaves with `requires_grad` set; a module lists them under PyTorch's
//! state-dict names (`layers.0.weight`) through `Module::visit`.

pub mod activation;
pub mod attention;
pub mod conv;
#[doc(hidden)]
pub mod derive_support;
pub mod init;
pub mod kv_cache;
pub mod layers;
pub mod loss;
mod module;
pub mod rnn;
pub mod rope;
pub mod state_dict;
pub mod transformer;

pub use activation::{leaky_relu, Activation, Gelu, LeakyRelu, Relu, Sigmoid, Silu, Tanh};
pub use attention::{
    causal_mask, merge_heads, repeat_kv, scaled_dot_product_attention, set_fused_attention, split_heads, AttnMasks, MultiheadAttention,
};
pub use conv::{
    adaptive_avg_pool2d, avg_pool2d, conv1d, conv2d, conv2d_groups, conv_transpose2d, interpolate, max_pool2d, unfold, AdaptiveAvgPool2d,
    AvgPool2d, Conv1d, Conv2d, ConvTranspose2d, Flatten, Interpolation, MaxPool2d, Upsample, Window,
};
pub use kiln_derive::Module;
pub use kv_cache::{causal_attention_at, Cache, KvCache, StaticKvCache};
pub use layers::{dropout, BatchNorm, Dropout, Embedding, GroupNorm, Layer, LayerNorm, Linear, RmsNorm, Sequential, SwiGlu};
pub use loss::{
    binary_cross_entropy, binary_cross_entropy_with_logits, cross_entropy, cross_entropy_with, huber_loss, kl_div, l1_loss, mse_loss,
    nll_loss, smooth_l1_loss, CrossEntropyConfig, Reduction,
};
pub use module::{join, Forward, Module};
pub use rnn::{Gates, Gru, GruCell, Lstm, LstmCell, RnnConfig};
pub use rope::{rotate_half, RotaryEmbedding};
pub use state_dict::{load_state_dict, load_state_dict_from_bytes, save_state_dict, state_dict_to_bytes};
pub use transformer::{Transformer, TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer, TransformerMasks};
