//! Training loops the compile tests share (CPU and CUDA): an MLP step closure, 200 GPT
//! steps with dropout, AdamW, warmup-cosine outside the step and gradient clipping, and a
//! small CNN.
#![allow(dead_code)]

use kiln::compile::{compile, Mode};
use kiln::models::{Gpt, GptConfig};
use kiln::nn::{cross_entropy, Sequential};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use kiln::tensor::Distribution;
use std::cell::RefCell;

/// One MLP step (forward, backward, clipping, AdamW, zero_grad) over a shared optimizer.
pub fn mlp_step<'a>(model: &'a Sequential, opt: &'a RefCell<AdamW>) -> impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'a {
    move |xs: &[Tensor]| {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        let mut opt = opt.borrow_mut();
        clip_grad_norm(opt.params(), 1.0)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    }
}

/// One MLP step without clipping (forward, backward, the optimizer's step, zero_grad): a
/// `Copy` closure, so that one step function runs both compiled and eagerly.
pub fn mlp_step_unclipped<'a, O: Optimizer, M: Forward>(
    model: &'a M,
    opt: &'a RefCell<O>,
) -> impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Copy + 'a {
    move |xs: &[Tensor]| {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        opt.borrow_mut().step()?;
        opt.borrow_mut().zero_grad()?;
        Ok(vec![loss])
    }
}

/// Losses (read only after the last step, so a replay that overwrote a returned tensor
/// shows) and final parameters.
pub struct Run {
    pub losses: Vec<f32>,
    pub params: Vec<Vec<f32>>,
}

pub fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let rel: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).collect();
    let (at, worst) = rel.iter().copied().enumerate().fold((0, 0.0f32), |m, (i, r)| if r > m.1 { (i, r) } else { m });
    assert!(worst < tol, "{what}: max relative difference {worst} at {at} ({} vs {}; tolerance {tol})", a[at], b[at]);
}

pub fn assert_runs_agree(what: &str, a: &Run, b: &Run, (lt, pt): (f32, f32)) {
    assert_close(&format!("{what}: losses"), &a.losses, &b.losses, lt);
    for (i, (x, y)) in a.params.iter().zip(&b.params).enumerate() {
        assert_close(&format!("{what}: param {i}"), x, y, pt);
    }
}

/// `r` without the key third of each qkv bias (the parameters of `3 * d_model` values): its
/// gradient is zero in exact arithmetic (softmax ignores a shift shared by all keys), so its
/// Adam steps follow rounding noise, which BF16 roundings change from run to run.
pub fn drop_key_bias(r: &Run, d_model: usize) -> Run {
    let params = r.params.iter().map(|p| if p.len() == 3 * d_model { [&p[..d_model], &p[2 * d_model..]].concat() } else { p.clone() });
    Run { losses: r.losses.clone(), params: params.collect() }
}

/// One GPT step (forward, backward, clipping at 0.5, AdamW, zero_grad), under autocast to
/// `low` if given: a `Copy` closure, so that one step function runs both compiled and eagerly.
pub fn gpt_step<'a>(model: &'a Gpt, opt: &'a RefCell<AdamW>, low: Option<DType>) -> impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Copy + 'a {
    move |xs: &[Tensor]| {
        let _ac = low.map(kiln::tensor::Autocast::new).transpose()?;
        let loss = model.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        let mut o = opt.borrow_mut();
        clip_grad_norm(o.params(), 0.5)?;
        o.step()?;
        o.zero_grad()?;
        Ok(vec![loss])
    }
}

/// `steps` steps of a small GPT with dropout 0.1 on `dev`: eager (`mode` None) or compiled.
pub fn train_gpt(dev: Device, mode: Option<Mode>, steps: u64) -> Run {
    train_gpt_with(dev, mode, steps, 0.1)
}

/// `train_gpt` with another dropout (0: a GPU takes the fused attention kernel).
pub fn train_gpt_with(dev: Device, mode: Option<Mode>, steps: u64, dropout: f64) -> Run {
    train_gpt_cfg(dev, mode, steps, GptConfig { dropout, ..GptConfig::new(11, 8, 16, 2, 2) })
}

