//! Compiled steps against eager ones: the same losses and parameters over hundreds of steps
//! (with dropout, AdamW, a warmup-cosine schedule stepping outside the compiled step, and
//! gradient clipping), recompiles on shape changes, graph breaks, caller-owned outputs.

use common::{assert_close, mlp_step, mlp_step_unclipped};
use kiln::compile::{compile, compile_with, CompileOptions, Dynamic, Mode};
use kiln::models::mlp;
use kiln::nn::cross_entropy;
use kiln::optim::{AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use kiln_tensor::{Distribution, UnaryOp};
use std::cell::RefCell;

mod common;

/// Whether `KILN_CPU_CODEGEN=0` turns native CPU kernels off (the test then says it skipped).
fn native_codegen_off(why: &str) -> bool {
    let off = std::env::var("KILN_CPU_CODEGEN").is_ok_and(|v| v == "0");
    if off {
        eprintln!("SKIPPED: KILN_CPU_CODEGEN=0 turns native CPU kernels off{why}");
    }
    off
}

fn data(step: u64, b: usize, inp: usize, classes: usize) -> (Tensor, Tensor) {
    let x = Tensor::rand_at(&[b, inp], Distribution::Normal, 100, step * 4096, DType::F32, Device::Cpu).unwrap();
    let y = Tensor::rand_at(&[b], Distribution::Uniform, 200, step * 64, DType::F32, Device::Cpu).unwrap();
    (x, y.mul_scalar(classes as f64).unwrap().to_dtype(DType::I64).unwrap())
}

fn train_mlp(compiled: bool, steps: u64) -> (Vec<f64>, Vec<Vec<f32>>) {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[20, 32, 5], Device::Cpu).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap());
    let mut sched = WarmupCosine::new(1e-2, 20, steps as usize, 1e-3).unwrap();
    sched.apply(&mut *opt.borrow_mut()).unwrap();
    let mut f = mlp_step(&model, &opt);
    let mut step = compile(Mode::Default, mlp_step(&model, &opt));
    let mut losses = Vec::new();
    for i in 0..steps {
        // Eight fixed batches, cycled, so there is something to learn.
        let (x, y) = data(i % 8, 16, 20, 5);
        let out = if compiled { step.call(&[&x, &y]).unwrap() } else { f(&[x, y]).unwrap() };
        losses.push(out[0].item().unwrap());
        sched.step(&mut *opt.borrow_mut()).unwrap();
    }
    if compiled {
        assert_eq!(step.counts(), (steps as usize, steps as usize - 1), "one trace, then replays");
    }
    (losses, model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect())
}

#[test]
fn compiled_mlp_matches_eager_for_200_steps() {
    let (le, pe) = train_mlp(false, 200);
    let (lc, pc) = train_mlp(true, 200);
    let (le32, lc32): (Vec<f32>, Vec<f32>) = (le.iter().map(|&x| x as f32).collect(), lc.iter().map(|&x| x as f32).collect());
    assert_close("losses", &lc32, &le32, 1e-4);
    for (i, (a, b)) in pc.iter().zip(&pe).enumerate() {
        assert_close(&format!("param {i}"), a, b, 1e-4);
    }
    // The schedule really moved the lr: a baked-in lr would train differently.
    assert!(le[199] < le[0], "loss fell: {} -> {}", le[0], le[199]);
}

#[test]
fn compiled_gpt_with_dropout_matches_eager_for_200_steps() {
    let eager = common::train_gpt(Device::Cpu, None, 200);
    let compiled = common::train_gpt(Device::Cpu, Some(Mode::Default), 200);
    common::assert_runs_agree("compiled vs eager", &compiled, &eager, (2e-3, 2e-3));
}

#[test]
fn without_dynamic_shapes_a_smaller_last_batch_recompiles_and_the_limit_errors() -> Result<()> {
    kiln::tensor::rng::manual_seed(1);
    let model = mlp(&[20, 8, 5], Device::Cpu)?;
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw())?);
    let opts = CompileOptions { recompile_limit: 2, dynamic: Dynamic::Never, ..Default::default() };
    let mut step = compile_with(opts, mlp_step(&model, &opt));
    for (i, b) in [16usize, 16, 5, 5, 16].into_iter().enumerate() {
        let (x, y) = data(i as u64, b, 20, 5);
        let before: Vec<Vec<f32>> = model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
        let loss = step.call(&[&x, &y])?[0].item()?;
        // The loss the compiled step returned is the eager loss for the parameters it started from.
        let check = mlp(&[20, 8, 5], Device::Cpu)?;
        for (p, v) in check.parameters().iter().zip(&before) {
            kiln::autograd::no_grad(|| p.assign(&Tensor::from_slice(v, p.shape(), Device::Cpu)?))?;
        }
        let want = cross_entropy(&check.forward(&x)?, &y)?.item()?;
        assert!((loss - want).abs() < 1e-5, "batch {b}: {loss} vs {want}");
    }
    assert_eq!(step.explain().graphs, 2);
    let (x, y) = data(9, 3, 20, 5);
    let e = step.call(&[&x, &y]).unwrap_err().to_string();
    assert!(e.contains("recompile limit (2) reached") && e.contains("[3, 20]"), "{e}");
    Ok(())
}

#[test]
fn returned_tensors_belong_to_the_caller() -> Result<()> {
    kiln::tensor::rng::manual_seed(2);
    let model = mlp(&[20, 8, 5], Device::Cpu)?;
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 0.1, ..AdamConfig::adamw() })?);
    let mut step = compile(Mode::Default, mlp_step(&model, &opt));
    let (x, y) = data(0, 16, 20, 5);
    step.call(&[&x, &y])?; // trace
    let first = step.call(&[&x, &y])?.remove(0);
    let kept = first.item()?;
    let second = step.call(&[&x, &y])?.remove(0);
    assert_eq!(first.item()?, kept, "the next call did not overwrite the first loss");
    assert_ne!(second.item()?, kept, "training moved the loss");
    Ok(())
}

