//! Indexing kernels on row-major data viewed as `[outer, dim, inner]`: index_select,
//! index_add, gather, scatter_add, cat. Every index is checked; a bad one is an error.

use super::base::PAR_THRESHOLD;
use super::strided::Strided;
use crate::storage::pool;
use crate::{Element, Error, Layout, Result};
use rayon::prelude::*;

/// `[outer, size_of_dim, inner]` for a dim of a shape.
fn split3(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

fn check(op: &'static str, i: i64, dim: usize, size: usize) -> Result<usize> {
    if i < 0 || i as usize >= size {
        return Err(Error::Index { op, index: i, dim, size });
    }
    Ok(i as usize)
}

/// `src` row-major with `shape`; `index` 1-D.
pub fn index_select<T: Element>(src: &[T], shape: &[usize], dim: usize, index: &[i64]) -> Result<Vec<T>> {
    let (outer, size, inner) = split3(shape, dim);
    let idx: Vec<usize> = index.iter().map(|&i| check("index_select", i, dim, size)).collect::<Result<_>>()?;
    let mut out = pool::take::<T>(outer * idx.len() * inner);
    if inner == 0 || idx.is_empty() {
        return Ok(out);
    }
    out.par_chunks_mut(inner).with_min_len(64).enumerate().for_each(|(r, row)| {
        let (o, j) = (r / idx.len(), r % idx.len());
        let s = (o * size + idx[j]) * inner;
        row.copy_from_slice(&src[s..s + inner]);
    });
    Ok(out)
}

/// `base[.., index[j], ..] += src[.., j, ..]`, in place on `base` (row-major).
pub fn index_add<T: Element>(base: &mut [T], shape: &[usize], dim: usize, index: &[i64], src: &[T]) -> Result<()> {
    let (outer, size, inner) = split3(shape, dim);
    let idx: Vec<usize> = index.iter().map(|&i| check("index_add", i, dim, size)).collect::<Result<_>>()?;
    for o in 0..outer {
        for (j, &t) in idx.iter().enumerate() {
            let d = (o * size + t) * inner;
            let s = (o * idx.len() + j) * inner;
            for (x, &y) in base[d..d + inner].iter_mut().zip(&src[s..s + inner]) {
                *x = T::from_f64(x.to_f64() + y.to_f64());
            }
        }
    }
    Ok(())
}

/// Visits every element of `idx_shape` as `(position, outer, j, inner)` along `dim`.
fn each_index(idx_shape: &[usize], dim: usize, mut f: impl FnMut(usize, usize, usize, usize) -> Result<()>) -> Result<()> {
    let (outer, size, inner) = split3(idx_shape, dim);
    let mut p = 0;
    for o in 0..outer {
        for j in 0..size {
            for i in 0..inner {
                f(p, o, j, i)?;
                p += 1;
            }
        }
    }
    Ok(())
}

/// Where each index element lands: `f(position in the index, offset in the tensor of shape)`.
/// An index that matches `shape` outside `dim` (the usual case: argmax's positions, a max
/// pool's windows) walks its offsets directly; a smaller one goes through `remap`.
fn each_target(
    op: &'static str,
    idx_shape: &[usize],
    shape: &[usize],
    dim: usize,
    index: &[i64],
    mut f: impl FnMut(usize, usize),
) -> Result<()> {
    let same = idx_shape.len() == shape.len() && (0..shape.len()).all(|d| d == dim || idx_shape[d] == shape[d]);
    if !same {
        return each_index(idx_shape, dim, |p, o, _, i| {
            let t = check(op, index[p], dim, shape[dim])?;
            f(p, remap(idx_shape, shape, dim, o, t, i));
            Ok(())
        });
    }
    let (outer, size, inner) = split3(idx_shape, dim);
    let full = shape[dim];
    let mut p = 0;
    for o in 0..outer {
        for _ in 0..size {
            for i in 0..inner {
                f(p, (o * full + check(op, index[p], dim, full)?) * inner + i);
                p += 1;
            }
        }
    }
    Ok(())
}

/// Position of `(o, i)` of an index shape inside a tensor of `shape` whose outer and inner
/// extents may be larger (index shapes may be smaller than the input outside `dim`).
fn remap(idx_shape: &[usize], shape: &[usize], dim: usize, o: usize, t: usize, i: usize) -> usize {
    // Decompose o and i over the index shape, recompose over the tensor's shape.
    let mut off = 0;
    let mut stride = 1;
    let mut rem_i = i;
    for d in (dim + 1..shape.len()).rev() {
        off += (rem_i % idx_shape[d]) * stride;
        rem_i /= idx_shape[d];
        stride *= shape[d];
    }
    off += t * stride;
    stride *= shape[dim];
    let mut rem_o = o;
    for d in (0..dim).rev() {
        off += (rem_o % idx_shape[d]) * stride;
        rem_o /= idx_shape[d];
        stride *= shape[d];
    }
    off
}

pub fn gather<T: Element>(src: &[T], shape: &[usize], dim: usize, index: &[i64], idx_shape: &[usize]) -> Result<Vec<T>> {
    let mut out = pool::take::<T>(index.len());
    each_target("gather", idx_shape, shape, dim, index, |p, at| out[p] = src[at])?;
    Ok(out)
}

/// In place on `base` (row-major `shape`).
pub fn scatter_add<T: Element>(base: &mut [T], shape: &[usize], dim: usize, index: &[i64], idx_shape: &[usize], src: &[T]) -> Result<()> {
    each_target("scatter_add", idx_shape, shape, dim, index, |p, d| base[d] = T::from_f64(base[d].to_f64() + src[p].to_f64()))
}

/// Concatenates parts along `dim`, each read through its own layout straight into its
/// slice of each output row (a strided part is not first copied out): output row `o` (the
/// dims before `dim`) holds part `p`'s elements `o * w_p .. (o + 1) * w_p` in its order.
pub fn cat<T: Element>(parts: &[(&[T], &Layout)], dim: usize, out_shape: &[usize]) -> Vec<T> {
    let (outer, total, inner) = split3(out_shape, dim);
    let mut out = pool::take::<T>(outer * total * inner);
    let row = total * inner;
    if row == 0 {
        return out;
    }
    let walks: Vec<(&[T], Strided<1>, usize)> =
        parts.iter().map(|(data, l)| (*data, Strided::new(&l.shape, [&l.strides], [l.offset]), l.shape[dim] * inner)).collect();
    let fill = |(o, dst): (usize, &mut [T])| {
        let mut at = 0;
        for (data, it, w) in &walks {
            let [st] = it.inner_strides();
            it.runs(o * w, (o + 1) * w, |pos, [from], len| {
                let d = &mut dst[at + pos - o * w..at + pos - o * w + len];
                if st == 1 {
                    d.copy_from_slice(&data[from..from + len]);
                } else {
                    d.iter_mut().enumerate().for_each(|(j, x)| *x = data[from + j * st]);
                }
            });
            at += w;
        }
    };
    if out.len() < PAR_THRESHOLD {
        out.chunks_mut(row).enumerate().for_each(fill);
    } else {
        out.par_chunks_mut(row).enumerate().for_each(fill);
    }
    out
}

/// The positions that sort each row of `n` values (row-major rows), stably; NaN is the
/// largest value (last ascending, first descending), as in PyTorch.
pub fn argsort<T: Element>(src: &[T], n: usize, descending: bool) -> Vec<i64> {
    let mut out = pool::take::<i64>(src.len());
    if n == 0 {
        return out;
    }
    #[allow(clippy::eq_op)] // x != x is the NaN test of a generic PartialOrd type
    let nan = |x: &T| x != x;
    let order = |a: &T, b: &T| a.partial_cmp(b).unwrap_or_else(|| nan(a).cmp(&nan(b)));
    let sort_row = |(o, row): (&mut [i64], &[T])| {
        o.iter_mut().enumerate().for_each(|(i, v)| *v = i as i64);
        if descending {
            o.sort_by(|&i, &j| order(&row[j as usize], &row[i as usize]));
        } else {
            o.sort_by(|&i, &j| order(&row[i as usize], &row[j as usize]));
        }
    };
    if src.len() < PAR_THRESHOLD {
        out.chunks_mut(n).zip(src.chunks(n)).for_each(sort_row);
    } else {
        out.par_chunks_mut(n).zip(src.par_chunks(n)).for_each(sort_row);
    }
    out
}
