//! `autograd::checkpoint`: the same gradients as the plain run (dropout included), less memory
//! held between forward and backward, a clear error through `autograd::grad`, a gradcheck, and
//! a compiled step (where `f` just runs) matching eager.
use kiln::autograd::{checkpoint, gradcheck, GradcheckConfig};
use kiln::compile::{compile, Mode};
use kiln::nn::{dropout, Linear};
use kiln::prelude::*;
use kiln::tensor::{rng, storage, Distribution};
use std::sync::Mutex;

/// Live and peak bytes are the process's: the tests here run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A residual MLP block, `x + fc2(dropout(gelu(fc1(x))))`.
#[derive(Clone)]
struct Block {
    fc1: Linear,
    fc2: Linear,
    p: f64,
}

impl Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = dropout(&self.fc1.forward(x)?.gelu()?, self.p, true)?;
        x.add(&self.fc2.forward(&h)?)
    }
}

fn blocks(n: usize, width: usize, p: f64) -> Vec<Block> {
    rng::manual_seed(3);
    (0..n)
        .map(|_| Block {
            fc1: Linear::new(64, width, true, Device::Cpu).unwrap(),
            fc2: Linear::new(width, 64, true, Device::Cpu).unwrap(),
            p,
        })
        .collect()
}

/// Forward and backward of the stack (each block checkpointed or not) from seed 9: the loss,
/// the input's and every parameter's gradient, and the peak of live bytes over both.
fn run(stack: &[Block], x: &Tensor, checkpointed: bool) -> (f64, Vec<Vec<f32>>, u64) {
    for b in stack {
        for p in [&b.fc1.weight, &b.fc2.weight] {
            p.set_grad(None);
        }
        for p in [&b.fc1.bias, &b.fc2.bias].into_iter().flatten() {
            p.set_grad(None);
        }
    }
    let x = x.detach();
    x.set_requires_grad(true);
    rng::manual_seed(9);
    storage::reset_peak_bytes();
    let base = storage::live_bytes();
    let mut h = x.clone();
    for b in stack {
        h = if checkpointed {
            let b = b.clone();
            checkpoint(move |v| b.forward(&v[0]), &[&h]).unwrap()
        } else {
            b.forward(&h).unwrap()
        };
    }
    let loss = h.square().unwrap().mean_all().unwrap();
    loss.backward().unwrap();
    let peak = storage::peak_bytes() - base;
    let mut grads = vec![x.grad().unwrap().to_vec::<f32>().unwrap()];
    for b in stack {
        for p in [&b.fc1.weight, &b.fc1.bias.clone().unwrap(), &b.fc2.weight, &b.fc2.bias.clone().unwrap()] {
            grads.push(p.grad().unwrap().to_vec::<f32>().unwrap());
        }
    }
    (loss.item().unwrap(), grads, peak)
}

#[test]
fn checkpointed_blocks_match_the_plain_run_and_hold_less_memory() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for p in [0.0, 0.3] {
        let stack = blocks(6, 512, p);
        let x = Tensor::rand_at(&[128, 64], Distribution::Normal, 5, 0, DType::F32, Device::Cpu).unwrap();
        let (loss, grads, peak) = run(&stack, &x, false);
        let after_plain = rng::state();
        let (c_loss, c_grads, c_peak) = run(&stack, &x, true);
        // The recomputation restores the generator: the same masks, and the same state after.
        assert_eq!(rng::state(), after_plain, "p {p}: the generator moved differently");
        assert_eq!(loss, c_loss, "p {p}: loss");
        for (i, (a, b)) in grads.iter().zip(&c_grads).enumerate() {
            let worst = a.iter().zip(b).map(|(u, v)| (u - v).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-6, "p {p}: gradient {i} differs by {worst}");
        }
        // Each plain block keeps its [128, 512] pre-activation, GELU output and (with dropout)
        // mask and dropped values; checkpointed, only the blocks' [128, 64] outputs stay.
        let activations = 6 * 128 * 512 * 4 * if p > 0.0 { 4 } else { 2 };
        assert!(c_peak + (activations as u64) / 2 < peak, "p {p}: checkpointed peak {c_peak} B against plain {peak} B");
    }
}

#[test]
fn gradients_through_a_checkpoint_pass_gradcheck() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let w = Tensor::rand_at(&[4, 3], Distribution::Normal, 1, 0, DType::F64, Device::Cpu).unwrap();
    let f = move |v: &[Tensor]| {
        let w = w.clone();
        checkpoint(move |u| u[0].matmul(&w)?.tanh()?.mul(&u[1]), &[&v[0], &v[1]])?.sum_all()
    };
    let a = Tensor::rand_at(&[2, 4], Distribution::Normal, 2, 0, DType::F64, Device::Cpu).unwrap();
    let b = Tensor::rand_at(&[2, 3], Distribution::Normal, 3, 0, DType::F64, Device::Cpu).unwrap();
    let err = gradcheck(f, &[a, b], GradcheckConfig::default()).unwrap();
    assert!(err < 1e-6, "gradcheck error {err}");
}