#[test]
fn host_reads_fall_back_to_eager_or_error_under_fullgraph() -> Result<()> {
    kiln::tensor::rng::manual_seed(3);
    let model = mlp(&[20, 8, 5], Device::Cpu)?;
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw())?);
    let read = std::cell::Cell::new(f64::NAN);
    let reading_step = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        read.set(loss.item()?);
        if read.get() > 1e9 {
            return Err(Error::Msg("diverged".into()));
        }
        loss.backward()?;
        opt.borrow_mut().step()?;
        opt.borrow_mut().zero_grad()?;
        Ok(vec![loss])
    };
    let mut step = compile(Mode::Default, reading_step);
    let (x, y) = data(0, 16, 20, 5);
    let eager_loss = kiln::tensor::no_grad(|| cross_entropy(&model.forward(&x)?, &y))?.item()?;
    for i in 0..3 {
        let loss = step.call(&[&x, &y])?[0].item()?;
        assert_eq!(loss, read.get(), "the value read inside the step is the one it returns");
        if i == 0 {
            // The trace queues kernels; the read runs them first, so it sees eager's value.
            assert_eq!(loss, eager_loss);
        }
    }
    let ex = step.explain();
    assert_eq!((ex.graphs, ex.graph_breaks.len()), (0, 1));
    assert!(ex.graph_breaks[0].contains("to_vec of a [] tensor"), "{:?}", ex.graph_breaks);
    let mut strict = compile_with(CompileOptions { fullgraph: true, ..Default::default() }, reading_step);
    let e = strict.call(&[&x, &y]).unwrap_err().to_string();
    assert!(e.contains("graph break") && e.contains("fullgraph forbids host reads"), "{e}");
    Ok(())
}

#[test]
fn check_mode_compares_compiled_with_eager() -> Result<()> {
    kiln::tensor::rng::manual_seed(4);
    let model = mlp(&[20, 8, 5], Device::Cpu)?;
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw())?);
    let mut step = compile_with(CompileOptions { check_steps: 5, ..Default::default() }, mlp_step(&model, &opt));
    for i in 0..8 {
        let (x, y) = data(i, 16, 20, 5);
        step.call(&[&x, &y])?;
    }
    let (steps, worst) = step.check_report();
    assert_eq!(steps, 5, "the first call compiles; the next five replays are checked");
    assert!(worst < 1e-5, "compiled and eager differ by {worst}");
    // A closure whose replays differ from eager is caught: it reads a counter the graph baked in.
    let calls = std::cell::Cell::new(0.0);
    let mut drifting = compile_with(CompileOptions { check_steps: 2, ..Default::default() }, |xs: &[Tensor]| {
        calls.set(calls.get() + 1.0);
        Ok(vec![xs[0].mul_scalar(calls.get())?])
    });
    let x = Tensor::ones(&[3], DType::F32, Device::Cpu)?;
    for _ in 0..3 {
        drifting.call(&[&x])?;
    }
    assert!(drifting.check_report().1 >= 1.0, "{:?}", drifting.check_report());
    Ok(())
}

#[test]
fn a_profiled_step_lists_its_kernels_in_explain_and_still_trains() -> Result<()> {
    kiln::tensor::rng::manual_seed(6);
    let model = mlp(&[20, 8, 5], Device::Cpu)?;
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw())?);
    let mut step = compile(Mode::Default, mlp_step(&model, &opt));
    let (x, y) = data(0, 16, 20, 5);
    let first = step.call(&[&x, &y])?[0].item()?;
    assert!(step.explain().kernel_times.is_none(), "nothing profiled yet");
    let before = model.parameters()[0].to_vec::<f32>()?;
    let second = step.call_profiled(&[&x, &y])?[0].item()?;
    assert!(second < first, "the profiled step is a real step: {first} -> {second}");
    assert_ne!(before, model.parameters()[0].to_vec::<f32>()?, "and it updated the parameters");
    let table = step.explain().kernel_times.expect("a kernel table");
    assert!(table.contains("matmul") && table.contains("fused groups"), "{table}");
    assert!(step.explain().to_string().contains("kernels of the last profiled step"));
    Ok(())
}

#[test]
fn split_gradients_become_one_buffer() -> Result<()> {
    let w = Tensor::rand_at(&[5, 6], Distribution::Normal, 9, 0, DType::F32, Device::Cpu)?;
    w.set_requires_grad(true);
    let step_fn = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let h = xs[0].matmul(&w)?;
        let (a, b, c) = (h.narrow(1, 0, 2)?, h.narrow(1, 2, 2)?, h.narrow(1, 4, 2)?);
        let loss = a.mul(&b)?.add(&c.exp()?)?.sum_all()?;
        loss.backward()?;
        let g = w.grad().ok_or_else(|| Error::Msg("no gradient".into()))?.copy()?;
        w.set_grad(None);
        Ok(vec![loss, g])
    };
    let x = Tensor::rand_at(&[3, 5], Distribution::Normal, 10, 0, DType::F32, Device::Cpu)?;
    let eager = step_fn(std::slice::from_ref(&x))?;
    let mut step = compile(Mode::Default, step_fn);
    step.call(&[&x])?;
    let compiled = step.call(&[&x])?;
    for (e, c) in eager.iter().zip(&compiled) {
        assert_close("loss and gradient", &c.to_vec::<f32>()?, &e.to_vec::<f32>()?, 1e-6);
    }
    // The three slices' gradients are joined by one cat (autograd sees that they tile h),
    // with no zeros and no adds of padded parts.
    let ir = step.dump().expect("a graph");
    let graph = ir.split("groups").next().unwrap_or_default();
    assert_eq!(graph.matches("[3, 6] = cat").count(), 1, "{graph}");
    assert!(!graph.contains("F32[3, 6] = full"), "{graph}");
    assert!(!graph.lines().any(|l| l.contains("[3, 6] = add")), "{graph}");
    Ok(())
}

/// Linear layers on `[B, T, C]` activations (as in a transformer): the ReLU joins the product
/// that feeds it and each bias gradient (a sum over B and T) joins its weight gradient's
/// product, and the gradients match eager ones.
#[test]
fn relu_and_bias_gradients_fold_into_their_matmuls() -> Result<()> {
    let graph = linear_pair_step(false)?;
    assert_eq!(graph.matches("= matmul_relu").count(), 1, "{graph}");
    assert_eq!(graph.matches("= matmul_sum").count(), 2, "{graph}");
    assert!(!graph.contains("= relu") && !graph.contains("= sum[0, 1]"), "{graph}");
    Ok(())
}

