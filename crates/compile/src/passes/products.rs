//! The rules on matrix products: epilogues taken into the product (bias, activation,
//! residual, column sums), unaligned 16-bit operands padded, gated sums fused.

use super::attention::{permuted_operands, read_permutation};
use super::edit::{each_arg_of, pinned_and_escaping, readers, redirect, remap, view_bases, whole};
use super::generic::dce;
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::op::{Part, Parts};
use kiln_tensor::{BinaryOp, DType, Fused, Layout, MatmulEpilogue, Op, ReduceOp, UnaryOp};
use std::collections::HashMap;

/// Collapses dims `(size, stride)` (outer first) into one, if they walk one arithmetic
/// sequence; size-1 dims are skipped. None: not one dim.
pub(super) fn collapse(dims: impl Iterator<Item = (usize, usize)>) -> Option<(usize, usize)> {
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
pub(super) fn sums_operand(sum: &Arg, dims: &[usize], op: &kiln_tensor::Layout, over: usize) -> bool {
    let l = &sum.layout;
    let pick = |reduced: bool| collapse((0..l.rank()).filter(|d| dims.contains(d) == reduced).map(|d| (l.shape[d], l.strides[d])));
    let same = |x: Option<(usize, usize)>, d: usize| x.is_some_and(|(size, st)| size == op.shape[d] && (size <= 1 || st == op.strides[d]));
    op.rank() == 2 && l.offset == op.offset && same(pick(true), over) && same(pick(false), 1 - over)
}

/// Work folded into matmuls (`Fused::Matmul`, a cuBLASLt epilogue on CUDA):
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
    let scan = Scan::new(g, gpu);
    let n = g.nodes.len();
    let mut w = Rewrite { out: g.clone(), alias: vec![None; n], taken: vec![false; n] };
    for i in 0..n {
        let Kind::Op(op, args) = &w.out.nodes[i].kind else { continue };
        let (op, args) = (op.clone(), args.clone());
        match op {
            Op::Binary(BinaryOp::Add) if gpu && scan.free(i) => residual_epilogue(&scan, &mut w, i, &args),
            Op::Unary(u @ (UnaryOp::Relu | UnaryOp::GeluTanh)) => activation_epilogue(&scan, &mut w, i, u, &args[0]),
            Op::Binary(BinaryOp::Mul) => activation_grad_epilogue(&scan, &mut w, i, &args),
            // (A sum that is written into in place stays a buffer of its own.)
            Op::Reduce { op: ReduceOp::Sum, dims, .. } if scan.free(i) => sums_epilogue(&scan, &mut w, i, &args[0], &dims),
            _ => {}
        }
    }
    redirect(&mut w.out, &w.alias);
    dce(&w.out)
}

/// What `fuse_matmuls`' rules read about the graph as it was.
struct Scan {
    gpu: bool,
    /// Readers per node.
    uses: Vec<usize>,
    /// Nodes written in place.
    written: Vec<NodeId>,
    /// Nodes that views write into.
    bases: Vec<NodeId>,
    /// The first reader of each node (outputs and writes read after every node).
    first_reader: Vec<usize>,
}

