//! The generic passes, for any model: dead code, common subexpressions, identities that
//! make a node an alias of its input, constant folding of scalar ops, zero writes merged,
//! dense copies read in place.

use super::edit::{each_read, pinned_and_escaping, remap};
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::{BinaryOp, Op};
use std::collections::HashMap;

/// Drops nodes nothing uses and renumbers the rest in order.
pub fn dce(g: &Graph) -> Graph {
    let live = g.live();
    let mut map = vec![usize::MAX; g.nodes.len()];
    let mut out = Graph {
        state: g.state.clone(),
        outputs: g.outputs.clone(),
        writes: g.writes.clone(),
        rng_advance: g.rng_advance,
        nodes: Vec::new(),
    };
    for (i, n) in g.nodes.iter().enumerate() {
        if live[i] {
            map[i] = out.nodes.len();
            out.nodes.push(n.clone());
        }
    }
    remap(&mut out, &map);
    out
}

/// Merges nodes that compute the same op on the same arguments (random draws excepted).
pub fn cse(g: &Graph) -> Graph {
    let mut out = g.clone();
    let mut seen: HashMap<String, NodeId> = HashMap::new();
    let mut map: Vec<NodeId> = (0..g.nodes.len()).collect();
    for i in 0..out.nodes.len() {
        // Arguments first point at their representatives.
        if let Kind::Op(_, args) = &mut out.nodes[i].kind {
            args.iter_mut().for_each(|a| a.node = map[a.node]);
        }
        let key = match &out.nodes[i].kind {
            Kind::Op(..) | Kind::State(_) | Kind::Input(_) => {
                format!("{:?}|{:?}|{:?}", out.nodes[i].kind, out.nodes[i].shape, out.nodes[i].dtype)
            }
            Kind::Rand { .. } | Kind::WriteView { .. } => continue,
        };
        match seen.get(&key) {
            Some(&r) => map[i] = r,
            None => {
                seen.insert(key, i);
            }
        }
    }
    remap(&mut out, &map);
    dce(&out)
}

/// `x * 1`, `x + 0`, `x - 0`, `x / 1`, `x ^ 1`, casts to the same dtype and copies of
/// contiguous buffers read whole are their input.
pub fn simplify(g: &Graph) -> Graph {
    let mut out = g.clone();
    let mut map: Vec<NodeId> = (0..g.nodes.len()).collect();
    for i in 0..out.nodes.len() {
        if let Kind::Op(_, args) = &mut out.nodes[i].kind {
            args.iter_mut().for_each(|a| a.node = map[a.node]);
        }
        let n = &out.nodes[i];
        let Kind::Op(op, args) = &n.kind else { continue };
        let identity = match op {
            Op::Scalar { op: BinaryOp::Mul | BinaryOp::Div | BinaryOp::Pow, value, scalar_lhs: false } => *value == 1.0,
            Op::Scalar { op: BinaryOp::Add | BinaryOp::Sub, value, scalar_lhs: false } => *value == 0.0,
            Op::Contiguous => true,
            Op::Cast(d) => *d == n.dtype && args.first().is_some_and(|a| out.nodes[a.node].dtype == *d),
            _ => false,
        };
        // Aliasing is only valid when the argument reads its whole buffer in order.
        if let (true, Some(a)) = (identity, args.first()) {
            let src = &out.nodes[a.node];
            let whole = a.layout.offset == 0 && a.layout.is_contiguous() && a.layout.numel() == src.numel() && src.dtype == n.dtype;
            if whole {
                map[i] = a.node;
            }
        }
    }
    remap(&mut out, &map);
    dce(&out)
}

/// Scalar ops and casts of constants become constants.
pub fn fold_constants(g: &Graph) -> Graph {
    let mut out = g.clone();
    for i in 0..out.nodes.len() {
        let folded = match &out.nodes[i].kind {
            Kind::Op(Op::Scalar { op, value, scalar_lhs }, args) => match &out.nodes[args[0].node].kind {
                Kind::Op(Op::Full { value: c, .. }, _) => {
                    let (a, b) = if *scalar_lhs { (*value, *c) } else { (*c, *value) };
                    Some(op.eval(a, b))
                }
                _ => None,
            },
            Kind::Op(Op::Cast(_), args) => match &out.nodes[args[0].node].kind {
                Kind::Op(Op::Full { value, .. }, _) => Some(*value),
                _ => None,
            },
            _ => None,
        };
        if let Some(v) = folded {
            let n = &mut out.nodes[i];
            let dtype = n.dtype;
            let value = if dtype.is_float() { v } else { v.trunc() };
            n.kind = Kind::Op(Op::Full { shape: n.shape.clone(), value, dtype }, vec![]);
        }
    }
    dce(&out)
}