/// `train_gpt` of a given model shape (vocab 11 and context 8 are what the data has).
pub fn train_gpt_cfg(dev: Device, mode: Option<Mode>, steps: u64, cfg: GptConfig) -> Run {
    kiln::tensor::rng::manual_seed(7);
    let model = Gpt::new(cfg, dev).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 3e-3, betas: (0.9, 0.95), ..AdamConfig::adamw() }).unwrap());
    let mut sched = WarmupCosine::new(3e-3, 10, steps as usize, 3e-4).unwrap();
    sched.apply(&mut *opt.borrow_mut()).unwrap();
    let step_fn = gpt_step(&model, &opt, None);
    let eager = step_fn;
    let mut step = compile(mode.unwrap_or(Mode::Default), step_fn);
    let mut losses = Vec::new();
    for i in 0..steps {
        let tok = |s: u64| {
            let t = Tensor::rand_at(&[4, 8], Distribution::Uniform, s, i * 32, DType::F32, Device::Cpu).unwrap();
            t.mul_scalar(11.0).unwrap().to_dtype(DType::I64).unwrap().to_device(dev).unwrap()
        };
        let (x, y) = (tok(1), tok(2));
        let out = if mode.is_some() { step.call(&[&x, &y]).unwrap() } else { eager(&[x, y]).unwrap() };
        losses.push(out[0].clone());
        sched.step(&mut *opt.borrow_mut()).unwrap();
    }
    if mode.is_some() {
        assert_eq!(step.counts(), (steps as usize, steps as usize - 1), "one trace, then replays");
    }
    let losses = losses.iter().map(|l| l.item().unwrap() as f32).collect();
    let state = model.named_state().into_iter().map(|(_, t)| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap());
    Run { losses, params: state.collect() }
}

/// A small CNN (a padded convolution, batch norm, ReLU, max pooling, a strided convolution,
/// average pooling, a linear head) trained with AdamW on 8x8 images, eagerly (`mode` None)
/// or compiled; four batches in turn. The run's parameters include batch norm's running
/// statistics and batch count, as F32.
pub fn train_cnn(dev: Device, mode: Option<Mode>, steps: u64) -> Run {
    use kiln::nn::{AvgPool2d, BatchNorm, Conv2d, Flatten, Linear, MaxPool2d, Relu, Window};
    kiln::tensor::rng::manual_seed(11);
    let model = Sequential::new()
        // No bias before batch norm (its gradient is zero but for rounding, which Adam would
        // amplify into noise that differs between runs).
        .add(Conv2d::new(1, 4, Window::new((3, 3)).padding((1, 1)), false, dev).unwrap())
        .add(BatchNorm::new(4, dev).unwrap())
        .add(Relu)
        .add(MaxPool2d(Window::new((2, 2)).stride((2, 2))))
        .add(Conv2d::new(4, 6, Window::new((3, 3)).stride((2, 2)).padding((1, 1)), true, dev).unwrap())
        .add(Relu)
        .add(AvgPool2d(Window::new((2, 2)).stride((2, 2))))
        .add(Flatten)
        .add(Linear::new(6, 3, true, dev).unwrap());
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap());
    let f = mlp_step_unclipped(&model, &opt);
    let mut step = compile(mode.unwrap_or(Mode::Default), f);
    let mut losses = Vec::new();
    for i in 0..steps {
        let x = Tensor::rand_at(&[8, 1, 8, 8], Distribution::Normal, 300, (i % 4) * 512, DType::F32, Device::Cpu).unwrap();
        let y = Tensor::rand_at(&[8], Distribution::Uniform, 400, (i % 4) * 8, DType::F32, Device::Cpu).unwrap();
        let (x, y) = (x.to_device(dev).unwrap(), y.mul_scalar(3.0).unwrap().to_dtype(DType::I64).unwrap().to_device(dev).unwrap());
        let out = if mode.is_some() { step.call(&[&x, &y]).unwrap() } else { f(&[x, y]).unwrap() };
        losses.push(out[0].clone());
    }
    let e = step.explain();
    assert!(e.graph_breaks.is_empty() && e.graphs == mode.is_some() as usize, "{e:?}");
    let losses = losses.iter().map(|l| l.item().unwrap() as f32).collect();
    let state = model.named_state().into_iter().map(|(_, t)| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap());
    Run { losses, params: state.collect() }
}

