//! Text for language models: GPT-2's BPE tokenizer (through `tiktoken-rs`, which carries
//! GPT-2's ranks inside the crate: nothing is downloaded) and token shards as llm.c writes
//! them (a header of 256 little-endian `i32`: magic 20240520, version 1, the token count;
//! then the tokens as little-endian `u16`).

mod dataset;

pub use dataset::{TokenDataset, TokenSplit};

use kiln_tensor::{Error, Result};
use std::path::Path;

/// GPT-2's tokenizer (`r50k_base`): 50257 tokens, `<|endoftext|>` = 50256.
pub struct Gpt2Tokenizer {
    bpe: tiktoken_rs::CoreBPE,
}

impl Gpt2Tokenizer {
    /// The vocabulary size.
    pub const VOCAB: usize = 50257;
    /// `<|endoftext|>`, which separates documents.
    pub const EOT: u32 = 50256;

    pub fn new() -> Result<Gpt2Tokenizer> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| Error::Msg(format!("GPT-2 tokenizer: {e}")))?;
        Ok(Gpt2Tokenizer { bpe })
    }

    /// The ids of `text`, special-token text included as ordinary text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// `encode`, with `<|endoftext|>` read as the end-of-text token.
    pub fn encode_with_eot(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special_tokens(text)
    }

    /// The text of `ids`; an id outside the vocabulary is an error naming its position.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= Self::VOCAB) {
            return Err(Error::Msg(format!("GPT-2 tokenizer: token {id} at position {i} is outside the vocabulary of {}", Self::VOCAB)));
        }
        self.bpe.decode(ids).map_err(|e| Error::Msg(format!("GPT-2 tokenizer: {e}")))
    }
}

const SHARD_MAGIC: i32 = 20240520;
const SHARD_VERSION: i32 = 1;
pub(crate) const SHARD_HEADER: usize = 256 * 4;

/// Writes `tokens` as one llm.c shard at `path`.
pub fn write_shard(path: &Path, tokens: &[u16]) -> Result<()> {
    let count = i32::try_from(tokens.len())
        .map_err(|_| Error::Io(format!("{}: {} tokens exceed a shard's count", path.display(), tokens.len())))?;
    let mut bytes = Vec::with_capacity(SHARD_HEADER + 2 * tokens.len());
    for v in [SHARD_MAGIC, SHARD_VERSION, count].into_iter().chain(std::iter::repeat_n(0, 253)) {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    tokens.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
    std::fs::write(path, bytes).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}

/// Reads an llm.c shard: its tokens, after checking the header and the file's length.
pub fn read_shard(path: &Path) -> Result<Vec<u16>> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    shard_tokens(path, &bytes)?;
    Ok(bytes[SHARD_HEADER..].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

/// The token count of a shard's bytes (header and length checked); `path` names it in errors.
fn shard_tokens(path: &Path, bytes: &[u8]) -> Result<usize> {
    let bad = |msg: String| Error::Format { what: path.display().to_string(), msg };
    if bytes.len() < SHARD_HEADER {
        return Err(bad(format!("{} bytes: shorter than a shard's {SHARD_HEADER}-byte header", bytes.len())));
    }
    let field = |i: usize| i32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
    if (field(0), field(1)) != (SHARD_MAGIC, SHARD_VERSION) {
        return Err(bad(format!("magic {} version {}: not an llm.c token shard ({SHARD_MAGIC}, {SHARD_VERSION})", field(0), field(1))));
    }
    let count = usize::try_from(field(2)).map_err(|_| bad(format!("a negative token count {}", field(2))))?;
    let body = bytes.len() - SHARD_HEADER;
    if body != 2 * count {
        return Err(bad(format!("the header counts {count} tokens, but {body} bytes follow it (want {})", 2 * count)));
    }
    Ok(count)
}
