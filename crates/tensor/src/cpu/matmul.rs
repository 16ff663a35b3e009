//! Batched matrix products through the `gemm` crate, which takes arbitrary strides: transposed
//! and broadcast inputs need no copy. bf16 goes through f32 (gemm has no bf16 kernel).

use super::elementwise::map1;
use crate::shape::Layout;
use crate::storage::pool;
use crate::Element;
use rayon::prelude::*;

/// One product `dst[m, n] (+)= a[m, k] @ b[k, n]`, each matrix a pointer and its (row,
/// column) strides; `accumulate`: add onto `dst` (a bias written there first), else overwrite.
pub struct Product<T> {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a: (*const T, [isize; 2]),
    pub b: (*const T, [isize; 2]),
    pub dst: (*mut T, [isize; 2]),
    pub accumulate: bool,
}

/// Runs a `Product` on the calling thread.
pub trait GemmElem: Element {
    /// # Safety
    /// The pointers must cover the matrices at their strides; `dst` must not alias `a` or `b`.
    unsafe fn product(p: &Product<Self>);
}

/// Every float dtype but bf16 goes through `gemm`, whose AVX-512 kernels (its `x86-v4`
/// feature, chosen at run time) match MKL's single-thread rate and scale over two threads where
/// `matrixmultiply` does not (BENCHMARKS.md).
macro_rules! gemm_elem {
    ($t:ty, $zero:expr, $one:expr) => {
        impl GemmElem for $t {
            unsafe fn product(p: &Product<$t>) {
                let Product { m, k, n, a: (a, sa), b: (b, sb), dst: (d, sd), accumulate } = *p;
                let keep = if accumulate { $one } else { $zero };
                let par = gemm::Parallelism::None;
                gemm::gemm(m, n, k, d, sd[1], sd[0], accumulate, a, sa[1], sa[0], b, sb[1], sb[0], keep, $one, false, false, false, par)
            }
        }
    };
}
gemm_elem!(f32, 0.0, 1.0);
gemm_elem!(f64, 0.0, 1.0);
gemm_elem!(half::f16, half::f16::ZERO, half::f16::ONE);

/// What the GEMM accumulates onto in whole rows of `n` columns: the bias in each row; with
/// `k = 0` (no product) zeros when there is no bias; else left for the GEMM to overwrite.
fn start_rows<T: Element>(dst: &mut [T], n: usize, k: usize, bias: Option<&[T]>) {
    match bias {
        Some(bias) => dst.chunks_mut(n).for_each(|row| row.copy_from_slice(bias)),
        None if k == 0 => dst.fill(T::zero()),
        None => {}
    }
}

/// Rows `row0..` of `a @ b (+ bias)` (whole rows of `n` columns) into `dst`, `a` given at
/// its row 0: the bias is written into each row and the GEMM accumulates onto it; with
/// `k = 0` the rows are the bias, or zeros.
///
/// # Safety
/// As `GemmElem::product`, for the rows `dst` holds.
unsafe fn product_rows<T: GemmElem>(
    a: (*const T, [isize; 2]),
    row0: usize,
    b: (*const T, [isize; 2]),
    k: usize,
    n: usize,
    dst: &mut [T],
    bias: Option<&[T]>,
) {
    start_rows(dst, n, k, bias);
    if k > 0 {
        let a = (a.0.offset(row0 as isize * a.1[0]), a.1);
        T::product(&Product { m: dst.len() / n, k, n, a, b, dst: (dst.as_mut_ptr(), [n as isize, 1]), accumulate: bias.is_some() })
    }
}

/// `dst = a @ b (+ bias)` (`[m, n]`, dense) as column blocks of `cols` columns run in parallel:
/// each block packs only its part of `b`, so a short, wide product (the MLP's 32 x 784 x 256
/// forward) splits without every thread packing all of `b`.
///
/// # Safety
/// As `GemmElem::product`, for the whole of `dst`.
unsafe fn product_cols<T: GemmElem>(
    a: (*const T, [isize; 2]),
    b: (*const T, [isize; 2]),
    s: MatmulShape,
    dst: &mut [T],
    bias: Option<&[T]>,
    cols: usize,
) {
    let MatmulShape { m, k, n, .. } = s;
    start_rows(dst, n, k, bias);
    if k == 0 {
        return;
    }
    // Raw pointers as integers: the blocks write disjoint columns of `dst`.
    let (ap, bp, dp) = (a.0 as usize, b.0 as usize, dst.as_mut_ptr() as usize);
    (0..n.div_ceil(cols)).into_par_iter().for_each(|j| {
        let (c0, w) = (j * cols, cols.min(n - j * cols));
        let b = ((bp as *const T).offset(c0 as isize * b.1[1]), b.1);
        let d = ((dp as *mut T).add(c0), [n as isize, 1]);
        // SAFETY: columns c0..c0 + w of b and of dst, inside the caller's matrices.
        unsafe { T::product(&Product { m, k, n: w, a: (ap as *const T, a.1), b, dst: d, accumulate: bias.is_some() }) }
    });
}

