//! Every op on hand-computed values, including broadcasting, non-contiguous inputs, empty and
//! size-1 dims, and f16/bf16 within their tolerances.

use half::{bf16, f16};
use kiln_tensor::{DType, Device, Distribution, Fused, Result, Tensor, UnaryOp};

const CPU: Device = Device::Cpu;

fn t(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape, CPU).unwrap()
}
fn v(x: &Tensor) -> Vec<f32> {
    x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}
fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()) || (x.is_nan() && y.is_nan()), "at {i}: {x} vs {y}\n{a:?}\n{b:?}");
    }
}

#[test]
fn creation() -> Result<()> {
    assert_eq!(v(&Tensor::zeros(&[2, 2], DType::F32, CPU)?), vec![0.0; 4]);
    assert_eq!(v(&Tensor::full(2.5, &[3], DType::F64, CPU)?), vec![2.5; 3]);
    assert_eq!(Tensor::arange(4, DType::I64, CPU)?.to_vec::<i64>()?, vec![0, 1, 2, 3]);
    close(&v(&Tensor::arange_step(1.0, 2.0, 0.25, DType::F32, CPU)?), &[1.0, 1.25, 1.5, 1.75], 0.0);
    let s = Tensor::scalar(3.0, DType::F32, CPU)?;
    assert_eq!((s.shape(), s.item()?), (&[][..], 3.0));
    assert!(Tensor::from_vec(vec![1.0f32; 5], &[2, 3], CPU).is_err());
    // Philox draws are reproducible from (seed, offset), and offsets index into one stream.
    let a = Tensor::rand_at(&[8], Distribution::Uniform, 42, 0, DType::F32, CPU)?;
    let b = Tensor::rand_at(&[4], Distribution::Uniform, 42, 4, DType::F32, CPU)?;
    assert_eq!(v(&a)[4..], v(&b)[..]);
    let n = Tensor::rand_at(&[20000], Distribution::Normal, 1, 0, DType::F32, CPU)?;
    let mean = n.mean_all()?.item()?;
    let var = n.var(&kiln_tensor::AllDims, false, 1)?.item()?;
    assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "{mean} {var}");
    kiln_tensor::rng::manual_seed(3);
    let r1 = v(&Tensor::rand(&[5], DType::F32, CPU)?);
    let r2 = v(&Tensor::rand(&[5], DType::F32, CPU)?);
    kiln_tensor::rng::manual_seed(3);
    assert_eq!(v(&Tensor::rand(&[5], DType::F32, CPU)?), r1);
    assert_ne!(r1, r2);
    Ok(())
}

#[test]
fn views_share_storage_and_read_correctly() -> Result<()> {
    let x = t(&[0., 1., 2., 3., 4., 5.], &[2, 3]);
    let xt = x.t()?;
    assert!(xt.same_storage(&x) && !xt.is_contiguous());
    assert_eq!(xt.shape(), &[3, 2]);
    assert_eq!(v(&xt), vec![0., 3., 1., 4., 2., 5.]);
    assert_eq!(v(&x.narrow(1, 1, 2)?), vec![1., 2., 4., 5.]);
    assert_eq!(v(&x.reshape(&[3, -1])?), vec![0., 1., 2., 3., 4., 5.]);
    assert_eq!(v(&xt.reshape(&[6])?), vec![0., 3., 1., 4., 2., 5.]); // needs a copy
    assert_eq!(v(&t(&[1., 2.], &[2, 1]).broadcast_to(&[2, 3])?), vec![1., 1., 1., 2., 2., 2.]);
    assert_eq!(x.unsqueeze(0)?.shape(), &[1, 2, 3]);
    assert_eq!(x.unsqueeze(-1)?.shape(), &[2, 3, 1]);
    assert_eq!(x.unsqueeze(1)?.squeeze(1)?.shape(), &[2, 3]);
    let p = Tensor::arange(24, DType::F32, CPU)?.reshape(&[2, 3, 4])?.permute(&[2, 0, 1])?;
    assert_eq!(p.shape(), &[4, 2, 3]);
    assert_eq!(v(&p.narrow(0, 1, 1)?), vec![1., 5., 9., 13., 17., 21.]);
    assert_eq!(p.contiguous()?.flatten(0, 1)?.shape(), &[8, 3]);
    let parts = Tensor::arange(5, DType::F32, CPU)?.split(2, 0)?;
    assert_eq!(parts.iter().map(v).collect::<Vec<_>>(), vec![vec![0., 1.], vec![2., 3.], vec![4.]]);
    assert_eq!(Tensor::arange(6, DType::F32, CPU)?.chunk(3, 0)?.len(), 3);
    Ok(())
}

#[test]
fn unary_ops_match_f64_formulas() -> Result<()> {
    let xs = [-2.0f64, -0.5, 0.0, 0.3, 1.7];
    let pos = [0.1f64, 0.5, 1.0, 2.0, 9.0];
    type Case<'a> = (UnaryOp, fn(f64) -> f64, &'a [f64]);
    let cases: Vec<Case> = vec![
        (UnaryOp::Neg, |x| -x, &xs),
        (UnaryOp::Abs, f64::abs, &xs),
        (UnaryOp::Exp, f64::exp, &xs),
        (UnaryOp::Log, f64::ln, &pos),
        (UnaryOp::Sqrt, f64::sqrt, &pos),
        (UnaryOp::Rsqrt, |x| 1.0 / x.sqrt(), &pos),
        (UnaryOp::Recip, |x| 1.0 / x, &pos),
        (UnaryOp::Sin, f64::sin, &xs),
        (UnaryOp::Cos, f64::cos, &xs),
        (UnaryOp::Tanh, f64::tanh, &xs),
        (UnaryOp::Sigmoid, |x| 1.0 / (1.0 + (-x).exp()), &xs),
        (UnaryOp::Relu, |x| x.max(0.0), &xs),
        (UnaryOp::Silu, |x| x / (1.0 + (-x).exp()), &xs),
        (UnaryOp::Square, |x| x * x, &xs),
        (UnaryOp::Sign, f64::signum, &[-2.0, 3.0]),
        (UnaryOp::Step, |x| if x > 0.0 { 1.0 } else { 0.0 }, &xs),
        (UnaryOp::GeluTanh, |x| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh()), &xs),
    ];
    for (op, f, inputs) in cases {
        let x = Tensor::from_slice(inputs, &[inputs.len()], CPU)?;
        let got = x.unary(op)?.to_vec::<f64>()?;
        let want: Vec<f64> = inputs.iter().map(|&x| f(x)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "{op:?}: {got:?} vs {want:?}");
        }
    }
    // Hand values: gelu(1) = 0.5 (1 + erf(1/sqrt 2)) = 0.841344746...; erf(0.5) = 0.520499877...
    let g = Tensor::from_slice(&[1.0f64, 0.5], &[2], CPU)?;
    assert!((g.gelu()?.to_vec::<f64>()?[0] - 0.841_344_746_068_543).abs() < 1e-12);
    assert!((g.erf()?.to_vec::<f64>()?[1] - 0.520_499_877_813_046_5).abs() < 1e-12);
    // Derivative ops against central differences.
    for (op, d) in [(UnaryOp::Gelu, UnaryOp::GeluGrad), (UnaryOp::GeluTanh, UnaryOp::GeluTanhGrad), (UnaryOp::Silu, UnaryOp::SiluGrad)] {
        let x = Tensor::from_slice(&xs, &[5], CPU)?;
        let h = 1e-6;
        let fd: Vec<f64> = x.add_scalar(h)?.unary(op)?.sub(&x.add_scalar(-h)?.unary(op)?)?.div_scalar(2.0 * h)?.to_vec()?;
        let an = x.unary(d)?.to_vec::<f64>()?;
        for (a, b) in an.iter().zip(&fd) {
            assert!((a - b).abs() < 1e-7, "{d:?}: {an:?} vs {fd:?}");
        }
    }
    close(&v(&t(&[4.0, 9.0], &[2]).powf(0.5)?), &[2.0, 3.0], 1e-6);
    Ok(())
}

/// Floats of two dtypes meet in the wider one (PyTorch's promotion); under autocast, products
/// stay in the low dtype and softmax, layer norm and cross-entropy compute in F32.
#[test]
fn mixed_float_dtypes_promote_and_autocast_keeps_products_low() -> Result<()> {
    let a = t(&[1.5, -2.0, 3.25], &[3]);
    let (b, h) = (a.to_dtype(DType::BF16)?, a.to_dtype(DType::F16)?);
    let sum = a.add(&b)?;
    assert_eq!((sum.dtype(), v(&sum)), (DType::F32, vec![3.0, -4.0, 6.5]));
    assert_eq!(b.mul(&h)?.dtype(), DType::F32);
    assert_eq!(a.to_dtype(DType::F64)?.sub(&b)?.dtype(), DType::F64);
    assert!(a.add(&Tensor::arange(3, DType::I64, CPU)?).is_err(), "integers do not promote");
    let _ac = kiln_tensor::Autocast::new(DType::BF16)?;
    let m = t(&[1., 2., 3., 4.], &[2, 2]);
    let p = m.matmul(&m)?;
    assert_eq!((p.dtype(), v(&p)), (DType::BF16, vec![7., 10., 15., 22.]));
    let s = p.softmax(-1)?;
    assert_eq!(s.dtype(), DType::F32);
    close(&v(&s), &[0.047_425_87, 0.952_574_1, 0.000_911_051_2, 0.999_089], 1e-6);
    Ok(())
}

