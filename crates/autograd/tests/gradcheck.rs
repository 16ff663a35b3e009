//! Finite-difference checks (f64) for every differentiable op, with broadcast and
//! non-contiguous inputs, plus the tape's own behaviour (accumulation, no_grad, errors).

#![allow(clippy::cloned_ref_to_slice_refs)] // `&[x.clone()]` reads better in a table of checks

use kiln_autograd::{backward, grad, gradcheck, Backward, GradcheckConfig};
use kiln_tensor::{DType, Device, Distribution, Result, Tensor, UnaryOp};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F64, Device::Cpu).unwrap()
}
/// Values in [lo, hi) for ops that need a domain (log, sqrt, pow).
fn uniform(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Uniform, seed, 0, DType::F64, Device::Cpu)
        .unwrap()
        .mul_scalar(hi - lo)
        .unwrap()
        .add_scalar(lo)
        .unwrap()
}
fn check(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    match gradcheck(f, inputs, GradcheckConfig::default()) {
        Ok(err) => assert!(err < 1e-6, "{name}: worst error {err}"),
        Err(e) => panic!("{name}: {e}"),
    }
}

#[test]
fn unary_ops() {
    let x = randn(&[3, 4], 1);
    let pos = uniform(&[3, 4], 2, 0.5, 2.0);
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Erf,
        UnaryOp::Square,
    ];
    for op in ops {
        check(op.name(), |xs| xs[0].unary(op), &[x.clone()]);
        // The same through a transposed (non-contiguous) view.
        check(op.name(), |xs| xs[0].t()?.unary(op), &[x.clone()]);
    }
    for op in [UnaryOp::Log, UnaryOp::Sqrt, UnaryOp::Rsqrt, UnaryOp::Recip] {
        check(op.name(), |xs| xs[0].unary(op), &[pos.clone()]);
    }
    check("powf", |xs| xs[0].powf(2.5), &[pos.clone()]);
    check("rpow", |xs| xs[0].scalar_op(kiln_tensor::BinaryOp::Pow, 1.7, true), &[x.clone()]);
}

#[test]
fn binary_ops_with_broadcasting() {
    let a = randn(&[2, 3, 4], 3);
    let row = randn(&[4], 4);
    let col = randn(&[2, 1, 1], 5);
    let pos = uniform(&[3, 1], 6, 0.5, 2.0);
    check("add", |x| x[0].add(&x[1]), &[a.clone(), row.clone()]);
    check("sub", |x| x[1].sub(&x[0]), &[a.clone(), col.clone()]);
    check("mul", |x| x[0].mul(&x[1]), &[a.clone(), col.clone()]);
    check("div", |x| x[0].div(&x[1]), &[a.clone(), pos.clone()]);
    check("pow", |x| x[1].pow(&x[0]), &[randn(&[3, 4], 7), pos.clone()]);
    check("maximum", |x| x[0].maximum(&x[1]), &[a.clone(), row.clone()]);
    check("minimum", |x| x[0].minimum(&x[1]), &[a.clone(), row.clone()]);
    // Scalar forms, both sides.
    check("scalars", |x| x[0].add_scalar(1.0)?.mul_scalar(3.0)?.sub_scalar(2.0)?.rsub_scalar(1.0)?.div_scalar(4.0), &[a.clone()]);
    check("rdiv", |x| x[0].rdiv_scalar(2.0), &[pos.clone()]);
    check("clamp", |x| x[0].clamp(-0.5, 0.5), &[a.clone()]);
    // A transposed lhs against an expanded rhs.
    check("strided", |x| x[0].t()?.mul(&x[1].broadcast_to(&[3, 3])?), &[randn(&[3, 3], 8), randn(&[3, 1], 9)]);
}

