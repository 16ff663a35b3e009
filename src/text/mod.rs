//! Text for language models: GPT-2's BPE tokenizer (through `tiktoken-rs`, which carries
//! GPT-2's ranks inside the crate: nothing is downloaded) and token shards as llm.c writes
//! them (a header of 256 little-endian `i32`: magic 20240520, version 1, the token count;
//! then the tokens as little-endian `u16`).

mod dataset;
mod shards;
mod tokenizer;

pub use dataset::{TokenDataset, TokenSplit};
pub use shards::{read_shard, write_shard};
pub use tokenizer::Gpt2Tokenizer;