#[test]
fn binary_ops_broadcast_like_numpy() -> Result<()> {
    let a = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let row = t(&[10., 20., 30.], &[3]);
    let col = t(&[100., 200.], &[2, 1]);
    assert_eq!(v(&a.add(&row)?), vec![11., 22., 33., 14., 25., 36.]);
    assert_eq!(v(&a.add(&col)?), vec![101., 102., 103., 204., 205., 206.]);
    assert_eq!(v(&col.sub(&row)?), vec![90., 80., 70., 190., 180., 170.]);
    assert_eq!(v(&a.mul(&row)?), vec![10., 40., 90., 40., 100., 180.]);
    assert_eq!(v(&a.div(&col)?), vec![0.01, 0.02, 0.03, 0.02, 0.025, 0.03]);
    assert_eq!(v(&t(&[2., 3.], &[2]).pow(&t(&[3., 2.], &[2]))?), vec![8., 9.]);
    assert_eq!(v(&a.maximum(&t(&[3.], &[1]))?), vec![3., 3., 3., 4., 5., 6.]);
    assert_eq!(v(&a.minimum(&t(&[3.], &[1]))?), vec![1., 2., 3., 3., 3., 3.]);
    let masks = [a.eq(&row.div_scalar(10.0)?)?, a.gt_scalar(3.0)?, a.le_scalar(2.0)?, a.ne_scalar(2.0)?];
    assert!(masks.iter().all(|m| m.dtype() == DType::U8));
    assert_eq!(masks[0].to_vec::<u8>()?, vec![1, 1, 1, 0, 0, 0]);
    assert_eq!(masks[1].to_vec::<u8>()?, vec![0, 0, 0, 1, 1, 1]);
    assert_eq!(masks[2].to_vec::<u8>()?, vec![1, 1, 0, 0, 0, 0]);
    assert_eq!(masks[3].to_vec::<u8>()?, vec![1, 0, 1, 1, 1, 1]);
    assert_eq!(a.lt(&col.div_scalar(50.0)?)?.to_vec::<u8>()?, vec![1, 0, 0, 0, 0, 0]); // [[1,2,3]] < 2, [[4,5,6]] < 4
    assert_eq!(a.ge(&a)?.to_vec::<u8>()?, vec![1; 6]);
    // Scalar forms, both sides.
    assert_eq!(v(&a.rsub_scalar(1.0)?), vec![0., -1., -2., -3., -4., -5.]);
    assert_eq!(v(&t(&[2., 4.], &[2]).rdiv_scalar(8.0)?), vec![4., 2.]);
    assert_eq!(v(&(&a * 2.0)?), vec![2., 4., 6., 8., 10., 12.]);
    assert_eq!(v(&(&a - &a)?), vec![0.; 6]);
    // Non-contiguous operands: a transposed lhs plus an expanded rhs.
    let at = a.t()?; // [3, 2]: [[1,4],[2,5],[3,6]]
    assert_eq!(v(&at.add(&col.reshape(&[1, 2])?)?), vec![101., 204., 102., 205., 103., 206.]);
    assert_eq!(v(&at.mul(&at)?), vec![1., 16., 4., 25., 9., 36.]);
    // Empty and size-1 dims.
    let e = Tensor::zeros(&[0, 3], DType::F32, CPU)?;
    assert_eq!(e.add(&row)?.shape(), &[0, 3]);
    assert_eq!(t(&[5.], &[1, 1]).add(&a)?.shape(), &[2, 3]);
    // where with a broadcast condition.
    let cond = Tensor::from_slice(&[1u8, 0, 1], &[3], CPU)?;
    assert_eq!(v(&Tensor::where_cond(&cond, &a, &Tensor::zeros(&[1], DType::F32, CPU)?)?), vec![1., 0., 3., 4., 0., 6.]);
    // Integers compute exactly.
    let i = Tensor::from_slice(&[7i64, -3], &[2], CPU)?;
    assert_eq!(i.mul(&i)?.to_vec::<i64>()?, vec![49, 9]);
    assert_eq!(i.add_scalar(1.0)?.to_vec::<i64>()?, vec![8, -2]);
    Ok(())
}

#[test]
fn large_tensors_take_the_parallel_paths() -> Result<()> {
    let n = 1 << 17;
    let x = Tensor::arange(n, DType::F32, CPU)?;
    let y = x.mul_scalar(2.0)?.add(&x)?; // 3x
    let got = v(&y);
    assert!(got.iter().enumerate().all(|(i, &g)| g == 3.0 * i as f32));
    let m = x.reshape(&[256, 512])?;
    let mt = m.t()?.add_scalar(1.0)?; // strided parallel path
    assert_eq!(v(&mt)[..3], [1.0, 513.0, 1025.0]);
    let s = m.sum(&[1], false)?; // each row: sum of 512 consecutive ints
    let r0: f64 = (0..512).map(|i| i as f64).sum();
    assert_eq!(v(&s)[0] as f64, r0);
    Ok(())
}

#[test]
fn reductions() -> Result<()> {
    let a = t(&[1., 5., 3., 4., 2., 6.], &[2, 3]);
    assert_eq!(v(&a.sum(&[0], false)?), vec![5., 7., 9.]);
    assert_eq!(v(&a.sum(&[1], true)?), vec![9., 12.]);
    assert_eq!(a.sum(&[1], true)?.shape(), &[2, 1]);
    assert_eq!(v(&a.sum_all()?), vec![21.]);
    assert_eq!(v(&a.sum(&[-1, 0], false)?), vec![21.]);
    assert_eq!(v(&a.max(&[1], false)?), vec![5., 6.]);
    assert_eq!(v(&a.min(&[0], false)?), vec![1., 2., 3.]);
    assert_eq!(a.argmax(1, false)?.to_vec::<i64>()?, vec![1, 2]);
    assert_eq!(a.argmin(0, false)?.to_vec::<i64>()?, vec![0, 1, 0]);
    close(&v(&a.mean(&[0], false)?), &[2.5, 3.5, 4.5], 1e-7);
    // var of [1,5,3] = mean 3, squared deviations 4+4+0 = 8, /2 unbiased = 4, /3 biased.
    // [4,2,6]: mean 4, deviations 0+4+4 = 8 as well.
    close(&v(&a.var(&[1], false, 1)?), &[4.0, 4.0], 1e-6);
    close(&v(&a.var(&[1], false, 0)?), &[8.0 / 3.0, 8.0 / 3.0], 1e-6);
    // Over a transposed view and over several dims.
    let at = a.t()?;
    assert_eq!(v(&at.sum(&[0], false)?), vec![9., 12.]);
    let b = Tensor::arange(24, DType::F32, CPU)?.reshape(&[2, 3, 4])?;
    assert_eq!(v(&b.sum(&[0, 2], false)?), vec![60., 92., 124.]);
    // Empty sums are 0; max over an empty dim is an error.
    let e = Tensor::zeros(&[2, 0], DType::F32, CPU)?;
    assert_eq!(v(&e.sum(&[1], false)?), vec![0., 0.]);
    assert!(e.max(&[1], false).is_err());
    // NaN propagates through max like torch.max.
    let n = t(&[1., f32::NAN, 3.], &[3]);
    assert!(v(&n.max(&[0], false)?)[0].is_nan());
    Ok(())
}

#[test]
fn softmax_and_log_softmax() -> Result<()> {
    let x = t(&[1., 2., 3., 1000., 1000., 1000.], &[2, 3]);
    let e = [1f64.exp(), 2f64.exp(), 3f64.exp()];
    let z: f64 = e.iter().sum();
    let want: Vec<f32> = e.iter().map(|v| (v / z) as f32).chain([1. / 3.; 3]).collect();
    close(&v(&x.softmax(-1)?), &want, 1e-6);
    let lw: Vec<f32> = want.iter().map(|p| p.ln()).collect();
    close(&v(&x.log_softmax(1)?), &lw, 1e-5);
    // Along dim 0 of a transposed view.
    close(&v(&x.t()?.softmax(0)?.t()?.contiguous()?), &want, 1e-6);
    // Scaled and causal: row i keeps entries j <= i of softmax(0.5 x).
    let c = t(&[1., 2., 3., 1., 2., 3.], &[2, 3]);
    let (a, b) = (0.5f64.exp(), 1f64.exp());
    close(&v(&c.softmax_scaled(0.5, true)?), &[1.0, 0.0, 0.0, (a / (a + b)) as f32, (b / (a + b)) as f32, 0.0], 1e-6);
    assert!(c.reshape(&[6])?.softmax_scaled(1.0, true).is_err(), "causal needs a matrix");
    Ok(())
}

