//! A 2-layer GPT trained 5 AdamW steps (warmup-cosine schedule, gradient clipping at 0.5)
//! against PyTorch: initial loss and gradients, every step's loss and the final parameters.
//! Fixture: scripts/make_golden.py (f64).

use kiln::models::{Gpt, GptConfig};
use kiln::nn::{load_state_dict_from_bytes, Module};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use std::collections::HashMap;

const FIXTURE: &[u8] = include_bytes!("../crates/nn/tests/golden/gpt_train.safetensors");

fn max_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.to_vec_f64().unwrap().iter().zip(b.to_vec_f64().unwrap()).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// The tensors under `prefix.` renamed to their parameter names.
fn with_prefix(f: &HashMap<String, Tensor>, prefix: &str) -> Vec<(String, Tensor)> {
    f.iter().filter_map(|(k, v)| k.strip_prefix(prefix).map(|n| (n.to_string(), v.clone()))).collect()
}

#[test]
fn gpt_five_adamw_steps_match_pytorch() -> Result<()> {
    kiln::tensor::set_default_dtype(DType::F64);
    let f: HashMap<String, Tensor> = kiln::tensor::io::load_tensors(FIXTURE)?.0.into_iter().collect();
    let config = GptConfig::new(11, 8, 16, 2, 2);
    let model = Gpt::new(config, Device::Cpu)?;
    let init = kiln::tensor::io::save_tensors(&with_prefix(&f, "init."), None)?;
    load_state_dict_from_bytes(&model, &init, true)?;

    // Initial loss and gradients.
    let loss0 = model.loss(&f["tokens"], &f["targets"])?;
    assert!((loss0.item()? - f["loss0"].item()?).abs() < 1e-12);
    loss0.backward()?;
    for (name, p) in model.named_parameters() {
        let e = max_err(&p.grad().unwrap(), &f[&format!("grad0.{name}")]);
        assert!(e < 1e-10, "grad0.{name}: {e:e}");
    }

    // Five steps: lr from the schedule, loss, backward, clip, AdamW.
    let mut opt =
        AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false })?;
    let mut sched = WarmupCosine::new(1e-2, 2, 5, 0.0)?;
    sched.apply(&mut opt)?; // lr for step 0, as PyTorch's scheduler constructor does
    opt.zero_grad()?;
    let want = f["losses"].to_vec::<f64>()?;
    for (t, want_loss) in want.iter().enumerate() {
        let loss = model.loss(&f["tokens"], &f["targets"])?;
        assert!((loss.item()? - want_loss).abs() < 1e-8, "step {t}: loss {} vs {want_loss}", loss.item()?);
        loss.backward()?;
        clip_grad_norm(opt.params(), 0.5)?;
        opt.step()?;
        opt.zero_grad()?;
        sched.step(&mut opt)?;
    }
    for (name, p) in model.named_parameters() {
        let e = max_err(&p, &f[&format!("final.{name}")]);
        assert!(e < 1e-8, "final.{name}: {e:e}");
    }
    Ok(())
}