#[test]
fn where_cast_and_reductions() {
    let x = randn(&[3, 4], 10);
    let y = randn(&[4], 11);
    let cond = x.gt_scalar(0.0).unwrap();
    check("where", |v| Tensor::where_cond(&cond, &v[0], &v[1]), &[x.clone(), y.clone()]);
    // Through f32 the finite difference needs a coarser step and tolerance.
    let coarse = GradcheckConfig { eps: 1e-2, atol: 1e-4, rtol: 1e-3 };
    gradcheck(|v| v[0].to_dtype(DType::F32)?.to_dtype(DType::F64), &[x.clone()], coarse).unwrap();
    check("sum", |v| v[0].sum(&[0], false), &[x.clone()]);
    check("sum keepdim", |v| v[0].sum(&[1], true), &[x.clone()]);
    check("sum all dims of a view", |v| v[0].t()?.sum(&[0, 1], false), &[x.clone()]);
    check("mean", |v| v[0].mean(&[1], false), &[x.clone()]);
    check("var", |v| v[0].var(&[1], true, 1), &[x.clone()]);
    check("max", |v| v[0].max(&[1], false), &[x.clone()]);
    check("min", |v| v[0].min(&[0], true), &[x.clone()]);
    check("softmax", |v| v[0].softmax(-1), &[x.clone()]);
    check("log_softmax", |v| v[0].t()?.log_softmax(1), &[x.clone()]);
    check("normalize", |v| v[0].normalize(1e-5), &[x.clone()]);
    check("scaled causal softmax", |v| v[0].softmax_scaled(0.7, true), &[x.clone()]);
    check("normalize of a view", |v| v[0].t()?.normalize(1e-3), &[x.clone()]);
    let (w, b) = (randn(&[x.shape()[0]], 38), randn(&[x.shape()[0]], 39));
    check("layer norm with weight and bias", |v| v[0].t()?.layer_norm(&v[1], &v[2], 1e-3), &[x.clone(), w.clone(), b]);
    check("rms norm", |v| v[0].rms_norm(None, 1e-3), &[x.clone()]);
    check("rms norm of a view, weighted", |v| v[0].t()?.rms_norm(Some(&v[1]), 1e-3), &[x.clone(), w]);
}

#[test]
fn rms_norm_matches_hand_computed_values_and_checks_its_weight() -> Result<()> {
    // Row [1, 2, 2]: mean square 3, so x / sqrt(3) (eps 0), times the weight.
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 2.0], &[1, 3], Device::Cpu)?;
    let w = Tensor::from_vec(vec![2.0f64, 1.0, -1.0], &[3], Device::Cpu)?;
    let r = 1.0 / 3f64.sqrt();
    for (got, want) in x.rms_norm(Some(&w), 0.0)?.to_vec::<f64>()?.iter().zip([2.0 * r, 2.0 * r, -2.0 * r]) {
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }
    // The composite it fuses, f32 rows of 96 with eps: equal to rounding.
    let xs = Tensor::randn(&[5, 96], DType::F32, Device::Cpu)?;
    let ws = Tensor::randn(&[96], DType::F32, Device::Cpu)?;
    let composite = xs.mul(&xs.square()?.mean(&[-1], true)?.add_scalar(1e-6)?.rsqrt()?)?.mul(&ws)?;
    for (a, b) in xs.rms_norm(Some(&ws), 1e-6)?.to_vec::<f32>()?.iter().zip(composite.to_vec::<f32>()?) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
    }
    // The backward by hand for one row: dx = r (g w - xhat mean(g w xhat)), xhat = x r.
    let g = Tensor::from_vec(vec![0.3f64, -1.0, 2.0], &[1, 3], Device::Cpu)?;
    let (xv, gw) = ([1.0, 2.0, 2.0], [0.6, -1.0, -2.0]);
    let m: f64 = (0..3).map(|i| gw[i] * xv[i] * r).sum::<f64>() / 3.0;
    let want: Vec<f64> = (0..3).map(|i| r * (gw[i] - xv[i] * r * m)).collect();
    for (got, want) in x.rms_norm_backward(&g, Some(&w), 0.0)?.to_vec::<f64>()?.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "dx {got} vs {want}");
    }
    let err = x.rms_norm(Some(&w.narrow(0, 0, 2)?), 0.0).unwrap_err().to_string();
    assert!(err.contains("[2]") && err.contains("[1, 3]") && err.contains("rms_norm"), "{err}");
    let err = x.rms_norm(Some(&w.to_dtype(DType::F32)?), 0.0).unwrap_err().to_string();
    assert!(err.contains("F32") && err.contains("F64"), "{err}");
    Ok(())
}