#[test]
fn normalize_and_its_backward() -> Result<()> {
    // Row [1, 2, 3, 4]: mean 2.5, biased variance 1.25.
    let x = t(&[1., 2., 3., 4., 5., 5., 5., 5.], &[2, 4]);
    let r = 1.0 / (1.25f64 + 1e-5).sqrt();
    let want: Vec<f32> = [-1.5, -0.5, 0.5, 1.5].iter().map(|d| (d * r) as f32).chain([0.0; 4]).collect();
    close(&v(&x.normalize(1e-5)?), &want, 1e-6);
    // A constant gradient has no component the normalisation keeps: dx = 0.
    let g = t(&[1.0; 8], &[2, 4]);
    close(&v(&x.normalize_backward(&g, 1e-5)?), &[0.0; 8], 1e-6);
    // g = xhat: dx = rstd (xhat - 0 - xhat * mean(xhat^2)) = rstd xhat (1 - 1 + eps rstd^2).
    let gx = x.normalize(1e-5)?.narrow(0, 0, 1)?;
    let dx = v(&x.narrow(0, 0, 1)?.normalize_backward(&gx, 1e-5)?);
    let shrink = 1.0 - 1.25 * r * r;
    let expect: Vec<f32> = [-1.5, -0.5, 0.5, 1.5].iter().map(|d| (r * d * r * shrink) as f32).collect();
    close(&dx, &expect, 1e-6);
    assert!(x.normalize_backward(&g.narrow(1, 0, 2)?, 1e-5).unwrap_err().to_string().contains("one shape"));
    Ok(())
}

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

#[test]
fn bf16_products_of_views_at_an_offset_match_f32() -> Result<()> {
    // Small integers are exact in BF16, so the products must equal F32's exactly: q and k are
    // column slices of one packed buffer (as attention's from qkv), k read transposed.
    let data: Vec<f32> = (0..2 * 5 * 12).map(|i| (i % 7) as f32 - 3.0).collect();
    let packed = t(&data, &[2, 5, 12]);
    let q = packed.narrow(2, 4, 4)?;
    let k = packed.narrow(2, 8, 4)?.transpose(1, 2)?;
    let want = q.matmul(&k)?;
    let got = q.to_dtype(DType::BF16)?.matmul(&k.to_dtype(DType::BF16)?)?;
    assert_eq!(v(&got.to_dtype(DType::F32)?), v(&want));
    let pb = packed.to_dtype(DType::BF16)?;
    let got = pb.narrow(2, 4, 4)?.matmul(&pb.narrow(2, 8, 4)?.transpose(1, 2)?)?;
    assert_eq!(v(&got.to_dtype(DType::F32)?), v(&want));
    Ok(())
}

#[test]
fn matmul_with_bias_adds_it_to_every_row() -> Result<()> {
    let a = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let b = t(&[7., 8., 9., 10., 11., 12.], &[3, 2]);
    let bias = t(&[0.5, -1.0], &[2]);
    assert_eq!(v(&a.matmul_bias(&b, &bias)?), vec![58.5, 63., 139.5, 153.]);
    // F.linear: x @ W^T + b, batched rows, an empty inner dim (the output is the bias).
    let x = Tensor::arange(12, DType::F32, CPU)?.reshape(&[2, 2, 3])?;
    let w = b.t()?.contiguous()?;
    assert_eq!(v(&x.linear(&w, Some(&bias))?), v(&x.matmul(&b)?.add(&bias)?));
    assert_eq!(v(&x.linear(&w, None)?), v(&x.matmul(&b)?));
    let empty = Tensor::zeros(&[2, 0], DType::F32, CPU)?.matmul_bias(&Tensor::zeros(&[0, 2], DType::F32, CPU)?, &bias)?;
    assert_eq!(v(&empty), vec![0.5, -1.0, 0.5, -1.0]);
    // BF16 and F64 take the same path.
    let bf = a.to_dtype(DType::BF16)?.matmul_bias(&b.to_dtype(DType::BF16)?, &bias.to_dtype(DType::BF16)?)?;
    // 139.5 rounds to even in BF16's 8-bit significand: 140.
    assert_eq!(v(&bf.to_dtype(DType::F32)?), vec![58.5, 63., 140., 153.]);
    let f64 = a.to_dtype(DType::F64)?.matmul_bias(&b.to_dtype(DType::F64)?, &bias.to_dtype(DType::F64)?)?;
    assert_eq!(f64.to_vec::<f64>()?, vec![58.5, 63., 139.5, 153.]);
    // A bias of the wrong length or dtype names the shapes and dtypes.
    let err = a.matmul_bias(&b, &t(&[1., 2., 3.], &[3])).unwrap_err().to_string();
    assert!(err.contains("must be [2]") && err.contains("[3]"), "{err}");
    let err = a.matmul_bias(&b, &bias.to_dtype(DType::F64)?).unwrap_err().to_string();
    assert!(err.contains("F64"), "{err}");
    Ok(())
}

/// A short, wide product large enough that its columns split over the threads
/// (`matmul::split_cols`), with a bias and with a transposed right operand: small integers,
/// so every sum is exact and the result must equal the naive product.
#[test]
fn short_wide_products_split_by_columns_match_the_naive_product() -> Result<()> {
    let (m, k, n) = (8, 300, 1000);
    let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
    let bias: Vec<f32> = (0..n).map(|j| (j % 4) as f32).collect();
    let mut want = naive_matmul(&a, &b, m, k, n);
    want.iter_mut().enumerate().for_each(|(i, w)| *w += bias[i % n]);
    let (ta, tb) = (t(&a, &[m, k]), t(&b, &[k, n]));
    assert_eq!(v(&ta.matmul_bias(&tb, &t(&bias, &[n]))?), want);
    let bt = tb.t()?.contiguous()?.t()?; // the same values through strides (n, 1) -> (1, k)
    assert_eq!(v(&ta.matmul(&bt)?.add(&t(&bias, &[n]))?), want);
    Ok(())
}

