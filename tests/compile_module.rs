//! `compile_module` (`torch.compile(model)`): the compiled module's outputs equal the eager
//! model's, its backward (a compiled graph of its own) gives the eager tape's gradients for
//! the parameters and the input, an eager optimizer then steps as after eager training, a
//! parameter the output does not use gets no gradient, and under `no_grad` the output has no
//! history.

use kiln::compile::Mode;
use kiln::models::mlp;
use kiln::nn::{Linear, Module};
use kiln::optim::{AdamConfig, AdamW, Optimizer};
use kiln::prelude::*;
use kiln::tensor::Distribution;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F32, Device::Cpu).unwrap()
}

fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + x.abs()), "{what}: element {i}: {x} vs {y}");
    }
}

/// The MLP's gradients for `loss(out) = sum(out * w)`, eagerly or through `compiled`.
fn grads(model: &kiln::nn::Sequential, out: &Tensor, w: &Tensor) -> Vec<Tensor> {
    out.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = model.parameters().iter().map(|p| p.grad().expect("every parameter has a gradient")).collect();
    model.parameters().iter().for_each(|p| p.set_grad(None));
    g
}

#[test]
fn a_compiled_module_trains_as_the_eager_model() -> Result<()> {
    kiln::tensor::rng::manual_seed(5);
    let model = mlp(&[12, 16, 5], Device::Cpu)?;
    let compiled = kiln::compile_module(Mode::Default, &model);
    for (batch, seed) in [(8, 1), (3, 2), (8, 3)] {
        let x = randn(&[batch, 12], seed);
        let w = randn(&[batch, 5], seed + 10);
        let eager_out = model.forward(&x)?;
        let eager = grads(&model, &eager_out, &w);
        let out = compiled.forward(&x)?;
        close("outputs", &eager_out, &out, 1e-6);
        assert!(out.requires_grad(), "the compiled module's output is differentiable");
        for (i, (e, c)) in eager.iter().zip(grads(&model, &out, &w)).enumerate() {
            close(&format!("gradient of parameter {i} at batch {batch}"), e, &c, 1e-5);
        }
        // The input's gradient, when it asks for one.
        x.set_requires_grad(true);
        model.forward(&x)?.mul(&w)?.sum_all()?.backward()?;
        let dx = x.grad().unwrap();
        x.set_grad(None);
        compiled.forward(&x)?.mul(&w)?.sum_all()?.backward()?;
        close("the input's gradient", &dx, &x.grad().unwrap(), 1e-5);
        model.parameters().iter().for_each(|p| p.set_grad(None));
    }
    // Two forwards, two graphs (batch 8 and 3), each backward graph twice as many (with and
    // without the input's gradient) kept apart.
    assert_eq!(compiled.explain().graphs, 2);
    // An eager optimizer after the compiled backward steps as after the eager one.
    kiln::tensor::rng::manual_seed(6);
    let (a, b) = (mlp(&[12, 16, 5], Device::Cpu)?, mlp(&[12, 16, 5], Device::Cpu)?);
    b.parameters().iter().zip(a.parameters()).for_each(|(p, q)| no_grad(|| p.assign(&q)).unwrap());
    let ca = kiln::compile_module(Mode::Default, &a);
    let (mut oa, mut ob) = (AdamW::new(a.parameters(), AdamConfig::adamw())?, AdamW::new(b.parameters(), AdamConfig::adamw())?);
    for step in 0..5 {
        let x = randn(&[6, 12], 30 + step);
        ca.forward(&x)?.square()?.mean_all()?.backward()?;
        oa.step()?;
        oa.zero_grad()?;
        b.forward(&x)?.square()?.mean_all()?.backward()?;
        ob.step()?;
        ob.zero_grad()?;
    }
    for (i, (p, q)) in a.parameters().iter().zip(b.parameters()).enumerate() {
        close(&format!("parameter {i} after 5 AdamW steps"), p, &q, 1e-5);
    }
    Ok(())
}

/// A module whose output ignores one of its parameters: that one gets no gradient, as in
/// eager autograd; under `no_grad` the output has no history.
#[derive(Clone, kiln::nn::Module)]
struct HalfUsed {
    used: Linear,
    unused: Linear,
}

impl Forward for HalfUsed {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.used.forward(x)
    }
}

#[test]
fn unused_parameters_get_no_gradient_and_no_grad_outputs_no_history() -> Result<()> {
    kiln::tensor::rng::manual_seed(7);
    let model = HalfUsed { used: Linear::new(4, 3, true, Device::Cpu)?, unused: Linear::new(4, 3, true, Device::Cpu)? };
    let compiled = kiln::compile_module(Mode::Default, &model);
    let x = randn(&[2, 4], 8);
    compiled.forward(&x)?.sum_all()?.backward()?;
    // d sum(x W^T + b) / dW = column sums of x, per output row.
    let xs = x.sum(&[0usize][..], false)?.to_vec::<f32>()?;
    let gw = model.used.weight.grad().unwrap().to_vec::<f32>()?;
    for (i, g) in gw.iter().enumerate() {
        assert!((g - xs[i % 4]).abs() < 1e-5, "weight gradient {i}: {g} vs {}", xs[i % 4]);
    }
    assert_eq!(model.used.bias.as_ref().unwrap().grad().unwrap().to_vec::<f32>()?, vec![2.0; 3]);
    assert!(model.unused.weight.grad().is_none() && model.unused.bias.as_ref().unwrap().grad().is_none());
    let out = no_grad(|| compiled.forward(&x))?;
    assert!(!out.requires_grad());
    Ok(())
}
