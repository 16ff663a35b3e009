//! Graph passes, each graph in, graph out: dead-code elimination, common-subexpression
//! elimination, algebraic simplification (identities that make a node an alias of its
//! input) and constant folding of scalar ops on constants.

use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::{BinaryOp, Op};
use std::collections::HashMap;

/// Rewrites every argument through `map` (old node -> new argument source).
fn remap(g: &mut Graph, map: &[NodeId]) {
    let fix = |a: &mut Arg| a.node = map[a.node];
    for n in &mut g.nodes {
        match &mut n.kind {
            Kind::Op(_, args) => args.iter_mut().for_each(fix),
            Kind::WriteView { base, value, .. } => {
                *base = map[*base];
                fix(value);
            }
            Kind::Input(_) | Kind::State(_) | Kind::Rand { .. } => {}
        }
    }
    g.outputs.iter_mut().for_each(fix);
    g.writes.iter_mut().for_each(|w| w.1 = map[w.1]);
}

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

/// The pipeline, in order; `log` sees the graph after each pass.
pub fn optimise(g: Graph, mut log: impl FnMut(&str, &Graph)) -> Graph {
    let mut g = dce(&g);
    log("dce", &g);
    g = fold_constants(&g);
    log("fold_constants", &g);
    g = simplify(&g);
    log("simplify", &g);
    g = cse(&g);
    log("cse", &g);
    g
}