/// A sequence classifier: a two-layer bidirectional LSTM (batch first) or a two-layer GRU,
/// its last step through a linear head.
enum Cells {
    Lstm(kiln::nn::Lstm),
    Gru(kiln::nn::Gru),
}

struct Recurrent {
    cells: Cells,
    head: kiln::nn::Linear,
}

impl Forward for Recurrent {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.cells {
            Cells::Lstm(l) => l.forward(x)?,
            Cells::Gru(g) => g.forward(&x.transpose(0usize, 1usize)?)?.transpose(0usize, 1usize)?,
        };
        let t = y.shape()[1];
        self.head.forward(&y.narrow(1usize, t - 1, 1)?.squeeze(1usize)?)
    }
}

/// The sequence classifier (`lstm` or a GRU) trained with AdamW on `[8, 6, 5]` sequences,
/// eagerly (`mode` None) or compiled; four batches in turn.
pub fn train_recurrent(dev: Device, mode: Option<Mode>, steps: u64, lstm: bool) -> Run {
    use kiln::nn::{Gru, Linear, Lstm, RnnConfig};
    kiln::tensor::rng::manual_seed(12);
    let cfg = RnnConfig::new(5, 8).num_layers(2);
    let (cells, width) = if lstm {
        (Cells::Lstm(Lstm::new(cfg.bidirectional(true).batch_first(true), dev).unwrap()), 16)
    } else {
        (Cells::Gru(Gru::new(cfg, dev).unwrap()), 8)
    };
    let model = Recurrent { cells, head: Linear::new(width, 3, true, dev).unwrap() };
    let mut params: Vec<Tensor> = match &model.cells {
        Cells::Lstm(l) => l.parameters(),
        Cells::Gru(g) => g.parameters(),
    };
    params.extend(model.head.parameters());
    let opt = RefCell::new(AdamW::new(params.clone(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap());
    let f = mlp_step_unclipped(&model, &opt);
    let mut step = compile(mode.unwrap_or(Mode::Default), f);
    let mut losses = Vec::new();
    for i in 0..steps {
        let x = Tensor::rand_at(&[8, 6, 5], Distribution::Normal, 500, (i % 4) * 512, DType::F32, Device::Cpu).unwrap();
        // The class is the sign pattern of the first feature's sum: learnable from the sequence.
        let sums = x.narrow(2usize, 0, 1).unwrap().sum(&[1usize, 2], false).unwrap().to_vec::<f32>().unwrap();
        let y: Vec<i64> = sums
            .iter()
            .map(|s| {
                if *s < -1.0 {
                    0
                } else if *s < 1.0 {
                    1
                } else {
                    2
                }
            })
            .collect();
        let (x, y) = (x.to_device(dev).unwrap(), Tensor::from_vec(y, &[8], dev).unwrap());
        let out = if mode.is_some() { step.call(&[&x, &y]).unwrap() } else { f(&[x, y]).unwrap() };
        losses.push(out[0].clone());
    }
    let e = step.explain();
    assert!(e.graph_breaks.is_empty() && e.graphs == mode.is_some() as usize, "{e:?}");
    let losses = losses.iter().map(|l| l.item().unwrap() as f32).collect();
    Run { losses, params: params.iter().map(|t| t.to_vec::<f32>().unwrap()).collect() }
}

/// Two parameters made from a fixed formula in `dtype` on `dev`: a `[3, 4]` matrix read through
/// `tanh` and a `[4]` vector squared (every gradient nonzero, none a constant).
fn precision_params(dtype: DType, dev: Device) -> Result<Vec<Tensor>> {
    let w: Vec<f32> = (0..12).map(|i| ((i as f32) * 0.7).sin() * 0.5).collect();
    let b: Vec<f32> = (0..4).map(|i| 0.25 - 0.2 * i as f32).collect();
    let make = |v: Vec<f32>, shape: &[usize]| -> Result<Tensor> {
        let t = Tensor::from_vec(v, shape, Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?;
        t.set_requires_grad(true);
        Ok(t)
    };
    Ok(vec![make(w, &[3, 4])?, make(b, &[4])?])
}

/// `sum(tanh(w) * c) + sum(b^2 * d)`, with `c` and `d` fixed.
fn precision_loss(ps: &[Tensor]) -> Result<Tensor> {
    let (dtype, dev) = (ps[0].dtype(), ps[0].device());
    let c: Vec<f32> = (0..12).map(|i| ((i as f32) * 1.3).cos() + 0.1).collect();
    let c = Tensor::from_vec(c, &[3, 4], Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?;
    let d = Tensor::from_vec(vec![0.3f32, -1.2, 2.5, 0.01], &[4], Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?;
    ps[0].tanh()?.mul(&c)?.sum_all()?.add(&ps[1].square()?.mul(&d)?.sum_all()?)
}

/// The parameters after `steps` steps of `make`'s optimizer on `precision_loss`, eagerly or
/// as one compiled step (`Mode::Default`) replayed, in `dtype` on `dev`.
fn precision_run<O: Optimizer>(
    dev: Device,
    dtype: DType,
    compiled: bool,
    steps: usize,
    make: &dyn Fn(Vec<Tensor>) -> Result<O>,
) -> Result<Vec<f64>> {
    let ps = precision_params(dtype, dev)?;
    let opt = RefCell::new(make(ps.clone())?);
    let f = |_: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = precision_loss(&ps)?;
        loss.backward()?;
        opt.borrow_mut().step()?;
        opt.borrow_mut().zero_grad()?;
        Ok(vec![loss])
    };
    let mut step = compile(Mode::Default, f);
    for _ in 0..steps {
        if compiled {
            step.call(&[] as &[Tensor])?;
        } else {
            f(&[])?;
        }
    }
    Ok(ps.iter().map(|p| p.to_vec_f64()).collect::<Result<Vec<_>>>()?.concat())
}

/// Ten steps with F32 parameters on `dev`, eagerly and compiled, against the same ten steps
/// with F64 parameters on `dev`: each run's largest difference over the largest F64
/// parameter must stay within 3e-7 (F32 rounding, nothing narrower).
pub fn assert_f32_steps_track_f64<O: Optimizer>(what: &str, dev: Device, make: impl Fn(Vec<Tensor>) -> Result<O>) {
    // The reference runs on the same device: what differs is only the parameters' dtype (a
    // GPU's own F32 arithmetic, its products' summation order, is not what is checked here).
    let exact = precision_run(dev, DType::F64, false, 10, &make).unwrap();
    let start = precision_run(dev, DType::F64, false, 0, &make).unwrap();
    let moved = exact.iter().zip(&start).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(moved > 1e-3, "{what}: the f64 run barely moves ({moved:e}): the comparison would be vacuous");
    let scale = exact.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for compiled in [false, true] {
        let got = precision_run(dev, DType::F32, compiled, 10, &make).unwrap();
        let (at, worst) =
            got.iter().zip(&exact).map(|(a, b)| (a - b).abs()).enumerate().fold((0, 0.0), |m, (i, d)| if d > m.1 { (i, d) } else { m });
        let rel = worst / scale;
        let mode = if compiled { "compiled" } else { "eager" };
        eprintln!("{what} {mode} on {dev:?}: 10 F32 steps land {rel:.2e} of the largest parameter from the f64 run");
        assert!(
            rel <= 3e-7,
            "{what} {mode} on {dev:?}: 10 F32 steps land {rel:.2e} of the largest parameter from the f64 run (at {at}: {} vs {})",
            got[at],
            exact[at]
        );
    }
}

/// Token batches for the data-parallel runs: global batch `step` (4 rows of 8 tokens of 13),
/// of which rank `rank` of `world` takes its share of rows.
pub fn ddp_batch(step: u64, rank: usize, world: usize, device: Device) -> Result<(Tensor, Tensor)> {
    let draw = |seed| -> Result<Tensor> {
        Tensor::rand_at(&[4, 8], Distribution::Uniform, seed, step * 32, DType::F32, Device::Cpu)?.mul_scalar(13.0)?.to_dtype(DType::I64)
    };
    let rows = 4 / world;
    let take = |t: Tensor| t.narrow(0usize, rank * rows, rows)?.contiguous()?.to_device(device);
    Ok((take(draw(1)?)?, take(draw(2)?)?))
}

/// How the data-parallel runs spread the work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Parallel {
    /// One process, the whole batch.
    Plain,
    /// `Ddp`: gradients averaged between backward and clipping.
    Ddp,
    /// `Zero1` around AdamW, clipping inside it.
    Zero1,
}

/// `steps` GPT steps (AdamW, clipping at 1) on this rank's share of each global batch, eager
/// or compiled in `mode`. The model starts from `init_seed` (Ddp and Zero1 then copy rank 0's).
pub fn dp_gpt_run(
    device: Device,
    pg: Option<&kiln::distributed::ProcessGroup>,
    how: Parallel,
    mode: Option<Mode>,
    steps: u64,
    init_seed: u64,
) -> Result<Run> {
    use kiln::distributed::{Ddp, DdpOptions, Zero1};
    let model = {
        let _lock = SEEDED.lock();
        kiln::tensor::rng::manual_seed(init_seed);
        Gpt::new(GptConfig::new(13, 8, 16, 2, 2), device)?
    };
    let config = AdamConfig { lr: 1e-2, ..AdamConfig::adamw() };
    let need = || pg.ok_or_else(|| Error::Msg(format!("{how:?} needs a process group")));
    let (rank, world) = pg.map_or((0, 1), |p| (p.rank(), p.world_size()));
    let run = Steps { model: &model, device, rank, world, mode, steps };
    match how {
        Parallel::Plain => run.train(None, AdamW::new(model.parameters(), config)?, true),
        Parallel::Ddp => {
            let ddp = Ddp::new(&model, need()?, DdpOptions::default())?;
            run.train(Some(&ddp), AdamW::new(model.parameters(), config)?, true)
        }
        Parallel::Zero1 => run.train(None, Zero1::new(&model, need()?, Some(1.0), |p| AdamW::new(p, config))?, false),
    }
}

struct Steps<'a> {
    model: &'a Gpt,
    device: Device,
    rank: usize,
    world: usize,
    mode: Option<Mode>,
    steps: u64,
}

impl Steps<'_> {
    fn train<O: Optimizer>(&self, ddp: Option<&kiln::distributed::Ddp>, mut opt: O, clip: bool) -> Result<Run> {
        let model = self.model;
        let step_fn = |o: &mut O, xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let loss = model.loss(&xs[0], &xs[1])?;
            loss.backward()?;
            if let Some(d) = ddp {
                d.sync_gradients()?;
            }
            if clip {
                clip_grad_norm(o.params(), 1.0)?;
            }
            o.step()?;
            o.zero_grad()?;
            Ok(vec![loss])
        };
        let mut compiled = self.mode.map(|m| kiln::compile::compile_step(m, step_fn));
        let mut losses = Vec::new();
        for i in 0..self.steps {
            let (x, y) = ddp_batch(i, self.rank, self.world, self.device)?;
            let out = match &mut compiled {
                Some(c) => c.call(&mut opt, &[&x, &y])?,
                None => step_fn(&mut opt, &[x, y])?,
            };
            losses.push(out[0].clone());
        }
        if let Some(c) = &compiled {
            // The data-parallel step stays one graph: the collectives are nodes of it.
            let (e, (calls, replays)) = (c.explain(), c.counts());
            if e.graphs != 1 || !e.graph_breaks.is_empty() || replays + 1 != calls {
                return Err(Error::Msg(format!("not one graph replayed: {e}, {replays} replays of {calls} calls")));
            }
        }
        let losses = losses.iter().map(|l| l.to_vec::<f32>().map(|v| v[0])).collect::<Result<Vec<f32>>>()?;
        let params = model.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<Vec<_>>>()?;
        Ok(Run { losses, params })
    }
}