#[test]
fn layer_norm_matches_hand_computed_values_and_checks_its_parameters() -> Result<()> {
    // Row [1, 2, 3]: mean 2, biased var 2/3, xhat = [-1, 0, 1] * sqrt(3/2) (eps 0).
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[1, 3], Device::Cpu)?;
    let (w, b) =
        (Tensor::from_vec(vec![2.0f64, 1.0, -1.0], &[3], Device::Cpu)?, Tensor::from_vec(vec![0.5f64, 0.0, 1.0], &[3], Device::Cpu)?);
    let r = 1.5f64.sqrt();
    let want = [-2.0 * r + 0.5, 0.0, -r + 1.0];
    for (got, want) in x.layer_norm(&w, &b, 0.0)?.to_vec::<f64>()?.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }
    let err = x.layer_norm(&w.narrow(0, 0, 2)?, &b, 0.0).unwrap_err().to_string();
    assert!(err.contains("[2]") && err.contains("[1, 3]"), "{err}");
    let err = x.layer_norm(&w.to_dtype(DType::F32)?, &b, 0.0).unwrap_err().to_string();
    assert!(err.contains("F32") && err.contains("F64"), "{err}");
    // The fused input gradient equals normalize_backward of g * w.
    let g = Tensor::from_vec(vec![0.3f64, -1.0, 2.0], &[1, 3], Device::Cpu)?;
    let (fused, plain) = (x.layer_norm_backward(&g, &w, 1e-5)?, x.normalize_backward(&g.mul(&w)?, 1e-5)?);
    for (a, b) in fused.to_vec::<f64>()?.iter().zip(plain.to_vec::<f64>()?) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    let err = x.layer_norm_backward(&g, &b.narrow(0, 0, 1)?, 1e-5).unwrap_err().to_string();
    assert!(err.contains("[1]") && err.contains("[1, 3]"), "{err}");
    // The whole backward as one op: the same x gradient, and the parameter gradients by hand:
    // dw = g * xhat, db = g (one row).
    let (dx, dw, db) = x.layer_norm_grads(&g, &w, 0.0)?;
    for (a, b) in dx.to_vec::<f64>()?.iter().zip(x.layer_norm_backward(&g, &w, 0.0)?.to_vec::<f64>()?) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    let want_dw = [0.3 * -r, 0.0, 2.0 * r];
    for (got, want) in dw.to_vec::<f64>()?.iter().zip(want_dw) {
        assert!((got - want).abs() < 1e-12, "dw {got} vs {want}");
    }
    assert_eq!(db.to_vec::<f64>()?, vec![0.3, -1.0, 2.0]);
    let err = x.layer_norm_grads(&g, &b.narrow(0, 0, 2)?, 0.0).unwrap_err().to_string();
    assert!(err.contains("[2]") && err.contains("[1, 3]") && err.contains("weight"), "{err}");
    Ok(())
}

