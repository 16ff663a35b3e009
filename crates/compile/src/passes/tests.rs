//! The passes on small graphs: what each rule rewrites (and leaves alone), and the same values
//! from the graph before and after.

use super::*;
use super::{attention::*, generic::*, layer_norm::*, loss::*, products::*};
use crate::graph::testing::{mean_loss, whole};
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::op::{Part, Parts};
use kiln_tensor::{BinaryOp, DType, Fused, Layout, MatmulEpilogue, Op, ReduceOp, UnaryOp};

type Cells = [std::sync::Arc<kiln_tensor::storage::StorageCell>];

/// Runs `g` and `f` on the CPU over the same inputs: `outputs` outputs each, every value
/// within `tol` (relative to 1 + |value|).
fn same_values(g: Graph, f: Graph, cells: &Cells, outputs: usize, tol: f64) -> kiln_tensor::Result<()> {
    f.verify().map_err(|e| kiln_tensor::Error::Msg(format!("verifier: {e}\n{f}")))?;
    let run = |g: Graph| -> kiln_tensor::Result<Vec<Vec<f64>>> {
        let p = crate::exec::Program::new(g, vec![], &crate::options::CompileOptions::default(), kiln_tensor::Device::Cpu, false)?;
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
    let f = pad_unaligned_products(&g);
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
    let t =
        |shape: &[usize], seed: u64| Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu)?.to_dtype(DType::BF16);
    let ins = [t(&[1024, 16], 1)?, t(&[13, 16], 2)?, t(&[1024, 13], 3)?];
    let mut cells = ins.iter().map(crate::exec::contiguous_cell).collect::<kiln_tensor::Result<Vec<_>>>()?;
    f.verify().map_err(|e| kiln_tensor::Error::Msg(format!("verifier: {e}")))?;
    let same = |g: Graph, f: Graph, cells: &Cells, outputs: usize| same_values(g, f, cells, outputs, 1e-2);
    same(g, f, &cells, 3)?;
    // A padded product read by another product: that one reads the padded rows as they lie.
    let mut q = unaligned_head(1024);
    let v = q.push(Kind::Input(3), vec![13, 8], DType::BF16);
    let p = Arg { node: 3, layout: Layout::contiguous(&[1024, 13]) };
    let pv = q.push(Kind::Op(Op::Matmul, vec![p, whole(&q, v)]), vec![1024, 8], DType::BF16);
    q.outputs.push(whole(&q, pv));
    let qf = pad_unaligned_products(&q);
    qf.verify().map_err(|e| kiln_tensor::Error::Msg(format!("verifier: {e}")))?;
    let Some(Kind::Op(_, pargs)) = qf.nodes.iter().find(|n| n.shape == [1024, 8]).map(|n| &n.kind) else { panic!("{qf}") };
    assert_eq!((&pargs[0].layout.shape[..], &pargs[0].layout.strides[..]), (&[1024, 13][..], &[16, 1][..]), "{qf}");
    cells.push(crate::exec::contiguous_cell(&t(&[13, 8], 4)?)?);
    same(q, qf, &cells, 4)?;
    // Logits read as `[B, T, 13]` twice by one node: each argument widened once.
    let mut b = unaligned_head(1024);
    let l3 = Arg { node: 3, layout: Layout::contiguous(&[16, 64, 13]) };
    let sq = b.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![l3.clone(), l3]), vec![16, 64, 13], DType::BF16);
    b.outputs.push(whole(&b, sq));
    let bf = pad_unaligned_products(&b);
    let Some(Kind::Op(_, margs)) = bf.nodes.iter().find(|n| matches!(n.kind, Kind::Op(Op::Binary(_), _))).map(|n| &n.kind) else {
        panic!("{bf}")
    };
    assert!(margs.iter().all(|a| a.layout.strides == [1024, 16, 1]), "{bf}");
    same(b, bf, &cells[..3], 4)?;
    // Too few rows, the CPU, and a padded product read in a way that skips its rows: untouched.
    assert_eq!(ops(&pad_unaligned_products(&unaligned_head(512))), ["matmul", "to_dtype", "matmul", "matmul"]);
    assert_eq!(ops(&pass("pad_unaligned_products", &unaligned_head(1024), Target::Cpu)), ["matmul", "to_dtype", "matmul", "matmul"]);
    let mut h = unaligned_head(1024);
    h.outputs.push(Arg { node: 3, layout: Layout::contiguous(&[1024, 13]) });
    let hf = pad_unaligned_products(&h);
    assert_eq!(ops(&hf).iter().filter(|&&o| o == "cat").count(), 2, "g and w still padded for the backward: {hf}");
    assert!(hf.nodes.iter().any(|n| matches!(n.kind, Kind::Op(Op::Matmul, _)) && n.shape == [1024, 13]), "the logits stay unpadded: {hf}");
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
    let op = Op::Attention { scale: 0.5, causal: true };
    let a = g.push(Kind::Op(op, vec![whole(&g, q), whole(&g, q), whole(&g, q)]), vec![b, h, t, d], DType::F32);
    let moved = Arg { node: a, layout: Layout { shape: vec![b, t, h, d], strides: vec![h * t * d, d, t * d, 1], offset: 0 } };
    let c = g.push(Kind::Op(Op::Contiguous, vec![moved]), vec![b, t, h * d], DType::F32);
    let neg = g.push(Kind::Op(Op::Unary(UnaryOp::Neg), vec![whole(&g, a)]), vec![b, h, t, d], DType::F32);
    g.outputs = vec![whole(&g, c), whole(&g, neg)];
    assert_eq!(ops(&pass("attention_heads_last", &g, Target::Cpu)), ["attention", "contiguous", "neg"]);
    let f = attention_heads_last(&g);
    assert_eq!(ops(&f), ["attention_heads_last", "neg"], "{f}");
    assert!(matches!(f.nodes[1].kind, Kind::Op(Op::Fused(Fused::AttentionHeadsLast { .. }), _)));
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
    let ln = Op::Normalize { eps: 1e-5, rms: false };
    let y = g.push(Kind::Op(ln, vec![whole(&g, x), whole(&g, w), whole(&g, w)]), vec![r, n], DType::F32);
    let yb = g.push(Kind::Op(Op::Cast(DType::BF16), vec![whole(&g, y)]), vec![r, n], DType::BF16);
    let gf = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, gb)]), vec![r, n], DType::F32);
    let grads = Op::LayerNormGrads { eps: 1e-5 };
    let len = Parts::layer_norm_grads(&[r, n], false).len();
    let pg = g.push(Kind::Op(grads, vec![whole(&g, x), whole(&g, gf), whole(&g, w)]), vec![len], DType::F32);
    g.outputs = vec![whole(&g, yb), whole(&g, pg)];
    assert_eq!(ops(&pass("fold_layer_norm_casts", &g, Target::Cpu)), ["normalize", "to_dtype", "to_dtype", "layer_norm_grads"]);
    let f = fold_layer_norm_casts(&g);
    assert_eq!(ops(&f), ["normalize_to", "layer_norm_grads"], "{f}");
    let Kind::Op(Op::Fused(Fused::NormalizeTo { to: DType::BF16, .. }), _) = &f.nodes[f.outputs[0].node].kind else { panic!("{f}") };
    assert_eq!(f.nodes[f.outputs[0].node].dtype, DType::BF16);
    let Kind::Op(_, args) = &f.nodes[f.outputs[1].node].kind else { panic!("{f}") };
    assert_eq!(f.nodes[args[1].node].dtype, DType::BF16, "the backward reads the BF16 gradient: {f}");
    // A layer norm read elsewhere too keeps its F32 output and the cast.
    let mut h = g.clone();
    let neg = h.push(Kind::Op(Op::Unary(UnaryOp::Neg), vec![whole(&h, y)]), vec![r, n], DType::F32);
    h.outputs.push(whole(&h, neg));
    assert_eq!(ops(&fold_layer_norm_casts(&h)), ["normalize", "to_dtype", "layer_norm_grads", "neg"]);
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
    let at = Parts::layer_norm_grads(&[r, n], false).offset(Part::Dx).unwrap();
    let grads = Op::Fused(Fused::LayerNormGrads { eps: 1e-5, sums: None, copy: None });
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
    shapes.iter().zip(1..).map(|(&(shape, dtype), seed)| crate::exec::contiguous_cell(&t(shape, seed, dtype)?)).collect()
}