/// `Fused::Matmul` (what compile's fusion makes) on hand-computed values.
/// Layer norm's weight and bias gradients in one op, against the ops it replaces.
#[test]
fn layer_norm_param_grads_match_the_composite() -> Result<()> {
    let x = Tensor::rand_at(&[2, 3, 5], Distribution::Normal, 7, 0, DType::F32, CPU)?;
    let g = Tensor::rand_at(&[2, 3, 5], Distribution::Normal, 8, 0, DType::F32, CPU)?;
    let both = x.layer_norm_param_grads(&g, 1e-5)?;
    assert_eq!(both.shape(), &[2, 5]);
    assert_eq!(v(&both.narrow(0, 0, 1)?), v(&g.mul(&x.normalize(1e-5)?)?.sum(&[0, 1], false)?));
    assert_eq!(v(&both.narrow(0, 1, 1)?), v(&g.sum(&[0, 1], false)?));
    // By hand for one row [1, 3] (mean 2, variance 1, so xhat = [-1, 1] with eps 0).
    let one = t(&[1., 3.], &[1, 2]).layer_norm_param_grads(&t(&[2., 5.], &[1, 2]), 0.0)?;
    assert_eq!(v(&one), vec![-2., 5., 2., 5.]);
    let err = x.layer_norm_param_grads(&g.narrow(2, 0, 4)?, 1e-5).unwrap_err().to_string();
    assert!(err.contains("[2, 3, 5]") && err.contains("[2, 3, 4]"), "{err}");
    // With the weight and a residual gradient r: x's gradient plus r (compile's fold on a
    // GPU), the parameter gradients as without r; r must be x's shape.
    use kiln_tensor::Op;
    let (w, r) = (t(&[0.5, -1., 2., 1.5, 3.], &[5]), Tensor::rand_at(&[2, 3, 5], Distribution::Normal, 9, 0, DType::F32, CPU)?);
    let fused = |sums, copy| Op::Fused(Fused::LayerNormGrads { eps: 1e-5, sums, copy });
    let grads = |ins: &[&Tensor]| Tensor::apply(fused(None, None), ins, CPU);
    let three = Tensor::apply(Op::LayerNormGrads { eps: 1e-5 }, &[&x, &g, &w], CPU)?;
    let four = grads(&[&x, &g, &w, &r])?;
    assert_eq!(v(&grads(&[&x, &g, &w])?), v(&three));
    use kiln_tensor::op::{Part, Parts};
    let dx_at = |x: &[usize], sums: bool| Parts::layer_norm_grads(x, sums).offset(Part::Dx).unwrap();
    let at = dx_at(&[2, 3, 5], false);
    assert_eq!(v(&four.narrow(0, 0, at)?), v(&three.narrow(0, 0, at)?));
    let dx = x.layer_norm_backward(&g, &w, 1e-5)?;
    assert_eq!(v(&four.narrow(0, at, 30)?), v(&dx.add(&r)?.reshape(&[30])?));
    let err = grads(&[&x, &g, &w, &r.narrow(2, 0, 4)?]).unwrap_err().to_string();
    assert!(err.contains("residual") && err.contains("[2, 3, 4]"), "{err}");
    // With the sums row (BF16): the column sums of dx + r as rounded to BF16, then x's
    // gradient (from 64 here too: 15 values fit before it).
    let sums = Tensor::apply(fused(Some(DType::BF16), None), &[&x, &g, &w, &r], CPU)?;
    let low = dx.add(&r)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
    let to = dx_at(&[2, 3, 5], true);
    assert_eq!((at, to), (64, 64));
    assert_eq!(v(&sums.narrow(0, 0, 10)?), v(&four.narrow(0, 0, 10)?));
    close(&v(&sums.narrow(0, 10, 5)?), &v(&low.sum(&[0, 1], false)?), 1e-6);
    assert_eq!(v(&sums.narrow(0, to, 30)?), v(&four.narrow(0, at, 30)?));
    // Rounded before it is summed: unlike the sums of dx + r itself (r's values are not BF16's).
    assert_ne!(v(&sums.narrow(0, 10, 5)?), v(&dx.add(&r)?.sum(&[0, 1], false)?));
    // A wide row moves x's gradient: [3, 32] fills 96 values, so it starts at 128 (64 without).
    assert_eq!((dx_at(&[4, 32], false), dx_at(&[4, 32], true)), (64, 128));
    // With a copy: the flat output unchanged, and x's gradient plus r cast to BF16 beside it.
    let with_copy = fused(Some(DType::BF16), Some(DType::BF16));
    let (flat, copy) = kiln_tensor::fused::layer_norm_grads_with_copy(&with_copy, &[&x, &g, &w, &r])?;
    assert_eq!(v(&flat), v(&sums));
    assert_eq!((copy.shape(), copy.dtype()), (&[2, 3, 5][..], DType::BF16));
    assert_eq!(v(&copy), v(&dx.add(&r)?.to_dtype(DType::BF16)?));
    let err = kiln_tensor::fused::layer_norm_grads_with_copy(&fused(None, None), &[&x, &g, &w]).unwrap_err().to_string();
    assert!(err.contains("copy"), "{err}");
    for bad in
        [Tensor::apply(fused(None, Some(DType::F32)), &[&x, &g, &w], CPU), Tensor::apply(fused(Some(DType::I64), None), &[&x, &g, &w], CPU)]
    {
        let err = bad.unwrap_err().to_string();
        assert!(err.contains("sums row") || err.contains("copy of x's gradient"), "{err}");
    }
    // The fused form always has the weight.
    let err = Tensor::apply(fused(Some(DType::BF16), None), &[&x, &g], CPU).unwrap_err().to_string();
    assert!(err.contains("layer_norm_grads_fused"), "{err}");
    Ok(())
}

#[test]
fn gated_sums_make_an_activation_gradient_and_its_row_sums() -> Result<()> {
    use kiln_tensor::Op;
    let gated = |ins: &[&Tensor]| Tensor::apply(Op::Fused(Fused::GatedSums { gate: UnaryOp::SiluGrad }), ins, CPU);
    // By hand at h = 0 (SiLU's gradient 1/2) and h = 2 (sigmoid(2) (1 + 2 (1 - sigmoid(2))) = 1.0907842).
    let (a, h) = (t(&[2., -4., 6., 8.], &[2, 2]), t(&[0., 2., 0., 2.], &[2, 2]));
    let out = v(&gated(&[&a, &h])?);
    assert_eq!(out.len(), 64 + 2);
    close(&out[..4], &[1., -4.363137, 3., 8.726274], 1e-6);
    close(&out[64..], &[4., 4.363137], 1e-6);
    // BF16 as the two ops and the sum store it, [2, 3, 5] rows.
    let a = Tensor::rand_at(&[2, 3, 5], Distribution::Normal, 1, 0, DType::F32, CPU)?.to_dtype(DType::BF16)?;
    let h = Tensor::rand_at(&[2, 3, 5], Distribution::Normal, 2, 0, DType::F32, CPU)?.to_dtype(DType::BF16)?;
    let f = Tensor::apply(Op::Fused(Fused::GatedSums { gate: UnaryOp::GeluGrad }), &[&a, &h], CPU)?;
    assert_eq!((f.shape(), f.dtype()), (&[64 + 5][..], DType::BF16));
    let y = a.mul(&h.unary(UnaryOp::GeluGrad)?)?;
    assert_eq!(v(&f.narrow(0, 0, 30)?), v(&y.reshape(&[30])?));
    assert_eq!(v(&f.narrow(0, 64, 5)?), v(&y.sum(&[0, 1], false)?));
    // No rows: zero sums.
    let none = Tensor::zeros(&[0, 3], DType::F32, CPU)?;
    assert_eq!(v(&gated(&[&none, &none])?), vec![0.; 3]);
    let err = gated(&[&a, &h.narrow(2, 0, 4)?]).unwrap_err().to_string();
    assert!(err.contains("[2, 3, 5]") && err.contains("[2, 3, 4]"), "{err}");
    Ok(())
}

#[test]
fn fused_matmuls_apply_relu_or_append_the_operand_sums() -> Result<()> {
    use kiln_tensor::{MatmulEpilogue as E, Op};
    let fused = |e: E, ins: &[&Tensor]| Tensor::apply(Op::Fused(Fused::Matmul(e)), ins, CPU);
    let a = t(&[1., 2., 3., 4.], &[2, 2]);
    let b = t(&[1., -1., 0., 0., 1., -2.], &[2, 3]);
    let bias = t(&[0.5, -10., 1.], &[3]);
    // a @ b = [[1, 1, -4], [3, 1, -8]].
    assert_eq!(v(&fused(E::Relu, &[&a, &b])?), vec![1., 1., 0., 3., 1., 0.]);
    assert_eq!(v(&fused(E::Relu, &[&a, &b, &bias])?), vec![1.5, 0., 0., 3.5, 0., 0.]);
    // The product, zeros up to element 64, then the sums: a's rows [3, 7], b's columns [1, 0, -2].
    let left = fused(E::SumLeft, &[&a, &b])?;
    assert_eq!(left.shape(), &[66]);
    let lv = v(&left);
    assert_eq!((&lv[..6], &lv[6..64], &lv[64..]), (&[1., 1., -4., 3., 1., -8.][..], &[0.; 58][..], &[3., 7.][..]));
    let right = v(&fused(E::SumRight, &[&a, &b])?);
    assert_eq!((right.len(), &right[64..]), (67, &[1., 0., -2.][..]));
    // A product of no columns: only a's row sums remain.
    let none = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu)?;
    assert_eq!(v(&fused(E::SumLeft, &[&a, &none])?), vec![3., 7.]);
    // A transposed left operand (a weight gradient g^T x): sums of g's columns.
    let g = t(&[1., 2., 3., 4., 5., 6.], &[3, 2]);
    let x = t(&[1., 0., 0., 1., 1., 1.], &[3, 2]);
    let wg = v(&fused(E::SumLeft, &[&g.t()?, &x])?);
    assert_eq!((&wg[..4], &wg[64..]), (&[6., 8., 8., 10.][..], &[9., 12.][..]));
    // GELU (tanh form) with its pre-activation after it, and the product by its gradient, as
    // the unfused ops compute them.
    let h = a.matmul_bias(&b, &bias)?;
    let gelu = v(&fused(E::GeluTanh, &[&a, &b, &bias])?);
    assert_eq!((gelu.len(), &gelu[..6], &gelu[64..]), (70, &v(&h.gelu_tanh()?)[..], &v(&h)[..]));
    let dg = fused(E::DGeluTanh, &[&a, &b, &h])?;
    assert_eq!(v(&dg), v(&a.matmul(&b)?.mul(&h.unary(UnaryOp::GeluTanhGrad)?)?));
    let step = Tensor::from_vec(vec![1.0f32, -1.0, 0.0, 2.0, 3.0, -0.5], &[2, 3], Device::Cpu)?;
    let dr = fused(E::DRelu, &[&a, &b, &step])?;
    assert_eq!(v(&dr), v(&a.matmul(&b)?.mul(&step.unary(UnaryOp::Step)?)?));
    let err = fused(E::DGeluTanh, &[&a, &b, &a]).unwrap_err().to_string();
    assert!(err.contains("[2, 2]") && err.contains("[2, 3]"), "{err}");
    // Sums need 2-D operands, and no bias.
    let err = fused(E::SumLeft, &[&a.reshape(&[1, 2, 2])?, &b]).unwrap_err().to_string();
    assert!(err.contains("matmul_sum") && err.contains("[1, 2, 2]"), "{err}");
    assert!(fused(E::SumRight, &[&a, &b, &bias]).is_err());
    // A residual added after the bias: inputs a, b, r, then the bias.
    let r = t(&[10., 20., 30., 40., 50., 60.], &[2, 3]);
    assert_eq!(v(&fused(E::Residual, &[&a, &b, &r])?), vec![11., 21., 26., 43., 51., 52.]);
    assert_eq!(v(&fused(E::Residual, &[&a, &b, &r, &bias])?), vec![11.5, 11., 27., 43.5, 41., 53.]);
    let err = fused(E::Residual, &[&a, &b, &a]).unwrap_err().to_string();
    assert!(err.contains("matmul_residual") && err.contains("[2, 2]") && err.contains("[2, 3]"), "{err}");
    // A BF16 product joining an F32 residual (autocast's): F32 out, the product rounded first
    // on the CPU as eager rounds it; an F64 residual under a BF16 product is refused.
    let (ah, bh, biash) = (a.to_dtype(DType::BF16)?, b.mul_scalar(1.01)?.to_dtype(DType::BF16)?, bias.to_dtype(DType::BF16)?);
    let wide = fused(E::Residual, &[&ah, &bh, &r, &biash])?;
    assert_eq!(wide.dtype(), DType::F32);
    assert_eq!(v(&wide), v(&ah.matmul_bias(&bh, &biash)?.to_dtype(DType::F32)?.add(&r)?));
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let unrounded = fused(E::Residual, &[&f32(&ah)?, &f32(&bh)?, &r, &f32(&biash)?])?;
    assert_ne!(v(&wide), v(&unrounded), "the product is rounded to BF16");
    // An F32 bias (autocast's parameter, as compile's fusion reads it) is added after the widening.
    let late = fused(E::Residual, &[&ah, &bh, &r, &bias])?;
    assert_eq!(v(&late), v(&ah.matmul(&bh)?.to_dtype(DType::F32)?.add(&bias)?.add(&r)?));
    let err = fused(E::Residual, &[&ah, &bh, &r.to_dtype(DType::F64)?]).unwrap_err().to_string();
    assert!(err.contains("BF16") && err.contains("F64"), "{err}");
    let err = fused(E::Residual, &[&ah, &bh, &r, &bias.to_dtype(DType::F64)?]).unwrap_err().to_string();
    assert!(err.contains("BF16") && err.contains("F64"), "{err}");
    Ok(())
}

