//! Every primitive op on CUDA against the CPU, forward and backward, on random inputs in every
//! dtype, plus the CUDA error paths (built only with `--features cuda`; runs on the GPU
//! machine through ../shared/gpu/pack). Without a GPU each test fails saying so.

// Cases list their inputs as owned arrays (`&[x.clone()]`) so every call reads the same way.
#![allow(clippy::cloned_ref_to_slice_refs)]

use kiln_tensor::Fused;

use kiln::nn::{cross_entropy, cross_entropy_with, CrossEntropyConfig, Forward, LayerNorm, Reduction};
use kiln::prelude::*;
use kiln::tensor::op::{Part, Parts};
use kiln::tensor::{cuda, BinaryOp, Distribution, ReduceOp, UnaryOp};

/// Tests here run one at a time: the allocation count is global.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpu() -> Device {
    let d = Device::cuda_if_available(0);
    assert!(d.is_cuda(), "NO GPU: this CUDA test needs an NVIDIA GPU and driver (run it on the GPU machine)");
    d
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn tol(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-10,
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::I64 | DType::U8 => 0.0,
    }
}

/// Same shape and dtype, and every value within `tol` relative (NaN matches NaN, inf matches
/// the same inf).
fn close(what: &str, cpu: &Tensor, gpu: &Tensor, tol: f64) {
    assert!(gpu.device().is_cuda(), "{what}: result left the GPU");
    assert_eq!((cpu.shape(), cpu.dtype()), (gpu.shape(), gpu.dtype()), "{what}");
    let (a, b) = (cpu.to_vec_f64().unwrap(), gpu.to_vec_f64().unwrap());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= tol * (1.0 + x.abs());
        assert!(ok, "{what}: element {i}: cpu {x} vs cuda {y} (tol {tol})");
    }
}

/// The tolerance of products and sums over many terms, whose order differs between devices
/// (16-bit results rounded once more).
fn product_tol(d: DType) -> f64 {
    match d {
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        d => tol(d) * 10.0,
    }
}

fn randn(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu).unwrap().to_dtype(dt).unwrap()
}

/// Runs `f` on CPU inputs and on their CUDA copies and compares.
fn both(what: &str, ins: &[Tensor], tol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let dev = gpu();
    let on_gpu: Vec<Tensor> = ins.iter().map(|t| t.to_device(dev).unwrap()).collect();
    let c = f(ins).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let g = f(&on_gpu).unwrap_or_else(|e| panic!("{what} on cuda: {e}"));
    close(what, &c, &g, tol);
}

#[test]
fn unary_ops_match_the_cpu_in_every_float_dtype() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ops = UnaryOp::ALL;
    for dt in FLOATS {
        // 1031 elements: the vector path plus a scalar tail; the transpose walks strides.
        let x = randn(&[1031], 1, dt);
        let xt = randn(&[13, 7], 2, dt).t().unwrap();
        for u in ops {
            let positive = matches!(u, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt);
            let f = |t: &Tensor| if positive { t.abs()?.add_scalar(0.1)?.unary(u) } else { t.unary(u) };
            both(&format!("{u:?} {dt:?}"), &[x.clone()], tol(dt), |t| f(&t[0]));
            both(&format!("{u:?} {dt:?} strided"), &[xt.clone()], tol(dt), |t| f(&t[0]));
        }
    }
    let i = Tensor::from_slice(&[-3i64, 0, 5, -1], &[4], Device::Cpu).unwrap();
    for u in [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Square, UnaryOp::Sign, UnaryOp::Relu] {
        both(&format!("{u:?} i64"), &[i.clone()], 0.0, |t| t[0].unary(u));
    }
}

#[test]
fn binary_scalar_where_and_cast_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ops = BinaryOp::ALL;
    for dt in FLOATS {
        let a = randn(&[6, 9], 3, dt);
        let row = randn(&[9], 4, dt);
        let col = randn(&[6, 1], 5, dt).abs().unwrap().add_scalar(0.5).unwrap();
        let at = randn(&[9, 6], 6, dt).t().unwrap();
        for b in ops {
            let base = |t: &Tensor| if b == BinaryOp::Pow { t.abs()?.add_scalar(0.1) } else { Ok(t.clone()) };
            let t = tol(dt) * if b == BinaryOp::Pow { 4.0 } else { 1.0 };
            both(&format!("{b:?} {dt:?} row"), &[a.clone(), row.clone()], t, |x| base(&x[0])?.binary(b, &x[1]));
            both(&format!("{b:?} {dt:?} col"), &[a.clone(), col.clone()], t, |x| base(&x[0])?.binary(b, &x[1]));
            both(&format!("{b:?} {dt:?} strided"), &[at.clone(), a.clone()], t, |x| base(&x[0])?.binary(b, &x[1]));
            both(&format!("{b:?} {dt:?} scalar"), &[a.clone()], t, |x| base(&x[0])?.scalar_op(b, 1.5, false));
            both(&format!("{b:?} {dt:?} scalar lhs"), &[a.clone()], t, |x| base(&x[0])?.scalar_op(b, 1.5, true));
        }
        let cond = randn(&[6, 1], 7, DType::F32).gt_scalar(0.0).unwrap();
        both(&format!("where {dt:?}"), &[cond, a.clone(), row.clone()], 0.0, |x| Tensor::where_cond(&x[0], &x[1], &x[2]));
        for to in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U8] {
            both(&format!("cast {dt:?} -> {to:?}"), &[a.mul_scalar(50.0).unwrap()], tol(to), |x| x[0].to_dtype(to));
        }
    }
    let i = Tensor::from_slice(&[7i64, -3, 0, 9, 4, -8], &[2, 3], Device::Cpu).unwrap();
    let j = Tensor::from_slice(&[2i64, 0, -3], &[3], Device::Cpu).unwrap();
    for b in ops {
        both(&format!("{b:?} i64"), &[i.clone(), j.clone()], 0.0, |x| x[0].binary(b, &x[1]));
    }
}

/// Strided operands whose innermost dim is contiguous (or broadcast) and a multiple of four
/// take the four-at-a-time kernels; odd offsets and lengths fall back to the scalar ones.
#[test]
fn strided_operands_with_a_contiguous_inner_dim_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        let x = randn(&[3, 5, 4, 8], 70, dt);
        let y = randn(&[3, 4, 5, 8], 71, dt);
        both(&format!("permuted copy {dt:?}"), &[x.clone()], 0.0, |v| v[0].transpose(1, 2)?.contiguous());
        both(&format!("permuted add {dt:?}"), &[x.clone(), y.clone()], tol(dt), |v| v[0].transpose(1, 2)?.add(&v[1]));
        both(&format!("inner broadcast {dt:?}"), &[y.clone(), randn(&[3, 4, 5, 1], 72, dt)], tol(dt), |v| v[0].mul(&v[1]));
        both(&format!("cat of permuted {dt:?}"), &[x.clone(), y.clone()], 0.0, |v| Tensor::cat(&[&v[0].transpose(1, 2)?, &v[1]], 3));
        both(&format!("cat mid dim {dt:?}"), &[x.clone(), randn(&[3, 2, 4, 8], 73, dt)], 0.0, |v| Tensor::cat(&[&v[0], &v[1]], 1));
        both(&format!("slice at an odd offset {dt:?}"), &[x.clone()], 0.0, |v| v[0].narrow(3, 1, 4)?.contiguous());
        both(&format!("slice of 4 at offset 4 {dt:?}"), &[x.clone()], 0.0, |v| v[0].narrow(3, 4, 4)?.transpose(0, 1)?.contiguous());
        both(&format!("in place into a slice {dt:?}"), &[x.clone(), randn(&[3, 5, 4, 4], 74, dt)], tol(dt), |v| {
            let dst = v[0].copy()?;
            dst.narrow(3, 4, 4)?.add_(&v[1])?;
            Ok(dst)
        });
    }
}

#[test]
fn sources_and_dropout_masks_are_the_same_on_both_devices() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    for dt in FLOATS {
        for dist in [Distribution::Uniform, Distribution::Normal] {
            let c = Tensor::rand_at(&[3, 1001], dist, 42, 12, dt, Device::Cpu).unwrap();
            let g = Tensor::rand_at(&[3, 1001], dist, 42, 12, dt, dev).unwrap();
            let t = if dist == Distribution::Uniform { 0.0 } else { tol(dt).max(1e-6) };
            close(&format!("rand {dist:?} {dt:?}"), &c, &g, t);
        }
        close(&format!("full {dt:?}"), &Tensor::full(2.5, &[5], dt, Device::Cpu).unwrap(), &Tensor::full(2.5, &[5], dt, dev).unwrap(), 0.0);
        close(&format!("arange {dt:?}"), &Tensor::arange(33, dt, Device::Cpu).unwrap(), &Tensor::arange(33, dt, dev).unwrap(), 0.0);
    }
    // Dropout through nn: identical masks for the same seed and offset, bit for bit.
    let x = Tensor::ones(&[64, 33], DType::F32, Device::Cpu).unwrap();
    kiln::tensor::rng::manual_seed(9);
    let c = kiln::nn::dropout(&x, 0.3, true).unwrap();
    kiln::tensor::rng::manual_seed(9);
    let g = kiln::nn::dropout(&x.to_device(dev).unwrap(), 0.3, true).unwrap();
    close("dropout", &c, &g, 0.0);
}