/// The same with GELU's tanh form: the forward GELU and the backward's product by its
/// gradient join their matmuls too.
#[test]
fn gelu_tanh_and_its_gradient_fold_into_their_matmuls() -> Result<()> {
    let graph = linear_pair_step(true)?;
    assert_eq!(graph.matches("= matmul_gelu_tanh").count(), 1, "{graph}");
    assert_eq!(graph.matches("= matmul_dgelu_tanh").count(), 1, "{graph}");
    assert_eq!(graph.matches("= matmul_sum").count(), 2, "{graph}");
    assert!(!graph.contains("= gelu_tanh") && !graph.contains("grad"), "{graph}");
    Ok(())
}

/// Two linear layers on `[2, 5, 6]` with ReLU or tanh-GELU between: the compiled step's loss
/// and gradients against eager ones; returns the compiled graph's text.
fn linear_pair_step(gelu: bool) -> Result<String> {
    use kiln::nn::{Linear, Module};
    kiln::tensor::rng::manual_seed(3);
    let (l1, l2) = (Linear::new(6, 8, true, Device::Cpu)?, Linear::new(8, 4, true, Device::Cpu)?);
    let params: Vec<Tensor> = l1.parameters().into_iter().chain(l2.parameters()).collect();
    let step_fn = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let h = l1.forward(&xs[0])?;
        let loss = l2.forward(&if gelu { h.gelu_tanh()? } else { h.relu()? })?.square()?.mean_all()?;
        loss.backward()?;
        let mut out = vec![loss];
        for p in &params {
            out.push(p.grad().ok_or_else(|| Error::Msg("no gradient".into()))?.copy()?);
            p.set_grad(None);
        }
        Ok(out)
    };
    let x = Tensor::rand_at(&[2, 5, 6], Distribution::Normal, 11, 0, DType::F32, Device::Cpu)?;
    let eager = step_fn(std::slice::from_ref(&x))?;
    let mut step = compile(Mode::Default, step_fn);
    let compiled = step.call(&[&x])?;
    for (i, (e, c)) in eager.iter().zip(&compiled).enumerate() {
        assert_eq!(c.shape(), e.shape(), "output {i}");
        assert_close(&format!("output {i}"), &c.to_vec::<f32>()?, &e.to_vec::<f32>()?, 1e-6);
    }
    let ir = step.dump().expect("a graph");
    Ok(ir.split("groups").next().unwrap_or_default().to_string())
}

/// Every unary op and a strided, broadcast and scalar read through one native CPU group
/// (`CompileOptions::native_cpu`, built with the system C compiler), against eager and the
/// interpreter bit for bit: the generated C computes each op as the CPU kernels do.
#[test]
fn native_cpu_groups_match_eager_and_the_interpreter_bit_for_bit() -> Result<()> {
    if native_codegen_off("") {
        return Ok(());
    }
    let r = |s: &[usize], seed| Tensor::rand_at(s, Distribution::Normal, seed, 0, DType::F32, Device::Cpu);
    let (a, b, bias) = (r(&[7, 5], 1)?, r(&[5, 7], 2)?, r(&[7], 3)?);
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        // a read transposed, the bias broadcast over rows, a 0-dim scale broadcast everywhere.
        let scale = xs[2].sum_all()?;
        let z = xs[0].t()?.mul(&xs[1])?.add(&xs[2])?.mul(&scale)?;
        let mut outs = vec![z.clone()];
        for op in UnaryOp::ALL {
            // Keep log and sqrt in their domain so NaNs do not hide differences.
            let arg = if matches!(op, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt) { z.abs()?.add_scalar(0.5)? } else { z.clone() };
            outs.push(arg.unary(op)?.add_scalar(1.0)?);
        }
        outs.push(Tensor::where_cond(&z.gt(&xs[1])?, &z.pow(&xs[1].abs()?)?, &z.maximum(&xs[1])?)?);
        Ok(outs)
    };
    let eager = f(&[a.clone(), b.clone(), bias.clone()])?;
    for native in [true, false] {
        let mut step = compile_with(CompileOptions { native_cpu: native, ..Default::default() }, f);
        step.call(&[&a, &b, &bias])?; // the trace runs eagerly; the replays run the groups
        for _ in 0..2 {
            let got = step.call(&[&a, &b, &bias])?;
            for (k, (x, y)) in got.iter().zip(&eager).enumerate() {
                let (x, y) = (x.to_vec::<f32>()?, y.to_vec::<f32>()?);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&x), bits(&y), "output {k} (native: {native}): {x:?} vs eager {y:?}");
            }
        }
        let (groups, built) = step.explain().native_groups.expect("a CPU step reports its groups");
        assert!(groups >= 1, "the step has fusion groups");
        assert_eq!(built, if native { groups } else { 0 }, "native: {native}; a missing C compiler fails here (set KILN_CC)");
    }
    Ok(())
}

/// Kiln's f32 `exp`, `erf` and `tanh` (`kiln_tensor::math`) in generated C against the eager
/// kernels, bit for bit, over their whole range: 0 to +-110 in small steps, the edges where
/// the implementation switches (erf at 1 and 4, tanh at 0.625; exp's clamps at -104 and 89, subnormal
/// results), infinities and NaN. The native groups are built with AVX2 or AVX-512 where the
/// CPU has them; eager runs its loops with AVX2 (`cpu::wide`).
#[test]
fn native_exp_and_erf_match_eager_over_their_whole_range() -> Result<()> {
    if native_codegen_off("") {
        return Ok(());
    }
    let mut v: Vec<f32> = (0..22000).map(|i| (i as f32 - 11000.0) * 0.01).collect();
    v.extend([1.0, -1.0, 4.0, -4.0, 3.9999998, 0.625, -0.625, 0.62499994, -104.0, -104.5, 89.0, 88.72, -87.5, -103.0, 0.0, -0.0]);
    v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-30, -1e-30]);
    v.resize(v.len().next_multiple_of(8), 0.5);
    let x = Tensor::from_vec(v.clone(), &[v.len()], Device::Cpu)?;
    let zero = Tensor::zeros(&[v.len()], DType::F32, Device::Cpu)?;
    let ops = [
        UnaryOp::Exp,
        UnaryOp::Erf,
        UnaryOp::Tanh,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::GeluTanh,
        UnaryOp::GeluTanhGrad,
        UnaryOp::Sigmoid,
        UnaryOp::Silu,
        UnaryOp::SiluGrad,
    ];
    // `+ zero` (an input, so no pass removes it) puts the ops in one group with it (a lone op runs
    // the eager kernel).
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> { ops.iter().map(|&op| xs[0].add(&xs[1])?.unary(op)).collect() };
    let eager = f(&[x.clone(), zero.clone()])?;
    let mut step = compile(Mode::Default, f);
    step.call(&[&x, &zero])?;
    let got = step.call(&[&x, &zero])?;
    let (groups, built) = step.explain().native_groups.expect("a CPU step reports its groups");
    assert_eq!((groups, built), (1, 1), "one native group (the add and every op); a missing C compiler fails here (set KILN_CC)");
    for ((op, g), e) in ops.iter().zip(&got).zip(&eager) {
        let (g, e) = (g.to_vec::<f32>()?, e.to_vec::<f32>()?);
        for (i, (a, b)) in g.iter().zip(&e).enumerate() {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{op:?}({}): native {a:e}, eager {b:e}", v[i]);
        }
    }
    // A lone GELU is a native group too (its wider vectors beat eager's loop), still exact.
    let mut lone = compile(Mode::Default, |xs: &[Tensor]| Ok(vec![xs[0].unary(UnaryOp::Gelu)?]));
    lone.call(&[&x])?;
    let got = lone.call(&[&x])?[0].to_vec::<f32>()?;
    assert_eq!(lone.explain().native_groups, Some((1, 1)), "the lone GELU runs as a native group");
    let want = x.unary(UnaryOp::Gelu)?.to_vec::<f32>()?;
    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
    assert!(same, "a lone native GELU differs from eager");
    Ok(())
}

