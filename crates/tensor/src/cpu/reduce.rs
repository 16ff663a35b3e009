//! Reductions over any set of dims, without copying strided inputs: each output element walks
//! its reduced sub-tensor in runs.

use super::base::{par_chunks, wide, Out, PAR_THRESHOLD};
use super::strided::Strided;
use crate::op::ReduceOp;
use crate::shape::Layout;
use crate::storage::pool;
use crate::Element;
use rayon::prelude::*;

/// Splits a layout into the kept dims (outer) and the reduced dims (inner).
struct Split {
    kept: Layout,
    red_shape: Vec<usize>,
    red_strides: Vec<usize>,
}

fn split(l: &Layout, dims: &[usize]) -> Split {
    let mut kept = Layout { shape: vec![], strides: vec![], offset: l.offset };
    let (mut red_shape, mut red_strides) = (vec![], vec![]);
    for d in 0..l.rank() {
        if dims.contains(&d) {
            red_shape.push(l.shape[d]);
            red_strides.push(l.strides[d]);
        } else {
            kept.shape.push(l.shape[d]);
            kept.strides.push(l.strides[d]);
        }
    }
    Split { kept, red_shape, red_strides }
}

/// Calls `f(out_index, acc)` for every output with the values of its reduced sub-tensor folded
/// by `step` from `init`. Parallel over outputs.
fn fold<T: Element, A: Copy + Send + Sync>(
    src: &[T],
    l: &Layout,
    dims: &[usize],
    init: A,
    step: impl Fn(A, T, usize) -> A + Sync,
    out: &mut [A],
) {
    let sp = split(l, dims);
    let kept_it = Strided::new(&sp.kept.shape, [&sp.kept.strides], [sp.kept.offset]);
    let [ks] = kept_it.inner_strides();
    let red_n: usize = sp.red_shape.iter().product();
    let red_it = Strided::new(&sp.red_shape, [&sp.red_strides], [0]);
    let [rs] = red_it.inner_strides();
    par_chunks(out, |start, chunk| {
        kept_it.runs(start, start + chunk.len(), |pos, [base], len| {
            for j in 0..len {
                let b = base + j * ks;
                let mut acc = init;
                red_it.runs(0, red_n, |rpos, [ro], rlen| {
                    for r in 0..rlen {
                        acc = step(acc, src[b + ro + r * rs], rpos + r);
                    }
                });
                chunk[pos - start + j] = acc;
            }
        });
    });
}

/// A sum whose reduced elements lie in contiguous runs (batch norm's `[N, C, H, W]` summed over
/// N, H and W: runs of H * W per sample): each run summed in four f64 lanes, which the
/// compiler keeps in registers and overlaps (a single accumulator waits on every add's
/// latency). Returns false (nothing written) when the reduced dims' inner stride is not 1 or
/// the runs are short.
fn run_sum<T: Element>(src: &[T], l: &Layout, dims: &[usize], out: &mut [f64]) -> bool {
    let sp = split(l, dims);
    let red_it = Strided::new(&sp.red_shape, [&sp.red_strides], [0]);
    let red_n: usize = sp.red_shape.iter().product();
    if red_it.inner_strides() != [1] || red_it.inner_len() < 32 {
        return false;
    }
    let kept_it = Strided::new(&sp.kept.shape, [&sp.kept.strides], [sp.kept.offset]);
    let [ks] = kept_it.inner_strides();
    par_chunks(out, |start, chunk| {
        kept_it.runs(start, start + chunk.len(), |pos, [base], len| {
            for j in 0..len {
                let b = base + j * ks;
                let mut acc = 0.0f64;
                red_it.runs(0, red_n, |_, [ro], rlen| acc += lanes_sum(&src[b + ro..b + ro + rlen]));
                chunk[pos - start + j] = acc;
            }
        });
    });
    true
}

