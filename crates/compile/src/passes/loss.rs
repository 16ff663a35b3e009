//! The rules on the loss: a small mean cross-entropy with its gradient as one op, and a
//! small classifier head with its loss and backward as one op.

use super::edit::{pinned_and_escaping, redirect, whole};
use super::generic::dce;
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::op::{Part, Parts};
use kiln_tensor::{BinaryOp, DType, Fused, MatmulEpilogue, Op, ReduceOp};

/// The most logits, and the longest row, that a fused mean cross-entropy takes. Its kernel
/// keeps a partial sum per block of 256 threads, room for 256 blocks, and gives a row at most
/// a quarter as many threads as it has logits: 64K logits always fit. Every block also counts
/// all the targets, which stays cheap only for small problems.
pub const XENT_MEAN_MAX: (usize, usize) = (1 << 16, 1024);

/// On a GPU, a small mean cross-entropy and its gradient as `nn::cross_entropy` and autograd
/// record them (the rows' losses summed over the count of targets that are not ignored; the
/// backward with every row's gradient `1 / count`) become one `Fused::CrossEntropyMean`: one
/// launch in place of three (the rows, the loss chain folded in one block, the
/// backward). The loss reads its element 0, the gradient the rest.
pub fn fuse_mean_cross_entropy(g: &Graph) -> Graph {
    let mut out = g.clone();
    let users = g.users();
    let (pinned, escapes) = pinned_and_escaping(g);
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    for ce in 0..g.nodes.len() {
        let Some((loss, grad)) = mean_xent(g, &users, (&escapes, &pinned), ce) else { continue };
        let &[n, c] = &g.nodes[grad].shape[..] else { continue };
        let parts = Parts::cross_entropy_mean(n, c);
        let (Ok(loss_at), Ok(grad_at)) = (parts.offset(Part::Loss), parts.offset(Part::Dx)) else { continue };
        if let Kind::Op(op, _) = &mut out.nodes[ce].kind {
            let Op::CrossEntropy { ignore_index, smoothing } = *op else { continue };
            *op = Op::Fused(Fused::CrossEntropyMean { ignore_index, smoothing });
        }
        out.nodes[ce].shape = vec![parts.len()];
        (alias[loss], alias[grad]) = (Some((ce, loss_at)), Some((ce, grad_at)));
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// For a `CrossEntropy` node `ce`, its mean's loss and gradient nodes when they form the chain
/// `fuse_mean_cross_entropy` replaces, with nothing else reading its inner nodes.
pub(super) fn mean_xent(g: &Graph, users: &[Vec<NodeId>], (escapes, pinned): (&[bool], &[bool]), ce: NodeId) -> Option<(NodeId, NodeId)> {
    let op = |i: NodeId| match &g.nodes[i].kind {
        Kind::Op(op, args) => Some((op, args.as_slice())),
        _ => None,
    };
    let (&Op::CrossEntropy { ignore_index: Some(ig), smoothing }, [x, t]) = op(ce)? else { return None };
    let [rows, classes] = x.layout.shape[..] else { return None };
    let (dtype, (most, longest)) = (g.nodes[ce].dtype, XENT_MEAN_MAX);
    // One buffer holds the loss and the gradient: the logits in the losses' dtype only.
    if rows * classes > most || classes > longest || !matches!(dtype, DType::F32 | DType::F64) || g.nodes[x.node].dtype != dtype {
        return None;
    }
    // `only(i)`: the one node reading `i`, which reads it whole.
    let only = |i: NodeId| match users[i][..] {
        [u] if !escapes[i] && op(u)?.1.iter().all(|a| a.node != i || whole(a, &g.nodes[i])) => Some(u),
        _ => None,
    };
    let sum_of = |i: NodeId| matches!(op(i), Some((Op::Reduce { op: ReduceOp::Sum, dims, .. }, _)) if dims[..] == [0]);
    let total = only(ce).filter(|&s| sum_of(s))?;
    let loss = only(total)?;
    let (Op::Binary(BinaryOp::Div), [num, count]) = op(loss)? else { return None };
    let count = count.node;
    // The count: sum(cast(targets != ignore_index)), read by the loss and the gradient's scale.
    let real_f = op(count).filter(|_| sum_of(count))?.1[0].node;
    let real = match op(real_f)? {
        (Op::Cast(d), [a]) if *d == dtype && only(real_f) == Some(count) => a.node,
        _ => None?,
    };
    let ne = Op::Scalar { op: BinaryOp::Ne, value: ig as f64, scalar_lhs: false };
    let counts_targets = matches!(op(real)?, (o, [a]) if *o == ne && a == t) && only(real) == Some(real_f);
    let [a, b] = users[count][..] else { return None };
    let scale = if a == loss { b } else { a };
    let (Op::Binary(BinaryOp::Div), [one, by]) = op(scale)? else { return None };
    let unit = matches!(op(one.node)?.0, Op::Full { value, .. } if *value == 1.0) && by.node == count;
    // (The backward reads the scale broadcast over the rows.)
    let (&[grad], false) = (&users[scale][..], escapes[scale]) else { return None };
    let backward = Op::CrossEntropyBackward { ignore_index: Some(ig), smoothing };
    let (gop, [gx, gt, gs]) = op(grad)? else { return None };
    let same = *gop == backward && gx == x && gt == t && gs.node == scale && gs.layout.strides == [0];
    let chain = num.node == total && !escapes[count] && counts_targets && unit && same;
    // The loss and the gradient may be returned, but no state buffer may stand for them.
    (chain && !pinned[loss] && !pinned[grad]).then_some((loss, grad))
}

/// The nodes `fuse_linear_cross_entropy` folds into a `CrossEntropyMean` node: its args (h,
/// the weight, the bias, the targets), the weight-gradient product (with the bias's sums) and
/// h's gradient product, and whether that one multiplies by a ReLU's `step(h)`.
pub(super) struct Head {
    args: Vec<Arg>,
    dw: NodeId,
    dh: NodeId,
    drelu: bool,
}

/// On a GPU with thread block clusters (`clusters`; one block would take up to eight times
/// the work it is sized for), a linear classifier head small enough for one cluster of blocks
/// (`kiln_tensor::cuda::kernels::products::linear_xent_fits`: a small batch), its fused mean cross-entropy and the head's
/// backward become one `Fused::LinearCrossEntropyMean`: the head's product, the loss, the weight and bias gradients
/// (`g^T h` with `sum(g)`) and h's gradient (`g w`, through a ReLU or not) in one launch. The
/// gradients' readers read them inside the new node's output.
pub fn fuse_linear_cross_entropy(g: &Graph) -> Graph {
    let mut out = g.clone();
    let users = g.users();
    let (pinned, escapes) = pinned_and_escaping(g);
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    for ce in 0..g.nodes.len() {
        let Some(head) = linear_head(g, &users, (&escapes, &pinned), ce) else { continue };
        let Kind::Op(Op::Fused(Fused::CrossEntropyMean { ignore_index, smoothing }), _) = out.nodes[ce].kind else { continue };
        let (n, c, f) = (head.args[0].layout.shape[0], head.args[1].layout.shape[0], head.args[0].layout.shape[1]);
        let parts = Parts::linear_cross_entropy_mean(n, c, f);
        let (Ok(dw_at), Ok(dh_at)) = (parts.offset(Part::Dw), parts.offset(Part::Dx)) else { continue };
        let op = Op::Fused(Fused::LinearCrossEntropyMean { ignore_index, smoothing, drelu: head.drelu });
        out.nodes[ce].kind = Kind::Op(op, head.args);
        out.nodes[ce].shape = vec![parts.len()];
        (alias[head.dw], alias[head.dh]) = (Some((ce, dw_at)), Some((ce, dh_at)));
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// The head `fuse_linear_cross_entropy` replaces at `CrossEntropyMean` node `ce`: its logits a
/// product with a bias read by nothing else, its gradient read only by the two products
/// autograd records for the head (and its loss by anything).
pub(super) fn linear_head(g: &Graph, users: &[Vec<NodeId>], (escapes, pinned): (&[bool], &[bool]), ce: NodeId) -> Option<Head> {
    let op = |i: NodeId| match &g.nodes[i].kind {
        Kind::Op(op, args) => Some((op, args.as_slice())),
        _ => None,
    };
    let (Op::Fused(Fused::CrossEntropyMean { .. }), [x, t]) = op(ce)? else { return None };
    let p = x.node;
    let (Op::Matmul, [h, wt, bias]) = op(p)? else { return None };
    let fits = |n, c, f| kiln_tensor::cuda::kernels::products::linear_xent_fits(g.nodes[ce].dtype, n, c, f);
    let (&[n, f], &[_, c]) = (&h.layout.shape[..], &wt.layout.shape[..]) else { return None };
    if users[p] != [ce] || escapes[p] || !whole(x, &g.nodes[p]) || !fits(n, c, f) || pinned[ce] {
        return None;
    }
    // The weight [C, F], which the forward read transposed; the gradient [N, C] and its transpose.
    let l = &wt.layout;
    let w = Arg {
        node: wt.node,
        layout: kiln_tensor::Layout { shape: vec![c, f], strides: vec![l.strides[1], l.strides[0]], offset: l.offset },
    };
    let grad = Parts::cross_entropy_mean(n, c).view(Part::Dx).ok()?;
    let grad_t = kiln_tensor::Layout { shape: vec![c, n], strides: vec![1, c], offset: grad.offset };
    let of_grad = |a: &Arg, l: &kiln_tensor::Layout| a.node == ce && a.layout == *l;
    let (mut dw, mut dh) = (None, None);
    for &u in &users[ce] {
        match op(u)? {
            (Op::Fused(Fused::Matmul(MatmulEpilogue::SumLeft)), [a, b]) if of_grad(a, &grad_t) && b == h => dw = Some(u),
            (Op::Fused(Fused::Matmul(MatmulEpilogue::DRelu)), [a, b, r]) if of_grad(a, &grad) && *b == w && r == h => dh = Some((u, true)),
            (Op::Matmul, [a, b]) if of_grad(a, &grad) && *b == w => dh = Some((u, false)),
            // Anything else reads the loss only.
            (_, args) if args.iter().all(|a| a.node != ce || (a.layout.offset == 0 && a.layout.numel() == 1)) => {}
            _ => return None,
        }
    }
    let ((dw, (dh, drelu)), loss_only) =
        ((dw?, dh?), g.outputs.iter().all(|a| a.node != ce || a.layout.offset == 0 && a.layout.numel() == 1));
    (loss_only && !pinned[dw] && !pinned[dh] && dw != dh).then(|| Head { args: vec![h.clone(), w, bias.clone(), t.clone()], dw, dh, drelu })
}