#[test]
fn fused_cross_entropy_matches_finite_differences_and_the_composite() -> Result<()> {
    let x = randn(&[4, 3], 12);
    let targets = Tensor::from_vec(vec![2i64, -100, 0, 1], &[4], Device::Cpu)?;
    for smoothing in [0.0, 0.2] {
        // Rows weighted unequally, so each row's gradient is checked, through a transposed view.
        let w = Tensor::from_vec(vec![0.5f64, 2.0, -1.0, 3.0], &[4], Device::Cpu)?;
        let f = |v: &[Tensor]| v[0].t()?.t()?.cross_entropy_rows(&targets, Some(-100), smoothing)?.mul(&w);
        check("cross_entropy", f, &[x.clone()]);
        // Against log-softmax by hand: lse - (1 - s) x[t] - s/C sum(x); the ignored row is 0.
        let got = x.cross_entropy_rows(&targets, Some(-100), smoothing)?.to_vec::<f64>()?;
        let (xs, ts) = (x.to_vec::<f64>()?, [2usize, 0, 0, 1]);
        for r in 0..4 {
            let row = &xs[r * 3..r * 3 + 3];
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            let want = if r == 1 { 0.0 } else { lse - (1.0 - smoothing) * row[ts[r]] - smoothing / 3.0 * row.iter().sum::<f64>() };
            assert!((got[r] - want).abs() < 1e-12, "row {r}: {} vs {want}", got[r]);
        }
    }
    let bad = Tensor::from_vec(vec![2i64, 3, 0, 1], &[4], Device::Cpu)?;
    let err = x.cross_entropy_rows(&bad, Some(-100), 0.0).unwrap_err().to_string();
    assert!(err.contains("cross_entropy") && err.contains('3'), "{err}");
    Ok(())
}

#[test]
fn matmul_batched_broadcast_and_transposed() {
    check("matmul", |v| v[0].matmul(&v[1]), &[randn(&[3, 4], 12), randn(&[4, 2], 13)]);
    check("batched x 2-D", |v| v[0].matmul(&v[1]), &[randn(&[2, 3, 4], 14), randn(&[4, 2], 15)]);
    check("broadcast batch", |v| v[0].matmul(&v[1]), &[randn(&[2, 1, 3, 4], 16), randn(&[3, 4, 2], 17)]);
    check("transposed", |v| v[0].t()?.matmul(&v[1].t()?), &[randn(&[4, 3], 18), randn(&[2, 4], 19)]);
    check("vector", |v| v[0].matmul(&v[1]), &[randn(&[3, 4], 20), randn(&[4], 21)]);
    let bias_ins = [randn(&[2, 3, 4], 60), randn(&[5, 4], 61), randn(&[5], 62)];
    check("linear with bias", |v| v[0].linear(&v[1], Some(&v[2])), &bias_ins);
    check("matmul_bias", |v| v[0].matmul_bias(&v[1], &v[2]), &[randn(&[3, 4], 63), randn(&[4, 2], 64), randn(&[2], 65)]);
}

#[test]
fn views_and_indexing() {
    let x = randn(&[2, 3, 4], 22);
    check("reshape", |v| v[0].reshape(&[6, 4]), &[x.clone()]);
    check("permute", |v| v[0].permute(&[2, 0, 1])?.contiguous(), &[x.clone()]);
    check("narrow", |v| v[0].narrow(2, 1, 2), &[x.clone()]);
    check("expand", |v| v[0].broadcast_to(&[2, 3, 4]), &[randn(&[3, 1], 23)]);
    check("squeeze/unsqueeze", |v| v[0].unsqueeze(1)?.squeeze(1), &[x.clone()]);
    check("cat", |v| Tensor::cat(&[&v[0], &v[1]], 1), &[randn(&[2, 2], 24), randn(&[2, 3], 25)]);
    check("stack", |v| Tensor::stack(&[&v[0], &v[1]], 0), &[randn(&[2, 2], 26), randn(&[2, 2], 27)]);
    let ids = Tensor::from_slice(&[2i64, 0, 2, 1], &[4], Device::Cpu).unwrap();
    check("index_select", |v| v[0].index_select(0, &ids), &[randn(&[3, 2], 28)]);
    check("embedding", |v| v[0].embedding(&ids.reshape(&[2, 2])?), &[randn(&[3, 2], 29)]);
    check("index_add", |v| v[0].index_add(0, &ids, &v[1]), &[randn(&[3, 2], 30), randn(&[4, 2], 31)]);
    let gidx = Tensor::from_slice(&[1i64, 0, 2, 2], &[2, 2], Device::Cpu).unwrap();
    check("gather", |v| v[0].gather(1, &gidx), &[randn(&[2, 3], 32)]);
    check("scatter_add", |v| v[0].scatter_add(1, &gidx, &v[1]), &[randn(&[2, 3], 33), randn(&[2, 2], 34)]);
}