impl Scan {
    fn new(g: &Graph, gpu: bool) -> Scan {
        let mut first_reader = vec![usize::MAX; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate().rev() {
            n.args().into_iter().for_each(|a| first_reader[a] = i);
        }
        Scan { gpu, uses: readers(g), written: g.writes.iter().map(|w| w.1).collect(), bases: view_bases(g), first_reader }
    }

    /// Neither written in place nor a base of written views.
    fn free(&self, i: NodeId) -> bool {
        !self.written.contains(&i) && !self.bases.contains(&i)
    }
}

/// `fuse_matmuls`' graph in the making.
struct Rewrite {
    out: Graph,
    /// alias[i] = (node, offset): readers of i read that node, `offset` elements further on.
    alias: Vec<Option<(NodeId, usize)>>,
    /// Products that a residual add took over (dead, left for `dce`).
    taken: Vec<bool>,
}

/// `r + a @ b (+ bias)` on a GPU (add node `i`): the add in the product's epilogue. The
/// product may be read with its dims permuted (a batch-first product added to a
/// sequence-first residual): its operands are then read through the same permutation.
fn residual_epilogue(s: &Scan, w: &mut Rewrite, i: NodeId, args: &[Arg]) {
    let out = &w.out;
    let residual = |x: &Arg, y: &Arg| -> Option<(NodeId, Vec<Arg>)> {
        let node = &out.nodes[i];
        // Through a widening cast, read whole and only here (autocast's 16-bit product added
        // to the F32 residual stream): the epilogue adds the product before it is rounded to
        // 16 bits. (It shortens GPT BF16's step; BENCHMARKS.md.)
        let p = match &out.nodes[x.node].kind {
            Kind::Op(Op::Cast(to), c) if *to == node.dtype && s.uses[x.node] == 1 && whole(&c[0], &out.nodes[c[0].node]) => {
                let from = out.nodes[c[0].node].dtype;
                let widens = matches!(from, DType::BF16 | DType::F16) && *to == DType::F32;
                if !(widens && s.free(x.node) && y.node != x.node) {
                    return None;
                }
                c[0].node
            }
            _ => x.node,
        };
        let Kind::Op(Op::Matmul, margs) = &out.nodes[p].kind else { return None };
        // (The product's operands are read at i now, later than at p: none may be a buffer
        // written in place in between.)
        let alone = s.uses[p] == 1 && s.free(p) && y.node != p;
        let stable = margs.iter().all(|a| !s.bases.contains(&a.node));
        let same =
            (p != x.node || out.nodes[p].dtype == node.dtype) && out.nodes[y.node].dtype == node.dtype && y.layout.shape == node.shape;
        let perm = read_permutation(&x.layout, &out.nodes[p].shape).filter(|_| alone && same && stable)?;
        let mut fused = permuted_operands(&margs[..2], &perm)?;
        fused.push(y.clone());
        // A widened product's bias cast from F32 is read in F32, the sum's dtype (cuBLASLt's
        // bias takes D's dtype outside FP8 and integer GEMMs).
        let bias = margs.get(2).map(|b| match &out.nodes[b.node].kind {
            Kind::Op(Op::Cast(_), bc)
                if p != x.node
                    && out.nodes[bc[0].node].dtype == node.dtype
                    && whole(b, &out.nodes[b.node])
                    && whole(&bc[0], &out.nodes[bc[0].node])
                    && !s.bases.contains(&bc[0].node) =>
            {
                bc[0].clone()
            }
            _ => b.clone(),
        });
        fused.extend(bias);
        Some((p, fused))
    };
    if let Some((p, fused)) = residual(&args[0], &args[1]).or_else(|| residual(&args[1], &args[0])) {
        w.out.nodes[i].kind = Kind::Op(Op::Fused(Fused::Matmul(MatmulEpilogue::Residual)), fused);
        w.taken[p] = true;
    }
}

/// An activation `u` (node `i`) of a product `x`: cuBLASLt applies it as the product is
/// stored. GELU's backward reads the pre-activation, which its epilogue stores after the
/// output.
fn activation_epilogue(s: &Scan, w: &mut Rewrite, i: NodeId, u: UnaryOp, x: &Arg) {
    let p = x.node;
    let pn = &w.out.nodes[p];
    let Kind::Op(Op::Matmul, margs) = &pn.kind else { return };
    let only = s.uses[p] == 1 || u == UnaryOp::GeluTanh;
    // (A base written into in place must keep its own shape.)
    let kept = !s.free(p) || s.bases.contains(&i);
    if !only || kept || !whole(x, pn) || pn.dtype != w.out.nodes[i].dtype {
        return;
    }
    let (margs, shape) = (margs.clone(), pn.shape.clone());
    if u == UnaryOp::Relu {
        w.out.nodes[p].kind = Kind::Op(Op::Fused(Fused::Matmul(MatmulEpilogue::Relu)), margs);
    } else {
        let parts = Parts::with_tail(&shape, &shape);
        let Ok(tail) = parts.offset(Part::Tail) else { return };
        w.out.nodes[p].kind = Kind::Op(Op::Fused(Fused::Matmul(MatmulEpilogue::GeluTanh)), margs);
        w.out.nodes[p].shape = vec![parts.len()];
        w.alias[p] = Some((p, tail));
    }
    w.alias[i] = Some((p, 0));
}

/// `(a @ b) * gelu_tanh_grad(h)` (node `i`): the gradient through a GELU (cuBLASLt's DGELU),
/// or `(a @ b) * step(h)`, through a ReLU.
fn activation_grad_epilogue(s: &Scan, w: &mut Rewrite, i: NodeId, args: &[Arg]) {
    let out = &w.out;
    let dgelu = |x: &Arg, y: &Arg| -> Option<(NodeId, Vec<Arg>, MatmulEpilogue)> {
        let (p, q) = (&out.nodes[x.node], &out.nodes[y.node]);
        let (Kind::Op(Op::Matmul, margs), Kind::Op(Op::Unary(u), h)) = (&p.kind, &q.kind) else {
            return None;
        };
        let epi = match u {
            UnaryOp::GeluTanhGrad => MatmulEpilogue::DGeluTanh,
            UnaryOp::Step if s.gpu && thin_product(margs, p.dtype) => MatmulEpilogue::DRelu,
            _ => return None,
        };
        let alone = |n: NodeId| s.uses[n] == 1 && s.free(n);
        let same = p.dtype == q.dtype && p.dtype == out.nodes[i].dtype && h[0].layout.shape == p.shape;
        let ok = margs.len() == 2 && alone(x.node) && alone(y.node) && whole(x, p) && whole(y, q) && same && h[0].node < x.node;
        ok.then(|| (x.node, vec![margs[0].clone(), margs[1].clone(), h[0].clone()], epi))
    };
    if let Some((p, margs, epi)) = dgelu(&args[0], &args[1]).or_else(|| dgelu(&args[1], &args[0])) {
        w.out.nodes[p].kind = Kind::Op(Op::Fused(Fused::Matmul(epi)), margs);
        w.alias[i] = Some((p, 0));
    }
}

/// The sum (node `i`) over `dims` of a 2-D product's operand `sum` along the contraction: the
/// product stores it after itself (cuBLASLt's BGRADA/BGRADB).
fn sums_epilogue(s: &Scan, w: &mut Rewrite, i: NodeId, sum: &Arg, dims: &[usize]) {
    let out = &w.out;
    let found = (0..out.nodes.len()).find_map(|p| {
        let Kind::Op(Op::Matmul, margs) = &out.nodes[p].kind else { return None };
        let ok =
            margs.len() == 2 && !w.taken[p] && !s.written.contains(&p) && s.first_reader[i] > p && out.nodes[p].dtype == out.nodes[i].dtype;
        let side = (0..2).find(|&side| ok && margs[side].node == sum.node && sums_operand(sum, dims, &margs[side].layout, 1 - side))?;
        Some((p, side, margs.clone()))
    });
    let Some((p, side, margs)) = found else { return };
    let (m, n) = (margs[0].layout.shape[0], margs[1].layout.shape[1]);
    let epi = if side == 0 { MatmulEpilogue::SumLeft } else { MatmulEpilogue::SumRight };
    let parts = Parts::with_tail(&[m, n], &[if side == 0 { m } else { n }]);
    let Ok(at) = parts.offset(Part::Tail) else { return };
    w.out.nodes[p].kind = Kind::Op(Op::Fused(Fused::Matmul(epi)), margs);
    w.out.nodes[p].shape = vec![parts.len()];
    w.alias[i] = Some((p, at));
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
pub fn pad_unaligned_products(g: &Graph) -> Graph {
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
pub(super) const PAD_MIN_ROWS: usize = 1024;

/// Appends `x` padded with zeros along `dim` to the next multiple of 8 (a zeros node, then a
/// cat of the two) and returns the cat.
pub(super) fn pad_node(g: &mut Graph, x: NodeId, dim: usize) -> NodeId {
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
pub(super) fn is_transposed_whole(a: &Arg, x: &crate::graph::Node) -> bool {
    let l = &a.layout;
    x.shape.len() == 2 && l.offset == 0 && l.shape == [x.shape[1], x.shape[0]] && l.strides == [1, x.shape[1]]
}

/// Whether node `x` is laid out as dense rows of `k` (its last dim).
pub(super) fn dense_node(x: &crate::graph::Node, k: usize) -> bool {
    x.shape.last() == Some(&k)
}

/// Whether a view reads whole rows of `k` contiguous elements from offset 0: its last dim is
/// `k` with stride 1 and every other stride a multiple of `k`.
pub(super) fn rows_of(l: &Layout, k: usize) -> bool {
    let r = l.rank();
    r >= 1 && l.offset == 0 && l.shape[r - 1] == k && (l.strides[r - 1] == 1 || k == 1) && l.strides[..r - 1].iter().all(|s| s % k == 0)
}

/// The same rows read from a copy whose rows are `k8` long instead of `k`.
pub(super) fn widen_rows(l: &Layout, k: usize, k8: usize) -> Layout {
    let r = l.rank();
    let strides = l.strides.iter().enumerate().map(|(d, &s)| if d + 1 == r { s } else { s / k * k8 }).collect();
    Layout { shape: l.shape.clone(), strides, offset: 0 }
}

/// Whether every argument of `reader` that reads node `p` reads whole rows of `n` (and
/// `reader` is an op, the only kind whose arguments can move to a padded product).
pub(super) fn reads_rows(reader: &crate::graph::Node, p: NodeId, n: usize) -> bool {
    match &reader.kind {
        Kind::Op(_, args) => args.iter().filter(|a| a.node == p).all(|a| rows_of(&a.layout, n)),
        _ => false,
    }
}

/// Whether a product of two 2-D operands is one the CUDA back end's thin-product kernel takes
/// (`kiln_tensor::cuda::kernels::products::thin_takes`).
pub(super) fn thin_product(margs: &[Arg], dtype: DType) -> bool {
    let [a, b] = margs else { return false };
    let (la, lb) = (&a.layout, &b.layout);
    la.shape.len() == 2
        && lb.shape.len() == 2
        && kiln_tensor::cuda::kernels::products::thin_takes(dtype, la.shape[1], lb.strides[1] == 1 || lb.shape[1] == 1)
}

/// On a GPU, an activation's backward `y = a * gate(h)` (GELU's or SiLU's gradient) whose
/// sums over the rows are taken (the bias gradient of the product y feeds) becomes one
/// `Fused::GatedSums`: the column-sum kernel makes y as it sums it, so that y is not read again
/// (GPT's `fc1` under autocast: 50 MB a layer). The sum's readers read the op's tail, y's
/// its head. (cuBLASLt's DGELU epilogue keeps the tanh form's gradient, and the thin product
/// ReLU's.) It shortens GPT BF16's step (BENCHMARKS.md).
pub fn fuse_gated_sums(g: &Graph) -> Graph {
    let mut out = g.clone();
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
        let parts = Parts::with_tail(&yn.shape, &[yn.shape[rank - 1]]);
        let Ok(tail) = parts.offset(Part::Tail) else { continue };
        out.nodes[y].kind = Kind::Op(Op::Fused(Fused::GatedSums { gate }), vec![a.clone(), h]);
        out.nodes[y].shape = vec![parts.len()];
        alias[i] = Some((y, tail));
        taken[y] = true;
    }
    redirect(&mut out, &alias);
    dce(&out)
}
