//! The rule on attention: an output copied to heads-after-T order written there directly.

use super::edit::{each_read, pinned_and_escaping, redirect};
use super::generic::dce;
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::{Fused, Layout, Op};

/// `perm` (view dim `d` is dim `perm[d]` of `shape`) when `view` reads a contiguous buffer of
/// `shape` with its dims permuted, the last one staying last (the identity when it reads it
/// whole).
pub(super) fn read_permutation(view: &Layout, shape: &[usize]) -> Option<Vec<usize>> {
    let r = shape.len();
    if view.offset != 0 || view.rank() != r || r < 2 {
        return None;
    }
    let strides = Layout::contiguous(shape).strides;
    let mut perm: Vec<usize> = Vec::with_capacity(r);
    for d in 0..r {
        let fits = |e: usize| shape[e] == view.shape[d] && (strides[e] == view.strides[d] || shape[e] == 1);
        perm.push((0..r).find(|&e| !perm.contains(&e) && fits(e))?);
    }
    (perm[r - 1] == r - 1).then_some(perm)
}

/// A product's operands `[a, b]` read so that their product is the product's dims permuted by
/// `perm` (`read_permutation`): with a 2-D b (a weight the batch shares), a's rows and batch
/// dims may mix; else the rows stay and the batch dims of each operand of full rank move.
pub(super) fn permuted_operands(ab: &[Arg], perm: &[usize]) -> Option<Vec<Arg>> {
    let r = perm.len();
    let shared = ab[1].layout.rank() == 2 && ab[0].layout.rank() == r;
    if !shared && perm[r - 2] != r - 2 {
        return None;
    }
    let permute = |a: &Arg| -> Option<Arg> {
        match a.layout.rank() {
            2 if r > 2 => Some(a.clone()),
            n if n == r => Some(Arg { node: a.node, layout: a.layout.permuted(perm) }),
            _ => None,
        }
    };
    ab.iter().map(permute).collect()
}

/// On a GPU, an attention output `[B, H, T, D]` copied with its heads moved after T (the
/// `contiguous` before an output projection) is written that way by the attention kernel
/// (`Fused::AttentionHeadsLast`): no copy. Its other readers, each reading it whole (the backward), read the
/// new buffer through the permutation; readers of the copy read the new buffer.
pub fn attention_heads_last(g: &Graph) -> Graph {
    let mut out = g.clone();
    let n = g.nodes.len();
    let (pinned, _) = pinned_and_escaping(g);
    // Every read of each node: (reader, layout); usize::MAX for outputs and writes.
    let mut reads: Vec<Vec<(usize, &Layout)>> = vec![Vec::new(); n];
    for (i, x) in g.nodes.iter().enumerate() {
        match &x.kind {
            Kind::Op(_, args) => args.iter().for_each(|a| reads[a.node].push((i, &a.layout))),
            Kind::WriteView { value, .. } => reads[value.node].push((i, &value.layout)),
            Kind::Input(_) | Kind::State(_) | Kind::Rand { .. } => {}
        }
    }
    g.outputs.iter().for_each(|a| reads[a.node].push((usize::MAX, &a.layout)));
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; n];
    let mut moved: Vec<Option<Layout>> = vec![None; n];
    for (i, node) in g.nodes.iter().enumerate() {
        let Kind::Op(Op::Contiguous, args) = &node.kind else { continue };
        let a = args[0].node;
        let Kind::Op(Op::Attention { scale, causal }, qkv) = &g.nodes[a].kind else { continue };
        let &[b, h, t, d] = &g.nodes[a].shape[..] else { continue };
        // Swapping H and T either way: the copy's view of the old buffer, and the old
        // readers' view of the new one.
        const SWAP: [usize; 4] = [0, 2, 1, 3];
        let whole = Layout::contiguous(&g.nodes[a].shape);
        let others_whole = reads[a].iter().all(|&(r, l)| r == i || *l == whole);
        if args[0].layout != whole.permuted(&SWAP) || !others_whole || moved[a].is_some() || pinned[a] || pinned[i] {
            continue;
        }
        out.nodes[a].kind = Kind::Op(Op::Fused(Fused::AttentionHeadsLast { scale: *scale, causal: *causal }), qkv.clone());
        out.nodes[a].shape = vec![b, t, h, d];
        moved[a] = Some(Layout::contiguous(&out.nodes[a].shape).permuted(&SWAP));
        alias[i] = Some((a, 0));
    }
    each_read(&mut out, |x| {
        if let Some(l) = &moved[x.node] {
            x.layout = l.clone();
        }
    });
    redirect(&mut out, &alias);
    dce(&out)
}