#[test]
fn gradients_of_several_slices_of_one_tensor() -> Result<()> {
    // Slices tiling a dim (q, k, v of one projection) are joined by one cat; overlapping or
    // partial slices, and a dense use beside them, are summed.
    let x = randn(&[2, 6, 3], 37);
    let split = |v: &[Tensor]| -> Result<Tensor> {
        let (a, b, c) = (v[0].narrow(1, 0, 2)?, v[0].narrow(1, 2, 3)?, v[0].narrow(1, 5, 1)?);
        a.mul(&b.narrow(1, 0, 2)?)?.sum(&[1], true)?.add(&c.tanh()?)
    };
    check("slices tiling a dim", split, &[x.clone()]);
    let mixed = |v: &[Tensor]| -> Result<Tensor> {
        let (a, b) = (v[0].narrow(1, 1, 3)?, v[0].narrow(1, 2, 3)?);
        a.mul(&b)?.add(&v[0].narrow(2, 0, 1)?.sum(&[1], true)?)?.mul(&v[0].sum(&[1], true)?)
    };
    check("overlapping and partial slices with a dense use", mixed, &[x.clone()]);
    // By hand: y = 2 x[0..2] + 3 x[2..4] + x[1..3] over a length-4 x: dy/dx = [2, 3, 4, 3].
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[4], Device::Cpu)?;
    x.set_requires_grad(true);
    let y = x.narrow(0, 0, 2)?.mul_scalar(2.0)?.add(&x.narrow(0, 2, 2)?.mul_scalar(3.0)?)?.add(&x.narrow(0, 1, 2)?)?;
    backward(&y.sum_all()?)?;
    assert_eq!(x.grad().expect("a gradient").to_vec::<f32>()?, vec![2.0, 3.0, 4.0, 3.0]);
    Ok(())
}

#[test]
fn a_composite_with_shared_subexpressions() {
    // y = softmax(x W) . x W + layer-norm-like centering: x is used on several paths.
    check(
        "composite",
        |v| {
            let h = v[0].matmul(&v[1])?;
            let c = h.sub(&h.mean(&[1], true)?)?;
            c.mul(&h.softmax(1)?)?.tanh()?.add(&v[0].narrow(1, 0, 2)?)
        },
        &[randn(&[3, 4], 35), randn(&[4, 2], 36)],
    );
}

#[test]
fn gradients_accumulate_and_no_grad_stops_recording() -> Result<()> {
    let w = Tensor::from_slice(&[1.0f64, 2.0, 3.0], &[3], Device::Cpu)?;
    w.set_requires_grad(true);
    // d/dw sum(w^2) = 2w, twice accumulated.
    w.square()?.sum_all()?.backward()?;
    let g = w.grad().unwrap();
    w.square()?.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![4.0, 8.0, 12.0]);
    assert!(w.grad().unwrap().same_storage(&g), "accumulation writes into the same buffer");
    let y = kiln_autograd::no_grad(|| w.mul_scalar(2.0))?;
    assert!(!y.requires_grad() && y.grad_fn().is_none());
    // grad() leaves .grad untouched and can target non-leaves.
    let h = w.mul_scalar(3.0)?;
    let l = h.sum_all()?;
    let gs = grad(&l, &[&h, &w])?;
    assert_eq!(gs[0].as_ref().unwrap().to_vec::<f64>()?, vec![1.0; 3]);
    assert_eq!(gs[1].as_ref().unwrap().to_vec::<f64>()?, vec![3.0; 3]);
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![4.0, 8.0, 12.0]);
    Ok(())
}

