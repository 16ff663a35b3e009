//! The primitive ops' shape and dtype rules (`Op::infer`), one function per op family.

use super::{attention_grads_shape, check_dim, InMeta, Op, OutMeta, Parts, ReduceOp, UnaryOp};
use crate::collective::Collective;
use crate::shape::broadcast_shapes;
use crate::{DType, Error, Result};

/// An error unless `d` is a float dtype.
pub(super) fn float_only(name: &'static str, d: DType) -> Result<()> {
    if d.is_float() {
        Ok(())
    } else {
        Err(Error::dtype(name, format!("needs a floating-point tensor, got {d:?}")))
    }
}

/// An error unless the two dtypes are one.
pub(super) fn same_dtype(name: &'static str, a: DType, b: DType) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::dtype_mismatch(name, a, b))
    }
}

/// An error unless `d` is I64 (an index).
pub(super) fn index_dtype(name: &'static str, d: DType) -> Result<()> {
    if d == DType::I64 {
        Ok(())
    } else {
        Err(Error::dtype(name, format!("index must be I64, got {d:?}")))
    }
}

fn meta(shape: Vec<usize>, dtype: DType) -> Result<OutMeta> {
    Ok(OutMeta { shape, dtype })
}

/// The error of a family's rule asked about an op of another family (a dispatch slip).
fn not_in(family: &str, op: &Op) -> Error {
    Error::Msg(format!("{}: not an op of the {family} shape rules", op.name()))
}

/// Full, Arange and Rand: the shape and dtype they are given.
pub(super) fn sources(op: &Op) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Full { shape, dtype, .. } | Op::Rand { shape, dtype, .. } => {
            if matches!(op, Op::Rand { .. }) {
                float_only(name, *dtype)?;
            }
            meta(shape.clone(), *dtype)
        }
        Op::Arange { n, dtype } => meta(vec![*n], *dtype),
        _ => Err(not_in("sources", op)),
    }
}

/// Unary, binary (broadcast), scalar, where and cast.
pub(super) fn elementwise(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Unary(u) => {
            let d = inputs[0].dtype;
            let int_ok = matches!(u, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Square | UnaryOp::Sign | UnaryOp::Relu);
            if !(d.is_float() || int_ok && d == DType::I64) {
                return Err(Error::dtype(name, format!("not defined for {d:?} tensors; cast to a float dtype first")));
            }
            meta(inputs[0].shape.to_vec(), d)
        }
        Op::Binary(b) => {
            same_dtype(name, inputs[0].dtype, inputs[1].dtype)?;
            let shape = broadcast_shapes(name, inputs[0].shape, inputs[1].shape)?;
            meta(shape, if b.is_comparison() { DType::U8 } else { inputs[0].dtype })
        }
        Op::Scalar { op, .. } => meta(inputs[0].shape.to_vec(), if op.is_comparison() { DType::U8 } else { inputs[0].dtype }),
        Op::Where => {
            same_dtype(name, inputs[1].dtype, inputs[2].dtype)?;
            let s = broadcast_shapes(name, inputs[0].shape, inputs[1].shape)?;
            meta(broadcast_shapes(name, &s, inputs[2].shape)?, inputs[1].dtype)
        }
        Op::Cast(d) => meta(inputs[0].shape.to_vec(), *d),
        _ => Err(not_in("elementwise", op)),
    }
}

/// Reductions over dims, keeping them or not.
pub(super) fn reduce(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Reduce { op, dims, keepdim } => {
            let shape = inputs[0].shape;
            if dims.iter().any(|&d| d >= shape.len()) {
                return Err(Error::shape(name, format!("dims {dims:?} out of range for shape {shape:?}")));
            }
            let is_arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
            if is_arg && dims.len() != 1 {
                return Err(Error::shape(name, format!("reduces exactly one dim, got {dims:?}")));
            }
            if !matches!(op, ReduceOp::Sum) && dims.iter().any(|&d| shape[d] == 0) {
                return Err(Error::shape(name, format!("cannot reduce an empty dim of shape {shape:?}")));
            }
            let out: Vec<usize> = if *keepdim {
                shape.iter().enumerate().map(|(i, &s)| if dims.contains(&i) { 1 } else { s }).collect()
            } else {
                shape.iter().enumerate().filter(|(i, _)| !dims.contains(i)).map(|(_, &s)| s).collect()
            };
            meta(out, if is_arg { DType::I64 } else { inputs[0].dtype })
        }
        _ => Err(not_in("reduce", op)),
    }
}

