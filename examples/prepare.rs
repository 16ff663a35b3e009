//! Tokenize text files into llm.c token shards for `examples/lm.rs --data DIR`.
//!
//!   cargo run --release --example prepare -- --input FILE|DIR --out DIR [--val-fraction 0.1] [--shard-tokens 100000000]
//!
//! Each `.txt` file (a directory is read recursively, in name order) is one document: its
//! GPT-2 tokens follow an `<|endoftext|>`, the last `--val-fraction` of them go to the
//! validation shards and the rest to the training ones (`train_000.bin`, ..., `val_000.bin`),
//! written as each fills, so that only one file's tokens are in memory at a time.

mod common;

use common::{flag, opt};
use kiln::prelude::*;
use kiln::text::{write_shard, Gpt2Tokenizer};
use std::path::{Path, PathBuf};

/// Tokens of one split, written out a shard at a time.
struct ShardWriter {
    dir: PathBuf,
    split: &'static str,
    size: usize,
    buf: Vec<u16>,
    written: Vec<(PathBuf, usize)>,
}

impl ShardWriter {
    fn push(&mut self, tokens: &[u32]) -> Result<()> {
        for &t in tokens {
            self.buf.push(t as u16);
            if self.buf.len() == self.size {
                self.flush()?;
            }
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<()> {
        if !self.buf.is_empty() {
            let path = self.dir.join(format!("{}_{:03}.bin", self.split, self.written.len()));
            write_shard(&path, &self.buf)?;
            self.written.push((path, self.buf.len()));
            self.buf.clear();
        }
        Ok(())
    }
}

fn text_files(root: &Path) -> Result<Vec<PathBuf>> {
    if root.is_file() {
        return Ok(vec![root.to_path_buf()]);
    }
    let mut out = Vec::new();
    let entries = std::fs::read_dir(root).map_err(|e| Error::Io(format!("{}: {e}", root.display())))?;
    for e in entries {
        let p = e.map_err(|e| Error::Io(format!("{}: {e}", root.display())))?.path();
        if p.is_dir() {
            out.extend(text_files(&p)?);
        } else if p.extension().is_some_and(|x| x == "txt") {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

fn main() -> Result<()> {
    let (Some(input), Some(out)) = (opt("--input"), opt("--out")) else {
        return Err(Error::Msg("usage: prepare --input FILE|DIR --out DIR [--val-fraction 0.1] [--shard-tokens N]".into()));
    };
    let val_fraction: f64 = flag("--val-fraction", 0.1);
    let size: usize = flag("--shard-tokens", 100_000_000);
    let files = text_files(Path::new(&input))?;
    if files.is_empty() {
        return Err(Error::Io(format!("{input}: no .txt files")));
    }
    std::fs::create_dir_all(&out).map_err(|e| Error::Io(format!("{out}: {e}")))?;
    let tok = Gpt2Tokenizer::new()?;
    let writer = |split| ShardWriter { dir: PathBuf::from(&out), split, size, buf: Vec::new(), written: Vec::new() };
    let (mut train, mut val) = (writer("train"), writer("val"));
    let bytes: u64 = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    let pb = common::bar(bytes, "tokenize");
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| Error::Io(format!("{}: {e}", f.display())))?;
        if text.trim().is_empty() {
            return Err(Error::Io(format!("{}: the file is empty", f.display())));
        }
        let mut ids = vec![Gpt2Tokenizer::EOT];
        ids.extend(tok.encode(&text));
        let cut = ids.len() - (ids.len() as f64 * val_fraction) as usize;
        train.push(&ids[..cut])?;
        val.push(&ids[cut..])?;
        pb.inc(text.len() as u64);
        pb.set_message(format!("{} train + {} val shards", train.written.len(), val.written.len()));
    }
    train.flush()?;
    val.flush()?;
    pb.finish_and_clear();
    for (path, n) in train.written.iter().chain(&val.written) {
        println!("{}: {n} tokens", path.display());
    }
    Ok(())
}
