//! One backward rule per primitive op, written with tensor ops. `g` is the gradient of the
//! op's output `out`; the result has one entry per input (`None`: no gradient flows there).

use kiln_tensor::collective::{Collective, Group, Reduction};
use kiln_tensor::{BinaryOp, DType, Error, Op, ReduceOp, Result, Tensor, UnaryOp};

/// Sums `g` over the dims that broadcasting expanded, so it has `shape` again.
pub fn reduce_to(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let extra = g.rank() - shape.len();
    let mut dims: Vec<usize> = (0..extra).collect();
    dims.extend((0..shape.len()).filter(|&d| shape[d] == 1 && g.shape()[extra + d] != 1).map(|d| d + extra));
    g.sum(&dims, true)?.reshape(shape)
}

/// 1 where `a` wins a max (or min) against `b`, 0.5 on ties: gradients split evenly there.
fn win_mask(a: &Tensor, b: &Tensor, max: bool) -> Result<Tensor> {
    let dt = a.dtype();
    let wins = if max { a.gt(b)? } else { a.lt(b)? };
    wins.to_dtype(dt)?.add(&a.eq(b)?.to_dtype(dt)?.mul_scalar(0.5)?)
}

fn unary_rule(u: UnaryOp, x: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
    let d = match u {
        UnaryOp::Neg => g.neg()?,
        UnaryOp::Abs => g.mul(&x.sign()?)?,
        UnaryOp::Exp => g.mul(out)?,
        UnaryOp::Log => g.div(x)?,
        UnaryOp::Sqrt => g.div(out)?.mul_scalar(0.5)?,               // 1 / (2 sqrt x)
        UnaryOp::Rsqrt => g.mul(&out.powf(3.0)?)?.mul_scalar(-0.5)?, // -x^(-3/2) / 2
        UnaryOp::Recip => g.mul(&out.square()?)?.neg()?,             // -1 / x^2
        UnaryOp::Sin => g.mul(&x.cos()?)?,
        UnaryOp::Cos => g.mul(&x.sin()?)?.neg()?,
        UnaryOp::Tanh => g.mul(&out.square()?.rsub_scalar(1.0)?)?, // 1 - tanh^2
        UnaryOp::Sigmoid => g.mul(&out.mul(&out.rsub_scalar(1.0)?)?)?, // s (1 - s)
        // From the output, as PyTorch does: the pre-activation need not be kept (and a
        // compiled step can fuse the ReLU into the product that feeds it).
        UnaryOp::Relu => g.mul(&out.unary(UnaryOp::Step)?)?,
        UnaryOp::Gelu => g.mul(&x.unary(UnaryOp::GeluGrad)?)?,
        UnaryOp::GeluTanh => g.mul(&x.unary(UnaryOp::GeluTanhGrad)?)?,
        UnaryOp::Silu => g.mul(&x.unary(UnaryOp::SiluGrad)?)?,
        // 2 / sqrt(pi) exp(-x^2)
        UnaryOp::Erf => g.mul(&x.square()?.neg()?.exp()?.mul_scalar(std::f64::consts::FRAC_2_SQRT_PI)?)?,
        UnaryOp::Square => g.mul(x)?.mul_scalar(2.0)?,
        UnaryOp::Sign | UnaryOp::Step => return Ok(None), // piecewise constant
        UnaryOp::GeluGrad | UnaryOp::GeluTanhGrad | UnaryOp::SiluGrad => {
            return Err(Error::Msg(format!("backward: second derivatives through {} are not supported", u.name())));
        }
    };
    Ok(Some(d))
}