/// The sum of a run in four interleaved f64 lanes.
fn lanes_sum<T: Element>(run: &[T]) -> f64 {
    let mut lanes = [0.0f64; 4];
    let mut quads = run.chunks_exact(4);
    for q in &mut quads {
        for (acc, x) in lanes.iter_mut().zip(q) {
            *acc += x.to_f64();
        }
    }
    let tail: f64 = quads.remainder().iter().map(|x| x.to_f64()).sum();
    (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + tail
}

/// A sum over the leading dims of a dense tensor (a bias gradient: `[rows, cols]` summed over
/// rows) as row-by-row adds into the output, so memory is read in order and the adds
/// vectorise; each output still sums its column top to bottom, as `fold` does. Returns
/// false (nothing written) for any other reduction.
fn column_sum<T: Element>(src: &[T], l: &Layout, dims: &[usize], acc: &mut [f64]) -> bool {
    let k = dims.len();
    if k == 0 || k == l.rank() || !l.is_contiguous() || dims.iter().enumerate().any(|(i, &d)| d != i) {
        return false;
    }
    let cols: usize = l.shape[k..].iter().product();
    let rows: usize = l.shape[..k].iter().product();
    if cols != acc.len() || cols < 8 {
        return false;
    }
    let data = &src[l.offset..l.offset + rows * cols];
    acc.iter_mut().for_each(|a| *a = 0.0);
    // Columns split across workers; every worker walks all rows of its columns.
    let per = if rows * cols >= PAR_THRESHOLD { cols.div_ceil(rayon::current_num_threads()).max(64) } else { cols };
    acc.par_chunks_mut(per).enumerate().for_each(|(c, out)| {
        let (c0, n) = (c * per, out.len());
        for row in data.chunks_exact(cols) {
            out.iter_mut().zip(&row[c0..c0 + n]).for_each(|(a, x)| *a += x.to_f64());
        }
    });
    true
}

/// A sum whose reduced dims are outermost in memory (a transposed view's rows summed, as in
/// a weight gradient's operand sums) through `column_sum` on the layout with its dims in
/// memory order. Only when that order keeps the kept dims' own order (the output's layout).
fn permuted_column_sum<T: Element>(src: &[T], l: &Layout, dims: &[usize], acc: &mut [f64]) -> bool {
    let mut order: Vec<usize> = (0..l.rank()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(l.strides[d]));
    let kept: Vec<usize> = order.iter().copied().filter(|d| !dims.contains(d)).collect();
    if order.iter().enumerate().all(|(i, &d)| i == d) || kept.windows(2).any(|w| w[0] > w[1]) {
        return false;
    }
    let permuted = Layout {
        shape: order.iter().map(|&d| l.shape[d]).collect(),
        strides: order.iter().map(|&d| l.strides[d]).collect(),
        offset: l.offset,
    };
    let new_dims: Vec<usize> = (0..order.len()).filter(|&i| dims.contains(&order[i])).collect();
    column_sum(src, &permuted, &new_dims, acc)
}

/// Sum, max and min keep the dtype (sums accumulate in f64); argmax/argmin give I64.
pub fn reduce<T: Element>(op: ReduceOp, src: &[T], l: &Layout, dims: &[usize], out_numel: usize) -> Out<T> {
    match op {
        ReduceOp::Sum => {
            let mut acc = pool::take::<f64>(out_numel);
            if !column_sum(src, l, dims, &mut acc) && !permuted_column_sum(src, l, dims, &mut acc) && !run_sum(src, l, dims, &mut acc) {
                fold(src, l, dims, 0.0f64, |a, x, _| a + x.to_f64(), &mut acc);
            }
            let out = pooled(&acc, |&a| T::from_f64(a));
            pool::give(acc);
            Out::Same(out)
        }
        ReduceOp::Max | ReduceOp::Min => {
            let max = op == ReduceOp::Max;
            let mut acc = vec![(src.first().copied().unwrap_or(T::zero()), false); out_numel];
            fold(
                src,
                l,
                dims,
                (T::zero(), false),
                |(a, seen), x, _| {
                    // NaN wins, as in torch.max.
                    let better = !seen || x.partial_cmp(&x).is_none() || (a.partial_cmp(&a).is_some() && if max { x > a } else { x < a });
                    (if better { x } else { a }, true)
                },
                &mut acc,
            );
            Out::Same(pooled(&acc, |&(a, _)| a))
        }
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let max = op == ReduceOp::ArgMax;
            // The first NaN wins, else the first largest (smallest), as in torch.argmax.
            let step = |(a, ai): (T, usize), x: T, i: usize| {
                let a_nan = ai != usize::MAX && a.partial_cmp(&a).is_none();
                let better = ai == usize::MAX || (!a_nan && (x.partial_cmp(&x).is_none() || if max { x > a } else { x < a }));
                if better {
                    (x, i)
                } else {
                    (a, ai)
                }
            };
            let k = l.shape.last().copied().unwrap_or(1);
            if l.is_contiguous() && dims == [l.rank() - 1] && k > 0 {
                // Rows of a dense tensor (max pooling's windows): one plain loop per row.
                let rows = &src[l.offset..l.offset + l.numel()];
                let mut out = pool::take::<i64>(out_numel);
                // Selects, not branches: which element wins is data, and mispredicted
                // branches cost more than the compares (as on random 2x2 windows).
                for_rows(&mut out, 1, |r, o| {
                    let row = &rows[r * k..(r + 1) * k];
                    let mut at = 0usize;
                    for (i, &x) in row.iter().enumerate().skip(1) {
                        // The best value re-read by index and the index chosen by a mask the
                        // optimiser cannot see through: it turns any select on these compares
                        // into a branch, mispredicted on every other random window.
                        let best = row[at];
                        let beats = if max { x > best } else { x < best };
                        #[allow(clippy::eq_op)] // x != x: NaN
                        let take = std::hint::black_box((best == best) & (beats | (x != x)));
                        at ^= (at ^ i) & (take as usize).wrapping_neg();
                    }
                    o[0] = at as i64;
                });
                return Out::Index(out);
            }
            let mut acc = vec![(T::zero(), usize::MAX); out_numel];
            fold(src, l, dims, (T::zero(), usize::MAX), step, &mut acc);
            Out::Index(pooled(&acc, |&(_, i)| i as i64))
        }
    }
}

