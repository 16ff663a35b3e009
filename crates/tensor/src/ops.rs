//! The public tensor API. Each method is a primitive op through `Tensor::apply`, or a short
//! composite of them (mean, var, softmax, ...) so autograd and the compiler see through it.

use crate::collective::{Collective, Group};
use crate::op::{BinaryOp, Distribution, Op, Part, Parts, ReduceOp, UnaryOp};
use crate::shape::{Dim, Dims};
use crate::{rng, DType, Device, Error, Result, Tensor};

/// A target shape: `[2, 3]`, `&[usize]`, `Vec<usize>`, or signed with one `-1` to infer.
pub trait ShapeSpec {
    fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>>;
}

fn resolve_signed(op: &'static str, dims: &[i64], numel: usize) -> Result<Vec<usize>> {
    let holes = dims.iter().filter(|&&d| d == -1).count();
    let known: i64 = dims.iter().filter(|&&d| d != -1).product();
    if holes > 1 || dims.iter().any(|&d| d < -1) {
        return Err(Error::shape(op, format!("invalid shape {dims:?}: at most one -1 and no other negative sizes")));
    }
    if holes == 1 {
        if known == 0 || numel as i64 % known != 0 {
            return Err(Error::shape(op, format!("cannot infer -1 in {dims:?} for {numel} elements")));
        }
        let fill = numel as i64 / known;
        return Ok(dims.iter().map(|&d| if d == -1 { fill as usize } else { d as usize }).collect());
    }
    Ok(dims.iter().map(|&d| d as usize).collect())
}

macro_rules! shape_spec {
    ($($t:ty),*) => {$(
        impl<const N: usize> ShapeSpec for [$t; N] {
            fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>> {
                self[..].resolve(op, numel)
            }
        }
        impl ShapeSpec for [$t] {
            fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>> {
                let v: Vec<i64> = self.iter().map(|&d| d as i64).collect();
                resolve_signed(op, &v, numel)
            }
        }
        impl ShapeSpec for &[$t] {
            fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>> {
                (**self).resolve(op, numel)
            }
        }
        impl ShapeSpec for Vec<$t> {
            fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>> {
                self[..].resolve(op, numel)
            }
        }
        impl ShapeSpec for &Vec<$t> {
            fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>> {
                self[..].resolve(op, numel)
            }
        }
    )*};
}
shape_spec!(usize, i32, i64, isize);

/// One size of a shape written as a tuple: a `usize`, or a signed integer where `-1` asks for
/// the size that makes the element count fit (`x.reshape(&(b, t, -1))`).
pub trait ShapeDim: Copy {
    fn signed(self) -> i64;
}

macro_rules! shape_dim {
    ($($t:ty),*) => {$(
        impl ShapeDim for $t {
            fn signed(self) -> i64 {
                self as i64
            }
        }
    )*};
}
shape_dim!(usize, i32, i64, isize);

macro_rules! tuple_shape_spec {
    ($(($($n:ident),+)),* $(,)?) => {$(
        #[allow(non_snake_case)]
        impl<$($n: ShapeDim),+> ShapeSpec for ($($n,)+) {
            fn resolve(&self, op: &'static str, numel: usize) -> Result<Vec<usize>> {
                let ($($n,)+) = *self;
                resolve_signed(op, &[$($n.signed()),+], numel)
            }
        }
    )*};
}
tuple_shape_spec!((A), (A, B), (A, B, C), (A, B, C, D), (A, B, C, D, E), (A, B, C, D, E, F));

/// `i` as a position along dim `d` of `shape`, a negative `i` counted from the end.
fn from_end(op: &'static str, i: i64, d: usize, shape: &[usize]) -> Result<usize> {
    let size = shape[d];
    let at = if i < 0 { i + size as i64 } else { i };
    usize::try_from(at).map_err(|_| Error::Index { op, index: i, dim: d, size })
}

impl Tensor {
    // ---- creation ----