#[test]
fn reductions_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ops = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax, ReduceOp::ArgMin];
    for dt in FLOATS {
        let x = randn(&[4, 5, 6], 8, dt);
        // Rows longer than 1024 take the block-per-row kernel.
        let long = randn(&[3, 5000], 9, dt);
        for op in ops {
            let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
            let t = if op == ReduceOp::Sum { tol(dt) * 4.0 } else { 0.0 };
            let dims: Vec<Vec<usize>> =
                if arg { vec![vec![0], vec![1], vec![2]] } else { vec![vec![0], vec![2], vec![0, 2], vec![0, 1, 2]] };
            for d in dims {
                for keep in [false, true] {
                    both(&format!("{op:?} {d:?} {keep} {dt:?}"), &[x.clone()], t, |v| v[0].reduce(op, &d[..], keep));
                    both(&format!("{op:?} {d:?} {dt:?} permuted"), &[x.clone()], t, |v| v[0].permute(&[2, 0, 1])?.reduce(op, &d[..], keep));
                }
            }
            both(&format!("{op:?} long {dt:?}"), &[long.clone()], t * 10.0, |v| v[0].reduce(op, &[1usize][..], false));
            if !arg {
                both(&format!("{op:?} long dim0 {dt:?}"), &[long.clone()], t * 10.0, |v| v[0].reduce(op, &[0usize][..], false));
            }
        }
        // Few rows and long reductions: split into chunks, folded by a second pass.
        let tall = randn(&[4000, 64], 10, dt);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let t = if op == ReduceOp::Sum { tol(dt) * 40.0 } else { 0.0 };
            both(&format!("{op:?} tall dim0 {dt:?}"), &[tall.clone()], t, |v| v[0].reduce(op, &[0usize][..], false));
            both(&format!("{op:?} tall all {dt:?}"), &[tall.clone()], t, |v| v[0].reduce(op, &[0usize, 1][..], false));
            both(&format!("{op:?} tall^T dim1 {dt:?}"), &[tall.clone()], t, |v| v[0].t()?.reduce(op, &[1usize][..], true));
        }
        // Sums over leading dims of a million elements take the column-sum kernel: columns in
        // 16-byte vectors ([64, 40, 410] over dim 0; [300, 3500] over dim 0 for F32 and F64),
        // or one a lane (3501 columns, and 3500 in 16 bits), in a view whose rows lie 4100
        // apart. Each sum is rounded once from F32, so 16-bit results are within an ulp or two.
        let big = randn(&[64, 40, 410], 17, dt);
        let t = match dt {
            DType::F16 | DType::BF16 => 1e-2,
            d => tol(d) * 40.0,
        };
        both(&format!("sum big dim0 {dt:?}"), &[big.clone()], t, |v| v[0].reduce(ReduceOp::Sum, &[0usize][..], false));
        for cols in [3500, 3501] {
            let m = randn(&[300, 4100], 18, dt);
            both(&format!("sum big rows of {cols} {dt:?}"), &[m], t, |v| {
                v[0].narrow(1, 0, cols)?.reduce(ReduceOp::Sum, &[0usize][..], true)
            });
        }
        // A few hundred rows down 40 columns: 32 threads per column and a shared-memory fold
        // (the second block of 32 columns is partly past the end), the arg reductions too.
        let wide = randn(&[300, 40], 15, dt);
        for op in ops {
            let t = if op == ReduceOp::Sum { tol(dt) * 20.0 } else { 0.0 };
            both(&format!("{op:?} wide dim0 {dt:?}"), &[wide.clone()], t, |v| v[0].reduce(op, &[0usize][..], false));
        }
        both(&format!("softmax {dt:?}"), &[x.clone()], tol(dt) * 4.0, |v| v[0].softmax(-1));
        both(&format!("log_softmax {dt:?}"), &[x.clone()], tol(dt) * 4.0, |v| v[0].log_softmax(1));
        both(&format!("softmax long rows {dt:?}"), &[long.clone()], tol(dt) * 4.0, |v| v[0].softmax(1));
        both(&format!("causal softmax {dt:?}"), &[x.clone()], tol(dt) * 4.0, |v| v[0].permute(&[1, 0, 2])?.softmax_scaled(0.3, true));
        both(&format!("causal softmax long rows {dt:?}"), &[long.clone()], tol(dt) * 4.0, |v| v[0].softmax_scaled(2.0, true));
        both(&format!("normalize {dt:?}"), &[x.clone()], tol(dt) * 8.0, |v| v[0].normalize(1e-5));
        both(&format!("normalize long rows {dt:?}"), &[long.clone()], tol(dt) * 8.0, |v| v[0].normalize(1e-5));
        let (w, b) = (randn(&[6], 12, dt), randn(&[6], 13, dt));
        both(&format!("layer norm {dt:?}"), &[x.clone(), w.clone(), b], tol(dt) * 8.0, |v| {
            v[0].permute(&[1, 0, 2])?.layer_norm(&v[1], &v[2], 1e-5)
        });
        both(&format!("layer norm backward {dt:?}"), &[x.clone(), randn(&[4, 5, 6], 14, dt), w], tol(dt) * 16.0, |v| {
            v[0].permute(&[1, 0, 2])?.layer_norm_backward(&v[1].permute(&[1, 0, 2])?, &v[2], 1e-5)
        });
        both(&format!("normalize backward {dt:?}"), &[x.clone(), randn(&[4, 5, 6], 11, dt)], tol(dt) * 16.0, |v| {
            v[0].permute(&[1, 0, 2])?.normalize_backward(&v[1].permute(&[1, 0, 2])?, 1e-5)
        });
        // Rows of whole float4s per lane (F32 takes the register-resident forward), some with
        // a large mean.
        for (i, n) in [128usize, 512, 1024].into_iter().enumerate() {
            let rows = randn(&[37, n], 16 + i as u64, dt).add_scalar(4.0 * i as f64).unwrap();
            let (w, b) = (randn(&[n], 19, dt), randn(&[n], 20, dt));
            both(&format!("layer norm rows of {n} {dt:?}"), &[rows.clone(), w, b], tol(dt) * 8.0, |v| v[0].layer_norm(&v[1], &v[2], 1e-5));
            both(&format!("normalize rows of {n} {dt:?}"), &[rows], tol(dt) * 8.0, |v| v[0].normalize(1e-5));
        }
        // RMS norm each way, weighted or not, on a view, short rows and long (block) rows.
        let w6 = randn(&[6], 21, dt);
        both(&format!("rms norm {dt:?}"), &[x.clone(), w6.clone()], tol(dt) * 8.0, |v| {
            v[0].permute(&[1, 0, 2])?.rms_norm(Some(&v[1]), 1e-5)
        });
        both(&format!("rms norm long rows {dt:?}"), &[long.clone()], tol(dt) * 8.0, |v| v[0].rms_norm(None, 1e-5));
        both(&format!("rms norm backward {dt:?}"), &[x.clone(), randn(&[4, 5, 6], 22, dt), w6], tol(dt) * 16.0, |v| {
            v[0].permute(&[1, 0, 2])?.rms_norm_backward(&v[1].permute(&[1, 0, 2])?, Some(&v[2]), 1e-5)
        });
        both(&format!("rms norm backward long rows {dt:?}"), &[long.clone(), long.mul_scalar(0.5).unwrap()], tol(dt) * 16.0, |v| {
            v[0].rms_norm_backward(&v[1], None, 1e-5)
        });
    }
    // NaN wins max and argmax, as on the CPU.
    let n = Tensor::from_slice(&[1.0f32, f32::NAN, 3.0, 2.0], &[2, 2], Device::Cpu).unwrap();
    both("max nan", &[n.clone()], 0.0, |v| v[0].max(&[1usize][..], false));
    both("argmax nan", &[n], 0.0, |v| v[0].argmax(1, false));
}

#[test]
fn matmul_matches_the_cpu_with_transposes_and_batches() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        let t = product_tol(dt);
        let a = randn(&[7, 5], 10, dt);
        let b = randn(&[5, 3], 11, dt);
        both(&format!("mm {dt:?}"), &[a.clone(), b.clone()], t, |x| x[0].matmul(&x[1]));
        both(&format!("mm a^T {dt:?}"), &[randn(&[5, 7], 12, dt), b.clone()], t, |x| x[0].t()?.matmul(&x[1]));
        both(&format!("mm b^T {dt:?}"), &[a.clone(), randn(&[3, 5], 13, dt)], t, |x| x[0].matmul(&x[1].t()?));
        both(&format!("bmm {dt:?}"), &[randn(&[4, 7, 5], 14, dt), randn(&[4, 5, 3], 15, dt)], t, |x| x[0].matmul(&x[1]));
        both(&format!("bmm broadcast {dt:?}"), &[randn(&[4, 7, 5], 16, dt), b.clone()], t, |x| x[0].matmul(&x[1]));
        both(&format!("bmm 4d broadcast {dt:?}"), &[randn(&[2, 1, 7, 5], 17, dt), randn(&[3, 5, 3], 18, dt)], t, |x| x[0].matmul(&x[1]));
        both(&format!("bmm permuted {dt:?}"), &[randn(&[7, 4, 5], 19, dt), randn(&[4, 3, 5], 20, dt)], t, |x| {
            x[0].permute(&[1, 0, 2])?.matmul(&x[1].transpose(1, 2)?)
        });
        both(&format!("mm k=0 {dt:?}"), &[randn(&[3, 0], 21, dt), randn(&[0, 2], 22, dt)], 0.0, |x| x[0].matmul(&x[1]));
        // Attention's q k^T over heads cut from a [B, T, H, D] projection: the batch dims take
        // no single stride, so both operands are copied (k^T as it lies, then transposed).
        for d in [5, 8] {
            both(&format!("q k^T of heads, D {d} {dt:?}"), &[randn(&[2, 7, 3, d], 27, dt), randn(&[2, 7, 3, d], 28, dt)], t, |x| {
                x[0].transpose(1, 2)?.matmul(&x[1].transpose(1, 2)?.transpose(2, 3)?)
            });
        }
        // With a bias: cuBLASLt's epilogue (one GEMM, aligned bias), else a broadcast add.
        let bias = randn(&[3], 23, dt);
        both(&format!("mm + bias {dt:?}"), &[a.clone(), b.clone(), bias.clone()], t, |x| x[0].matmul_bias(&x[1], &x[2]));
        both(&format!("linear {dt:?}"), &[randn(&[4, 7, 5], 24, dt), randn(&[3, 5], 25, dt), bias.clone()], t, |x| {
            x[0].linear(&x[1], Some(&x[2]))
        });
        both(&format!("bmm + bias {dt:?}"), &[randn(&[4, 7, 5], 14, dt), randn(&[4, 5, 3], 15, dt), bias.clone()], t, |x| {
            x[0].matmul_bias(&x[1], &x[2])
        });
        both(&format!("mm + unaligned bias {dt:?}"), &[a.clone(), b.clone(), randn(&[4], 26, dt)], t, |x| {
            x[0].matmul_bias(&x[1], &x[2].narrow(0, 1, 3)?)
        });
        both(&format!("mm k=0 + bias {dt:?}"), &[randn(&[3, 0], 21, dt), randn(&[0, 3], 22, dt), bias.clone()], 0.0, |x| {
            x[0].matmul_bias(&x[1], &x[2])
        });
        // Large products with rows of 65 (GPT's vocabulary; rows that are not whole 16-byte
        // pieces take cuBLASLt's align-1 kernels): a head's logits `h w^T`, and its
        // backward's `g w` and `g^T h` (4096 deep). Against the CPU in F32 (F64 for F64),
        // rounded once.
        let ins = [randn(&[8, 512, 384], 29, dt), randn(&[65, 384], 30, dt), randn(&[4096, 65], 31, dt)];
        type Product = fn(&[Tensor]) -> Result<Tensor>;
        let head: [(&str, Product); 3] = [
            ("h w^T", |x| x[0].matmul(&x[1].t()?)),
            ("g w", |x| x[2].matmul(&x[1])),
            ("g^T h", |x| x[2].t()?.matmul(&x[0].reshape(&[4096, 384])?)),
        ];
        let wide = if dt == DType::F64 { DType::F64 } else { DType::F32 };
        for (what, f) in head {
            let cpu = f(&ins.iter().map(|t| t.to_dtype(wide).unwrap()).collect::<Vec<_>>()).unwrap().to_dtype(dt).unwrap();
            let gpu = f(&ins.iter().map(|t| t.to_device(gpu()).unwrap()).collect::<Vec<_>>()).unwrap();
            close(&format!("{what}, rows of 65, {dt:?}"), &cpu, &gpu, t * 4.0);
        }
    }
}

/// Layer norms' shapes for the GPU tests: from a few rows to many (6000: several rows a warp
/// in the backward's one-pass kernel, so its staged form refills both row slots), up to the
/// kernels' longest row (`LAYER_NORM_GRADS_MAX_N`) and past it, and no rows at all.
const LN_SHAPES: [&[usize]; 7] = [&[3, 5, 24], &[300, 384], &[2, 3], &[70, 1024], &[4, 1030], &[0, 8], &[6000, 136]];

/// Layer norm's parameter gradients (one pass over x and g, then a fold of per-block
/// partials) against the CPU's composite, from a few rows to many, up to the kernel's longest
/// row and past it (the composite ops on the GPU too).
#[test]
fn layer_norm_param_grads_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        for (i, shape) in LN_SHAPES.into_iter().enumerate() {
            // 6000 rows: the CPU's 16-bit composite rounds each partial sum (0.06 off at F16);
            // the staged kernel it is there for is F32's.
            if shape[0] > 4096 && dt.size_in_bytes() == 2 {
                continue;
            }
            let (x, g) = (randn(shape, 60 + i as u64, dt), randn(shape, 70 + i as u64, dt));
            // The CPU's composite rounds xhat and each product to F16/BF16; the GPU does not.
            let t = if matches!(dt, DType::F16 | DType::BF16) { tol(dt) * 8.0 } else { tol(dt) * 100.0 };
            both(&format!("layer_norm_param_grads {shape:?} {dt:?}"), &[x, g], t, |v| v[0].layer_norm_param_grads(&v[1], 1e-5));
        }
    }
}

/// Layer norm's whole backward in one pass (`layer_norm_grads`: the parameter gradients and,
/// from the same rows in registers, x's gradient), against the CPU's separate ops, at the
/// shapes of `layer_norm_param_grads_match_the_cpu`, past the kernel's longest row too.
#[test]
fn layer_norm_grads_in_one_pass_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        for (i, shape) in LN_SHAPES.into_iter().enumerate() {
            let n = shape[shape.len() - 1];
            let ins = [randn(shape, 80 + i as u64, dt), randn(shape, 90 + i as u64, dt), randn(&[n], 100 + i as u64, dt)];
            let t = if matches!(dt, DType::F16 | DType::BF16) { tol(dt) * 8.0 } else { tol(dt) * 100.0 };
            both(&format!("layer_norm_grads {shape:?} {dt:?}"), &ins, t, |v| {
                let (dx, dw, db) = v[0].layer_norm_grads(&v[1], &v[2], 1e-5)?;
                Tensor::cat(&[&dx.reshape(&[dx.numel()])?, &dw, &db], 0)
            });
        }
    }
}