/// The row ops over the last dim: softmax, layer norm and their backwards.
pub(super) fn rows(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::NormalizeBackward { .. } | Op::SoftmaxBackward { .. } | Op::LayerNormGrads { .. } if inputs[0].shape != inputs[1].shape => {
            Err(Error::shape(name, format!("input {:?} and gradient {:?} must have one shape", inputs[0].shape, inputs[1].shape)))
        }
        Op::Softmax { log: true, causal: true, .. } => Err(Error::Msg(format!("{name}: the causal mask is for softmax only"))),
        Op::Softmax { causal: true, .. } if inputs[0].shape.len() < 2 => {
            Err(Error::shape(name, format!("a causal softmax needs rank >= 2, got {:?}", inputs[0].shape)))
        }
        Op::LayerNormGrads { .. } => {
            float_only(name, inputs[0].dtype)?;
            float_only(name, inputs[1].dtype)?;
            inputs[2..].iter().try_for_each(|a| same_dtype(name, inputs[0].dtype, a.dtype))?;
            let Some(&n) = inputs[0].shape.last() else {
                return Err(Error::shape(name, "needs rank >= 1, got a scalar".to_string()));
            };
            match inputs.get(2) {
                None => meta(vec![2, n], inputs[0].dtype),
                Some(w) if w.shape == [n] => meta(vec![Parts::layer_norm_grads(inputs[0].shape, false).len()], inputs[0].dtype),
                Some(w) => Err(Error::shape(name, format!("the weight must be [{n}] for x {:?}, got {:?}", inputs[0].shape, w.shape))),
            }
        }
        Op::Normalize { .. } | Op::NormalizeBackward { .. } if inputs.len() > 1 + matches!(op, Op::NormalizeBackward { .. }) as usize => {
            // The weighted forms: layer norm's x, weight, bias (`[n]` each after x), RMS norm's
            // x and weight, or either backward's x, output gradient (x's shape) and weight.
            let x = &inputs[0];
            float_only(name, x.dtype)?;
            let n = x.shape.last().copied().unwrap_or(0);
            let row: &[usize] = &[n];
            let want: Vec<&[usize]> = match op {
                Op::Normalize { rms: false, .. } => vec![row, row],
                Op::Normalize { .. } => vec![row],
                _ => vec![x.shape, row],
            };
            if x.shape.is_empty() || inputs.len() != want.len() + 1 || inputs[1..].iter().zip(&want).any(|(a, w)| a.shape != *w) {
                let got: Vec<&[usize]> = inputs[1..].iter().map(|a| a.shape).collect();
                return Err(Error::shape(name, format!("the inputs after x {:?} must be {want:?}, got {got:?}", x.shape)));
            }
            inputs[1..].iter().try_for_each(|a| same_dtype(name, x.dtype, a.dtype))?;
            meta(x.shape.to_vec(), x.dtype)
        }
        Op::Softmax { .. } | Op::SoftmaxBackward { .. } | Op::Normalize { .. } | Op::NormalizeBackward { .. } => {
            float_only(name, inputs[0].dtype)?;
            if inputs.len() == 2 {
                same_dtype(name, inputs[0].dtype, inputs[1].dtype)?;
            }
            if inputs[0].shape.is_empty() {
                return Err(Error::shape(name, "needs rank >= 1, got a scalar".to_string()));
            }
            meta(inputs[0].shape.to_vec(), inputs[0].dtype)
        }
        _ => Err(not_in("rows", op)),
    }
}