/// `Op::Attention` with the heads last (what compile writes for an output projection): the
/// plain output with its heads moved after T, and only for `[B, H, T, D]`.
#[test]
fn attention_with_the_heads_last_moves_them_after_t() -> Result<()> {
    use kiln_tensor::Op;
    let r = |s: u64| Tensor::rand_at(&[2, 3, 5, 4], Distribution::Normal, s, 0, DType::F32, CPU);
    let (q, k, w) = (r(1)?, r(2)?, r(3)?);
    let last = Tensor::apply(Op::Fused(Fused::AttentionHeadsLast { scale: 0.5, causal: true }), &[&q, &k, &w], CPU)?;
    assert_eq!(last.shape(), &[2, 5, 3, 4]);
    assert_eq!(v(&last), v(&q.attention(&k, &w, 0.5, true)?.transpose(1, 2)?.contiguous()?));
    let flat = q.reshape(&[6, 5, 4])?;
    let err = Tensor::apply(Op::Fused(Fused::AttentionHeadsLast { scale: 0.5, causal: true }), &[&flat, &flat, &flat], CPU).unwrap_err();
    assert!(err.to_string().contains("[6, 5, 4]"), "{err}");
    Ok(())
}

/// `Fused::CrossEntropyMean` (compile's fused mean loss and gradient) on hand-computed values.
#[test]
fn fused_mean_cross_entropy_gives_the_loss_then_its_gradient() -> Result<()> {
    use kiln_tensor::Op;
    let logits = t(&[0., 0., 0., 0., 1., 2.], &[3, 2]);
    let targets = Tensor::from_vec(vec![0i64, -100, 1], &[3], CPU)?;
    let op = Op::Fused(Fused::CrossEntropyMean { ignore_index: Some(-100), smoothing: 0.0 });
    let out = v(&Tensor::apply(op.clone(), &[&logits, &targets], CPU)?);
    assert_eq!(out.len(), 64 + 6);
    // Row 0: ln 2; row 1 ignored; row 2: ln(1 + 1/e). Two real targets.
    let e = std::f32::consts::E;
    close(&out[..1], &[(2f32.ln() + (1. + 1. / e).ln()) / 2.], 1e-6);
    assert!(out[1..64].iter().all(|&x| x == 0.0));
    // (softmax - one-hot) / 2 on the real rows.
    let p = 1. / (1. + e);
    close(&out[64..], &[-0.25, 0.25, 0., 0., p / 2., -p / 2.], 1e-6);
    let err = Tensor::apply(op, &[&logits, &targets.narrow(0, 0, 2)?], CPU).unwrap_err().to_string();
    assert!(err.contains("[3, 2]") && err.contains("[2]"), "{err}");
    Ok(())
}

#[test]
fn matmul_small_batched_broadcast_and_transposed() -> Result<()> {
    let a = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let b = t(&[7., 8., 9., 10., 11., 12.], &[3, 2]);
    assert_eq!(v(&a.matmul(&b)?), vec![58., 64., 139., 154.]);
    // Transposed operands need no copy and give the same product.
    assert_eq!(v(&b.t()?.matmul(&a.t()?)?), vec![58., 139., 64., 154.]);
    // Batched with a broadcast rhs.
    let ab = Tensor::arange(12, DType::F32, CPU)?.reshape(&[2, 2, 3])?;
    let out = ab.matmul(&b)?;
    assert_eq!(out.shape(), &[2, 2, 2]);
    let av = v(&ab);
    let bv = v(&b);
    let want: Vec<f32> = (0..2).flat_map(|i| naive_matmul(&av[i * 6..i * 6 + 6], &bv, 2, 3, 2)).collect();
    assert_eq!(v(&out), want);
    // Vectors are promoted like torch.matmul.
    let x = t(&[1., 1., 1.], &[3]);
    assert_eq!(v(&a.matmul(&x)?), vec![6., 15.]);
    assert_eq!(x.matmul(&x)?.shape(), &[0usize; 0]);
    // A larger product checks the threaded gemm path against the naive loop.
    let (m, k, n) = (67, 130, 45);
    let a = Tensor::rand_at(&[m, k], Distribution::Normal, 9, 0, DType::F32, CPU)?;
    let b = Tensor::rand_at(&[k, n], Distribution::Normal, 9, 100_000, DType::F32, CPU)?;
    close(&v(&a.matmul(&b)?), &naive_matmul(&v(&a), &v(&b), m, k, n), 1e-4);
    // Mid-sized products have their rows split over the threads (an odd row count leaves a
    // short last piece), with and without a bias, and with a transposed left operand.
    let (m2, k2, n2) = (67, 300, 257);
    let a2 = Tensor::rand_at(&[m2, k2], Distribution::Normal, 10, 0, DType::F32, CPU)?;
    let b2 = Tensor::rand_at(&[k2, n2], Distribution::Normal, 10, 100_000, DType::F32, CPU)?;
    let bias = Tensor::rand_at(&[n2], Distribution::Normal, 10, 200_000, DType::F32, CPU)?;
    let want = naive_matmul(&v(&a2), &v(&b2), m2, k2, n2);
    close(&v(&a2.matmul(&b2)?), &want, 1e-4);
    close(&v(&a2.t()?.contiguous()?.t()?.matmul(&b2)?), &want, 1e-4);
    let with_bias: Vec<f32> = want.iter().enumerate().map(|(i, w)| w + v(&bias)[i % n2]).collect();
    close(&v(&a2.matmul_bias(&b2, &bias)?), &with_bias, 1e-4);
    // Half precision within its tolerance.
    for dt in [DType::F16, DType::BF16, DType::F64] {
        let got = v(&a.to_dtype(dt)?.matmul(&b.to_dtype(dt)?)?);
        let tol = if dt == DType::F64 { 1e-5 } else { 3e-2 };
        let want = naive_matmul(&v(&a.to_dtype(dt)?), &v(&b.to_dtype(dt)?), m, k, n);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()) + if dt == DType::F64 { 0.0 } else { 0.1 }, "{dt:?}: {g} vs {w}");
        }
    }
    // k = 0 gives zeros.
    let z = Tensor::zeros(&[2, 0], DType::F32, CPU)?.matmul(&Tensor::zeros(&[0, 3], DType::F32, CPU)?)?;
    assert_eq!(v(&z), vec![0.; 6]);
    Ok(())
}