/// `f` of each accumulator, into a pooled buffer (a fresh one is page-faulted and zeroed by
/// the kernel at every step).
fn pooled<A, U: Element>(acc: &[A], f: impl Fn(&A) -> U) -> Vec<U> {
    let mut out = pool::take::<U>(acc.len());
    out.iter_mut().zip(acc).for_each(|(o, a)| *o = f(a));
    out
}

/// Calls `f(row, out_row)` for each row of `n` elements of `out`, in parallel when large.
fn for_rows<T: Send>(out: &mut [T], n: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    for_rows_reading(out, n, n, f)
}

/// `for_rows` where each row reads `work` elements (a row of losses reads a row of logits):
/// in parallel when the reads are many.
fn for_rows_reading<T: Send>(out: &mut [T], n: usize, work: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    use rayon::prelude::*;
    if n == 0 {
        return;
    }
    let rows = out.len() / n;
    if rows * work < PAR_THRESHOLD / 4 {
        out.chunks_mut(n).enumerate().for_each(|(r, o)| f(r, o));
    } else {
        out.par_chunks_mut(n).with_min_len((PAR_THRESHOLD / 16 / work.max(1)).max(1)).enumerate().for_each(|(r, o)| f(r, o));
    }
}

/// What `softmax` computes per row (see `Op::Softmax`).
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxSpec {
    /// Row length.
    pub n: usize,
    pub log: bool,
    pub scale: f64,
    /// With the causal mask: rows per `[T, S]` matrix (T); row `i` keeps entries `j <= i % T`.
    pub causal_rows: Option<usize>,
}