/// Compile's fold of a residual gradient into layer norm's backward
/// (`passes::fold_residual_into_layer_norm_grads`: `LayerNormGrads` with a fourth input r adds it
/// to x's gradient as it stores it): against the CPU, and on the GPU within F32 rounding of the
/// three-input result plus r (dx rounded as stored, then one add: no FMA), with the
/// parameter gradients unchanged, F32 x with F32 or BF16 g (staged or not) and F64. Then the
/// same with the bias sums row (`passes::ln_bias_sums`).
#[test]
fn layer_norm_grads_with_a_residual_match_the_separate_add() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let grads = |v: &[&Tensor]| {
        Tensor::apply(kiln::tensor::Op::Fused(Fused::LayerNormGrads { eps: 1e-5, sums: None, copy: None }), v, v[0].device())
    };
    for (i, shape) in LN_SHAPES.into_iter().enumerate() {
        let n = shape[shape.len() - 1];
        if n > cuda::kernels::rows::LAYER_NORM_GRADS_MAX_N {
            continue;
        }
        for (xd, gd) in [(DType::F32, DType::F32), (DType::F32, DType::BF16), (DType::F64, DType::F64)] {
            let seed = 110 + 10 * i as u64;
            let ins = [randn(shape, seed, xd), randn(shape, seed + 1, gd), randn(&[n], seed + 2, xd), randn(shape, seed + 3, xd)];
            let what = format!("layer_norm_grads + r {shape:?} {xd:?} g {gd:?}");
            let (at, numel) = (Parts::layer_norm_grads(shape, false).offset(Part::Dx).unwrap(), ins[0].numel());
            // The parameter gradients and dx (the padding between is unspecified).
            both(&what, &ins, tol(xd) * 100.0, |v| {
                let f = grads(&[&v[0], &v[1], &v[2], &v[3]])?;
                Tensor::cat(&[&f.narrow(0, 0, 2 * n)?, &f.narrow(0, at, numel)?], 0)
            });
            let on: Vec<Tensor> = ins.iter().map(|t| t.to_device(gpu()).unwrap()).collect();
            let (four, three) = (grads(&[&on[0], &on[1], &on[2], &on[3]]).unwrap(), grads(&[&on[0], &on[1], &on[2]]).unwrap());
            let dx = |t: &Tensor| t.narrow(0, at, numel).unwrap().reshape(shape).unwrap();
            let want = dx(&three).add(&on[3]).unwrap();
            // (Not bit for bit: NVRTC contracts the two kernels' dx expressions differently.)
            close(&format!("{what}: dx + r"), &want, &dx(&four), tol(xd) * 4.0);
            let params = |t: &Tensor| t.narrow(0, 0, 2 * n).unwrap().to_vec_f64().unwrap();
            assert_eq!(params(&four), params(&three), "{what}: parameter gradients");
            // With the sums row (`passes::ln_bias_sums`): dx (+ r) rounded to BF16 or in x's
            // dtype, summed over the rows, with r and without; the rest as without the row.
            let to = Parts::layer_norm_grads(shape, true).offset(Part::Dx).unwrap();
            for (sums, k) in [(DType::BF16, 4), (xd, 4), (DType::BF16, 3)] {
                let op = kiln::tensor::Op::Fused(Fused::LayerNormGrads { eps: 1e-5, sums: Some(sums), copy: None });
                let with = |v: &[Tensor]| Tensor::apply(op.clone(), &v.iter().take(k).collect::<Vec<_>>(), v[0].device());
                let what = format!("{what}: {k} inputs, sums in {sums:?}");
                // Summing dx rounded to BF16: a last-bit difference in an F64 dx can round it
                // the other way, a BF16 step of that element in the sum (e.g. -10.1751 against
                // -10.1712 in a row of 300).
                let t = if sums == DType::BF16 { tol(DType::BF16) / 4.0 } else { tol(xd) * 100.0 };
                both(&what, &ins, t, |v| {
                    let f = with(v)?;
                    Tensor::cat(&[&f.narrow(0, 0, 3 * n)?, &f.narrow(0, to, numel)?], 0)
                });
                let (f, plain) = (with(&on).unwrap(), if k == 4 { &four } else { &three });
                close(&format!("{what}: dw, db"), &plain.narrow(0, 0, 2 * n).unwrap(), &f.narrow(0, 0, 2 * n).unwrap(), tol(xd));
                let moved = f.narrow(0, to, numel).unwrap().reshape(shape).unwrap();
                close(&format!("{what}: dx"), &dx(plain), &moved, tol(xd) * 4.0);
                // With the copy (`passes::ln_dx_copies`, F32 layer norms): the same flat
                // output, and dx (plus r) in BF16 from the same kernel, as the cast of that dx
                // stores it.
                if xd != DType::F32 {
                    continue;
                }
                let op = kiln::tensor::Op::Fused(Fused::LayerNormGrads { eps: 1e-5, sums: Some(sums), copy: Some(DType::BF16) });
                let refs: Vec<&Tensor> = on.iter().take(k).collect();
                let (flat, copy) = kiln::tensor::fused::layer_norm_grads_with_copy(&op, &refs).unwrap();
                assert_eq!(flat.narrow(0, 0, 3 * n).unwrap().to_vec_f64().unwrap(), f.narrow(0, 0, 3 * n).unwrap().to_vec_f64().unwrap());
                let stored = flat.narrow(0, to, numel).unwrap().reshape(shape).unwrap();
                assert_eq!(stored.to_vec_f64().unwrap(), moved.to_vec_f64().unwrap(), "{what}: dx beside the copy");
                assert_eq!(copy.to_vec_f64().unwrap(), stored.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap(), "{what}: the copy");
            }
        }
    }
}

/// `Fused::GatedSums` (compile's `fuse_gated_sums`: an activation's gradient made, stored and
/// summed over the rows by the column-sum kernel): GELU's and SiLU's, every float dtype, rows
/// of 16-byte vectors (GPT's fc1 width, many chunks) and of single values, and no rows,
/// against the CPU.
#[test]
fn gated_sums_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        let t = product_tol(dt);
        for (i, shape) in [&[300, 384][..], &[4, 1024, 1536], &[5, 7], &[0, 8]].into_iter().enumerate() {
            for gate in [kiln::tensor::UnaryOp::GeluGrad, kiln::tensor::UnaryOp::SiluGrad] {
                let ins = [randn(shape, 300 + i as u64, dt), randn(shape, 310 + i as u64, dt)];
                let (numel, n) = (ins[0].numel(), shape[shape.len() - 1]);
                let tail = Parts::with_tail(shape, &[n]).offset(Part::Tail).unwrap();
                // y, then the sums (the padding between is unspecified).
                both(&format!("gated sums {gate:?} {shape:?} {dt:?}"), &ins, t, |v| {
                    let f = Tensor::apply(kiln::tensor::Op::Fused(Fused::GatedSums { gate }), &[&v[0], &v[1]], v[0].device())?;
                    Tensor::cat(&[&f.narrow(0, 0, numel)?, &f.narrow(0, tail, n)?], 0)
                });
            }
        }
    }
}

/// Compile's folds of autocast's casts into layer norm (`passes::fold_layer_norm_casts`): the
/// forward writing F16/BF16 (the register-resident kernel at 384 and 1024, the loop at 24 and
/// 1030), and the backward reading a BF16 gradient for F32 x (rows up to its one-pass kernel's
/// 1024), against the CPU.
#[test]
fn layer_norm_with_folded_casts_matches_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (i, shape) in LN_SHAPES.into_iter().enumerate() {
        let n = shape[shape.len() - 1];
        let (x, w, b) =
            (randn(shape, 110 + i as u64, DType::F32), randn(&[n], 120 + i as u64, DType::F32), randn(&[n], 130 + i as u64, DType::F32));
        for to in [DType::BF16, DType::F16] {
            let op = kiln::tensor::Op::Fused(Fused::NormalizeTo { eps: 1e-5, to });
            both(&format!("layer norm {shape:?} written as {to:?}"), &[x.clone(), w.clone(), b.clone()], tol(to), |v| {
                let y = Tensor::apply(op.clone(), &[&v[0], &v[1], &v[2]], v[0].device())?;
                assert_eq!(y.dtype(), to);
                y.to_dtype(DType::F32)
            });
        }
        if n > kiln::tensor::cuda::kernels::rows::LAYER_NORM_GRADS_MAX_N {
            continue; // the one-pass backward's limit (autograd takes other ops past it)
        }
        let g = randn(shape, 140 + i as u64, DType::BF16);
        both(&format!("layer norm grads {shape:?}, g in BF16"), &[x.clone(), g, w.clone()], tol(DType::F32) * 100.0, |v| {
            let flat = Tensor::apply(kiln::tensor::Op::LayerNormGrads { eps: 1e-5 }, &[&v[0], &v[1], &v[2]], v[0].device())?;
            // The parameter gradients, then x's (the padding between them is not part of it).
            let dx = flat.narrow(0, Parts::layer_norm_grads(v[0].shape(), false).offset(Part::Dx)?, v[0].numel())?;
            Tensor::cat(&[&flat.narrow(0, 0, 2 * n)?, &dx], 0)
        });
    }
}

/// `Fused::Matmul` (compile's matmul epilogues): cuBLASLt's RELU(_BIAS), GELU_AUX(_BIAS)
/// and DGELU epilogues where they apply (BGRADA/BGRADB where Kiln's column sums do not fit),
/// the product then kernels where not (a batch, an unaligned bias, F64 if cuBLASLt has no
/// such epilogue), and the operand sums by `column_sums`, all against the CPU.
#[test]
fn fused_matmul_epilogues_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        let t = product_tol(dt);
        // A small shape and a wider one (other cuBLASLt kernels and epilogue paths).
        for (k, n) in [(24, 16), (64, 48)] {
            fused_epilogue_cases(dt, t, k, n);
        }
        // Bias gradients over many rows (`kiln_tensor::cuda::kernels::reduce::column_sums`: chunks of rows, added in
        // order): 16-byte vectors where the columns allow (392), one value a lane where not.
        // 16-bit against the CPU in F32, rounded once: its 16-bit product rounds each of the 4100
        // partial sums (5 % off on an H200), where the GPU accumulates in F32.
        for n in [392, 390] {
            let (g, x) = (randn(&[4100, n], 58, dt), randn(&[4100, 8], 59, dt));
            for (what, side, a, b) in
                [("g^T x", kiln::tensor::MatmulEpilogue::SumLeft, &g, &x), ("x^T g", kiln::tensor::MatmulEpilogue::SumRight, &x, &g)]
            {
                let f = |a: &Tensor, b: &Tensor| fused(side)(&[a.t()?, b.clone()]);
                let wide = |t: &Tensor| if t.dtype().size_in_bytes() == 2 { t.to_dtype(DType::F32).unwrap() } else { t.clone() };
                let dev = gpu();
                // The sums, the flat output's last n: the 4100-deep product is cuBLAS's (its
                // split-K partials in F16 are 14 % off the F32 reference at n = 390).
                let sums = |t: Tensor| t.narrow(0, t.numel() - n, n).unwrap();
                let cpu = sums(f(&wide(a), &wide(b)).unwrap().to_dtype(dt).unwrap());
                let gpu = sums(f(&a.to_device(dev).unwrap(), &b.to_device(dev).unwrap()).unwrap());
                close(&format!("matmul_sum long {what} {dt:?}, n {n}"), &cpu, &gpu, t * 4.0);
            }
        }
    }
}

/// `Op::Fused(Fused::Matmul(e))` as a test function: the product and the sums (the padding between
/// them is left unwritten on CUDA).
fn fused(e: kiln::tensor::MatmulEpilogue) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    use kiln::tensor::{MatmulEpilogue as E, Op};
    move |x: &[Tensor]| {
        let out = Tensor::apply(Op::Fused(Fused::Matmul(e)), &x.iter().collect::<Vec<_>>(), x[0].device())?;
        if matches!(e, E::Relu | E::DGeluTanh | E::DRelu | E::Residual) {
            return Ok(out);
        }
        let numel = x[0].matmul(&x[1])?.numel();
        let at = Parts::with_tail(&[numel], &[]).offset(Part::Tail)?;
        Tensor::cat(&[&out.narrow(0, 0, numel)?, &out.narrow(0, at, out.shape()[0] - at)?], 0)
    }
}