#[test]
fn a_bias_gradient_of_a_layer_norms_dx_is_summed_by_its_backward_on_a_gpu() -> kiln_tensor::Result<()> {
    let g = ln_then_bias(vec![0], DType::BF16, 32);
    let f = ln_bias_sums(&g);
    assert_eq!(ops(&f), ["layer_norm_grads_fused", "to_dtype", "to_dtype", "matmul"], "{f}");
    let Kind::Op(Op::Fused(Fused::LayerNormGrads { sums: Some(DType::BF16), .. }), _) = &f.nodes[5].kind else { panic!("{f}") };
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
    assert_eq!(ops(&pass("ln_bias_sums", &g, Target::Cpu)), ops(&g));
    let shapes = |g: &Graph| g.nodes.iter().map(|n| n.shape.clone()).collect::<Vec<_>>();
    for h in [ln_then_bias(vec![1], DType::BF16, 32), ln_then_bias(vec![0], DType::F64, 32)] {
        assert_eq!(shapes(&ln_bias_sums(&h)), shapes(&h), "{h}");
    }
    // Rows of 24: a read into the padding between the parameter gradients (48) and dx
    // (64) leaves the layer norm alone.
    let mut p = ln_then_bias(vec![0], DType::BF16, 24);
    assert_eq!(ops(&ln_bias_sums(&p)), ["layer_norm_grads_fused", "to_dtype", "to_dtype", "matmul"]);
    p.outputs.push(Arg { node: 5, layout: Layout { offset: 50, ..Layout::contiguous(&[1]) } });
    assert_eq!(shapes(&ln_bias_sums(&p)), shapes(&p));
    Ok(())
}

