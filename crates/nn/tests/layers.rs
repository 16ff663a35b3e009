//! Layers without a PyTorch fixture, checked against their formulas and finite differences.

use kiln_autograd::Backward;
use kiln_autograd::{gradcheck, GradcheckConfig};
use kiln_nn::{dropout, Dropout, Embedding, Forward, Module, RmsNorm, Transformer, TransformerConfig, TransformerMasks};
use kiln_tensor::Fused;
use kiln_tensor::{DType, Device, Distribution, Result, Tensor};

#[test]
fn rms_norm_matches_its_formula_and_gradients() -> Result<()> {
    let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0, -4.0, 0.5, 0.0], &[2, 3], Device::Cpu)?;
    let m = RmsNorm::new(3, Some(1e-6), Device::Cpu)?;
    let y = m.forward(&x.to_dtype(DType::F32)?)?.to_vec::<f32>()?;
    // Row 0: rms = sqrt((1 + 4 + 9) / 3).
    let r = ((14.0f64 / 3.0) + 1e-6).sqrt();
    assert!((y[1] as f64 - 2.0 / r).abs() < 1e-6, "{y:?}");
    let w = Tensor::from_slice(&[0.5f64, 1.5, -1.0], &[3], Device::Cpu)?;
    let err = gradcheck(
        |v| v[0].mul(&v[0].square()?.mean(&[-1], true)?.add_scalar(1e-6)?.rsqrt()?)?.mul(&v[1]),
        &[x, w],
        GradcheckConfig::default(),
    )?;
    assert!(err < 1e-7);
    Ok(())
}

#[test]
fn dropout_zeroes_about_p_and_rescales_in_training_only() -> Result<()> {
    kiln_tensor::rng::manual_seed(5);
    let x = Tensor::ones(&[100_000], DType::F32, Device::Cpu)?;
    let y = dropout(&x, 0.3, true)?.to_vec::<f32>()?;
    let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / y.len() as f64;
    assert!((kept - 0.7).abs() < 0.01, "kept {kept}");
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
    let d = Dropout::new(0.3);
    d.eval();
    assert_eq!(d.forward(&x)?.to_vec::<f32>()?, x.to_vec::<f32>()?);
    // Two draws differ; reseeding reproduces the first.
    kiln_tensor::rng::manual_seed(5);
    assert_eq!(dropout(&x, 0.3, true)?.to_vec::<f32>()?, y);
    assert!(dropout(&x, 1.5, true).is_err());
    Ok(())
}

#[test]
fn transformer_names_shapes_and_masks() -> Result<()> {
    let c = TransformerConfig {
        d_model: 8,
        nhead: 2,
        num_encoder_layers: 2,
        num_decoder_layers: 1,
        dim_feedforward: 16,
        dropout: 0.0,
        ..Default::default()
    };
    let t = Transformer::new(c, Device::Cpu)?;
    let names: Vec<String> = t.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"encoder.layers.1.self_attn.in_proj_weight".to_string()));
    assert!(names.contains(&"decoder.layers.0.multihead_attn.out_proj.bias".to_string()));
    assert!(names.contains(&"decoder.norm.weight".to_string()));
    // (S, N, E) and (T, N, E) as with batch_first = false.
    let src = Tensor::rand_at(&[5, 3, 8], Distribution::Normal, 1, 0, DType::F32, Device::Cpu)?;
    let tgt = Tensor::rand_at(&[4, 3, 8], Distribution::Normal, 2, 0, DType::F32, Device::Cpu)?;
    let mut masks = TransformerMasks::default();
    masks.tgt.is_causal = true;
    let out = t.forward(&src, &tgt, &masks)?;
    assert_eq!(out.shape(), &[4, 3, 8]);
    // Causal: the first target position does not depend on later ones.
    let tgt2 = tgt.narrow(0, 0, 1)?.contiguous()?;
    let tail = Tensor::rand_at(&[3, 3, 8], Distribution::Normal, 9, 0, DType::F32, Device::Cpu)?;
    let out2 = t.forward(&src, &Tensor::cat(&[&tgt2, &tail], 0)?, &masks)?;
    let (a, b) = (out.narrow(0, 0, 1)?.to_vec::<f32>()?, out2.narrow(0, 0, 1)?.to_vec::<f32>()?);
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5));
    Ok(())
}