/// `needs` says which of x and y want a gradient: the other is never computed (a dropout
/// mask or a loss's row count costs no kernel in the backward).
fn binary_rule(
    b: BinaryOp,
    (x, y): (&Tensor, &Tensor),
    needs: (bool, bool),
    out: &Tensor,
    g: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    use BinaryOp::*;
    let dx = || -> Result<Option<Tensor>> {
        Ok(Some(match b {
            Add | Sub => g.clone(),
            Mul => g.mul(y)?,
            Div => g.div(y)?,
            Pow => g.mul(y)?.mul(&x.pow(&y.add_scalar(-1.0)?)?)?, // d/dx x^y = y x^(y-1)
            Maximum | Minimum => g.mul(&win_mask(x, y, b == Maximum)?)?,
            Eq | Ne | Lt | Le | Gt | Ge => return Ok(None),
        }))
    };
    let dy = || -> Result<Option<Tensor>> {
        Ok(Some(match b {
            Add => g.clone(),
            Sub => g.neg()?,
            Mul => g.mul(x)?,
            Div => g.mul(out)?.div(y)?.neg()?,  // d/dy x/y = -x/y^2 = -out/y
            Pow => g.mul(out)?.mul(&x.log()?)?, // d/dy x^y = x^y ln x
            Maximum | Minimum => g.mul(&win_mask(x, y, b == Maximum)?.rsub_scalar(1.0)?)?,
            Eq | Ne | Lt | Le | Gt | Ge => return Ok(None),
        }))
    };
    let dx = if needs.0 { dx()?.map(|d| reduce_to(&d, x.shape())).transpose()? } else { None };
    let dy = if needs.1 { dy()?.map(|d| reduce_to(&d, y.shape())).transpose()? } else { None };
    Ok((dx, dy))
}

fn scalar_rule(b: BinaryOp, v: f64, lhs: bool, x: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
    let d = match (b, lhs) {
        (BinaryOp::Add, _) => g.clone(),
        (BinaryOp::Sub, false) => g.clone(),
        (BinaryOp::Sub, true) => g.neg()?,
        (BinaryOp::Mul, _) => g.mul_scalar(v)?,
        (BinaryOp::Div, false) => g.mul_scalar(1.0 / v)?,
        (BinaryOp::Div, true) => g.mul(out)?.div(x)?.neg()?, // d/dx v/x = -v/x^2 = -out/x
        (BinaryOp::Pow, false) => g.mul(&x.powf(v - 1.0)?)?.mul_scalar(v)?,
        (BinaryOp::Pow, true) => g.mul(out)?.mul_scalar(v.ln())?,
        (BinaryOp::Maximum | BinaryOp::Minimum, _) => {
            let s = Tensor::scalar(v, x.dtype(), x.device())?;
            g.mul(&win_mask(x, &s, b == BinaryOp::Maximum)?)?
        }
        (BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge, _) => return Ok(None),
    };
    Ok(Some(d))
}

/// `g` of a reduction over `dims` brought back to the input's rank (size 1 on reduced dims).
fn unreduce(g: &Tensor, in_shape: &[usize], dims: &[usize], keepdim: bool) -> Result<Tensor> {
    if keepdim {
        return Ok(g.clone());
    }
    let kept: Vec<usize> = in_shape.iter().enumerate().map(|(i, &s)| if dims.contains(&i) { 1 } else { s }).collect();
    g.reshape(&kept)
}

/// d(a @ b): `g @ b^T` and `a^T @ g`, each only when wanted.
fn matmul_rule(a: &Tensor, b: &Tensor, (need_a, need_b): (bool, bool), g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let da = if need_a { Some(reduce_to(&g.matmul(&b.t()?)?, a.shape())?) } else { None };
    if !need_b {
        return Ok((da, None));
    }
    // A batched activation times a 2-D weight: fold the batch into rows, one product.
    let (a, g) = if b.rank() == 2 && a.rank() > 2 {
        let (k, n) = (a.shape()[a.rank() - 1], b.shape()[1]);
        (a.reshape(&[-1, k as i64])?, g.reshape(&[-1, n as i64])?)
    } else {
        (a.clone(), g.clone())
    };
    // `x @ W^T` (nn.Linear): b is a transposed view of a contiguous weight. Computing
    // (g^T a)^T makes the permute's backward hand the weight a contiguous gradient.
    let b_is_transposed = b.rank() == 2 && !b.is_contiguous() && b.t()?.is_contiguous();
    let db = if b_is_transposed { g.t()?.matmul(&a)?.t()? } else { a.t()?.matmul(&g)? };
    Ok((da, Some(reduce_to(&db, b.shape())?)))
}