/// A weight gradient read only by its AdamW update is made a tile of rows at a time, each
/// tile updated while it is in cache (`fusion::feed_products`). 4096 inputs make tiles of 16
/// rows, so the 40-row gradient is three tiles (16, 16, 8). Parameters match the interpreter
/// (which does not feed) bit for bit, and eager within float rounding.
#[test]
fn weight_gradients_feed_their_adamw_update_tile_by_tile() -> Result<()> {
    if native_codegen_off(" (feeding needs them)") {
        return Ok(());
    }
    // `how`: compiled with (native code, feeding), or eager.
    let run = |how: Option<(bool, bool)>| -> Result<(Vec<Vec<f32>>, Vec<f32>, usize)> {
        kiln::tensor::rng::manual_seed(3);
        let model = mlp(&[4096, 40], Device::Cpu)?;
        let start = model.parameters()[0].to_vec::<f32>()?;
        let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })?);
        // No clipping: the global norm would read the gradient before its update does.
        let f = mlp_step_unclipped(&model, &opt);
        let opts = |(native_cpu, feed_products)| CompileOptions { native_cpu, feed_products, ..Default::default() };
        let mut step = how.map(|h| compile_with(opts(h), f));
        for i in 0..4 {
            let (x, y) = data(i, 8, 4096, 40);
            match &mut step {
                Some(s) => s.call(&[&x, &y])?,
                None => f(&[x, y])?,
            };
        }
        let fed = step.map_or(0, |s| s.explain().fed_products);
        Ok((model.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()?, start, fed))
    };
    let (eager, start, _) = run(None)?;
    let (native, _, fed) = run(Some((true, true)))?;
    let (interpreted, _, none) = run(Some((false, true)))?;
    let (unfed, _, off) = run(Some((true, false)))?;
    assert_eq!((fed, none, off), (1, 0, 0), "the weight gradient (not the 40-element bias's) is fed; a missing C compiler fails here");
    assert_eq!(native, unfed, "`feed_products` off: the same bits, the product a kernel of its own");
    for (k, ((f, i), e)) in native.iter().zip(&interpreted).zip(&eager).enumerate() {
        let bad: Vec<(usize, f32, f32)> =
            f.iter().zip(i).enumerate().filter(|(_, (a, b))| a.to_bits() != b.to_bits()).map(|(j, (a, b))| (j, *a, *b)).collect();
        assert!(bad.is_empty(), "param {k}, fed vs interpreted: {} of {} differ, first {:?}", bad.len(), f.len(), &bad[..bad.len().min(4)]);
        // Eager's AdamW kernel rounds in another order than the traced update's ops.
        assert_close(&format!("param {k}, fed vs eager"), f, e, 1e-5);
    }
    let moved = eager[0].iter().zip(&start).filter(|(a, b)| a != b).count();
    assert!(moved > eager[0].len() / 2, "training moved the weight: {moved} of {} changed", start.len());
    Ok(())
}

/// A group reading two products whole is fed by one of them (the other runs before it as a
/// plain product), and the result is eager's bit for bit: 8192 columns make 8-row tiles,
/// so the 20-row product is three tiles.
#[test]
fn a_group_reading_two_products_is_fed_by_one() -> Result<()> {
    if native_codegen_off(" (feeding needs them)") {
        return Ok(());
    }
    let r = |s: &[usize], seed| Tensor::rand_at(s, Distribution::Normal, seed, 0, DType::F32, Device::Cpu);
    let (a, b, c) = (r(&[20, 16], 1)?, r(&[16, 8192], 2)?, r(&[16, 8192], 3)?);
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![xs[0].matmul(&xs[1])?.add(&xs[0].matmul(&xs[2])?)?.mul_scalar(0.5)?]) };
    let want = f(&[a.clone(), b.clone(), c.clone()])?[0].to_vec::<f32>()?;
    let mut step = compile_with(CompileOptions::default(), f);
    for _ in 0..3 {
        let got = step.call(&[&a, &b, &c])?[0].to_vec::<f32>()?;
        let bad = got.iter().zip(&want).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(bad, 0, "{bad} of {} elements differ from eager", want.len());
    }
    assert_eq!(step.explain().fed_products, 1, "one product fed; a missing C compiler fails here");
    Ok(())
}

