//! Ops with several results, and where each result lies in the op's one output buffer.
//!
//! Every op computes into one allocation. An op with several results (layer norm's whole
//! backward, a product with its bias sums or its pre-activation, a loss with its gradient)
//! lays them out one after another, most starts aligned to 64 elements for vector loads and
//! cuBLASLt. `Parts` is that layout, made here and nowhere else: the shape rules, the CPU and
//! CUDA kernels, the eager methods and compile's passes all take their offsets from it.

use crate::{Error, Layout, Result};

/// The name of one result of an op with several.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The main result: a product, an activation's gradient.
    Out,
    /// What follows `Out`: sums of it over its rows, or of an operand (a bias's gradient), or
    /// GELU's pre-activation.
    Tail,
    /// A loss (a scalar).
    Loss,
    /// An input's gradient: x's (layer norm), the logits' (cross-entropy), h's (a linear head).
    Dx,
    /// A weight's gradient.
    Dw,
    /// A bias's gradient.
    Db,
    /// Layer norm's third row: the sums over rows of x's gradient as rounded to a dtype.
    Sums,
}

/// Where the results of an op with several lie in its flat output.
#[derive(Debug, Clone, PartialEq)]
pub struct Parts {
    parts: Vec<(Part, usize, Vec<usize>)>,
    len: usize,
}

/// The alignment, in elements, of a part that starts on its own.
const ALIGN: usize = 64;

impl Parts {
    fn first(part: Part, shape: &[usize]) -> Parts {
        Parts { parts: vec![(part, 0, shape.to_vec())], len: shape.iter().product() }
    }

    /// Appends a part right after the last one.
    fn beside(mut self, part: Part, shape: &[usize]) -> Parts {
        let at = self.len;
        self.len = at + shape.iter().product::<usize>();
        self.parts.push((part, at, shape.to_vec()));
        self
    }

    /// Appends a part after the last one, from the next multiple of 64 (the gap unspecified,
    /// zeros on the CPU).
    fn then(mut self, part: Part, shape: &[usize]) -> Parts {
        self.len = self.len.next_multiple_of(ALIGN);
        self.beside(part, shape)
    }

    /// Layer norm's parameter gradients for rows of length `n`: the weight's, then the bias's
    /// (`Op::LayerNormGrads` without the weight, a `[2, n]`).
    pub fn layer_norm_param_grads(n: usize) -> Parts {
        Parts::first(Part::Dw, &[n]).beside(Part::Db, &[n])
    }

    /// Layer norm's whole backward for x of shape `x`: the parameter gradients, the `sums` row
    /// if asked for, then x's gradient (`Op::LayerNormGrads` with the weight).
    pub fn layer_norm_grads(x: &[usize], sums: bool) -> Parts {
        let params = Parts::layer_norm_param_grads(x.last().copied().unwrap_or(0));
        let params = if sums { params.beside(Part::Sums, &[x.last().copied().unwrap_or(0)]) } else { params };
        params.then(Part::Dx, x)
    }

    /// A result of shape `out` and a second one of shape `tail` after it (`Fused::Matmul`'s
    /// `GeluTanh`, `SumLeft`, `SumRight`; `Fused::GatedSums`).
    pub fn with_tail(out: &[usize], tail: &[usize]) -> Parts {
        Parts::first(Part::Out, out).then(Part::Tail, tail)
    }

    /// A mean cross-entropy over `n` rows of `c` classes and the logits' gradient
    /// (`Fused::CrossEntropyMean`).
    pub fn cross_entropy_mean(n: usize, c: usize) -> Parts {
        Parts::first(Part::Loss, &[]).then(Part::Dx, &[n, c])
    }

    /// A linear head's mean cross-entropy for `n` rows of `h` features and `c` classes, the
    /// weight's and the bias's gradients and h's (`Fused::LinearCrossEntropyMean`).
    pub fn linear_cross_entropy_mean(n: usize, c: usize, h: usize) -> Parts {
        Parts::first(Part::Loss, &[]).then(Part::Dw, &[c, h]).then(Part::Db, &[c]).then(Part::Dx, &[n, h])
    }

    /// The length of the flat output, in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the output holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where `part` starts.
    pub fn offset(&self, part: Part) -> Result<usize> {
        self.find(part).map(|p| p.1)
    }

    /// `part` as a dense view of the flat output.
    pub fn view(&self, part: Part) -> Result<Layout> {
        let (_, offset, shape) = self.find(part)?;
        Ok(Layout { offset: *offset, ..Layout::contiguous(shape) })
    }

    fn find(&self, part: Part) -> Result<&(Part, usize, Vec<usize>)> {
        self.parts.iter().find(|p| p.0 == part).ok_or_else(|| {
            let have: Vec<Part> = self.parts.iter().map(|p| p.0).collect();
            Error::Msg(format!("no {part:?} among this op's results {have:?}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_follow_each_other_with_their_starts_aligned() -> Result<()> {
        let ln = Parts::layer_norm_grads(&[3, 5, 100], true);
        assert_eq!((ln.offset(Part::Dw)?, ln.offset(Part::Db)?, ln.offset(Part::Sums)?, ln.offset(Part::Dx)?), (0, 100, 200, 320));
        assert_eq!(ln.len(), 320 + 1500);
        assert_eq!(ln.view(Part::Dx)?, Layout { offset: 320, ..Layout::contiguous(&[3, 5, 100]) });
        assert_eq!(Parts::layer_norm_grads(&[4, 64], false).offset(Part::Dx)?, 128);
        let head = Parts::linear_cross_entropy_mean(4, 3, 6);
        assert_eq!((head.offset(Part::Dw)?, head.offset(Part::Db)?, head.offset(Part::Dx)?, head.len()), (64, 128, 192, 216));
        assert_eq!(Parts::with_tail(&[2, 65], &[65]).offset(Part::Tail)?, 192);
        assert_eq!(Parts::cross_entropy_mean(2, 3).len(), 70);
        let err = Parts::cross_entropy_mean(2, 3).offset(Part::Dw).unwrap_err().to_string();
        assert!(err.contains("Dw") && err.contains("[Loss, Dx]"), "{err}");
        Ok(())
    }
}