/// The gradients of an op's inputs given the gradient `g` of its output `out`.
/// `needs[i]` says whether input i wants a gradient (products skip the others).
pub fn backward(op: &Op, inputs: &[Tensor], needs: &[bool], out: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    let x = inputs.first();
    let x0 = || x.ok_or_else(|| Error::Msg(format!("backward of {}: missing input", op.name())));
    let second = |what: &str| Err(Error::Msg(format!("backward: second derivatives through {what} are not supported")));
    Ok(match op {
        Op::Full { .. } | Op::Arange { .. } | Op::Rand { .. } => vec![],
        Op::Unary(u) => vec![unary_rule(*u, x0()?, out, g)?],
        Op::Binary(b) => {
            let (dx, dy) = binary_rule(*b, (&inputs[0], &inputs[1]), (needs[0], needs[1]), out, g)?;
            vec![dx, dy]
        }
        Op::Scalar { op: b, value, scalar_lhs } => vec![scalar_rule(*b, *value, *scalar_lhs, x0()?, out, g)?],
        Op::Where => {
            let zero = Tensor::zeros(&[], g.dtype(), g.device())?;
            let c = &inputs[0];
            let da = Tensor::where_cond(c, g, &zero)?;
            let db = Tensor::where_cond(c, &zero, g)?;
            vec![None, Some(reduce_to(&da, inputs[1].shape())?), Some(reduce_to(&db, inputs[2].shape())?)]
        }
        Op::Cast(_) => vec![Some(g.to_dtype(x0()?.dtype())?)],
        Op::Reduce { op: r, dims, keepdim } => vec![reduce_rule(*r, dims, *keepdim, x0()?, out, g)?],
        // y = softmax(x): dx = y (g - sum(g y)); y = log_softmax(x): dx = g - exp(y) sum(g);
        // one fused kernel per row either way.
        Op::Softmax { log, scale, .. } => vec![Some(out.softmax_backward(g, *log, *scale)?)],
        Op::Normalize { eps, rms: false } if inputs.len() == 3 => layer_norm_rule(inputs, needs, g, *eps)?,
        Op::Normalize { eps, rms: false } => vec![Some(x0()?.normalize_backward(g, *eps)?)],
        Op::Normalize { eps, rms: true } => rms_norm_rule(inputs, needs, g, *eps)?,
        Op::Attention { scale, causal } => attention_rule(inputs, out, g, (*scale, *causal))?,
        Op::CrossEntropy { ignore_index, smoothing } => {
            vec![Some(inputs[0].cross_entropy_rows_backward(&inputs[1], g, *ignore_index, *smoothing)?), None]
        }
        Op::SoftmaxBackward { .. } => return second("softmax"),
        Op::NormalizeBackward { .. } | Op::LayerNormGrads { .. } => return second("normalize"),
        Op::AttentionBackward { .. } => return second("attention"),
        Op::CrossEntropyBackward { .. } => return second("cross_entropy"),
        Op::Matmul => {
            let (da, db) = matmul_rule(&inputs[0], &inputs[1], (needs[0], needs[1]), g)?;
            // The bias's gradient sums the output's gradient over its rows.
            let dbias = match inputs.get(2) {
                Some(bias) if needs[2] => Some(reduce_to(g, bias.shape())?),
                _ => None,
            };
            [da, db, dbias].into_iter().take(inputs.len()).collect()
        }
        Op::Fused(_) => {
            return Err(Error::Msg(format!(
                "backward: {} is made by compile's fusion after the backward was traced; it has no backward rule",
                op.name()
            )));
        }
        Op::Reshape(_) | Op::Contiguous | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_) | Op::Cat { .. } => {
            layout_rule(op, inputs, x0()?, g)?
        }
        Op::IndexSelect { .. } | Op::IndexAdd { .. } | Op::Gather { .. } | Op::ScatterAdd { .. } | Op::ArgSort { .. } => {
            index_rule(op, inputs, x0()?, g)?
        }
        Op::Assign | Op::UpdateBinary(_) | Op::UpdateScalar(..) => {
            return Err(Error::Msg(format!("backward: in-place {} is not differentiable", op.name())));
        }
        Op::Collective { group, kind } => vec![Some(collective_rule(*group, *kind, g)?)],
    })
}