/// Compile's fused classifier head (`Fused::LinearCrossEntropyMean`, which a GPU step runs as one
/// block) on the CPU against autograd through the ops it stands for: the loss, the weight and
/// bias gradients and the gradient of the head's input (through a ReLU with `drelu`).
#[test]
fn the_fused_classifier_head_matches_autograd() -> Result<()> {
    use kiln_autograd::Backward;
    use kiln_nn::{cross_entropy_with, CrossEntropyConfig};
    let (n, c, f) = (6, 4, 5);
    let close = |what: &str, got: &[f64], want: &Tensor| {
        let want = want.to_vec::<f64>().unwrap();
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-12, "{what}[{i}]: fused {a} vs autograd {b}");
        }
    };
    for (drelu, smoothing) in [(true, 0.0), (false, 0.1)] {
        let rand = |shape: &[usize], seed| Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F64, Device::Cpu);
        let (pre, w, b) = (rand(&[n, f], 1)?, rand(&[c, f], 2)?, rand(&[c], 3)?);
        let targets = Tensor::from_vec(vec![0i64, 3, -100, 1, 2, 3], &[n], Device::Cpu)?;
        for x in [&pre, &w, &b] {
            x.set_requires_grad(true);
        }
        let h = if drelu { pre.relu()? } else { pre.clone() };
        let cfg = CrossEntropyConfig { label_smoothing: smoothing, ..CrossEntropyConfig::default() };
        let loss = cross_entropy_with(&h.linear(&w, Some(&b))?, &targets, cfg)?;
        loss.backward()?;
        let op = kiln_tensor::Op::Fused(Fused::LinearCrossEntropyMean { ignore_index: Some(-100), smoothing, drelu });
        let out = Tensor::apply(op, &[&h.detach(), &w.detach(), &b.detach(), &targets], Device::Cpu)?.to_vec::<f64>()?;
        use kiln_tensor::op::{Part, Parts};
        let parts = Parts::linear_cross_entropy_mean(n, c, f);
        let [dw, db, dh] = [Part::Dw, Part::Db, Part::Dx].map(|p| parts.offset(p).unwrap());
        assert_eq!(out.len(), parts.len());
        close("loss", &out[..1], &loss.reshape(&[1])?);
        close("weight grad", &out[dw..dw + c * f], &w.grad().expect("w.grad"));
        close("bias grad", &out[db..db + c], &b.grad().expect("b.grad"));
        close("input grad", &out[dh..], &pre.grad().expect("pre.grad"));
    }
    Ok(())
}

/// `padding_idx`: the row starts at zero, lookups of it give that row, and its gradient stays
/// zero while the other rows' gradients count their lookups.
#[test]
fn embedding_padding_row_gets_no_gradient() -> Result<()> {
    let e = Embedding::with_padding_idx(4, 3, 2, Device::Cpu)?;
    assert_eq!(e.weight.narrow(0usize, 2, 1)?.to_vec::<f32>()?, vec![0.0; 3]);
    let ids = Tensor::from_vec(vec![2i64, 0, 2, 1, 0], &[5], Device::Cpu)?;
    let out = e.forward(&ids)?;
    assert_eq!(out.narrow(0usize, 0, 1)?.to_vec::<f32>()?, vec![0.0; 3]);
    out.sum_all()?.backward()?;
    let g = e.weight.grad().unwrap().to_vec::<f32>()?;
    assert_eq!(g, vec![2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert!(Embedding::with_padding_idx(4, 3, 4, Device::Cpu).unwrap_err().to_string().contains("padding_idx 4"));
    Ok(())
}
