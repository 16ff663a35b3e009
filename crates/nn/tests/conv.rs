//! Convolution and pooling against hand-computed values and direct loops (strides, padding,
//! dilation), their gradients against finite differences, and the layers' init and errors.

use kiln_autograd::{gradcheck, Backward, GradcheckConfig};
use kiln_nn::{
    adaptive_avg_pool2d, avg_pool2d, conv1d, conv2d, conv2d_groups, conv_transpose2d, interpolate, max_pool2d, unfold, AdaptiveAvgPool2d,
    Conv1d, Conv2d, ConvTranspose2d, Flatten, Forward, Interpolation, MaxPool2d, Module, Upsample, Window,
};
use kiln_tensor::{Autocast, DType, Device, Distribution, Result, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F64, Device::Cpu).unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

/// `x[n][c][r][s]` of an NCHW buffer, 0 outside (the padding).
fn at(x: &[f64], shape: [usize; 4], n: usize, c: usize, r: isize, s: isize) -> Option<f64> {
    let [_, cs, h, w] = shape;
    (r >= 0 && s >= 0 && (r as usize) < h && (s as usize) < w).then(|| x[((n * cs + c) * h + r as usize) * w + s as usize])
}

/// Each output position's window in order, by direct loops: `f(values)`, padding as None.
fn each_window(shape: [usize; 4], x: &[f64], win: &Window, mut f: impl FnMut(Vec<Option<f64>>)) -> (usize, usize) {
    let [n, c, h, w] = shape;
    let (k, s, p, d) = (win.kernel, win.stride, win.padding, win.dilation);
    let oh = (h + 2 * p.0 - d.0 * (k.0 - 1) - 1) / s.0 + 1;
    let ow = (w + 2 * p.1 - d.1 * (k.1 - 1) - 1) / s.1 + 1;
    for b in 0..n {
        for ch in 0..c {
            for i in 0..oh {
                for j in 0..ow {
                    let mut vals = Vec::new();
                    for a in 0..k.0 {
                        for e in 0..k.1 {
                            let r = (i * s.0 + a * d.0) as isize - p.0 as isize;
                            let q = (j * s.1 + e * d.1) as isize - p.1 as isize;
                            vals.push(at(x, shape, b, ch, r, q));
                        }
                    }
                    f(vals);
                }
            }
        }
    }
    (oh, ow)
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
    }
}

#[test]
fn a_small_convolution_by_hand() -> Result<()> {
    // x = 1..9 in a 3x3 image; the kernel [[1, 0], [0, -1]] takes x[r][s] - x[r+1][s+1] = -4.
    let x = Tensor::from_vec((1..=9).map(f64::from).collect(), &[1, 1, 3, 3], Device::Cpu)?;
    let w = Tensor::from_vec(vec![1.0, 0.0, 0.0, -1.0], &[1, 1, 2, 2], Device::Cpu)?;
    let b = Tensor::from_vec(vec![0.5], &[1], Device::Cpu)?;
    let y = conv2d(&x, &w, Some(&b), &Window::new((2, 2)))?;
    assert_eq!(y.shape(), &[1, 1, 2, 2]);
    assert_eq!(f64s(&y), vec![-3.5; 4]);
    // Padding 1, stride 2: windows at rows and columns (-1, 0) and (1, 2) of x; each output is
    // x[r][s] - x[r+1][s+1] with zeros outside: 0 - 1, 0 - 3, 0 - 7, 5 - 9.
    let y = conv2d(&x, &w, None, &Window::new((2, 2)).stride((2, 2)).padding((1, 1)))?;
    assert_eq!(f64s(&y), vec![-1.0, -3.0, -7.0, -4.0]);
    Ok(())
}

