//! The Llama model: Hugging Face's parameter names and shapes, causality, and training
//! eager and compiled alike.

use kiln::compile::{compile_step, Mode};
use kiln::models::{Llama, LlamaConfig};
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;

const CPU: Device = Device::Cpu;

fn ids(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, CPU).unwrap()
}

#[test]
fn parameters_carry_hugging_faces_names_and_shapes() -> Result<()> {
    kiln::tensor::rng::manual_seed(1);
    let m = Llama::new(LlamaConfig::tiny(50), CPU)?;
    let named = m.named_parameters();
    let shape = |name: &str| named.iter().find(|(k, _)| k == name).map(|(_, t)| t.shape().to_vec());
    assert_eq!(named[0].0, "model.embed_tokens.weight");
    assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), Some(vec![64, 64]));
    // Two key/value heads of 16: k and v project to 32.
    assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), Some(vec![32, 64]));
    assert_eq!(shape("model.layers.1.mlp.gate_proj.weight"), Some(vec![176, 64]));
    assert_eq!(shape("model.layers.1.post_attention_layernorm.weight"), Some(vec![64]));
    assert_eq!((named[named.len() - 2].0.as_str(), named[named.len() - 1].0.as_str()), ("model.norm.weight", "lm_head.weight"));
    // Per layer: q, k, v, o, gate, up, down and two norms.
    assert_eq!(named.len(), 1 + 2 * 9 + 2);
    let err = Llama::new(LlamaConfig { n_kv_heads: 3, ..LlamaConfig::tiny(50) }, CPU).unwrap_err().to_string();
    assert!(err.contains("n_kv_heads 3"), "{err}");
    Ok(())
}

#[test]
fn a_later_token_never_changes_earlier_logits() -> Result<()> {
    kiln::tensor::rng::manual_seed(2);
    let m = Llama::new(LlamaConfig::tiny(20), CPU)?;
    let a = m.forward(&ids(&[1, 5, 7, 3, 9, 2], &[1, 6]))?;
    let b = m.forward(&ids(&[1, 5, 7, 3, 9, 11], &[1, 6]))?;
    assert_eq!(a.shape(), &[1, 6, 20]);
    assert_eq!(a.narrow(1, 0, 5)?.to_vec::<f32>()?, b.narrow(1, 0, 5)?.to_vec::<f32>()?);
    assert_ne!(a.narrow(1, 5, 1)?.to_vec::<f32>()?, b.narrow(1, 5, 1)?.to_vec::<f32>()?);
    Ok(())
}

/// Twenty AdamW steps on one batch (it learns to continue a fixed sequence); the losses.
fn train(compiled: bool) -> Result<Vec<f32>> {
    kiln::tensor::rng::manual_seed(3);
    let m = Llama::new(LlamaConfig::tiny(16), CPU)?;
    let mut opt = AdamW::new(m.parameters(), AdamConfig { lr: 3e-3, ..AdamConfig::adamw() })?;
    let seq: Vec<i64> = (0..17).map(|i| (i * 5 + 3) % 16).collect();
    let (x, y) = (ids(&seq[..16], &[2, 8]), ids(&seq[1..], &[2, 8]));
    let step_fn = |opt: &mut AdamW, xs: &[Tensor]| {
        let loss = m.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    let mut step = compile_step(Mode::Default, step_fn);
    let mut losses = Vec::new();
    for _ in 0..20 {
        let out = if compiled { step.call(&mut opt, &[&x, &y])? } else { step_fn(&mut opt, &[x.clone(), y.clone()])? };
        losses.push(out[0].to_vec::<f32>()?[0]);
    }
    Ok(losses)
}

#[test]
fn it_trains_and_the_compiled_step_matches_eager() -> Result<()> {
    let (eager, compiled) = (train(false)?, train(true)?);
    for (s, (a, b)) in compiled.iter().zip(&eager).enumerate() {
        assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "step {s}: compiled {compiled:?}\neager {eager:?}");
    }
    // ln(16) = 2.77 at the start; the fixed sequence is learned.
    assert!(eager[0] > 2.0 && eager[19] < 0.5 * eager[0], "{eager:?}");
    Ok(())
}
