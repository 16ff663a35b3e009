//! Token data for training a language model: shard files memory-mapped (a corpus larger
//! than memory streams from disk) - llm.c's, with their header, or nanoGPT's bare `u16`
//! tokens - or tokens held in memory; a train and a validation split;
//! random windows of `context + 1` tokens drawn as `[B, T]` inputs and next-token targets.

use super::shards::{shard_tokens, SHARD_HEADER, SHARD_MAGIC};
use super::tokenizer::Gpt2Tokenizer;
use kiln_tensor::{Device, Error, Result, Tensor};
use rand::Rng;
use std::path::{Path, PathBuf};

/// One shard's tokens: a memory-mapped file or a buffer.
enum Tokens {
    /// A mapped file, its tokens from byte `start`.
    Mapped(memmap2::Mmap, usize),
    Owned(Vec<u16>),
}

struct Shard {
    name: String,
    tokens: Tokens,
    len: usize,
}

impl Shard {
    fn get(&self, i: usize) -> u16 {
        match &self.tokens {
            Tokens::Mapped(m, start) => u16::from_le_bytes([m[start + 2 * i], m[start + 2 * i + 1]]),
            Tokens::Owned(v) => v[i],
        }
    }
}

/// The tokens of one split (train or validation), in one or more shards; a window never
/// crosses from one shard into the next.
pub struct TokenSplit {
    shards: Vec<Shard>,
}

impl TokenSplit {
    /// Shard files, memory-mapped: llm.c's (header and length checked), or files of bare
    /// little-endian `u16` tokens as nanoGPT's `prepare.py` writes (a whole number of them).
    pub fn open(paths: &[PathBuf]) -> Result<TokenSplit> {
        let mut shards = Vec::with_capacity(paths.len());
        for path in paths {
            let file = std::fs::File::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
            // SAFETY: the map is read only; a shard changed by another process while mapped
            // would give other token values, never memory outside the map (each read is
            // bounds-checked against the length checked here).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
            let llmc = map.len() >= 4 && map[..4] == SHARD_MAGIC.to_le_bytes();
            let (start, len) = if llmc {
                (SHARD_HEADER, shard_tokens(path, &map)?)
            } else if map.len() % 2 == 0 {
                (0, map.len() / 2)
            } else {
                let msg = format!("{} bytes are not a whole number of u16 tokens (nor an llm.c shard)", map.len());
                return Err(Error::Format { what: path.display().to_string(), msg });
            };
            shards.push(Shard { name: path.display().to_string(), tokens: Tokens::Mapped(map, start), len });
        }
        Ok(TokenSplit { shards })
    }

    /// Tokens held in memory; `name` labels them in errors.
    pub fn from_tokens(name: &str, tokens: Vec<u16>) -> TokenSplit {
        let len = tokens.len();
        TokenSplit { shards: vec![Shard { name: name.to_string(), tokens: Tokens::Owned(tokens), len }] }
    }

    /// Tokens in all shards.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The start (shard, position) of a window of `len` tokens drawn uniformly over every
    /// place one fits.
    fn draw(&self, len: usize, rng: &mut impl Rng) -> Result<(usize, usize)> {
        let fits: Vec<usize> = self.shards.iter().map(|s| (s.len + 1).saturating_sub(len)).collect();
        let total: usize = fits.iter().sum();
        if total == 0 {
            let names: Vec<&str> = self.shards.iter().map(|s| s.name.as_str()).collect();
            return Err(Error::Msg(format!(
                "token data {names:?}: no shard holds a window of {len} tokens ({} tokens in all)",
                self.len()
            )));
        }
        let mut at = rng.random_range(0..total);
        for (i, f) in fits.iter().enumerate() {
            if at < *f {
                return Ok((i, at));
            }
            at -= f;
        }
        unreachable!("at < total")
    }

    /// `len` tokens from `start` of shard `shard`, each checked against `vocab`.
    fn window(&self, shard: usize, start: usize, len: usize, vocab: usize) -> Result<Vec<i64>> {
        let s = &self.shards[shard];
        (start..start + len)
            .map(|i| match s.get(i) {
                t if (t as usize) < vocab => Ok(t as i64),
                t => Err(Error::Msg(format!("{}: token {t} at position {i} is outside the model's vocabulary of {vocab}", s.name))),
            })
            .collect()
    }