/// The maximum of `scale * x` over a row (NaN wins) and the sum of `exp(scale * x - max)`.
fn max_and_sum_exp<T: RowKernels>(row: &[T], scale: f64) -> (f64, f64) {
    let m = row.iter().map(|v| scale * v.to_f64()).fold(f64::NEG_INFINITY, |a, b| if b.is_nan() || b > a { b } else { a });
    (m, T::sum_exp_minus(row, scale, m))
}

/// Softmax (or log-softmax) of `scale * x` for each row of a row-major buffer, in f64.
pub fn softmax<T: RowKernels>(src: &[T], k: SoftmaxSpec) -> Vec<T> {
    let n = k.n;
    let mut out = pool::take::<T>(src.len());
    for_rows(&mut out, n, |r, o| {
        let keep = k.causal_rows.map_or(n, |t| (r % t + 1).min(n));
        let (m, sum) = max_and_sum_exp(&src[r * n..r * n + keep], k.scale);
        let lse = m + sum.ln();
        for (j, o) in o.iter_mut().enumerate() {
            let v = k.scale * src[r * n + j].to_f64();
            *o = T::from_f64(if j >= keep {
                0.0
            } else if k.log {
                v - lse
            } else {
                (v - m).exp() / sum
            });
        }
    });
    out
}

/// Softmax and layer norm by element type: f32 computes in f32 with f64 row sums, 8 lanes at
/// a time (`softmax_f32`, `normalize_f32`), as PyTorch does; the other types in f64
/// (`softmax`, `normalize`).
pub trait RowKernels: Element {
    /// `exp(scale * x - m)`: in f64, or for f32 in f32 (`math::exp_f32`, which vectorises).
    #[inline(always)]
    fn exp_minus(x: Self, scale: f64, m: f64) -> f64 {
        (scale * x.to_f64() - m).exp()
    }
    /// The sum of `exp_minus` over a row, in f64.
    fn sum_exp_minus(row: &[Self], scale: f64, m: f64) -> f64 {
        row.iter().map(|&v| Self::exp_minus(v, scale, m)).sum()
    }
    fn softmax_rows(src: &[Self], k: SoftmaxSpec) -> Vec<Self> {
        softmax(src, k)
    }
    fn normalize_rows(src: &[Self], g: Option<&[Self]>, wb: (Option<&[Self]>, Option<&[Self]>), k: NormSpec) -> Vec<Self> {
        normalize(src, g, wb, k)
    }
}
impl RowKernels for f32 {
    #[inline(always)]
    fn exp_minus(x: f32, scale: f64, m: f64) -> f64 {
        crate::math::exp_f32(scale as f32 * x - m as f32) as f64
    }
    fn sum_exp_minus(row: &[f32], scale: f64, m: f64) -> f64 {
        wide(
            #[inline(always)]
            || sum_f64(row, |_, v| Self::exp_minus(v, scale, m)),
        )
    }
    fn softmax_rows(src: &[f32], k: SoftmaxSpec) -> Vec<f32> {
        softmax_f32(src, k)
    }
    fn normalize_rows(src: &[f32], g: Option<&[f32]>, wb: (Option<&[f32]>, Option<&[f32]>), k: NormSpec) -> Vec<f32> {
        normalize_f32(src, g, wb, k)
    }
}
impl RowKernels for f64 {}
impl RowKernels for half::f16 {}
impl RowKernels for half::bf16 {}
impl RowKernels for i64 {}
impl RowKernels for u8 {}

