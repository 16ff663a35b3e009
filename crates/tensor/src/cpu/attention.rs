//! Scaled dot-product attention on the CPU, one query row at a time with f64 sums (the
//! reference the CUDA kernels are tested against). Inputs are dense `[n, t, d]`.

use crate::Element;
use rayon::prelude::*;

/// The sizes of a dense `[n, t, d]` attention problem and its options.
#[derive(Debug, Clone, Copy)]
pub struct AttnSpec {
    pub n: usize,
    /// The batch matrices' inner leading dims (heads): matrix `b` is head `b % heads` of
    /// batch `b / heads`.
    pub heads: usize,
    /// Query heads per key/value head (grouped-query attention; 1 when k and v have q's
    /// shape): query matrix `b` reads key/value matrix `b / rep`.
    pub rep: usize,
    pub t: usize,
    /// Keys (and values) per matrix: T, or another length in the forward (queries that are
    /// the last T positions of S).
    pub s: usize,
    pub d: usize,
    pub scale: f64,
    pub causal: bool,
}

impl AttnSpec {
    /// Keys that query `i` attends to: causal, those up to its position `i + S - T`.
    fn keys(&self, i: usize) -> usize {
        if self.causal {
            (i + 1 + self.s).saturating_sub(self.t).min(self.s)
        } else {
            self.s
        }
    }

    /// Where query matrix `b`'s key and value matrix starts.
    fn kv_base(&self, b: usize) -> usize {
        (b / self.rep) * self.s * self.d
    }

    /// Query `i`'s softmax probabilities over its keys, for the query matrix at `base` and its
    /// key matrix at `kbase`.
    fn probs<T: Element>(&self, q: &[T], k: &[T], (base, kbase): (usize, usize), i: usize) -> Vec<f64> {
        let d = self.d;
        let qi = &q[base + i * d..base + (i + 1) * d];
        let mut p: Vec<f64> = (0..self.keys(i))
            .map(|j| self.scale * qi.iter().zip(&k[kbase + j * d..kbase + (j + 1) * d]).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>())
            .collect();
        let m = p.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        p.iter_mut().for_each(|x| *x = (*x - m).exp());
        let l: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= l);
        p
    }
}

/// `softmax(scale q k^T) v` for every batch matrix.
pub fn forward<T: Element>(q: &[T], k: &[T], v: &[T], s: AttnSpec) -> Vec<T> {
    let (t, d) = (s.t, s.d);
    let mut out = vec![T::zero(); s.n * t * d];
    out.par_chunks_mut(d.max(1)).enumerate().for_each(|(row, o)| {
        let (base, kbase, i) = ((row / t) * t * d, s.kv_base(row / t), row % t);
        let p = s.probs(q, k, (base, kbase), i);
        // (A query that sees no key gives zeros, as on CUDA.)
        for (c, oc) in o.iter_mut().enumerate() {
            *oc = T::from_f64(p.iter().enumerate().map(|(j, pj)| pj * v[kbase + j * d + c].to_f64()).sum());
        }
    });
    out
}

/// dq, dk, dv packed as `[n / heads, t, 3, heads, d]` (`op::attention_grads_shape`), from
/// the output's gradient `g`; under grouped-query attention dk and dv per query head.
pub fn backward<T: Element>(q: &[T], k: &[T], v: &[T], g: &[T], s: AttnSpec) -> Vec<T> {
    let (t, d) = (s.t, s.d);
    let per = t * d;
    let grads: Vec<[Vec<f64>; 3]> = (0..s.n)
        .into_par_iter()
        .map(|b| {
            let (base, kbase) = (b * per, s.kv_base(b));
            let (mut dq, mut dk, mut dv) = (vec![0f64; per], vec![0f64; per], vec![0f64; per]);
            for i in 0..t {
                let p = s.probs(q, k, (base, kbase), i);
                let gi = &g[base + i * d..base + (i + 1) * d];
                let dp: Vec<f64> = (0..p.len())
                    .map(|j| gi.iter().zip(&v[kbase + j * d..kbase + (j + 1) * d]).map(|(a, b)| a.to_f64() * b.to_f64()).sum())
                    .collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..p.len() {
                    let ds = s.scale * p[j] * (dp[j] - dsum);
                    for c in 0..d {
                        dq[i * d + c] += ds * k[kbase + j * d + c].to_f64();
                        dk[j * d + c] += ds * q[base + i * d + c].to_f64();
                        dv[j * d + c] += p[j] * gi[c].to_f64();
                    }
                }
            }
            [dq, dk, dv]
        })
        .collect();
    let mut out = vec![T::zero(); 3 * s.n * per];
    for (b, gr) in grads.iter().enumerate() {
        for (w, x) in gr.iter().enumerate() {
            let (outer, h) = (b / s.heads, b % s.heads);
            for (i, row) in x.chunks(d.max(1)).enumerate() {
                let at = ((outer * t + i) * 3 + w) * s.heads * d + h * d;
                out[at..at + d].iter_mut().zip(row).for_each(|(o, &y)| *o = T::from_f64(y));
            }
        }
    }
    out
}
