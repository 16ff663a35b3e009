//! Graph passes, each graph in, graph out: dead-code elimination, common-subexpression
//! elimination, algebraic simplification (identities that make a node an alias of its
//! input), constant folding of scalar ops on constants, and matmul epilogues.

use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::{BinaryOp, MatmulEpilogue, Op, ReduceOp, UnaryOp};
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

/// The regions a chain of writes into a zero constant covers (`None` if `x` is not one).
fn zero_writes(g: &Graph, x: NodeId) -> Option<Vec<&kiln_tensor::Layout>> {
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
fn disjoint_slices(a: &kiln_tensor::Layout, b: &kiln_tensor::Layout, shape: &[usize]) -> bool {
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
    if a.offset % st != 0 || b.offset % st != 0 || a.offset / st >= shape[d] || b.offset / st >= shape[d] {
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

/// Collapses dims `(size, stride)` (outer first) into one, if they walk one arithmetic
/// sequence; size-1 dims are skipped. None: not one dim.
fn collapse(dims: impl Iterator<Item = (usize, usize)>) -> Option<(usize, usize)> {
    let mut acc: Option<(usize, usize)> = None;
    for (size, stride) in dims.filter(|d| d.0 != 1) {
        acc = match acc {
            None => Some((size, stride)),
            Some((s0, st0)) if st0 == stride * size => Some((s0 * size, stride)),
            Some(_) => return None,
        };
    }
    Some(acc.unwrap_or((1, 0)))
}

/// Whether `sum` (a sum over `dims` read through its argument) adds up exactly the elements
/// along dim `over` of the 2-D operand layout `op`, per index of its other dim.
fn sums_operand(sum: &Arg, dims: &[usize], op: &kiln_tensor::Layout, over: usize) -> bool {
    let l = &sum.layout;
    let pick = |reduced: bool| collapse((0..l.rank()).filter(|d| dims.contains(d) == reduced).map(|d| (l.shape[d], l.strides[d])));
    let same = |x: Option<(usize, usize)>, d: usize| x.is_some_and(|(size, st)| size == op.shape[d] && (size <= 1 || st == op.strides[d]));
    op.rank() == 2 && l.offset == op.offset && same(pick(true), over) && same(pick(false), 1 - over)
}

/// Whether `a` reads all of node `n` in order.
fn whole(a: &Arg, n: &crate::graph::Node) -> bool {
    a.layout.offset == 0 && a.layout.is_contiguous() && a.layout.shape == n.shape
}

/// How many times each node is read (arguments, outputs and state writes).
fn readers(g: &Graph) -> Vec<usize> {
    let mut n = vec![0; g.nodes.len()];
    g.nodes
        .iter()
        .flat_map(|x| x.args())
        .chain(g.outputs.iter().map(|a| a.node))
        .chain(g.writes.iter().map(|w| w.1))
        .for_each(|a| n[a] += 1);
    n
}

/// Work folded into matmuls (`Op::MatmulFused`, a cuBLASLt epilogue on CUDA):
/// - a ReLU that is a product's only reader, or a GELU (tanh form) of a product;
/// - the product of a matmul by a GELU's gradient;
/// - the sum of a 2-D product's operand over the contraction, the bias gradient `sum(g)`
///   beside the weight gradient `g^T x`: one GEMM writes both, the sums after the product.
pub fn fuse_matmuls(g: &Graph) -> Graph {
    let mut out = g.clone();
    let uses = readers(g);
    let written: Vec<NodeId> = g.writes.iter().map(|w| w.1).collect();
    let bases: Vec<NodeId> =
        g.nodes.iter().filter_map(|n| if let Kind::WriteView { base, .. } = n.kind { Some(base) } else { None }).collect();
    // alias[i] = (node, offset): readers of i read that node, `offset` elements further on.
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    // The first reader of each node (outputs and writes read after every node).
    let mut first_reader = vec![usize::MAX; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate().rev() {
        n.args().into_iter().for_each(|a| first_reader[a] = i);
    }
    for i in 0..out.nodes.len() {
        let Kind::Op(op, args) = &out.nodes[i].kind else { continue };
        match op {
            // An activation of a product: cuBLASLt applies it as the product is stored. GELU's
            // backward reads the pre-activation, which its epilogue stores after the output.
            Op::Unary(u @ (UnaryOp::Relu | UnaryOp::GeluTanh)) => {
                let (u, p) = (*u, args[0].node);
                let pn = &out.nodes[p];
                let Kind::Op(Op::Matmul, margs) = &pn.kind else { continue };
                let only = uses[p] == 1 || u == UnaryOp::GeluTanh;
                // (A base written into in place must keep its own shape.)
                let kept = written.contains(&p) || bases.contains(&p) || bases.contains(&i);
                if !only || kept || !whole(&args[0], pn) || pn.dtype != out.nodes[i].dtype {
                    continue;
                }
                let (margs, numel) = (margs.clone(), pn.numel());
                alias[i] = Some((p, 0));
                if u == UnaryOp::Relu {
                    out.nodes[p].kind = Kind::Op(Op::MatmulFused(MatmulEpilogue::Relu), margs);
                } else {
                    let tail = kiln_tensor::op::matmul_tail_offset(numel);
                    out.nodes[p].kind = Kind::Op(Op::MatmulFused(MatmulEpilogue::GeluTanh), margs);
                    out.nodes[p].shape = vec![tail + numel];
                    alias[p] = Some((p, tail));
                }
            }
            // `(a @ b) * gelu_tanh_grad(h)`: the gradient through a GELU (cuBLASLt's DGELU).
            Op::Binary(BinaryOp::Mul) => {
                let dgelu = |x: &Arg, y: &Arg| -> Option<(NodeId, Vec<Arg>)> {
                    let (p, q) = (&out.nodes[x.node], &out.nodes[y.node]);
                    let (Kind::Op(Op::Matmul, margs), Kind::Op(Op::Unary(UnaryOp::GeluTanhGrad), h)) = (&p.kind, &q.kind) else {
                        return None;
                    };
                    let alone = |n: NodeId| uses[n] == 1 && !written.contains(&n) && !bases.contains(&n);
                    let same = p.dtype == q.dtype && p.dtype == out.nodes[i].dtype && h[0].layout.shape == p.shape;
                    let ok = margs.len() == 2 && alone(x.node) && alone(y.node) && whole(x, p) && whole(y, q) && same && h[0].node < x.node;
                    ok.then(|| (x.node, vec![margs[0].clone(), margs[1].clone(), h[0].clone()]))
                };
                if let Some((p, margs)) = dgelu(&args[0], &args[1]).or_else(|| dgelu(&args[1], &args[0])) {
                    out.nodes[p].kind = Kind::Op(Op::MatmulFused(MatmulEpilogue::DGeluTanh), margs);
                    alias[i] = Some((p, 0));
                }
            }
            // (A sum that is written into in place stays a buffer of its own.)
            Op::Reduce { op: ReduceOp::Sum, dims, .. } if !written.contains(&i) && !bases.contains(&i) => {
                let (sum, dims) = (args[0].clone(), dims.clone());
                let found = (0..out.nodes.len()).find_map(|p| {
                    let Kind::Op(Op::Matmul, margs) = &out.nodes[p].kind else { return None };
                    if margs.len() != 2 || written.contains(&p) || first_reader[i] <= p || out.nodes[p].dtype != out.nodes[i].dtype {
                        return None;
                    }
                    let side = (0..2).find(|&s| margs[s].node == sum.node && sums_operand(&sum, &dims, &margs[s].layout, 1 - s))?;
                    Some((p, side, margs.clone()))
                });
                let Some((p, side, margs)) = found else { continue };
                let (m, n) = (margs[0].layout.shape[0], margs[1].layout.shape[1]);
                let epi = if side == 0 { MatmulEpilogue::SumLeft } else { MatmulEpilogue::SumRight };
                let at = kiln_tensor::op::matmul_tail_offset(m * n);
                let len = if side == 0 { m } else { n };
                out.nodes[p].kind = Kind::Op(Op::MatmulFused(epi), margs);
                out.nodes[p].shape = vec![at + len];
                alias[i] = Some((p, at));
            }
            _ => {}
        }
    }
    let fix = |a: &mut Arg| {
        if let Some((node, offset)) = alias[a.node] {
            a.node = node;
            a.layout.offset += offset;
        }
    };
    for n in &mut out.nodes {
        match &mut n.kind {
            Kind::Op(_, args) => args.iter_mut().for_each(fix),
            Kind::WriteView { base, value, .. } => {
                // No fused node is a base (see above): only a product's DGELU output (offset 0)
                // can stand for one.
                if let Some((node, 0)) = alias[*base] {
                    *base = node;
                }
                fix(value)
            }
            Kind::Input(_) | Kind::State(_) | Kind::Rand { .. } => {}
        }
    }
    out.outputs.iter_mut().for_each(fix);
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
    g = merge_zero_writes(&g);
    log("merge_zero_writes", &g);
    g = cse(&g);
    log("cse", &g);
    g = fuse_matmuls(&g);
    log("fuse_matmuls", &g);
    g
}