/// Attention and its packed backward.
pub(super) fn attention(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Attention { .. } | Op::AttentionBackward { .. } => {
            let q = inputs[0].shape;
            float_only(name, inputs[0].dtype)?;
            if q.len() < 2 {
                return Err(Error::shape(name, format!("needs q, k, v of rank >= 2, got {q:?}")));
            }
            // k and v (inputs 1 and 2) may have fewer heads (grouped-query attention), and
            // (forward only) another length.
            let backward = matches!(op, Op::AttentionBackward { .. });
            for (i, x) in inputs.iter().enumerate().skip(1) {
                same_dtype(name, inputs[0].dtype, x.dtype)?;
                let kv_fits =
                    i <= 2 && super::attention_kv_repeat(q, x.shape).is_some() && (!backward || x.shape[q.len() - 2] == q[q.len() - 2]);
                if x.shape != q && !kv_fits {
                    let kv = if backward { "[B, H_kv, T, D]" } else { "[B, H_kv, S, D]" };
                    return Err(Error::shape(
                        name,
                        format!(
                            "needs q, k, v (and output, gradient) of one shape, or k and v {kv} with H_kv dividing q's heads [B, H, T, D], got {q:?} and {:?}",
                            x.shape
                        ),
                    ));
                }
            }
            if inputs.len() >= 3 && inputs[1].shape != inputs[2].shape {
                return Err(Error::shape(name, format!("needs k and v of one shape, got {:?} and {:?}", inputs[1].shape, inputs[2].shape)));
            }
            let shape = match op {
                Op::AttentionBackward { .. } => attention_grads_shape(q),
                _ => q.to_vec(),
            };
            meta(shape, inputs[0].dtype)
        }
        _ => Err(not_in("attention", op)),
    }
}

/// Cross-entropy per row and its backward.
pub(super) fn cross_entropy(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::CrossEntropy { .. } | Op::CrossEntropyBackward { .. } => {
            let (x, t) = (inputs[0].shape, inputs[1].shape);
            float_only(name, inputs[0].dtype)?;
            index_dtype(name, inputs[1].dtype)?;
            if x.len() != 2 || t.len() != 1 || t[0] != x[0] {
                return Err(Error::shape(name, format!("expects logits [N, C] and targets [N], got {x:?} and {t:?}")));
            }
            let loss = super::cross_entropy_loss_dtype(inputs[0].dtype);
            if let Some(g) = inputs.get(2) {
                if g.dtype != loss {
                    return Err(Error::Msg(format!(
                        "{name}: the per-row gradient of {:?} logits must be {loss:?} (the losses' dtype), got {:?}",
                        inputs[0].dtype, g.dtype
                    )));
                }
                if g.shape != t {
                    return Err(Error::shape(name, format!("the gradient must be [N] = {t:?}, got {:?}", g.shape)));
                }
                return meta(x.to_vec(), inputs[0].dtype);
            }
            meta(vec![x[0]], loss)
        }
        _ => Err(not_in("cross_entropy", op)),
    }
}

/// The batched product (bias optional).
pub(super) fn matmul(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Matmul => {
            let (a, b) = (inputs[0].shape, inputs[1].shape);
            same_dtype(name, inputs[0].dtype, inputs[1].dtype)?;
            float_only(name, inputs[0].dtype)?;
            if a.len() < 2 || b.len() < 2 {
                return Err(Error::shape(name, format!("needs rank >= 2, got {a:?} and {b:?}")));
            }
            let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
            let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
            if k != k2 {
                return Err(Error::shape(name, format!("inner dims differ: {a:?} x {b:?} ({k} vs {k2})")));
            }
            let mut shape = broadcast_shapes(name, &a[..a.len() - 2], &b[..b.len() - 2])?;
            shape.extend([m, n]);
            if let Some(bias) = inputs.get(2) {
                same_dtype(name, inputs[0].dtype, bias.dtype)?;
                if bias.shape != [n] {
                    return Err(Error::shape(name, format!("the bias of {a:?} x {b:?} must be [{n}], got {:?}", bias.shape)));
                }
            }
            meta(shape, inputs[0].dtype)
        }
        _ => Err(not_in("matmul", op)),
    }
}