/// 16-bit index_add and scatter_add accumulate in F32 and round once: a thousand BF16 0.01s
/// into one row sum to 10 (bf16 of 10.0098); rounded at every add, the sum stalled at 4, where
/// 0.01 is under half a BF16 step.
#[test]
fn half_index_adds_accumulate_in_f32() -> Result<()> {
    let hundredth = bf16::from_f32(0.01).to_f32();
    let src = Tensor::full(hundredth as f64, &[1000, 2], DType::F32, CPU)?.to_dtype(DType::BF16)?;
    let ids = Tensor::zeros(&[1000], DType::I64, CPU)?;
    let want = bf16::from_f32(1000.0 * hundredth).to_f32();
    assert_eq!(want, 10.0);
    for dt in [DType::BF16, DType::F16] {
        let base = Tensor::zeros(&[2, 2], dt, CPU)?;
        let summed = base.index_add(0, &ids, &src.to_dtype(dt)?)?;
        assert_eq!(summed.dtype(), dt);
        let expect = if dt == DType::BF16 { want } else { f16::from_f32(1000.0 * f16::from_f32(hundredth).to_f32()).to_f32() };
        assert_eq!(v(&summed.to_dtype(DType::F32)?), vec![expect, expect, 0.0, 0.0], "{dt:?}");
        let scattered = base.scatter_add(0, &Tensor::zeros(&[1000, 2], DType::I64, CPU)?, &src.to_dtype(dt)?)?;
        assert_eq!(v(&scattered.to_dtype(DType::F32)?), vec![expect, expect, 0.0, 0.0], "{dt:?} scatter_add");
    }
    Ok(())
}

#[test]
fn indexing_ops() -> Result<()> {
    let w = t(&[0., 1., 10., 11., 20., 21.], &[3, 2]);
    let ids = Tensor::from_slice(&[2i64, 0, 2], &[3], CPU)?;
    assert_eq!(v(&w.index_select(0, &ids)?), vec![20., 21., 0., 1., 20., 21.]);
    assert_eq!(v(&w.index_select(1, &Tensor::from_slice(&[1i64], &[1], CPU)?)?), vec![1., 11., 21.]);
    let e = w.embedding(&Tensor::from_slice(&[1i64, 2, 0, 1], &[2, 2], CPU)?)?;
    assert_eq!(e.shape(), &[2, 2, 2]);
    assert_eq!(v(&e), vec![10., 11., 20., 21., 0., 1., 10., 11.]);
    let acc = Tensor::zeros(&[3, 2], DType::F32, CPU)?.index_add(0, &ids, &t(&[1., 1., 2., 2., 3., 3.], &[3, 2]))?;
    assert_eq!(v(&acc), vec![2., 2., 0., 0., 4., 4.]);
    // gather picks one entry per row, like cross-entropy's target lookup.
    let logits = t(&[0.1, 0.2, 0.3, 1.1, 1.2, 1.3], &[2, 3]);
    let tgt = Tensor::from_slice(&[2i64, 0], &[2, 1], CPU)?;
    close(&v(&logits.gather(1, &tgt)?), &[0.3, 1.1], 1e-7);
    close(&v(&logits.t()?.gather(0, &Tensor::from_slice(&[1i64, 2], &[1, 2], CPU)?)?), &[0.2, 1.3], 1e-7);
    let sc = Tensor::zeros(&[2, 3], DType::F32, CPU)?.scatter_add(1, &tgt, &t(&[5., 7.], &[2, 1]))?;
    assert_eq!(v(&sc), vec![0., 0., 5., 7., 0., 0.]);
    // cat and stack.
    let c = Tensor::cat(&[&w, &t(&[30., 31.], &[1, 2])], 0)?;
    assert_eq!(v(&c), vec![0., 1., 10., 11., 20., 21., 30., 31.]);
    let c1 = Tensor::cat(&[&w, &w.narrow(1, 0, 1)?], 1)?;
    assert_eq!(v(&c1), vec![0., 1., 0., 10., 11., 10., 20., 21., 20.]);
    let s = Tensor::stack(&[&t(&[1., 2.], &[2]), &t(&[3., 4.], &[2])], 1)?;
    assert_eq!((s.shape(), v(&s)), (&[2usize, 2][..], vec![1., 3., 2., 4.]));
    Ok(())
}

#[test]
fn casts_and_half_precision() -> Result<()> {
    let x = t(&[1.5, -2.25, 1000.0, 0.1], &[4]);
    assert_eq!(x.to_dtype(DType::F16)?.to_vec::<f16>()?, [1.5, -2.25, 1000.0, 0.1].map(f16::from_f32).to_vec());
    assert_eq!(x.to_dtype(DType::BF16)?.to_vec::<bf16>()?, [1.5, -2.25, 1000.0, 0.1].map(bf16::from_f32).to_vec());
    assert_eq!(x.to_dtype(DType::I64)?.to_vec::<i64>()?, vec![1, -2, 1000, 0]);
    for dt in [DType::F16, DType::BF16] {
        let h = x.to_dtype(dt)?;
        let y = h.mul(&h)?.add_scalar(1.0)?.exp()?.log()?;
        assert_eq!(y.dtype(), dt);
        let want: Vec<f32> = v(&h).iter().map(|a| a * a + 1.0).collect();
        close(&v(&y.narrow(0, 0, 2)?), &want[..2], if dt == DType::F16 { 2e-3 } else { 1e-2 });
        close(&v(&h.softmax(0)?.sum_all()?), &[1.0], 1e-2);
    }
    Ok(())
}

#[test]
fn in_place_updates_write_through_views() -> Result<()> {
    let x = Tensor::zeros(&[2, 3], DType::F32, CPU)?;
    let view = x.narrow(1, 1, 2)?;
    view.assign(&t(&[1., 2.], &[2]))?;
    assert_eq!(v(&x), vec![0., 1., 2., 0., 1., 2.]);
    x.add_(&t(&[10.], &[1]))?;
    x.mul_scalar_(2.0)?;
    assert_eq!(v(&x), vec![20., 22., 24., 20., 22., 24.]);
    x.t()?.sub_(&t(&[20., 22., 24.], &[3, 1]))?; // non-contiguous destination
    assert_eq!(v(&x), vec![0.; 6]);
    let before = x.storage().version();
    x.fill_(1.5)?;
    assert!(x.storage().version() > before);
    x.add_(&x)?; // the source aliases the destination
    assert_eq!(v(&x), vec![3.; 6]);
    x.div_(&x.mul_scalar(3.0)?)?;
    assert_eq!(v(&x), vec![1. / 3.; 6]);
    x.zero_()?;
    assert_eq!(v(&x), vec![0.; 6]);
    Ok(())
}

#[test]
fn display_looks_like_pytorch() -> Result<()> {
    let x = t(&[1., 2.5, -3., 4.], &[2, 2]);
    assert_eq!(x.to_string(), "tensor([[ 1.0000,  2.5000],\n        [-3.0000,  4.0000]])");
    assert_eq!(Tensor::arange(3, DType::I64, CPU)?.to_string(), "tensor([0, 1, 2])");
    assert_eq!(Tensor::scalar(2.0, DType::F64, CPU)?.to_string(), "tensor(2.0000, dtype=float64)");
    let big = Tensor::arange(2000, DType::I64, CPU)?.to_string();
    assert!(big.starts_with("tensor([   0,    1,    2, ..., 1997, 1998, 1999])"), "{big}");
    Ok(())
}

/// Sums over leading dims (bias gradients) take the row-by-row path: hand-computed column
/// sums, several leading dims, and a large sum split across threads, bit for bit equal to
/// the same sum walked through a transposed view (the general path).
#[test]
fn column_sums_match_hand_values_and_the_general_path() -> Result<()> {
    let x = t(&(0..48).map(|i| i as f32).collect::<Vec<_>>(), &[3, 16]);
    let want: Vec<f32> = (0..16).map(|j| (j + (16 + j) + (32 + j)) as f32).collect();
    assert_eq!(v(&x.sum(&[0], false)?), want);
    let y = x.reshape(&[3, 2, 8])?;
    assert_eq!(v(&y.sum(&[0, 1], true)?), (0..8).map(|j| (0..6).map(|r| (r * 8 + j) as f32).sum::<f32>()).collect::<Vec<_>>());
    let big = Tensor::rand_at(&[600, 500], Distribution::Normal, 3, 0, DType::F32, Device::Cpu)?;
    let general = big.t()?.contiguous()?.sum(&[1], false)?; // rows of the transpose: the strided walk
    assert_eq!(
        v(&big.sum(&[0], false)?).iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
        v(&general).iter().map(|f| f.to_bits()).collect::<Vec<_>>()
    );
    Ok(())
}