/// Autocast (BF16): a product of F32 tensors is the product of their BF16 roundings, returned
/// in F32 (rounded through BF16), and the weight's gradient is F32.
#[test]
fn autocast_multiplies_in_bf16_and_keeps_f32_parameters() -> Result<()> {
    let x = Tensor::from_slice(&[1.0f32, 1.001, -2.0, 0.5, 3.0, 1.0 / 3.0], &[2, 3], Device::Cpu)?;
    let w = Tensor::from_slice(&[0.1f32, 0.2, 0.3, -1.0, 1.0 / 7.0, 2.5], &[3, 2], Device::Cpu)?;
    w.set_requires_grad(true);
    let y = {
        let _ac = kiln::tensor::Autocast::new(DType::BF16)?;
        x.matmul(&w)?
    };
    assert_eq!(y.dtype(), DType::BF16, "the product stays in the low dtype, as in torch.autocast");
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    let (xv, wv) = (x.to_vec::<f32>()?, w.to_vec::<f32>()?);
    let mut want = vec![0f32; 4];
    for i in 0..2 {
        for j in 0..2 {
            let acc: f32 = (0..3).map(|k| bf(xv[i * 3 + k]) * bf(wv[k * 2 + j])).sum();
            want[i * 2 + j] = bf(acc);
        }
    }
    assert_close("autocast product", &y.to_dtype(DType::F32)?.to_vec::<f32>()?, &want, 1e-6);
    // Added to an F32 tensor it is F32 again (type promotion).
    assert_eq!(y.add(&x.narrow(1, 0, 2)?)?.dtype(), DType::F32);
    y.sum_all()?.backward()?;
    let g = w.grad().expect("w has a gradient");
    assert_eq!(g.dtype(), DType::F32, "the parameter's gradient stays F32");
    // d(sum)/dw[k][j] = sum_i x[i][k], with x rounded to BF16 and the result rounded too.
    let gw: Vec<f32> = (0..6).map(|kj| bf(bf(xv[kj / 2]) + bf(xv[3 + kj / 2]))).collect();
    assert_close("autocast weight gradient", &g.to_vec::<f32>()?, &gw, 1e-6);
    assert!(kiln::tensor::Autocast::new(DType::F64).is_err(), "autocast takes BF16 or F16 only");
    Ok(())
}

/// Autocast casts a weight read transposed (`x w^T`, nn.Linear) as it is stored and reads the
/// copy through the transpose (PyTorch's `to` keeps strides), so the product's backward makes
/// the weight's gradient in the weight's own layout: a compiled MLP step under autocast has
/// no transposing copy left (the optimizer reads each gradient in order), and the gradient
/// has the hand-computed values.
#[test]
fn autocast_hands_a_transposed_weight_its_gradient_in_its_own_layout() -> Result<()> {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[20, 32, 5], Device::Cpu)?;
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw())?);
    let mut step = compile(Mode::Default, mlp_step(&model, &opt));
    let (xb, yb) = data(0, 16, 20, 5);
    {
        let _ac = kiln::tensor::Autocast::new(DType::BF16)?;
        step.call(&[&xb, &yb])?;
    }
    let ir = step.dump().unwrap_or_default();
    assert!(ir.contains("BF16[") && !ir.contains("= contiguous"), "a weight's gradient was transposed by a copy:\n{ir}");
    let x = Tensor::from_slice(&[1.0f32, 1.001, -2.0, 0.5, 3.0, 1.0 / 3.0], &[2, 3], Device::Cpu)?;
    let w = Tensor::from_slice(&[0.1f32, 0.2, 0.3, -1.0, 1.0 / 7.0, 2.5], &[2, 3], Device::Cpu)?;
    w.set_requires_grad(true);
    let y = {
        let _ac = kiln::tensor::Autocast::new(DType::BF16)?;
        x.matmul(&w.t()?)?
    };
    y.sum_all()?.backward()?;
    let g = w.grad().expect("w has a gradient");
    assert!(g.is_contiguous() && g.shape() == [2, 3] && g.dtype() == DType::F32, "{:?} {:?}", g.shape(), g.layout());
    // d(sum)/dw[j][k] = sum_i x[i][k], x rounded to BF16 and the sum too.
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    let xv = x.to_vec::<f32>()?;
    let gw: Vec<f32> = (0..6).map(|jk| bf(bf(xv[jk % 3]) + bf(xv[3 + jk % 3]))).collect();
    assert_close("transposed weight's gradient", &g.to_vec::<f32>()?, &gw, 1e-6);
    Ok(())
}

/// A step traced under autocast matches the eager autocast step, and leaving autocast
/// recompiles (the setting is part of the guard) instead of replaying BF16 products.
#[test]
fn compiled_autocast_matches_eager_and_is_keyed_by_the_setting() -> Result<()> {
    let run = |compiled: bool| -> Result<(common::Run, usize, String)> {
        kiln::tensor::rng::manual_seed(0);
        let model = mlp(&[20, 32, 5], Device::Cpu)?;
        let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })?);
        let mut f = mlp_step(&model, &opt);
        let mut step = compile(Mode::Default, mlp_step(&model, &opt));
        let (mut losses, mut ir) = (Vec::new(), String::new());
        for i in 0..30 {
            let (x, y) = data(i % 8, 16, 20, 5);
            let _ac = (i < 20).then(|| kiln::tensor::Autocast::new(DType::BF16)).transpose()?;
            let out = if compiled { step.call(&[&x, &y])? } else { f(&[x, y])? };
            losses.push(out[0].item()? as f32);
            if i == 19 {
                ir = step.dump().unwrap_or_default();
            }
        }
        let params = model.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()?;
        Ok((common::Run { losses, params }, step.explain().graphs, ir))
    };
    let (eager, _, _) = run(false)?;
    let (compiled, graphs, ir) = run(true)?;
    let (le, pe, lc, pc) = (&eager.losses, &eager.params, &compiled.losses, &compiled.params);
    // The same BF16 products. Eager AdamW takes its bias corrections from the host in f64,
    // the compiled step computes them in f32; a BF16 rounding flipped by that differs by one
    // BF16 ulp, which Adam's normalised update carries into the parameters.
    assert_close("autocast losses", lc, le, 2e-3);
    for (i, (a, b)) in pc.iter().zip(pe).enumerate() {
        assert_close(&format!("param {i}"), a, b, 1e-2);
    }
    let products: Vec<&str> = ir.lines().filter(|l| l.contains("= matmul")).collect();
    assert!(!products.is_empty() && products.iter().all(|l| l.contains("BF16[")), "autocast graph multiplies in BF16:\n{ir}");
    assert_eq!(graphs, 2, "one graph under autocast, one without");
    Ok(())
}