/// The gradients of the collectives, as `torch.distributed.nn` gives them: an all-reduce's
/// gradient is the same all-reduce of the gradients, all-gather and reduce-scatter (sum) are
/// each other's backward, a broadcast's gradient is the ranks' gradients summed at the root.
fn collective_rule(group: Group, kind: Collective, g: &Tensor) -> Result<Tensor> {
    let not = |why: &str| Error::Msg(format!("backward: {} has no gradient {why}", kind.name()));
    match kind {
        Collective::AllReduce(r @ (Reduction::Sum | Reduction::Mean)) => g.collective(group, Collective::AllReduce(r)),
        Collective::AllGather => g.collective(group, Collective::ReduceScatter(Reduction::Sum)),
        Collective::ReduceScatter(Reduction::Sum) => g.collective(group, Collective::AllGather),
        Collective::ReduceScatter(Reduction::Mean) => g.collective(group, Collective::AllGather)? / group.world as f64,
        Collective::Broadcast { root } => {
            let summed = g.collective(group, Collective::AllReduce(Reduction::Sum))?;
            if group.rank == root {
                Ok(summed)
            } else {
                summed.zeros_like()
            }
        }
        Collective::AllReduce(_) | Collective::ReduceScatter(_) => Err(not("through a max or min over ranks")),
    }
}

/// A reduction's input gradient (input `x`, output `out`).
fn reduce_rule(r: ReduceOp, dims: &[usize], keepdim: bool, x: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
    let gk = unreduce(g, x.shape(), dims, keepdim)?;
    Ok(match r {
        ReduceOp::Sum => Some(gk.broadcast_to(x.shape())?),
        ReduceOp::Max | ReduceOp::Min => {
            // Split evenly between tied extremes, like torch.amax.
            let ok = unreduce(out, x.shape(), dims, keepdim)?;
            let hit = x.eq(&ok)?.to_dtype(x.dtype())?;
            let count = hit.sum(dims, true)?;
            Some(gk.div(&count)?.mul(&hit)?)
        }
        ReduceOp::ArgMax | ReduceOp::ArgMin => None,
    })
}

/// Layer norm's gradients (inputs x, weight, bias; `y = xhat w + b`): the weight's and the
/// bias's in one pass over x and g, with x's when it is needed too.
fn layer_norm_rule(inputs: &[Tensor], needs: &[bool], g: &Tensor, eps: f64) -> Result<Vec<Option<Tensor>>> {
    let (x, w, b) = (&inputs[0], &inputs[1], &inputs[2]);
    if needs[0] && needs[1] {
        // The whole backward in one pass over x and g (`Tensor::layer_norm_grads`).
        let (dx, dw, db) = x.layer_norm_grads(g, w, eps)?;
        return Ok(vec![Some(dx), Some(dw.reshape(w.shape())?), needs[2].then(|| db.reshape(b.shape())).transpose()?]);
    }
    let dx = needs[0].then(|| x.layer_norm_backward(g, w, eps)).transpose()?;
    let (dw, db) = if needs[1] {
        let both = x.layer_norm_param_grads(g, eps)?;
        let db = needs[2].then(|| both.narrow(0, 1, 1)?.reshape(b.shape())).transpose()?;
        (Some(both.narrow(0, 0, 1)?.reshape(w.shape())?), db)
    } else {
        (None, needs[2].then(|| reduce_to(g, b.shape())).transpose()?)
    };
    Ok(vec![dx, dw, db])
}

