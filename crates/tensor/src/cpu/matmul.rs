//! Batched matrix products through the `gemm` crate, which takes arbitrary strides: transposed
//! and broadcast inputs need no copy. bf16 goes through f32 (gemm has no bf16 kernel).

use super::pool;
use crate::shape::Layout;
use crate::Element;
use gemm::Parallelism;
use rayon::prelude::*;

/// Below this many multiply-adds a single product runs on one thread.
/// NOTE: below ~32M multiply-adds (well under a millisecond on one core) the wake-up and
/// spin of rayon workers on a 2-core machine costs more than the second core gains.
const PAR_FLOPS: usize = 1 << 25;

/// From this many multiply-adds up to `PAR_FLOPS`, a single product's rows are split over the
/// threads, each running a one-thread GEMM (gemm's own threading of such products was slower
/// than one thread: 493 against 197 us for the MLP's 32 x 784 x 256 product).
const SPLIT_FLOPS: usize = 1 << 22;

/// A product with a short inner dim and a wide output (a weight gradient at a small batch,
/// e.g. 32 x 784 -> 784 x 256) costs mostly writing the output, which two threads share
/// well even below `PAR_FLOPS`: measured on the MLP b32 step, eager went from about 0.75
/// to 0.66 ms and compiled from 0.55 to 0.53 ms.
/// (With k <= 64, 4M multiply-adds means an output of at least 64K elements.)
fn short_and_wide(s: MatmulShape) -> bool {
    s.k <= 64 && s.m * s.n * s.k >= 1 << 22
}

pub trait GemmElem: Element {}
impl GemmElem for f32 {}
impl GemmElem for f64 {}
impl GemmElem for half::f16 {}

/// The sizes of a batched product `[..batch, m, k] x [..batch, k, n]`.
#[derive(Debug, Clone, Copy)]
pub struct MatmulShape<'a> {
    pub batch: &'a [usize],
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// `out[b] = a[b] @ bm[b] (+ bias)` for every batch index of the broadcast batch shape; the
/// bias `[n]` (contiguous) is written into every row first and the GEMM accumulates onto it.
pub fn matmul<T: GemmElem>(a: (&[T], &Layout), b: (&[T], &Layout), bias: Option<&[T]>, s: MatmulShape) -> Vec<T> {
    matmul_with_tail(a, b, bias, s, 0)
}

/// `matmul` into a buffer `tail` elements longer (unwritten): room for what a fused matmul
/// stores after the product, with no copy of the product.
pub fn matmul_with_tail<T: GemmElem>(
    (a, la): (&[T], &Layout),
    (b, lb): (&[T], &Layout),
    bias: Option<&[T]>,
    s: MatmulShape,
    tail: usize,
) -> Vec<T> {
    let MatmulShape { batch, m, k, n } = s;
    let nb: usize = batch.iter().product();
    let mut buf = pool::take::<T>(nb * m * n + tail);
    let out = &mut buf[..nb * m * n];
    if m * n == 0 {
        return buf;
    }
    if let Some(bias) = bias {
        out.chunks_mut(n).for_each(|row| row.copy_from_slice(bias));
    }
    let (ra, rb) = (la.rank(), lb.rank());
    let (a_rs, a_cs) = (la.strides[ra - 2] as isize, la.strides[ra - 1] as isize);
    let (b_rs, b_cs) = (lb.strides[rb - 2] as isize, lb.strides[rb - 1] as isize);
    // Offsets of each batch's matrix in a and b (broadcast batch dims have stride 0).
    let batch_offsets = |l: &Layout| -> Vec<usize> {
        let bl = Layout { shape: l.shape[..l.rank() - 2].to_vec(), strides: l.strides[..l.rank() - 2].to_vec(), offset: l.offset };
        let s = bl.broadcast_strides(batch);
        let mut offs = Vec::with_capacity(nb);
        let mut idx = vec![0usize; batch.len()];
        for _ in 0..nb {
            offs.push(l.offset + idx.iter().zip(&s).map(|(i, s)| i * s).sum::<usize>());
            for d in (0..batch.len()).rev() {
                idx[d] += 1;
                if idx[d] < batch[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        offs
    };
    let (oa, ob) = (batch_offsets(la), batch_offsets(lb));
    let flops = m * n * k;
    let threads = rayon::current_num_threads();
    // `dst` holds rows `row0..` of batch i's output.
    let one = |dst: &mut [T], i: usize, row0: usize, par: Parallelism| {
        let rows = dst.len() / n;
        if k == 0 {
            // An empty product: the output is the bias, or zeros.
            if bias.is_none() {
                dst.fill(T::zero());
            }
            return;
        }
        // SAFETY: the pointers cover [m, k], [k, n] and [m, n] matrices at the given strides,
        // all inside their slices (the shape rule and layouts guarantee it); dst is not aliased.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                bias.is_some(),
                a.as_ptr().offset(oa[i] as isize + row0 as isize * a_rs),
                a_cs,
                a_rs,
                b.as_ptr().add(ob[i]),
                b_cs,
                b_rs,
                T::from_f64(if bias.is_some() { 1.0 } else { 0.0 }),
                T::from_f64(1.0),
                false,
                false,
                false,
                par,
            )
        }
    };
    if nb >= threads && flops < PAR_FLOPS * 4 {
        out.par_chunks_mut(m * n).enumerate().for_each(|(i, dst)| one(dst, i, 0, Parallelism::None));
    } else if nb == 1 && threads > 1 && flops < PAR_FLOPS && (flops >= SPLIT_FLOPS || short_and_wide(s)) && m >= 2 * threads {
        // One mid-sized product: its rows split evenly over the threads, one plain GEMM each.
        let rows = m.div_ceil(threads);
        out.par_chunks_mut(rows * n).enumerate().for_each(|(c, dst)| one(dst, 0, c * rows, Parallelism::None));
    } else {
        let par = if flops >= PAR_FLOPS || short_and_wide(s) { Parallelism::Rayon(threads) } else { Parallelism::None };
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            one(dst, i, 0, par);
        }
    }
    buf
}

/// bf16 through f32.
pub fn matmul_bf16(
    (a, la): (&[half::bf16], &Layout),
    (b, lb): (&[half::bf16], &Layout),
    bias: Option<&[half::bf16]>,
    s: MatmulShape,
) -> Vec<half::bf16> {
    let widen = |v: &[half::bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let bias = bias.map(widen);
    let out = matmul((&widen(a), la), (&widen(b), lb), bias.as_deref(), s);
    out.iter().map(|&x| half::bf16::from_f32(x)).collect()
}
