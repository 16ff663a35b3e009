//! Batch normalisation against hand-computed statistics (training and eval), its gradient
//! against finite differences, and its buffers in state dicts under PyTorch's names; group
//! normalisation against per-group statistics.

use kiln_autograd::{gradcheck, GradcheckConfig};
use kiln_nn::{load_state_dict_from_bytes, state_dict_to_bytes, BatchNorm, Forward, GroupNorm, Module, Sequential};
use kiln_tensor::{DType, Device, Distribution, Result, Tensor};

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

fn close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= tol, "got {got:?}, want {want:?}");
    }
}

#[test]
fn training_normalises_each_channel_and_tracks_running_statistics() -> Result<()> {
    // [N=2, C=2, L=2]: channel 0 holds 1, 3, 5, 7 (mean 4, biased var 5, unbiased 20/3);
    // channel 1 holds 2, 2, 2, 6 (mean 3, biased var 3, unbiased 4).
    let x = Tensor::from_vec(vec![1.0f32, 3.0, 2.0, 2.0, 5.0, 7.0, 2.0, 6.0], &[2, 2, 2], Device::Cpu)?;
    let bn = BatchNorm::new(2, Device::Cpu)?;
    kiln_tensor::no_grad(|| {
        bn.weight.assign(&Tensor::from_vec(vec![2.0f32, 1.0], &[2], Device::Cpu)?)?;
        bn.bias.assign(&Tensor::from_vec(vec![0.5f32, -1.0], &[2], Device::Cpu)?)
    })?;
    let y = bn.forward(&x)?;
    let (s0, s1) = (2.0 / (5.0f64 + 1e-5).sqrt(), 1.0 / (3.0f64 + 1e-5).sqrt());
    let want = [-3.0 * s0 + 0.5, -s0 + 0.5, -s1 - 1.0, -s1 - 1.0, s0 + 0.5, 3.0 * s0 + 0.5, -s1 - 1.0, 3.0 * s1 - 1.0];
    close(&f64s(&y), &want, 1e-5);
    close(&f64s(&bn.running_mean), &[0.4, 0.3], 1e-6);
    close(&f64s(&bn.running_var), &[0.9 + 0.1 * 20.0 / 3.0, 0.9 + 0.1 * 4.0], 1e-6);
    assert_eq!(bn.num_batches_tracked.to_vec::<i64>()?, vec![1]);

    // Eval: the running statistics, no update.
    bn.eval();
    let y = bn.forward(&x)?;
    let (m, v) = (f64s(&bn.running_mean), f64s(&bn.running_var));
    let expect = |i: usize, c: usize, w: f64, b: f64| (f64s(&x)[i] - m[c]) / (v[c] + 1e-5).sqrt() * w + b;
    let want: Vec<f64> = (0..8).map(|i| if (i / 2) % 2 == 0 { expect(i, 0, 2.0, 0.5) } else { expect(i, 1, 1.0, -1.0) }).collect();
    close(&f64s(&y), &want, 1e-5);
    assert_eq!(bn.num_batches_tracked.to_vec::<i64>()?, vec![1], "eval does not count");
    Ok(())
}

#[test]
fn the_gradient_matches_finite_differences_and_bad_input_is_an_error() -> Result<()> {
    let bn = BatchNorm::new(3, Device::Cpu)?;
    let x = Tensor::rand_at(&[4, 3, 2, 3], Distribution::Normal, 1, 0, DType::F64, Device::Cpu)?;
    let (w, b) = (Tensor::from_vec(vec![1.5, 0.5, -1.0], &[3], Device::Cpu)?, Tensor::from_vec(vec![0.25, 0.0, 1.0], &[3], Device::Cpu)?);
    let f = |t: &[Tensor]| {
        let stats = (Tensor::zeros(&[3], DType::F64, Device::Cpu)?, Tensor::ones(&[3], DType::F64, Device::Cpu)?);
        let m = BatchNorm { weight: t[1].clone(), bias: t[2].clone(), running_mean: stats.0, running_var: stats.1, ..bn.clone() };
        m.forward(&t[0])?.square()
    };
    gradcheck(f, &[x, w, b], GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() })?;
    let e = bn.forward(&Tensor::zeros(&[1, 3], DType::F32, Device::Cpu)?).unwrap_err().to_string();
    assert!(e.contains("more than one value per channel"), "{e}");
    let e = bn.forward(&Tensor::zeros(&[2, 4], DType::F32, Device::Cpu)?).unwrap_err().to_string();
    assert!(e.contains("[2, 4]"), "{e}");
    Ok(())
}