#[test]
fn a_layer_norms_16_bit_copy_of_dx_is_written_by_its_backward_on_a_gpu() -> kiln_tensor::Result<()> {
    let g = ln_then_bias(vec![0], DType::BF16, 32);
    let f = ln_dx_copies(&g);
    assert_eq!(ops(&f), ops(&g), "no node added or removed: {f}");
    let Kind::Op(Op::Fused(Fused::LayerNormGrads { copy: Some(DType::BF16), .. }), _) = &f.nodes[5].kind else { panic!("{f}") };
    assert_eq!(dx_copies(&f)[5], Some(6), "the cast of dx is made with it");
    assert!(dx_copies(&g).iter().all(Option::is_none));
    // The executor makes the cast in the layer norm's step (the CPU casts after the op);
    // with the sums row too, x's gradient moved.
    let both = ln_dx_copies(&ln_bias_sums(&g));
    assert_eq!(dx_copies(&both)[5], Some(6), "{both}");
    let cells = ln_then_bias_inputs()?;
    same_values(g.clone(), f, &cells, 4, 0.0)?;
    same_values(g.clone(), both, &cells, 4, 1e-2)?;
    // Not on the CPU, nor a cast to F64 (only 16-bit copies).
    assert_eq!(pass("ln_dx_copies", &g, Target::Cpu).nodes[5].kind, g.nodes[5].kind);
    let wide = ln_then_bias(vec![0], DType::F64, 32);
    assert_eq!(ln_dx_copies(&wide).nodes[5].kind, wide.nodes[5].kind);
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
    let f = fuse_gated_sums(&g);
    assert_eq!(ops(&f), ["gated_sums", "matmul"], "{f}");
    let tail = Parts::with_tail(&[r, n], &[n]).offset(Part::Tail).unwrap();
    assert_eq!((f.nodes[3].shape.clone(), f.outputs[0].node, f.outputs[0].layout.offset), (vec![tail + n], 3, tail));
    assert_eq!((f.outputs[2].node, f.outputs[2].layout.offset), (3, 0));
    let t =
        |shape: &[usize], seed: u64| Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu)?.to_dtype(DType::BF16);
    let cells = [t(&[r, n], 1)?, t(&[r, n], 2)?, t(&[r, m], 3)?]
        .iter()
        .map(crate::exec::contiguous_cell)
        .collect::<kiln_tensor::Result<Vec<_>>>()?;
    same_values(g.clone(), f, &cells, 3, 1e-2)?;
    // Not on the CPU, nor the tanh form's gradient (cuBLASLt's DGELU epilogue takes it).
    assert_eq!(ops(&pass("fuse_gated_sums", &g, Target::Cpu)), ops(&g));
    let tanh = build(UnaryOp::GeluTanhGrad);
    assert_eq!(ops(&fuse_gated_sums(&tanh)), ops(&tanh));
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
    let at = Parts::layer_norm_grads(&[r, n], false).offset(Part::Dx).unwrap();
    let grads = Op::LayerNormGrads { eps: 1e-5 };
    let pg = g.push(Kind::Op(grads, vec![whole(&g, x), whole(&g, gy), whole(&g, w)]), vec![at + r * n], DType::F32);
    let dx = Arg { node: pg, layout: Layout { offset: at, ..Layout::contiguous(&[r, n]) } };
    let params = Arg { node: pg, layout: Layout::contiguous(&[2, n]) };
    let sum = g.push(Kind::Op(Op::Binary(BinaryOp::Add), vec![whole(&g, res), dx.clone()]), vec![r, n], DType::F32);
    let low = g.push(Kind::Op(Op::Cast(DType::BF16), vec![whole(&g, sum)]), vec![r, n], DType::BF16);
    g.outputs = vec![whole(&g, sum), whole(&g, low), params];
    assert_eq!(ops(&pass("fold_residual_into_layer_norm_grads", &g, Target::Cpu)), ["layer_norm_grads", "add", "to_dtype"]);
    let f = fold_residual_into_layer_norm_grads(&g);
    assert_eq!(ops(&f), ["layer_norm_grads_fused", "to_dtype"], "{f}");
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
    assert_eq!(ops(&fold_residual_into_layer_norm_grads(&h)), ["layer_norm_grads", "add", "to_dtype", "neg"]);
    let mut b = g.clone();
    let row = b.push(Kind::Input(4), vec![n], DType::F32);
    let Kind::Op(_, args) = &mut b.nodes[sum].kind else { unreachable!() };
    args[0] = Arg { node: row, layout: Layout::contiguous(&[n]) };
    assert_eq!(ops(&fold_residual_into_layer_norm_grads(&b)).len(), 3, "a broadcast row is not x's shape");
}