/// The f64 sum of `f(v[i])` in eight running sums, which vectorise (one sum is a chain of
/// dependent additions).
#[inline(always)]
fn sum_f64(v: &[f32], f: impl Fn(usize, f32) -> f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks.len() * 8;
    let rest: f64 = chunks.remainder().iter().enumerate().map(|(i, &x)| f(tail + i, x)).sum();
    for (c, chunk) in chunks.enumerate() {
        for (j, (a, &x)) in acc.iter_mut().zip(chunk).enumerate() {
            *a += f(c * 8 + j, x);
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// `softmax` for f32, as PyTorch computes it: each `exp` once, in f32 (`math::exp_f32`, 8
/// lanes at a time through `wide`), written into the output and summed in f64; then one
/// scaling pass. The generic path computes in f64 with the C library's `exp`, twice per
/// element, which is far slower for the GPT's attention softmax.
fn softmax_f32(src: &[f32], k: SoftmaxSpec) -> Vec<f32> {
    let n = k.n;
    let mut out = pool::take::<f32>(src.len());
    let scale = k.scale as f32;
    for_rows(&mut out, n, |r, o| {
        let keep = k.causal_rows.map_or(n, |t| (r % t + 1).min(n));
        let x = &src[r * n..r * n + keep];
        let (o, masked) = o.split_at_mut(keep);
        masked.fill(0.0);
        let (m, sum) = wide(
            #[inline(always)]
            || {
                let m = scaled_max(x, scale);
                o.iter_mut().zip(x).for_each(|(o, &v)| *o = crate::math::exp_f32(scale * v - m));
                (m, sum_f64(o, |_, v| v as f64))
            },
        );
        if k.log {
            let lse = sum.ln() as f32;
            o.iter_mut().zip(x).for_each(|(o, &v)| *o = (scale * v - m) - lse);
        } else {
            let inv = (1.0 / sum) as f32;
            o.iter_mut().for_each(|v| *v *= inv);
        }
    });
    out
}

/// The largest of `scale * x` (NaN if any is NaN), in 16 running maxima, which vectorise.
#[inline(always)]
fn scaled_max(x: &[f32], scale: f32) -> f32 {
    let pick = |a: f32, b: f32| if b.is_nan() || b > a { b } else { a };
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &v| pick(a, scale * v));
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = pick(*a, scale * v);
        }
    }
    acc.iter().fold(rest, |a, &b| pick(a, b))
}