/// Sums of permuted views: reduced dims outermost in memory take the row-by-row kernel on
/// the view's memory order; each result is checked against a sum in f64 by hand.
#[test]
fn sums_of_permuted_views_match_hand_sums() -> Result<()> {
    let x = Tensor::rand_at(&[4, 5, 600], Distribution::Normal, 7, 0, DType::F32, CPU)?;
    let xv = v(&x);
    let at = |i: usize, j: usize, k: usize| xv[(i * 5 + j) * 600 + k] as f64;
    // [600, 4, 5] (strides 1, 3000, 600): dims 1 and 2 are outermost in memory.
    let p = x.permute(&[2, 0, 1])?;
    let got = v(&p.sum(&[1usize, 2][..], false)?);
    let want: Vec<f32> =
        (0..600).map(|k| (0..4).flat_map(|i| (0..5).map(move |j| (i, j))).map(|(i, j)| at(i, j, k)).sum::<f64>() as f32).collect();
    assert_eq!(got, want);
    // The transposed matrix [600, 20] summed over its columns (a weight gradient's sums).
    let m = x.reshape(&[20, 600])?.t()?;
    let got = v(&m.sum(&[1usize][..], false)?);
    let want: Vec<f32> = (0..600).map(|k| (0..20).map(|r| xv[r * 600 + k] as f64).sum::<f64>() as f32).collect();
    assert_eq!(got, want);
    // Kept dims out of memory order ([5, 600, 4] summed over 600): the general kernel.
    let q = x.permute(&[1, 2, 0])?;
    let got = v(&q.sum(&[1usize][..], false)?);
    let want: Vec<f32> =
        (0..5).flat_map(|j| (0..4).map(move |i| (j, i))).map(|(j, i)| (0..600).map(|k| at(i, j, k)).sum::<f64>() as f32).collect();
    assert_eq!(got, want);
    Ok(())
}

/// The f32 row kernels (softmax and layer norm computed in f32 with f64 row sums, 8 lanes at a
/// time) against the f64 kernels on the same values: rows of 130 (not a multiple of 8), and
/// enough of them that rows and the parameter-gradient blocks run on several threads.
#[test]
fn f32_row_kernels_match_the_f64_kernels() -> Result<()> {
    let r = |seed, s: &[usize]| Tensor::rand_at(s, Distribution::Normal, seed, 0, DType::F32, CPU);
    let (x, g) = (r(20, &[1100, 130])?.mul_scalar(3.0)?.add_scalar(1.5)?, r(21, &[1100, 130])?);
    let (w, b) = (r(22, &[130])?, r(23, &[130])?);
    let wide = |t: &Tensor| t.to_dtype(DType::F64);
    let (x64, g64, w64, b64) = (wide(&x)?, wide(&g)?, wide(&w)?, wide(&b)?);
    let cases: [(&str, Tensor, Tensor); 9] = [
        ("softmax", x.softmax(-1)?, x64.softmax(-1)?),
        ("log_softmax", x.log_softmax(-1)?, x64.log_softmax(-1)?),
        (
            "causal scaled softmax",
            x.reshape(&[10, 110, 130])?.softmax_scaled(0.3, true)?,
            x64.reshape(&[10, 110, 130])?.softmax_scaled(0.3, true)?,
        ),
        ("normalize", x.normalize(1e-5)?, x64.normalize(1e-5)?),
        ("layer_norm", x.layer_norm(&w, &b, 1e-5)?, x64.layer_norm(&w64, &b64, 1e-5)?),
        ("normalize_backward", x.normalize_backward(&g, 1e-5)?, x64.normalize_backward(&g64, 1e-5)?),
        ("layer_norm_backward", x.layer_norm_backward(&g, &w, 1e-5)?, x64.layer_norm_backward(&g64, &w64, 1e-5)?),
        ("layer_norm_grads", x.layer_norm_param_grads(&g, 1e-5)?, x64.layer_norm_param_grads(&g64, 1e-5)?),
        ("softmax_backward", x.softmax(-1)?.softmax_backward(&g, false, 1.0)?, x64.softmax(-1)?.softmax_backward(&g64, false, 1.0)?),
    ];
    for (name, got, want) in cases {
        assert_eq!(got.dtype(), DType::F32, "{name}");
        let (got, want) = (v(&got), want.to_vec::<f64>()?);
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
        assert!(worst <= 2e-6 * scale, "{name}: off by {worst:e} (largest value {scale})");
    }
    Ok(())
}

/// Sums over contiguous runs (batch norm's `[N, C, H, W]` over N, H, W; runs of H * W summed
/// in lanes) against f64 sums by hand, runs of a length not a multiple of the lanes included.
#[test]
fn run_sums_match_hand_sums() -> Result<()> {
    for (h, w) in [(8, 8), (7, 9)] {
        let x = Tensor::rand_at(&[3, 4, h, w], Distribution::Normal, 9, 0, DType::F64, CPU)?;
        let xv = x.to_vec::<f64>()?;
        let got = x.sum(&[0usize, 2, 3][..], false)?.to_vec::<f64>()?;
        for (c, g) in got.iter().enumerate() {
            let want: f64 = (0..3).flat_map(|n| xv[(n * 4 + c) * h * w..(n * 4 + c + 1) * h * w].iter()).sum();
            assert!((g - want).abs() < 1e-12 * (1.0 + want.abs()), "channel {c} of {h}x{w}: {g} vs {want}");
        }
    }
    Ok(())
}

/// argmax/argmin over the last dim of a dense tensor (the branch-free row loop) against the
/// general strided walk on the same values (a transposed copy reduced over dim 0), with ties
/// (the first wins) and NaNs (the first NaN wins) in the rows.
#[test]
fn dense_row_argmax_matches_the_general_path_with_ties_and_nans() -> Result<()> {
    let mut vals: Vec<f32> = (0..4000).map(|i| ((i * 7919) % 13) as f32).collect();
    vals[5] = f32::NAN;
    vals[6] = f32::NAN;
    vals[401] = f32::NAN;
    let x = t(&vals, &[1000, 4]);
    let xt = x.t()?.contiguous()?.t()?; // the same values, strided: the general path
    for (dense, general) in [(x.argmax(1, false)?, xt.argmax(1, false)?), (x.argmin(1, false)?, xt.argmin(1, false)?)] {
        assert_eq!(dense.to_vec::<i64>()?, general.to_vec::<i64>()?);
    }
    let row = |r: usize| x.narrow(0, r, 1).unwrap().argmax(1, false).unwrap().to_vec::<i64>().unwrap()[0];
    assert_eq!((row(1), row(100)), (1, 1), "rows 1 and 100 hold NaN at index 1 (and 2): the first NaN wins");
    let tie = t(&[3.0, 7.0, 7.0, 1.0], &[1, 4]);
    assert_eq!(tie.argmax(1, false)?.to_vec::<i64>()?, vec![1]);
    assert_eq!(tie.argmin(1, false)?.to_vec::<i64>()?, vec![3]);
    Ok(())
}

#[test]
fn sort_argsort_and_topk_follow_pytorch() -> Result<()> {
    // Ties keep their order (stable); NaN is the largest value.
    let x = t(&[3.0, 1.0, f32::NAN, 1.0, -2.0, 3.0], &[6]);
    let (vals, idx) = x.sort(0usize, false)?;
    assert_eq!(idx.to_vec::<i64>()?, [4, 1, 3, 0, 5, 2]);
    close(&v(&vals), &[-2.0, 1.0, 1.0, 3.0, 3.0, f32::NAN], 0.0);
    let (vals, idx) = x.sort(0usize, true)?;
    assert_eq!(idx.to_vec::<i64>()?, [2, 0, 5, 1, 3, 4]);
    close(&v(&vals), &[f32::NAN, 3.0, 3.0, 1.0, 1.0, -2.0], 0.0);

    // Along dim 0 of a [3, 2] (each column sorted), and of a transposed view.
    let m = t(&[5.0, 0.0, 1.0, 9.0, 3.0, 4.0], &[3, 2]);
    assert_eq!(m.argsort(0usize, false)?.to_vec::<i64>()?, [1, 0, 2, 2, 0, 1]);
    assert_eq!(m.t()?.argsort(1usize, true)?.to_vec::<i64>()?, [0, 2, 1, 1, 2, 0]);
    let (vals, idx) = m.topk(2, -1, true)?;
    assert_eq!((vals.shape(), idx.to_vec::<i64>()?), (&[3, 2][..], vec![0, 1, 1, 0, 1, 0]));
    let (vals, idx) = m.topk(1, 0usize, false)?;
    close(&v(&vals), &[1.0, 0.0], 0.0);
    assert_eq!(idx.to_vec::<i64>()?, [1, 0]);

    // Integers (beyond f64's exact range, so no rounding through floats), 16-bit floats, empty
    // rows and a scalar.
    let big = Tensor::from_slice(&[i64::MAX, i64::MAX - 1, -7, 0], &[4], CPU)?;
    assert_eq!(big.argsort(0usize, false)?.to_vec::<i64>()?, [2, 3, 1, 0]);
    let h = t(&[0.5, -1.0, 2.0], &[3]).to_dtype(DType::BF16)?;
    assert_eq!(h.argsort(0usize, true)?.to_vec::<i64>()?, [2, 0, 1]);
    assert_eq!(Tensor::zeros(&[2, 0], DType::F32, CPU)?.argsort(1usize, false)?.shape(), [2, 0]);
    let s = Tensor::scalar(4.0, DType::F32, CPU)?;
    assert_eq!(s.sort(0usize, false)?.1.to_vec::<i64>()?, [0]);

    // Random rows against a sort of each row by hand.
    let r = Tensor::rand_at(&[7, 33], Distribution::Normal, 5, 0, DType::F32, CPU)?;
    let (vals, idx) = r.sort(1usize, true)?;
    let (rv, sv, si) = (v(&r), v(&vals), idx.to_vec::<i64>()?);
    for row in 0..7 {
        let mut want = rv[row * 33..(row + 1) * 33].to_vec();
        want.sort_by(|a, b| b.partial_cmp(a).unwrap());
        assert_eq!(&sv[row * 33..(row + 1) * 33], &want[..]);
        assert!(si[row * 33..(row + 1) * 33].iter().zip(&want).all(|(&i, w)| rv[row * 33 + i as usize] == *w));
    }
    let e = m.topk(4, 0usize, true).unwrap_err().to_string();
    assert!(e.contains("k = 4") && e.contains("[3, 2]"), "{e}");
    Ok(())
}