/// `bias[o] + sum over (c, a, e) of w[o][c][a][e] * x[n][c][i s + a d - p][j s + e d - p]`.
fn conv_by_loops(x: &[f64], xs: [usize; 4], w: &[f64], ws: [usize; 4], b: &[f64], win: &Window) -> (Vec<f64>, usize, usize) {
    let ([n, c, h, wd], [o, _, kh, kw]) = (xs, ws);
    let (s, p, d) = (win.stride, win.padding, win.dilation);
    let oh = (h + 2 * p.0 - d.0 * (kh - 1) - 1) / s.0 + 1;
    let ow = (wd + 2 * p.1 - d.1 * (kw - 1) - 1) / s.1 + 1;
    let mut out = Vec::new();
    for bn in 0..n {
        for oc in 0..o {
            for i in 0..oh {
                for j in 0..ow {
                    let mut acc = b[oc];
                    for ch in 0..c {
                        for a in 0..kh {
                            for e in 0..kw {
                                let r = (i * s.0 + a * d.0) as isize - p.0 as isize;
                                let q = (j * s.1 + e * d.1) as isize - p.1 as isize;
                                acc += w[((oc * c + ch) * kh + a) * kw + e] * at(x, xs, bn, ch, r, q).unwrap_or(0.0);
                            }
                        }
                    }
                    out.push(acc);
                }
            }
        }
    }
    (out, oh, ow)
}

#[test]
fn convolution_matches_direct_loops_with_stride_padding_and_dilation() -> Result<()> {
    let (x, w, b) = (randn(&[2, 3, 7, 6], 1), randn(&[4, 3, 3, 2], 2), randn(&[4], 3));
    for win in [
        Window::new((3, 2)),
        Window::new((3, 2)).stride((2, 3)).padding((1, 2)),
        Window::new((3, 2)).dilation((2, 1)).padding((2, 0)).stride((1, 2)),
        // Windows that tile the input (stride = kernel): the reshaped view, not the stack.
        Window::new((3, 2)).stride((3, 2)).padding((1, 0)),
    ] {
        let y = conv2d(&x, &w, Some(&b), &win)?;
        let (want, oh, ow) = conv_by_loops(&f64s(&x), [2, 3, 7, 6], &f64s(&w), [4, 3, 3, 2], &f64s(&b), &win);
        assert_eq!(y.shape(), &[2, 4, oh, ow], "{win:?}");
        assert_close(&f64s(&y), &want, 1e-12);
    }
    Ok(())
}

#[test]
fn pooling_matches_direct_loops() -> Result<()> {
    let x = randn(&[2, 3, 7, 5], 4);
    let xs = f64s(&x);
    for win in [Window::new((2, 2)).stride((2, 2)), Window::new((3, 2)).stride((2, 1)).padding((1, 1))] {
        let (mut max, mut avg) = (Vec::new(), Vec::new());
        let (oh, ow) = each_window([2, 3, 7, 5], &xs, &win, |vals| {
            max.push(vals.iter().flatten().copied().fold(f64::NEG_INFINITY, f64::max));
            avg.push(vals.iter().map(|v| v.unwrap_or(0.0)).sum::<f64>() / vals.len() as f64);
        });
        let (m, a) = (max_pool2d(&x, &win)?, kiln_nn::avg_pool2d(&x, &win)?);
        assert_eq!(m.shape(), &[2, 3, oh, ow]);
        assert_close(&f64s(&m), &max, 0.0);
        assert_close(&f64s(&a), &avg, 1e-14);
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    let win = Window::new((3, 2)).stride((2, 1)).padding((1, 1)).dilation((1, 2));
    let inputs = [randn(&[2, 2, 5, 6], 5), randn(&[3, 2, 3, 2], 6), randn(&[3], 7)];
    gradcheck(|t| conv2d(&t[0], &t[1], Some(&t[2]), &win), &inputs, cfg)?;
    let tiles = Window::new((3, 2)).stride((3, 2)).padding((1, 1));
    gradcheck(|t| conv2d(&t[0], &t[1], Some(&t[2]), &tiles), &inputs, cfg)?;
    gradcheck(|t| avg_pool2d(&t[0], &Window::new((2, 2)).stride((2, 2))), &inputs[..1], cfg)?;
    let pool = Window::new((2, 3)).stride((2, 2)).padding((1, 1));
    gradcheck(|t| avg_pool2d(&t[0], &pool), &inputs[..1], cfg)?;
    // Max pooling's gradient goes to each window's largest value (distinct values: no ties).
    let x = Tensor::from_vec(
        vec![1.0, 5.0, 2.0, 0.0, 3.0, 4.0, 7.0, 6.0, 9.0, 8.0, -1.0, 10.0, 11.0, 12.0, 13.0, 14.0],
        &[1, 1, 4, 4],
        Device::Cpu,
    )?;
    x.set_requires_grad(true);
    let y = max_pool2d(&x, &Window::new((2, 2)).stride((2, 2)))?;
    assert_eq!(f64s(&y), vec![5.0, 7.0, 12.0, 14.0]);
    y.sum_all()?.backward()?;
    let g = f64s(&x.grad().unwrap());
    assert_eq!(g, vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]);
    Ok(())
}

