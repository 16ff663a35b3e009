//! Graph passes, each graph in, graph out: dead-code elimination, common-subexpression
//! elimination, algebraic simplification (identities that make a node an alias of its
//! input), constant folding of scalar ops on constants, and matmul epilogues.

use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::{BinaryOp, DType, Layout, MatmulEpilogue, Op, ReduceOp, UnaryOp};
use std::collections::HashMap;

/// Calls `f` on every argument that reads a node's values: ops' arguments, written values and
/// the step's outputs (not the bases written into, nor state writes).
fn each_read(g: &mut Graph, mut f: impl FnMut(&mut Arg)) {
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
fn bases_mut(g: &mut Graph) -> impl Iterator<Item = &mut NodeId> {
    g.nodes.iter_mut().filter_map(|n| match &mut n.kind {
        Kind::WriteView { base, .. } => Some(base),
        _ => None,
    })
}

/// Rewrites every argument through `map` (old node -> new argument source).
fn remap(g: &mut Graph, map: &[NodeId]) {
    each_read(g, |a| a.node = map[a.node]);
    bases_mut(g).for_each(|b| *b = map[*b]);
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

/// The nodes written into in place (each `WriteView`'s base).
fn view_bases(g: &Graph) -> Vec<NodeId> {
    g.nodes.iter().filter_map(|n| if let Kind::WriteView { base, .. } = n.kind { Some(base) } else { None }).collect()
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
/// - the product of a matmul by a GELU's gradient, and on a GPU by a ReLU's (`step`) where
///   the contraction is short enough for Kiln's thin-product kernel, which multiplies as it
///   stores (`kiln_tensor::cuda::kernels::products::matmul_thin_source`; elsewhere the separate multiply is as fast);
/// - the sum of a 2-D product's operand over the contraction, the bias gradient `sum(g)`
///   beside the weight gradient `g^T x`: one GEMM writes both, the sums after the product;
/// - on a GPU, a residual add `r + a @ b`, also through a cast widening a 16-bit product to
///   an F32 `r` (autocast's residual stream: cuBLASLt's C, with an F32 D, adds the product
///   before any rounding to 16 bits).
pub fn fuse_matmuls(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    let uses = readers(g);
    let written: Vec<NodeId> = g.writes.iter().map(|w| w.1).collect();
    let bases = view_bases(g);
    // alias[i] = (node, offset): readers of i read that node, `offset` elements further on.
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    // The first reader of each node (outputs and writes read after every node).
    let mut first_reader = vec![usize::MAX; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate().rev() {
        n.args().into_iter().for_each(|a| first_reader[a] = i);
    }
    // Products that a residual add took over (dead, left for `dce`).
    let mut taken = vec![false; g.nodes.len()];
    for i in 0..out.nodes.len() {
        let Kind::Op(op, args) = &out.nodes[i].kind else { continue };
        match op {
            // `r + a @ b (+ bias)` on a GPU: the add in the product's epilogue. The product may
            // be read with its dims permuted (a batch-first product added to a sequence-first
            // residual): its operands are then read through the same permutation.
            Op::Binary(BinaryOp::Add) if gpu && !written.contains(&i) && !bases.contains(&i) => {
                let residual = |x: &Arg, y: &Arg| -> Option<(NodeId, Vec<Arg>)> {
                    let node = &out.nodes[i];
                    // Through a widening cast, read whole and only here (autocast's 16-bit
                    // product added to the F32 residual stream): the epilogue adds the
                    // product before it is rounded to 16 bits. (It shortens GPT BF16's step;
                    // BENCHMARKS.md.)
                    let p = match &out.nodes[x.node].kind {
                        Kind::Op(Op::Cast(to), c) if *to == node.dtype && uses[x.node] == 1 && whole(&c[0], &out.nodes[c[0].node]) => {
                            let from = out.nodes[c[0].node].dtype;
                            let widens = matches!(from, DType::BF16 | DType::F16) && *to == DType::F32;
                            let alone = !written.contains(&x.node) && !bases.contains(&x.node) && y.node != x.node;
                            if !(widens && alone) {
                                return None;
                            }
                            c[0].node
                        }
                        _ => x.node,
                    };
                    let Kind::Op(Op::Matmul, margs) = &out.nodes[p].kind else { return None };
                    // (The product's operands are read at i now, later than at p: none may be a
                    // buffer written in place in between.)
                    let alone = uses[p] == 1 && !written.contains(&p) && !bases.contains(&p) && y.node != p;
                    let stable = margs.iter().all(|a| !bases.contains(&a.node));
                    let same = (p != x.node || out.nodes[p].dtype == node.dtype)
                        && out.nodes[y.node].dtype == node.dtype
                        && y.layout.shape == node.shape;
                    let perm = read_permutation(&x.layout, &out.nodes[p].shape).filter(|_| alone && same && stable)?;
                    let mut fused = permuted_operands(&margs[..2], &perm)?;
                    fused.push(y.clone());
                    // A widened product's bias cast from F32 is read in F32, the sum's dtype
                    // (cuBLASLt's bias takes D's dtype outside FP8 and integer GEMMs).
                    let bias = margs.get(2).map(|b| match &out.nodes[b.node].kind {
                        Kind::Op(Op::Cast(_), bc)
                            if p != x.node
                                && out.nodes[bc[0].node].dtype == node.dtype
                                && whole(b, &out.nodes[b.node])
                                && whole(&bc[0], &out.nodes[bc[0].node])
                                && !bases.contains(&bc[0].node) =>
                        {
                            bc[0].clone()
                        }
                        _ => b.clone(),
                    });
                    fused.extend(bias);
                    Some((p, fused))
                };
                if let Some((p, fused)) = residual(&args[0], &args[1]).or_else(|| residual(&args[1], &args[0])) {
                    out.nodes[i].kind = Kind::Op(Op::MatmulFused(MatmulEpilogue::Residual), fused);
                    taken[p] = true;
                }
            }
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
            // `(a @ b) * gelu_tanh_grad(h)`: the gradient through a GELU (cuBLASLt's DGELU), or
            // `(a @ b) * step(h)`, through a ReLU.
            Op::Binary(BinaryOp::Mul) => {
                let dgelu = |x: &Arg, y: &Arg| -> Option<(NodeId, Vec<Arg>, MatmulEpilogue)> {
                    let (p, q) = (&out.nodes[x.node], &out.nodes[y.node]);
                    let (Kind::Op(Op::Matmul, margs), Kind::Op(Op::Unary(u), h)) = (&p.kind, &q.kind) else {
                        return None;
                    };
                    let epi = match u {
                        UnaryOp::GeluTanhGrad => MatmulEpilogue::DGeluTanh,
                        UnaryOp::Step if gpu && thin_product(margs, p.dtype) => MatmulEpilogue::DRelu,
                        _ => return None,
                    };
                    let alone = |n: NodeId| uses[n] == 1 && !written.contains(&n) && !bases.contains(&n);
                    let same = p.dtype == q.dtype && p.dtype == out.nodes[i].dtype && h[0].layout.shape == p.shape;
                    let ok = margs.len() == 2 && alone(x.node) && alone(y.node) && whole(x, p) && whole(y, q) && same && h[0].node < x.node;
                    ok.then(|| (x.node, vec![margs[0].clone(), margs[1].clone(), h[0].clone()], epi))
                };
                if let Some((p, margs, epi)) = dgelu(&args[0], &args[1]).or_else(|| dgelu(&args[1], &args[0])) {
                    out.nodes[p].kind = Kind::Op(Op::MatmulFused(epi), margs);
                    alias[i] = Some((p, 0));
                }
            }
            // (A sum that is written into in place stays a buffer of its own.)
            Op::Reduce { op: ReduceOp::Sum, dims, .. } if !written.contains(&i) && !bases.contains(&i) => {
                let (sum, dims) = (args[0].clone(), dims.clone());
                let found = (0..out.nodes.len()).find_map(|p| {
                    let Kind::Op(Op::Matmul, margs) = &out.nodes[p].kind else { return None };
                    if margs.len() != 2
                        || taken[p]
                        || written.contains(&p)
                        || first_reader[i] <= p
                        || out.nodes[p].dtype != out.nodes[i].dtype
                    {
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
    redirect(&mut out, &alias);
    dce(&out)
}

/// On a GPU, 16-bit products with a dim that is not a multiple of 8 (a classifier head over a
/// 65-letter vocabulary) run on cuBLASLt's align-1 kernels, far below the bandwidth (as GPT
/// BF16's three head products do). Zero padding to the next multiple of 8
/// changes no value and aligns them: a weight `w [n, k]` read as `w^T` grows zero rows (the
/// product's extra columns, zeros, are never read: its readers see the first `n`), and a
/// contraction of `k` grows zero columns in the left operand and zero rows in `w`, so each
/// of the head's three products (`h w^T`, `g w`, `g^T h`) reads a padded copy. Only where
/// every reader of a padded product reads whole rows of it, and each padded operand is a
/// dense node read as rows (or their transpose). It shortens GPT BF16's step (BENCHMARKS.md).
pub fn pad_unaligned_products(g: &Graph, gpu: bool) -> Graph {
    if !gpu {
        return g.clone();
    }
    let mut out = g.clone();
    let users = g.users();
    let held: Vec<NodeId> = g.outputs.iter().map(|a| a.node).chain(g.writes.iter().map(|w| w.1)).chain(view_bases(g)).collect();
    // Padded copies made so far: (node, dim) -> the copy (appended; moved into order below).
    let mut padded: HashMap<(NodeId, usize), NodeId> = HashMap::new();
    let original = g.nodes.len();
    // (Read from `out`: a product's readers see its padded layout by the time they come up.)
    for (i, readers) in users.iter().enumerate() {
        let node = out.nodes[i].clone();
        let Kind::Op(Op::Matmul, args) = &node.kind else { continue };
        let [a, b] = &args[..] else { continue };
        if !matches!(node.dtype, DType::BF16 | DType::F16) || b.layout.rank() != 2 {
            continue;
        }
        let r = a.layout.rank();
        if r < 2 {
            continue;
        }
        let (rows, k, n) = (a.layout.shape[..r - 1].iter().product::<usize>(), a.layout.shape[r - 1], b.layout.shape[1]);
        if rows.max(k) < PAD_MIN_ROWS {
            continue;
        }
        let mut pad =
            |out: &mut Graph, x: NodeId, dim: usize| -> NodeId { *padded.entry((x, dim)).or_insert_with(|| pad_node(out, x, dim)) };
        let (mut na, mut nb, mut shape) = (a.clone(), b.clone(), node.shape.clone());
        if n % 8 != 0 && is_transposed_whole(b, &out.nodes[b.node]) {
            // `x w^T` with w `[n, k]`: w gets zero rows, the product zero columns its readers
            // skip (so it may not be an output, state or written in place: its shape changes).
            let readers_ok = !held.contains(&i) && readers.iter().all(|&u| reads_rows(&out.nodes[u], i, n));
            if !readers_ok {
                continue;
            }
            let w = pad(&mut out, b.node, 0);
            let n8 = n.next_multiple_of(8);
            nb = Arg { node: w, layout: Layout { shape: vec![k, n8], strides: vec![1, k], offset: 0 } };
            *shape.last_mut().expect("a product has dims") = n8;
            // (A reader is listed once per argument; each of its arguments is widened once.)
            let mut once = readers.clone();
            once.sort_unstable();
            once.dedup();
            for u in once {
                each_arg_of(&mut out.nodes[u], i, |l| *l = widen_rows(l, n, n8));
            }
        } else if k % 8 != 0 && rows_of(&a.layout, k) && dense_node(&out.nodes[a.node], k) && whole(b, &out.nodes[b.node]) {
            // `g w` over a contraction of k: g gets zero columns, w zero rows.
            let last = out.nodes[a.node].shape.len() - 1;
            let (ga, w) = (pad(&mut out, a.node, last), pad(&mut out, b.node, 0));
            let k8 = k.next_multiple_of(8);
            // (The copy's rows are dense: unit stride along them, whatever a k of 1 had.)
            let mut l = widen_rows(&a.layout, k, k8);
            *l.shape.last_mut().expect("a has dims") = k8;
            *l.strides.last_mut().expect("a has dims") = 1;
            na = Arg { node: ga, layout: l };
            nb = Arg { node: w, layout: Layout::contiguous(&[k8, n]) };
        } else if r == 2 && a.layout.shape[0] % 8 != 0 && is_transposed_whole(a, &out.nodes[a.node]) {
            // `g^T h` with g `[rows, m]`: g read from its padded copy (aligned columns).
            let m = a.layout.shape[0];
            let ga = pad(&mut out, a.node, 1);
            na = Arg { node: ga, layout: Layout { shape: vec![m, k], strides: vec![1, m.next_multiple_of(8)], offset: 0 } };
        } else {
            continue;
        }
        out.nodes[i].kind = Kind::Op(Op::Matmul, vec![na, nb]);
        out.nodes[i].shape = shape;
    }
    if out.nodes.len() == original {
        return out;
    }
    // Each padded copy (two nodes: the zeros, then the cat) goes right after what it pads.
    let mut after: Vec<Vec<NodeId>> = vec![vec![]; original];
    for (&(x, _), &c) in &padded {
        after[x].extend([c - 1, c]);
    }
    let mut order: Vec<NodeId> = Vec::with_capacity(out.nodes.len());
    for (x, extra) in after.iter_mut().enumerate() {
        order.push(x);
        extra.sort_unstable();
        order.extend(extra.iter());
    }
    let mut map = vec![usize::MAX; out.nodes.len()];
    order.iter().enumerate().for_each(|(to, &from)| map[from] = to);
    let nodes = order.iter().map(|&from| out.nodes[from].clone()).collect();
    out.nodes = nodes;
    remap(&mut out, &map);
    out
}

/// The fewest rows of the product, or terms of the contraction, for which
/// `pad_unaligned_products` pads: below it the copies cost more than the aligned kernels save.
const PAD_MIN_ROWS: usize = 1024;

/// Appends `x` padded with zeros along `dim` to the next multiple of 8 (a zeros node, then a
/// cat of the two) and returns the cat.
fn pad_node(g: &mut Graph, x: NodeId, dim: usize) -> NodeId {
    let (mut zeros, dtype) = (g.nodes[x].shape.clone(), g.nodes[x].dtype);
    let d = zeros[dim];
    zeros[dim] = d.next_multiple_of(8) - d;
    let mut full = g.nodes[x].shape.clone();
    full[dim] = d.next_multiple_of(8);
    let z = g.push(Kind::Op(Op::Full { shape: zeros.clone(), value: 0.0, dtype }, vec![]), zeros, dtype);
    let xa = Arg { node: x, layout: Layout::contiguous(&g.nodes[x].shape) };
    let za = Arg { node: z, layout: Layout::contiguous(&g.nodes[z].shape) };
    g.push(Kind::Op(Op::Cat { dim }, vec![xa, za]), full, dtype)
}

/// Whether `a` reads node `x` (`[n, k]`, dense) whole as its transpose `[k, n]`.
fn is_transposed_whole(a: &Arg, x: &crate::graph::Node) -> bool {
    let l = &a.layout;
    x.shape.len() == 2 && l.offset == 0 && l.shape == [x.shape[1], x.shape[0]] && l.strides == [1, x.shape[1]]
}

/// Whether node `x` is laid out as dense rows of `k` (its last dim).
fn dense_node(x: &crate::graph::Node, k: usize) -> bool {
    x.shape.last() == Some(&k)
}

/// Whether a view reads whole rows of `k` contiguous elements from offset 0: its last dim is
/// `k` with stride 1 and every other stride a multiple of `k`.
fn rows_of(l: &Layout, k: usize) -> bool {
    let r = l.rank();
    r >= 1 && l.offset == 0 && l.shape[r - 1] == k && (l.strides[r - 1] == 1 || k == 1) && l.strides[..r - 1].iter().all(|s| s % k == 0)
}

/// The same rows read from a copy whose rows are `k8` long instead of `k`.
fn widen_rows(l: &Layout, k: usize, k8: usize) -> Layout {
    let r = l.rank();
    let strides = l.strides.iter().enumerate().map(|(d, &s)| if d + 1 == r { s } else { s / k * k8 }).collect();
    Layout { shape: l.shape.clone(), strides, offset: 0 }
}

/// Whether every argument of `reader` that reads node `p` reads whole rows of `n` (and
/// `reader` is an op, the only kind whose arguments can move to a padded product).
fn reads_rows(reader: &crate::graph::Node, p: NodeId, n: usize) -> bool {
    match &reader.kind {
        Kind::Op(_, args) => args.iter().filter(|a| a.node == p).all(|a| rows_of(&a.layout, n)),
        _ => false,
    }
}

/// Applies `f` to the layout of each argument of `node` that reads `p`.
fn each_arg_of(node: &mut crate::graph::Node, p: NodeId, mut f: impl FnMut(&mut Layout)) {
    if let Kind::Op(_, args) = &mut node.kind {
        args.iter_mut().filter(|a| a.node == p).for_each(|a| f(&mut a.layout));
    }
}

/// `perm` (view dim `d` is dim `perm[d]` of `shape`) when `view` reads a contiguous buffer of
/// `shape` with its dims permuted, the last one staying last (the identity when it reads it
/// whole).
fn read_permutation(view: &Layout, shape: &[usize]) -> Option<Vec<usize>> {
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
fn permuted_operands(ab: &[Arg], perm: &[usize]) -> Option<Vec<Arg>> {
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

/// Points every read of a node `i` with `alias[i] = (node, offset)` at `node`, `offset`
/// elements further on. No fused node is a base written into in place (the passes check): only
/// a product's DGELU output (offset 0) can stand for one.
fn redirect(out: &mut Graph, alias: &[Option<(NodeId, usize)>]) {
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

/// The most logits, and the longest row, that a fused mean cross-entropy takes. Its kernel
/// keeps a partial sum per block of 256 threads, room for 256 blocks, and gives a row at most
/// a quarter as many threads as it has logits: 64K logits always fit. Every block also counts
/// all the targets, which stays cheap only for small problems.
pub const XENT_MEAN_MAX: (usize, usize) = (1 << 16, 1024);

/// Per node, (pinned, escapes): whether a state buffer stands for it (a state write, or a
/// base written into in place), which a fusion may not move into another node's output; and
/// whether it is pinned or the step returns it.
fn pinned_and_escaping(g: &Graph) -> (Vec<bool>, Vec<bool>) {
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

/// On a GPU, a small mean cross-entropy and its gradient as `nn::cross_entropy` and autograd
/// record them (the rows' losses summed over the count of targets that are not ignored; the
/// backward with every row's gradient `1 / count`) become one `Op::CrossEntropyMean`: one
/// launch in place of three (the rows, the loss chain folded in one block, the
/// backward). The loss reads its element 0, the gradient the rest.
pub fn fuse_mean_cross_entropy(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
    let users = g.users();
    let (pinned, escapes) = pinned_and_escaping(g);
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    for ce in 0..g.nodes.len() {
        let Some((loss, grad)) = mean_xent(g, &users, (&escapes, &pinned), ce) else { continue };
        if let Kind::Op(op, _) = &mut out.nodes[ce].kind {
            let Op::CrossEntropy { ignore_index, smoothing } = *op else { continue };
            *op = Op::CrossEntropyMean { ignore_index, smoothing };
        }
        out.nodes[ce].shape = vec![kiln_tensor::op::XENT_GRAD_AT + g.nodes[grad].numel()];
        (alias[loss], alias[grad]) = (Some((ce, 0)), Some((ce, kiln_tensor::op::XENT_GRAD_AT)));
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// For a `CrossEntropy` node `ce`, its mean's loss and gradient nodes when they form the chain
/// `fuse_mean_cross_entropy` replaces, with nothing else reading its inner nodes.
fn mean_xent(g: &Graph, users: &[Vec<NodeId>], (escapes, pinned): (&[bool], &[bool]), ce: NodeId) -> Option<(NodeId, NodeId)> {
    let op = |i: NodeId| match &g.nodes[i].kind {
        Kind::Op(op, args) => Some((op, args.as_slice())),
        _ => None,
    };
    let (&Op::CrossEntropy { ignore_index: Some(ig), smoothing }, [x, t]) = op(ce)? else { return None };
    let [rows, classes] = x.layout.shape[..] else { return None };
    let (dtype, (most, longest)) = (g.nodes[ce].dtype, XENT_MEAN_MAX);
    if rows * classes > most || classes > longest || !matches!(dtype, DType::F32 | DType::F64) {
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
struct Head {
    args: Vec<Arg>,
    dw: NodeId,
    dh: NodeId,
    drelu: bool,
}

/// On a GPU with thread block clusters (`clusters`; one block would take up to eight times
/// the work it is sized for), a linear classifier head small enough for one cluster of blocks
/// (`kiln_tensor::cuda::kernels::products::linear_xent_fits`: a small batch), its fused mean cross-entropy and the head's
/// backward become one `Op::LinearCrossEntropyMean`: the head's product, the loss, the weight and bias gradients
/// (`g^T h` with `sum(g)`) and h's gradient (`g w`, through a ReLU or not) in one launch. The
/// gradients' readers read them inside the new node's output.
pub fn fuse_linear_cross_entropy(g: &Graph, clusters: bool) -> Graph {
    let mut out = g.clone();
    if !clusters {
        return out;
    }
    let users = g.users();
    let (pinned, escapes) = pinned_and_escaping(g);
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    for ce in 0..g.nodes.len() {
        let Some(head) = linear_head(g, &users, (&escapes, &pinned), ce) else { continue };
        let Kind::Op(Op::CrossEntropyMean { ignore_index, smoothing }, _) = out.nodes[ce].kind else { continue };
        let (n, c, f) = (head.args[0].layout.shape[0], head.args[1].layout.shape[0], head.args[0].layout.shape[1]);
        let (dw_at, _, dh_at, len) = kiln_tensor::op::linear_xent_parts(n, c, f);
        let op = Op::LinearCrossEntropyMean { ignore_index, smoothing, drelu: head.drelu };
        out.nodes[ce].kind = Kind::Op(op, head.args);
        out.nodes[ce].shape = vec![len];
        (alias[head.dw], alias[head.dh]) = (Some((ce, dw_at)), Some((ce, dh_at)));
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// The head `fuse_linear_cross_entropy` replaces at `CrossEntropyMean` node `ce`: its logits a
/// product with a bias read by nothing else, its gradient read only by the two products
/// autograd records for the head (and its loss by anything).
fn linear_head(g: &Graph, users: &[Vec<NodeId>], (escapes, pinned): (&[bool], &[bool]), ce: NodeId) -> Option<Head> {
    let op = |i: NodeId| match &g.nodes[i].kind {
        Kind::Op(op, args) => Some((op, args.as_slice())),
        _ => None,
    };
    let (Op::CrossEntropyMean { .. }, [x, t]) = op(ce)? else { return None };
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
    let at = kiln_tensor::op::XENT_GRAD_AT;
    let grad = kiln_tensor::Layout { shape: vec![n, c], strides: vec![c, 1], offset: at };
    let grad_t = kiln_tensor::Layout { shape: vec![c, n], strides: vec![1, c], offset: at };
    let of_grad = |a: &Arg, l: &kiln_tensor::Layout| a.node == ce && a.layout == *l;
    let (mut dw, mut dh) = (None, None);
    for &u in &users[ce] {
        match op(u)? {
            (Op::MatmulFused(MatmulEpilogue::SumLeft), [a, b]) if of_grad(a, &grad_t) && b == h => dw = Some(u),
            (Op::MatmulFused(MatmulEpilogue::DRelu), [a, b, r]) if of_grad(a, &grad) && *b == w && r == h => dh = Some((u, true)),
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

/// Whether a product of two 2-D operands is one the CUDA back end's thin-product kernel takes
/// (`kiln_tensor::cuda::kernels::products::thin_takes`).
fn thin_product(margs: &[Arg], dtype: DType) -> bool {
    let [a, b] = margs else { return false };
    let (la, lb) = (&a.layout, &b.layout);
    la.shape.len() == 2
        && lb.shape.len() == 2
        && kiln_tensor::cuda::kernels::products::thin_takes(dtype, la.shape[1], lb.strides[1] == 1 || lb.shape[1] == 1)
}

/// What a graph is optimised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Cpu,
    /// A CUDA GPU; `clusters`: it runs thread block clusters (Hopper on), which the fused
    /// classifier head's kernel needs to spread over several SMs.
    Gpu {
        clusters: bool,
    },
}

/// The pipeline, in order; `log` sees the graph after each pass.
pub fn optimise(g: Graph, target: Target, mut log: impl FnMut(&str, &Graph)) -> Graph {
    let gpu = target != Target::Cpu;
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
    // (Before `fuse_matmuls`, which would otherwise take the bias sums into the products.)
    g = fold_residual_into_ln_grads(&g, gpu);
    log("fold_residual_into_ln_grads", &g);
    g = ln_bias_sums(&g, gpu);
    log("ln_bias_sums", &g);
    g = ln_dx_copies(&g, gpu);
    log("ln_dx_copies", &g);
    g = fuse_gated_sums(&g, gpu);
    log("fuse_gated_sums", &g);
    g = fuse_matmuls(&g, gpu);
    log("fuse_matmuls", &g);
    g = fuse_mean_cross_entropy(&g, gpu);
    log("fuse_mean_cross_entropy", &g);
    g = fuse_linear_cross_entropy(&g, target == Target::Gpu { clusters: true });
    log("fuse_linear_cross_entropy", &g);
    g = attention_heads_last(&g, gpu);
    log("attention_heads_last", &g);
    g = fold_layer_norm_casts(&g, gpu);
    log("fold_layer_norm_casts", &g);
    g = pad_unaligned_products(&g, gpu);
    log("pad_unaligned_products", &g);
    g = read_dense_copies_in_place(&g);
    log("read_dense_copies_in_place", &g);
    g
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

/// On a GPU, autocast's casts beside an F32 layer norm go into its kernels: a layer norm read
/// only by a cast of all of it to F16/BF16 (before a product) writes that dtype itself
/// (`Normalize`'s `to`: the cast node becomes the layer norm), and a layer norm's backward
/// (`NormalizeParamGrads`) whose gradient was cast to F32 only for it reads the gradient in
/// the dtype the product left it in. Each saves a kernel and a round trip of an F32 copy.
pub fn fold_layer_norm_casts(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
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
                let Kind::Op(Op::Normalize { eps, to: None }, nargs) = &g.nodes[a].kind else { continue };
                let stable = nargs.iter().all(|x| !bases.contains(&x.node));
                if alone(a) && stable && whole(&args[0], &g.nodes[a]) && g.nodes[a].dtype == DType::F32 {
                    out.nodes[i].kind = Kind::Op(Op::Normalize { eps: *eps, to: Some(*to) }, nargs.clone());
                }
            }
            Op::NormalizeParamGrads { .. } => {
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
/// gradient, `r + dx` with dx read from `NormalizeParamGrads`'s flat output, is added by that
/// kernel as it stores dx (its fourth input `r`): the sum's readers read the flat output
/// instead. That saves writing dx and reading it back (GPT: 25 MB twice a layer norm).
/// Conditions: nothing else reads dx, r (x's shape and dtype, no broadcast) exists before
/// the layer norm's backward and is never written in place, and the sum is no state buffer.
pub fn fold_residual_into_ln_grads(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
    let (pinned, _) = pinned_and_escaping(g);
    let bases = view_bases(g);
    // Every read of each node's region from `ln_grads_dx_at` on (a layer norm's dx).
    let at = |p: NodeId| match &g.nodes[p].kind {
        Kind::Op(Op::NormalizeParamGrads { sums, .. }, a) if a.len() == 3 => {
            a[0].layout.shape.last().map(|&n| kiln_tensor::op::ln_grads_dx_at(n, sums.is_some()))
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
            if ok {
                out.nodes[p].kind = Kind::Op(op.clone(), [&pargs[..], std::slice::from_ref(r)].concat());
                alias[i] = Some((p, from));
                break;
            }
        }
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// On a GPU, the bias gradient of a product fed by a layer norm's input gradient (the sum over
/// rows of dx, with the residual gradient folded in, or of autocast's 16-bit copy of it) is
/// summed by the layer norm's backward as it stores dx (`NormalizeParamGrads`'s `sums` row,
/// the values rounded to the copy's dtype first): the sum becomes a cast of that row, and no
/// column sums read the copy again (GPT: the `proj` and `fc2` biases, 12.6 MB each in BF16).
/// Readers of dx move with it to `ln_grads_dx_at(n, true)`. It shortens GPT BF16's step
/// (BENCHMARKS.md).
pub fn ln_bias_sums(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
    let (pinned, _) = pinned_and_escaping(g);
    let bases = view_bases(g);
    let dx_from = |l: NodeId| match &g.nodes[l].kind {
        Kind::Op(Op::NormalizeParamGrads { sums: None, .. }, a) if a.len() >= 3 => {
            a[0].layout.shape.last().map(|&n| (n, kiln_tensor::op::ln_grads_dx_at(n, false)))
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
        let Kind::Op(Op::NormalizeParamGrads { eps, .. }, largs) = &g.nodes[l].kind else { continue };
        let to = kiln_tensor::op::ln_grads_dx_at(n, true);
        out.nodes[l].kind = Kind::Op(Op::NormalizeParamGrads { eps: *eps, sums: Some(t), copy: None }, largs.clone());
        out.nodes[l].shape = vec![to + a.layout.numel()];
        moved[l] = Some((from, to - from));
        casts.push((i, t, Arg { node: l, layout: Layout { offset: 2 * n, ..Layout::contiguous(&node.shape) } }));
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
pub fn ln_dx_copies(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
    for (i, alone) in unpinned(g).into_iter().enumerate() {
        let Some((l, t)) = dx_copy_source(g, i).filter(|_| alone) else { continue };
        if let Kind::Op(Op::NormalizeParamGrads { copy: copy @ None, .. }, _) = &mut out.nodes[l].kind {
            *copy = Some(t);
        }
    }
    out
}

/// Per node: neither a state buffer's value nor a base written into in place.
fn unpinned(g: &Graph) -> Vec<bool> {
    let (pinned, _) = pinned_and_escaping(g);
    pinned.iter().map(|p| !p).collect()
}

/// The layer norm's backward whose whole dx (plus r) node `i` casts to 16 bits, and that
/// dtype.
fn dx_copy_source(g: &Graph, i: NodeId) -> Option<(NodeId, DType)> {
    let Kind::Op(Op::Cast(t @ (DType::BF16 | DType::F16)), args) = &g.nodes[i].kind else { return None };
    let a = &args[0];
    let l = &g.nodes[a.node];
    let Kind::Op(Op::NormalizeParamGrads { sums, .. }, largs) = &l.kind else { return None };
    let x = &largs[0].layout;
    let n = *x.shape.last()?;
    let ok = largs.len() >= 3
        && a.layout.is_contiguous()
        && a.layout.offset == kiln_tensor::op::ln_grads_dx_at(n, sums.is_some())
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
        if matches!(g.nodes[l].kind, Kind::Op(Op::NormalizeParamGrads { copy: Some(c), .. }, _) if c == t) && copies[l].is_none() {
            copies[l] = Some(i);
        }
    }
    copies
}

/// On a GPU, an activation's backward `y = a * gate(h)` (GELU's or SiLU's gradient) whose
/// sums over the rows are taken (the bias gradient of the product y feeds) becomes one
/// `Op::GatedSums`: the column-sum kernel makes y as it sums it, so that y is not read again
/// (GPT's `fc1` under autocast: 50 MB a layer). The sum's readers read the op's tail, y's
/// its head. (cuBLASLt's DGELU epilogue keeps the tanh form's gradient, and the thin product
/// ReLU's.) It shortens GPT BF16's step (BENCHMARKS.md).
pub fn fuse_gated_sums(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
    let uses = readers(g);
    let (pinned, _) = pinned_and_escaping(g);
    let bases = view_bases(g);
    let mut alias: Vec<Option<(NodeId, usize)>> = vec![None; g.nodes.len()];
    let mut taken = vec![false; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let Kind::Op(Op::Reduce { op: ReduceOp::Sum, dims, .. }, args) = &node.kind else { continue };
        let (s, y) = (&args[0], args[0].node);
        let Kind::Op(Op::Binary(BinaryOp::Mul), margs) = &g.nodes[y].kind else { continue };
        // The gate's side of the product, read whole, and the other side a.
        let gated = |m: &Arg| match &g.nodes[m.node].kind {
            Kind::Op(Op::Unary(u @ (UnaryOp::GeluGrad | UnaryOp::SiluGrad)), h) if whole(m, &g.nodes[m.node]) && uses[m.node] == 1 => {
                Some((*u, h[0].clone()))
            }
            _ => None,
        };
        let Some((gate, h, a)) =
            gated(&margs[1]).map(|(u, h)| (u, h, &margs[0])).or_else(|| gated(&margs[0]).map(|(u, h)| (u, h, &margs[1])))
        else {
            continue;
        };
        let yn = &g.nodes[y];
        let rank = yn.shape.len();
        let free = |x: NodeId| !pinned[x] && !bases.contains(&x);
        let ok = !taken[y]
            && whole(s, yn)
            && rank >= 1
            && dims.iter().copied().eq(0..rank - 1)
            && node.numel() == yn.shape[rank - 1]
            && [node.dtype, g.nodes[a.node].dtype, g.nodes[h.node].dtype].iter().all(|&t| t == yn.dtype)
            && yn.dtype.is_float()
            && a.layout.shape == yn.shape
            && h.layout.shape == yn.shape
            && free(i)
            && free(y)
            && [a.node, h.node].iter().all(|x| !bases.contains(x));
        if !ok {
            continue;
        }
        let (numel, n) = (yn.numel(), yn.shape[rank - 1]);
        let tail = kiln_tensor::op::matmul_tail_offset(numel);
        out.nodes[y].kind = Kind::Op(Op::GatedSums { gate }, vec![a.clone(), h]);
        out.nodes[y].shape = vec![tail + n];
        alias[i] = Some((y, tail));
        taken[y] = true;
    }
    redirect(&mut out, &alias);
    dce(&out)
}

/// On a GPU, an attention output `[B, H, T, D]` copied with its heads moved after T (the
/// `contiguous` before an output projection) is written that way by the attention kernel
/// (`heads_last`): no copy. Its other readers, each reading it whole (the backward), read the
/// new buffer through the permutation; readers of the copy read the new buffer.
pub fn attention_heads_last(g: &Graph, gpu: bool) -> Graph {
    let mut out = g.clone();
    if !gpu {
        return out;
    }
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
        let Kind::Op(Op::Attention { scale, causal, heads_last: false }, qkv) = &g.nodes[a].kind else { continue };
        let &[b, h, t, d] = &g.nodes[a].shape[..] else { continue };
        // Swapping H and T either way: the copy's view of the old buffer, and the old
        // readers' view of the new one.
        const SWAP: [usize; 4] = [0, 2, 1, 3];
        let whole = Layout::contiguous(&g.nodes[a].shape);
        let others_whole = reads[a].iter().all(|&(r, l)| r == i || *l == whole);
        if args[0].layout != whole.permuted(&SWAP) || !others_whole || moved[a].is_some() || pinned[a] || pinned[i] {
            continue;
        }
        out.nodes[a].kind = Kind::Op(Op::Attention { scale: *scale, causal: *causal, heads_last: true }, qkv.clone());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::testing::{mean_loss, whole};

    type Cells = [std::sync::Arc<kiln_tensor::storage::StorageCell>];

    /// Runs `g` and `f` on the CPU over the same inputs: `outputs` outputs each, every value
    /// within `tol` (relative to 1 + |value|).
    fn same_values(g: Graph, f: Graph, cells: &Cells, outputs: usize, tol: f64) -> kiln_tensor::Result<()> {
        f.verify().map_err(|e| kiln_tensor::Error::Msg(format!("verifier: {e}\n{f}")))?;
        let run = |g: Graph| -> kiln_tensor::Result<Vec<Vec<f64>>> {
            let p = crate::exec::Program::new(g, vec![], &crate::CompileOptions::default(), kiln_tensor::Device::Cpu)?;
            p.run(cells, kiln_tensor::rng::GeneratorState { seed: 0, offset: 0 })?.iter().map(|t| t.to_vec_f64()).collect()
        };
        let (want, got) = (run(g)?, run(f)?);
        assert_eq!((want.len(), got.len()), (outputs, outputs));
        for (o, (w, v)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.len(), v.len(), "output {o}");
            let worst = w.iter().zip(v).map(|(a, b)| (a - b).abs() / (1.0 + a.abs())).fold(0.0, f64::max);
            assert!(worst <= tol, "output {o}: {worst}");
        }
        Ok(())
    }

    /// The op nodes of `g`, by name.
    fn ops(g: &Graph) -> Vec<&'static str> {
        g.nodes.iter().filter_map(|n| if let Kind::Op(op, _) = &n.kind { Some(op.name()) } else { None }).collect()
    }

    /// `(g @ w) * step(h)` with a contraction of `k`: the backward through a ReLU before a
    /// layer of `k` outputs.
    fn relu_backward(k: usize) -> Graph {
        let mut g = Graph::default();
        let d = g.push(Kind::Input(0), vec![6, k], DType::F32);
        let w = g.push(Kind::Input(1), vec![k, 5], DType::F32);
        let h = g.push(Kind::Input(2), vec![6, 5], DType::F32);
        let p = g.push(Kind::Op(Op::Matmul, vec![whole(&g, d), whole(&g, w)]), vec![6, 5], DType::F32);
        let s = g.push(Kind::Op(Op::Unary(UnaryOp::Step), vec![whole(&g, h)]), vec![6, 5], DType::F32);
        let m = g.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![whole(&g, p), whole(&g, s)]), vec![6, 5], DType::F32);
        g.outputs = vec![whole(&g, m)];
        g
    }

    #[test]
    fn a_relu_gradient_joins_a_thin_product_on_a_gpu_only() {
        let fused = fuse_matmuls(&relu_backward(10), true);
        assert_eq!(ops(&dce(&fused)), ["matmul_drelu"]);
        let Kind::Op(_, args) = &fused.nodes[3].kind else { panic!("node 3 is not an op") };
        assert_eq!(args.iter().map(|a| a.node).collect::<Vec<_>>(), [0, 1, 2]);
        // The CPU, and a contraction past the thin kernel's, keep the multiply.
        assert_eq!(ops(&dce(&fuse_matmuls(&relu_backward(10), false))), ["matmul", "step", "mul"]);
        assert_eq!(ops(&dce(&fuse_matmuls(&relu_backward(64), true))), ["matmul", "step", "mul"]);
    }

    /// `r + x @ w^T + b` where the product `[B, T, C]` is read as `[T, B, C]` (with `permute`)
    /// and the residual is `[T, B, C]`; with `twice`, the product is read again.
    fn residual_add(permute: bool, twice: bool) -> (Graph, NodeId) {
        let (bl, tl, c) = (3, 4, 8);
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![bl, tl, c], DType::F32);
        let w = g.push(Kind::Input(1), vec![c, c], DType::F32);
        let b = g.push(Kind::Input(2), vec![c], DType::F32);
        let r = g.push(Kind::Input(3), if permute { vec![tl, bl, c] } else { vec![bl, tl, c] }, DType::F32);
        let wt = Arg { node: w, layout: Layout { shape: vec![c, c], strides: vec![1, c], offset: 0 } };
        let p = g.push(Kind::Op(Op::Matmul, vec![whole(&g, x), wt, whole(&g, b)]), vec![bl, tl, c], DType::F32);
        let view = match permute {
            true => Arg { node: p, layout: Layout { shape: vec![tl, bl, c], strides: vec![c, tl * c, 1], offset: 0 } },
            false => whole(&g, p),
        };
        let shape = g.nodes[r].shape.clone();
        let sum = g.push(Kind::Op(Op::Binary(BinaryOp::Add), vec![whole(&g, r), view]), shape, DType::F32);
        g.outputs = vec![whole(&g, sum)];
        if twice {
            g.outputs.push(whole(&g, p));
        }
        (g, sum)
    }

    /// Autocast's residual connection: `r + to_f32(x @ w + to_bf16(b))` with x and w in BF16,
    /// b and r in F32; with `twice`, the widened product is read again.
    fn widened_residual_add(twice: bool) -> Graph {
        let (rows, c) = (12, 8);
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![rows, c], DType::BF16);
        let w = g.push(Kind::Input(1), vec![c, c], DType::BF16);
        let b32 = g.push(Kind::Input(2), vec![c], DType::F32);
        let r = g.push(Kind::Input(3), vec![rows, c], DType::F32);
        let b = g.push(Kind::Op(Op::Cast(DType::BF16), vec![whole(&g, b32)]), vec![c], DType::BF16);
        let p = g.push(Kind::Op(Op::Matmul, vec![whole(&g, x), whole(&g, w), whole(&g, b)]), vec![rows, c], DType::BF16);
        let wide = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, p)]), vec![rows, c], DType::F32);
        let sum = g.push(Kind::Op(Op::Binary(BinaryOp::Add), vec![whole(&g, wide), whole(&g, r)]), vec![rows, c], DType::F32);
        g.outputs = vec![whole(&g, sum)];
        if twice {
            g.outputs.push(whole(&g, wide));
        }
        g
    }

    #[test]
    fn a_widened_product_joins_its_f32_residual_on_a_gpu() {
        let f = dce(&fuse_matmuls(&widened_residual_add(false), true));
        assert_eq!(ops(&f), ["matmul_residual"], "{f}");
        let n = f.nodes.last().expect("a node");
        let Kind::Op(_, args) = &n.kind else { panic!("{f}") };
        // x, w, the F32 residual, the bias in F32 (its cast to BF16 dropped); the sum stays F32.
        assert_eq!((args.iter().map(|a| a.node).collect::<Vec<_>>(), n.dtype), (vec![0, 1, 3, 2], DType::F32));
        // The CPU, and a widened product read elsewhere too, keep the casts and the add.
        assert_eq!(ops(&dce(&fuse_matmuls(&widened_residual_add(false), false))), ["to_dtype", "matmul", "to_dtype", "add"]);
        assert_eq!(ops(&dce(&fuse_matmuls(&widened_residual_add(true), true))), ["to_dtype", "matmul", "to_dtype", "add"]);
    }

    /// A classifier head over 13 classes in BF16: the logits `h w^T` (widened to F32), the
    /// input gradient `g w` and the weight gradient `g^T h`, each an output.
    fn unaligned_head(rows: usize) -> Graph {
        let (c, k) = (13, 16);
        let mut g = Graph::default();
        let h = g.push(Kind::Input(0), vec![rows, k], DType::BF16);
        let w = g.push(Kind::Input(1), vec![c, k], DType::BF16);
        let gl = g.push(Kind::Input(2), vec![rows, c], DType::BF16);
        let wt = Arg { node: w, layout: Layout { shape: vec![k, c], strides: vec![1, k], offset: 0 } };
        let p = g.push(Kind::Op(Op::Matmul, vec![whole(&g, h), wt]), vec![rows, c], DType::BF16);
        let logits = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, p)]), vec![rows, c], DType::F32);
        let dh = g.push(Kind::Op(Op::Matmul, vec![whole(&g, gl), whole(&g, w)]), vec![rows, k], DType::BF16);
        let gt = Arg { node: gl, layout: Layout { shape: vec![c, rows], strides: vec![1, c], offset: 0 } };
        let dw = g.push(Kind::Op(Op::Matmul, vec![gt, whole(&g, h)]), vec![c, k], DType::BF16);
        g.outputs = vec![whole(&g, logits), whole(&g, dh), whole(&g, dw)];
        g
    }

    #[test]
    fn unaligned_16_bit_products_read_zero_padded_copies_on_a_gpu() -> kiln_tensor::Result<()> {
        use kiln_tensor::{Device, Distribution, Tensor};
        let g = unaligned_head(1024);
        let f = pad_unaligned_products(&g, true);
        assert_eq!(ops(&f), ["full", "cat", "full", "cat", "matmul", "to_dtype", "matmul", "matmul"], "{f}");
        let args = |i: usize| match &f.nodes[i].kind {
            Kind::Op(_, a) => a.iter().map(|a| (a.node, a.layout.shape.clone(), a.layout.strides.clone())).collect::<Vec<_>>(),
            _ => vec![],
        };
        // w padded to [16, 16] (read as w^T for the logits, whole for g w); g to [1024, 16].
        // Each copy right after what it pads: w (%1) as %3, g (%4) as %6.
        assert_eq!((&f.nodes[3].shape, &f.nodes[6].shape), (&vec![16, 16], &vec![1024, 16]));
        assert_eq!(args(7), [(0, vec![1024, 16], vec![16, 1]), (3, vec![16, 16], vec![1, 16])]);
        assert_eq!(f.nodes[7].shape, [1024, 16], "the logits' product has three zero columns");
        assert_eq!(args(8), [(7, vec![1024, 13], vec![16, 1])], "the cast reads the first 13 of each row");
        assert_eq!(args(9), [(6, vec![1024, 16], vec![16, 1]), (3, vec![16, 16], vec![16, 1])]);
        assert_eq!(args(10), [(6, vec![13, 1024], vec![1, 16]), (0, vec![1024, 16], vec![16, 1])]);
        // The same values as the unpadded graph (the padding adds zero terms only).
        let t = |shape: &[usize], seed: u64| {
            Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu)?.to_dtype(DType::BF16)
        };
        let ins = [t(&[1024, 16], 1)?, t(&[13, 16], 2)?, t(&[1024, 13], 3)?];
        let mut cells = ins.iter().map(crate::contiguous_cell).collect::<kiln_tensor::Result<Vec<_>>>()?;
        f.verify().map_err(|e| kiln_tensor::Error::Msg(format!("verifier: {e}")))?;
        let same = |g: Graph, f: Graph, cells: &Cells, outputs: usize| same_values(g, f, cells, outputs, 1e-2);
        same(g, f, &cells, 3)?;
        // A padded product read by another product: that one reads the padded rows as they lie.
        let mut q = unaligned_head(1024);
        let v = q.push(Kind::Input(3), vec![13, 8], DType::BF16);
        let p = Arg { node: 3, layout: Layout::contiguous(&[1024, 13]) };
        let pv = q.push(Kind::Op(Op::Matmul, vec![p, whole(&q, v)]), vec![1024, 8], DType::BF16);
        q.outputs.push(whole(&q, pv));
        let qf = pad_unaligned_products(&q, true);
        qf.verify().map_err(|e| kiln_tensor::Error::Msg(format!("verifier: {e}")))?;
        let Some(Kind::Op(_, pargs)) = qf.nodes.iter().find(|n| n.shape == [1024, 8]).map(|n| &n.kind) else { panic!("{qf}") };
        assert_eq!((&pargs[0].layout.shape[..], &pargs[0].layout.strides[..]), (&[1024, 13][..], &[16, 1][..]), "{qf}");
        cells.push(crate::contiguous_cell(&t(&[13, 8], 4)?)?);
        same(q, qf, &cells, 4)?;
        // Logits read as `[B, T, 13]` twice by one node: each argument widened once.
        let mut b = unaligned_head(1024);
        let l3 = Arg { node: 3, layout: Layout::contiguous(&[16, 64, 13]) };
        let sq = b.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![l3.clone(), l3]), vec![16, 64, 13], DType::BF16);
        b.outputs.push(whole(&b, sq));
        let bf = pad_unaligned_products(&b, true);
        let Some(Kind::Op(_, margs)) = bf.nodes.iter().find(|n| matches!(n.kind, Kind::Op(Op::Binary(_), _))).map(|n| &n.kind) else {
            panic!("{bf}")
        };
        assert!(margs.iter().all(|a| a.layout.strides == [1024, 16, 1]), "{bf}");
        same(b, bf, &cells[..3], 4)?;
        // Too few rows, the CPU, and a padded product read in a way that skips its rows: untouched.
        assert_eq!(ops(&pad_unaligned_products(&unaligned_head(512), true)), ["matmul", "to_dtype", "matmul", "matmul"]);
        assert_eq!(ops(&pad_unaligned_products(&unaligned_head(1024), false)), ["matmul", "to_dtype", "matmul", "matmul"]);
        let mut h = unaligned_head(1024);
        h.outputs.push(Arg { node: 3, layout: Layout::contiguous(&[1024, 13]) });
        let hf = pad_unaligned_products(&h, true);
        assert_eq!(ops(&hf).iter().filter(|&&o| o == "cat").count(), 2, "g and w still padded for the backward: {hf}");
        assert!(
            hf.nodes.iter().any(|n| matches!(n.kind, Kind::Op(Op::Matmul, _)) && n.shape == [1024, 13]),
            "the logits stay unpadded: {hf}"
        );
        Ok(())
    }

    #[test]
    fn a_residual_add_joins_its_product_on_a_gpu_through_a_permutation() {
        for permute in [false, true] {
            let (g, sum) = residual_add(permute, false);
            let f = dce(&fuse_matmuls(&g, true));
            assert_eq!(ops(&f), ["matmul_residual"], "{f}");
            let Kind::Op(_, args) = &f.nodes[sum - 1].kind else { panic!("{f}") };
            // x (read sequence-first when the sum is), w^T, the residual, the bias.
            assert_eq!(args.iter().map(|a| a.node).collect::<Vec<_>>(), [0, 1, 3, 2]);
            let want: (&[usize], &[usize]) = if permute { (&[4, 3, 8], &[8, 32, 1]) } else { (&[3, 4, 8], &[32, 8, 1]) };
            assert_eq!((&args[0].layout.shape[..], &args[0].layout.strides[..]), want);
            assert_eq!(&args[1].layout.strides[..], &[1, 8]);
            // The CPU, and a product read elsewhere too, keep the add.
            assert_eq!(ops(&dce(&fuse_matmuls(&g, false))), ["matmul", "add"]);
            assert_eq!(ops(&dce(&fuse_matmuls(&residual_add(permute, true).0, true))), ["matmul", "add"]);
        }
        // An operand written in place after the product keeps the add apart (the fused read
        // would come after the write).
        let (mut g, _) = residual_add(false, false);
        let value = g.push(Kind::Input(4), vec![4, 8], DType::F32);
        let at = Layout { shape: vec![4, 8], strides: vec![8, 1], offset: 0 };
        g.push(Kind::WriteView { base: 0, layout: at, value: whole(&g, value) }, vec![3, 4, 8], DType::F32);
        assert_eq!(ops(&fuse_matmuls(&g, true)), ["matmul", "add"]);
        // The rows and the batch swapped, and a view that moves the columns.
        let rows = Layout { shape: vec![4, 3, 8], strides: vec![8, 32, 1], offset: 0 };
        assert_eq!(read_permutation(&rows, &[3, 4, 8]), Some(vec![1, 0, 2]));
        let cols = Layout { shape: vec![3, 8, 4], strides: vec![32, 1, 8], offset: 0 };
        assert_eq!(read_permutation(&cols, &[3, 4, 8]), None);
        // A batched b keeps the rows in place.
        let (a, b) = (Layout::contiguous(&[3, 4, 8]), Layout::contiguous(&[3, 8, 8]));
        let ab = [Arg { node: 0, layout: a }, Arg { node: 1, layout: b }];
        assert!(permuted_operands(&ab, &[1, 0, 2]).is_none());
        let same = permuted_operands(&ab, &[0, 1, 2]).unwrap_or_default();
        assert_eq!(same, ab);
    }

    #[test]
    fn attention_copied_with_its_heads_after_t_writes_them_there_on_a_gpu() {
        let (b, h, t, d) = (2, 3, 5, 4);
        let mut g = Graph::default();
        let q = g.push(Kind::Input(0), vec![b, h, t, d], DType::F32);
        let op = Op::Attention { scale: 0.5, causal: true, heads_last: false };
        let a = g.push(Kind::Op(op, vec![whole(&g, q), whole(&g, q), whole(&g, q)]), vec![b, h, t, d], DType::F32);
        let moved = Arg { node: a, layout: Layout { shape: vec![b, t, h, d], strides: vec![h * t * d, d, t * d, 1], offset: 0 } };
        let c = g.push(Kind::Op(Op::Contiguous, vec![moved]), vec![b, t, h * d], DType::F32);
        let neg = g.push(Kind::Op(Op::Unary(UnaryOp::Neg), vec![whole(&g, a)]), vec![b, h, t, d], DType::F32);
        g.outputs = vec![whole(&g, c), whole(&g, neg)];
        assert_eq!(ops(&attention_heads_last(&g, false)), ["attention", "contiguous", "neg"]);
        let f = attention_heads_last(&g, true);
        assert_eq!(ops(&f), ["attention", "neg"], "{f}");
        assert!(matches!(f.nodes[1].kind, Kind::Op(Op::Attention { heads_last: true, .. }, _)));
        assert_eq!(f.nodes[1].shape, vec![b, t, h, d]);
        // The copy's reader reads the new buffer as it read the copy; the other reads it
        // through the permutation back to [B, H, T, D].
        assert_eq!((f.outputs[0].node, &f.outputs[0].layout.shape[..]), (1, &[b, t, h * d][..]));
        let Kind::Op(_, args) = &f.nodes[2].kind else { panic!("{f}") };
        assert_eq!((&args[0].layout.shape[..], &args[0].layout.strides[..]), (&[b, h, t, d][..], &[h * t * d, d, h * d, 1][..]));
    }

    #[test]
    fn autocast_casts_beside_a_layer_norm_fold_into_it_on_a_gpu() {
        let (r, n) = (6, 8);
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![r, n], DType::F32);
        let w = g.push(Kind::Input(1), vec![n], DType::F32);
        let gb = g.push(Kind::Input(2), vec![r, n], DType::BF16);
        let ln = Op::Normalize { eps: 1e-5, to: None };
        let y = g.push(Kind::Op(ln, vec![whole(&g, x), whole(&g, w), whole(&g, w)]), vec![r, n], DType::F32);
        let yb = g.push(Kind::Op(Op::Cast(DType::BF16), vec![whole(&g, y)]), vec![r, n], DType::BF16);
        let gf = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, gb)]), vec![r, n], DType::F32);
        let grads = Op::NormalizeParamGrads { eps: 1e-5, sums: None, copy: None };
        let len = kiln_tensor::op::ln_grads_dx_at(n, false) + r * n;
        let pg = g.push(Kind::Op(grads, vec![whole(&g, x), whole(&g, gf), whole(&g, w)]), vec![len], DType::F32);
        g.outputs = vec![whole(&g, yb), whole(&g, pg)];
        assert_eq!(ops(&fold_layer_norm_casts(&g, false)), ["normalize", "to_dtype", "to_dtype", "layer_norm_param_grads"]);
        let f = fold_layer_norm_casts(&g, true);
        assert_eq!(ops(&f), ["normalize", "layer_norm_param_grads"], "{f}");
        let Kind::Op(Op::Normalize { to: Some(DType::BF16), .. }, _) = &f.nodes[f.outputs[0].node].kind else { panic!("{f}") };
        assert_eq!(f.nodes[f.outputs[0].node].dtype, DType::BF16);
        let Kind::Op(_, args) = &f.nodes[f.outputs[1].node].kind else { panic!("{f}") };
        assert_eq!(f.nodes[args[1].node].dtype, DType::BF16, "the backward reads the BF16 gradient: {f}");
        // A layer norm read elsewhere too keeps its F32 output and the cast.
        let mut h = g.clone();
        let neg = h.push(Kind::Op(Op::Unary(UnaryOp::Neg), vec![whole(&h, y)]), vec![r, n], DType::F32);
        h.outputs.push(whole(&h, neg));
        assert_eq!(ops(&fold_layer_norm_casts(&h, true)), ["normalize", "to_dtype", "layer_norm_param_grads", "neg"]);
    }

    /// A layer norm's backward with a residual gradient, its dx + r read as a BF16 copy by
    /// the bias sum and the weight gradient of the product before it (GPT's proj under
    /// autocast), rows of 32: the flat output's dx starts at 64 without the sums row, 128 with.
    fn ln_then_bias(sum_dims: Vec<usize>, to: DType, n: usize) -> Graph {
        let (r, m) = (6, 8);
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![r, n], DType::F32);
        let w = g.push(Kind::Input(1), vec![n], DType::F32);
        let gy = g.push(Kind::Input(2), vec![r, n], DType::BF16);
        let res = g.push(Kind::Input(3), vec![r, n], DType::F32);
        let h = g.push(Kind::Input(4), vec![r, m], to);
        let at = kiln_tensor::op::ln_grads_dx_at(n, false);
        let grads = Op::NormalizeParamGrads { eps: 1e-5, sums: None, copy: None };
        let args = vec![whole(&g, x), whole(&g, gy), whole(&g, w), whole(&g, res)];
        let pg = g.push(Kind::Op(grads, args), vec![at + r * n], DType::F32);
        let dx = Arg { node: pg, layout: Layout { offset: at, ..Layout::contiguous(&[r, n]) } };
        let low = g.push(Kind::Op(Op::Cast(to), vec![dx.clone()]), vec![r, n], to);
        let shape: Vec<usize> = (0..2).filter(|d| !sum_dims.contains(d)).map(|d| [r, n][d]).collect();
        let sum = g.push(Kind::Op(Op::Reduce { op: ReduceOp::Sum, dims: sum_dims, keepdim: false }, vec![whole(&g, low)]), shape, to);
        let lt = Arg { node: low, layout: Layout { shape: vec![n, r], strides: vec![1, n], offset: 0 } };
        let wg = g.push(Kind::Op(Op::Matmul, vec![lt, whole(&g, h)]), vec![n, m], to);
        let params = Arg { node: pg, layout: Layout::contiguous(&[2, n]) };
        g.outputs = vec![whole(&g, sum), whole(&g, wg), dx, params];
        g
    }

    /// Random inputs for `ln_then_bias(_, BF16, 32)`: x, w, the output's BF16 gradient, r, h.
    fn ln_then_bias_inputs() -> kiln_tensor::Result<Vec<std::sync::Arc<kiln_tensor::storage::StorageCell>>> {
        use kiln_tensor::{Device, Distribution, Tensor};
        let t = |shape: &[usize], seed: u64, dtype: DType| {
            Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu)?.to_dtype(dtype)
        };
        let shapes: [(&[usize], DType); 5] =
            [(&[6, 32], DType::F32), (&[32], DType::F32), (&[6, 32], DType::BF16), (&[6, 32], DType::F32), (&[6, 8], DType::BF16)];
        shapes.iter().zip(1..).map(|(&(shape, dtype), seed)| crate::contiguous_cell(&t(shape, seed, dtype)?)).collect()
    }

    #[test]
    fn a_bias_gradient_of_a_layer_norms_dx_is_summed_by_its_backward_on_a_gpu() -> kiln_tensor::Result<()> {
        let g = ln_then_bias(vec![0], DType::BF16, 32);
        let f = ln_bias_sums(&g, true);
        assert_eq!(ops(&f), ["layer_norm_param_grads", "to_dtype", "to_dtype", "matmul"], "{f}");
        let Kind::Op(Op::NormalizeParamGrads { sums: Some(DType::BF16), .. }, _) = &f.nodes[5].kind else { panic!("{f}") };
        assert_eq!(f.nodes[5].shape, [128 + 6 * 32]);
        // The sum is a cast of the row after dw and db (at 64, where dx was); dx moved to 128.
        let Kind::Op(Op::Cast(DType::BF16), row) = &f.nodes[f.outputs[0].node].kind else { panic!("{f}") };
        assert_eq!((row[0].node, row[0].layout.offset, &row[0].layout.shape[..]), (5, 64, &[32][..]));
        let Kind::Op(Op::Cast(DType::BF16), copy) = &f.nodes[6].kind else { panic!("{f}") };
        assert_eq!((copy[0].layout.offset, f.outputs[2].layout.offset, f.outputs[3].layout.offset), (128, 128, 0));
        // The same values as the unfused graph on the CPU.
        let cells = ln_then_bias_inputs()?;
        same_values(g.clone(), f, &cells, 4, 1e-2)?;
        // Not on the CPU, nor a sum over dx's columns, nor one in a wider dtype than the
        // row's (F64 from F32).
        assert_eq!(ops(&ln_bias_sums(&g, false)), ops(&g));
        let shapes = |g: &Graph| g.nodes.iter().map(|n| n.shape.clone()).collect::<Vec<_>>();
        for h in [ln_then_bias(vec![1], DType::BF16, 32), ln_then_bias(vec![0], DType::F64, 32)] {
            assert_eq!(shapes(&ln_bias_sums(&h, true)), shapes(&h), "{h}");
        }
        // Rows of 24: a read into the padding between the parameter gradients (48) and dx
        // (64) leaves the layer norm alone.
        let mut p = ln_then_bias(vec![0], DType::BF16, 24);
        assert_eq!(ops(&ln_bias_sums(&p, true)), ["layer_norm_param_grads", "to_dtype", "to_dtype", "matmul"]);
        p.outputs.push(Arg { node: 5, layout: Layout { offset: 50, ..Layout::contiguous(&[1]) } });
        assert_eq!(shapes(&ln_bias_sums(&p, true)), shapes(&p));
        Ok(())
    }

    #[test]
    fn a_layer_norms_16_bit_copy_of_dx_is_written_by_its_backward_on_a_gpu() -> kiln_tensor::Result<()> {
        let g = ln_then_bias(vec![0], DType::BF16, 32);
        let f = ln_dx_copies(&g, true);
        assert_eq!(ops(&f), ops(&g), "no node added or removed: {f}");
        let Kind::Op(Op::NormalizeParamGrads { copy: Some(DType::BF16), .. }, _) = &f.nodes[5].kind else { panic!("{f}") };
        assert_eq!(dx_copies(&f)[5], Some(6), "the cast of dx is made with it");
        assert!(dx_copies(&g).iter().all(Option::is_none));
        // The executor makes the cast in the layer norm's step (the CPU casts after the op);
        // with the sums row too, x's gradient moved.
        let both = ln_dx_copies(&ln_bias_sums(&g, true), true);
        assert_eq!(dx_copies(&both)[5], Some(6), "{both}");
        let cells = ln_then_bias_inputs()?;
        same_values(g.clone(), f, &cells, 4, 0.0)?;
        same_values(g.clone(), both, &cells, 4, 1e-2)?;
        // Not on the CPU, nor a cast to F64 (only 16-bit copies).
        assert_eq!(ln_dx_copies(&g, false).nodes[5].kind, g.nodes[5].kind);
        let wide = ln_then_bias(vec![0], DType::F64, 32);
        assert_eq!(ln_dx_copies(&wide, true).nodes[5].kind, wide.nodes[5].kind);
        Ok(())
    }

    #[test]
    fn a_gelu_gradient_and_its_bias_sums_take_one_pass_on_a_gpu() -> kiln_tensor::Result<()> {
        use kiln_tensor::{Device, Distribution, Tensor};
        let (r, n, m) = (40, 24, 8);
        let build = |gate: UnaryOp| {
            let mut g = Graph::default();
            let a = g.push(Kind::Input(0), vec![r, n], DType::BF16);
            let h = g.push(Kind::Input(1), vec![r, n], DType::BF16);
            let x = g.push(Kind::Input(2), vec![r, m], DType::BF16);
            let u = g.push(Kind::Op(Op::Unary(gate), vec![whole(&g, h)]), vec![r, n], DType::BF16);
            let y = g.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![whole(&g, a), whole(&g, u)]), vec![r, n], DType::BF16);
            let sum = Op::Reduce { op: ReduceOp::Sum, dims: vec![0], keepdim: true };
            let s = g.push(Kind::Op(sum, vec![whole(&g, y)]), vec![1, n], DType::BF16);
            let yt = Arg { node: y, layout: Layout { shape: vec![n, r], strides: vec![1, n], offset: 0 } };
            let wg = g.push(Kind::Op(Op::Matmul, vec![yt, whole(&g, x)]), vec![n, m], DType::BF16);
            g.outputs = vec![whole(&g, s), whole(&g, wg), whole(&g, y)];
            g
        };
        let g = build(UnaryOp::GeluGrad);
        let f = fuse_gated_sums(&g, true);
        assert_eq!(ops(&f), ["gated_sums", "matmul"], "{f}");
        let tail = kiln_tensor::op::matmul_tail_offset(r * n);
        assert_eq!((f.nodes[3].shape.clone(), f.outputs[0].node, f.outputs[0].layout.offset), (vec![tail + n], 3, tail));
        assert_eq!((f.outputs[2].node, f.outputs[2].layout.offset), (3, 0));
        let t = |shape: &[usize], seed: u64| {
            Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu)?.to_dtype(DType::BF16)
        };
        let cells =
            [t(&[r, n], 1)?, t(&[r, n], 2)?, t(&[r, m], 3)?].iter().map(crate::contiguous_cell).collect::<kiln_tensor::Result<Vec<_>>>()?;
        same_values(g.clone(), f, &cells, 3, 1e-2)?;
        // Not on the CPU, nor the tanh form's gradient (cuBLASLt's DGELU epilogue takes it).
        assert_eq!(ops(&fuse_gated_sums(&g, false)), ops(&g));
        let tanh = build(UnaryOp::GeluTanhGrad);
        assert_eq!(ops(&fuse_gated_sums(&tanh, true)), ops(&tanh));
        Ok(())
    }

    #[test]
    fn a_residual_gradient_is_added_by_the_layer_norm_backward_on_a_gpu() {
        let (r, n) = (6, 8);
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![r, n], DType::F32);
        let w = g.push(Kind::Input(1), vec![n], DType::F32);
        let gy = g.push(Kind::Input(2), vec![r, n], DType::BF16);
        let res = g.push(Kind::Input(3), vec![r, n], DType::F32);
        let at = kiln_tensor::op::ln_grads_dx_at(n, false);
        let grads = Op::NormalizeParamGrads { eps: 1e-5, sums: None, copy: None };
        let pg = g.push(Kind::Op(grads, vec![whole(&g, x), whole(&g, gy), whole(&g, w)]), vec![at + r * n], DType::F32);
        let dx = Arg { node: pg, layout: Layout { offset: at, ..Layout::contiguous(&[r, n]) } };
        let params = Arg { node: pg, layout: Layout::contiguous(&[2, n]) };
        let sum = g.push(Kind::Op(Op::Binary(BinaryOp::Add), vec![whole(&g, res), dx.clone()]), vec![r, n], DType::F32);
        let low = g.push(Kind::Op(Op::Cast(DType::BF16), vec![whole(&g, sum)]), vec![r, n], DType::BF16);
        g.outputs = vec![whole(&g, sum), whole(&g, low), params];
        assert_eq!(ops(&fold_residual_into_ln_grads(&g, false)), ["layer_norm_param_grads", "add", "to_dtype"]);
        let f = fold_residual_into_ln_grads(&g, true);
        assert_eq!(ops(&f), ["layer_norm_param_grads", "to_dtype"], "{f}");
        let Kind::Op(_, args) = &f.nodes[f.outputs[2].node].kind else { panic!("{f}") };
        assert_eq!(args.iter().map(|a| a.node).collect::<Vec<_>>(), [x, gy, w, res], "r is the fourth input: {f}");
        // The sum's readers read dx's place in the flat output.
        let Kind::Op(_, cast) = &f.nodes[f.outputs[1].node].kind else { panic!("{f}") };
        assert_eq!((cast[0].node, cast[0].layout.offset), (f.outputs[2].node, at));
        assert_eq!((f.outputs[0].node, f.outputs[0].layout.offset, &f.outputs[0].layout.shape[..]), (f.outputs[2].node, at, &[r, n][..]));
        // dx read elsewhere too, or a broadcast residual: nothing folds.
        let mut h = g.clone();
        let neg = h.push(Kind::Op(Op::Unary(UnaryOp::Neg), vec![dx]), vec![r, n], DType::F32);
        h.outputs.push(whole(&h, neg));
        assert_eq!(ops(&fold_residual_into_ln_grads(&h, true)), ["layer_norm_param_grads", "add", "to_dtype", "neg"]);
        let mut b = g.clone();
        let row = b.push(Kind::Input(4), vec![n], DType::F32);
        let Kind::Op(_, args) = &mut b.nodes[sum].kind else { unreachable!() };
        args[0] = Arg { node: row, layout: Layout::contiguous(&[n]) };
        assert_eq!(ops(&fold_residual_into_ln_grads(&b, true)).len(), 3, "a broadcast row is not x's shape");
    }

    #[test]
    fn a_small_mean_cross_entropy_and_its_gradient_become_one_gpu_op() {
        let (g, _) = mean_loss();
        let f = fuse_mean_cross_entropy(&g, true);
        assert_eq!(ops(&f), ["cross_entropy_mean"]);
        let ce = f.nodes.iter().position(|n| matches!(n.kind, Kind::Op(..))).unwrap_or(usize::MAX);
        assert_eq!(f.nodes[ce].shape, vec![64 + 12]);
        assert!(matches!(f.nodes[ce].kind, Kind::Op(Op::CrossEntropyMean { ignore_index: Some(-100), .. }, _)));
        // The loss reads element 0, the gradient the 4 x 3 values from element 64.
        let outs: Vec<(NodeId, usize, &[usize])> = f.outputs.iter().map(|a| (a.node, a.layout.offset, &a.layout.shape[..])).collect();
        assert_eq!(outs, vec![(ce, 0, &[][..]), (ce, 64, &[4, 3][..])]);
        // The CPU keeps the chain (its kernels fold nothing in one block).
        assert_eq!(fuse_mean_cross_entropy(&g, false).nodes.len(), g.nodes.len());
    }

    /// A classifier head after `fuse_mean_cross_entropy` as autograd records it: logits
    /// `h w^T + b`, the fused loss, `g^T h` with `sum(g)` and `(g w) * step(h)`. Returns the
    /// graph and the loss, weight-gradient and input-gradient nodes.
    fn classifier_head(n: usize) -> (Graph, [NodeId; 3]) {
        use kiln_tensor::{op::XENT_GRAD_AT, Layout};
        let (c, f) = (3, 6);
        let mut g = Graph::default();
        let h = g.push(Kind::Input(0), vec![n, f], DType::F32);
        let w = g.push(Kind::Input(1), vec![c, f], DType::F32);
        let b = g.push(Kind::Input(2), vec![c], DType::F32);
        let t = g.push(Kind::Input(3), vec![n], DType::I64);
        let wt = Arg { node: w, layout: Layout { shape: vec![f, c], strides: vec![1, f], offset: 0 } };
        let p = g.push(Kind::Op(Op::Matmul, vec![whole(&g, h), wt, whole(&g, b)]), vec![n, c], DType::F32);
        let xent = Op::CrossEntropyMean { ignore_index: Some(-100), smoothing: 0.0 };
        let ce = g.push(Kind::Op(xent, vec![whole(&g, p), whole(&g, t)]), vec![XENT_GRAD_AT + n * c], DType::F32);
        let grad = |shape: Vec<usize>, strides: Vec<usize>| Arg { node: ce, layout: Layout { shape, strides, offset: XENT_GRAD_AT } };
        let sums = Op::MatmulFused(MatmulEpilogue::SumLeft);
        let dw = g.push(Kind::Op(sums, vec![grad(vec![c, n], vec![1, c]), whole(&g, h)]), vec![64 + c], DType::F32);
        let drelu = Op::MatmulFused(MatmulEpilogue::DRelu);
        let dh = g.push(Kind::Op(drelu, vec![grad(vec![n, c], vec![c, 1]), whole(&g, w), whole(&g, h)]), vec![n, f], DType::F32);
        let loss = Arg { node: ce, layout: Layout { shape: vec![], strides: vec![], offset: 0 } };
        g.outputs = vec![loss, whole(&g, dw), whole(&g, dh)];
        (g, [ce, dw, dh])
    }

    #[test]
    fn a_small_classifier_head_its_loss_and_its_backward_become_one_gpu_op() {
        let (g, [ce, _, _]) = classifier_head(4);
        let f = fuse_linear_cross_entropy(&g, true);
        assert_eq!(ops(&f), ["linear_cross_entropy_mean"]);
        let fused = f.nodes.iter().position(|n| matches!(n.kind, Kind::Op(..))).unwrap_or(usize::MAX);
        let Kind::Op(Op::LinearCrossEntropyMean { drelu: true, .. }, args) = &f.nodes[fused].kind else { panic!("{f}") };
        // h, the weight read as [C, F], the bias, the targets.
        assert_eq!(args.iter().map(|a| a.node).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!((&args[1].layout.shape[..], &args[1].layout.strides[..]), (&[3, 6][..], &[6, 1][..]));
        // The loss at 0, the weight gradient (and its sums) from 64, h's gradient after them.
        let (dw, _, dh, len) = kiln_tensor::op::linear_xent_parts(4, 3, 6);
        assert_eq!(f.nodes[fused].shape, vec![len]);
        let outs: Vec<(NodeId, usize)> = f.outputs.iter().map(|a| (a.node, a.layout.offset)).collect();
        assert_eq!(outs, vec![(fused, 0), (fused, dw), (fused, dh)]);
        // The CPU (and a GPU without clusters) keeps the products; so does a GPU when the
        // logits are read elsewhere.
        assert_eq!(fuse_linear_cross_entropy(&g, false).nodes.len(), g.nodes.len());
        let (mut g, _) = classifier_head(4);
        g.outputs.push(whole(&g, 4));
        assert!(!ops(&fuse_linear_cross_entropy(&g, true)).contains(&"linear_cross_entropy_mean"));
        // Or when the gradient is returned too.
        let (mut g, _) = classifier_head(4);
        let grad = Arg { node: ce, layout: kiln_tensor::Layout { shape: vec![4, 3], strides: vec![3, 1], offset: 64 } };
        g.outputs.push(grad);
        assert!(!ops(&fuse_linear_cross_entropy(&g, true)).contains(&"linear_cross_entropy_mean"));
        // A batch past the kernel's limits stays unfused.
        let (g, _) = classifier_head(4096);
        assert!(!ops(&fuse_linear_cross_entropy(&g, true)).contains(&"linear_cross_entropy_mean"));
    }

    #[test]
    fn a_mean_cross_entropy_whose_parts_are_read_elsewhere_stays_unfused() {
        // The count (the number of real targets) returned as well.
        let (mut g, [total, _, _, count, _, _]) = mean_loss();
        g.outputs.push(whole(&g, count));
        assert!(!ops(&fuse_mean_cross_entropy(&g, true)).contains(&"cross_entropy_mean"));
        // The rows' losses read by another op (the sum of the losses returned).
        let (mut g, _) = mean_loss();
        g.outputs.push(whole(&g, total));
        assert!(!ops(&fuse_mean_cross_entropy(&g, true)).contains(&"cross_entropy_mean"));
        // Rows over 1024 classes (the kernel's warp per row would crawl).
        let (mut g, _) = mean_loss();
        g.nodes[0].shape = vec![4, 2000];
        for n in &mut g.nodes {
            if let Kind::Op(_, args) = &mut n.kind {
                args.iter_mut().filter(|a| a.node == 0).for_each(|a| a.layout = kiln_tensor::Layout::contiguous(&[4, 2000]));
            }
        }
        assert!(!ops(&fuse_mean_cross_entropy(&g, true)).contains(&"cross_entropy_mean"));
    }

    #[test]
    fn copies_of_dense_ranges_are_read_in_place() -> kiln_tensor::Result<()> {
        use kiln_tensor::{Device, Distribution, Tensor};
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![4, 6], DType::F32);
        let y = g.push(Kind::Op(Op::Unary(UnaryOp::Exp), vec![whole(&g, x)]), vec![4, 6], DType::F32);
        let range = |node: NodeId, len: usize, offset: usize| Arg { node, layout: Layout { shape: vec![len], strides: vec![1], offset } };
        // Rows 1..3 of y, then the last 6 of those: a chain of copies.
        let c = g.push(Kind::Op(Op::Contiguous, vec![range(y, 12, 6)]), vec![12], DType::F32);
        let d = g.push(Kind::Op(Op::Contiguous, vec![range(c, 6, 6)]), vec![6], DType::F32);
        let e = g.push(Kind::Op(Op::Scalar { op: BinaryOp::Mul, value: 3.0, scalar_lhs: false }, vec![whole(&g, d)]), vec![6], DType::F32);
        // A transposing copy and a returned copy stay.
        let t = Arg { node: y, layout: Layout { shape: vec![6, 4], strides: vec![1, 6], offset: 0 } };
        let transposed = g.push(Kind::Op(Op::Contiguous, vec![t]), vec![6, 4], DType::F32);
        let kept = g.push(Kind::Op(Op::Contiguous, vec![range(y, 6, 0)]), vec![6], DType::F32);
        g.outputs = vec![whole(&g, e), whole(&g, transposed), whole(&g, kept)];
        let f = read_dense_copies_in_place(&g);
        assert_eq!(ops(&f), ["exp", "mul", "contiguous", "contiguous"]);
        let Kind::Op(_, args) = &f.nodes[2].kind else { panic!("node 2 is not an op") };
        assert_eq!((args[0].node, args[0].layout.offset), (1, 12));
        let cells = [crate::contiguous_cell(&Tensor::rand_at(&[4, 6], Distribution::Normal, 5, 0, DType::F32, Device::Cpu)?)?];
        same_values(g, f, &cells, 3, 0.0)
    }
}
