//! Graph editing the passes share: reads and bases walked, nodes remapped or aliased, who
//! reads what, and which nodes must keep their buffers.

use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::Layout;

/// Calls `f` on every argument that reads a node's values: ops' arguments, written values and
/// the step's outputs (not the bases written into, nor state writes).
pub(super) fn each_read(g: &mut Graph, mut f: impl FnMut(&mut Arg)) {
    for n in &mut g.nodes {
        match &mut n.kind {
            Kind::Op(_, args) => args.iter_mut().for_each(&mut f),
            Kind::WriteView { value, .. } => f(value),
            Kind::Input(_) | Kind::State(_) | Kind::Rand { .. } => {}
        }
    }
    g.outputs.iter_mut().for_each(f);
}

/// Each base written into in place.
pub(super) fn bases_mut(g: &mut Graph) -> impl Iterator<Item = &mut NodeId> {
    g.nodes.iter_mut().filter_map(|n| match &mut n.kind {
        Kind::WriteView { base, .. } => Some(base),
        _ => None,
    })
}

/// Rewrites every argument through `map` (old node -> new argument source).
pub(super) fn remap(g: &mut Graph, map: &[NodeId]) {
    each_read(g, |a| a.node = map[a.node]);
    bases_mut(g).for_each(|b| *b = map[*b]);
    g.writes.iter_mut().for_each(|w| w.1 = map[w.1]);
}

/// Whether `a` reads all of node `n` in order.
pub(super) fn whole(a: &Arg, n: &crate::graph::Node) -> bool {
    a.layout.offset == 0 && a.layout.is_contiguous() && a.layout.shape == n.shape
}

/// The nodes written into in place (each `WriteView`'s base).
pub(super) fn view_bases(g: &Graph) -> Vec<NodeId> {
    g.nodes.iter().filter_map(|n| if let Kind::WriteView { base, .. } = n.kind { Some(base) } else { None }).collect()
}

/// How many times each node is read (arguments, outputs and state writes).
pub(super) fn readers(g: &Graph) -> Vec<usize> {
    let mut n = vec![0; g.nodes.len()];
    g.nodes
        .iter()
        .flat_map(|x| x.args())
        .chain(g.outputs.iter().map(|a| a.node))
        .chain(g.writes.iter().map(|w| w.1))
        .for_each(|a| n[a] += 1);
    n
}

/// Applies `f` to the layout of each argument of `node` that reads `p`.
pub(super) fn each_arg_of(node: &mut crate::graph::Node, p: NodeId, mut f: impl FnMut(&mut Layout)) {
    if let Kind::Op(_, args) = &mut node.kind {
        args.iter_mut().filter(|a| a.node == p).for_each(|a| f(&mut a.layout));
    }
}

/// Points every read of a node `i` with `alias[i] = (node, offset)` at `node`, `offset`
/// elements further on. No fused node is a base written into in place (the passes check): only
/// a product's DGELU output (offset 0) can stand for one.
pub(super) fn redirect(out: &mut Graph, alias: &[Option<(NodeId, usize)>]) {
    each_read(out, |a| {
        if let Some((node, offset)) = alias[a.node] {
            a.node = node;
            a.layout.offset += offset;
        }
    });
    for base in bases_mut(out) {
        if let Some((node, 0)) = alias[*base] {
            *base = node;
        }
    }
}

/// Per node, (pinned, escapes): whether a state buffer stands for it (a state write, or a
/// base written into in place), which a fusion may not move into another node's output; and
/// whether it is pinned or the step returns it.
pub(super) fn pinned_and_escaping(g: &Graph) -> (Vec<bool>, Vec<bool>) {
    let mut pinned = vec![false; g.nodes.len()];
    g.writes.iter().for_each(|w| pinned[w.1] = true);
    for n in &g.nodes {
        if let Kind::WriteView { base, .. } = n.kind {
            pinned[base] = true;
        }
    }
    let mut escapes = pinned.clone();
    g.outputs.iter().for_each(|a| escapes[a.node] = true);
    (pinned, escapes)
}

/// Per node: neither a state buffer's value nor a base written into in place.
pub(super) fn unpinned(g: &Graph) -> Vec<bool> {
    let (pinned, _) = pinned_and_escaping(g);
    pinned.iter().map(|p| !p).collect()
}