/// The columns each thread takes of a single product made as one tile: all of them unless the
/// product is large enough to pay for waking the workers and wide enough to split. Column
/// blocks beat row blocks on every product measured (each thread packs only its part of `b`).
pub fn split_cols(s: MatmulShape) -> usize {
    per_thread(s, s.n, 16)
}

/// The rows each thread takes of a single product too narrow to split by columns: all of them
/// unless it is large enough to pay for waking the workers.
fn split_rows(s: MatmulShape) -> usize {
    per_thread(s, s.m, 1)
}

/// Each thread's share of `len` (the product's columns or rows), a multiple of `align`: all
/// of it unless the product has `PAR_FLOPS` multiply-adds and `len` gives every thread at
/// least `max(align, 2)`.
fn per_thread(s: MatmulShape, len: usize, align: usize) -> usize {
    let threads = rayon::current_num_threads();
    if threads > 1 && len >= align.max(2) * threads && s.m * s.n * s.k >= PAR_FLOPS {
        len.div_ceil(threads).next_multiple_of(align).min(len)
    } else {
        len
    }
}

/// From this many multiply-adds a single product spreads over the threads.
const PAR_FLOPS: usize = 1 << 21;

/// The strides of `l`'s batch dims (all but its last two) broadcast to `batch` (0 where a
/// dim is broadcast).
fn batch_strides(l: &Layout, batch: &[usize]) -> Vec<usize> {
    let r = l.rank();
    let bl = Layout { shape: l.shape[..r - 2].to_vec(), strides: l.strides[..r - 2].to_vec(), offset: l.offset };
    bl.broadcast_strides(batch)
}

/// `[..batch, m, k]` read through `l` as one `[batch * m, k]` matrix, when its batch and row
/// dims walk as one stride (dims of size 1 skipped); None otherwise.
fn folded_rows(l: &Layout, batch: &[usize], m: usize) -> Option<Layout> {
    let r = l.rank();
    let full: Vec<usize> = [batch, &[m, l.shape[r - 1]]].concat();
    let st = l.broadcast_strides(&full);
    let rows = full.len() - 1;
    let row_stride = (0..rows).rev().find(|&d| full[d] > 1).map_or(st[rows - 1], |d| st[d]);
    let mut want = row_stride;
    for d in (0..rows).rev() {
        if full[d] > 1 {
            if st[d] != want {
                return None;
            }
            want *= full[d];
        }
    }
    Some(Layout { shape: vec![batch.iter().product::<usize>() * m, full[rows]], strides: vec![row_stride, st[rows]], offset: l.offset })
}

/// The strides of a layout's last two dims, as a matrix's (row, column) strides.
fn matrix_strides(l: &Layout) -> [isize; 2] {
    let r = l.rank();
    [l.strides[r - 2] as isize, l.strides[r - 1] as isize]
}

/// From this many multiply-adds in all, a batch of products spreads over the threads.
const PAR_BATCH_FLOPS: usize = 1 << 18;

