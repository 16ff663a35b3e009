//! The rules on layer norm's backward: casts, a residual gradient, bias sums and a 16-bit
//! copy of dx made by the parameter-gradient kernel itself.

use super::edit::{each_read, pinned_and_escaping, readers, redirect, unpinned, view_bases, whole};
use super::generic::dce;
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::op::{Part, Parts};
use kiln_tensor::{BinaryOp, DType, Fused, Layout, Op, ReduceOp};

/// On a GPU, autocast's casts beside an F32 layer norm go into its kernels: a layer norm read
/// only by a cast of all of it to F16/BF16 (before a product) writes that dtype itself
/// (`Fused::NormalizeTo`: the cast node becomes the layer norm), and a layer norm's backward
/// (`LayerNormGrads`) whose gradient was cast to F32 only for it reads the gradient in
/// the dtype the product left it in. Each saves a kernel and a round trip of an F32 copy.
/// A layer norm backward's `(eps, sums, copy)`: the primitive's (no sums, no copy) or the
/// fused form's.
fn layer_norm_grads(op: &Op) -> Option<(f64, Option<DType>, Option<DType>)> {
    match op {
        Op::LayerNormGrads { eps } => Some((*eps, None, None)),
        Op::Fused(Fused::LayerNormGrads { eps, sums, copy }) => Some((*eps, *sums, *copy)),
        _ => None,
    }
}

pub fn fold_layer_norm_casts(g: &Graph) -> Graph {
    let mut out = g.clone();
    let uses = readers(g);
    let (_, escapes) = pinned_and_escaping(g);
    let bases = view_bases(g);
    // The node read in place of `a` at a later node: nothing may write it in between.
    let alone = |a: NodeId| uses[a] == 1 && !escapes[a];
    for (i, node) in g.nodes.iter().enumerate() {
        let Kind::Op(op, args) = &node.kind else { continue };
        match op {
            Op::Cast(to @ (DType::BF16 | DType::F16)) => {
                let a = args[0].node;
                let Kind::Op(Op::Normalize { eps, rms: false }, nargs) = &g.nodes[a].kind else { continue };
                let stable = nargs.iter().all(|x| !bases.contains(&x.node));
                if alone(a) && stable && whole(&args[0], &g.nodes[a]) && g.nodes[a].dtype == DType::F32 {
                    out.nodes[i].kind = Kind::Op(Op::Fused(Fused::NormalizeTo { eps: *eps, to: *to }), nargs.clone());
                }
            }
            Op::LayerNormGrads { .. } | Op::Fused(Fused::LayerNormGrads { .. }) => {
                let c = args[1].node;
                let Kind::Op(Op::Cast(DType::F32), cargs) = &g.nodes[c].kind else { continue };
                let low = matches!(g.nodes[cargs[0].node].dtype, DType::BF16 | DType::F16);
                if alone(c) && low && !bases.contains(&cargs[0].node) && whole(&args[1], &g.nodes[c]) {
                    if let Kind::Op(_, pargs) = &mut out.nodes[i].kind {
                        pargs[1] = cargs[0].clone();
                    }
                }
            }
            _ => {}
        }
    }
    dce(&out)
}