    pub fn full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::apply(Op::Full { shape: shape.to_vec(), value, dtype }, &[], device)
    }
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(0.0, shape, dtype, device)
    }
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(1.0, shape, dtype, device)
    }
    /// A 0-dim tensor.
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(value, &[], dtype, device)
    }
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self.dtype(), self.device())
    }
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), self.dtype(), self.device())
    }
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(value, self.shape(), self.dtype(), self.device())
    }
    /// `0, 1, ..., n - 1`.
    pub fn arange(n: usize, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::apply(Op::Arange { n, dtype }, &[], device)
    }
    /// `start, start + step, ...` below `end` (floats).
    pub fn arange_step(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if step == 0.0 || !((end - start) / step).is_finite() {
            return Err(Error::shape("arange", format!("invalid range {start}..{end} step {step}")));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        Tensor::arange(n, dtype, device)?.mul_scalar(step)?.add_scalar(start)
    }
    /// Uniform on [0, 1) from the default generator (see `rng::manual_seed`).
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let (seed, offset) = rng::reserve(shape.iter().product());
        Tensor::rand_at(shape, Distribution::Uniform, seed, offset, dtype, device)
    }
    /// Standard normal from the default generator.
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let (seed, offset) = rng::reserve(shape.iter().product());
        Tensor::rand_at(shape, Distribution::Normal, seed, offset, dtype, device)
    }
    /// Draws `offset, offset + 1, ...` of Philox stream `seed`: the same on every device.
    pub fn rand_at(shape: &[usize], dist: Distribution, seed: u64, offset: u64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::apply(Op::Rand { shape: shape.to_vec(), dist, seed, offset, dtype }, &[], device)
    }

    // ---- views ----

    pub fn reshape<S: ShapeSpec + ?Sized>(&self, shape: &S) -> Result<Tensor> {
        let shape = shape.resolve("reshape", self.numel())?;
        if shape == self.shape() {
            return Ok(self.clone());
        }
        Tensor::apply(Op::Reshape(shape), &[self], self.device())
    }
    pub fn permute<D: Dim>(&self, dims: &[D]) -> Result<Tensor> {
        let perm: Vec<usize> = dims.iter().map(|d| d.to_index("permute", self.shape())).collect::<Result<_>>()?;
        Tensor::apply(Op::Permute(perm), &[self], self.device())
    }
    pub fn transpose<D: Dim>(&self, d0: D, d1: D) -> Result<Tensor> {
        let (a, b) = (d0.to_index("transpose", self.shape())?, d1.to_index("transpose", self.shape())?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        Tensor::apply(Op::Permute(perm), &[self], self.device())
    }
    /// Swaps the last two dims.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::shape("t", format!("needs rank >= 2, got shape {:?}", self.shape())));
        }
        self.transpose(-2i64, -1)
    }
    /// `len` entries of `dim` from `start` (a negative start counts from the end, as
    /// `torch.narrow`'s): a view.
    pub fn narrow<D: Dim, S: ShapeDim>(&self, dim: D, start: S, len: usize) -> Result<Tensor> {
        let dim = dim.to_index("narrow", self.shape())?;
        let start = from_end("narrow", start.signed(), dim, self.shape())?;
        Tensor::apply(Op::Narrow { dim, start, len }, &[self], self.device())
    }
    /// The slice at `index` of `dim`, without that dim (`x[:, i]`, `torch.select`); a
    /// negative index counts from the end. A view.
    pub fn select<D: Dim, S: ShapeDim>(&self, dim: D, index: S) -> Result<Tensor> {
        let d = dim.to_index("select", self.shape())?;
        let (i, size) = (index.signed(), self.shape()[d]);
        let at = from_end("select", i, d, self.shape())?;
        if at >= size {
            return Err(Error::Index { op: "select", index: i, dim: d, size });
        }
        self.narrow(d, at, 1)?.squeeze(d)
    }
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        Tensor::apply(Op::Expand(shape.to_vec()), &[self], self.device())
    }
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        self.broadcast_to(shape)
    }
    pub fn unsqueeze<D: Dim>(&self, dim: D) -> Result<Tensor> {
        let mut bigger = self.shape().to_vec();
        bigger.push(1);
        let d = dim.to_index("unsqueeze", &bigger)?;
        let mut shape = self.shape().to_vec();
        shape.insert(d, 1);
        self.reshape(&shape)
    }
    pub fn squeeze<D: Dim>(&self, dim: D) -> Result<Tensor> {
        let d = dim.to_index("squeeze", self.shape())?;
        if self.shape()[d] != 1 {
            return Ok(self.clone());
        }
        let mut shape = self.shape().to_vec();
        shape.remove(d);
        self.reshape(&shape)
    }
    /// Merges dims `start..=end` into one.
    pub fn flatten<D: Dim>(&self, start: D, end: D) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(&[1usize]);
        }
        let (s, e) = (start.to_index("flatten", self.shape())?, end.to_index("flatten", self.shape())?);
        if s > e {
            return Err(Error::shape("flatten", format!("start dim {s} after end dim {e}")));
        }
        let mut shape = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(&shape)
    }
    /// A row-major tensor: `self` if already contiguous, else a copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy()
    }
    pub fn split<D: Dim>(&self, size: usize, dim: D) -> Result<Vec<Tensor>> {
        let d = dim.to_index("split", self.shape())?;
        if size == 0 {
            return Err(Error::shape("split", "split size must be positive"));
        }
        (0..self.shape()[d]).step_by(size).map(|s| self.narrow(d, s, size.min(self.shape()[d] - s))).collect()
    }
    pub fn chunk<D: Dim>(&self, chunks: usize, dim: D) -> Result<Vec<Tensor>> {
        let d = dim.to_index("chunk", self.shape())?;
        if chunks == 0 {
            return Err(Error::shape("chunk", "number of chunks must be positive"));
        }
        self.split(self.shape()[d].div_ceil(chunks).max(1), d)
    }

    // ---- elementwise ----

    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        Tensor::apply(Op::Unary(op), &[self], self.device())
    }
    /// `self op rhs`; floats of two dtypes meet in the wider one, as in PyTorch (F64 over F32
    /// over F16/BF16; F16 with BF16 gives F32): an autocast product (BF16) added to an F32
    /// residual stream is F32.
    pub fn binary(&self, op: BinaryOp, rhs: &Tensor) -> Result<Tensor> {
        let (a, b) = (self.dtype(), rhs.dtype());
        if a != b && a.is_float() && b.is_float() {
            let to = if a == DType::F64 || b == DType::F64 { DType::F64 } else { DType::F32 };
            return Tensor::apply(Op::Binary(op), &[&self.to_dtype(to)?, &rhs.to_dtype(to)?], self.device());
        }
        Tensor::apply(Op::Binary(op), &[self, rhs], self.device())
    }
    /// Under `Autocast`, a F16/BF16 tensor in F32 (the ops PyTorch's autocast runs in F32:
    /// softmax, layer norm, cross-entropy); otherwise `self`.
    pub(crate) fn autocast_f32(&self) -> Result<Tensor> {
        match crate::autocast_dtype() {
            Some(_) if matches!(self.dtype(), DType::F16 | DType::BF16) => self.to_dtype(DType::F32),
            _ => Ok(self.clone()),
        }
    }
    /// `self op value` (or `value op self` when `scalar_lhs`).
    pub fn scalar_op(&self, op: BinaryOp, value: f64, scalar_lhs: bool) -> Result<Tensor> {
        Tensor::apply(Op::Scalar { op, value, scalar_lhs }, &[self], self.device())
    }
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Add, v, false)
    }
    pub fn sub_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Sub, v, false)
    }
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Mul, v, false)
    }
    pub fn div_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Div, v, false)
    }
    /// `v - self`.
    pub fn rsub_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Sub, v, true)
    }
    /// `v / self`.
    pub fn rdiv_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Div, v, true)
    }
    pub fn powf(&self, e: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Pow, e, false)
    }
    pub fn maximum_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Maximum, v, false)
    }
    pub fn minimum_scalar(&self, v: f64) -> Result<Tensor> {
        self.scalar_op(BinaryOp::Minimum, v, false)
    }
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        self.maximum_scalar(lo)?.minimum_scalar(hi)
    }
    /// `cond ? on_true : on_false` elementwise; `cond` nonzero is true.
    pub fn where_cond(cond: &Tensor, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        Tensor::apply(Op::Where, &[cond, on_true, on_false], cond.device())
    }
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        Tensor::apply(Op::Cast(dtype), &[self], self.device())
    }

    // ---- reductions ----

    pub fn reduce<D: Dims + ?Sized>(&self, op: ReduceOp, dims: &D, keepdim: bool) -> Result<Tensor> {
        let dims = dims.to_indices(op.name(), self.shape())?;
        Tensor::apply(Op::Reduce { op, dims, keepdim }, &[self], self.device())
    }
    pub fn sum<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, dims, keepdim)
    }
    pub fn max<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, dims, keepdim)
    }
    pub fn min<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, dims, keepdim)
    }
    pub fn argmax<D: Dim>(&self, dim: D, keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::ArgMax, &dim, keepdim)
    }
    pub fn argmin<D: Dim>(&self, dim: D, keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::ArgMin, &dim, keepdim)
    }
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&crate::AllDims, false)
    }
    pub fn mean<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool) -> Result<Tensor> {
        let idx = dims.to_indices("mean", self.shape())?;
        let n: usize = idx.iter().map(|&d| self.shape()[d]).product();
        self.sum(&idx, keepdim)?.mul_scalar(1.0 / n as f64)
    }
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&crate::AllDims, false)
    }
    /// Variance with Bessel's correction (`correction` = 1 as torch.var's default, 0 for
    /// the population variance).
    pub fn var<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool, correction: usize) -> Result<Tensor> {
        let idx = dims.to_indices("var", self.shape())?;
        let n: usize = idx.iter().map(|&d| self.shape()[d]).product();
        let centered = self.sub(&self.mean(&idx, true)?)?;
        let denom = n.saturating_sub(correction).max(1) as f64;
        centered.square()?.sum(&idx, keepdim)?.mul_scalar(1.0 / denom)
    }
    /// Standard deviation: the square root of `var` with the same arguments.
    pub fn std<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool, correction: usize) -> Result<Tensor> {
        self.var(dims, keepdim, correction)?.sqrt()
    }
    /// `log(sum(exp(x)))` over `dims`, computed from `x - max` so it never overflows; rows of
    /// all `-inf` give `-inf` (as PyTorch's).
    pub fn logsumexp<D: Dims + ?Sized>(&self, dims: &D, keepdim: bool) -> Result<Tensor> {
        let idx = dims.to_indices("logsumexp", self.shape())?;
        // The shift cancels in value and gradient: detached, and 0 where the max is infinite.
        let m = self.max(&idx, true)?.detach();
        let m = Tensor::where_cond(&m.abs()?.eq_scalar(f64::INFINITY)?, &m.zeros_like()?, &m)?;
        let log_sum = self.sub(&m)?.exp()?.sum(&idx, keepdim)?.log()?;
        log_sum.add(&m.reshape(log_sum.shape())?)
    }

    // ---- masks and rearrangements built from other ops ----

    /// `value` where `mask` (Bool, broadcast to `self`) is true, `self` elsewhere.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        Tensor::where_cond(mask, &Tensor::scalar(value, self.dtype(), self.device())?, self)
    }
    /// The lower triangle of the last two dims: elements with `col - row <= diagonal`, 0 above.
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        Tensor::where_cond(&self.triangle("tril")?.le_scalar(diagonal as f64)?, self, &self.zeros_like()?)
    }
    /// The upper triangle of the last two dims: elements with `col - row >= diagonal`, 0 below.
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        Tensor::where_cond(&self.triangle("triu")?.ge_scalar(diagonal as f64)?, self, &self.zeros_like()?)
    }
    /// `col - row` over the last two dims, `[rows, cols]` (I64).
    fn triangle(&self, op: &'static str) -> Result<Tensor> {
        let [.., r, c] = self.shape() else {
            return Err(Error::shape(op, format!("needs at least 2 dims, got {:?}", self.shape())));
        };
        let rows = Tensor::arange(*r, DType::I64, self.device())?.reshape(&[*r, 1])?;
        Tensor::arange(*c, DType::I64, self.device())?.reshape(&[1, *c])?.sub(&rows)
    }
    /// Running sums along `dim` (`torch.cumsum`, float dtypes): a product with an upper
    /// triangle of ones, so autograd, CUDA and compile need nothing new (O(n²) in the dim's
    /// length: for the short dims of sampling and masks).
    pub fn cumsum<D: Dim>(&self, dim: D) -> Result<Tensor> {
        let d = dim.to_index("cumsum", self.shape())?;
        if self.rank() == 1 {
            return self.unsqueeze(0usize)?.cumsum(1usize)?.squeeze(0usize);
        }
        let last = self.rank() - 1;
        let n = self.shape()[d];
        let ones = Tensor::ones(&[n, n], self.dtype(), self.device())?.triu(0)?;
        self.transpose(d, last)?.matmul(&ones)?.transpose(d, last)
    }
    /// The elements in reverse order along each of `dims`.
    pub fn flip<D: Dims + ?Sized>(&self, dims: &D) -> Result<Tensor> {
        let mut out = self.clone();
        for d in dims.to_indices("flip", self.shape())? {
            let n = self.shape()[d] as f64;
            out = out.index_select(d, &Tensor::arange_step(n - 1.0, -1.0, -1.0, DType::I64, self.device())?)?;
        }
        Ok(out)
    }
    /// This rank's result of collective `kind` over the ranks of `group` (`torch.distributed`'s
    /// collectives as functions: `self` is left as it is). Every rank of the group calls it
    /// with the same shape and dtype, in the same order. CPU tensors take a thread group
    /// (`cpu::collective::thread_group`), CUDA tensors an NCCL group (`cuda::nccl`).
    pub fn collective(&self, group: Group, kind: Collective) -> Result<Tensor> {
        Tensor::apply(Op::Collective { group, kind }, &[self], self.device())
    }
    /// The positions that sort `self` along `dim` (`torch.argsort(stable=True)`): ties keep
    /// their order, NaN counts as the largest value. A scalar sorts to position 0.
    pub fn argsort<D: Dim>(&self, dim: D, descending: bool) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.unsqueeze(0usize)?.argsort(0usize, descending)?.squeeze(0usize);
        }
        let (d, last) = (dim.to_index("argsort", self.shape())?, self.rank() - 1);
        let rows = if d == last { self.clone() } else { self.transpose(d, last)? };
        let idx = Tensor::apply(Op::ArgSort { descending }, &[&rows], self.device())?;
        if d == last {
            Ok(idx)
        } else {
            idx.transpose(d, last)
        }
    }
    /// `torch.sort(stable=True)`: the values along `dim` in order and their positions; the
    /// values' gradient goes back to where each came from.
    pub fn sort<D: Dim>(&self, dim: D, descending: bool) -> Result<(Tensor, Tensor)> {
        let idx = self.argsort(dim, descending)?;
        if self.rank() == 0 {
            return Ok((self.clone(), idx));
        }
        Ok((self.gather(dim, &idx)?, idx))
    }
    /// `torch.topk(sorted=True)`: the `k` largest (or, with `largest` false, smallest) values
    /// along `dim` in order, and their positions.
    pub fn topk<D: Dim>(&self, k: usize, dim: D, largest: bool) -> Result<(Tensor, Tensor)> {
        let d = if self.rank() == 0 { 0 } else { dim.to_index("topk", self.shape())? };
        let size = self.shape().get(d).copied().unwrap_or(1);
        if k > size {
            return Err(Error::shape("topk", format!("k = {k} is more than the {size} values along dim {d} of {:?}", self.shape())));
        }
        let (values, idx) = self.sort(d, largest)?;
        if self.rank() == 0 {
            return Ok((values, idx));
        }
        Ok((values.narrow(d, 0, k)?, idx.narrow(d, 0, k)?))
    }
    /// Tiles `self` `reps[i]` times along dim `i` (`torch.Tensor.repeat`); more `reps` than
    /// dims adds leading dims.
    pub fn repeat(&self, reps: &[usize]) -> Result<Tensor> {
        if reps.len() < self.rank() {
            return Err(Error::shape(
                "repeat",
                format!("needs at least {} repeats for shape {:?}, got {reps:?}", self.rank(), self.shape()),
            ));
        }
        let mut shape = vec![1; reps.len() - self.rank()];
        shape.extend_from_slice(self.shape());
        // [s0, s1, ..] viewed as [1, s0, 1, s1, ..], expanded to [r0, s0, r1, s1, ..].
        let interleaved: Vec<usize> = shape.iter().flat_map(|&s| [1, s]).collect();
        let expanded: Vec<usize> = reps.iter().zip(&shape).flat_map(|(&r, &s)| [r, s]).collect();
        let tiled: Vec<usize> = reps.iter().zip(&shape).map(|(&r, &s)| r * s).collect();
        self.reshape(&interleaved)?.expand(&expanded)?.contiguous()?.reshape(&tiled)
    }
    /// Softmax along `dim`: one fused primitive over the last dim (other dims are moved
    /// there and back as views).
    pub fn softmax<D: Dim>(&self, dim: D) -> Result<Tensor> {
        self.softmax_op(dim.to_index("softmax", self.shape())?, false)
    }
    pub fn log_softmax<D: Dim>(&self, dim: D) -> Result<Tensor> {
        self.softmax_op(dim.to_index("log_softmax", self.shape())?, true)
    }
    /// `(x - mean) / sqrt(var + eps)` over the last dim (layer norm before its affine part),
    /// one fused primitive with a fused backward.
    pub fn normalize(&self, eps: f64) -> Result<Tensor> {
        Tensor::apply(Op::Normalize { eps, rms: false }, &[self], self.device())
    }
    /// RMS norm over the last dim in one pass: `x / sqrt(mean(x^2) + eps) * weight`, the
    /// weight `[n]` (the last dim) of `self`'s dtype or absent; a fused backward.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let ins: Vec<&Tensor> = [self].into_iter().chain(weight).collect();
        Tensor::apply(Op::Normalize { eps, rms: true }, &ins, self.device())
    }
    /// The input gradient of `rms_norm` (with its weight, if any) for the output gradient `g`,
    /// in one row pass.
    pub fn rms_norm_backward(&self, g: &Tensor, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let ins: Vec<&Tensor> = [self, g].into_iter().chain(weight).collect();
        Tensor::apply(Op::NormalizeBackward { eps, rms: true }, &ins, self.device())
    }
    /// Layer norm over the last dim in one pass: `normalize(eps) * weight + bias`, with
    /// `weight` and `bias` of shape `[n]` (the last dim) and of `self`'s dtype.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        Tensor::apply(Op::Normalize { eps, rms: false }, &[&self.autocast_f32()?, weight, bias], self.device())
    }
    /// The input gradient of a softmax (`log`: log-softmax) of `scale * x` over the last dim,
    /// from its output `self` and the output's gradient `g`, in one pass per row.
    pub fn softmax_backward(&self, g: &Tensor, log: bool, scale: f64) -> Result<Tensor> {
        Tensor::apply(Op::SoftmaxBackward { log, scale }, &[self, g], self.device())
    }
    /// Layer norm's weight and bias gradients, `[2, n]`, from its input `self` and output
    /// gradient `g` (`Op::LayerNormGrads`); on CUDA rows longer than the kernel takes
    /// go through the composite ops.
    pub fn layer_norm_param_grads(&self, g: &Tensor, eps: f64) -> Result<Tensor> {
        let n = self.shape().last().copied().unwrap_or(0);
        if self.device().is_cuda() && n > crate::cuda::kernels::rows::LAYER_NORM_GRADS_MAX_N {
            let rows: Vec<usize> = (0..self.rank() - 1).collect();
            let dw = g.mul(&self.normalize(eps)?)?.sum(&rows, false)?;
            return Tensor::cat(&[&dw.unsqueeze(0)?, &g.sum(&rows, false)?.unsqueeze(0)?], 0);
        }
        Tensor::apply(Op::LayerNormGrads { eps }, &[self, g], self.device())
    }
    /// Layer norm's whole backward for its weight `w` and the output gradient `g`: x's, the
    /// weight's and the bias's gradients, from one pass over x and g on CUDA
    /// (`Op::LayerNormGrads` with the weight; rows longer than its kernel takes run the
    /// two ops).
    pub fn layer_norm_grads(&self, g: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
        let n = self.shape().last().copied().unwrap_or(0);
        if self.device().is_cuda() && n > crate::cuda::kernels::rows::LAYER_NORM_GRADS_MAX_N {
            let both = self.layer_norm_param_grads(g, eps)?;
            return Ok((self.layer_norm_backward(g, w, eps)?, both.narrow(0, 0, 1)?.reshape(&[n])?, both.narrow(0, 1, 1)?.reshape(&[n])?));
        }
        let flat = Tensor::apply(Op::LayerNormGrads { eps }, &[self, g, w], self.device())?;
        let parts = Parts::layer_norm_grads(self.shape(), false);
        // The parameter gradients get their own small buffer: as views they would keep the
        // whole flat buffer (x's size) alive for as long as the parameters hold them.
        // (The flat output starts with the `[2, n]` of `layer_norm_param_grads`.)
        let (pp, at) = (Parts::layer_norm_param_grads(n), parts.offset(Part::Dw)?);
        let params = flat.narrow(0, at, pp.len())?.copy()?;
        Ok((flat.part(&parts, Part::Dx)?, params.part(&pp, Part::Dw)?, params.part(&pp, Part::Db)?))
    }
    /// The input gradient of `normalize` for the output gradient `g`.
    pub fn normalize_backward(&self, g: &Tensor, eps: f64) -> Result<Tensor> {
        Tensor::apply(Op::NormalizeBackward { eps, rms: false }, &[self, g], self.device())
    }
    /// The input gradient of `layer_norm` with weight `w` for the output gradient `g` (one
    /// row pass: `normalize_backward` of `g * w`).
    pub fn layer_norm_backward(&self, g: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        Tensor::apply(Op::NormalizeBackward { eps, rms: false }, &[self, g, w], self.device())
    }
    /// Scaled dot-product attention as one op (flash-style: the `[T, S]` scores are never
    /// stored): `softmax(scale * self k^T) v` for q `[.., T, D]` and k, v `[.., S, D]` (fewer
    /// heads under grouped-query attention), with `causal` leaving key `j` out of query `i`
    /// when `j > i + S - T`. Under `Autocast`, computed and returned in the low dtype, as for
    /// `matmul`.
    pub fn attention(&self, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
        Tensor::autocast_apply(Op::Attention { scale, causal }, &[self, k, v])
    }
    /// The gradients of `attention` (q = self, then k, v, its output `o` and the output's
    /// gradient `g`), packed as `[B, T, 3, H.., D]` for q of shape `[B, H.., T, D]`
    /// (`op::attention_grads_shape`): dq, dk, dv along the dim of size 3.
    pub fn attention_backward(&self, k: &Tensor, v: &Tensor, o: &Tensor, g: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
        Tensor::apply(Op::AttentionBackward { scale, causal }, &[self, k, v, o, g], self.device())
    }
    /// Cross-entropy of each row of `self` (logits `[N, C]`) against class indices `targets`
    /// (`[N]`, I64) in one kernel: `[N]` losses, 0 where the target is `ignore_index`;
    /// `smoothing` mixes the one-hot target with the uniform distribution. A target outside
    /// `0..C` is an error (on a GPU, at the next host read). BF16 and F16 logits are read as
    /// they are and each row computed in F32; the losses are F32 under `Autocast` (as
    /// PyTorch's autocast runs the loss in F32), else in the logits' dtype.
    pub fn cross_entropy_rows(&self, targets: &Tensor, ignore_index: Option<i64>, smoothing: f64) -> Result<Tensor> {
        let losses = Tensor::apply(Op::CrossEntropy { ignore_index, smoothing }, &[self, targets], self.device())?;
        match crate::autocast_dtype() {
            None if losses.dtype() != self.dtype() => losses.to_dtype(self.dtype()),
            _ => Ok(losses),
        }
    }
    /// The logits' gradient of `cross_entropy_rows` for the per-row gradient `g` (`[N]`).
    pub fn cross_entropy_rows_backward(&self, targets: &Tensor, g: &Tensor, ignore_index: Option<i64>, smoothing: f64) -> Result<Tensor> {
        Tensor::apply(Op::CrossEntropyBackward { ignore_index, smoothing }, &[self, targets, g], self.device())
    }
    /// `softmax(scale * x)` over the last dim, optionally with attention's causal mask (entry
    /// `j` of row `i` of each trailing `[T, S]` matrix dropped when `j > i`), in one kernel.
    pub fn softmax_scaled(&self, scale: f64, causal: bool) -> Result<Tensor> {
        Tensor::apply(Op::Softmax { log: false, scale, causal }, &[&self.autocast_f32()?], self.device())
    }
    fn softmax_op(&self, d: usize, log: bool) -> Result<Tensor> {
        let x = self.autocast_f32()?;
        let last = x.rank() - 1;
        let op = Op::Softmax { log, scale: 1.0, causal: false };
        if d == last {
            return Tensor::apply(op, &[&x], x.device());
        }
        let moved = x.transpose(d, last)?;
        Tensor::apply(op, &[&moved], x.device())?.transpose(d, last)
    }

    // ---- matrix products ----

    /// Matrix product with PyTorch's rules: batch dims broadcast, 1-D operands are promoted.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        match (self.rank(), rhs.rank()) {
            (0, _) | (_, 0) => Err(Error::shape("matmul", format!("needs rank >= 1, got {:?} and {:?}", self.shape(), rhs.shape()))),
            (1, 1) => self.unsqueeze(0)?.matmul(&rhs.unsqueeze(1)?)?.reshape(&[0usize; 0]),
            (1, _) => self.unsqueeze(0)?.matmul(rhs)?.squeeze(-2i64),
            (_, 1) => self.matmul(&rhs.unsqueeze(1)?)?.squeeze(-1i64),
            _ => Tensor::autocast_apply(Op::Matmul, &[self, rhs]),
        }
    }

    /// `op` (a matmul or attention) over `ins`; under `Autocast`, F32 inputs are cast to the
    /// low dtype, and the result stays in it (as PyTorch's autocast leaves a linear layer's
    /// output: the next product reads it with no cast, and adding it to F32 gives F32).
    fn autocast_apply(op: Op, ins: &[&Tensor]) -> Result<Tensor> {
        let device = ins[0].device();
        match crate::autocast_dtype() {
            Some(low) if ins.iter().all(|t| t.dtype() == DType::F32 || t.dtype() == low) => {
                // A weight read transposed (`x w^T`) is cast as it is stored and read through
                // the transpose, as PyTorch's `to` keeps a dense tensor's strides: the
                // product's backward then hands the weight a gradient in its own layout
                // (`matmul_rule`), which the optimizer reads in order (vector loads), and the
                // cast reads the weight in order too.
                let lower = |t: &Tensor| -> Result<Tensor> {
                    if t.dtype() != low && t.rank() == 2 && !t.is_contiguous() && t.t()?.is_contiguous() {
                        t.t()?.to_dtype(low)?.t()
                    } else {
                        t.to_dtype(low)
                    }
                };
                let low_ins: Vec<Tensor> = ins.iter().map(|t| lower(t)).collect::<Result<_>>()?;
                Tensor::apply(op, &low_ins.iter().collect::<Vec<_>>(), device)
            }
            _ => Tensor::apply(op, ins, device),
        }
    }

    /// `self @ rhs + bias`, the bias `[n]` added to every row by the product itself (PyTorch's
    /// `addmm`): a cuBLASLt epilogue on CUDA, the GEMM accumulating into the bias on the CPU.
    pub fn matmul_bias(&self, rhs: &Tensor, bias: &Tensor) -> Result<Tensor> {
        if self.rank() < 2 || rhs.rank() < 2 {
            return self.matmul(rhs)?.add(bias);
        }
        Tensor::autocast_apply(Op::Matmul, &[self, rhs, bias])
    }

    /// `self @ weight^T (+ bias)` with `weight` `[out, in]`: PyTorch's `F.linear`.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        match bias {
            Some(b) => self.matmul_bias(&weight.t()?, b),
            None => self.matmul(&weight.t()?),
        }
    }

    // ---- indexing ----

    pub fn index_select<D: Dim>(&self, dim: D, index: &Tensor) -> Result<Tensor> {
        let dim = dim.to_index("index_select", self.shape())?;
        Tensor::apply(Op::IndexSelect { dim }, &[self, index], self.device())
    }
    /// A copy of `self` with `src` added at `index` along `dim`.
    pub fn index_add<D: Dim>(&self, dim: D, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let dim = dim.to_index("index_add", self.shape())?;
        Tensor::apply(Op::IndexAdd { dim }, &[self, index, src], self.device())
    }
    pub fn gather<D: Dim>(&self, dim: D, index: &Tensor) -> Result<Tensor> {
        let dim = dim.to_index("gather", self.shape())?;
        Tensor::apply(Op::Gather { dim }, &[self, index], self.device())
    }
    /// A copy of `self` with `src` added at `index` along `dim` (torch.scatter_add).
    pub fn scatter_add<D: Dim>(&self, dim: D, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let dim = dim.to_index("scatter_add", self.shape())?;
        Tensor::apply(Op::ScatterAdd { dim }, &[self, index, src], self.device())
    }
    /// Rows of `self` (`[num, dim]`) picked by integer `ids` of any shape: `[..ids, dim]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 {
            return Err(Error::shape("embedding", format!("weight must be [num_embeddings, dim], got {:?}", self.shape())));
        }
        let flat = ids.reshape(&[ids.numel()])?;
        let mut shape = ids.shape().to_vec();
        shape.push(self.shape()[1]);
        self.index_select(0usize, &flat)?.reshape(&shape)
    }
    pub fn cat<D: Dim>(tensors: &[&Tensor], dim: D) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::shape("cat", "needs at least one tensor"))?;
        let dim = dim.to_index("cat", first.shape())?;
        if tensors.len() == 1 {
            return Ok((*first).clone());
        }
        Tensor::apply(Op::Cat { dim }, tensors, first.device())
    }
    pub fn stack<D: Dim>(tensors: &[&Tensor], dim: D) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::shape("stack", "needs at least one tensor"))?;
        let mut bigger = first.shape().to_vec();
        bigger.push(1);
        let d = dim.to_index("stack", &bigger)?;
        let parts: Vec<Tensor> = tensors.iter().map(|t| t.unsqueeze(d)).collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::apply(Op::Cat { dim: d }, &refs, first.device())
    }

    // ---- in-place updates (the only mutation) ----

    /// Writes `src` (broadcast) into `self`.
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        self.apply_inplace(Op::Assign, Some(src))
    }
    pub fn add_(&self, src: &Tensor) -> Result<()> {
        self.apply_inplace_as("add_", Op::UpdateBinary(BinaryOp::Add), Some(src))
    }
    pub fn sub_(&self, src: &Tensor) -> Result<()> {
        self.apply_inplace_as("sub_", Op::UpdateBinary(BinaryOp::Sub), Some(src))
    }
    pub fn mul_(&self, src: &Tensor) -> Result<()> {
        self.apply_inplace_as("mul_", Op::UpdateBinary(BinaryOp::Mul), Some(src))
    }
    pub fn div_(&self, src: &Tensor) -> Result<()> {
        self.apply_inplace_as("div_", Op::UpdateBinary(BinaryOp::Div), Some(src))
    }
    pub fn add_scalar_(&self, v: f64) -> Result<()> {
        self.apply_inplace_as("add_scalar_", Op::UpdateScalar(BinaryOp::Add, v), None)
    }
    pub fn mul_scalar_(&self, v: f64) -> Result<()> {
        self.apply_inplace_as("mul_scalar_", Op::UpdateScalar(BinaryOp::Mul, v), None)
    }
    pub fn fill_(&self, v: f64) -> Result<()> {
        self.apply_inplace_as("fill_", Op::Assign, Some(&Tensor::scalar(v, self.dtype(), self.device())?))
    }
    pub fn zero_(&self) -> Result<()> {
        self.apply_inplace_as("zero_", Op::Assign, Some(&Tensor::scalar(0.0, self.dtype(), self.device())?))
    }
}

