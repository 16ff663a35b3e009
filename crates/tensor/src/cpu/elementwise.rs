//! Elementwise CPU kernels: unary, binary with broadcasting, where, cast, copy, in-place
//! updates. Contiguous inputs take a flat loop the compiler vectorises; others walk runs.

use super::base::{par_chunks, wide, Out, PAR_THRESHOLD};
use super::strided::Strided;
use crate::op::{BinaryOp, Float, UnaryOp};
use crate::shape::Layout;
use crate::storage::pool;
use crate::Element;
use rayon::prelude::*;

/// `out[i] = f(src[i])` over a (possibly strided) layout.
pub fn map1<T: Element, U: Element>(src: &[T], l: &Layout, f: impl Fn(T) -> U + Sync) -> Vec<U> {
    let n = l.numel();
    let mut out = pool::take::<U>(n);
    if l.is_contiguous() {
        let s = &src[l.offset..l.offset + n];
        par_chunks(&mut out, |start, chunk| {
            let end = start + chunk.len();
            wide(
                #[inline(always)]
                || {
                    for (o, &x) in chunk.iter_mut().zip(&s[start..end]) {
                        *o = f(x);
                    }
                },
            )
        });
    } else {
        let it = Strided::new(&l.shape, [&l.strides], [l.offset]);
        if it.inner_len() < 16 && tiled_map1(src, &it, l.offset, &mut out, &f) {
            return out;
        }
        let [st] = it.inner_strides();
        par_chunks(&mut out, |start, chunk| {
            it.runs(start, start + chunk.len(), |pos, [o], len| {
                let dst = &mut chunk[pos - start..pos - start + len];
                if st == 1 {
                    for (d, &x) in dst.iter_mut().zip(&src[o..o + len]) {
                        *d = f(x);
                    }
                } else if st == 0 {
                    let y = f(src[o]);
                    dst.fill(y);
                } else {
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = f(src[o + j * st]);
                    }
                }
            });
        });
    }
    out
}

/// `map1` for layouts whose runs are short (a pooling window's 2 or 3 columns): the offsets
/// of one tile (the innermost dims, at least 64 elements) are worked out once, and each tile
/// of the output is gathered through them from its base offset, instead of a run's set-up
/// every few elements. Returns false (nothing written) when no tile of 16 to 65536 elements
/// fits the shape.
fn tiled_map1<T: Element, U: Element>(src: &[T], it: &Strided<1>, offset: usize, out: &mut [U], f: &(impl Fn(T) -> U + Sync)) -> bool {
    let (shape, [strides]) = it.merged();
    let mut split = shape.len();
    let mut table = vec![0usize];
    while split > 0 && table.len() < 64 && table.len() * shape[split - 1] <= 1 << 16 {
        split -= 1;
        let (n, st) = (shape[split], strides[split]);
        table = (0..n).flat_map(|i| table.iter().map(move |t| t + i * st)).collect();
    }
    if table.len() < 16 {
        return false;
    }
    // Row-major within the tile: the loop above put the outer tile dim's index outermost.
    let (outer, outer_strides) = (&shape[..split], &strides[..split]);
    let tile = |t: usize, dst: &mut [U]| {
        let (mut rem, mut base) = (t, offset);
        for (&n, &st) in outer.iter().zip(outer_strides).rev() {
            base += (rem % n) * st;
            rem /= n;
        }
        for (d, &o) in dst.iter_mut().zip(&table) {
            *d = f(src[base + o]);
        }
    };
    if out.len() < PAR_THRESHOLD {
        out.chunks_mut(table.len()).enumerate().for_each(|(t, d)| tile(t, d));
    } else {
        out.par_chunks_mut(table.len()).with_min_len(8).enumerate().for_each(|(t, d)| tile(t, d));
    }
    true
}