#[test]
fn a_second_backward_through_a_spent_graph_is_an_error_unless_it_was_retained() -> Result<()> {
    let w = Tensor::from_slice(&[1.0f64, 2.0], &[2], Device::Cpu)?;
    w.set_requires_grad(true);
    let loss = w.square()?.sum_all()?;
    loss.backward_retain_graph()?;
    loss.backward()?;
    // d/dw sum(w^2) = 2w, from both walks.
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![4.0, 8.0]);
    let err = loss.backward().unwrap_err().to_string();
    assert!(err.contains("spent") && err.contains("retain_graph"), "{err}");
    // The failed walk added nothing; a graph sharing only the leaf is fresh.
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![4.0, 8.0]);
    w.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![5.0, 9.0]);
    // A second loss over a spent intermediate is refused too, as in PyTorch.
    let h = w.square()?;
    h.sum_all()?.backward()?;
    let err = h.mul_scalar(2.0)?.sum_all()?.backward().unwrap_err().to_string();
    assert!(err.contains("spent"), "{err}");
    Ok(())
}

#[test]
fn tape_errors_are_clear() -> Result<()> {
    let w = Tensor::from_slice(&[1.0f64, 2.0], &[2], Device::Cpu)?;
    let e = backward(&w.sum_all()?).unwrap_err().to_string();
    assert!(e.contains("does not require grad"), "{e}");
    w.set_requires_grad(true);
    assert!(backward(&w.mul_scalar(2.0)?).unwrap_err().to_string().contains("one-element loss, got shape [2]"));
    // Modifying a saved input in place before backward is caught.
    let a = Tensor::from_slice(&[1.0f64, 2.0], &[2], Device::Cpu)?;
    let y = w.mul(&a)?.sum_all()?;
    a.add_scalar_(1.0)?;
    let e = backward(&y).unwrap_err().to_string();
    assert!(e.contains("was modified in place"), "{e}");
    Ok(())
}

#[test]
fn deep_chains_do_not_overflow_the_stack() -> Result<()> {
    let w = Tensor::from_slice(&[1.0f64], &[1], Device::Cpu)?;
    w.set_requires_grad(true);
    let mut x = w.clone();
    for _ in 0..20_000 {
        x = x.add_scalar(0.0)?;
    }
    x.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![1.0]);
    Ok(())
}

/// Fused attention: its gradients by finite differences, and its value against the unfused
/// ops (scores, scaled causal softmax, product), on transposed views like a split of heads.
#[test]
fn fused_attention_matches_finite_differences_and_the_unfused_ops() -> Result<()> {
    let qkv = || [randn(&[2, 5, 3], 30), randn(&[2, 5, 3], 31), randn(&[2, 5, 3], 32)];
    for causal in [false, true] {
        check("attention", |v| v[0].attention(&v[1], &v[2], 0.6, causal), &qkv());
        // [T, B, D] views transposed to [B, T, D], as heads are split.
        check(
            "attention of views",
            |v| v[0].transpose(0, 1)?.attention(&v[1].transpose(0, 1)?, &v[2].transpose(0, 1)?, 0.6, causal),
            &qkv(),
        );
        // Heads cut from one fused [B, T, 3 H D] projection, as a model's attention does: the
        // packed backward gives the projection's gradient as one buffer (no `cat`).
        check(
            "attention of heads cut from a fused projection",
            |v| {
                let head = |i: usize| v[0].narrow(2, i * 6, 6)?.reshape(&[2, 4, 3, 2])?.transpose(1, 2);
                head(0)?.attention(&head(1)?, &head(2)?, 0.6, causal)
            },
            &[randn(&[2, 4, 18], 33)],
        );
        // Rank 2 and rank 5 ([B, H1, H2, T, D]) packings.
        check(
            "attention of rank 2",
            |v| v[0].attention(&v[1], &v[2], 0.6, causal),
            &[randn(&[4, 3], 34), randn(&[4, 3], 35), randn(&[4, 3], 36)],
        );
        let r5 = |seed| randn(&[2, 2, 2, 3, 2], seed);
        check("attention of rank 5", |v| v[0].attention(&v[1], &v[2], 0.6, causal), &[r5(37), r5(38), r5(39)]);
        let [q, k, v] = qkv();
        let fused = q.attention(&k, &v, 0.6, causal)?.to_vec::<f64>()?;
        let unfused = q.matmul(&k.transpose(1, 2)?)?.softmax_scaled(0.6, causal)?.matmul(&v)?.to_vec::<f64>()?;
        let worst = fused.iter().zip(&unfused).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-12, "fused vs unfused attention (causal {causal}): {worst}");
        // Fewer queries than keys (a decoding step's 2 over 5 cached) and more (3 over 2),
        // grouped-query heads among them: query i sits at position i + S - T.
        check(
            "attention of 2 queries over 5 keys",
            |v| v[0].attention(&v[1], &v[2], 0.6, causal),
            &[randn(&[2, 2, 3], 41), randn(&[2, 5, 3], 42), randn(&[2, 5, 3], 43)],
        );
        check(
            "grouped-query attention of 3 queries over 2 keys",
            |v| v[0].attention(&v[1], &v[2], 0.6, causal),
            &[randn(&[1, 4, 3, 2], 44), randn(&[1, 2, 2, 2], 45), randn(&[1, 2, 2, 2], 46)],
        );
    }
    Ok(())
}