macro_rules! unary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            pub fn $name(&self) -> Result<Tensor> {
                self.unary(UnaryOp::$op)
            }
        )*}
    };
}
unary_methods!(
    neg => Neg, abs => Abs, exp => Exp, log => Log, sqrt => Sqrt, rsqrt => Rsqrt, recip => Recip,
    sin => Sin, cos => Cos, tanh => Tanh, sigmoid => Sigmoid, relu => Relu, gelu => Gelu,
    gelu_tanh => GeluTanh, silu => Silu, erf => Erf, square => Square, sign => Sign,
);

macro_rules! binary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> {
                self.binary(BinaryOp::$op, rhs)
            }
        )*}
    };
}
binary_methods!(
    add => Add, sub => Sub, mul => Mul, div => Div, pow => Pow, maximum => Maximum,
    minimum => Minimum, eq => Eq, ne => Ne, lt => Lt, le => Le, gt => Gt, ge => Ge,
);

macro_rules! compare_scalar_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            pub fn $name(&self, v: f64) -> Result<Tensor> {
                self.scalar_op(BinaryOp::$op, v, false)
            }
        )*}
    };
}
compare_scalar_methods!(eq_scalar => Eq, ne_scalar => Ne, lt_scalar => Lt, le_scalar => Le, gt_scalar => Gt, ge_scalar => Ge);