#[test]
fn unfold_lays_out_channel_then_kernel_offset() -> Result<()> {
    // One 2-channel 2x2 image, a 2x2 kernel: one column holding channel 0's four values, then
    // channel 1's.
    let x = Tensor::from_vec((0..8).map(f64::from).collect(), &[1, 2, 2, 2], Device::Cpu)?;
    let cols = unfold(&x, &Window::new((2, 2)))?;
    assert_eq!(cols.shape(), &[1, 8, 1]);
    assert_eq!(f64s(&cols), (0..8).map(f64::from).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn layers_init_like_pytorch_and_bad_shapes_are_errors() -> Result<()> {
    let conv = Conv2d::new(3, 8, Window::new((3, 3)).padding((1, 1)), true, Device::Cpu)?;
    let mut names = Vec::new();
    conv.visit("conv", &mut |n, t| names.push((n, t.shape().to_vec())));
    assert_eq!(names, vec![("conv.weight".into(), vec![8, 3, 3, 3]), ("conv.bias".into(), vec![8])]);
    let bound = 1.0 / (27f64).sqrt();
    let w = conv.weight.to_vec::<f32>()?;
    assert!(w.iter().all(|v| (v.abs() as f64) <= bound) && w.iter().any(|v| (v.abs() as f64) > bound / 2.0), "U(-1/sqrt(27), 1/sqrt(27))");
    let x = Tensor::rand(&[2, 3, 8, 8], DType::F32, Device::Cpu)?;
    let y = MaxPool2d(Window::new((2, 2)).stride((2, 2))).forward(&conv.forward(&x)?.relu()?)?;
    assert_eq!(Flatten.forward(&y)?.shape(), &[2, 8 * 4 * 4]);

    let e = conv.forward(&Tensor::rand(&[2, 4, 8, 8], DType::F32, Device::Cpu)?).unwrap_err().to_string();
    assert!(e.contains("[2, 4, 8, 8]") && e.contains("3 channels"), "{e}");
    let e = conv.forward(&Tensor::rand(&[3, 8, 8], DType::F32, Device::Cpu)?).unwrap_err().to_string();
    assert!(e.contains("[3, 8, 8]"), "{e}");
    let e = max_pool2d(&Tensor::rand(&[1, 1, 2, 2], DType::F32, Device::Cpu)?, &Window::new((3, 3))).unwrap_err().to_string();
    assert!(e.contains("smaller than the kernel"), "{e}");
    let e = max_pool2d(&x, &Window::new((2, 2)).stride((0, 1))).unwrap_err().to_string();
    assert!(e.contains("must be positive"), "{e}");
    Ok(())
}

#[test]
fn max_pooling_sends_a_tied_windows_gradient_to_its_first_largest() -> Result<()> {
    // Two windows of ties (all 2; a 1 and two 3s), tiled and, with stride 1, stacked.
    let x = Tensor::from_vec(vec![2.0, 2.0, 1.0, 3.0, 2.0, 2.0, 3.0, 0.0], &[1, 1, 2, 4], Device::Cpu)?;
    x.set_requires_grad(true);
    let y = max_pool2d(&x, &Window::new((2, 2)).stride((2, 2)))?;
    assert_eq!(f64s(&y), vec![2.0, 3.0]);
    y.sum_all()?.backward()?;
    assert_eq!(f64s(&x.grad().unwrap()), vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    x.set_grad(None);
    // Windows at columns 0, 1 and 2, read row by row: the third's first 3 is x[0][3].
    let y = max_pool2d(&x, &Window::new((2, 2)))?;
    assert_eq!(f64s(&y), vec![2.0, 3.0, 3.0]);
    y.sum_all()?.backward()?;
    assert_eq!(f64s(&x.grad().unwrap()), vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]);
    Ok(())
}

#[test]
fn pooling_rules_and_edge_cases() -> Result<()> {
    let x = randn(&[1, 2, 4, 4], 8);
    let e = max_pool2d(&x, &Window::new((2, 2)).stride((2, 2)).padding((2, 0))).unwrap_err().to_string();
    assert!(e.contains("at most half the kernel"), "{e}");
    assert!(avg_pool2d(&x, &Window::new((3, 3)).padding((1, 2))).is_err());
    let e = max_pool2d(&Tensor::zeros(&[1, 1, 0, 4], DType::F64, Device::Cpu)?, &Window::new((1, 1))).unwrap_err().to_string();
    assert!(e.contains("0x4"), "{e}");
    // A stride far beyond the input: one output, no padding to the stride's size.
    let y = conv2d(&x, &randn(&[3, 2, 1, 1], 9), None, &Window::new((1, 1)).stride((1_000_000, 1_000_000)))?;
    assert_eq!(y.shape(), &[1, 3, 1, 1]);
    assert_eq!(MaxPool2d::new((2, 2)).forward(&x)?.shape(), &[1, 2, 2, 2], "stride = kernel by default");
    Ok(())
}

#[test]
fn autocast_convolution_stays_in_f16_with_its_bias() -> Result<()> {
    let (x, w, b) = (randn(&[2, 3, 5, 5], 10), randn(&[4, 3, 3, 3], 11), randn(&[4], 12));
    let (x, w, b) = (x.to_dtype(DType::F32)?, w.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let full = conv2d(&x, &w, Some(&b), &Window::new((3, 3)).padding((1, 1)))?;
    let half = {
        let _f16 = Autocast::new(DType::F16)?;
        conv2d(&x, &w, Some(&b), &Window::new((3, 3)).padding((1, 1)))?
    };
    assert_eq!(half.dtype(), DType::F16, "the product and its bias in F16, as PyTorch's autocast");
    let (a, c) = (half.to_dtype(DType::F32)?.to_vec::<f32>()?, full.to_vec::<f32>()?);
    assert!(a.iter().zip(&c).all(|(a, c)| (a - c).abs() <= 2e-2 * (1.0 + c.abs())), "F16 close to F32");
    Ok(())
}

#[test]
fn grouped_convolution_is_one_convolution_per_group() -> Result<()> {
    // 4 channels in 2 groups, 6 filters (3 a group); and depthwise (4 groups, one filter each).
    let win = Window::new((3, 3)).padding((1, 1)).stride((2, 1));
    let x = randn(&[2, 4, 5, 6], 20);
    for (groups, o) in [(2usize, 6usize), (4, 4)] {
        let (w, b) = (randn(&[o, 4 / groups, 3, 3], 21), randn(&[o], 22));
        let y = conv2d_groups(&x, &w, Some(&b), &win, groups)?;
        let per = |g: usize| -> Result<Tensor> {
            let (og, cg) = (o / groups, 4 / groups);
            conv2d(&x.narrow(1usize, g * cg, cg)?, &w.narrow(0usize, g * og, og)?, Some(&b.narrow(0usize, g * og, og)?), &win)
        };
        let parts: Vec<Tensor> = (0..groups).map(per).collect::<Result<_>>()?;
        let want = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 1usize)?;
        assert_eq!(y.shape(), want.shape());
        assert_close(&f64s(&y), &f64s(&want), 1e-12);
    }
    let inputs = [randn(&[2, 4, 4, 5], 23), randn(&[6, 2, 3, 3], 24), randn(&[6], 25)];
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| conv2d_groups(&t[0], &t[1], Some(&t[2]), &win, 2), &inputs, cfg)?;
    let e = Conv2d::with_groups(4, 6, win, 4, true, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("4 groups"), "{e}");
    let depthwise = Conv2d::with_groups(4, 8, win, 4, false, Device::Cpu)?;
    assert_eq!(depthwise.weight.shape(), &[8, 1, 3, 3]);
    assert_eq!(depthwise.forward(&x.to_dtype(DType::F32)?)?.shape(), &[2, 8, 3, 6]);
    assert!(conv2d_groups(&x, &randn(&[6, 2, 3, 3], 26), None, &win, 3).is_err(), "4 channels are not 3 groups of 2");
    Ok(())
}

/// conv1d against a direct loop (stride, padding, dilation), its gradients against finite
/// differences, and the layer's shapes.
#[test]
fn conv1d_matches_a_loop_and_finite_differences() -> Result<()> {
    let (x, w, b) = (randn(&[2, 3, 9], 30), randn(&[4, 3, 3], 31), randn(&[4], 32));
    let win = Window::new((1, 3)).stride((1, 2)).padding((0, 1)).dilation((1, 2));
    let y = conv1d(&x, &w, Some(&b), &win, 1)?;
    let (xv, wv, bv) = (f64s(&x), f64s(&w), f64s(&b));
    let lo = (9 + 2 - 2 * 2 - 1) / 2 + 1;
    assert_eq!(y.shape(), &[2, 4, lo]);
    let mut want = Vec::new();
    for n in 0..2 {
        for o in 0..4 {
            for i in 0..lo {
                let mut acc = bv[o];
                for c in 0..3 {
                    for k in 0..3 {
                        let pos = (i * 2 + k * 2) as isize - 1;
                        if (0..9).contains(&pos) {
                            acc += xv[(n * 3 + c) * 9 + pos as usize] * wv[(o * 3 + c) * 3 + k];
                        }
                    }
                }
                want.push(acc);
            }
        }
    }
    assert_close(&f64s(&y), &want, 1e-12);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| conv1d(&t[0], &t[1], Some(&t[2]), &win, 1), &[x.clone(), w, b], cfg)?;
    let layer = Conv1d::new(3, 5, 4, 1, 0, true, Device::Cpu)?;
    assert_eq!(layer.weight.shape(), &[5, 3, 4]);
    assert_eq!(layer.forward(&x.to_dtype(DType::F32)?)?.shape(), &[2, 5, 6]);
    let e = conv1d(&x, &randn(&[4, 3, 3, 1], 33), None, &win, 1).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 9]") && e.contains("[4, 3, 3, 1]"), "{e}");
    Ok(())
}