    /// `batch` random windows of `context + 1` tokens as inputs `x` and targets `y` (`y` is
    /// `x` shifted by one), `[batch, context]` I64 on `device`; a token not below `vocab` is
    /// an error naming its shard and position.
    pub fn batch(&self, batch: usize, context: usize, vocab: usize, rng: &mut impl Rng, device: Device) -> Result<(Tensor, Tensor)> {
        let (mut x, mut y) = (Vec::with_capacity(batch * context), Vec::with_capacity(batch * context));
        for _ in 0..batch {
            let (shard, start) = self.draw(context + 1, rng)?;
            let w = self.window(shard, start, context + 1, vocab)?;
            x.extend_from_slice(&w[..context]);
            y.extend_from_slice(&w[1..]);
        }
        let to = |v: Vec<i64>| Tensor::from_vec(v, &[batch, context], Device::Cpu)?.to_device(device);
        Ok((to(x)?, to(y)?))
    }
}

/// A language model's data: the train and validation splits.
///
/// ```
/// use kiln::text::TokenDataset;
/// use rand::SeedableRng;
/// let text = "Kiln trains language models. ".repeat(40);
/// let data = TokenDataset::from_text("example", &text, 0.1)?; // the last tenth held out
/// let mut rng = rand::rngs::StdRng::seed_from_u64(0);
/// let (x, y) = data.train.batch(4, 16, 50257, &mut rng, kiln::Device::Cpu)?;
/// assert_eq!((x.shape(), y.shape()), (&[4, 16][..], &[4, 16][..])); // y is x shifted by one
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct TokenDataset {
    pub train: TokenSplit,
    pub val: TokenSplit,
}

impl TokenDataset {
    /// A directory of llm.c or nanoGPT-style shards: files ending in `.bin` whose names hold
    /// `train` or `val` (e.g. `kiln_prepare`'s `train_000.bin`, `val_000.bin`).
    pub fn open_dir(dir: &Path) -> Result<TokenDataset> {
        let entries = std::fs::read_dir(dir).map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
        let mut paths: Vec<PathBuf> =
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "bin")).collect();
        paths.sort();
        let named = |part: &str| -> Vec<PathBuf> {
            paths.iter().filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().contains(part))).cloned().collect()
        };
        let (train, val) = (named("train"), named("val"));
        if train.is_empty() || val.is_empty() {
            return Err(Error::Io(format!("{}: needs train and val shards (*train*.bin, *val*.bin), found {paths:?}", dir.display())));
        }
        Ok(TokenDataset { train: TokenSplit::open(&train)?, val: TokenSplit::open(&val)? })
    }

    /// Tokens in memory, the last `val_fraction` of them held out for validation.
    pub fn from_tokens(name: &str, tokens: Vec<u16>, val_fraction: f64) -> Result<TokenDataset> {
        if !(0.0..1.0).contains(&val_fraction) || tokens.len() < 2 {
            return Err(Error::Msg(format!(
                "{name}: {} tokens and val_fraction {val_fraction}: need 2 tokens and a fraction in [0, 1)",
                tokens.len()
            )));
        }
        let cut = tokens.len() - ((tokens.len() as f64 * val_fraction) as usize).max(1);
        let mut train = tokens;
        let val = train.split_off(cut);
        Ok(TokenDataset {
            train: TokenSplit::from_tokens(&format!("{name} (train)"), train),
            val: TokenSplit::from_tokens(&format!("{name} (val)"), val),
        })
    }

    /// A text tokenized with GPT-2's tokenizer, split as `from_tokens`.
    pub fn from_text(name: &str, text: &str, val_fraction: f64) -> Result<TokenDataset> {
        if text.trim().is_empty() {
            return Err(Error::Msg(format!("{name}: the text is empty")));
        }
        let tokens = Gpt2Tokenizer::new()?.encode(text).into_iter().map(|t| t as u16).collect();
        TokenDataset::from_tokens(name, tokens, val_fraction)
    }
}