/// `out[i] = f(a[i], b[i])` with `a` and `b` broadcast to `shape`.
pub fn map2<T: Element, U: Element>(a: &[T], la: &Layout, b: &[T], lb: &Layout, shape: &[usize], f: impl Fn(T, T) -> U + Sync) -> Vec<U> {
    let n: usize = shape.iter().product();
    let mut out = pool::take::<U>(n);
    if la.is_contiguous() && lb.is_contiguous() && la.shape == shape && lb.shape == shape {
        let (a, b) = (&a[la.offset..la.offset + n], &b[lb.offset..lb.offset + n]);
        par_chunks(&mut out, |s, chunk| {
            let e = s + chunk.len();
            for ((o, &x), &y) in chunk.iter_mut().zip(&a[s..e]).zip(&b[s..e]) {
                *o = f(x, y);
            }
        });
        return out;
    }
    let (sa, sb) = (la.broadcast_strides(shape), lb.broadcast_strides(shape));
    let it = Strided::new(shape, [&sa, &sb], [la.offset, lb.offset]);
    let [ia, ib] = it.inner_strides();
    par_chunks(&mut out, |start, chunk| {
        it.runs(start, start + chunk.len(), |pos, [oa, ob], len| {
            let dst = &mut chunk[pos - start..pos - start + len];
            match (ia, ib) {
                (1, 1) => {
                    for ((d, &x), &y) in dst.iter_mut().zip(&a[oa..oa + len]).zip(&b[ob..ob + len]) {
                        *d = f(x, y);
                    }
                }
                (1, 0) => {
                    let y = b[ob];
                    for (d, &x) in dst.iter_mut().zip(&a[oa..oa + len]) {
                        *d = f(x, y);
                    }
                }
                (0, 1) => {
                    let x = a[oa];
                    for (d, &y) in dst.iter_mut().zip(&b[ob..ob + len]) {
                        *d = f(x, y);
                    }
                }
                _ => {
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = f(a[oa + j * ia], b[ob + j * ib]);
                    }
                }
            }
        });
    });
    out
}

/// `out[i] = f(c[i], a[i], b[i])` with all three broadcast to `shape` (for `where`).
pub fn map3<C: Element, T: Element>(
    (c, lc): (&[C], &Layout),
    (a, la): (&[T], &Layout),
    (b, lb): (&[T], &Layout),
    shape: &[usize],
    f: impl Fn(C, T, T) -> T + Sync,
) -> Vec<T> {
    let n: usize = shape.iter().product();
    let mut out = pool::take::<T>(n);
    let (sc, sa, sb) = (lc.broadcast_strides(shape), la.broadcast_strides(shape), lb.broadcast_strides(shape));
    let it = Strided::new(shape, [&sc, &sa, &sb], [lc.offset, la.offset, lb.offset]);
    let [ic, ia, ib] = it.inner_strides();
    par_chunks(&mut out, |start, chunk| {
        it.runs(start, start + chunk.len(), |pos, [oc, oa, ob], len| {
            for (j, d) in chunk[pos - start..pos - start + len].iter_mut().enumerate() {
                *d = f(c[oc + j * ic], a[oa + j * ia], b[ob + j * ib]);
            }
        });
    });
    out
}

/// `dst = f(dst, src)` in place, `src` broadcast to dst's shape.
pub fn update<T: Element>(dst: &mut [T], ld: &Layout, src: &[T], ls: &Layout, f: impl Fn(T, T) -> T + Sync) {
    let n = ld.numel();
    let ss = ls.broadcast_strides(&ld.shape);
    if ld.is_contiguous() {
        let d = &mut dst[ld.offset..ld.offset + n];
        if ls.is_contiguous() && ls.shape == ld.shape {
            let s = &src[ls.offset..ls.offset + n];
            par_chunks(d, |start, chunk| {
                let end = start + chunk.len();
                for (o, &y) in chunk.iter_mut().zip(&s[start..end]) {
                    *o = f(*o, y);
                }
            });
            return;
        }
        let it = Strided::new(&ld.shape, [&ss], [ls.offset]);
        let [is] = it.inner_strides();
        par_chunks(d, |start, chunk| {
            it.runs(start, start + chunk.len(), |pos, [os], len| {
                let dst = &mut chunk[pos - start..pos - start + len];
                match is {
                    0 => {
                        let y = src[os];
                        dst.iter_mut().for_each(|o| *o = f(*o, y));
                    }
                    1 => dst.iter_mut().zip(&src[os..os + len]).for_each(|(o, &y)| *o = f(*o, y)),
                    _ => dst.iter_mut().enumerate().for_each(|(j, o)| *o = f(*o, src[os + j * is])),
                }
            });
        });
    } else {
        let it = Strided::new(&ld.shape, [&ld.strides, &ss], [ld.offset, ls.offset]);
        let [id, is] = it.inner_strides();
        it.runs(0, n, |_, [od, os], len| {
            for j in 0..len {
                let p = od + j * id;
                dst[p] = f(dst[p], src[os + j * is]);
            }
        });
    }
}