/// Adaptive average pooling against PyTorch's windows by loops (sizes that divide the input
/// and sizes that do not, global pooling), and its gradient against finite differences.
#[test]
fn adaptive_average_pooling_uses_pytorchs_windows() -> Result<()> {
    let x = randn(&[2, 3, 7, 5], 40);
    let xv = f64s(&x);
    for (oh, ow) in [(3, 2), (7, 5), (1, 1), (7, 1), (4, 4)] {
        let y = adaptive_avg_pool2d(&x, (oh, ow))?;
        assert_eq!(y.shape(), &[2, 3, oh, ow]);
        let mut want = Vec::new();
        for nc in 0..6 {
            for i in 0..oh {
                for j in 0..ow {
                    let (r0, r1) = (i * 7 / oh, ((i + 1) * 7).div_ceil(oh));
                    let (c0, c1) = (j * 5 / ow, ((j + 1) * 5).div_ceil(ow));
                    let sum: f64 = (r0..r1).flat_map(|r| (c0..c1).map(move |c| (r, c))).map(|(r, c)| xv[(nc * 7 + r) * 5 + c]).sum();
                    want.push(sum / ((r1 - r0) * (c1 - c0)) as f64);
                }
            }
        }
        assert_close(&f64s(&y), &want, 1e-12);
    }
    let x2 = randn(&[1, 2, 6, 4], 41);
    assert_close(&f64s(&adaptive_avg_pool2d(&x2, (3, 2))?), &f64s(&avg_pool2d(&x2, &Window::new((2, 2)).stride((2, 2)))?), 1e-15);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| adaptive_avg_pool2d(&t[0], (3, 2)), std::slice::from_ref(&x), cfg)?;
    assert_eq!(AdaptiveAvgPool2d((1, 1)).forward(&x)?.shape(), &[2, 3, 1, 1]);
    assert!(adaptive_avg_pool2d(&x, (0, 2)).unwrap_err().to_string().contains("[2, 3, 7, 5]"));
    Ok(())
}