#[test]
fn state_dicts_hold_the_buffers_under_pytorchs_names() -> Result<()> {
    let model = Sequential::new().add(BatchNorm::new(2, Device::Cpu)?);
    let names: Vec<String> = model.named_state().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "0.running_mean", "0.running_var", "0.num_batches_tracked"]);
    assert_eq!(model.parameters().len(), 2, "buffers are not parameters");
    model.forward(&Tensor::rand(&[4, 2], DType::F32, Device::Cpu)?)?;
    let bytes = state_dict_to_bytes(&model)?;
    let fresh = Sequential::new().add(BatchNorm::new(2, Device::Cpu)?);
    load_state_dict_from_bytes(&fresh, &bytes, true)?;
    for ((n, a), (_, b)) in model.named_buffers().iter().zip(fresh.named_buffers()) {
        assert_eq!(f64s(a), f64s(&b), "{n} restored");
    }
    Ok(())
}

/// GroupNorm against per-(sample, group) statistics computed in a loop, with an affine part;
/// its gradients against finite differences; a bad channel count is an error.
#[test]
fn group_norm_normalises_each_group_of_each_sample() -> Result<()> {
    let x = Tensor::rand_at(&[2, 6, 5], Distribution::Normal, 11, 0, DType::F64, Device::Cpu)?;
    let gn = GroupNorm::new(3, 6, Device::Cpu)?;
    let (w, b): (Vec<f64>, Vec<f64>) = ((0..6).map(|c| 0.5 + c as f64).collect(), (0..6).map(|c| c as f64 - 2.0).collect());
    kiln_tensor::no_grad(|| {
        gn.weight.assign(&Tensor::from_vec(w.clone(), &[6], Device::Cpu)?.to_dtype(gn.weight.dtype())?)?;
        gn.bias.assign(&Tensor::from_vec(b.clone(), &[6], Device::Cpu)?.to_dtype(gn.bias.dtype())?)
    })?;
    let got = f64s(&gn.forward(&x.to_dtype(DType::F32)?)?);
    let xv = f64s(&x);
    let mut want = vec![0.0; xv.len()];
    for n in 0..2 {
        for g in 0..3 {
            // Channels 2g, 2g+1 of sample n: 10 values in a row.
            let start = (n * 6 + 2 * g) * 5;
            let run = &xv[start..start + 10];
            let mean = run.iter().sum::<f64>() / 10.0;
            let var = run.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 10.0;
            for (k, v) in run.iter().enumerate() {
                let c = 2 * g + k / 5;
                want[start + k] = (v - mean) / (var + 1e-5).sqrt() * w[c] + b[c];
            }
        }
    }
    close(&got, &want, 1e-5);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    let wide = GroupNorm { weight: Tensor::from_vec(w, &[6], Device::Cpu)?, bias: Tensor::from_vec(b, &[6], Device::Cpu)?, ..gn.clone() };
    gradcheck(|t| wide.forward(&t[0]), &[x], cfg)?;
    assert!(GroupNorm::new(4, 6, Device::Cpu).unwrap_err().to_string().contains("6 channels"));
    let e = gn.forward(&Tensor::zeros(&[2, 4, 3], DType::F32, Device::Cpu)?).unwrap_err().to_string();
    assert!(e.contains("[2, 4, 3]"), "{e}");
    Ok(())
}