/// `fused_matmul_epilogues_match_the_cpu` at one shape: `[37, k] x [k, n]`.
fn fused_epilogue_cases(dt: DType, t: f64, k: usize, n: usize) {
    use kiln::tensor::MatmulEpilogue as E;
    let (a, b, bias) = (randn(&[37, k], 40, dt), randn(&[k, n], 41, dt), randn(&[n], 42, dt));
    both(&format!("matmul_relu {dt:?}, k {k} n {n}"), &[a.clone(), b.clone()], t, fused(E::Relu));
    both(&format!("matmul_relu + bias {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), bias.clone()], t, fused(E::Relu));
    both(&format!("matmul_relu batched {dt:?}, k {k} n {n}"), &[randn(&[3, 37, k], 43, dt), randn(&[3, k, n], 44, dt)], t, fused(E::Relu));
    both(&format!("matmul_relu + unaligned bias {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), randn(&[n + 1], 45, dt)], t, |x| {
        fused(E::Relu)(&[x[0].clone(), x[1].clone(), x[2].narrow(0, 1, n)?])
    });
    // GELU (tanh form) with its pre-activation, and the product by its gradient. cuBLASLt
    // evaluates the gradient's formula differently (3e-9 relative in F64).
    let tg = if dt == DType::F64 { 1e-8 } else { t };
    both(&format!("matmul_gelu_tanh {dt:?}, k {k} n {n}"), &[a.clone(), b.clone()], tg, fused(E::GeluTanh));
    both(&format!("matmul_gelu_tanh + bias {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), bias.clone()], tg, fused(E::GeluTanh));
    both(
        &format!("matmul_gelu_tanh [B, T, C] {dt:?}, k {k} n {n}"),
        &[randn(&[3, 37, k], 50, dt), b.clone(), bias.clone()],
        tg,
        fused(E::GeluTanh),
    );
    both(&format!("matmul_gelu_tanh + unaligned bias {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), randn(&[n + 1], 45, dt)], tg, |x| {
        fused(E::GeluTanh)(&[x[0].clone(), x[1].clone(), x[2].narrow(0, 1, n)?])
    });
    both(&format!("matmul_dgelu_tanh {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), randn(&[37, n], 51, dt)], tg, fused(E::DGeluTanh));
    both(&format!("matmul_drelu {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), randn(&[37, n], 53, dt)], t, fused(E::DRelu));
    both(&format!("matmul_dgelu_tanh, h a view {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), randn(&[37, n + 1], 52, dt)], tg, |x| {
        fused(E::DGeluTanh)(&[x[0].clone(), x[1].clone(), x[2].narrow(1, 1, n)?])
    });
    // A weight gradient g^T x with its bias gradient sum(g): g read transposed.
    let (g, x) = (randn(&[300, k], 46, dt), randn(&[300, 40], 47, dt));
    both(&format!("matmul_sum g^T x {dt:?}, k {k} n {n}"), &[g.clone(), x.clone()], t * 4.0, |v| {
        fused(E::SumLeft)(&[v[0].t()?, v[1].clone()])
    });
    both(&format!("matmul_sum left {dt:?}, k {k} n {n}"), &[a.clone(), b.clone()], t, fused(E::SumLeft));
    both(&format!("matmul_sum right {dt:?}, k {k} n {n}"), &[a.clone(), b.clone()], t, fused(E::SumRight));
    both(&format!("matmul_sum x^T g {dt:?}, k {k} n {n}"), &[x.clone(), g.clone()], t * 4.0, |v| {
        fused(E::SumRight)(&[v[0].t()?, v[1].clone()])
    });
    both(&format!("matmul_sum k=0 {dt:?}, k {k} n {n}"), &[randn(&[3, 0], 48, dt), randn(&[0, 5], 49, dt)], 0.0, fused(E::SumLeft));
    // No columns: only the row sums (a short contraction the thin kernel would otherwise take).
    both(&format!("matmul_sum n=0 {dt:?}, k {k} n {n}"), &[randn(&[3, 4], 56, dt), randn(&[4, 0], 57, dt)], t, fused(E::SumLeft));
    // A residual add, with a bias after it, and read strided (no epilogue takes it).
    let r = randn(&[37, n], 54, dt);
    both(&format!("matmul_residual {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), r.clone()], t, fused(E::Residual));
    both(&format!("matmul_residual + bias {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), r.clone(), bias.clone()], t, fused(E::Residual));
    both(&format!("matmul_residual, r transposed {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), randn(&[n, 37], 55, dt)], t, |x| {
        fused(E::Residual)(&[x[0].clone(), x[1].clone(), x[2].t()?])
    });
    // A 16-bit product summed into an F32 residual (autocast's residual stream): cuBLASLt's
    // C of its own with an F32 D (the product unrounded, where the CPU rounds it first).
    // Also with an F32 bias (compile reads autocast's parameter in F32), and where C cannot be
    // the residual (read transposed) or the epilogue the bias (unaligned): kernels after it.
    if dt.size_in_bytes() == 2 {
        let r32 = randn(&[37, n], 54, DType::F32);
        let b32 = randn(&[n], 42, DType::F32);
        both(&format!("matmul_residual into F32 {dt:?}, k {k} n {n}"), &[a.clone(), b.clone(), r32.clone()], t, fused(E::Residual));
        both(
            &format!("matmul_residual + bias into F32 {dt:?}, k {k} n {n}"),
            &[a.clone(), b.clone(), r32.clone(), bias.clone()],
            t,
            fused(E::Residual),
        );
        both(
            &format!("matmul_residual + F32 bias into F32 {dt:?}, k {k} n {n}"),
            &[a.clone(), b.clone(), r32.clone(), b32.clone()],
            t,
            fused(E::Residual),
        );
        both(
            &format!("matmul_residual into F32, r transposed {dt:?}, k {k} n {n}"),
            &[a.clone(), b.clone(), randn(&[n, 37], 55, DType::F32), b32],
            t,
            |x| fused(E::Residual)(&[x[0].clone(), x[1].clone(), x[2].t()?, x[3].clone()]),
        );
        both(
            &format!("matmul_residual + unaligned bias into F32 {dt:?}, k {k} n {n}"),
            &[a.clone(), b.clone(), r32, randn(&[n + 1], 45, dt)],
            t,
            |x| fused(E::Residual)(&[x[0].clone(), x[1].clone(), x[2].clone(), x[3].narrow(0, 1, n)?]),
        );
    }
}

/// Column sums, layer norm's backward and Kiln's F32 GEMM under `MaxAutotune`'s flag
/// (`tune::set_autotune`): the chunk, block or part count is timed once per problem (in a cache
/// folder of the test's own, which then holds each choice), the results still match the CPU's,
/// and the next call takes the kept choice (no timing, the same bits).
#[test]
fn kiln_kernels_tuned_under_autotune_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    // A cache folder of this run's own, so that no earlier run's choices answer.
    let dir = std::env::temp_dir().join(format!("kiln-tune-test-{}", std::process::id()));
    std::env::set_var("KILN_CACHE_DIR", &dir);
    let rows = 4111;
    for dt in [DType::F32, DType::BF16] {
        let x = randn(&[rows, 392], 60, dt);
        let wide = if dt == DType::F32 { x.clone() } else { x.to_dtype(DType::F32).unwrap() };
        let cpu = wide.sum(&[0], false).unwrap().to_dtype(dt).unwrap();
        let xg = x.to_device(dev).unwrap();
        let tuned = |x: &Tensor| {
            cuda::tune::set_autotune(true);
            let s = x.sum(&[0], false);
            cuda::tune::set_autotune(false);
            s.unwrap()
        };
        let before = cuda::tune::tuning_stats().0;
        let first = tuned(&xg);
        let timed = cuda::tune::tuning_stats().0;
        assert_eq!(timed, before + 1, "{dt:?}: one column-sum problem timed");
        close(&format!("tuned column sums {dt:?}, {rows} rows"), &cpu, &first, if dt == DType::F32 { 1e-4 } else { 1.6e-2 });
        let again = tuned(&xg);
        assert_eq!(cuda::tune::tuning_stats().0, timed, "{dt:?}: the kept choice, not timed again");
        assert_eq!(first.to_vec_f64().unwrap(), again.to_vec_f64().unwrap(), "{dt:?}: the same chunking, the same bits");
    }
    // Layer norm's one-pass backward: its blocks an SM timed the same way.
    let ins = [randn(&[rows, 384], 61, DType::F32), randn(&[rows, 384], 62, DType::F32), randn(&[384], 63, DType::F32)];
    let grads = |v: &[Tensor]| -> Tensor {
        let (dx, dw, db) = v[0].layer_norm_grads(&v[1], &v[2], 1e-5).unwrap();
        Tensor::cat(&[&dx.reshape(&[dx.numel()]).unwrap(), &dw, &db], 0).unwrap()
    };
    let on_gpu: Vec<Tensor> = ins.iter().map(|t| t.to_device(dev).unwrap()).collect();
    let before = cuda::tune::tuning_stats().0;
    cuda::tune::set_autotune(true);
    let tuned = grads(&on_gpu);
    cuda::tune::set_autotune(false);
    assert_eq!(cuda::tune::tuning_stats().0, before + 1, "layer norm's backward timed");
    close(&format!("tuned layer_norm_grads, {rows} rows"), &grads(&ins), &tuned, tol(DType::F32) * 100.0);
    // Kiln's F32 GEMM (a few rows through a Linear, the Transformer's shape): the contraction's
    // parts timed, each count adding the same terms in another grouping.
    let m = 333;
    let ins = [randn(&[m, 512], 64, DType::F32), randn(&[512, 512], 65, DType::F32), randn(&[512], 66, DType::F32)];
    let linear = |v: &[Tensor]| v[0].matmul_bias(&v[1].t().unwrap(), &v[2]).unwrap();
    let on_gpu: Vec<Tensor> = ins.iter().map(|t| t.to_device(dev).unwrap()).collect();
    let (before, launches) = (cuda::tune::tuning_stats().0, cuda::wgmma_launches());
    cuda::tune::set_autotune(true);
    let tuned = linear(&on_gpu);
    cuda::tune::set_autotune(false);
    assert!(cuda::wgmma_launches() > launches, "the product took Kiln's GEMM");
    assert_eq!(cuda::tune::tuning_stats().0, before + 1, "the GEMM's parts timed");
    close(&format!("tuned [{m}, 512] x [512, 512]^T + bias"), &linear(&ins), &tuned, tol(DType::F32) * 10.0);
    std::env::remove_var("KILN_CACHE_DIR");
    let files = std::fs::read_dir(dir.join("tuned")).map(|d| d.count()).unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(files, 4, "each tuned choice is kept on disk (two column sums, layer norm, the GEMM)");
}

/// Products at the MLP's shapes, F32 and F64, against the CPU: the weight gradients at batch
/// 32 with their bias gradients (the operand sums), a product by a narrow layer's weight
/// transposed, the classifier head with bias and ReLU, the weight gradients at batch 4096
/// (long contractions, which cuBLAS splits over blocks) with their bias gradients, ragged
/// shapes, and short or narrow products.
#[test]
fn products_at_the_mlp_shapes_match_the_cpu() {
    use kiln::tensor::MatmulEpilogue as E;
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in [DType::F32, DType::F64] {
        let t = tol(dt) * 10.0;
        let (x, g1, h, g2) = (randn(&[32, 784], 90, dt), randn(&[32, 256], 91, dt), randn(&[32, 256], 92, dt), randn(&[32, 10], 93, dt));
        both(&format!("x^T g + sum(g) {dt:?}"), &[x.clone(), g1.clone()], t, |v| fused(E::SumRight)(&[v[0].t()?, v[1].clone()]));
        both(&format!("h^T g + sum(g) {dt:?}"), &[h.clone(), g2.clone()], t, |v| fused(E::SumRight)(&[v[0].t()?, v[1].clone()]));
        both(&format!("g^T h + sum(g) {dt:?}"), &[g2.clone(), h.clone()], t, |v| fused(E::SumLeft)(&[v[0].t()?, v[1].clone()]));
        // The first layer's weight and bias gradients as compile orders them (the thin kernel).
        both(&format!("g^T x + sum(g) {dt:?}"), &[g1.clone(), x.clone()], t, |v| fused(E::SumLeft)(&[v[0].t()?, v[1].clone()]));
        let (w2, b1) = (randn(&[256, 10], 94, dt), randn(&[256], 95, dt));
        both(&format!("g w^T {dt:?}"), &[randn(&[4096, 10], 96, dt), w2.clone()], t, |v| v[0].matmul(&v[1].t()?));
        both(&format!("g w^T + bias, relu {dt:?}"), &[randn(&[300, 10], 97, dt), w2.clone(), b1.clone()], t, |v| {
            fused(E::Relu)(&[v[0].clone(), v[1].t()?, v[2].clone()])
        });
        let (hb, b2) = (randn(&[4096, 256], 98, dt), randn(&[10], 99, dt));
        both(&format!("head h w + b {dt:?}"), &[hb.clone(), w2.clone(), b2.clone()], t, |v| v[0].matmul_bias(&v[1], &v[2]));
        both(&format!("head h w + b, relu {dt:?}"), &[h.clone(), w2.clone(), b2.clone()], t, fused(E::Relu));
        both(&format!("a^T w, short k {dt:?}"), &[randn(&[200, 64], 100, dt), randn(&[200, 16], 101, dt)], t, |v| v[0].t()?.matmul(&v[1]));
        // Long contractions down a^T's columns (the MLP's weight gradients at batch 4096,
        // with the bias gradients), a ragged one, and with bias and ReLU.
        let (hl, gl) = (randn(&[4096, 256], 106, dt), randn(&[4096, 10], 107, dt));
        both(&format!("h^T g + sum(g), k 4096 {dt:?}"), &[hl.clone(), gl.clone()], t * 4.0, |v| {
            fused(E::SumRight)(&[v[0].t()?, v[1].clone()])
        });
        both(&format!("g^T h + sum(g), k 4096 {dt:?}"), &[gl.clone(), hl.clone()], t * 4.0, |v| {
            fused(E::SumLeft)(&[v[0].t()?, v[1].clone()])
        });
        both(&format!("a b + row sums, 5 wide {dt:?}"), &[randn(&[37, 24], 111, dt), randn(&[24, 5], 112, dt)], t, fused(E::SumLeft));
        let (hr, gr) = (randn(&[1000, 70], 108, dt), randn(&[1000, 16], 109, dt));
        both(&format!("h^T g, ragged {dt:?}"), &[hr.clone(), gr.clone()], t * 4.0, |v| v[0].t()?.matmul(&v[1]));
        both(&format!("h^T g + b, relu {dt:?}"), &[hr, gr, randn(&[16], 110, dt)], t * 4.0, |v| {
            fused(E::Relu)(&[v[0].t()?, v[1].clone(), v[2].clone()])
        });
        // A contraction of 33, and 17 columns.
        both(&format!("k = 33 {dt:?}"), &[randn(&[40, 33], 102, dt), randn(&[33, 20], 103, dt)], t, |v| v[0].matmul(&v[1]));
        both(&format!("n = 17 {dt:?}"), &[randn(&[40, 300], 104, dt), randn(&[300, 17], 105, dt)], t, |v| v[0].matmul(&v[1]));
        // The narrow-product kernel (at most 16 columns): a head's weight read transposed, A
        // rows cut from a wider buffer, one column, 16 columns, a contraction of one, and
        // rows that are not a multiple of the block's eight.
        let w = randn(&[10, 300], 113, dt);
        both(&format!("narrow h w^T + b {dt:?}"), &[randn(&[1001, 300], 114, dt), w.clone(), b2.clone()], t, |v| {
            v[0].linear(&v[1], Some(&v[2]))
        });
        both(&format!("narrow, a cut from wider rows, relu {dt:?}"), &[randn(&[77, 320], 115, dt), w, b2.clone()], t, |v| {
            fused(E::Relu)(&[v[0].narrow(1, 20, 300)?, v[1].t()?, v[2].clone()])
        });
        // The short-product kernels (at most 16 rows, a contraction of 1024 or more, chunks
        // of 64 folded in order): a ragged contraction, two column blocks, one row, A's rows
        // read across a transposed buffer, with and without the row sums.
        let (gs, hs) = (randn(&[1500, 5], 118, dt), randn(&[1500, 300], 119, dt));
        both(&format!("short g^T h, k 1500 {dt:?}"), &[gs.clone(), hs.clone()], t * 4.0, |v| v[0].t()?.matmul(&v[1]));
        both(&format!("short g^T h + sum(g), k 1500 {dt:?}"), &[gs, hs], t * 4.0, |v| fused(E::SumLeft)(&[v[0].t()?, v[1].clone()]));
        both(&format!("short [1, 2048] x [2048, 7] {dt:?}"), &[randn(&[1, 2048], 120, dt), randn(&[2048, 7], 121, dt)], t * 4.0, |v| {
            v[0].matmul(&v[1])
        });
        // The thin-product kernel (a contraction of at most 32), with the ReLU's gradient: the
        // MLP's backward through its head, h a view, and a product with no mask.
        let (gh, hh) = (randn(&[4096, 10], 122, dt), randn(&[4096, 257], 123, dt));
        both(&format!("thin g w * step(h) {dt:?}"), &[gh.clone(), randn(&[10, 256], 124, dt), hh], t, |v| {
            fused(E::DRelu)(&[v[0].clone(), v[1].clone(), v[2].narrow(1, 1, 256)?])
        });
        both(
            &format!("thin g w * step(h), four a thread {dt:?}"),
            &[gh.clone(), randn(&[10, 256], 127, dt), randn(&[4096, 256], 128, dt)],
            t,
            fused(E::DRelu),
        );
        both(&format!("thin g w, four a thread {dt:?}"), &[gh.clone(), randn(&[10, 64], 129, dt)], t, |v| v[0].matmul(&v[1]));
        both(&format!("thin g^T-read [33, 3] x [3, 70] {dt:?}"), &[randn(&[3, 33], 125, dt), randn(&[3, 70], 126, dt)], t, |v| {
            v[0].t()?.matmul(&v[1])
        });
        for (m, k, n) in [(9, 700, 1), (50, 64, 16), (13, 1, 7)] {
            both(&format!("narrow [{m}, {k}] x [{k}, {n}] {dt:?}"), &[randn(&[m, k], 116, dt), randn(&[k, n], 117, dt)], t, |v| {
                v[0].matmul(&v[1])
            });
        }
        // The few-rows kernel (at most 32 rows, in one launch): the MLP's first layer with
        // bias and ReLU (its weight read transposed), ragged rows, columns and contraction
        // with B's rows contiguous, one row, and A read down a transposed buffer.
        both(&format!("few x w1^T + b1, relu {dt:?}"), &[x.clone(), randn(&[256, 784], 130, dt), b1.clone()], t, |v| {
            fused(E::Relu)(&[v[0].clone(), v[1].t()?, v[2].clone()])
        });
        both(&format!("few [19, 300] x [300, 37] {dt:?}"), &[randn(&[19, 300], 131, dt), randn(&[300, 37], 132, dt)], t, |v| {
            v[0].matmul(&v[1])
        });
        both(
            &format!("few [1, 129] x [129, 100] + b {dt:?}"),
            &[randn(&[1, 129], 133, dt), randn(&[129, 100], 134, dt), randn(&[100], 135, dt)],
            t,
            |v| v[0].matmul_bias(&v[1], &v[2]),
        );
        both(&format!("few a^T [5, 200] x [200, 40] {dt:?}"), &[randn(&[200, 5], 136, dt), randn(&[200, 40], 137, dt)], t, |v| {
            v[0].t()?.matmul(&v[1])
        });
    }
}

/// `Fused::CrossEntropyMean` (compile's one-block mean loss and gradient) against the CPU, with
/// ignored targets, label smoothing, more rows than the block has warps, and F64.
#[test]
fn fused_mean_cross_entropy_matches_the_cpu() {
    use kiln::tensor::Op;
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Rows of one to 32 threads each (`xent_mean_threads_per_row`), some sharing their last
    // warp with rows past the end.
    let cases = [
        (32, 10, 0.0, DType::F32),
        (4096, 10, 0.1, DType::F32),
        (4093, 10, 0.0, DType::F32),
        (5, 3, 0.0, DType::F32),
        (33, 20, 0.1, DType::F64),
        (7, 64, 0.0, DType::F32),
        (100, 700, 0.0, DType::F64),
    ];
    for (rows, classes, smoothing, dt) in cases {
        let logits = randn(&[rows, classes], 70, dt).mul_scalar(3.0).unwrap();
        // Every seventh target ignored.
        let t: Vec<i64> = (0..rows as i64).map(|i| if i % 7 == 3 { -100 } else { (i * 5 + 1) % classes as i64 }).collect();
        let targets = Tensor::from_vec(t, &[rows], Device::Cpu).unwrap();
        let op = Op::Fused(Fused::CrossEntropyMean { ignore_index: Some(-100), smoothing });
        let what = format!("cross_entropy_mean [{rows}, {classes}] {dt:?} smoothing {smoothing}");
        both(&what, &[logits, targets], tol(dt) * 10.0, |x| {
            let out = Tensor::apply(op.clone(), &[&x[0], &x[1]], x[0].device())?;
            // The loss and the gradient (the padding between is left unwritten on CUDA).
            let at = Parts::cross_entropy_mean(rows, classes).offset(Part::Dx)?;
            Tensor::cat(&[&out.narrow(0, 0, 1)?, &out.narrow(0, at, rows * classes)?], 0)
        });
    }
}

/// Cross-entropy per row on BF16 and F16 logits read as they are (F32 losses, a gradient in
/// the logits' dtype), at GPT-2's vocabulary (rows of a block) and short rows (a warp each),
/// with masked `-inf` logits, ignored targets and label smoothing, against the CPU.
#[test]
fn cross_entropy_on_half_logits_matches_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (rows, classes, smoothing) in [(24, 50304, 0.0), (40, 257, 0.1)] {
        for dt in [DType::BF16, DType::F16] {
            let mut v = randn(&[rows, classes], 71, DType::F32).mul_scalar(4.0).unwrap().to_vec::<f32>().unwrap();
            // The first logits of every third row masked out, as a vocabulary's padding is.
            (0..rows).step_by(3).for_each(|r| v[r * classes..r * classes + 7].fill(f32::NEG_INFINITY));
            let logits = Tensor::from_vec(v, &[rows, classes], Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let t: Vec<i64> = (0..rows as i64).map(|i| if i % 5 == 2 { -100 } else { (i * 7919 + 11) % classes as i64 }).collect();
            let targets = Tensor::from_vec(t, &[rows], Device::Cpu).unwrap();
            let gr = randn(&[rows], 72, DType::F32);
            let what = format!("cross_entropy [{rows}, {classes}] {dt:?} smoothing {smoothing}");
            both(&format!("{what} losses"), &[logits.clone(), targets.clone()], 1e-4, |x| {
                let losses = x[0].cross_entropy_rows(&x[1], Some(-100), smoothing)?;
                assert_eq!(losses.dtype(), dt, "{what}: losses outside autocast keep the logits' dtype");
                // The F32 losses the kernel wrote, before the cast back.
                Tensor::apply(kiln::tensor::Op::CrossEntropy { ignore_index: Some(-100), smoothing }, &[&x[0], &x[1]], x[0].device())
            });
            both(&format!("{what} gradient"), &[logits, targets, gr], tol(dt), |x| {
                x[0].cross_entropy_rows_backward(&x[1], &x[2], Some(-100), smoothing)
            });
        }
    }
}

#[test]
fn fused_classifier_head_matches_the_cpu() {
    use kiln::tensor::Op;
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // (rows, classes, features, drelu, smoothing, h a column slice, w read transposed)
    let cases = [
        (32, 10, 48, true, 0.0, false, false),
        (16, 5, 32, true, 0.0, false, true),
        (5, 3, 7, false, 0.1, true, false),
        (64, 16, 16, true, 0.0, true, true),
        (600, 2, 13, false, 0.0, false, false),
        // MLP b32's head (eight blocks of 4 rows), and rows and features that split unevenly.
        (32, 10, 256, true, 0.0, false, false),
        (33, 10, 100, true, 0.1, true, true),
    ];
    for (n, c, f, drelu, smoothing, sliced, transposed) in cases {
        let h = randn(&[n, f + 3], 71, DType::F32).relu().unwrap();
        let h = if sliced { h.narrow(1, 2, f).unwrap() } else { h.narrow(1, 0, f).unwrap().contiguous().unwrap() };
        let w = if transposed { randn(&[f, c], 72, DType::F32).t().unwrap() } else { randn(&[c, f], 72, DType::F32) };
        let b = randn(&[c], 73, DType::F32);
        let t: Vec<i64> = (0..n as i64).map(|i| if i % 7 == 3 { -100 } else { (i * 5 + 1) % c as i64 }).collect();
        let targets = Tensor::from_vec(t, &[n], Device::Cpu).unwrap();
        let op = Op::Fused(Fused::LinearCrossEntropyMean { ignore_index: Some(-100), smoothing, drelu });
        let what = format!("linear_cross_entropy_mean [{n}, {f}] x [{c}, {f}] drelu {drelu} smoothing {smoothing}");
        both(&what, &[h, w, b, targets], 1e-4, |x| {
            let out = Tensor::apply(op.clone(), &[&x[0], &x[1], &x[2], &x[3]], x[0].device())?;
            // The loss, the weight and bias gradients, h's gradient (the padding is unwritten).
            let parts = Parts::linear_cross_entropy_mean(n, c, f);
            let (dw, db, dh) = (parts.offset(Part::Dw)?, parts.offset(Part::Db)?, parts.offset(Part::Dx)?);
            Tensor::cat(&[&out.narrow(0, 0, 1)?, &out.narrow(0, dw, c * f)?, &out.narrow(0, db, c)?, &out.narrow(0, dh, n * f)?], 0)
        });
    }
    // A head past the kernel's limit is refused, naming the shapes.
    let dev = gpu();
    let big: Vec<Tensor> = [randn(&[256, 256], 77, DType::F32), randn(&[10, 256], 78, DType::F32), randn(&[10], 79, DType::F32)]
        .iter()
        .map(|x| x.to_device(dev).unwrap())
        .collect();
    let t256 = Tensor::zeros(&[256], DType::I64, dev).unwrap();
    let op = Op::Fused(Fused::LinearCrossEntropyMean { ignore_index: Some(-100), smoothing: 0.0, drelu: false });
    let err = Tensor::apply(op, &[&big[0], &big[1], &big[2], &t256], dev).unwrap_err().to_string();
    assert!(err.contains("[256, 256]") && err.contains("[10, 256]"), "{err}");
    // A target outside the classes is an error at the next host read, as for cross_entropy.
    let ins = [randn(&[4, 8], 74, DType::F32), randn(&[3, 8], 75, DType::F32), randn(&[3], 76, DType::F32)];
    let ins: Vec<Tensor> = ins.iter().map(|x| x.to_device(dev).unwrap()).collect();
    let bad = Tensor::from_vec(vec![0i64, 1, 3, 2], &[4], Device::Cpu).unwrap().to_device(dev).unwrap();
    let op = Op::Fused(Fused::LinearCrossEntropyMean { ignore_index: Some(-100), smoothing: 0.0, drelu: false });
    let err = Tensor::apply(op, &[&ins[0], &ins[1], &ins[2], &bad], dev).and_then(|o| o.to_vec_f64()).unwrap_err().to_string();
    assert!(err.contains("cross_entropy") && err.contains("out of range"), "{err}");
}

#[test]
fn indexing_cat_and_in_place_updates_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in FLOATS {
        let x = randn(&[5, 4, 3], 23, dt);
        let idx = Tensor::from_slice(&[4i64, 0, 2, 2], &[4], Device::Cpu).unwrap();
        both(&format!("index_select 0 {dt:?}"), &[x.clone(), idx.clone()], 0.0, |v| v[0].index_select(0, &v[1]));
        both(&format!("index_select 1 {dt:?}"), &[x.clone(), idx.narrow(0, 1, 2).unwrap()], 0.0, |v| {
            v[0].transpose(0, 1)?.index_select(1, &v[1])
        });
        let src = randn(&[5, 4, 4], 24, dt);
        let idx2 = Tensor::from_slice(&[2i64, 0, 2], &[3], Device::Cpu).unwrap();
        both(&format!("index_add {dt:?}"), &[x.clone(), idx2, src], tol(dt) * 2.0, |v| v[0].index_add(2, &v[1], &v[2].narrow(2, 0, 3)?));
        let gi = Tensor::from_slice(&[0i64, 3, 1, 1, 2, 0], &[2, 3], Device::Cpu).unwrap();
        let m = randn(&[2, 4], 25, dt);
        both(&format!("gather {dt:?}"), &[m.clone(), gi.clone()], 0.0, |v| v[0].gather(1, &v[1]));
        both(&format!("scatter_add {dt:?}"), &[m.clone(), gi.clone(), randn(&[2, 3], 26, dt)], tol(dt) * 2.0, |v| {
            v[0].scatter_add(1, &v[1], &v[2])
        });
        both(&format!("cat {dt:?}"), &[m.clone(), randn(&[4, 2], 27, dt)], 0.0, |v| Tensor::cat(&[&v[0], &v[1].t()?, &v[0]], 0));
        both(&format!("cat dim1 {dt:?}"), &[m.clone(), randn(&[2, 3], 28, dt)], 0.0, |v| Tensor::cat(&[&v[0], &v[1]], 1));
        both(
            &format!("embedding {dt:?}"),
            &[randn(&[10, 6], 29, dt), Tensor::from_slice(&[3i64, 9, 0, 3], &[2, 2], Device::Cpu).unwrap()],
            0.0,
            |v| v[0].embedding(&v[1]),
        );
        // Many rows of a warp's width or more (a warp a row: `kiln_tensor::cuda::kernels::index::select_by_rows`), from
        // dim 0 and from dim 1 of three matrices; and an index_add reading a whole, dense
        // source where it lies.
        let many: Vec<i64> = (0..9000).map(|i| (i * 7 + i / 13) % 10).collect();
        let ids = Tensor::from_slice(&many, &[90, 100], Device::Cpu).unwrap();
        both(&format!("embedding wide rows {dt:?}"), &[randn(&[10, 40], 32, dt), ids.clone()], 0.0, |v| v[0].embedding(&v[1]));
        both(&format!("index_select wide rows, dim 1 {dt:?}"), &[randn(&[3, 10, 40], 34, dt), ids], 0.0, |v| {
            v[0].index_select(1, &v[1].reshape(&[9000])?.narrow(0, 0, 3000)?)
        });
        // index_add a warp a source row too: 9000 rows of 40 into 3000 (three adds a row: the
        // CPU rounds F16/BF16 at each add, the GPU once).
        let spread: Vec<i64> = (0..9000).map(|i| (i * 7919) % 3000).collect();
        let spread = Tensor::from_slice(&spread, &[9000], Device::Cpu).unwrap();
        both(
            &format!("index_add wide rows {dt:?}"),
            &[randn(&[3000, 40], 35, dt), spread, randn(&[9000, 40], 36, dt)],
            tol(dt) * 4.0,
            |v| v[0].index_add(0, &v[1], &v[2]),
        );
        let idx3 = Tensor::from_slice(&[1i64, 1, 0, 4], &[4], Device::Cpu).unwrap();
        both(&format!("index_add dense source {dt:?}"), &[x.clone(), idx3, randn(&[4, 4, 3], 33, dt)], tol(dt) * 2.0, |v| {
            v[0].index_add(0, &v[1], &v[2])
        });
        // In place through a strided view: only the view's elements change.
        both(&format!("in place {dt:?}"), &[randn(&[6, 5], 30, dt), randn(&[5], 31, dt)], tol(dt), |v| {
            let dst = v[0].copy()?;
            let view = dst.narrow(0, 1, 3)?.t()?;
            view.add_(&v[1].narrow(0, 0, 3)?.unsqueeze(0)?)?;
            dst.narrow(1, 4, 1)?.mul_scalar_(3.0)?;
            dst.narrow(0, 5, 1)?.assign(&v[1])?;
            Ok(dst)
        });
    }
}

/// Gradients of `f` with respect to its float inputs, on one device.
fn grads(ins: &[Tensor], f: &dyn Fn(&[Tensor]) -> Result<Tensor>) -> Vec<Tensor> {
    for t in ins.iter().filter(|t| t.dtype().is_float()) {
        t.set_requires_grad(true);
    }
    let y = f(ins).unwrap();
    let w = Tensor::rand_at(y.shape(), Distribution::Normal, 77, 0, DType::F32, Device::Cpu).unwrap().to_dtype(y.dtype()).unwrap();
    y.mul(&w.to_device(y.device()).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    ins.iter().filter(|t| t.dtype().is_float()).map(|t| t.grad().expect("a gradient")).collect()
}

#[test]
fn backward_of_every_differentiable_op_matches_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    type F = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
    let cases: Vec<(&str, Vec<Tensor>, F)> = vec![
        (
            "unary chain",
            vec![randn(&[4, 6], 40, DType::F32)],
            Box::new(|x| {
                let a = x[0].exp()?.add(&x[0].sin()?)?.add(&x[0].tanh()?)?.add(&x[0].sigmoid()?)?;
                let b = x[0].gelu()?.add(&x[0].silu()?)?.add(&x[0].relu()?)?.add(&x[0].abs()?.add_scalar(0.5)?.log()?)?;
                a.add(&b)?.add(&x[0].square()?.add_scalar(1.0)?.sqrt()?)
            }),
        ),
        (
            "binary broadcast",
            vec![randn(&[4, 6], 41, DType::F32), randn(&[6], 42, DType::F32)],
            Box::new(|x| {
                let d = x[1].abs()?.add_scalar(0.5)?;
                x[0].mul(&x[1])?.sub(&x[0].div(&d)?)?.add(&x[0].maximum(&x[1])?)?.add(&x[0].minimum(&x[1])?)
            }),
        ),
        (
            "pow and where",
            vec![randn(&[5, 3], 43, DType::F32)],
            Box::new(|x| {
                let p = x[0].abs()?.add_scalar(0.2)?.powf(1.7)?;
                Tensor::where_cond(&x[0].gt_scalar(0.0)?, &p, &x[0].mul_scalar(-2.0)?)
            }),
        ),
        (
            "reductions",
            vec![randn(&[4, 5, 6], 44, DType::F32)],
            Box::new(|x| {
                x[0].sum(&[1usize][..], true)?
                    .add(&x[0].max(&[2usize][..], true)?)?
                    .add(&x[0].min(&[0usize][..], true)?)?
                    .add(&x[0].mean(&[0usize, 2][..], true)?)
            }),
        ),
        (
            "linear with bias",
            vec![randn(&[3, 4, 5], 57, DType::F32), randn(&[6, 5], 58, DType::F32), randn(&[6], 59, DType::F32)],
            Box::new(|x| x[0].linear(&x[1], Some(&x[2]))?.mul(&x[0].sum(&[2usize][..], true)?)),
        ),
        (
            "matmul and views",
            vec![randn(&[3, 4, 5], 45, DType::F32), randn(&[6, 5], 46, DType::F32)],
            Box::new(|x| {
                x[0].matmul(&x[1].t()?)?.permute(&[2, 0, 1])?.narrow(0, 1, 4)?.reshape(&[4, 12][..])?.expand(&[2, 4, 12])?.contiguous()
            }),
        ),
        ("softmax, log_softmax", vec![randn(&[4, 7], 47, DType::F32)], Box::new(|x| x[0].softmax(1)?.add(&x[0].log_softmax(0)?))),
        ("causal softmax", vec![randn(&[2, 5, 7], 53, DType::F32)], Box::new(|x| x[0].softmax_scaled(0.4, true))),
        (
            "softmax and log_softmax, rows longer than a block",
            vec![randn(&[2, 1500], 56, DType::F32)],
            Box::new(|x| x[0].softmax(1)?.mul_scalar(3.0)?.add(&x[0].log_softmax(1)?)),
        ),
        (
            "indexing and cat",
            vec![randn(&[6, 4], 48, DType::F32), Tensor::from_slice(&[5i64, 0, 5, 2], &[4], Device::Cpu).unwrap()],
            Box::new(|x| {
                let sel = x[0].index_select(0, &x[1])?;
                let gi = x[1].narrow(0, 0, 2)?.reshape(&[2, 1][..])?.expand(&[2, 4])?.contiguous()?;
                Tensor::cat(&[&sel, &x[0].gather(0, &gi)?, &x[0].embedding(&x[1])?], 0)
            }),
        ),
        (
            "cross entropy",
            vec![randn(&[8, 5], 49, DType::F32), Tensor::from_slice(&[0i64, 4, 2, 2, 1, 3, 0, 4], &[8], Device::Cpu).unwrap()],
            Box::new(|x| cross_entropy(&x[0], &x[1])),
        ),
        (
            "cross entropy, ignored rows and label smoothing",
            vec![randn(&[6, 5], 54, DType::F32), Tensor::from_slice(&[0i64, -100, 2, 4, -100, 3], &[6], Device::Cpu).unwrap()],
            Box::new(|x| cross_entropy_with(&x[0], &x[1], CrossEntropyConfig { label_smoothing: 0.1, ..Default::default() })),
        ),
        (
            "cross entropy, rows longer than a block",
            vec![randn(&[3, 1500], 55, DType::F32), Tensor::from_slice(&[1499i64, 0, 700], &[3], Device::Cpu).unwrap()],
            Box::new(|x| {
                let cfg = CrossEntropyConfig { label_smoothing: 0.05, reduction: Reduction::Sum, ..Default::default() };
                cross_entropy_with(&x[0], &x[1], cfg)
            }),
        ),
        ("dtype casts", vec![randn(&[3, 4], 50, DType::F32)], Box::new(|x| x[0].to_dtype(DType::F64)?.exp()?.to_dtype(DType::F32))),
        ("normalize", vec![randn(&[6, 40], 52, DType::F32)], Box::new(|x| x[0].normalize(1e-5)?.mul(&x[0].t()?.normalize(1e-5)?.t()?))),
    ];
    for (name, ins, f) in cases {
        let cpu = grads(&ins, &*f);
        let g_ins: Vec<Tensor> = ins.iter().map(|t| t.detach().to_device(dev).unwrap()).collect();
        let cuda = grads(&g_ins, &*f);
        for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
            close(&format!("grad {i} of {name}"), c, g, 1e-4);
        }
    }
    // LayerNorm as a layer, parameters on the GPU.
    kiln::tensor::rng::manual_seed(3);
    let ln_c = LayerNorm::new(6, 1e-5, Device::Cpu).unwrap();
    kiln::tensor::rng::manual_seed(3);
    let ln_g = LayerNorm::new(6, 1e-5, dev).unwrap();
    let x = randn(&[4, 6], 51, DType::F32);
    close("layer norm", &ln_c.forward(&x).unwrap(), &ln_g.forward(&x.to_device(dev).unwrap()).unwrap(), 1e-5);
}

#[test]
fn cuda_errors_are_clear() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    // Mixed devices.
    let a = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    let b = a.to_device(dev).unwrap();
    let e = a.add(&b).unwrap_err().to_string();
    assert!(e.contains("different devices"), "{e}");
    // A bad embedding index: the kernel records it, the next host read reports it.
    let table = Tensor::ones(&[10, 4], DType::F32, dev).unwrap();
    let ids = Tensor::from_slice(&[1i64, 12, 3], &[3], dev).unwrap();
    let out = table.embedding(&ids).unwrap();
    let e = out.to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("index_select") && e.contains("12") && e.contains("size 10"), "{e}");
    // The error is reported once; the device keeps working.
    assert_eq!(table.sum_all().unwrap().item().unwrap(), 40.0);
    // The same from the warp-a-row path (9000 rows of 40).
    let wide = Tensor::ones(&[10, 40], DType::F32, dev).unwrap();
    let mut many = vec![1i64; 9000];
    many[4321] = 12;
    let ids = Tensor::from_slice(&many, &[9000], dev).unwrap();
    let e = wide.embedding(&ids).unwrap().to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("index_select") && e.contains("12") && e.contains("size 10"), "{e}");
    // And index_add's warp-a-row path: the bad row adds nothing, the error names it.
    let src = Tensor::ones(&[9000, 40], DType::F32, dev).unwrap();
    let e = wide.index_add(0, &ids, &src).unwrap().to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("index_add") && e.contains("12") && e.contains("size 10"), "{e}");
    // A cross-entropy target beyond the classes: the same path.
    let targets = Tensor::from_slice(&[1i64, 4], &[2], dev).unwrap();
    let e = cross_entropy(&table.narrow(0, 0, 2).unwrap(), &targets).unwrap().item().unwrap_err().to_string();
    assert!(e.contains("cross_entropy") && e.contains("index 4") && e.contains("size 4"), "{e}");
    // Out of memory: a clear error naming the request, and the GPU still works after it.
    let e = Tensor::zeros(&[1 << 40], DType::F32, dev).unwrap_err().to_string();
    assert!(e.contains("out of memory") && e.contains("4398046511104 bytes"), "{e}");
    assert_eq!(b.add(&b).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
    // A GPU that does not exist.
    let e = a.to_device(Device::Cuda(99)).unwrap_err().to_string();
    assert!(e.contains("Cuda(99)"), "{e}");
}

#[test]
fn steady_state_ops_make_no_driver_allocation() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let x = randn(&[64, 128], 60, DType::F32).to_device(dev).unwrap();
    let w = randn(&[128, 32], 61, DType::F32).to_device(dev).unwrap();
    let run = || x.matmul(&w).unwrap().relu().unwrap().sum_all().unwrap();
    run();
    cuda::synchronize(dev).unwrap();
    let before = cuda::driver_allocations();
    for _ in 0..10 {
        run();
    }
    cuda::synchronize(dev).unwrap();
    assert_eq!(cuda::driver_allocations(), before, "the caching allocator served every buffer");
}

/// Fused attention (`Tensor::attention` and its backward kernels) against the CPU's f64
/// reference: every float dtype the kernels take, causal and not, T a multiple of the
/// kernels' tiles or not, or short (at most 32: the short-sequence forward), head dims for every kernel family (F32's D = 20 takes the FMA kernels, the
/// others the tensor-core ones), inputs through a transposed view (split heads), and the
/// gradients through autograd.
#[test]
fn fused_attention_matches_the_cpu_forward_and_backward() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let mut before = cuda::attention_lse_reuses();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (b, h, t, d, causal) in [
            (2, 3, 70, 64, true),
            (2, 3, 70, 64, false),
            (1, 2, 33, 32, true),
            (1, 1, 130, 128, true),
            (1, 2, 200, 24, true),
            (1, 1, 100, 96, false),
            (1, 2, 50, 20, true),
            // T a whole number of tiles; D = 48 (16-bit tiles by the general copy loop) and
            // D = 16 (two 16-byte pieces a row; dq's g.o a column in four).
            (1, 2, 128, 48, true),
            (2, 2, 64, 16, false),
            // Short sequences (the CUDA cores' kernel, a lane per key).
            (2, 3, 10, 64, false),
            (2, 2, 17, 20, true),
            (1, 3, 32, 128, true),
        ] {
            let what = format!("attention {dt:?} [{b}, {h}, {t}, {d}] causal {causal}");
            // [B, T, H, D] buffers viewed as [B, H, T, D], as a model splits heads.
            let ins: Vec<Tensor> = (0..4).map(|s| randn(&[b, t, h, d], 60 + s, dt)).collect();
            let scale = 1.0 / (d as f64).sqrt();
            both(&format!("{what}: forward"), &ins, tol(dt), |x| {
                x[0].transpose(1, 2)?.attention(&x[1].transpose(1, 2)?, &x[2].transpose(1, 2)?, scale, causal)
            });
            // Written with the heads after T (compile's `attention_heads_last`).
            both(&format!("{what}: forward, heads last"), &ins, tol(dt), |x| {
                let op = kiln::tensor::Op::Fused(kiln::tensor::Fused::AttentionHeadsLast { scale, causal });
                let qkv: Vec<Tensor> = x[..3].iter().map(|t| t.transpose(1, 2)).collect::<Result<_>>()?;
                Tensor::apply(op, &qkv.iter().collect::<Vec<_>>(), x[0].device())
            });
            both(&format!("{what}: gradients"), &ins, tol(dt) * 2.0, |x| {
                let qkv: Vec<Tensor> = x[..3].iter().map(|t| t.transpose(1, 2).unwrap().contiguous().unwrap()).collect();
                qkv.iter().for_each(|t| {
                    t.set_requires_grad(true);
                });
                let out = qkv[0].attention(&qkv[1], &qkv[2], scale, causal)?;
                out.mul(&x[3].transpose(1, 2)?)?.sum_all()?.backward()?;
                let grads: Vec<Tensor> = qkv.iter().map(|t| t.grad().expect("a gradient")).collect();
                Tensor::cat(&grads.iter().collect::<Vec<_>>(), 0)
            });
            // The tensor-core forward keeps each row's log-sum-exp with its output, and the
            // backward above read it; a copy of the output carries none, so dq finds it again.
            let flash = t > 32 && (d % 16 == 0 || (dt == DType::F32 && d % 8 == 0));
            let reused = cuda::attention_lse_reuses();
            both(&format!("{what}: gradients, log-sum-exp recomputed"), &ins, tol(dt) * 2.0, |x| {
                let qkv: Vec<Tensor> = x[..3].iter().map(|t| t.transpose(1, 2).unwrap().contiguous().unwrap()).collect();
                let out = qkv[0].attention(&qkv[1], &qkv[2], scale, causal)?.copy()?;
                qkv[0].attention_backward(&qkv[1], &qkv[2], &out, &x[3].transpose(1, 2)?, scale, causal)
            });
            assert_eq!(cuda::attention_lse_reuses(), reused, "{what}: a copy of the output kept no log-sum-exp");
            if flash {
                assert!(reused > before, "{what}: the backward read the forward's log-sum-exp");
            }
            before = reused;
        }
    }
    let _ = dev;
}

/// Grouped-query attention on the GPU (k and v with fewer heads, read per group by the
/// tensor-core kernels, repeated into a copy for the FMA ones) against the CPU, forward and
/// gradients, with the heads cut from `[B, T, H, D]` buffers as a model splits them.
#[test]
fn grouped_query_attention_matches_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in [DType::BF16, DType::F32] {
        for (b, h, hkv, t, d, causal) in
            [(2, 4, 2, 70, 64, true), (1, 6, 1, 130, 128, false), (2, 4, 2, 17, 32, true), (1, 4, 2, 50, 20, true)]
        {
            let what = format!("grouped-query attention {dt:?} q [{b}, {h}, {t}, {d}] k, v [{b}, {hkv}, {t}, {d}] causal {causal}");
            let ins = vec![
                randn(&[b, t, h, d], 80, dt),
                randn(&[b, t, hkv, d], 81, dt),
                randn(&[b, t, hkv, d], 82, dt),
                randn(&[b, t, h, d], 83, dt),
            ];
            let scale = 1.0 / (d as f64).sqrt();
            both(&format!("{what}: forward"), &ins, tol(dt), |x| {
                x[0].transpose(1, 2)?.attention(&x[1].transpose(1, 2)?, &x[2].transpose(1, 2)?, scale, causal)
            });
            both(&format!("{what}: gradients"), &ins, tol(dt) * 2.0, |x| {
                let qkv: Vec<Tensor> = x[..3].iter().map(|t| t.transpose(1, 2).unwrap().contiguous().unwrap()).collect();
                qkv.iter().for_each(|t| _ = t.set_requires_grad(true));
                let out = qkv[0].attention(&qkv[1], &qkv[2], scale, causal)?;
                out.mul(&x[3].transpose(1, 2)?)?.sum_all()?.backward()?;
                let grads: Vec<Tensor> = qkv.iter().map(|t| t.grad().expect("a gradient").reshape(&[-1i64][..]).unwrap()).collect();
                Tensor::cat(&grads.iter().collect::<Vec<_>>(), 0)
            });
        }
    }
}

/// The tensor-core attention kernels take more than 65535 batch matrices (their grid puts the
/// matrices along x), forward and backward, against the CPU; the FMA kernels (F32 with D =
/// 20) say clearly that they do not.
#[test]
fn fused_attention_takes_more_than_65535_matrices() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, t, d) = (65540, 40, 16);
    let ins: Vec<Tensor> = (0..4).map(|s| randn(&[n, t, d], 150 + s, DType::BF16)).collect();
    let scale = 0.25;
    both("attention over 65540 matrices: forward", &ins, tol(DType::BF16), |x| x[0].attention(&x[1], &x[2], scale, true));
    both("attention over 65540 matrices: gradients", &ins, tol(DType::BF16) * 2.0, |x| {
        let o = x[0].attention(&x[1], &x[2], scale, true)?;
        x[0].attention_backward(&x[1], &x[2], &o, &x[3], scale, true)
    });
    let q = randn(&[n, t, 20], 160, DType::F32).to_device(gpu()).unwrap();
    let err = q.attention(&q, &q, scale, true).expect_err("the FMA kernels take at most 65535 matrices");
    assert!(err.to_string().contains("at most 65535 batch matrices"), "{err}");
}