/// The transposed convolution by its definition: each input value scatters `x * w` onto the
/// output at `i s - p + a d` (grouped, output padding on the far side).
fn conv_transpose_by_loops(x: &Tensor, w: &Tensor, b: &[f64], win: &Window, op: (usize, usize), groups: usize) -> Vec<f64> {
    let ([n, c, h, wd], [_, og, kh, kw]) = (<[usize; 4]>::try_from(x.shape()).unwrap(), <[usize; 4]>::try_from(w.shape()).unwrap());
    let (s, p, d) = (win.stride, win.padding, win.dilation);
    let oh = (h - 1) * s.0 + d.0 * (kh - 1) + op.0 + 1 - 2 * p.0;
    let ow = (wd - 1) * s.1 + d.1 * (kw - 1) + op.1 + 1 - 2 * p.1;
    let (xv, wv, o) = (f64s(x), f64s(w), og * groups);
    let mut y: Vec<f64> = (0..n * o * oh * ow).map(|i| b[(i / (oh * ow)) % o]).collect();
    for bn in 0..n {
        for ci in 0..c {
            let g = ci / (c / groups);
            for i in 0..h {
                for j in 0..wd {
                    for (oc, a, e) in (0..og).flat_map(|oc| (0..kh).flat_map(move |a| (0..kw).map(move |e| (oc, a, e)))) {
                        let r = (i * s.0 + a * d.0) as isize - p.0 as isize;
                        let q = (j * s.1 + e * d.1) as isize - p.1 as isize;
                        if r >= 0 && q >= 0 && (r as usize) < oh && (q as usize) < ow {
                            let out = ((bn * o + g * og + oc) * oh + r as usize) * ow + q as usize;
                            y[out] += xv[((bn * c + ci) * h + i) * wd + j] * wv[((ci * og + oc) * kh + a) * kw + e];
                        }
                    }
                }
            }
        }
    }
    y
}