/// The regions a chain of writes into a zero constant covers (`None` if `x` is not one).
pub(super) fn zero_writes(g: &Graph, x: NodeId) -> Option<Vec<&kiln_tensor::Layout>> {
    match &g.nodes[x].kind {
        Kind::Op(Op::Full { value, .. }, _) if *value == 0.0 => Some(vec![]),
        Kind::WriteView { base, layout, .. } => {
            let mut r = zero_writes(g, *base)?;
            r.push(layout);
            Some(r)
        }
        _ => None,
    }
}

/// Whether two regions of a row-major buffer of `shape` are slices along one dim that do
/// not overlap (what splitting a tensor and writing each part's gradient back gives).
pub(super) fn disjoint_slices(a: &kiln_tensor::Layout, b: &kiln_tensor::Layout, shape: &[usize]) -> bool {
    let full = kiln_tensor::Layout::contiguous(shape);
    if a.strides != full.strides || b.strides != full.strides || a.rank() != shape.len() || b.rank() != shape.len() {
        return false;
    }
    let dims = |l: &kiln_tensor::Layout| (0..shape.len()).filter(|&d| l.shape[d] != shape[d]).collect::<Vec<_>>();
    let (da, db) = (dims(a), dims(b));
    let d = match (da.as_slice(), db.as_slice()) {
        ([x], [y]) if x == y => *x,
        _ => return false,
    };
    let st = full.strides[d].max(1);
    if !a.offset.is_multiple_of(st) || !b.offset.is_multiple_of(st) || a.offset / st >= shape[d] || b.offset / st >= shape[d] {
        return false;
    }
    let (sa, sb) = (a.offset / st, b.offset / st);
    sa + a.shape[d] <= sb || sb + b.shape[d] <= sa
}

/// `writes into zeros + write of one slice into zeros`, the slices disjoint, is one more
/// write into the first: splitting a tensor (q, k, v) then sums its parts' gradients as
/// zero-padded buffers; this makes it one buffer written slice by slice (no adds, and the
/// executor writes a chain in place).
pub fn merge_zero_writes(g: &Graph) -> Graph {
    let mut out = g.clone();
    for i in 0..out.nodes.len() {
        let Kind::Op(Op::Binary(BinaryOp::Add), args) = &out.nodes[i].kind else { continue };
        let shape = out.nodes[i].shape.clone();
        let whole = |a: &Arg| a.layout.offset == 0 && a.layout.shape == shape && a.layout.is_contiguous();
        if args.len() != 2 || !args.iter().all(whole) || args.iter().any(|a| out.nodes[a.node].dtype != out.nodes[i].dtype) {
            continue;
        }
        let (x, y) = (args[0].node, args[1].node);
        let rewrite = |many: NodeId, one: NodeId| -> Option<Kind> {
            let (rm, ro) = (zero_writes(&out, many)?, zero_writes(&out, one)?);
            let Kind::WriteView { layout, value, .. } = &out.nodes[one].kind else { return None };
            (ro.len() == 1 && rm.iter().all(|l| disjoint_slices(l, layout, &shape))).then(|| Kind::WriteView {
                base: many,
                layout: layout.clone(),
                value: value.clone(),
            })
        };
        if let Some(k) = rewrite(x, y).or_else(|| rewrite(y, x)) {
            out.nodes[i].kind = k;
        }
    }
    dce(&out)
}

/// A copy of a dense range of an op's buffer (`contiguous` of a row-major view at any offset,
/// as autograd leaves a parameter's slice of a flat gradient) is read in place: its readers
/// read the source at the shifted offset, and the copy goes. `simplify` catches only copies of
/// whole buffers. Copies written into, kept as state or returned stay.
pub fn read_dense_copies_in_place(g: &Graph) -> Graph {
    let mut out = g.clone();
    let (pinned, escapes) = pinned_and_escaping(g);
    // For each dropped copy: the source node and the copy's offset in it.
    let mut source: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let Kind::Op(Op::Contiguous, args) = &node.kind else { continue };
        let a = &args[0];
        let dense = a.layout.is_contiguous() && g.nodes[a.node].dtype == node.dtype;
        if !dense || pinned[i] || escapes[i] {
            continue;
        }
        source[i] = match source[a.node] {
            Some((s, offset)) => Some((s, offset + a.layout.offset)),
            None if matches!(g.nodes[a.node].kind, Kind::Op(..)) => Some((a.node, a.layout.offset)),
            None => None,
        };
    }
    each_read(&mut out, |x| {
        if let Some((s, offset)) = source[x.node] {
            x.node = s;
            x.layout.offset += offset;
        }
    });
    dce(&out)
}