/// Fused attention reading q, k and v where a model's fused projection leaves them: heads cut
/// from one `[B, T, 3 * H * D]` buffer, read in place by the tensor-core kernels. A row stride
/// that breaks their 16-byte loads (`pad` 3) takes the dense copy instead. Forward and the
/// gradient of the fused buffer, against the CPU.
#[test]
fn fused_attention_reads_heads_of_a_fused_projection_in_place() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (b, h, t, d, pad) in [(2, 3, 70, 64, 0), (3, 2, 64, 32, 8), (1, 2, 45, 64, 3)] {
            let what = format!("attention {dt:?} from a fused [{b}, {t}, 3 x {h} x {d} + {pad}] buffer");
            let e = h * d;
            let ins = [randn(&[b, t, 3 * e + pad], 70, dt), randn(&[b, t, e], 71, dt)];
            let heads = |qkv: &Tensor, i: usize| qkv.narrow(2, pad + i * e, e)?.reshape(&[b, t, h, d])?.transpose(1, 2);
            both(&format!("{what}: forward"), &ins, tol(dt), |x| {
                heads(&x[0], 0)?.attention(&heads(&x[0], 1)?, &heads(&x[0], 2)?, 1.0 / (d as f64).sqrt(), true)
            });
            both(&format!("{what}: gradient"), &ins, tol(dt) * 2.0, |x| {
                let qkv = x[0].detach();
                qkv.set_requires_grad(true);
                let out = heads(&qkv, 0)?.attention(&heads(&qkv, 1)?, &heads(&qkv, 2)?, 1.0 / (d as f64).sqrt(), true)?;
                // The output gradient arrives as heads of a [B, T, H * D] buffer too.
                out.mul(&x[1].reshape(&[b, t, h, d])?.transpose(1, 2)?)?.sum_all()?.backward()?;
                qkv.grad().ok_or_else(|| kiln::tensor::Error::Msg("no gradient".into()))
            });
        }
    }
}

