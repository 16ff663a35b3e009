//! Shapes, strides and the dimension arguments ops take.

use crate::{Error, Result};

/// How a tensor's elements sit in its storage: shape, strides (in elements) and offset.
/// Views (reshape, permute, narrow, expand) only change the layout.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// Row-major with no gaps (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        is_row_major(&self.shape, &self.strides)
    }
    /// The storage offset of the element at a multi-index.
    pub fn offset_of(&self, index: &[usize]) -> usize {
        self.offset + index.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>()
    }
    /// The largest storage index this layout reads (its offset when it has no elements).
    pub fn last_index(&self) -> usize {
        last_index(self.offset, &self.shape, &self.strides)
    }
    /// Strides to read this layout as if it had `shape` (NumPy broadcasting): broadcast dims get 0.
    pub fn broadcast_strides(&self, shape: &[usize]) -> Vec<usize> {
        let pad = shape.len() - self.rank();
        (0..shape.len()).map(|i| if i < pad || self.shape[i - pad] == 1 { 0 } else { self.strides[i - pad] }).collect()
    }
    /// The same memory with its dims reordered: dim `d` of the result is dim `perm[d]` of this
    /// one (as torch.permute; `perm` a permutation of `0..rank`).
    pub fn permuted(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }
    /// The layout of a reshape without copying, if the strides allow it (as torch.view).
    pub fn reshaped(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: self.offset });
        }
        // Group old dims into runs that are contiguous among themselves, then map new dims onto runs.
        let old: Vec<(usize, usize)> = self.shape.iter().copied().zip(self.strides.iter().copied()).filter(|(d, _)| *d != 1).collect();
        let mut strides = vec![0; shape.len()];
        let mut oi = 0;
        let mut ni = 0;
        while ni < shape.len() {
            if shape[ni] == 1 {
                strides[ni] = 1;
                ni += 1;
                continue;
            }
            if oi >= old.len() {
                return None;
            }
            // One run of old dims [oi, oj) with product == product of new dims [ni, nj).
            let (mut op, mut np) = (old[oi].0, shape[ni]);
            let (mut oj, mut nj) = (oi + 1, ni + 1);
            while op != np {
                if op < np {
                    if oj >= old.len() || old[oj - 1].1 != old[oj].0 * old[oj].1 {
                        return None;
                    }
                    op *= old[oj].0;
                    oj += 1;
                } else {
                    if nj >= shape.len() {
                        return None;
                    }
                    np *= shape[nj];
                    nj += 1;
                }
            }
            let mut stride = old[oj - 1].1;
            for k in (ni..nj).rev() {
                strides[k] = stride;
                stride *= shape[k];
            }
            oi = oj;
            ni = nj;
        }
        if oi != old.len() {
            return None;
        }
        Some(Layout { shape: shape.to_vec(), strides, offset: self.offset })
    }
}

/// The largest storage index read by `shape` at `strides` from `offset`: what a buffer must
/// exceed for the read to stay in bounds (when the shape has elements).
pub fn last_index(offset: usize, shape: &[usize], strides: &[usize]) -> usize {
    offset + shape.iter().zip(strides).map(|(d, s)| d.saturating_sub(1) * s).sum::<usize>()
}

/// Whether `strides` walk `shape` row-major with no gaps (size-1 dims may have any stride;
/// a shape with no element is row-major whatever its strides, as in PyTorch).
pub fn is_row_major(shape: &[usize], strides: &[usize]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected *= d;
    }
    true
}

pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// NumPy broadcasting of two shapes; the error names the op, both shapes and the dim.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(op, format!("cannot broadcast {a:?} with {b:?} (dim {i}: {da} vs {db})")));
            }
        };
    }
    Ok(out)
}

/// A dimension argument: `usize`, or a signed integer where negative counts from the end.
pub trait Dim: Copy {
    fn to_index(self, op: &'static str, shape: &[usize]) -> Result<usize>;
}

fn signed_dim(op: &'static str, dim: isize, shape: &[usize]) -> Result<usize> {
    let rank = shape.len() as isize;
    let d = if dim < 0 { dim + rank } else { dim };
    if d < 0 || d >= rank {
        return Err(Error::Dim { op, dim, rank: shape.len(), shape: shape.to_vec() });
    }
    Ok(d as usize)
}

macro_rules! dim_impl {
    ($($t:ty),*) => {$(
        impl Dim for $t {
            fn to_index(self, op: &'static str, shape: &[usize]) -> Result<usize> {
                signed_dim(op, self as isize, shape)
            }
        }
    )*};
}
dim_impl!(usize, i32, i64, isize);

/// A set of dimensions: one `Dim`, an array, a slice or a Vec of them.
pub trait Dims {
    fn to_indices(&self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>>;
}

impl<D: Dim> Dims for D {
    fn to_indices(&self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        Ok(vec![self.to_index(op, shape)?])
    }
}
impl<D: Dim> Dims for [D] {
    fn to_indices(&self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        let mut dims = Vec::with_capacity(self.len());
        for d in self {
            let i = d.to_index(op, shape)?;
            if dims.contains(&i) {
                return Err(Error::shape(op, format!("dim {i} repeated in the dim list for shape {shape:?}")));
            }
            dims.push(i);
        }
        dims.sort_unstable();
        Ok(dims)
    }
}
impl<D: Dim, const N: usize> Dims for [D; N] {
    fn to_indices(&self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        self[..].to_indices(op, shape)
    }
}
impl<D: Dim> Dims for Vec<D> {
    fn to_indices(&self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        self[..].to_indices(op, shape)
    }
}
impl<D: Dim> Dims for &[D] {
    fn to_indices(&self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        (**self).to_indices(op, shape)
    }
}

/// Every dim of a tensor, for full reductions: `t.sum(AllDims, false)`.
#[derive(Debug, Clone, Copy)]
pub struct AllDims;
impl Dims for AllDims {
    fn to_indices(&self, _op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        Ok((0..shape.len()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reshape_of_transposed_needs_copy_but_split_of_contiguous_run_does_not() {
        let l = Layout { shape: vec![3, 4], strides: vec![1, 3], offset: 0 };
        assert!(l.reshaped(&[12]).is_none());
        assert_eq!(l.reshaped(&[3, 2, 2]).map(|l| l.strides), Some(vec![1, 6, 3]));
        assert_eq!(l.reshaped(&[3, 4, 1]).map(|l| l.strides[..2].to_vec()), Some(vec![1, 3]));
        // A [2, 3, 4] tensor narrowed on dim 0 keeps contiguous rows: [.., 12] splits into [.., 3, 4].
        let n = Layout { shape: vec![2, 12], strides: vec![24, 1], offset: 24 };
        assert_eq!(n.reshaped(&[2, 3, 4]).unwrap().strides, vec![24, 4, 1]);
    }

    #[test]
    fn row_major_means_no_gaps_and_holds_for_any_empty_shape() {
        assert!(is_row_major(&[2, 3], &[3, 1]) && is_row_major(&[2, 1], &[1, 7]));
        assert!(!is_row_major(&[2, 3], &[1, 2]) && !is_row_major(&[2, 3], &[4, 1]));
        assert!(is_row_major(&[0, 3], &[1, 0]) && is_row_major(&[4, 0], &[9, 2]));
    }
}
