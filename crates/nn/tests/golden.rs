//! Kiln layers against PyTorch: fixtures written by scripts/make_golden.py (f64, dropout 0,
//! train mode), embedded so the test binary runs anywhere. Each checks the output and the
//! gradient of `sum(out * dout)` for the inputs and every parameter.

use kiln_autograd::Backward;
use kiln_nn::{
    cross_entropy_with, load_state_dict_from_bytes, Activation, AttnMasks, CrossEntropyConfig, Forward, LayerNorm, Linear, Module,
    MultiheadAttention, TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer,
};
use kiln_tensor::{set_default_dtype, DType, Device, Result, Tensor};
use std::collections::HashMap;

fn fixture(bytes: &[u8]) -> HashMap<String, Tensor> {
    set_default_dtype(DType::F64);
    kiln_tensor::io::load_tensors(bytes).unwrap().0.into_iter().collect()
}

fn assert_close(name: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let worst = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(worst <= tol, "{name}: max abs error {worst:e} > {tol:e}");
}

/// Checks the output, then backprops `dout` and checks every `grad.<name>` in the fixture.
fn check_grads(f: &HashMap<String, Tensor>, out: &Tensor, inputs: &[(&str, &Tensor)], m: &dyn Module) {
    assert_close("out", out, &f["out"], 1e-10);
    out.mul(&f["dout"]).unwrap().sum_all().unwrap().backward().unwrap();
    for (name, t) in inputs {
        assert_close(&format!("grad.{name}"), &t.grad().expect("input grad"), &f[&format!("grad.{name}")], 1e-10);
    }
    for (name, p) in m.named_parameters() {
        assert_close(&format!("grad.{name}"), &p.grad().expect("param grad"), &f[&format!("grad.{name}")], 1e-10);
    }
}

fn leaf(t: &Tensor) -> Tensor {
    let c = t.copy().unwrap();
    c.set_requires_grad(true);
    c
}

#[test]
fn linear() -> Result<()> {
    let f = fixture(include_bytes!("golden/linear.safetensors"));
    let m = Linear::new(5, 3, true, Device::Cpu)?;
    load_state_dict_from_bytes(&m, include_bytes!("golden/linear.safetensors"), false)?;
    let x = leaf(&f["x"]);
    check_grads(&f, &m.forward(&x)?, &[("x", &x)], &m);
    Ok(())
}

#[test]
fn layer_norm() -> Result<()> {
    let f = fixture(include_bytes!("golden/layer_norm.safetensors"));
    let m = LayerNorm::new(6, 1e-5, Device::Cpu)?;
    load_state_dict_from_bytes(&m, include_bytes!("golden/layer_norm.safetensors"), false)?;
    let x = leaf(&f["x"]);
    check_grads(&f, &m.forward(&x)?, &[("x", &x)], &m);
    Ok(())
}

#[test]
fn multihead_attention_with_causal_and_padding_masks() -> Result<()> {
    let f = fixture(include_bytes!("golden/mha.safetensors"));
    let m = MultiheadAttention::new(8, 2, 0.0, true, Device::Cpu)?;
    load_state_dict_from_bytes(&m, include_bytes!("golden/mha.safetensors"), false)?;
    let x = leaf(&f["x"]);
    let masks = AttnMasks { attn_mask: Some(&f["attn_mask"]), key_padding_mask: Some(&f["key_padding_mask"]), is_causal: false };
    check_grads(&f, &m.forward(&x, &x, &x, &masks)?, &[("x", &x)], &m);
    Ok(())
}

fn layer_config(norm_first: bool, activation: Activation) -> TransformerConfig {
    TransformerConfig {
        d_model: 8,
        nhead: 2,
        dim_feedforward: 16,
        dropout: 0.0,
        batch_first: true,
        norm_first,
        activation,
        ..Default::default()
    }
}

#[test]
fn transformer_encoder_layer_post_norm_relu() -> Result<()> {
    let f = fixture(include_bytes!("golden/encoder_layer.safetensors"));
    let m = TransformerEncoderLayer::new(layer_config(false, Activation::Relu), Device::Cpu)?;
    load_state_dict_from_bytes(&m, include_bytes!("golden/encoder_layer.safetensors"), false)?;
    let x = leaf(&f["x"]);
    check_grads(&f, &m.forward(&x, &AttnMasks::default())?, &[("x", &x)], &m);
    Ok(())
}

#[test]
fn transformer_decoder_layer_pre_norm_gelu() -> Result<()> {
    let f = fixture(include_bytes!("golden/decoder_layer.safetensors"));
    let m = TransformerDecoderLayer::new(layer_config(true, Activation::Gelu), Device::Cpu)?;
    load_state_dict_from_bytes(&m, include_bytes!("golden/decoder_layer.safetensors"), false)?;
    let (tgt, memory) = (leaf(&f["tgt"]), leaf(&f["memory"]));
    let tgt_masks = AttnMasks { attn_mask: Some(&f["tgt_mask"]), ..Default::default() };
    let out = m.forward(&tgt, &memory, &tgt_masks, &AttnMasks::default())?;
    check_grads(&f, &out, &[("tgt", &tgt), ("memory", &memory)], &m);
    Ok(())
}

#[test]
fn cross_entropy_with_label_smoothing_and_ignore_index() -> Result<()> {
    let f = fixture(include_bytes!("golden/cross_entropy.safetensors"));
    for (smoothing, loss_key, grad_key) in [(0.1, "loss", "grad.logits"), (0.0, "loss_plain", "grad_plain.logits")] {
        let logits = leaf(&f["logits"]);
        let cfg = CrossEntropyConfig { label_smoothing: smoothing, ..Default::default() };
        let loss = cross_entropy_with(&logits, &f["targets"], cfg)?;
        assert_close(loss_key, &loss, &f[loss_key], 1e-12);
        loss.backward()?;
        assert_close(grad_key, &logits.grad().unwrap(), &f[grad_key], 1e-12);
    }
    Ok(())
}