#[test]
fn autotuned_matmuls_match_the_cpu_and_are_kept_on_disk() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("kiln-lt-test-{}", std::process::id()));
    std::env::set_var("KILN_CACHE_DIR", &dir);
    let (before, _) = cuda::lt::tuning_stats();
    cuda::tune::set_autotune(true);
    // Shapes no other test uses (plans are cached per shape): plain, transposed, batched.
    for dt in [DType::F32, DType::BF16] {
        let (a, b) = (randn(&[131, 77], 90, dt), randn(&[77, 45], 91, dt));
        both(&format!("tuned matmul {dt:?}"), &[a, b], tol(dt), |x| x[0].matmul(&x[1]));
        let (a, b) = (randn(&[77, 131], 92, dt), randn(&[45, 77], 93, dt));
        both(&format!("tuned transposed matmul {dt:?}"), &[a, b], tol(dt), |x| x[0].t()?.matmul(&x[1].t()?));
        let (a, b) = (randn(&[3, 29, 77], 94, dt), randn(&[3, 77, 45], 95, dt));
        both(&format!("tuned batched matmul {dt:?}"), &[a, b], tol(dt), |x| x[0].matmul(&x[1]));
    }
    cuda::tune::set_autotune(false);
    let (after, took) = cuda::lt::tuning_stats();
    std::env::remove_var("KILN_CACHE_DIR");
    let files = std::fs::read_dir(dir.join("cublaslt")).map(|d| d.count()).unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    println!("tuned {} shapes in {took:?}, {files} kept on disk", after - before);
    assert!(after - before >= 6, "each new shape is timed ({} were)", after - before);
    assert!(files >= 6, "tuned choices are written to the cache folder ({files} files)");
}