/// SGD's momentum buffer starts at the first gradient: a step compiled on the first call must
/// keep accumulating momentum on replays (a baked first-step rule would drop it), and with
/// dampening, whose first step is a different rule, tracing from the first step is an error.
#[test]
fn compiled_sgd_with_momentum_matches_eager() -> Result<()> {
    use kiln::optim::{SgdConfig, SGD};
    let cfg = SgdConfig { lr: 0.05, momentum: 0.9, nesterov: true, ..Default::default() };
    let run = |compiled: bool| -> Result<Vec<Vec<f32>>> {
        kiln::tensor::rng::manual_seed(5);
        let model = mlp(&[20, 8, 5], Device::Cpu)?;
        let opt = RefCell::new(SGD::new(model.parameters(), cfg)?);
        let eager = mlp_step_unclipped(&model, &opt);
        let mut step = compile(Mode::Default, mlp_step_unclipped(&model, &opt));
        for i in 0..20 {
            let (x, y) = data(i, 16, 20, 5);
            if compiled {
                step.call(&[&x, &y])?;
            } else {
                eager(&[x, y])?;
            }
        }
        model.parameters().iter().map(|p| p.to_vec::<f32>()).collect()
    };
    let (eager, compiled) = (run(false)?, run(true)?);
    for (e, c) in eager.iter().zip(&compiled) {
        assert_close("SGD momentum parameters", c, e, 1e-5);
    }
    kiln::tensor::rng::manual_seed(5);
    let model = mlp(&[20, 8, 5], Device::Cpu)?;
    let opt = RefCell::new(SGD::new(model.parameters(), SgdConfig { dampening: 0.1, nesterov: false, ..cfg })?);
    let mut damped = compile(Mode::Default, mlp_step_unclipped(&model, &opt));
    let (x, y) = data(0, 16, 20, 5);
    let e = damped.call(&[&x, &y]).unwrap_err().to_string();
    assert!(e.contains("dampening") && e.contains("take one eager step"), "{e}");
    Ok(())
}

/// A step that reads values without a host-read hook (`count_nan_inf`, a debugging aid) runs
/// the trace's queued kernels early: that first call then keeps its eager effects and is not
/// computed a second time by the compiled program (which would apply the update twice).
#[test]
fn a_flush_inside_the_trace_applies_the_first_step_once() -> Result<()> {
    let run = |compiled: bool| -> Result<Vec<Vec<f32>>> {
        kiln::tensor::rng::manual_seed(6);
        let model = mlp(&[20, 8, 5], Device::Cpu)?;
        let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig::adamw())?);
        let mut inner = mlp_step(&model, &opt);
        let mut checked = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let out = inner(xs)?;
            assert_eq!(out[0].count_nan_inf()?, (0, 0));
            Ok(out)
        };
        if compiled {
            let mut step = compile(Mode::Default, checked);
            for i in 0..3 {
                let (x, y) = data(i, 16, 20, 5);
                step.call(&[&x, &y])?;
            }
            assert_eq!(step.explain().graphs, 1, "the graph is still compiled and replayed");
        } else {
            for i in 0..3 {
                let (x, y) = data(i, 16, 20, 5);
                checked(&[x, y])?;
            }
        }
        model.parameters().iter().map(|p| p.to_vec::<f32>()).collect()
    };
    let (eager, compiled) = (run(false)?, run(true)?);
    for (e, c) in eager.iter().zip(&compiled) {
        assert_close("parameters after 3 steps", c, e, 1e-5);
    }
    Ok(())
}

/// F16 autocast with dynamic loss scaling: the forward and the scaled backward compiled, the
/// scaler's step and update outside. The first scale (2^24) overflows F16's gradients, so
/// the first steps are skipped and the scale backs off, then grows every four clean steps:
/// the compiled step must read each new scale (a baked one would keep every step skipped).
#[test]
fn compiled_f16_steps_read_the_grad_scalers_current_scale() -> Result<()> {
    use kiln::optim::{GradScaler, GradScalerConfig};
    let run = |compiled: bool| -> Result<(common::Run, Vec<bool>, f64, usize)> {
        kiln::tensor::rng::manual_seed(7);
        let model = mlp(&[20, 32, 5], Device::Cpu)?;
        let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })?;
        let cfg = GradScalerConfig { init_scale: 16777216.0, growth_interval: 4, ..GradScalerConfig::default() };
        let scaler = RefCell::new(GradScaler::new(Device::Cpu, cfg)?);
        let fwd_bwd = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let loss = {
                let _f16 = kiln::tensor::Autocast::new(DType::F16)?;
                cross_entropy(&model.forward(&xs[0])?, &xs[1])?
            };
            scaler.borrow().scale(&loss)?.backward()?;
            Ok(vec![loss])
        };
        let mut step = compile(Mode::Default, fwd_bwd);
        let (mut losses, mut taken) = (Vec::new(), Vec::new());
        for i in 0..24 {
            let (x, y) = data(i % 8, 16, 20, 5);
            let out = if compiled { step.call(&[&x, &y])? } else { fwd_bwd(&[x, y])? };
            losses.push(out[0].item()? as f32);
            taken.push(scaler.borrow_mut().step(&mut opt)?);
            scaler.borrow_mut().update()?;
            opt.zero_grad()?;
        }
        let params = model.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()?;
        let e = step.explain();
        assert!(e.graph_breaks.is_empty() && e.recompiles == 0, "one graph, no breaks: {e:?}");
        let scale = scaler.borrow().current_scale();
        Ok((common::Run { losses, params }, taken, scale, if compiled { e.graphs } else { 1 }))
    };
    let (eager, eager_taken, eager_scale, _) = run(false)?;
    let (compiled, taken, scale, graphs) = run(true)?;
    assert_eq!(graphs, 1);
    assert_eq!(taken, eager_taken, "the same steps skipped");
    assert!(!taken[0] && taken.iter().filter(|&&t| t).count() >= 10, "skipped at first, then taken: {taken:?}");
    assert_eq!(scale, eager_scale);
    assert_close("F16 losses", &compiled.losses, &eager.losses, 1e-3);
    for (i, (c, e)) in compiled.params.iter().zip(&eager.params).enumerate() {
        assert_close(&format!("param {i}"), c, e, 1e-3);
    }
    Ok(())
}

/// A small CNN (convolution with padding, ReLU, max pooling, a strided convolution, average
/// pooling, a linear head) trained with AdamW: the compiled step against eager.
#[test]
fn a_compiled_cnn_matches_eager() {
    let (eager, compiled) = (common::train_cnn(Device::Cpu, None, 12), common::train_cnn(Device::Cpu, Some(Mode::Default), 12));
    // Four batches in turn: their mean loss two rounds later is lower.
    let round = |r: usize| eager.losses[4 * r..4 * r + 4].iter().sum::<f32>();
    assert!(round(2) < round(0), "it trains: {:?}", eager.losses);
    common::assert_runs_agree("CNN", &compiled, &eager, (1e-5, 1e-5));
}