/// Views (reshape, permute, narrow, expand) and the dense copy.
pub(super) fn views(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Reshape(shape) => {
            let (n0, n1) = (inputs[0].shape.iter().product::<usize>(), shape.iter().product::<usize>());
            if n0 != n1 {
                return Err(Error::shape(
                    name,
                    format!("cannot reshape {:?} ({n0} elements) into {shape:?} ({n1} elements)", inputs[0].shape),
                ));
            }
            meta(shape.clone(), inputs[0].dtype)
        }
        Op::Permute(perm) => {
            let shape = inputs[0].shape;
            let mut seen = vec![false; shape.len()];
            if perm.len() != shape.len() || perm.iter().any(|&p| p >= shape.len() || std::mem::replace(&mut seen[p], true)) {
                return Err(Error::shape(name, format!("{perm:?} is not a permutation of the dims of {shape:?}")));
            }
            meta(perm.iter().map(|&p| shape[p]).collect(), inputs[0].dtype)
        }
        Op::Narrow { dim, start, len } => {
            let shape = inputs[0].shape;
            if *dim >= shape.len() || start + len > shape[*dim] {
                return Err(Error::shape(name, format!("range {start}..{} out of bounds for dim {dim} of shape {shape:?}", start + len)));
            }
            let mut out = shape.to_vec();
            out[*dim] = *len;
            meta(out, inputs[0].dtype)
        }
        Op::Expand(target) => {
            let shape = inputs[0].shape;
            let ok = target.len() >= shape.len() && shape.iter().rev().zip(target.iter().rev()).all(|(&s, &t)| s == t || s == 1);
            if !ok {
                return Err(Error::shape(name, format!("cannot expand {shape:?} to {target:?}")));
            }
            meta(target.clone(), inputs[0].dtype)
        }
        Op::Contiguous => meta(inputs[0].shape.to_vec(), inputs[0].dtype),
        _ => Err(not_in("views", op)),
    }
}

/// Index select/add, gather, scatter-add and argsort.
pub(super) fn indexing(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::IndexSelect { dim } => {
            index_dtype(name, inputs[1].dtype)?;
            if inputs[1].shape.len() != 1 {
                return Err(Error::shape(name, format!("index must be 1-D, got {:?}", inputs[1].shape)));
            }
            let mut out = inputs[0].shape.to_vec();
            check_dim(name, *dim, &out)?;
            out[*dim] = inputs[1].shape[0];
            meta(out, inputs[0].dtype)
        }
        Op::IndexAdd { dim } => {
            index_dtype(name, inputs[1].dtype)?;
            same_dtype(name, inputs[0].dtype, inputs[2].dtype)?;
            let (base, idx, src) = (inputs[0].shape, inputs[1].shape, inputs[2].shape);
            check_dim(name, *dim, base)?;
            let mut expect = base.to_vec();
            if idx.len() == 1 {
                expect[*dim] = idx[0];
            }
            if idx.len() != 1 || src != expect.as_slice() {
                return Err(Error::shape(
                    name,
                    format!("base {base:?}, index {idx:?}, src {src:?}: src must be base with dim {dim} of the index's length"),
                ));
            }
            meta(base.to_vec(), inputs[0].dtype)
        }
        Op::Gather { dim } => {
            index_dtype(name, inputs[1].dtype)?;
            let (inp, idx) = (inputs[0].shape, inputs[1].shape);
            check_dim(name, *dim, inp)?;
            if idx.len() != inp.len() || (0..inp.len()).any(|d| d != *dim && idx[d] > inp[d]) {
                return Err(Error::shape(name, format!("index {idx:?} does not fit input {inp:?} outside dim {dim}")));
            }
            meta(idx.to_vec(), inputs[0].dtype)
        }
        Op::ScatterAdd { dim } => {
            index_dtype(name, inputs[1].dtype)?;
            same_dtype(name, inputs[0].dtype, inputs[2].dtype)?;
            let (base, idx, src) = (inputs[0].shape, inputs[1].shape, inputs[2].shape);
            check_dim(name, *dim, base)?;
            if idx != src || idx.len() != base.len() || (0..base.len()).any(|d| d != *dim && idx[d] > base[d]) {
                return Err(Error::shape(
                    name,
                    format!("base {base:?}, index {idx:?}, src {src:?}: index and src must match and fit base outside dim {dim}"),
                ));
            }
            meta(base.to_vec(), inputs[0].dtype)
        }
        Op::ArgSort { .. } => {
            if inputs[0].shape.is_empty() {
                return Err(Error::shape(name, "needs a tensor of rank 1 or more, got a scalar".to_string()));
            }
            meta(inputs[0].shape.to_vec(), DType::I64)
        }
        _ => Err(not_in("indexing", op)),
    }
}