fn small_cumsum() -> Result<Vec<f64>> {
    Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3], Device::Cpu)?.cumsum(0usize)?.to_vec::<f64>()
}

/// The composite ops (cumsum, std, logsumexp, masked_fill, tril/triu, flip, repeat) against direct
/// loops, and their gradients against finite differences.
#[test]
fn composite_ops_match_loops_and_finite_differences() -> Result<()> {
    let x = randn(&[3, 4], 40);
    let v = x.to_vec::<f64>()?;
    let at = |r: usize, c: usize| v[r * 4 + c];
    // std over dim 1, unbiased; logsumexp over dim 1.
    let std = x.std(&[1usize], false, 1)?.to_vec::<f64>()?;
    let lse = x.logsumexp(&[1usize], false)?.to_vec::<f64>()?;
    assert_eq!(x.logsumexp(&[1usize], true)?.shape(), &[3, 1]);
    for r in 0..3 {
        let mean = (0..4).map(|c| at(r, c)).sum::<f64>() / 4.0;
        let want_std = ((0..4).map(|c| (at(r, c) - mean).powi(2)).sum::<f64>() / 3.0).sqrt();
        let want_lse = (0..4).map(|c| at(r, c).exp()).sum::<f64>().ln();
        assert!((std[r] - want_std).abs() < 1e-12 && (lse[r] - want_lse).abs() < 1e-12, "row {r}");
    }
    // Large values do not overflow; an all -inf row gives -inf.
    let big = Tensor::from_vec(vec![1000.0, 1000.0, f64::NEG_INFINITY, f64::NEG_INFINITY], &[2, 2], Device::Cpu)?;
    let got = big.logsumexp(&[1usize], false)?.to_vec::<f64>()?;
    assert!((got[0] - (1000.0 + 2f64.ln())).abs() < 1e-9 && got[1] == f64::NEG_INFINITY, "{got:?}");
    // tril/triu with offsets, masked_fill, flip, repeat.
    let tril = x.tril(0)?.to_vec::<f64>()?;
    let triu = x.triu(1)?.to_vec::<f64>()?;
    let mask = x.gt_scalar(0.0)?;
    let filled = x.masked_fill(&mask, -7.0)?.to_vec::<f64>()?;
    let flipped = x.flip(&[0usize, 1])?.to_vec::<f64>()?;
    for r in 0..3 {
        for c in 0..4 {
            let k = r * 4 + c;
            assert_eq!(tril[k], if c <= r { at(r, c) } else { 0.0 });
            assert_eq!(triu[k], if c > r { at(r, c) } else { 0.0 });
            assert_eq!(filled[k], if at(r, c) > 0.0 { -7.0 } else { at(r, c) });
            assert_eq!(flipped[k], at(2 - r, 3 - c));
        }
    }
    let small = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3], Device::Cpu)?;
    assert_eq!(small.repeat(&[2, 2])?.to_vec::<f64>()?, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    assert_eq!(small.repeat(&[2, 2])?.shape(), &[2, 6]);
    assert!(small.repeat(&[]).unwrap_err().to_string().contains("[3]"));
    assert!(small.tril(0).unwrap_err().to_string().contains("at least 2 dims"));
    // cumsum along each dim, and of a vector.
    let c0 = x.cumsum(0usize)?.to_vec::<f64>()?;
    let c1 = x.cumsum(1usize)?.to_vec::<f64>()?;
    for r in 0..3 {
        for c in 0..4 {
            let (down, across) = ((0..=r).map(|k| at(k, c)).sum::<f64>(), (0..=c).map(|k| at(r, k)).sum::<f64>());
            assert!((c0[r * 4 + c] - down).abs() < 1e-12 && (c1[r * 4 + c] - across).abs() < 1e-12, "({r}, {c})");
        }
    }
    assert_eq!(small_cumsum()?, vec![1.0, 3.0, 6.0]);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    let inputs = [randn(&[2, 3, 4], 41)];
    gradcheck(|t| t[0].cumsum(1usize)?.square(), &inputs, cfg)?;
    gradcheck(|t| t[0].std(&[2usize], false, 1), &inputs, cfg)?;
    gradcheck(|t| t[0].logsumexp(&[0usize, 2], true), &inputs, cfg)?;
    gradcheck(|t| t[0].triu(-1)?.mul(&t[0].tril(1)?), &inputs, cfg)?;
    gradcheck(
        |t| {
            let r = t[0].flip(&[1usize])?.repeat(&[2, 1, 1, 2])?;
            r.masked_fill(&r.lt_scalar(0.0)?, 0.5)
        },
        &inputs,
        cfg,
    )?;
    Ok(())
}