/// An LSTM (two layers, both directions, batch first) and a GRU classifier: the time loop
/// unrolls into one compiled graph whose training run matches eager, and the model learns.
#[test]
fn compiled_lstm_and_gru_classifiers_match_eager() {
    for lstm in [true, false] {
        let (eager, compiled) =
            (common::train_recurrent(Device::Cpu, None, 16, lstm), common::train_recurrent(Device::Cpu, Some(Mode::Default), 16, lstm));
        let round = |r: usize| eager.losses[4 * r..4 * r + 4].iter().sum::<f32>();
        assert!(round(3) < 0.95 * round(0), "it trains: {:?}", eager.losses);
        common::assert_runs_agree(if lstm { "LSTM" } else { "GRU" }, &compiled, &eager, (1e-5, 1e-5));
    }
}

/// 20 MLP steps (four batches in turn) with the optimizer `make` builds, eagerly or compiled.
fn mlp_run_with<O: Optimizer>(compiled: bool, seed: u64, make: impl Fn(Vec<Tensor>) -> Result<O>) -> Result<common::Run> {
    kiln::tensor::rng::manual_seed(seed);
    let model = mlp(&[20, 32, 5], Device::Cpu)?;
    let opt = RefCell::new(make(model.parameters())?);
    let f = mlp_step_unclipped(&model, &opt);
    let mut step = compile(Mode::Default, f);
    let mut losses = Vec::new();
    for i in 0..20 {
        let (x, y) = data(i % 4, 16, 20, 5);
        let out = if compiled { step.call(&[&x, &y])? } else { f(&[x, y])? };
        losses.push(out[0].item()? as f32);
    }
    let params = model.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()?;
    Ok(common::Run { losses, params })
}

/// AdamW with weight-decay groups (matrices decayed, biases not): the compiled step against
/// eager.
#[test]
fn compiled_adamw_with_weight_decay_groups_matches_eager() -> Result<()> {
    use kiln::optim::split_for_weight_decay;
    let make = |params: Vec<Tensor>| {
        let (decayed, rest) = split_for_weight_decay(params);
        AdamW::with_groups(vec![(decayed, 0.5), (rest, 0.0)], AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })
    };
    let (eager, compiled) = (mlp_run_with(false, 3, make)?, mlp_run_with(true, 3, make)?);
    common::assert_runs_agree("AdamW groups", &compiled, &eager, (1e-5, 1e-5));
    Ok(())
}

/// RMSprop (centred, with momentum and weight decay) compiled against eager.
#[test]
fn compiled_rmsprop_matches_eager() -> Result<()> {
    use kiln::optim::{RmsProp, RmsPropConfig};
    let cfg = RmsPropConfig { lr: 1e-3, momentum: 0.9, centered: true, weight_decay: 1e-2, ..RmsPropConfig::default() };
    let make = |params: Vec<Tensor>| RmsProp::new(params, cfg);
    let (eager, compiled) = (mlp_run_with(false, 4, make)?, mlp_run_with(true, 4, make)?);
    assert!(eager.losses[16..].iter().sum::<f32>() < eager.losses[..4].iter().sum::<f32>(), "it trains: {:?}", eager.losses);
    common::assert_runs_agree("RMSprop", &compiled, &eager, (1e-5, 1e-5));
    Ok(())
}

/// Adagrad (lr decay, a starting accumulator, weight decay) and Lion (decoupled weight decay)
/// compiled against eager: their step-count and lr tensors are read in the graph.
#[test]
fn compiled_adagrad_and_lion_match_eager() -> Result<()> {
    use kiln::optim::{Adagrad, AdagradConfig, Lion, LionConfig};
    let cfg = AdagradConfig { lr: 0.05, lr_decay: 0.1, weight_decay: 1e-2, initial_accumulator_value: 0.1, eps: 1e-10 };
    let make = |params: Vec<Tensor>| Adagrad::new(params, cfg);
    let (eager, compiled) = (mlp_run_with(false, 5, make)?, mlp_run_with(true, 5, make)?);
    assert!(eager.losses[16..].iter().sum::<f32>() < eager.losses[..4].iter().sum::<f32>(), "it trains: {:?}", eager.losses);
    common::assert_runs_agree("Adagrad", &compiled, &eager, (1e-5, 1e-5));
    let make = |params: Vec<Tensor>| Lion::new(params, LionConfig { lr: 3e-3, weight_decay: 0.1, ..LionConfig::default() });
    let (eager, compiled) = (mlp_run_with(false, 6, make)?, mlp_run_with(true, 6, make)?);
    assert!(eager.losses[16..].iter().sum::<f32>() < eager.losses[..4].iter().sum::<f32>(), "it trains: {:?}", eager.losses);
    common::assert_runs_agree("Lion", &compiled, &eager, (1e-5, 1e-5));
    Ok(())
}

/// `model.eval()` through a shared borrow while a compiled step holds the model: the step
/// traces again (dropout off, the eager eval output exactly), switching back replays the
/// training graph (no third trace), and grad mode keys the cache too.
#[test]
fn train_eval_switches_and_grad_mode_pick_their_own_compiled_graph() -> Result<()> {
    kiln::tensor::rng::manual_seed(3);
    let model = kiln::nn::Sequential::new().add(kiln::nn::Linear::new(6, 64, true, Device::Cpu)?).add(kiln::nn::Dropout::new(0.5));
    let x = Tensor::randn(&[4, 6], DType::F32, Device::Cpu)?;
    let mut step = compile(Mode::Default, |xs: &[Tensor]| Ok(vec![model.forward(&xs[0])?]));
    let plain = kiln::autograd::no_grad(|| model.layers[0].forward(&x))?.to_vec::<f32>()?;
    let zeros = |v: &[f32]| v.iter().filter(|&&a| a == 0.0).count();
    for _ in 0..2 {
        let train = step.call(&[&x])?[0].to_vec::<f32>()?;
        assert!((64..192).contains(&zeros(&train)), "dropout 0.5 zeroes about half of 256: {}", zeros(&train));
        for (t, p) in train.iter().zip(&plain).filter(|(t, _)| **t != 0.0) {
            assert!((t - 2.0 * p).abs() < 1e-5, "kept values are scaled by 2: {t} vs {p}");
        }
        model.eval();
        assert_eq!(step.call(&[&x])?[0].to_vec::<f32>()?, plain, "eval: no dropout");
        model.train();
    }
    assert_eq!(step.explain().graphs, 2, "train and eval graphs, each traced once");
    kiln::autograd::no_grad(|| step.call(&[&x]))?;
    assert_eq!(step.explain().graphs, 3, "no_grad traces its own graph");
    Ok(())
}