/// Held while a model is made from a seed: the generator is the process's, and the ranks of
/// a thread group make their models at once.
pub static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `n` (batch, length) pairs spread over `batch` and `length` in a fixed pseudo-random order,
/// starting with both ends (the smallest batch with the longest sequence and the reverse).
pub fn random_shapes(n: usize, batch: (usize, usize), length: (usize, usize)) -> Vec<(usize, usize)> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = |(lo, hi): (usize, usize)| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        lo + (s % (hi - lo + 1) as u64) as usize
    };
    let mut v = vec![(batch.0, length.1), (batch.1, length.0)];
    while v.len() < n {
        v.push((next(batch), next(length)));
    }
    v
}

/// A run over changing shapes and what the compiled step reports: graphs compiled, and
/// shapes traced for its dynamic graphs.
pub struct ShapesRun {
    pub run: Run,
    pub graphs: usize,
    pub shapes_traced: usize,
}

/// A small GPT (context 256, dropout 0.1) trained on batches of the given (batch, length)
/// shapes in turn, eagerly (`opts` None) or compiled with `opts`; `after` runs after each step.
pub fn train_gpt_shapes(
    dev: Device,
    opts: Option<kiln::compile::CompileOptions>,
    shapes: &[(usize, usize)],
    after: &mut dyn FnMut(),
) -> ShapesRun {
    kiln::tensor::rng::manual_seed(5);
    let model = Gpt::new(GptConfig { dropout: 0.1, ..GptConfig::new(11, 256, 16, 2, 2) }, dev).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 3e-3, ..AdamConfig::adamw() }).unwrap());
    let step_fn = gpt_step(&model, &opt, None);
    let mut step = kiln::compile::compile_with(opts.unwrap_or_default(), step_fn);
    let mut losses = Vec::new();
    for (i, &(b, t)) in shapes.iter().enumerate() {
        let tok = |s: u64| {
            let x = Tensor::rand_at(&[b, t], Distribution::Uniform, s, i as u64 * 65536, DType::F32, Device::Cpu).unwrap();
            x.mul_scalar(11.0).unwrap().to_dtype(DType::I64).unwrap().to_device(dev).unwrap()
        };
        let (x, y) = (tok(1), tok(2));
        let out = if opts.is_some() { step.call(&[&x, &y]).unwrap() } else { step_fn(&[x, y]).unwrap() };
        losses.push(out[0].clone());
        after();
    }
    let losses = losses.iter().map(|l| l.item().unwrap() as f32).collect();
    let state = model.named_state().into_iter().map(|(_, t)| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap());
    let e = step.explain();
    ShapesRun { run: Run { losses, params: state.collect() }, graphs: e.graphs, shapes_traced: e.shapes_traced }
}