/// Kiln's Hopper F32 GEMM (`wgmma`, three TF32 products a step) against the CPU in all four
/// operand layouts, with ragged edges (rows, columns and a contraction not multiples of the
/// tiles) and every epilogue it takes; then the same products through cuBLAS, to show that
/// both agree with the CPU to F32's tolerance. On a GPU other than `sm_90` it says it skipped.
#[test]
fn hopper_f32_gemm_matches_the_cpu_in_every_layout_and_epilogue() {
    use kiln::tensor::MatmulEpilogue as E;
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let Device::Cuda(ordinal) = dev else { unreachable!("gpu() gives a CUDA device") };
    let cc = cuda::compute_capability(ordinal).unwrap();
    if cc != (9, 0) {
        println!("SKIPPED: Kiln's wgmma GEMM needs an sm_90 GPU; this one is sm_{}{}", cc.0, cc.1);
        return;
    }
    let dt = DType::F32;
    cuda::set_f32_gemm(cuda::F32Gemm::Kiln);
    let t = tol(dt) * 10.0;
    let mut missed = Vec::new();
    for (m, k, n) in [(300, 36, 260), (132, 200, 8), (4, 4, 4), (260, 1000, 132), (1032, 40, 36), (200, 400, 200)] {
        let (a, at, b, bt) = (randn(&[m, k], 60, dt), randn(&[k, m], 61, dt), randn(&[k, n], 62, dt), randn(&[n, k], 63, dt));
        let (bias, h) = (randn(&[n], 64, dt), randn(&[m, n], 65, dt));
        type Case = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
        let cases: [(&str, Vec<Tensor>, Case); 8] = [
            ("a b", vec![a.clone(), b.clone()], Box::new(|v| v[0].matmul(&v[1]))),
            ("a w^T", vec![a.clone(), bt.clone()], Box::new(|v| v[0].matmul(&v[1].t()?))),
            ("x^T b", vec![at.clone(), b.clone()], Box::new(|v| v[0].t()?.matmul(&v[1]))),
            ("x^T w^T", vec![at.clone(), bt.clone()], Box::new(|v| v[0].t()?.matmul(&v[1].t()?))),
            (
                "a w^T + bias, relu",
                vec![a.clone(), bt.clone(), bias.clone()],
                Box::new(|v| fused(E::Relu)(&[v[0].clone(), v[1].t()?, v[2].clone()])),
            ),
            (
                "a w^T + bias, gelu with its input",
                vec![a.clone(), bt.clone(), bias.clone()],
                Box::new(|v| fused(E::GeluTanh)(&[v[0].clone(), v[1].t()?, v[2].clone()])),
            ),
            ("g w * gelu'(h)", vec![a.clone(), b.clone(), h.clone()], Box::new(fused(E::DGeluTanh))),
            ("g w * step(h)", vec![a.clone(), b.clone(), h.clone()], Box::new(fused(E::DRelu))),
        ];
        // (The second, fourth and last shapes split the contraction, into 3, 8 and 5 parts, the
        // last part short; the fifth has enough rows for a row-major B to be copied transposed
        // first.)
        for (what, ins, f) in cases {
            let what = format!("{what}, m {m} k {k} n {n}");
            let before = cuda::wgmma_launches();
            both(&what, &ins, t, f);
            if cuda::wgmma_launches() == before {
                missed.push(what);
            }
        }
    }
    // A sequence-first `[T, B, C]` input read batch-first, `x.transpose(0, 1) @ w^T + bias`
    // (an attention's projection): its rows do not fold, so the kernel reads them through its
    // row map. The first shape splits its contraction, the second has ragged tiles.
    for (tl, bl, c, n) in [(10, 32, 512, 512), (7, 5, 36, 260)] {
        let ins = vec![randn(&[tl, bl, c], 68, dt), randn(&[n, c], 69, dt), randn(&[n], 70, dt)];
        let what = format!("[{tl}, {bl}, {c}] read batch-first @ w^T + bias, relu, n {n}");
        let before = cuda::wgmma_launches();
        both(&what, &ins, t, |v| fused(E::Relu)(&[v[0].transpose(0, 1)?, v[1].t()?, v[2].clone()]));
        if cuda::wgmma_launches() == before {
            missed.push(what);
        }
        // A batch-first product added to a sequence-first residual (a Transformer's attention
        // output projection and its residual connection), in the product's epilogue.
        let ins = vec![randn(&[bl, tl, c], 71, dt), randn(&[n, c], 72, dt), randn(&[tl, bl, n], 73, dt), randn(&[n], 74, dt)];
        let what = format!("[{bl}, {tl}, {c}] read sequence-first @ w^T + bias + residual, n {n}");
        let before = cuda::wgmma_launches();
        both(&what, &ins, t, |v| fused(E::Residual)(&[v[0].transpose(0, 1)?, v[1].t()?, v[2].clone(), v[3].clone()]));
        if cuda::wgmma_launches() == before {
            missed.push(what);
        }
    }
    assert!(missed.is_empty(), "products that did not take Kiln's GEMM: {missed:?}");
    // A [B, T, C] input folded into rows, against cuBLAS's result on the same GPU.
    let (x, w) = (randn(&[3, 100, 64], 66, dt).to_device(dev).unwrap(), randn(&[96, 64], 67, dt).to_device(dev).unwrap());
    let ours = x.matmul(&w.t().unwrap()).unwrap();
    cuda::set_f32_gemm(cuda::F32Gemm::Cublas);
    let theirs = x.matmul(&w.t().unwrap()).unwrap();
    cuda::set_f32_gemm(cuda::F32Gemm::Auto);
    let (o, c) = (ours.to_vec_f64().unwrap(), theirs.to_vec_f64().unwrap());
    let worst = o.iter().zip(&c).map(|(p, q)| (p - q).abs() / (1.0 + q.abs())).fold(0.0, f64::max);
    assert!(worst < 1e-5, "Kiln's GEMM against cuBLAS's: {worst}");
}