/// Adversarial training (FGSM): the input detached inside the step takes a gradient, which
/// perturbs it, and the model trains on the result. That leaf is the step's own: the graph is
/// traced once (it was retraced every call, its stale gradient failing the guard) and
/// matches eager.
#[test]
fn an_fgsm_step_with_an_input_gradient_compiles_once_and_matches_eager() -> Result<()> {
    let run = |compiled: bool| -> Result<common::Run> {
        kiln::tensor::rng::manual_seed(8);
        let model = mlp(&[20, 16, 5], Device::Cpu)?;
        let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })?);
        let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let x = xs[0].detach();
            x.set_requires_grad(true);
            cross_entropy(&model.forward(&x)?, &xs[1])?.backward()?;
            let adv = x.add(&x.grad().unwrap().sign()?.mul_scalar(0.05)?)?.detach();
            opt.borrow_mut().zero_grad()?;
            let loss = cross_entropy(&model.forward(&adv)?, &xs[1])?;
            loss.backward()?;
            opt.borrow_mut().step()?;
            opt.borrow_mut().zero_grad()?;
            Ok(vec![loss])
        };
        let mut step = compile(Mode::Default, f);
        let mut losses = Vec::new();
        for i in 0..8 {
            let (x, y) = data(i % 4, 16, 20, 5);
            losses.push(if compiled { step.call(&[&x, &y])? } else { f(&[x, y])? }[0].item()? as f32);
        }
        if compiled {
            assert_eq!(step.explain().graphs, 1, "{:?}", step.explain());
        }
        Ok(common::Run { losses, params: model.parameters().iter().map(|p| p.to_vec::<f32>()).collect::<Result<_>>()? })
    };
    common::assert_runs_agree("FGSM", &run(true)?, &run(false)?, (1e-5, 1e-5));
    Ok(())
}

/// sort and topk inside a compiled step: one graph whose values, positions and gradients
/// are eager's.
#[test]
fn sort_and_topk_compile_to_the_eager_values() -> Result<()> {
    let w = Tensor::rand_at(&[4, 9], Distribution::Normal, 29, 0, DType::F32, Device::Cpu)?;
    w.set_requires_grad(true);
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let x = xs[0].mul(&w)?;
        let (top, idx) = x.topk(3, 1usize, true)?;
        let (sorted, _) = x.sort(0usize, false)?;
        top.square()?.sum_all()?.add(&sorted.narrow(0usize, 0, 1)?.sum_all()?)?.backward()?;
        let g = w.grad().unwrap();
        w.set_grad(None);
        Ok(vec![top, idx, g])
    };
    let mut step = compile(Mode::Default, f);
    for seed in 0..3 {
        let x = Tensor::rand_at(&[4, 9], Distribution::Normal, 30 + seed, 0, DType::F32, Device::Cpu)?;
        let (got, want) = (step.call(&[&x])?, f(&[x])?);
        assert_eq!(got[1].to_vec::<i64>()?, want[1].to_vec::<i64>()?);
        assert_close("topk values", &got[0].to_vec::<f32>()?, &want[0].to_vec::<f32>()?, 1e-7);
        assert_close("gradient", &got[2].to_vec::<f32>()?, &want[2].to_vec::<f32>()?, 1e-6);
    }
    assert_eq!(step.explain().graphs, 1, "{:?}", step.explain());
    Ok(())
}

/// The composite ops (logsumexp, std, tril, flip, repeat, masked_fill) trace into a graph
/// (no graph break, no baked constants) that gives eager's values.
#[test]
fn composite_ops_compile_to_the_eager_values() -> Result<()> {
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let x = &xs[0];
        let m = x.tril(0)?.flip(&[1usize])?.repeat(&[1, 2])?;
        Ok(vec![x.logsumexp(&[1usize], false)?, x.std(&[0usize], true, 1)?, m.masked_fill(&m.lt_scalar(0.0)?, -1.0)?])
    };
    let mut step = compile(Mode::Default, f);
    for seed in 0..3 {
        let x = Tensor::rand_at(&[5, 6], Distribution::Normal, seed, 0, DType::F32, Device::Cpu)?;
        let (got, want) = (step.call(&[&x])?, f(&[x])?);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.shape(), w.shape());
            assert_close("composite", &g.to_vec::<f32>()?, &w.to_vec::<f32>()?, 1e-6);
        }
    }
    let e = step.explain();
    assert_eq!(e.graphs, 1);
    assert!(e.graph_breaks.is_empty(), "{:?}", e.graph_breaks);
    Ok(())
}

/// The seed's `nn.Transformer` forward on sequence-first input (`[T, B, E]`, whose products
/// fold the batch into the rows of one product or pack a permuted operand once), compiled
/// against eager, in eval mode, with and without masks' causal flag.
#[test]
fn compiled_sequence_first_transformer_forward_matches_eager() -> Result<()> {
    use kiln::nn::{Transformer, TransformerConfig, TransformerMasks};
    kiln::tensor::rng::manual_seed(11);
    let cfg = TransformerConfig {
        d_model: 32,
        nhead: 4,
        num_encoder_layers: 2,
        num_decoder_layers: 2,
        dim_feedforward: 64,
        ..TransformerConfig::default()
    };
    let model = Transformer::new(cfg, Device::Cpu)?;
    model.set_training(false);
    let src = Tensor::randn(&[10, 6, 32], DType::F32, Device::Cpu)?;
    let tgt = Tensor::randn(&[7, 6, 32], DType::F32, Device::Cpu)?;
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let _no_grad = NoGradGuard::new();
        Ok(vec![model.forward(&xs[0], &xs[1], &TransformerMasks::default())?])
    };
    let eager = f(&[src.clone(), tgt.clone()])?.remove(0);
    assert_eq!(eager.shape(), &[7, 6, 32]);
    let mut step = compile(Mode::Default, f);
    for _ in 0..2 {
        let got = step.call(&[&src, &tgt])?.remove(0);
        assert_close("transformer forward", &got.to_vec::<f32>()?, &eager.to_vec::<f32>()?, 1e-5);
    }
    Ok(())
}