/// The gradient of a softmax (`log`: log-softmax) of `scale * x` for each row of `n`, from
/// its output `y` and the output's gradient `g`, in f64.
pub fn softmax_backward<T: Element>(y: &[T], g: &[T], n: usize, log: bool, scale: f64) -> Vec<T> {
    let mut out = pool::take::<T>(y.len());
    for_rows(&mut out, n, |r, o| {
        let (y, g) = (&y[r * n..(r + 1) * n], &g[r * n..(r + 1) * n]);
        if log {
            let sum: f64 = g.iter().map(|v| v.to_f64()).sum();
            o.iter_mut().enumerate().for_each(|(i, o)| *o = T::from_f64(scale * (g[i].to_f64() - y[i].to_f64().exp() * sum)));
        } else {
            let dot: f64 = g.iter().zip(y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
            o.iter_mut().enumerate().for_each(|(i, o)| *o = T::from_f64(scale * y[i].to_f64() * (g[i].to_f64() - dot)));
        }
    });
    out
}

/// What `normalize` computes per row (see `Op::Normalize`).
#[derive(Debug, Clone, Copy)]
pub struct NormSpec {
    /// Row length.
    pub n: usize,
    pub eps: f64,
    /// RMS norm: no mean taken (it is 0 throughout).
    pub rms: bool,
}

/// A row's mean (0 for RMS norm) and `1 / sqrt(var + eps)` (biased variance about that mean;
/// two passes, f64 sums).
#[inline(always)]
fn row_stats(x: &[f32], eps: f64, rms: bool) -> (f32, f32) {
    let n = x.len() as f64;
    let mean = if rms { 0.0 } else { sum_f64(x, |_, v| v as f64) / n };
    let var = sum_f64(x, |_, v| (v as f64 - mean) * (v as f64 - mean)) / n;
    (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
}

/// `normalize` for f32: row statistics summed in f64, the elementwise work in f32 and 8
/// lanes at a time (`wide`), as PyTorch computes layer norm. Faster than the f64 path at
/// the GPT's rows of 128.
fn normalize_f32(src: &[f32], g: Option<&[f32]>, (w, b): (Option<&[f32]>, Option<&[f32]>), k: NormSpec) -> Vec<f32> {
    let (n, eps) = (k.n, k.eps);
    let mut out = pool::take::<f32>(src.len());
    for_rows(&mut out, n, |r, o| {
        let x = &src[r * n..(r + 1) * n];
        wide(
            #[inline(always)]
            || {
                let (mean, rstd) = row_stats(x, eps, k.rms);
                let xhat = |v: f32| (v - mean) * rstd;
                match g {
                    None => {
                        o.iter_mut().zip(x).for_each(|(o, &v)| *o = xhat(v));
                        if let Some(w) = w {
                            o.iter_mut().zip(w).for_each(|(o, &w)| *o *= w);
                        }
                        if let Some(b) = b {
                            o.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
                        }
                    }
                    Some(g) => {
                        // The gradient of xhat is g times the weight.
                        o.copy_from_slice(&g[r * n..(r + 1) * n]);
                        if let Some(w) = w {
                            o.iter_mut().zip(w).for_each(|(o, &w)| *o *= w);
                        }
                        let mg = if k.rms { 0.0 } else { (sum_f64(o, |_, v| v as f64) / n as f64) as f32 };
                        let mgx = (sum_f64(o, |i, v| (v * xhat(x[i])) as f64) / n as f64) as f32;
                        o.iter_mut().zip(x).for_each(|(o, &v)| *o = rstd * (*o - mg - xhat(v) * mgx));
                    }
                }
            },
        )
    });
    out
}

/// Layer norm's weight and bias gradients `[2, n]` for f32 (`Op::LayerNormGrads`):
/// `sum(g * xhat)` and `sum(g)` over the rows in one pass over x and g, blocks of rows in
/// parallel, each into its own f64 sums, then added up.
pub fn layer_norm_grads_f32(x: &[f32], g: &[f32], n: usize, eps: f64) -> Vec<f32> {
    use rayon::prelude::*;
    if n == 0 {
        return Vec::new();
    }
    let block = (PAR_THRESHOLD / 4 / n).max(1) * n;
    let partial = |(x, g): (&[f32], &[f32])| -> Vec<f64> {
        let mut acc = vec![0.0f64; 2 * n];
        let (dw, db) = acc.split_at_mut(n);
        wide(
            #[inline(always)]
            || {
                for (x, g) in x.chunks(n).zip(g.chunks(n)) {
                    let (mean, rstd) = row_stats(x, eps, false);
                    for (j, (&v, &g)) in x.iter().zip(g).enumerate() {
                        dw[j] += (g * ((v - mean) * rstd)) as f64;
                        db[j] += g as f64;
                    }
                }
            },
        );
        acc
    };
    let sums: Vec<Vec<f64>> =
        if x.len() < PAR_THRESHOLD { vec![partial((x, g))] } else { x.par_chunks(block).zip(g.par_chunks(block)).map(partial).collect() };
    (0..2 * n).map(|j| sums.iter().map(|s| s[j]).sum::<f64>() as f32).collect()
}

/// Layer norm's whole backward for f32 (`Op::LayerNormGrads` with the weight `w`): one flat
/// buffer, the weight's and bias's gradients (`sum(g * xhat)`, `sum(g)` over rows) at 0 and
/// `n`, x's gradient `rstd (gw - mean(gw) - xhat mean(gw xhat))` (plus `r`, a residual
/// connection's gradient, where given) from `dx_at` (`Parts::layer_norm_grads`). Each row's statistics are made once for both; blocks of rows
/// run in parallel, each summing its parameter gradients in f32 per row block of 32 and in
/// f64 across blocks. The same arithmetic per element as `normalize_f32` and
/// `layer_norm_grads_f32`.
pub fn layer_norm_backward_f32(x: &[f32], g: &[f32], w: &[f32], r: Option<&[f32]>, (n, eps, dx_at): (usize, f64, usize)) -> Vec<f32> {
    let mut out = pool::take::<f32>(dx_at + x.len());
    if n == 0 {
        return out;
    }
    let (head, dx) = out.split_at_mut(dx_at);
    let block = (PAR_THRESHOLD / 4 / n).max(1) * n;
    let partial = |(b, dx): (usize, &mut [f32])| -> Vec<f64> {
        let rows = b * block..b * block + dx.len();
        let (x, g, r) = (&x[rows.clone()], &g[rows.clone()], r.map(|r| &r[rows]));
        let mut acc = vec![0.0f64; 2 * n];
        let mut part = vec![0.0f32; 2 * n];
        wide(
            #[inline(always)]
            || {
                for (i, ((x, g), dx)) in x.chunks(n).zip(g.chunks(n)).zip(dx.chunks_mut(n)).enumerate() {
                    let (mean, rstd) = row_stats(x, eps, false);
                    let (dw, db) = part.split_at_mut(n);
                    for (j, (&v, &g)) in x.iter().zip(g).enumerate() {
                        dw[j] += g * ((v - mean) * rstd);
                        db[j] += g;
                    }
                    for ((d, &g), &w) in dx.iter_mut().zip(g).zip(w) {
                        *d = g * w;
                    }
                    let mg = (sum_f64(dx, |_, v| v as f64) / n as f64) as f32;
                    let mgx = (sum_f64(dx, |i, v| (v * ((x[i] - mean) * rstd)) as f64) / n as f64) as f32;
                    dx.iter_mut().zip(x).for_each(|(d, &v)| *d = rstd * (*d - mg - ((v - mean) * rstd) * mgx));
                    if let Some(r) = r {
                        dx.iter_mut().zip(&r[i * n..(i + 1) * n]).for_each(|(d, &r)| *d += r);
                    }
                    if i % 32 == 31 {
                        acc.iter_mut().zip(&mut part).for_each(|(a, p)| *a += std::mem::take(p) as f64);
                    }
                }
                acc.iter_mut().zip(&part).for_each(|(a, &p)| *a += p as f64);
            },
        );
        acc
    };
    let sums: Vec<Vec<f64>> =
        if x.len() < PAR_THRESHOLD { vec![partial((0, dx))] } else { dx.par_chunks_mut(block).enumerate().map(partial).collect() };
    head.fill(0.0);
    for (j, h) in head[..2 * n].iter_mut().enumerate() {
        *h = sums.iter().map(|s| s[j]).sum::<f64>() as f32;
    }
    out
}

/// Each row of `n` normalised to zero mean and unit (biased) variance, in f64, times `w` plus
/// `b` per column where given; with `g`, the input gradient for the output gradient `g`
/// instead (`w` scaling g: `rstd (gw - mean(gw) - xhat mean(gw xhat))`).
pub fn normalize<T: Element>(src: &[T], g: Option<&[T]>, (w, b): (Option<&[T]>, Option<&[T]>), k: NormSpec) -> Vec<T> {
    let (n, eps) = (k.n, k.eps);
    let mut out = pool::take::<T>(src.len());
    for_rows(&mut out, n, |r, o| {
        let x = &src[r * n..(r + 1) * n];
        let mean = if k.rms { 0.0 } else { x.iter().map(|v| v.to_f64()).sum::<f64>() / n as f64 };
        let var = x.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat = |i: usize| (x[i].to_f64() - mean) * rstd;
        let (w, b) = (|i: usize| w.map_or(1.0, |w| w[i].to_f64()), |i: usize| b.map_or(0.0, |b| b[i].to_f64()));
        match g {
            None => o.iter_mut().enumerate().for_each(|(i, o)| *o = T::from_f64(xhat(i) * w(i) + b(i))),
            Some(g) => {
                // The gradient of xhat is g times the weight.
                let g: Vec<f64> = g[r * n..(r + 1) * n].iter().enumerate().map(|(i, v)| v.to_f64() * w(i)).collect();
                let mg = if k.rms { 0.0 } else { g.iter().sum::<f64>() / n as f64 };
                let mgx = g.iter().enumerate().map(|(i, v)| v * xhat(i)).sum::<f64>() / n as f64;
                o.iter_mut().enumerate().for_each(|(i, o)| *o = T::from_f64(rstd * (g[i] - mg - xhat(i) * mgx)));
            }
        }
    });
    out
}

/// What `cross_entropy` computes (see `Op::CrossEntropy`).
#[derive(Debug, Clone, Copy)]
pub struct XentSpec {
    /// Classes (row length).
    pub n: usize,
    pub ignore: Option<i64>,
    pub smoothing: f64,
}

/// Cross-entropy of each row of `x` (row-major `[targets.len(), n]`) in f64: the per-row loss
/// in `U` (`Op::CrossEntropy`'s loss dtype), or with `g` (one value per row, in `U`) the
/// logits' gradient in `x`'s dtype. A target outside `0..n` that is not the ignore index is an
/// error naming it.
pub fn cross_entropy<T: RowKernels, U: Element>(
    x: &[T],
    targets: &[i64],
    g: Option<&[U]>,
    k: XentSpec,
) -> crate::Result<CrossEntropyOut<T, U>> {
    let n = k.n;
    let target = |r: usize| -> crate::Result<Option<usize>> {
        match targets[r] {
            t if Some(t) == k.ignore => Ok(None),
            t if t < 0 || t as usize >= n => Err(crate::Error::Index { op: "cross_entropy", index: t, dim: 1, size: n }),
            t => Ok(Some(t as usize)),
        }
    };
    let picked: Vec<Option<usize>> = (0..targets.len()).map(target).collect::<crate::Result<_>>()?;
    // Per row: the log-sum-exp and (for smoothing) the sum of the logits.
    let stats = |r: usize| -> (f64, f64) {
        let row = &x[r * n..(r + 1) * n];
        let (m, sum) = max_and_sum_exp(row, 1.0);
        // The logits' sum only under smoothing: a masked -inf logit must not make 0 * -inf.
        (m + sum.ln(), if k.smoothing != 0.0 { row.iter().map(|v| v.to_f64()).sum() } else { 0.0 })
    };
    let on = 1.0 - k.smoothing;
    let off = k.smoothing / n as f64;
    let Some(g) = g else {
        let mut out = pool::take::<U>(targets.len());
        for_rows_reading(&mut out, 1, n, |r, o| {
            let (lse, total) = stats(r);
            o[0] = U::from_f64(picked[r].map_or(0.0, |t| lse - on * x[r * n + t].to_f64() - off * total));
        });
        return Ok(CrossEntropyOut::Losses(out));
    };
    let mut out = pool::take::<T>(x.len());
    for_rows(&mut out, n, |r, o| {
        let Some(t) = picked[r] else { return o.iter_mut().for_each(|o| *o = T::from_f64(0.0)) };
        let (lse, gr) = (stats(r).0, g[r].to_f64());
        let row = &x[r * n..(r + 1) * n];
        wide(
            #[inline(always)]
            || o.iter_mut().zip(row).for_each(|(o, &v)| *o = T::from_f64(gr * (T::exp_minus(v, 1.0, lse) - off))),
        );
        o[t] = T::from_f64(gr * (T::exp_minus(x[r * n + t], 1.0, lse) - on - off));
    });
    Ok(CrossEntropyOut::Grad(out))
}

/// `cross_entropy`'s result: the rows' losses, or the logits' gradient.
pub enum CrossEntropyOut<T, U> {
    Losses(Vec<U>),
    Grad(Vec<T>),
}