/// The sizes of a batched product `[..batch, m, k] x [..batch, k, n]`.
#[derive(Debug, Clone, Copy)]
pub struct MatmulShape<'a> {
    pub batch: &'a [usize],
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// `out[b] = a[b] @ bm[b] (+ bias)` for every batch index of the broadcast batch shape (the
/// bias `[n]` contiguous).
pub fn matmul<T: GemmElem>((a, la): (&[T], &Layout), (b, lb): (&[T], &Layout), bias: Option<&[T]>, s: MatmulShape) -> Vec<T> {
    let MatmulShape { batch, m, k, n } = s;
    let nb: usize = batch.iter().product();
    let mut buf = pool::take::<T>(nb * m * n);
    let out = &mut buf[..];
    if m * n == 0 {
        return buf;
    }
    if nb == 1 {
        // One product, spread over the threads when large (`by_tiles`).
        by_tiles((a, la), (b, lb), bias, s, out, m, &|_, _, _| {});
        return buf;
    }
    if batch_strides(lb, batch).iter().all(|&st| st == 0) {
        // Every batch entry multiplies the same b (a weight read by a `[.., m, k]`
        // activation): the batch folds into the rows of one product, which packs b once
        // instead of once per entry. A's rows are read where they lie when its batch and row
        // dims walk as one stride, else from one dense copy.
        // (`by_tiles` reads only b's last two dims and its offset.)
        let rows = MatmulShape { batch: &[], m: nb * m, k, n };
        match folded_rows(la, batch, m) {
            Some(la2) => by_tiles((a, &la2), (b, lb), bias, rows, out, rows.m, &|_, _, _| {}),
            None => {
                let shape = [batch, &[m, k]].concat();
                let view = Layout { strides: la.broadcast_strides(&shape), shape, offset: la.offset };
                let dense = map1(a, &view, |x: T| x);
                by_tiles((&dense, &Layout::contiguous(&[nb * m, k])), (b, lb), bias, rows, out, rows.m, &|_, _, _| {});
                pool::give(dense);
            }
        }
        return buf;
    }
    let (a_s, b_s) = (matrix_strides(la), matrix_strides(lb));
    // Offsets of each batch's matrix in a and b (broadcast batch dims have stride 0).
    let batch_offsets = |l: &Layout| -> Vec<usize> {
        let s = batch_strides(l, batch);
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
    // SAFETY: the pointers cover [m, k], [k, n] and [m, n] matrices at the given strides, all
    // inside their slices (the shape rule and layouts guarantee it); dst is batch i's output.
    let one = |(i, dst): (usize, &mut [T])| unsafe {
        product_rows((a.as_ptr().add(oa[i]), a_s), 0, (b.as_ptr().add(ob[i]), b_s), k, n, dst, bias)
    };
    // A batch spreads over the threads when large (waking the workers costs more below that).
    if nb * m * n * k >= PAR_BATCH_FLOPS {
        out.par_chunks_mut(m * n).enumerate().for_each(one);
    } else {
        out.chunks_mut(m * n).enumerate().for_each(one);
    }
    buf
}

/// What runs on each tile of a product made by `by_tiles`: `(element 0 of the product,
/// start, end)`, the tile being elements `start..end`.
pub type TileFn<'a> = dyn Fn(*const u8, usize, usize) + Sync + 'a;

/// A single product `a @ b (+ bias)` (batch dims, if any, all 1) into `out` (`[m, n]`),
/// `tile` rows at a time with the tiles spread over the threads; right after each tile,
/// `after(out_ptr, start, end)` runs on its elements `start..end` of `out` (`out_ptr` is
/// element 0) while they are in cache. Compile's CPU back end runs an optimizer update this
/// way, straight off its gradient. Asked for one tile (`tile >= m`), the product still spreads
/// over the threads when large: by column blocks (`split_cols`), else by rows (`split_rows`).
pub fn by_tiles<T: GemmElem>(
    (a, la): (&[T], &Layout),
    (b, lb): (&[T], &Layout),
    bias: Option<&[T]>,
    s: MatmulShape,
    out: &mut [T],
    tile: usize,
    after: &TileFn,
) {
    let MatmulShape { m, k, n, .. } = s;
    if m * n == 0 {
        return;
    }
    let (a_s, b_s, tile) = (matrix_strides(la), matrix_strides(lb), tile.max(1));
    let cols = if tile >= m { split_cols(s) } else { n };
    let tile = if tile >= m && cols == n { split_rows(s) } else { tile };
    let per_tile = |(t, dst): (usize, &mut [T])| {
        let r0 = t * tile;
        // SAFETY: rows r0.. of the [m, k] matrix a at its strides, the whole [k, n] b, and
        // this tile's rows of the output, which no other tile touches.
        unsafe { product_rows((a.as_ptr().add(la.offset), a_s), r0, (b.as_ptr().add(lb.offset), b_s), k, n, dst, bias) };
        // Element 0 of `out`, from this tile's own pointer (the callee touches this tile only).
        after(dst.as_ptr().wrapping_sub(r0 * n) as *const u8, r0 * n, r0 * n + dst.len());
    };
    if cols < n {
        // One tile, its columns spread over the threads.
        let dst = &mut out[..m * n];
        // SAFETY: as in `per_tile`, the column blocks being disjoint parts of `dst`.
        unsafe { product_cols((a.as_ptr().add(la.offset), a_s), (b.as_ptr().add(lb.offset), b_s), s, dst, bias, cols) };
        after(dst.as_ptr() as *const u8, 0, m * n);
    } else if tile >= m {
        // One tile runs on the calling thread: waking rayon's workers would cost more.
        per_tile((0, &mut out[..m * n]));
    } else {
        out[..m * n].par_chunks_mut(tile * n).enumerate().for_each(per_tile);
    }
}

/// bf16 through f32: the range each operand's view reads is widened (`map1`: in parallel,
/// into pooled buffers), multiplied, and the product narrowed.
pub fn matmul_bf16(
    (a, la): (&[half::bf16], &Layout),
    (b, lb): (&[half::bf16], &Layout),
    bias: Option<&[half::bf16]>,
    s: MatmulShape,
) -> Vec<half::bf16> {
    let (wa, la) = widen_read_range(a, la);
    let (wb, lb) = widen_read_range(b, lb);
    let wbias = bias.map(|v| widen_read_range(v, &Layout::contiguous(&[v.len()])).0);
    let wide = matmul((&wa, &la), (&wb, &lb), wbias.as_deref(), s);
    let out = map1(&wide, &Layout::contiguous(&[wide.len()]), half::bf16::from_f32);
    [wa, wb, wide].into_iter().chain(wbias).for_each(pool::give);
    out
}

/// The part of `v` that `l` reads, widened to f32, and `l` moved onto it.
fn widen_read_range(v: &[half::bf16], l: &Layout) -> (Vec<f32>, Layout) {
    let (lo, hi) = if l.numel() == 0 { (0, 0) } else { (l.offset, l.last_index() + 1) };
    let range = Layout { offset: lo, ..Layout::contiguous(&[hi - lo]) };
    (map1(v, &range, |x: half::bf16| x.to_f32()), Layout { offset: l.offset - lo, ..l.clone() })
}