/// On a GPU, a residual connection's gradient added to an F32 (or F64) layer norm's input
/// gradient, `r + dx` with dx read from `LayerNormGrads`'s flat output, is added by that
/// kernel as it stores dx (its fourth input `r`): the sum's readers read the flat output
/// instead. That saves writing dx and reading it back (GPT: 25 MB twice a layer norm).
/// Conditions: nothing else reads dx, r (x's shape and dtype, no broadcast) exists before
/// the layer norm's backward and is never written in place, and the sum is no state buffer.
pub fn fold_residual_into_layer_norm_grads(g: &Graph) -> Graph {
    let mut out = g.clone();
    let (pinned, _) = pinned_and_escaping(g);
    let bases = view_bases(g);
    // Every read of each node's region from its dx on (a layer norm's backward).
    let at = |p: NodeId| match &g.nodes[p].kind {
        Kind::Op(op, a) if a.len() == 3 => {
            let (_, sums, _) = layer_norm_grads(op)?;
            Parts::layer_norm_grads(&a[0].layout.shape, sums.is_some()).offset(Part::Dx).ok()
        }
        _ => None,
    };
    let mut dx_reads = vec![0usize; g.nodes.len()];
    let mut count = |a: &Arg| {
        if at(a.node).is_some_and(|from| a.layout.numel() > 0 && a.layout.last_index() >= from) {
            dx_reads[a.node] += 1;
        }
    };
    g.nodes.iter().for_each(|x| match &x.kind {
        Kind::Op(_, args) => args.iter().for_each(&mut count),
        Kind::WriteView { value, .. } => count(value),
        _ => {}
    });
    g.outputs.iter().for_each(&mut count);
    g.writes.iter().for_each(|w| dx_reads[w.1] += 2);
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let Kind::Op(Op::Binary(BinaryOp::Add), args) = &node.kind else { continue };
        for (d, r) in [(&args[0], &args[1]), (&args[1], &args[0])] {
            let p = d.node;
            let Some(from) = at(p) else { continue };
            let Kind::Op(op, pargs) = &g.nodes[p].kind else { continue };
            let x = &pargs[0];
            let dense = |a: &Arg| a.layout.is_contiguous() && a.layout.shape == x.layout.shape;
            let ok = dense(d)
                && d.layout.offset == from
                && r.layout.shape == x.layout.shape
                && node.shape == x.layout.shape
                && matches!(node.dtype, DType::F32 | DType::F64)
                && [g.nodes[p].dtype, g.nodes[r.node].dtype].iter().all(|&t| t == node.dtype)
                && dx_reads[p] == 1
                && r.node < p
                && !bases.contains(&r.node)
                && !pinned[i]
                && !pinned[p];
            let Some((eps, sums, copy)) = layer_norm_grads(op).filter(|_| ok) else { continue };
            let fused = Op::Fused(Fused::LayerNormGrads { eps, sums, copy });
            out.nodes[p].kind = Kind::Op(fused, [&pargs[..], std::slice::from_ref(r)].concat());
            alias[i] = Some((p, from));
            break;
        }
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// On a GPU, the bias gradient of a product fed by a layer norm's input gradient (the sum over
/// rows of dx, with the residual gradient folded in, or of autocast's 16-bit copy of it) is
/// summed by the layer norm's backward as it stores dx (`LayerNormGrads`'s `sums` row,
/// the values rounded to the copy's dtype first): the sum becomes a cast of that row, and no
/// column sums read the copy again (GPT: the `proj` and `fc2` biases, 12.6 MB each in BF16).
/// Readers of dx move with it (`Parts::layer_norm_grads` with the row). It shortens GPT BF16's step
/// (BENCHMARKS.md).
pub fn ln_bias_sums(g: &Graph) -> Graph {
    let mut out = g.clone();
    let (pinned, _) = pinned_and_escaping(g);
    let bases = view_bases(g);
    let dx_from = |l: NodeId| match &g.nodes[l].kind {
        Kind::Op(op, a) if a.len() >= 3 && layer_norm_grads(op).is_some_and(|(_, sums, _)| sums.is_none()) => {
            let n = *a[0].layout.shape.last()?;
            Some((n, Parts::layer_norm_grads(&a[0].layout.shape, false).offset(Part::Dx).ok()?))
        }
        _ => None,
    };
    // A layer norm with a read past its parameter gradients that is not a read of dx (into
    // the padding before it, or across its start) keeps its layout.
    let mut straddled = vec![false; g.nodes.len()];
    each_read(&mut out, |a| {
        if let Some((n, from)) = dx_from(a.node) {
            straddled[a.node] |= a.layout.numel() > 0 && a.layout.offset < from && a.layout.last_index() >= 2 * n;
        }
    });
    // Per layer norm taken: (where dx was, how far it moves); per sum: the row's cast.
    let mut moved: Vec<Option<(usize, usize)>> = vec![None; g.nodes.len()];
    let mut casts = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Kind::Op(Op::Reduce { op: ReduceOp::Sum, dims, .. }, args) = &node.kind else { continue };
        let a = &args[0];
        let (d, t) = match &g.nodes[a.node].kind {
            Kind::Op(Op::Cast(t), c) if whole(a, &g.nodes[a.node]) => (&c[0], *t),
            _ => (a, g.nodes[a.node].dtype),
        };
        let l = d.node;
        let Some((n, from)) = dx_from(l) else { continue };
        let rank = a.layout.rank();
        let ok = moved[l].is_none()
            && !straddled[l]
            && d.layout.is_contiguous()
            && d.layout.offset == from
            && d.layout.shape == a.layout.shape
            && a.layout.numel() == g.nodes[l].numel() - from
            && a.layout.shape.last() == Some(&n)
            && dims.iter().copied().eq(0..rank - 1)
            && node.numel() == n
            && node.dtype == t
            && t.is_float()
            // The row is kept in the layer norm's dtype: no wider sums (nor F64's registers).
            && t.size_in_bytes() <= g.nodes[l].dtype.size_in_bytes()
            && g.nodes[l].dtype != DType::F64
            && ![i, l].iter().any(|x| pinned[*x] || bases.contains(x));
        if !ok {
            continue;
        }
        let Kind::Op(lop, largs) = &g.nodes[l].kind else { continue };
        let Some((eps, _, copy)) = layer_norm_grads(lop) else { continue };
        let parts = Parts::layer_norm_grads(&largs[0].layout.shape, true);
        let (Ok(to), Ok(row)) = (parts.offset(Part::Dx), parts.offset(Part::Sums)) else { continue };
        out.nodes[l].kind = Kind::Op(Op::Fused(Fused::LayerNormGrads { eps, sums: Some(t), copy }), largs.clone());
        out.nodes[l].shape = vec![parts.len()];
        moved[l] = Some((from, to - from));
        casts.push((i, t, Arg { node: l, layout: Layout { offset: row, ..Layout::contiguous(&node.shape) } }));
    }
    each_read(&mut out, |a| match moved[a.node] {
        Some((from, by)) if a.layout.offset >= from => a.layout.offset += by,
        _ => {}
    });
    for (i, t, row) in casts {
        out.nodes[i].kind = Kind::Op(Op::Cast(t), vec![row]);
    }
    dce(&out)
}