/// Concatenation.
pub(super) fn cat(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Cat { dim } => {
            let first = inputs[0].shape;
            check_dim(name, *dim, first)?;
            let mut out = first.to_vec();
            out[*dim] = 0;
            for (i, t) in inputs.iter().enumerate() {
                same_dtype(name, inputs[0].dtype, t.dtype)?;
                let fits = t.shape.len() == first.len() && (0..first.len()).all(|d| d == *dim || t.shape[d] == first[d]);
                if !fits {
                    return Err(Error::shape(
                        name,
                        format!("input {i} has shape {:?}, which does not match {first:?} outside dim {dim}", t.shape),
                    ));
                }
                out[*dim] += t.shape[*dim];
            }
            meta(out, inputs[0].dtype)
        }
        _ => Err(not_in("cat", op)),
    }
}

/// The in-place updates: the destination keeps its shape and dtype.
pub(super) fn update(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    match op {
        Op::Assign | Op::UpdateBinary(_) => {
            let (dst, src) = (inputs[0].shape, inputs[1].shape);
            same_dtype(name, inputs[0].dtype, inputs[1].dtype)?;
            let b = broadcast_shapes(name, dst, src)?;
            if b != dst {
                return Err(Error::shape(name, format!("source {src:?} does not broadcast to destination {dst:?}")));
            }
            if let Op::UpdateBinary(op) = op {
                if op.is_comparison() {
                    return Err(Error::Msg(format!("{name}: comparison {} cannot update in place", op.name())));
                }
            }
            meta(dst.to_vec(), inputs[0].dtype)
        }
        Op::UpdateScalar(op, _) => {
            if op.is_comparison() {
                return Err(Error::Msg(format!("{name}: comparison {} cannot update in place", op.name())));
            }
            meta(inputs[0].shape.to_vec(), inputs[0].dtype)
        }
        _ => Err(not_in("update", op)),
    }
}

/// Collectives: the same shape on every rank; all-gather stacks the ranks along dim 0,
/// reduce-scatter cuts dim 0 into one part per rank. Reductions take float tensors.
pub(super) fn collective(op: &Op, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    let name = op.name();
    let Op::Collective { group, kind } = op else { return Err(not_in("collective", op)) };
    let (shape, dtype) = (inputs[0].shape, inputs[0].dtype);
    if group.world == 0 || group.rank >= group.world {
        return Err(Error::Msg(format!("{name}: rank {} is not in a group of {} ranks", group.rank, group.world)));
    }
    if kind.reduction().is_some() {
        float_only(name, dtype)?;
    }
    let mut out = shape.to_vec();
    match kind {
        Collective::AllReduce(_) => {}
        Collective::Broadcast { root } if *root >= group.world => {
            return Err(Error::Msg(format!("{name}: root rank {root} is not in a group of {} ranks", group.world)))
        }
        Collective::Broadcast { .. } => {}
        Collective::AllGather | Collective::ReduceScatter(_) if shape.is_empty() => {
            return Err(Error::shape(name, "needs a tensor of rank 1 or more (it stacks or cuts dim 0), got a scalar".to_string()))
        }
        Collective::AllGather => out[0] *= group.world,
        Collective::ReduceScatter(_) if !shape[0].is_multiple_of(group.world) => {
            return Err(Error::shape(name, format!("dim 0 of {shape:?} does not split into {} equal parts, one per rank", group.world)))
        }
        Collective::ReduceScatter(_) => out[0] /= group.world,
    }
    meta(out, dtype)
}