/// RMS norm's x gradient (one fused row pass) and its weight's: the sum over rows of g times
/// the unweighted output.
fn rms_norm_rule(inputs: &[Tensor], needs: &[bool], g: &Tensor, eps: f64) -> Result<Vec<Option<Tensor>>> {
    let (x, w) = (&inputs[0], inputs.get(1));
    let mut grads = vec![needs[0].then(|| x.rms_norm_backward(g, w, eps)).transpose()?];
    if let Some(w) = w {
        grads.push(needs[1].then(|| reduce_to(&g.mul(&x.rms_norm(None, eps)?)?, w.shape())).transpose()?);
    }
    Ok(grads)
}

/// Attention's q, k and v gradients, from one backward kernel (keys as many as queries), or
/// through the scores (`attention_unequal_rule`).
fn attention_rule(inputs: &[Tensor], out: &Tensor, g: &Tensor, (scale, causal): (f64, bool)) -> Result<Vec<Option<Tensor>>> {
    let r = inputs[0].rank();
    if inputs[1].shape()[r - 2] != inputs[0].shape()[r - 2] {
        return attention_unequal_rule(inputs, g, (scale, causal));
    }
    // Packed as [B, T, 3, H.., D]: each gradient is a view, T moved back after H...
    let packed = inputs[0].attention_backward(&inputs[1], &inputs[2], out, g, scale, causal)?;
    let at = if r > 2 { 2 } else { 1 };
    let order: Vec<usize> = if r > 2 { [&[0], &(2..r - 1).collect::<Vec<_>>()[..], &[1, r - 1]].concat() } else { (0..r).collect() };
    let mut grads: Vec<Tensor> = (0..3).map(|w| packed.narrow(at, w, 1)?.squeeze(at)?.permute(&order)).collect::<Result<_>>()?;
    // Grouped-query attention: dk and dv come per query head; each key/value head's is the
    // sum over the query heads that read it.
    let (q, k) = (inputs[0].shape(), inputs[1].shape());
    if q != k {
        let grouped = [k[0], k[1], q[1] / k[1], k[2], k[3]];
        for dkv in &mut grads[1..] {
            *dkv = dkv.reshape(&grouped[..])?.sum(&[2usize][..], false)?;
        }
    }
    Ok(grads.into_iter().map(Some).collect())
}

