//! Where an eager training step (the MLP, or the example CNN) spends its time: per phase, and
//! per op through a timing tracer (the time between consecutive ops is charged to the later one).
//! `cargo run --release --example profile_step -- [BATCH] [mlp|cnn]`
use kiln::models::mlp;
use kiln::nn::cross_entropy;
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;
use kiln_tensor::{Distribution, Op, Tracer};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

struct Timer {
    last: RefCell<Instant>,
    per_op: RefCell<HashMap<String, (f64, usize)>>,
}

impl Tracer for Timer {
    fn record(&self, op: &Op, inputs: &[&Tensor], _output: &Tensor) {
        let now = Instant::now();
        let dt = (now - *self.last.borrow()).as_secs_f64();
        *self.last.borrow_mut() = now;
        let shapes: Vec<String> = inputs.iter().map(|t| format!("{:?}", t.shape())).collect();
        let key = format!("{:?} {}", op, shapes.join(" "));
        let key: String = key.chars().take(90).collect();
        let mut m = self.per_op.borrow_mut();
        let e = m.entry(key).or_insert((0.0, 0));
        e.0 += dt;
        e.1 += 1;
    }
    fn host_read(&self, _what: &'static str, _t: &Tensor) -> Result<()> {
        Ok(())
    }
}

fn main() -> Result<()> {
    let batch: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(32);
    let model = match std::env::args().nth(2).as_deref() {
        None | Some("mlp") => mlp(&[784, 256, 10], Device::Cpu)?,
        Some("cnn") => kiln::models::cnn(28, 28, 10, Device::Cpu)?,
        Some(other) => return Err(Error::Msg(format!("model {other}: expected mlp or cnn"))),
    };
    let mut opt = AdamW::new(model.parameters(), AdamConfig::adamw())?;
    let x = Tensor::rand_at(&[batch, 784], Distribution::Uniform, 1, 0, DType::F32, Device::Cpu)?;
    let y = Tensor::rand_at(&[batch], Distribution::Uniform, 2, 0, DType::F32, Device::Cpu)?.mul_scalar(10.0)?.to_dtype(DType::I64)?;
    let mut step = || -> Result<[Instant; 4]> {
        let t0 = Instant::now();
        let loss = cross_entropy(&model.forward(&x)?, &y)?;
        let t1 = Instant::now();
        loss.backward()?;
        let t2 = Instant::now();
        opt.step()?;
        opt.zero_grad()?;
        Ok([t0, t1, t2, Instant::now()])
    };
    let n = if std::env::args().nth(2).as_deref() == Some("cnn") { 50 } else { 1000 };
    let mut phase = [0.0; 3];
    for i in 0..n + 100 {
        let t = step()?;
        if i >= 100 {
            for k in 0..3 {
                phase[k] += (t[k + 1] - t[k]).as_secs_f64();
            }
        }
    }
    let ms = |t: f64| 1e3 * t / n as f64;
    println!(
        "forward {:.3} ms, backward {:.3} ms, optimizer {:.3} ms, total {:.3} ms",
        ms(phase[0]),
        ms(phase[1]),
        ms(phase[2]),
        ms(phase.iter().sum())
    );
    let timer = Rc::new(Timer { last: RefCell::new(Instant::now()), per_op: RefCell::new(HashMap::new()) });
    kiln_tensor::set_tracer(Some(timer.clone()));
    for _ in 0..n {
        step()?;
    }
    kiln_tensor::set_tracer(None);
    let mut rows: Vec<(String, (f64, usize))> = timer.per_op.borrow().iter().map(|(k, v)| (k.clone(), *v)).collect();
    rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    for (k, (t, c)) in rows.iter().take(25) {
        println!("{:8.1} us  x{:<3} {k}", 1e6 * t / n as f64, c / n);
    }
    Ok(())
}