/// `a + b` and friends for every mix of owned and borrowed tensors and `f64` scalars on
/// either side, as PyTorch writes them; each returns `Result<Tensor>`: `(&a + &b)?`,
/// `(x * 0.5)?`, `(1.0 - &p)?`.
macro_rules! std_ops {
    ($($tr:ident $f:ident => $m:ident / $ms:ident / $op:ident),* $(,)?) => {$(
        impl std::ops::$tr<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: &Tensor) -> Result<Tensor> {
                self.$m(rhs)
            }
        }
        impl std::ops::$tr<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$m(&self, &rhs)
            }
        }
        impl std::ops::$tr<&Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$m(&self, rhs)
            }
        }
        impl std::ops::$tr<Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$m(&self, &rhs)
            }
        }
        impl std::ops::$tr<f64> for &Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: f64) -> Result<Tensor> {
                self.$ms(rhs)
            }
        }
        impl std::ops::$tr<f64> for Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: f64) -> Result<Tensor> {
                Tensor::$ms(&self, rhs)
            }
        }
        impl std::ops::$tr<&Tensor> for f64 {
            type Output = Result<Tensor>;
            fn $f(self, rhs: &Tensor) -> Result<Tensor> {
                rhs.scalar_op(BinaryOp::$op, self, true)
            }
        }
        impl std::ops::$tr<Tensor> for f64 {
            type Output = Result<Tensor>;
            fn $f(self, rhs: Tensor) -> Result<Tensor> {
                rhs.scalar_op(BinaryOp::$op, self, true)
            }
        }
    )*};
}
std_ops!(Add add => add / add_scalar / Add, Sub sub => sub / sub_scalar / Sub, Mul mul => mul / mul_scalar / Mul, Div div => div / div_scalar / Div);

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}

impl std::ops::Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(&self)
    }
}