/// Attention's gradients when the S keys outnumber (or fall short of) the T queries, through
/// the `[T, S]` probabilities (recomputed; such attention is a decoding step's, rarely trained
/// through): p = softmax(scale q k^T) with query i hiding the keys after `i + S - T` when
/// causal; dv = p^T g, ds = p (g v^T - rowsum(p g v^T)), dq = scale ds k, dk = scale ds^T q.
/// Grouped-query k and v are repeated to q's heads, their gradients summed back.
fn attention_unequal_rule(inputs: &[Tensor], g: &Tensor, (scale, causal): (f64, bool)) -> Result<Vec<Option<Tensor>>> {
    let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
    let (qs, ks) = (q.shape().to_vec(), k.shape().to_vec());
    let r = qs.len();
    let (t, s) = (qs[r - 2], ks[r - 2]);
    let rep = kiln_tensor::op::attention_kv_repeat(&qs, &ks).unwrap_or(1);
    let heads = |x: &Tensor| -> Result<Tensor> {
        if rep == 1 {
            return Ok(x.clone());
        }
        let (b, hk, d) = (ks[0], ks[1], ks[3]);
        x.unsqueeze(2)?.expand(&[b, hk, rep, s, d])?.reshape(&[b, hk * rep, s, d])
    };
    let (kr, vr) = (heads(k)?, heads(v)?);
    let mut scores = q.matmul(&kr.transpose(-2i64, -1)?)?.mul_scalar(scale)?;
    if causal {
        let dev = q.device();
        let i = Tensor::arange(t, DType::I64, dev)?.add_scalar(s as f64 - t as f64)?;
        let j = Tensor::arange(s, DType::I64, dev)?;
        let hide = j.reshape(&[1, s])?.gt(&i.reshape(&[t, 1])?)?;
        let neg = Tensor::scalar(f64::NEG_INFINITY, scores.dtype(), dev)?;
        scores = Tensor::where_cond(&hide, &neg, &scores)?;
    }
    let mut p = scores.softmax(-1i64)?;
    if causal && s < t {
        // The first T - S queries see no key: their output is zero (as the forward's), and so
        // are their probabilities (the softmax of a row of -inf would be NaN everywhere).
        let none = Tensor::arange(t, DType::I64, q.device())?.lt_scalar((t - s) as f64)?.reshape(&[t, 1])?;
        p = Tensor::where_cond(&none, &Tensor::scalar(0.0, p.dtype(), q.device())?, &p)?;
    }
    let dv = p.transpose(-2i64, -1)?.matmul(g)?;
    let dp = g.matmul(&vr.transpose(-2i64, -1)?)?;
    let ds = p.mul(&dp.sub(&dp.mul(&p)?.sum(&[r - 1][..], true)?)?)?.mul_scalar(scale)?;
    let dq = ds.matmul(&kr)?;
    let dk = ds.transpose(-2i64, -1)?.matmul(q)?;
    let back = |x: Tensor| -> Result<Tensor> {
        if rep == 1 {
            return Ok(x);
        }
        x.reshape(&[ks[0], ks[1], rep, s, ks[3]])?.sum(&[2usize][..], false)
    };
    Ok(vec![Some(dq), Some(back(dk)?), Some(back(dv)?)])
}

/// The gradients of the ops that move or view elements without computing (x the first
/// input).
fn layout_rule(op: &Op, inputs: &[Tensor], x: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    Ok(match op {
        Op::Permute(perm) => {
            let mut inv = vec![0usize; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(g.permute(&inv)?)]
        }
        Op::Narrow { dim, start, len } => {
            // Zeros of the input's shape with the gradient written into the slice: one fill and
            // one slice copy (padding with zero blocks through `cat` moved about twice as much).
            // Backward runs without recording, so the in-place write is allowed here.
            let out = Tensor::zeros(x.shape(), g.dtype(), g.device())?;
            out.narrow(*dim, *start, *len)?.assign(g)?;
            vec![Some(out)]
        }
        Op::Expand(_) => vec![Some(reduce_to(g, x.shape())?)],
        Op::Cat { dim } => {
            let mut at = 0;
            let mut out = Vec::with_capacity(inputs.len());
            for t in inputs {
                let n = t.shape()[*dim];
                out.push(Some(g.narrow(*dim, at, n)?));
                at += n;
            }
            out
        }
        Op::Reshape(_) | Op::Contiguous => vec![Some(g.reshape(x.shape())?)],
        _ => return Err(Error::Msg(format!("backward: {} is not a layout op", op.name()))),
    })
}

/// The gradients of the indexing ops (x the first input; the indices get none).
fn index_rule(op: &Op, inputs: &[Tensor], x: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    Ok(match op {
        Op::IndexSelect { dim } => vec![Some(x.zeros_like()?.index_add(*dim, &inputs[1], g)?), None],
        Op::IndexAdd { dim } => vec![Some(g.clone()), None, Some(g.index_select(*dim, &inputs[1])?)],
        Op::Gather { dim } => vec![Some(x.zeros_like()?.scatter_add(*dim, &inputs[1], g)?), None],
        Op::ScatterAdd { dim } => vec![Some(g.clone()), None, Some(g.gather(*dim, &inputs[1])?)],
        // Positions carry no gradient; `sort`'s values get theirs through `gather`.
        Op::ArgSort { .. } => vec![None],
        _ => return Err(Error::Msg(format!("backward: {} is not an indexing op", op.name()))),
    })
}
