//! GPT-2's BPE tokenizer through `tiktoken-rs`.

use kiln_tensor::{Error, Result};

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
        Self::check(ids)?;
        self.bpe.decode(ids).map_err(|e| Error::Msg(format!("GPT-2 tokenizer: {e}")))
    }

    /// An id outside the vocabulary is an error naming its position.
    fn check(ids: &[u32]) -> Result<()> {
        match ids.iter().enumerate().find(|(_, &id)| id as usize >= Self::VOCAB) {
            Some((i, id)) => {
                Err(Error::Msg(format!("GPT-2 tokenizer: token {id} at position {i} is outside the vocabulary of {}", Self::VOCAB)))
            }
            None => Ok(()),
        }
    }

    /// `decode` for text that may end or break inside a character (a sample cut at any
    /// token): bytes that are not UTF-8 become U+FFFD, as Hugging Face's decoders do.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String> {
        Self::check(ids)?;
        let bytes = self.bpe.decode_bytes(ids).map_err(|e| Error::Msg(format!("GPT-2 tokenizer: {e}")))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