/// The composite ops and the losses and layers built from them on CUDA against
/// the CPU, forward and the input's gradient, in F32.
#[test]
fn composites_losses_and_group_norm_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dt = DType::F32;
    let (x, y) = (randn(&[6, 10], 40, dt), randn(&[6, 10], 41, dt));
    let p = randn(&[6, 10], 42, dt).sigmoid().unwrap();
    let grad_of = |f: &dyn Fn(&Tensor) -> Result<Tensor>, t: &Tensor| -> Result<Tensor> {
        let leaf = t.copy()?;
        leaf.set_requires_grad(true);
        f(&leaf)?.sum_all()?.backward()?;
        Ok(leaf.grad().unwrap())
    };
    type Case = (&'static str, Box<dyn Fn(&Tensor, &Tensor) -> Result<Tensor>>);
    let cases: Vec<Case> = vec![
        ("logsumexp", Box::new(|a, _| a.logsumexp(&[1usize][..], false))),
        ("std", Box::new(|a, _| a.std(&[0usize][..], true, 1))),
        ("cumsum", Box::new(|a, _| a.cumsum(1usize))),
        ("tril flip repeat", Box::new(|a, _| a.tril(1)?.flip(&[0usize][..])?.repeat(&[2, 1]))),
        ("masked_fill", Box::new(|a, b| a.masked_fill(&b.gt_scalar(0.0)?, -2.0))),
        ("huber", Box::new(|a, b| kiln::nn::huber_loss(a, b, 0.5, Reduction::Mean))),
        ("smooth_l1", Box::new(|a, b| kiln::nn::smooth_l1_loss(a, b, 0.5, Reduction::Sum))),
        ("bce_with_logits", Box::new(|a, b| kiln::nn::binary_cross_entropy_with_logits(a, &b.sigmoid()?, None, Reduction::Mean))),
        ("kl_div", Box::new(|a, b| kiln::nn::kl_div(&a.log_softmax(1)?, &b.softmax(1)?, false, Reduction::Sum))),
        ("leaky_relu", Box::new(|a, _| kiln::nn::leaky_relu(a, 0.1))),
    ];
    for (name, f) in &cases {
        both(name, &[x.clone(), y.clone()], product_tol(dt), |t| f(&t[0], &t[1]));
        both(&format!("{name} grad"), &[x.clone(), y.clone()], product_tol(dt), |t| grad_of(&|a| f(a, &t[1]), &t[0]));
    }
    both("bce", &[p.clone(), y.sigmoid().unwrap()], product_tol(dt), |t| kiln::nn::binary_cross_entropy(&t[0], &t[1], Reduction::Mean));
    // GroupNorm's affine part starts at ones and zeros on either device.
    both("group norm + adaptive pooling", &[randn(&[2, 6, 5, 4], 43, dt)], product_tol(dt), |t| {
        kiln::nn::adaptive_avg_pool2d(&kiln::nn::GroupNorm::new(3, 6, t[0].device())?.forward(&t[0])?, (3, 3))
    });
}

/// argsort, sort and topk on CUDA (a bitonic sort over padded rows) against the CPU: rows of
/// every length class (1, odd, a power of two, past one shared-memory tile), ties and NaN,
/// every dtype.
#[test]
fn sort_and_topk_match_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    // 2048 fills one shared-memory tile exactly; 20000 pads to 32768, four tiles' merges.
    for n in [1, 7, 64, 1000, 2048, 2049, 5000, 20000] {
        // Whole numbers: many ties, which must keep their order.
        let x =
            randn(&[3, n], 50 + n as u64, DType::F32).mul_scalar(4.0).unwrap().to_dtype(DType::I64).unwrap().to_dtype(DType::F32).unwrap();
        for dt in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U8] {
            let xt = x.to_dtype(dt).unwrap();
            for descending in [false, true] {
                let want = xt.argsort(1usize, descending).unwrap().to_vec::<i64>().unwrap();
                let got = xt.to_device(dev).unwrap().argsort(1usize, descending).unwrap().to_vec::<i64>().unwrap();
                assert_eq!(got, want, "argsort n {n} {dt:?} descending {descending}");
            }
        }
    }
    let nan = Tensor::from_slice(&[2.0f32, f32::NAN, -1.0, 2.0, f32::NAN], &[5], Device::Cpu).unwrap();
    for descending in [false, true] {
        let want = nan.argsort(0usize, descending).unwrap().to_vec::<i64>().unwrap();
        assert_eq!(nan.to_device(dev).unwrap().argsort(0usize, descending).unwrap().to_vec::<i64>().unwrap(), want);
    }
    let x = randn(&[5, 40], 60, DType::F32);
    both("topk values", &[x.clone()], 0.0, |t| Ok(t[0].topk(5, 1usize, true)?.0));
    both("sort dim 0 values", &[x], 0.0, |t| Ok(t[0].sort(0usize, false)?.0));
}

/// index_add (an embedding's gradient) adds each row's sources in index order: the same bits
/// every run, and the CPU's bits, with tokens repeated hundreds of times in an F32 sum (atomic
/// adds would change the last bits from run to run and make training impossible to replay).
#[test]
fn index_add_is_deterministic_and_the_cpus_bits() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let tokens: Vec<i64> = (0..16384i64).map(|i| (i * i * 31 + i / 7) % 300).collect();
    let ids = Tensor::from_slice(&tokens, &[16384], Device::Cpu).unwrap();
    for (inner, outer) in [(64, 1), (5, 2)] {
        let base = randn(&[outer, 300, inner], 70, DType::F32);
        let src = randn(&[outer, 16384, inner], 71, DType::F32);
        let want = base.index_add(1, &ids, &src).unwrap().to_vec::<f32>().unwrap();
        let (b, i, s) = (base.to_device(dev).unwrap(), ids.to_device(dev).unwrap(), src.to_device(dev).unwrap());
        let first = b.index_add(1, &i, &s).unwrap().to_vec::<f32>().unwrap();
        let second = b.index_add(1, &i, &s).unwrap().to_vec::<f32>().unwrap();
        assert!(first.iter().zip(&second).all(|(x, y)| x.to_bits() == y.to_bits()), "index_add differs between runs (inner {inner})");
        assert!(first.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "index_add differs from the CPU's (inner {inner})");
    }
}

/// Attention with S keys for T queries (a decoding step over its cache: one block a query row)
/// against the CPU, forward, in every float dtype: one query over a hundred keys with
/// grouped-query heads, a few causal queries at the end of longer keys, the heads cut from
/// `[B, T, H, D]` buffers as a model splits them, a head dim of 20, and 3000 keys.
#[test]
fn attention_over_more_keys_than_queries_matches_the_cpu() {
    let _only_me = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dt in [DType::BF16, DType::F16, DType::F32] {
        for (b, h, hkv, t, s, d, causal) in
            [(1, 12, 4, 1, 100, 64, false), (2, 4, 2, 5, 37, 128, true), (1, 2, 2, 3, 300, 20, true), (1, 4, 4, 1, 3000, 64, true)]
        {
            let what = format!("attention {dt:?} q [{b}, {h}, {t}, {d}] k, v [{b}, {hkv}, {s}, {d}] causal {causal}");
            let ins = vec![randn(&[b, t, h, d], 90, dt), randn(&[b, s, hkv, d], 91, dt), randn(&[b, s, hkv, d], 92, dt)];
            let scale = 1.0 / (d as f64).sqrt();
            both(&what, &ins, tol(dt), |x| x[0].transpose(1, 2)?.attention(&x[1].transpose(1, 2)?, &x[2].transpose(1, 2)?, scale, causal));
        }
    }
}