/// `dst = f(dst)` in place.
pub fn update_scalar<T: Element>(dst: &mut [T], ld: &Layout, f: impl Fn(T) -> T + Sync) {
    let n = ld.numel();
    if ld.is_contiguous() {
        par_chunks(&mut dst[ld.offset..ld.offset + n], |_, chunk| {
            for o in chunk.iter_mut() {
                *o = f(*o);
            }
        });
    } else {
        let it = Strided::new(&ld.shape, [&ld.strides], [ld.offset]);
        let [id] = it.inner_strides();
        it.runs(0, n, |_, [od], len| {
            for j in 0..len {
                dst[od + j * id] = f(dst[od + j * id]);
            }
        });
    }
}

/// Expands `$body` once per listed variant with `$c` bound to it as a constant, so the op's
/// `match` folds away inside the monomorphised loop. The lists below are exhaustive matches:
/// a new op variant is a compile error here.
macro_rules! per_variant {
    ($ty:path, $op:expr, $c:ident => $body:expr; $($v:ident),* $(,)?) => {{
        use $ty as Ty;
        match $op {
            $(Ty::$v => {
                const $c: Ty = Ty::$v;
                $body
            })*
        }
    }};
}

macro_rules! per_unary {
    ($op:expr, $c:ident => $body:expr) => {
        $crate::cpu::elementwise::per_variant!(crate::op::UnaryOp, $op, $c => $body;
            Neg, Abs, Exp, Log, Sqrt, Rsqrt, Recip, Sin, Cos, Tanh, Sigmoid, Relu, Gelu, GeluTanh,
            Silu, Erf, Square, Sign, Step, GeluGrad, GeluTanhGrad, SiluGrad)
    };
}

macro_rules! per_binary {
    ($op:expr, $c:ident => $body:expr) => {
        $crate::cpu::elementwise::per_variant!(crate::op::BinaryOp, $op, $c => $body;
            Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge)
    };
}
pub(crate) use {per_binary, per_variant};