/// An MLP (20-32-5, AdamW, clipping) trained on batches of the given sizes in turn, eagerly
/// (`opts` None) or compiled with `opts`.
pub fn train_mlp_batches(dev: Device, opts: Option<kiln::compile::CompileOptions>, batches: &[usize]) -> ShapesRun {
    kiln::tensor::rng::manual_seed(3);
    let model = kiln::models::mlp(&[20, 32, 5], dev).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap());
    let mut eager = mlp_step(&model, &opt);
    let mut step = kiln::compile::compile_with(opts.unwrap_or_default(), mlp_step(&model, &opt));
    let mut losses = Vec::new();
    for (i, &b) in batches.iter().enumerate() {
        let x = Tensor::rand_at(&[b, 20], Distribution::Normal, 100, i as u64 * 4096, DType::F32, Device::Cpu).unwrap();
        let y = Tensor::rand_at(&[b], Distribution::Uniform, 200, i as u64 * 64, DType::F32, Device::Cpu).unwrap();
        let y = y.mul_scalar(5.0).unwrap().to_dtype(DType::I64).unwrap();
        let (x, y) = (x.to_device(dev).unwrap(), y.to_device(dev).unwrap());
        let out = if opts.is_some() { step.call(&[&x, &y]).unwrap() } else { eager(&[x, y]).unwrap() };
        losses.push(out[0].clone());
    }
    let losses = losses.iter().map(|l| l.item().unwrap() as f32).collect();
    let params = model.parameters().iter().map(|t| t.to_vec::<f32>().unwrap()).collect();
    let e = step.explain();
    ShapesRun { run: Run { losses, params }, graphs: e.graphs, shapes_traced: e.shapes_traced }
}