#[test]
fn autograd_grad_through_a_checkpoint_gives_its_inputs_and_refuses_what_is_inside() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::rand_at(&[3], Distribution::Normal, 1, 0, DType::F32, Device::Cpu).unwrap();
    let w = Tensor::rand_at(&[3], Distribution::Normal, 2, 0, DType::F32, Device::Cpu).unwrap();
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    let inner = w.clone();
    let y = checkpoint(move |v| v[0].square()?.mul(&inner), &[&x]).unwrap().sum_all().unwrap();
    let (xv, wv) = (x.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
    // d/dx sum(x^2 w) = 2 x w, and nothing accumulated into w's .grad().
    let g = kiln::autograd::grad(&y, &[&x]).unwrap()[0].clone().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(g, xv.iter().zip(&wv).map(|(a, b)| 2.0 * a * b).collect::<Vec<_>>());
    assert!(w.grad().is_none(), "grad() accumulated into a parameter");
    // w is used inside the checkpoint: grad() cannot return it, and says so.
    let err = kiln::autograd::grad(&y, &[&w]).unwrap_err().to_string();
    assert!(err.contains("checkpoint") && err.contains("backward()") && err.contains("[3]"), "{err}");
    // backward() gives both: x^2 for w.
    y.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), xv.iter().map(|a| a * a).collect::<Vec<_>>());
}

#[test]
fn a_checkpointed_function_that_writes_to_its_input_is_an_error() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::rand_at(&[4], Distribution::Normal, 1, 0, DType::F32, Device::Cpu).unwrap();
    let h = x.mul_scalar(1.0).unwrap();
    x.set_requires_grad(true);
    let err = checkpoint(
        |v| {
            v[1].assign(&v[1].mul_scalar(2.0)?)?;
            v[0].mul(&v[1])
        },
        &[&x, &h],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("in place") && err.contains("input 1"), "{err}");
}

#[test]
fn a_compiled_step_with_checkpoints_matches_eager() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (stack, plain) = (blocks(3, 128, 0.0), blocks(3, 128, 0.0));
    let x = Tensor::rand_at(&[32, 64], Distribution::Normal, 5, 0, DType::F32, Device::Cpu).unwrap();
    // SGD by hand on the first layer's weight, so that each step depends on the last.
    let w = stack[0].fc1.weight.clone();
    let step = move |v: &[Tensor]| -> Result<Vec<Tensor>> {
        let mut h = v[0].clone();
        for b in &stack {
            let b = b.clone();
            h = checkpoint(move |u| b.forward(&u[0]), &[&h])?;
        }
        let loss = h.square()?.mean_all()?;
        loss.backward()?;
        no_grad(|| w.assign(&w.sub(&w.grad().unwrap().mul_scalar(0.1)?)?))?;
        w.set_grad(None);
        Ok(vec![loss])
    };
    // The eager reference: blocks of the same values (their own tensors), no checkpoints.
    let mut compiled = compile(Mode::Default, step);
    let w2 = plain[0].fc1.weight.clone();
    for i in 0..3 {
        let c = compiled.call(&[&x]).unwrap()[0].item().unwrap();
        let mut h = x.clone();
        for b in &plain {
            h = b.forward(&h).unwrap();
        }
        let loss = h.square().unwrap().mean_all().unwrap();
        loss.backward().unwrap();
        no_grad(|| w2.assign(&w2.sub(&w2.grad().unwrap().mul_scalar(0.1)?)?)).unwrap();
        w2.set_grad(None);
        let e = loss.item().unwrap();
        assert!((c - e).abs() <= 1e-5 * e.abs(), "step {i}: compiled {c} against eager {e}");
    }
}

#[test]
fn a_gpt_with_checkpointing_trains_the_same_with_less_memory() {
    use kiln::models::{Gpt, GptConfig};
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    rng::manual_seed(4);
    let cfg = GptConfig { dropout: 0.2, ..GptConfig::new(11, 32, 32, 3, 2) };
    let model = Gpt::new(cfg, Device::Cpu).unwrap();
    let tok = |s: u64| {
        let t = Tensor::rand_at(&[16, 32], Distribution::Uniform, s, 0, DType::F32, Device::Cpu).unwrap();
        t.mul_scalar(11.0).unwrap().to_dtype(DType::I64).unwrap()
    };
    let (x, y) = (tok(1), tok(2));
    let mut runs = Vec::new();
    for on in [false, true] {
        model.checkpointing.set(on);
        model.parameters().iter().for_each(|p| p.set_grad(None));
        rng::manual_seed(7);
        storage::reset_peak_bytes();
        let base = storage::live_bytes();
        let loss = model.loss(&x, &y).unwrap();
        loss.backward().unwrap();
        let peak = storage::peak_bytes() - base;
        let grads: Vec<Vec<f32>> = model.parameters().iter().map(|p| p.grad().unwrap().to_vec::<f32>().unwrap()).collect();
        runs.push((loss.item().unwrap(), grads, peak));
    }
    let ((loss, grads, peak), (c_loss, c_grads, c_peak)) = (&runs[0], &runs[1]);
    assert_eq!(loss, c_loss);
    for (i, (a, b)) in grads.iter().zip(c_grads).enumerate() {
        let worst = a.iter().zip(b).map(|(u, v)| (u - v).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-6, "parameter {i}: gradients differ by {worst}");
    }
    assert!(c_peak * 3 < peak * 2, "checkpointed peak {c_peak} B against {peak} B");
}