/// On a GPU, autocast's 16-bit copy of an F32 layer norm's input gradient (the cast of dx, with
/// the residual gradient folded in, that the products read) is written by the layer norm's
/// backward as it stores dx: its op gets `copy`, and the executor takes both from one kernel
/// (`dx_copies`), the cast's own step doing nothing (GPT: twelve casts of 25 MB). It shortens
/// GPT BF16's step (BENCHMARKS.md).
pub fn ln_dx_copies(g: &Graph) -> Graph {
    let mut out = g.clone();
    for (i, alone) in unpinned(g).into_iter().enumerate() {
        let Some((l, t)) = dx_copy_source(g, i).filter(|_| alone) else { continue };
        if let Kind::Op(op, _) = &mut out.nodes[l].kind {
            if let Some((eps, sums, None)) = layer_norm_grads(op) {
                *op = Op::Fused(Fused::LayerNormGrads { eps, sums, copy: Some(t) });
            }
        }
    }
    out
}

/// The layer norm's backward whose whole dx (plus r) node `i` casts to 16 bits, and that
/// dtype.
pub(super) fn dx_copy_source(g: &Graph, i: NodeId) -> Option<(NodeId, DType)> {
    let Kind::Op(Op::Cast(t @ (DType::BF16 | DType::F16)), args) = &g.nodes[i].kind else { return None };
    let a = &args[0];
    let l = &g.nodes[a.node];
    let Kind::Op(op, largs) = &l.kind else { return None };
    let (_, sums, _) = layer_norm_grads(op)?;
    let x = &largs[0].layout;
    let ok = largs.len() >= 3
        && a.layout.is_contiguous()
        && Parts::layer_norm_grads(&x.shape, sums.is_some()).offset(Part::Dx).ok() == Some(a.layout.offset)
        && a.layout.numel() == x.numel()
        && l.dtype == DType::F32;
    ok.then_some((a.node, *t))
}

/// Per node, for a layer norm's backward with a `copy` (`ln_dx_copies`), the first cast node
/// that reads its dx whole in that dtype: the executor makes both in one step.
pub fn dx_copies(g: &Graph) -> Vec<Option<NodeId>> {
    let mut copies = vec![None; g.nodes.len()];
    for (i, alone) in unpinned(g).into_iter().enumerate() {
        let Some((l, t)) = dx_copy_source(g, i).filter(|_| alone) else { continue };
        if matches!(g.nodes[l].kind, Kind::Op(Op::Fused(Fused::LayerNormGrads { copy: Some(c), .. }), _) if c == t) && copies[l].is_none() {
            copies[l] = Some(i);
        }
    }
    copies
}