impl Op {
    /// The shape rule: the output's shape and dtype, or an error naming shapes and dtypes.
    pub fn infer(&self, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
        let arity = self.arity(inputs.len());
        if inputs.len() != arity {
            return Err(Error::Msg(format!("{}: expected {arity} inputs, got {}", self.name(), inputs.len())));
        }
        match self {
            Op::Full { .. } | Op::Arange { .. } | Op::Rand { .. } => sources(self),
            Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Where | Op::Cast(_) => elementwise(self, inputs),
            Op::Reduce { .. } => reduce(self, inputs),
            Op::Softmax { .. }
            | Op::SoftmaxBackward { .. }
            | Op::Normalize { .. }
            | Op::NormalizeBackward { .. }
            | Op::LayerNormGrads { .. } => rows(self, inputs),
            Op::Attention { .. } | Op::AttentionBackward { .. } => attention(self, inputs),
            Op::CrossEntropy { .. } | Op::CrossEntropyBackward { .. } => cross_entropy(self, inputs),
            Op::Matmul => matmul(self, inputs),
            Op::Reshape(_) | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_) | Op::Contiguous => views(self, inputs),
            Op::IndexSelect { .. } | Op::IndexAdd { .. } | Op::Gather { .. } | Op::ScatterAdd { .. } | Op::ArgSort { .. } => {
                indexing(self, inputs)
            }
            Op::Cat { .. } => cat(self, inputs),
            Op::Assign | Op::UpdateBinary(_) | Op::UpdateScalar(..) => update(self, inputs),
            Op::Collective { .. } => collective(self, inputs),
            Op::Fused(f) => f.infer(inputs),
        }
    }

    /// How many inputs the op takes, `given` the count passed (some take optional ones).
    fn arity(&self, given: usize) -> usize {
        match self {
            Op::Full { .. } | Op::Arange { .. } | Op::Rand { .. } => 0,
            Op::Unary(_) | Op::Scalar { .. } | Op::Cast(_) | Op::Reduce { .. } | Op::UpdateScalar(..) | Op::Softmax { .. } => 1,
            Op::Normalize { rms: false, .. } if given == 3 => 3,
            Op::Normalize { rms: true, .. } if given == 2 => 2,
            Op::Normalize { .. } => 1,
            Op::NormalizeBackward { .. } | Op::LayerNormGrads { .. } if given == 3 => 3,
            Op::NormalizeBackward { .. } | Op::SoftmaxBackward { .. } | Op::LayerNormGrads { .. } => 2,
            Op::Attention { .. } => 3,
            Op::AttentionBackward { .. } => 5,
            Op::CrossEntropy { .. } => 2,
            Op::CrossEntropyBackward { .. } => 3,
            Op::Reshape(_) | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_) | Op::Contiguous | Op::ArgSort { .. } => 1,
            Op::Collective { .. } => 1,
            Op::Matmul if given == 3 => 3,
            Op::Binary(_) | Op::Matmul | Op::IndexSelect { .. } | Op::Gather { .. } => 2,
            Op::Assign | Op::UpdateBinary(_) => 2,
            Op::Where | Op::IndexAdd { .. } | Op::ScatterAdd { .. } => 3,
            Op::Cat { .. } => given.max(1),
            Op::Fused(f) => f.arity(given),
        }
    }
}