/// How a storage type computes: f32/f64 natively, f16/bf16 through f32.
pub trait Compute: Element {
    type F: Float;
    fn up(self) -> Self::F;
    fn down(v: Self::F) -> Self;
}
impl Compute for f32 {
    type F = f32;
    #[inline(always)]
    fn up(self) -> f32 {
        self
    }
    #[inline(always)]
    fn down(v: f32) -> f32 {
        v
    }
}
impl Compute for f64 {
    type F = f64;
    #[inline(always)]
    fn up(self) -> f64 {
        self
    }
    #[inline(always)]
    fn down(v: f64) -> f64 {
        v
    }
}
impl Compute for half::f16 {
    type F = f32;
    #[inline(always)]
    fn up(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn down(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}
impl Compute for half::bf16 {
    type F = f32;
    #[inline(always)]
    fn up(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn down(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

pub fn unary<T: Compute>(op: UnaryOp, src: &[T], l: &Layout) -> Vec<T> {
    per_unary!(op, OP => map1(src, l, #[inline(always)] |x: T| T::down(OP.eval(x.up()))))
}

pub fn unary_int(op: UnaryOp, src: &[i64], l: &Layout) -> Vec<i64> {
    map1(src, l, |x: i64| match op {
        UnaryOp::Neg => x.wrapping_neg(),
        UnaryOp::Abs => x.wrapping_abs(),
        UnaryOp::Square => x.wrapping_mul(x),
        UnaryOp::Sign => x.signum(),
        _ => x.max(0), // relu; the shape rule admits no other op for I64
    })
}

/// Floats: arithmetic keeps T, comparisons give u8 masks.
pub fn binary<T: Compute>(op: BinaryOp, a: &[T], la: &Layout, b: &[T], lb: &Layout, shape: &[usize]) -> Out<T> {
    if op.is_comparison() {
        Out::Mask(per_binary!(op, OP => map2(a, la, b, lb, shape, |x: T, y: T| (OP.eval(x.up(), y.up()) != T::F::c(0.0)) as u8)))
    } else {
        Out::Same(per_binary!(op, OP => map2(a, la, b, lb, shape, |x: T, y: T| T::down(OP.eval(x.up(), y.up())))))
    }
}

/// Integers (I64, U8) compute in i64.
pub fn binary_int<T: Element>(op: BinaryOp, a: &[T], la: &Layout, b: &[T], lb: &Layout, shape: &[usize]) -> Out<T> {
    let f = |x: T, y: T| op.eval_int(x.to_f64() as i64, y.to_f64() as i64);
    if op.is_comparison() {
        Out::Mask(map2(a, la, b, lb, shape, |x, y| f(x, y) as u8))
    } else {
        Out::Same(map2(a, la, b, lb, shape, |x, y| T::from_f64(f(x, y) as f64)))
    }
}

/// `x op s` or `s op x` for a scalar `s`.
pub fn scalar<T: Compute>(op: BinaryOp, s: f64, lhs: bool, src: &[T], l: &Layout) -> Out<T> {
    let s = T::F::c(s);
    if op.is_comparison() {
        let f = move |x: T| if lhs { op.eval(s, x.up()) } else { op.eval(x.up(), s) };
        return Out::Mask(map1(src, l, |x: T| (f(x) != T::F::c(0.0)) as u8));
    }
    Out::Same(per_binary!(op, OP => {
        if lhs {
            map1(src, l, |x: T| T::down(OP.eval(s, x.up())))
        } else {
            map1(src, l, |x: T| T::down(OP.eval(x.up(), s)))
        }
    }))
}

pub fn scalar_int<T: Element>(op: BinaryOp, s: f64, lhs: bool, src: &[T], l: &Layout) -> Out<T> {
    let s = s as i64;
    let f = move |x: T| {
        let x = x.to_f64() as i64;
        if lhs {
            op.eval_int(s, x)
        } else {
            op.eval_int(x, s)
        }
    };
    if op.is_comparison() {
        Out::Mask(map1(src, l, |x| f(x) as u8))
    } else {
        Out::Same(map1(src, l, |x| T::from_f64(f(x) as f64)))
    }
}

/// Fill a fresh buffer with one value.
pub fn full<T: Element>(n: usize, v: T) -> Vec<T> {
    let mut out = pool::take::<T>(n);
    out.par_iter_mut().with_min_len(1 << 16).for_each(|o| *o = v);
    out
}

// ---- slice kernels for fused groups (kiln-compile's CPU back end) ----

/// `out[i] = op(x[i])`.
#[inline(always)]
pub fn unary_into<F: Float>(op: UnaryOp, x: &[F], out: &mut [F]) {
    per_unary!(op, OP => out.iter_mut().zip(x).for_each(|(o, &v)| *o = OP.eval(v)))
}

/// `out[i] = a[i] op b[i]` (comparisons give 1 or 0).
#[inline(always)]
pub fn binary_into<F: Float>(op: BinaryOp, a: &[F], b: &[F], out: &mut [F]) {
    per_binary!(op, OP => out.iter_mut().zip(a).zip(b).for_each(|((o, &x), &y)| *o = OP.eval(x, y)))
}

/// `out[i] = x[i] op v`, or `v op x[i]` when `lhs`.
#[inline(always)]
pub fn scalar_into<F: Float>(op: BinaryOp, v: F, lhs: bool, x: &[F], out: &mut [F]) {
    if lhs {
        per_binary!(op, OP => out.iter_mut().zip(x).for_each(|(o, &a)| *o = OP.eval(v, a)))
    } else {
        per_binary!(op, OP => out.iter_mut().zip(x).for_each(|(o, &a)| *o = OP.eval(a, v)))
    }
}

/// `out[i] = c[i] != 0 ? a[i] : b[i]`.
#[inline(always)]
pub fn where_into<F: Float>(c: &[F], a: &[F], b: &[F], out: &mut [F]) {
    let zero = F::c(0.0);
    out.iter_mut().zip(c).zip(a).zip(b).for_each(|(((o, &c), &x), &y)| *o = if c != zero { x } else { y });
}

/// Converts between element types through f64 (exact for every pair Kiln fuses).
pub trait Convert<U> {
    fn convert(self) -> U;
}
impl<T: Element, U: Element> Convert<U> for T {
    #[inline(always)]
    fn convert(self) -> U {
        U::from_f64(self.to_f64())
    }
}

/// Positions `start..start + out.len()` of `shape` read through `layout` (broadcast), as `F`.
#[inline(always)]
pub fn load_into<T: Element, F: Element>(src: &[T], layout: &Layout, shape: &[usize], start: usize, out: &mut [F]) {
    let strides = layout.broadcast_strides(shape);
    let it = Strided::new(shape, [&strides], [layout.offset]);
    let [st] = it.inner_strides();
    it.runs(start, start + out.len(), |pos, [o], len| {
        let dst = &mut out[pos - start..pos - start + len];
        match st {
            0 => dst.fill(src[o].convert()),
            1 => dst.iter_mut().zip(&src[o..o + len]).for_each(|(d, &x)| *d = x.convert()),
            _ => dst.iter_mut().enumerate().for_each(|(j, d)| *d = src[o + j * st].convert()),
        }
    });
}