#[test]
fn a_small_mean_cross_entropy_and_its_gradient_become_one_gpu_op() {
    let (g, _) = mean_loss();
    let f = fuse_mean_cross_entropy(&g);
    assert_eq!(ops(&f), ["cross_entropy_mean"]);
    let ce = f.nodes.iter().position(|n| matches!(n.kind, Kind::Op(..))).unwrap_or(usize::MAX);
    assert_eq!(f.nodes[ce].shape, vec![64 + 12]);
    assert!(matches!(f.nodes[ce].kind, Kind::Op(Op::Fused(Fused::CrossEntropyMean { ignore_index: Some(-100), .. }), _)));
    // The loss reads element 0, the gradient the 4 x 3 values from element 64.
    let outs: Vec<(NodeId, usize, &[usize])> = f.outputs.iter().map(|a| (a.node, a.layout.offset, &a.layout.shape[..])).collect();
    assert_eq!(outs, vec![(ce, 0, &[][..]), (ce, 64, &[4, 3][..])]);
    // The CPU keeps the chain (its kernels fold nothing in one block).
    assert_eq!(pass("fuse_mean_cross_entropy", &g, Target::Cpu).nodes.len(), g.nodes.len());
}

/// A classifier head after `fuse_mean_cross_entropy` as autograd records it: logits
/// `h w^T + b`, the fused loss, `g^T h` with `sum(g)` and `(g w) * step(h)`. Returns the
/// graph and the loss, weight-gradient and input-gradient nodes.
fn classifier_head(n: usize) -> (Graph, [NodeId; 3]) {
    let (c, f) = (3, 6);
    let mut g = Graph::default();
    let h = g.push(Kind::Input(0), vec![n, f], DType::F32);
    let w = g.push(Kind::Input(1), vec![c, f], DType::F32);
    let b = g.push(Kind::Input(2), vec![c], DType::F32);
    let t = g.push(Kind::Input(3), vec![n], DType::I64);
    let wt = Arg { node: w, layout: Layout { shape: vec![f, c], strides: vec![1, f], offset: 0 } };
    let p = g.push(Kind::Op(Op::Matmul, vec![whole(&g, h), wt, whole(&g, b)]), vec![n, c], DType::F32);
    let xent = Op::Fused(Fused::CrossEntropyMean { ignore_index: Some(-100), smoothing: 0.0 });
    let parts = Parts::cross_entropy_mean(n, c);
    let ce = g.push(Kind::Op(xent, vec![whole(&g, p), whole(&g, t)]), vec![parts.len()], DType::F32);
    let at = parts.offset(Part::Dx).unwrap();
    let grad = |shape: Vec<usize>, strides: Vec<usize>| Arg { node: ce, layout: Layout { shape, strides, offset: at } };
    let sums = Op::Fused(Fused::Matmul(MatmulEpilogue::SumLeft));
    let dw = g.push(Kind::Op(sums, vec![grad(vec![c, n], vec![1, c]), whole(&g, h)]), vec![64 + c], DType::F32);
    let drelu = Op::Fused(Fused::Matmul(MatmulEpilogue::DRelu));
    let dh = g.push(Kind::Op(drelu, vec![grad(vec![n, c], vec![c, 1]), whole(&g, w), whole(&g, h)]), vec![n, f], DType::F32);
    let loss = Arg { node: ce, layout: Layout { shape: vec![], strides: vec![], offset: 0 } };
    g.outputs = vec![loss, whole(&g, dw), whole(&g, dh)];
    (g, [ce, dw, dh])
}