#[test]
fn sort_and_topk_values_send_their_gradient_back_to_where_they_came_from() {
    // Distinct random values: the order does not change under the finite differences.
    let w = randn(&[4, 9], 8);
    check("sort", |t| t[0].sort(1usize, false)?.0.mul(&w), &[randn(&[4, 9], 7)]);
    check("topk", |t| t[0].topk(3, 0usize, true)?.0.square(), &[randn(&[4, 9], 9)]);
}

#[test]
fn post_accumulate_hooks_see_each_finished_gradient_in_backward_order() -> kiln_tensor::Result<()> {
    use kiln_autograd::register_post_accumulate_grad_hook;
    use std::sync::{Arc, Mutex};
    // loss = sum(w2 * (w1 * x)): w2's gradient is finished before w1's.
    let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?;
    let w1 = Tensor::from_vec(vec![3.0f32, 4.0], &[2], Device::Cpu)?;
    let w2 = Tensor::from_vec(vec![5.0f32, 6.0], &[2], Device::Cpu)?;
    w1.set_requires_grad(true);
    w2.set_requires_grad(true);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hook = |name: &'static str| {
        let seen = seen.clone();
        move |t: &Tensor| {
            seen.lock().unwrap().push((name, t.grad().unwrap().to_vec::<f32>()?));
            Ok(())
        }
    };
    let h1 = register_post_accumulate_grad_hook(&w1, hook("w1"));
    let h2 = register_post_accumulate_grad_hook(&w2, hook("w2"));
    w2.mul(&w1.mul(&x)?)?.sum_all()?.backward()?;
    // d/dw2 = w1 x = [3, 8]; d/dw1 = w2 x = [5, 12].
    assert_eq!(*seen.lock().unwrap(), vec![("w2", vec![3.0, 8.0]), ("w1", vec![5.0, 12.0])]);
    drop((h1, h2));
    w2.mul(&w1.mul(&x)?)?.sum_all()?.backward()?;
    assert_eq!(seen.lock().unwrap().len(), 2, "dropped hooks do not run");
    assert_eq!(w1.grad().unwrap().to_vec::<f32>()?, vec![10.0, 24.0], "the second backward accumulated");
    Ok(())
}