#[test]
fn transposed_convolution_matches_its_definition_and_is_conv2ds_adjoint() -> Result<()> {
    // (window, output padding, groups, in, out per group); the fourth pads more than
    // d (k - 1), so the spread input is cropped.
    let cases = [
        (Window::new((3, 3)).stride((2, 2)).padding((1, 1)), (1, 1), 1, 3, 2),
        (Window::new((2, 3)).stride((1, 2)).dilation((2, 1)), (0, 1), 1, 2, 3),
        (Window::new((3, 3)).stride((2, 1)).padding((0, 1)), (1, 0), 2, 4, 1),
        (Window::new((1, 1)).stride((3, 3)).padding((1, 1)), (2, 0), 1, 2, 2),
    ];
    for (k, (win, op, groups, c, og)) in cases.into_iter().enumerate() {
        let x = randn(&[2, c, 3, 4], 10 + k as u64);
        let w = randn(&[c, og, win.kernel.0, win.kernel.1], 20 + k as u64);
        let b = randn(&[og * groups], 30 + k as u64);
        let y = conv_transpose2d(&x, &w, Some(&b), &win, op, groups)?;
        assert_close(&f64s(&y), &conv_transpose_by_loops(&x, &w, &f64s(&b), &win, op, groups), 1e-12);
        // <conv2d(z, w), x> = <z, conv_transpose2d(x, w)> (no bias, no output padding).
        let yt = conv_transpose2d(&x, &w, None, &win, (0, 0), groups)?;
        let z = randn(yt.shape(), 40 + k as u64);
        let lhs = conv2d_groups(&z, &w, None, &win, groups)?.mul(&x)?.sum_all()?.item()?;
        let rhs = z.mul(&yt)?.sum_all()?.item()?;
        assert!((lhs - rhs).abs() < 1e-9 * (1.0 + lhs.abs()), "case {k}: adjoint {lhs} vs {rhs}");
    }
    let win = Window::new((3, 3)).stride((2, 2)).padding((1, 1));
    let inputs = [randn(&[1, 2, 3, 3], 1), randn(&[2, 2, 3, 3], 2), randn(&[2], 3)];
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| conv_transpose2d(&t[0], &t[1], Some(&t[2]), &win, (1, 1), 1), &inputs, cfg)?;

    // The layer: PyTorch's weight layout and init bound 1/sqrt(out * kh * kw), stride 2
    // doubling the size with output padding 1.
    let layer = ConvTranspose2d::new(4, 3, win, true, Device::Cpu)?.output_padding((1, 1));
    assert_eq!(layer.weight.shape(), [4, 3, 3, 3]);
    let bound = 1.0 / 27f64.sqrt();
    for p in layer.parameters() {
        assert!(p.to_dtype(DType::F64)?.to_vec::<f64>()?.iter().all(|v| v.abs() <= bound), "init within {bound}");
    }
    assert_eq!(layer.forward(&Tensor::zeros(&[1, 4, 5, 6], DType::F32, Device::Cpu)?)?.shape(), [1, 3, 10, 12]);
    let e = conv_transpose2d(&x_small(), &randn(&[2, 1, 3, 3], 1), None, &win, (2, 0), 1).unwrap_err().to_string();
    assert!(e.contains("output_padding (2, 0)"), "{e}");
    let e = conv_transpose2d(&x_small(), &randn(&[3, 1, 3, 3], 1), None, &win, (0, 0), 1).unwrap_err().to_string();
    assert!(e.contains("[1, 2, 3, 3]") && e.contains("[3, 1, 3, 3]"), "{e}");
    Ok(())
}