#[test]
fn a_small_classifier_head_its_loss_and_its_backward_become_one_gpu_op() {
    let (g, [ce, _, _]) = classifier_head(4);
    let f = fuse_linear_cross_entropy(&g);
    assert_eq!(ops(&f), ["linear_cross_entropy_mean"]);
    let fused = f.nodes.iter().position(|n| matches!(n.kind, Kind::Op(..))).unwrap_or(usize::MAX);
    let Kind::Op(Op::Fused(Fused::LinearCrossEntropyMean { drelu: true, .. }), args) = &f.nodes[fused].kind else { panic!("{f}") };
    // h, the weight read as [C, F], the bias, the targets.
    assert_eq!(args.iter().map(|a| a.node).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!((&args[1].layout.shape[..], &args[1].layout.strides[..]), (&[3, 6][..], &[6, 1][..]));
    // The loss at 0, the weight gradient (and its sums) from 64, h's gradient after them.
    let parts = Parts::linear_cross_entropy_mean(4, 3, 6);
    let (dw, dh) = (parts.offset(Part::Dw).unwrap(), parts.offset(Part::Dx).unwrap());
    assert_eq!(f.nodes[fused].shape, vec![parts.len()]);
    let outs: Vec<(NodeId, usize)> = f.outputs.iter().map(|a| (a.node, a.layout.offset)).collect();
    assert_eq!(outs, vec![(fused, 0), (fused, dw), (fused, dh)]);
    // The CPU (and a GPU without clusters) keeps the products; so does a GPU when the
    // logits are read elsewhere.
    assert_eq!(pass("fuse_linear_cross_entropy", &g, Target::Cpu).nodes.len(), g.nodes.len());
    let (mut g, _) = classifier_head(4);
    g.outputs.push(whole(&g, 4));
    assert!(!ops(&fuse_linear_cross_entropy(&g)).contains(&"linear_cross_entropy_mean"));
    // Or when the gradient is returned too.
    let (mut g, _) = classifier_head(4);
    let grad = Arg { node: ce, layout: kiln_tensor::Layout { shape: vec![4, 3], strides: vec![3, 1], offset: 64 } };
    g.outputs.push(grad);
    assert!(!ops(&fuse_linear_cross_entropy(&g)).contains(&"linear_cross_entropy_mean"));
    // A batch past the kernel's limits stays unfused.
    let (g, _) = classifier_head(4096);
    assert!(!ops(&fuse_linear_cross_entropy(&g)).contains(&"linear_cross_entropy_mean"));
}

#[test]
fn a_mean_cross_entropy_whose_parts_are_read_elsewhere_stays_unfused() {
    // The count (the number of real targets) returned as well.
    let (mut g, [total, _, _, count, _, _]) = mean_loss();
    g.outputs.push(whole(&g, count));
    assert!(!ops(&fuse_mean_cross_entropy(&g)).contains(&"cross_entropy_mean"));
    // The rows' losses read by another op (the sum of the losses returned).
    let (mut g, _) = mean_loss();
    g.outputs.push(whole(&g, total));
    assert!(!ops(&fuse_mean_cross_entropy(&g)).contains(&"cross_entropy_mean"));
    // Rows over 1024 classes (the kernel's warp per row would crawl).
    let (mut g, _) = mean_loss();
    g.nodes[0].shape = vec![4, 2000];
    for n in &mut g.nodes {
        if let Kind::Op(_, args) = &mut n.kind {
            args.iter_mut().filter(|a| a.node == 0).for_each(|a| a.layout = kiln_tensor::Layout::contiguous(&[4, 2000]));
        }
    }
    assert!(!ops(&fuse_mean_cross_entropy(&g)).contains(&"cross_entropy_mean"));
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
    let cells = [crate::exec::contiguous_cell(&Tensor::rand_at(&[4, 6], Distribution::Normal, 5, 0, DType::F32, Device::Cpu)?)?];
    same_values(g, f, &cells, 3, 0.0)
}

/// Pass `name` of the pipeline on `g`, as `optimise` runs it for `target`.
fn pass(name: &str, g: &Graph, target: Target) -> Graph {
    let p = PIPELINE.iter().find(|p| p.name == name).expect("a pass of the pipeline");
    if p.on.takes(target) {
        (p.run)(g, target)
    } else {
        g.clone()
    }
}
