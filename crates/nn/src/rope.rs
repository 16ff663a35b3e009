//! Rotary position embeddings (RoPE) in Llama's half-split layout: dims `j` and `j + D/2` of
//! each head rotate together by the angle `p * theta^(-2j / D)` at position `p`. Built from
//! tensor ops, so it runs on every device, eager and compiled, with its backward.

use kiln_tensor::{DType, Device, Error, Result, Tensor};

/// The cos and sin tables of RoPE for positions `0..max_seq` (`[max_seq, head_dim]` each,
/// computed in f64 and stored in the dtype asked for), applied with a position offset for
/// decoding with a cache. Like Hugging Face's `rotary_emb`, it holds no parameter; its tables
/// are buffers, which a model holding it skips (not saved) and `to_device` moves.
#[derive(Debug, Clone, kiln_derive::Module)]
#[module(crate = "crate")]
pub struct RotaryEmbedding {
    #[module(buffer)]
    cos: Tensor,
    #[module(buffer)]
    sin: Tensor,
    head_dim: usize,
    max_seq: usize,
}

impl RotaryEmbedding {
    /// Tables for heads of `head_dim` (even) up to `max_seq` positions; Llama's `theta` is
    /// 10000 (500000 for Llama 3).
    pub fn new(head_dim: usize, max_seq: usize, theta: f64, dtype: DType, device: Device) -> Result<RotaryEmbedding> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::shape("rope", format!("head_dim must be even and positive, got {head_dim}")));
        }
        let half = head_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(max_seq * head_dim), Vec::with_capacity(max_seq * head_dim));
        for p in 0..max_seq {
            for j in 0..head_dim {
                let angle = p as f64 * theta.powf(-2.0 * (j % half) as f64 / head_dim as f64);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let table = |v: Vec<f64>| Tensor::from_vec(v, &[max_seq, head_dim], Device::Cpu)?.to_dtype(dtype)?.to_device(device);
        Ok(RotaryEmbedding { cos: table(cos)?, sin: table(sin)?, head_dim, max_seq })
    }

    /// `x` (`[.., T, head_dim]`, e.g. `[B, H, T, D]`) rotated for positions
    /// `offset..offset + T`: `x cos + rotate_half(x) sin`.
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let t = self.check(x)?;
        if offset + t > self.max_seq {
            return Err(Error::shape(
                "rope",
                format!("positions {offset}..{} of x {:?} run past the table's {}", offset + t, x.shape(), self.max_seq),
            ));
        }
        self.rotate(x, |table| table.narrow(0, offset, t))
    }

    /// `apply` at the positions a tensor holds (I64 `[T]`): a decode step whose position is
    /// an input, so that one compiled step serves every position.
    pub fn apply_at(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let t = self.check(x)?;
        if positions.shape() != [t] {
            return Err(Error::shape("rope", format!("positions {:?} must be [{t}] for x {:?}", positions.shape(), x.shape())));
        }
        self.rotate(x, |table| table.index_select(0usize, positions))
    }

    /// x's T, after checking its last dim.
    fn check(&self, x: &Tensor) -> Result<usize> {
        let r = x.rank();
        if r < 2 || x.shape()[r - 1] != self.head_dim {
            return Err(Error::shape("rope", format!("x {:?} must be [.., T, {}]", x.shape(), self.head_dim)));
        }
        Ok(x.shape()[r - 2])
    }

    /// `x cos + rotate_half(x) sin`, with the rows of the tables that `rows` picks.
    fn rotate(&self, x: &Tensor, rows: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let at = |table: &Tensor| rows(table)?.to_dtype(x.dtype());
        (x * &at(&self.cos)?)? + (rotate_half(x)? * &at(&self.sin)?)?
    }
}

/// `cat(-x2, x1)` over the last dim, for `x = cat(x1, x2)` split in halves.
pub fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.shape().last().copied().unwrap_or(0);
    let (x1, x2) = (x.narrow(-1, 0, d / 2)?, x.narrow(-1, d / 2, d - d / 2)?);
    Tensor::cat(&[&x2.neg()?, &x1], -1)
}
