//! llm.c's token shard files: writing, reading and checking their headers.

use kiln_tensor::{Error, Result};
use std::path::Path;

pub(crate) const SHARD_MAGIC: i32 = 20240520;
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
pub(crate) fn shard_tokens(path: &Path, bytes: &[u8]) -> Result<usize> {
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