#[test]
fn gather_and_scatter_add_with_full_and_smaller_indices() -> Result<()> {
    // src [3, 4] = 0..12.
    let src = Tensor::arange(12, DType::F32, CPU)?.reshape(&[3, 4])?;
    // Full outside dim 1 (the direct walk): rows 0, 1, 2 pick columns (3, 0), (1, 1), (2, 3).
    let full = Tensor::from_slice(&[3i64, 0, 1, 1, 2, 3], &[3, 2], CPU)?;
    assert_eq!(v(&src.gather(1, &full)?), [3.0, 0.0, 5.0, 5.0, 10.0, 11.0]);
    // Smaller outside the dim (the remapped walk): an index [2, 2] reads rows 0 and 1 only.
    let small = Tensor::from_slice(&[3i64, 0, 1, 1], &[2, 2], CPU)?;
    assert_eq!(v(&src.gather(1, &small)?), [3.0, 0.0, 5.0, 5.0]);
    // Along dim 0, full: column j picks row index[.., j].
    let rows = Tensor::from_slice(&[2i64, 0, 1, 2], &[1, 4], CPU)?;
    assert_eq!(v(&src.gather(0, &rows)?), [8.0, 1.0, 6.0, 11.0]);
    // scatter_add sends each value back; repeated positions add up.
    let ones = Tensor::ones(&[3, 2], DType::F32, CPU)?;
    let back = Tensor::zeros(&[3, 4], DType::F32, CPU)?.scatter_add(1, &full, &ones)?;
    assert_eq!(v(&back), [1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]);
    let back = Tensor::zeros(&[3, 4], DType::F32, CPU)?.scatter_add(1, &small, &Tensor::ones(&[2, 2], DType::F32, CPU)?)?;
    assert_eq!(v(&back), [1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let e = src.gather(1, &Tensor::from_slice(&[4i64, 0, 0, 0, 0, 0], &[3, 2], CPU)?).unwrap_err().to_string();
    assert!(e.contains('4'), "{e}");
    Ok(())
}

#[test]
fn a_fused_ops_shape_errors_name_the_fused_op() {
    use kiln_tensor::{MatmulEpilogue, Op};
    let cpu = Device::Cpu;
    let logits = t(&[0.; 12], &[4, 3]);
    let targets = Tensor::from_vec(vec![0i64; 5], &[5], cpu).unwrap();
    let xent = Op::Fused(Fused::CrossEntropyMean { ignore_index: None, smoothing: 0.0 });
    let err = Tensor::apply(xent, &[&logits, &targets], cpu).unwrap_err().to_string();
    assert!(err.starts_with("cross_entropy_mean:") && err.contains("[5]"), "{err}");
    let q = t(&[0.; 24], &[1, 2, 3, 4]);
    let k = t(&[0.; 16], &[1, 2, 2, 4]);
    let heads_last = Op::Fused(Fused::AttentionHeadsLast { scale: 0.5, causal: false });
    let err = Tensor::apply(heads_last, &[&q, &k, &q], cpu).unwrap_err().to_string();
    assert!(err.starts_with("attention_heads_last:"), "{err}");
    let relu = Op::Fused(Fused::Matmul(MatmulEpilogue::Relu));
    let err = Tensor::apply(relu, &[&logits, &logits], cpu).unwrap_err().to_string();
    assert!(err.starts_with("matmul_relu:") && err.contains("[4, 3]"), "{err}");
}

#[test]
fn operators_take_owned_and_borrowed_tensors_and_scalars_on_either_side() -> Result<()> {
    let (a, b) = (t(&[1., 2., 3.], &[3]), t(&[4., 5., 6.], &[3]));
    assert_eq!(v(&(a.clone() + b.clone())?), [5., 7., 9.]);
    assert_eq!(v(&(&a - b.clone())?), [-3., -3., -3.]);
    assert_eq!(v(&(a.clone() * &b)?), [4., 10., 18.]);
    assert_eq!(v(&(&b / &a)?), [4., 2.5, 2.]);
    assert_eq!(v(&(b.clone() / 2.0)?), [2., 2.5, 3.]);
    assert_eq!(v(&(&a + 0.5)?), [1.5, 2.5, 3.5]);
    assert_eq!(v(&(1.0 - &a)?), [0., -1., -2.]);
    assert_eq!(v(&(6.0 / a.clone())?), [6., 3., 2.]);
    assert_eq!(v(&(2.0 * &a)?), [2., 4., 6.]);
    assert_eq!(v(&(10.0 + a.clone())?), [11., 12., 13.]);
    assert_eq!(v(&(-&a)?), [-1., -2., -3.]);
    assert_eq!(v(&(-(a.clone() * 2.0)?)?), [-2., -4., -6.]);
    let err = (&a + &t(&[1., 2.], &[2])).unwrap_err().to_string();
    assert!(err.contains("[3]") && err.contains("[2]"), "{err}");
    Ok(())
}

#[test]
fn select_narrow_and_reshape_take_positions_from_the_end_and_tuple_shapes() -> Result<()> {
    let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let x = t(&data, &[2, 3, 4]);
    // x[:, -1, :] and x[1, 0]
    let last = x.select(1, -1)?;
    assert_eq!(last.shape(), &[2, 4]);
    assert_eq!(v(&last), [8., 9., 10., 11., 20., 21., 22., 23.]);
    assert_eq!(v(&x.select(0, 1)?.select(0, 0usize)?), [12., 13., 14., 15.]);
    assert_eq!(v(&x.narrow(2, -2, 2)?.select(0, 0)?.select(0, 0)?), [2., 3.]);
    for bad in [3i64, -4] {
        let err = x.select(1, bad).unwrap_err().to_string();
        assert!(err.contains(&format!("index {bad}")) && err.contains("size 3"), "{err}");
    }
    let err = x.narrow(2, -5, 1).unwrap_err().to_string();
    assert!(err.contains("index -5") && err.contains("size 4"), "{err}");
    // (b, t, -1) with usize sizes, as PyTorch's view(b, t, -1).
    let (b, n) = (2usize, 3usize);
    assert_eq!(x.reshape(&(b, n, -1))?.shape(), &[2, 3, 4]);
    assert_eq!(x.reshape(&(-1, 6usize))?.shape(), &[4, 6]);
    assert_eq!(v(&x.reshape(&(-1,))?), data);
    let err = x.reshape(&(5usize, -1)).unwrap_err().to_string();
    assert!(err.contains("cannot infer -1"), "{err}");
    Ok(())
}

#[test]
fn i_slices_as_pythons_indexing_does() -> Result<()> {
    let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let x = t(&data, &[2, 3, 4]);
    // x[:, -1] and x[:, -1, :]
    assert_eq!(x.i((.., -1))?.shape(), &[2, 4]);
    assert_eq!(v(&x.i((.., -1, ..))?), [8., 9., 10., 11., 20., 21., 22., 23.]);
    // x[1, 0:2, 1:] and x[0, :, -2:]
    let y = x.i((1, 0..2, 1..))?;
    assert_eq!((y.shape(), v(&y)), (&[2, 3][..], vec![13., 14., 15., 17., 18., 19.]));
    assert_eq!(v(&x.i((0, .., -2..))?), [2., 3., 6., 7., 10., 11.]);
    // x[0] and x[..1] (one item); ends past the dim clip, as Python's slices.
    assert_eq!(x.i(0)?.shape(), &[3, 4]);
    assert_eq!(x.i(..1)?.shape(), &[1, 3, 4]);
    assert_eq!(x.i((.., 1..10))?.shape(), &[2, 2, 4]);
    assert_eq!(x.i((.., 5..))?.shape(), &[2, 0, 4]);
    // A view: writing through it writes x.
    x.i((1, -1, -1))?.fill_(-1.0)?;
    assert_eq!(v(&x)[23], -1.0);
    let err = x.i((0, 0, 0, 0)).unwrap_err().to_string();
    assert!(err.contains("4 indices") && err.contains("[2, 3, 4]"), "{err}");
    let err = x.i((.., 3)).unwrap_err().to_string();
    assert!(err.contains("index 3") && err.contains("size 3"), "{err}");
    Ok(())
}