fn x_small() -> Tensor {
    randn(&[1, 2, 3, 3], 5)
}

#[test]
fn interpolation_gives_pytorchs_values() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[1, 1, 2, 2], Device::Cpu)?;
    // PyTorch's documented outputs for this input upsampled by 2.
    let nearest = [1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 3.0, 3.0, 4.0, 4.0];
    let bilinear = [1.0, 1.25, 1.75, 2.0, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3.0, 3.25, 3.75, 4.0];
    let t = 1.0 / 3.0;
    let corners =
        [1.0, 1.0 + t, 2.0 - t, 2.0, 1.0 + 2.0 * t, 2.0, 2.0 + t, 3.0 - t, 2.0 + t, 3.0 - t, 3.0, 3.0 + t, 3.0, 3.0 + t, 4.0 - t, 4.0];
    let up = |mode| Upsample { scale: (2, 2), mode }.forward(&x);
    assert_close(&f64s(&up(Interpolation::Nearest)?), &nearest, 0.0);
    assert_close(&f64s(&up(Interpolation::Bilinear { align_corners: false })?), &bilinear, 1e-12);
    assert_close(&f64s(&up(Interpolation::Bilinear { align_corners: true })?), &corners, 1e-12);

    // Shrinking 5 to 2 (nearest: rows 0 and 2; bilinear: source 0.75 and 3.25).
    let col = Tensor::from_vec(vec![0.0f64, 10.0, 20.0, 30.0, 40.0], &[1, 1, 5, 1], Device::Cpu)?;
    assert_close(&f64s(&interpolate(&col, (2, 1), Interpolation::Nearest)?), &[0.0, 20.0], 0.0);
    assert_close(&f64s(&interpolate(&col, (2, 1), Interpolation::Bilinear { align_corners: false })?), &[7.5, 32.5], 1e-12);

    // Gradients: nearest adds each copy's gradient back, bilinear is linear.
    let z = randn(&[2, 3, 3, 4], 7);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    gradcheck(|t| interpolate(&t[0], (5, 7), Interpolation::Nearest)?.square(), std::slice::from_ref(&z), cfg)?;
    gradcheck(|t| interpolate(&t[0], (2, 6), Interpolation::Bilinear { align_corners: false })?.square(), &[z], cfg)?;
    let e = interpolate(&randn(&[2, 3], 1), (2, 2), Interpolation::Nearest).unwrap_err().to_string();
    assert!(e.contains("[2, 3]"), "{e}");
    Ok(())
}
