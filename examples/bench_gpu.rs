//! The side-by-side benchmark's Kiln half: median step times of the comparison workloads
//! (MLP 784-256-10 with CE + AdamW at batch 32 and 4096, nn.Transformer(512, 8) forward on
//! (10, 32, 512), the GPT char-LM AdamW step in FP32, BF16 autocast and pure BF16, GPT-2
//! 124M and 350M steps in BF16 autocast with tokens/s and model FLOPs utilisation). Prints
//! one JSON line per workload; benches/pytorch/compare.py joins them with PyTorch's table.
//!
//!   cargo run --release --features cuda --example bench_gpu -- [--device cuda|cpu] [--only NAME] [--steps N]
//!       (`--only op_overhead` prints the host time per eager op; `--only transformer_step`
//!        the seed Transformer's training step, run on request only)
//!       [--modes eager,default,reduce-overhead,max-autotune]
//!       [--interleave]  (eager and the first compiled mode alternately, step by step; prints
//!                        the per-pair eager / compiled ratio: the fair comparison on a noisy host)
//!
//! Each compiled mode compiles the same step (`kiln::compile`); its first call is reported
//! as `compile_s` (trace, passes, NVRTC; `KILN_EXPLAIN=1` prints each step's `explain()`, with
//! the kernel times of one profiled step).
//!
//! Timing: warm-up steps, then each step is timed on the host with the device synchronised
//! before and after (so it is the step's full latency), and the median is reported.

mod common;

use common::{flag, has, opt};
use kiln::compile::{compile, compile_with, CompileOptions, Dynamic, Mode};
use kiln::models::{mlp, Gpt, GptConfig};
use kiln::nn::{cross_entropy, mse_loss, Reduction, Transformer, TransformerConfig, TransformerMasks};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW};
use kiln::prelude::*;
use kiln::tensor::{cuda, set_default_dtype, Distribution};
use std::time::Instant;

fn median_ms(dev: Device, warmup: usize, steps: usize, mut step: impl FnMut() -> Result<()>) -> Result<f64> {
    kiln::tensor::storage::reset_peak_bytes();
    for _ in 0..warmup {
        step()?;
    }
    kiln::tensor::profile::reset();
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        cuda::synchronize(dev)?;
        let t = Instant::now();
        step()?;
        cuda::synchronize(dev)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `a + b` on 16M contiguous floats: reads 2 x 64 MiB and writes 64 MiB.
fn elementwise(dev: Device, steps: usize) -> Result<f64> {
    let n = 1 << 24;
    let a = Tensor::rand_at(&[n], Distribution::Normal, 6, 0, DType::F32, dev)?;
    let b = Tensor::rand_at(&[n], Distribution::Normal, 7, 0, DType::F32, dev)?;
    median_ms(dev, 3, steps, || a.add(&b).map(|_| ()))
}

/// F32 products at the GPT's, the Transformer's and the MLP's shapes (`m k n` and layout:
/// `n` for a row-major operand, `t` for a transposed view), Kiln's Hopper GEMM
/// (`F32Gemm::Kiln`) against cuBLAS's, 20 products between synchronisations: one JSON line
/// each with both times and TFLOP/s (`--only gemm_f32`, CUDA only, not part of the table).
#[cfg(feature = "cuda")]
fn gemm_f32(dev: Device, steps: usize) -> Result<()> {
    use cuda::{set_f32_gemm, F32Gemm};
    let shapes: [(usize, usize, usize, &str); 14] = [
        (4096, 4096, 4096, "nt"),
        (16384, 384, 1152, "nt"),
        (16384, 384, 1536, "nt"),
        (16384, 1536, 384, "nt"),
        (16384, 384, 1536, "nn"),
        (16384, 1536, 384, "nn"),
        (384, 16384, 1536, "tn"),
        (320, 512, 1536, "nt"),
        (320, 512, 512, "nt"),
        (320, 512, 2048, "nt"),
        (320, 2048, 512, "nt"),
        (4096, 784, 256, "nt"),
        (4096, 256, 784, "nn"),
        (784, 4096, 256, "tn"),
    ];
    for (m, k, n, layout) in shapes {
        let t = |rows: usize, cols: usize, trans: bool, seed: u64| -> Result<Tensor> {
            let x = Tensor::rand_at(&if trans { [cols, rows] } else { [rows, cols] }, Distribution::Normal, seed, 0, DType::F32, dev)?;
            if trans {
                x.t()
            } else {
                Ok(x)
            }
        };
        let (a, b) = (t(m, k, layout.starts_with('t'), 11)?, t(k, n, layout.ends_with('t'), 12)?);
        // ||c - c64|| / ||c64|| against the F64 product of the same operands.
        let want = a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?.to_vec_f64()?;
        let error = |c: &Tensor| -> Result<f64> {
            let (mut num, mut den) = (0.0, 0.0);
            for (x, y) in c.to_vec_f64()?.iter().zip(&want) {
                num += (x - y) * (x - y);
                den += y * y;
            }
            Ok((num / den).sqrt())
        };
        let (mut us, mut err) = ([0.0; 2], [0.0; 2]);
        for (i, choice) in [F32Gemm::Cublas, F32Gemm::Kiln].into_iter().enumerate() {
            set_f32_gemm(choice);
            us[i] = median_ms(dev, 2, steps.min(20), || (0..20).try_for_each(|_| a.matmul(&b).map(|_| ())))? * 1e3 / 20.0;
            err[i] = error(&a.matmul(&b)?)?;
        }
        set_f32_gemm(F32Gemm::Auto);
        let tflops = |us: f64| 2.0 * (m * n * k) as f64 / us / 1e6;
        println!(
            "{{\"workload\": \"gemm_f32\", \"shape\": \"{m}x{k}x{n} {layout}\", \"cublas_us\": {:.1}, \"kiln_us\": {:.1}, \"cublas_tflops\": {:.1}, \"kiln_tflops\": {:.1}, \"speedup\": {:.2}, \"cublas_err\": {:.1e}, \"kiln_err\": {:.1e}}}",
            us[0],
            us[1],
            tflops(us[0]),
            tflops(us[1]),
            us[0] / us[1],
            err[0],
            err[1]
        );
    }
    Ok(())
}

/// Host time per eager op (printed to stderr, not part of the table): 2000 ops on
/// 1-element tensors queued without synchronising, so the device never holds the host back.
/// Contiguous adds, a broadcast add and a matmul, each with and without autograd recording.
fn host_overhead(dev: Device) -> Result<()> {
    let a = Tensor::rand_at(&[1, 8], Distribution::Normal, 8, 0, DType::F32, dev)?;
    let b = Tensor::rand_at(&[8], Distribution::Normal, 9, 0, DType::F32, dev)?;
    let w = Tensor::rand_at(&[8, 8], Distribution::Normal, 10, 0, DType::F32, dev)?;
    let ops: [(&str, &dyn Fn() -> Result<Tensor>); 3] =
        [("add", &|| a.add(&a)), ("broadcast add", &|| a.add(&b)), ("matmul", &|| a.matmul(&w))];
    for (name, op) in ops {
        for grad in [false, true] {
            a.set_requires_grad(grad);
            op()?;
            cuda::synchronize(dev)?;
            let t = Instant::now();
            for _ in 0..2000 {
                op()?;
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / 2000.0;
            cuda::synchronize(dev)?;
            eprintln!("host time per eager op: {name} (requires grad {grad}): {us:.2} us");
        }
    }
    a.set_requires_grad(false);
    Ok(())
}

/// What one run printed: median step, first-call time (trace + compile) for compiled modes.
struct Timing {
    ms: f64,
    compile_s: Option<f64>,
    /// Peak bytes of live tensors during the first call (trace, compile, first run).
    compile_peak: Option<u64>,
}

/// Times `f` eagerly (`mode` None) or compiled in `mode`; the first compiled call (trace,
/// passes, kernel compilation) is timed on its own as the compile time.
fn timed(
    dev: Device,
    mode: Option<Mode>,
    (warmup, steps): (usize, usize),
    xs: &[Tensor],
    mut f: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
) -> Result<Timing> {
    let Some(mode) = mode else {
        return Ok(Timing { ms: median_ms(dev, warmup, steps, || f(xs).map(drop))?, compile_s: None, compile_peak: None });
    };
    // `--dynamic`: every input dim dynamic from the first call (the cost of being dynamic).
    let dynamic = if has("--dynamic") { Dynamic::Always } else { Dynamic::Auto };
    let mut step = compile_with(CompileOptions { mode, dynamic, ..Default::default() }, f);
    let refs: Vec<&Tensor> = xs.iter().collect();
    cuda::synchronize(dev)?;
    kiln::tensor::storage::reset_peak_bytes();
    let t = Instant::now();
    step.call(&refs)?;
    cuda::synchronize(dev)?;
    let compile_s = t.elapsed().as_secs_f64();
    let compile_peak = kiln::tensor::storage::peak_bytes();
    let ms = median_ms(dev, warmup, steps, || step.call(&refs).map(drop))?;
    if std::env::var("KILN_EXPLAIN").is_ok() {
        step.call_profiled(&refs)?;
        eprintln!("{}", step.explain());
    }
    let sweep = flag("--sweep", 0);
    if sweep > 0 {
        batch_sweep(dev, &mut |ins: &[&Tensor]| step.call(ins), xs, sweep)?;
        let e = step.explain();
        println!("{{\"sweep\": {sweep}, \"graphs\": {}, \"shapes_traced\": {}}}", e.graphs, e.shapes_traced);
    }
    Ok(Timing { ms, compile_s: Some(compile_s), compile_peak: Some(compile_peak) })
}

/// `--sweep N`: `n` calls on the first `b` rows of every input, `b` drawn from 1..=batch in a
/// fixed order (the shapes a last partial batch or a varying batch size makes); prints the
/// wall time of all of them and of the calls after the first of each size.
fn batch_sweep(dev: Device, call: &mut dyn FnMut(&[&Tensor]) -> Result<Vec<Tensor>>, xs: &[Tensor], n: usize) -> Result<()> {
    let full = xs[0].shape()[0];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let (mut seen, mut total, mut again) = (Vec::new(), 0.0, 0.0);
    for _ in 0..n {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let b = 1 + (state >> 33) as usize % full;
        let part: Vec<Tensor> = xs.iter().map(|x| x.narrow(0, 0, b)?.contiguous()).collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = part.iter().collect();
        cuda::synchronize(dev)?;
        let t = Instant::now();
        call(&refs)?;
        cuda::synchronize(dev)?;
        let s = t.elapsed().as_secs_f64();
        total += s;
        if seen.contains(&b) {
            again += s;
        }
        seen.push(b);
    }
    seen.sort_unstable();
    seen.dedup();
    eprintln!("sweep: {n} calls over {} batch sizes in {total:.2} s ({again:.3} s in the calls of a size seen before)", seen.len());
    Ok(())
}

fn report(workload: &str, precision: &str, mode: Option<Mode>, t: Timing, dev: Device) {
    report_with(workload, precision, mode, t, dev, "")
}

/// `report` with more JSON fields (`extra`: `, "name": value` pairs).
fn report_with(workload: &str, precision: &str, mode: Option<Mode>, t: Timing, dev: Device, extra: &str) {
    if kiln::tensor::profile::enabled() {
        eprintln!("--- {workload}: per-op device time over the timed steps (KILN_PROFILE)\n{}", kiln::tensor::profile::report());
        kiln::tensor::profile::reset();
    }
    let peak = kiln::tensor::storage::peak_bytes() as f64 / 1048576.0;
    let imp = match mode {
        None => "kiln eager".to_string(),
        Some(m) => format!("kiln {}{}", mode_name(m), if has("--dynamic") { " dynamic" } else { "" }),
    };
    let mut compile = t.compile_s.map(|c| format!(", \"compile_s\": {c:.3}")).unwrap_or_default();
    if let Some(p) = t.compile_peak {
        compile += &format!(", \"compile_peak_mib\": {:.1}", p as f64 / 1048576.0);
    }
    println!(
        "{{\"workload\": \"{workload}\", \"impl\": \"{imp}\", \"precision\": \"{precision}\", \"median_ms\": {:.4}, \"device\": \"{dev}\", \"peak_mib\": {peak:.1}{compile}{extra}}}",
        t.ms
    );
}

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Default => "default",
        Mode::ReduceOverhead => "reduce-overhead",
        Mode::MaxAutotune => "max-autotune",
    }
}

/// A workload: its inputs and its step, which owns its model and optimizer.
type Workload = (Vec<Tensor>, Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>>);
/// Builds a fresh copy of a workload (same seed each time).
type MakeWorkload<'a> = &'a dyn Fn() -> Result<Workload>;

fn mlp_workload(dev: Device, batch: usize) -> Result<Workload> {
    kiln::tensor::rng::manual_seed(0);
    let model = mlp(&[784, 256, 10], dev)?;
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-3, ..AdamConfig::adamw() })?;
    let x = Tensor::rand_at(&[batch, 784], Distribution::Normal, 1, 0, DType::F32, dev)?;
    let y = Tensor::rand_at(&[batch], Distribution::Uniform, 2, 0, DType::F32, dev)?.mul_scalar(10.0)?.to_dtype(DType::I64)?;
    let step = move |xs: &[Tensor]| {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    Ok((vec![x, y], Box::new(step)))
}

fn transformer_workload(dev: Device) -> Result<Workload> {
    kiln::tensor::rng::manual_seed(0);
    let model = Transformer::new(TransformerConfig { d_model: 512, nhead: 8, ..TransformerConfig::default() }, dev)?;
    model.set_training(false);
    let x = Tensor::rand_at(&[10, 32, 512], Distribution::Normal, 3, 0, DType::F32, dev)?;
    let step = move |xs: &[Tensor]| {
        let _no_grad = NoGradGuard::new();
        Ok(vec![model.forward(&xs[0], &xs[0], &TransformerMasks::default())?])
    };
    Ok((vec![x], Box::new(step)))
}

/// The seed's Transformer as a training step (dropout off): MSE of its output against a
/// target, backward, AdamW, as `benches/pytorch/cpu_train_step.py`'s `transformer_step`.
fn transformer_step_workload(dev: Device) -> Result<Workload> {
    kiln::tensor::rng::manual_seed(0);
    let model = Transformer::new(TransformerConfig { d_model: 512, nhead: 8, dropout: 0.0, ..TransformerConfig::default() }, dev)?;
    let mut opt = AdamW::new(model.parameters(), AdamConfig::adamw())?;
    let x = Tensor::rand_at(&[10, 32, 512], Distribution::Normal, 3, 0, DType::F32, dev)?;
    let y = Tensor::rand_at(&[10, 32, 512], Distribution::Normal, 4, 0, DType::F32, dev)?;
    let step = move |xs: &[Tensor]| {
        let loss = mse_loss(&model.forward(&xs[0], &xs[0], &TransformerMasks::default())?, &xs[1], Reduction::Mean)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    Ok((vec![x, y], Box::new(step)))
}

/// The GPT step: the GPU benchmark's model (batch 64), or with `small` the CPU criterion
/// bench's (`benches/train_step.rs`: context 64, 4 layers, d_model 128, batch 16).
fn gpt_workload(dev: Device, dtype: DType, small: bool) -> Result<Workload> {
    kiln::tensor::rng::manual_seed(0);
    set_default_dtype(dtype);
    let cfg = if small { GptConfig::new(65, 64, 128, 4, 4) } else { GptConfig::new(65, 256, 384, 6, 6) };
    let batch = if small { 16 } else { 64 };
    let model = Gpt::new(cfg, dev)?;
    set_default_dtype(DType::F32);
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 3e-4, ..AdamConfig::adamw() })?;
    let tok = |s| -> Result<Tensor> {
        Tensor::rand_at(&[batch, cfg.context], Distribution::Uniform, s, 0, DType::F32, dev)?.mul_scalar(65.0)?.to_dtype(DType::I64)
    };
    let step = move |xs: &[Tensor]| {
        let loss = model.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    Ok((vec![tok(4)?, tok(5)?], Box::new(step)))
}

/// GPT-2 shapes as nanoGPT trains them (vocab padded to 50304, context 1024, tied head):
/// (name, d_model, layers, heads, batch).
const GPT2: [(&str, usize, usize, usize, usize); 2] = [("gpt2_124m", 768, 12, 12, 8), ("gpt2_350m", 1024, 24, 16, 4)];

/// A GPT-2 step's FLOPs per token (`common::train_flops_per_token`; vocabulary 50304,
/// context 1024, tied head).
fn gpt2_flops_per_token(d: usize, layers: usize) -> f64 {
    common::train_flops_per_token(50304 * d + layers * (12 * d * d + 13 * d) + 2 * d, layers, d, 1024)
}

/// A GPT-2 training step: BF16 autocast is the caller's; AdamW (weight decay 0.1) after
/// `clip_grad_norm(1.0)`, as `benches/pytorch/gpu_bench.py`'s `gpt2_step`.
fn gpt2_workload(dev: Device, d_model: usize, n_layer: usize, n_head: usize, batch: usize) -> Result<Workload> {
    kiln::tensor::rng::manual_seed(0);
    let cfg = GptConfig { tied_head: true, ..GptConfig::new(50304, 1024, d_model, n_layer, n_head) };
    let model = Gpt::new(cfg, dev)?;
    let params = model.parameters();
    let mut opt = AdamW::new(params.clone(), AdamConfig { lr: 6e-4, weight_decay: 0.1, ..AdamConfig::adamw() })?;
    let tok = |s| -> Result<Tensor> {
        Tensor::rand_at(&[batch, 1024], Distribution::Uniform, s, 0, DType::F32, dev)?.mul_scalar(50257.0)?.to_dtype(DType::I64)
    };
    let step = move |xs: &[Tensor]| {
        let loss = model.loss(&xs[0], &xs[1])?;
        loss.backward()?;
        clip_grad_norm(&params, 1.0)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![loss])
    };
    Ok((vec![tok(4)?, tok(5)?], Box::new(step)))
}

/// Eager and `mode` steps of two copies of a workload (same seed) alternately, the order
/// swapped every pair, so that the machine's drift lands on both: prints the medians and
/// the median eager / compiled ratio of the pairs with its 10th and 90th percentiles.
fn interleaved(dev: Device, name: &str, mode: Mode, (warmup, steps): (usize, usize), make: impl Fn() -> Result<Workload>) -> Result<()> {
    let (xs, mut eager) = make()?;
    let (cx, f) = make()?;
    let mut compiled = compile(mode, f);
    let refs: Vec<&Tensor> = cx.iter().collect();
    let mut time = |compiled_step: bool| -> Result<f64> {
        cuda::synchronize(dev)?;
        let t = Instant::now();
        if compiled_step {
            compiled.call(&refs)?;
        } else {
            eager(&xs)?;
        }
        cuda::synchronize(dev)?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    for i in 0..=warmup {
        time(i % 2 == 0)?;
        time(i % 2 == 1)?;
    }
    let (mut e, mut c, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..steps {
        let first = i % 2 == 0;
        let a = time(first)?;
        let b = time(!first)?;
        let (te, tc) = if first { (b, a) } else { (a, b) };
        e.push(te);
        c.push(tc);
        ratio.push(te / tc);
    }
    let q = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    let (me, mc) = (q(&mut e, 0.5), q(&mut c, 0.5));
    let (r10, r50, r90) = (q(&mut ratio, 0.1), q(&mut ratio, 0.5), q(&mut ratio, 0.9));
    eprintln!("{name}: eager {me:.3} ms, {} {mc:.3} ms; eager / compiled per pair: median {r50:.3}x (p10 {r10:.3}, p90 {r90:.3}) over {steps} pairs", mode_name(mode));
    println!(
        "{{\"workload\": \"{name}\", \"impl\": \"kiln eager vs {}, interleaved\", \"eager_ms\": {me:.4}, \"compiled_ms\": {mc:.4}, \"ratio_median\": {r50:.4}, \"ratio_p10\": {r10:.4}, \"ratio_p90\": {r90:.4}, \"device\": \"{dev}\"}}",
        mode_name(mode)
    );
    Ok(())
}

fn main() -> Result<()> {
    let dev = match opt("--device").as_deref() {
        Some("cpu") => Device::Cpu,
        Some(_) | None => Device::cuda_if_available(0),
    };
    let only = opt("--only");
    let modes: Vec<Option<Mode>> = opt("--modes")
        .unwrap_or_else(|| "eager,default,reduce-overhead".into())
        .split(',')
        .map(|m| match m.trim() {
            "default" => Some(Mode::Default),
            "reduce-overhead" => Some(Mode::ReduceOverhead),
            "max-autotune" => Some(Mode::MaxAutotune),
            _ => None,
        })
        .collect();
    let steps: usize = flag("--steps", 50);
    let want = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    // The timed steps repeat one batch thousands of times; as the model memorises it the
    // gradients underflow into subnormals, which would time the CPU's microcode instead.
    let flush = dev == Device::Cpu && kiln::tensor::set_flush_denormal(true);
    eprintln!(
        "kiln bench on {dev} ({steps} timed steps each; TF32 {}{})",
        if cfg!(feature = "cuda") { "off" } else { "n/a" },
        if flush { "; subnormals flushed" } else { "" }
    );
    if want("add_16M") {
        let ms = elementwise(dev, steps)?;
        report("add_16M", "fp32", None, Timing { ms, compile_s: None, compile_peak: None }, dev);
        eprintln!("add_16M: {:.0} GB/s", 3.0 * 4.0 * (1u64 << 24) as f64 / (ms * 1e-3) / 1e9);
    }
    if want("op_overhead") {
        host_overhead(dev)?;
    }
    #[cfg(feature = "cuda")]
    if only.as_deref().is_some_and(|o| "gemm_f32".contains(o)) && dev.is_cuda() {
        gemm_f32(dev, steps)?;
    }
    // The CPU criterion bench's other workloads run on request only.
    let asked = |name: &str| only.as_deref().is_some_and(|o| name.contains(o));
    if has("--interleave") {
        let mode = modes.iter().flatten().next().copied().unwrap_or(Mode::Default);
        let ws: [(&str, bool, usize, MakeWorkload); 7] = [
            ("mlp_b32", want("mlp_b32"), steps * 4, &|| mlp_workload(dev, 32)),
            ("mlp_b1024", asked("mlp_b1024"), steps, &|| mlp_workload(dev, 1024)),
            ("mlp_b4096", want("mlp_b4096"), steps * 2, &|| mlp_workload(dev, 4096)),
            ("gpt_small", asked("gpt_small"), steps, &|| gpt_workload(dev, DType::F32, true)),
            ("transformer_fwd", asked("transformer_fwd"), steps, &|| transformer_workload(dev)),
            ("transformer_step", asked("transformer_step"), steps.min(10), &|| transformer_step_workload(dev)),
            ("gpt_fp32", want("gpt_fp32"), steps.min(20), &|| gpt_workload(dev, DType::F32, false)),
        ];
        for (name, run, n, make) in ws {
            if run {
                interleaved(dev, name, mode, (3, n), make)?;
            }
        }
        return Ok(());
    }
    for &mode in &modes {
        let run = |make: Result<Workload>, warmup: usize, n: usize| -> Result<Timing> {
            let (xs, f) = make?;
            timed(dev, mode, (warmup, n), &xs, f)
        };
        if want("mlp_b32") {
            report("mlp_b32", "fp32", mode, run(mlp_workload(dev, 32), 10, steps * 4)?, dev);
        }
        if want("mlp_b4096") {
            report("mlp_b4096", "fp32", mode, run(mlp_workload(dev, 4096), 10, steps * 2)?, dev);
        }
        if asked("mlp_b1024") {
            report("mlp_b1024", "fp32", mode, run(mlp_workload(dev, 1024), 10, steps)?, dev);
        }
        if asked("gpt_small") {
            report("gpt_small", "fp32", mode, run(gpt_workload(dev, DType::F32, true), 3, steps)?, dev);
        }
        if want("transformer_fwd") {
            report("transformer_fwd", "fp32", mode, run(transformer_workload(dev), 3, steps)?, dev);
        }
        if asked("transformer_step") {
            report("transformer_step", "fp32", mode, run(transformer_step_workload(dev), 2, steps.min(10))?, dev);
        }
        if want("gpt_fp32") {
            report("gpt_fp32", "fp32", mode, run(gpt_workload(dev, DType::F32, false), 3, steps.min(20))?, dev);
        }
        if want("gpt_bf16") {
            // Like torch.autocast: F32 parameters, BF16 products.
            let _ac = kiln::tensor::Autocast::new(DType::BF16)?;
            report("gpt_bf16", "bf16 autocast", mode, run(gpt_workload(dev, DType::F32, false), 3, steps.min(20))?, dev);
        }
        if want("gpt_pure_bf16") {
            report("gpt_pure_bf16", "bf16 (params and compute)", mode, run(gpt_workload(dev, DType::BF16, false), 3, steps.min(20))?, dev);
        }
        for (name, d, layers, heads, batch) in GPT2 {
            if want(name) && dev.is_cuda() {
                let _ac = kiln::tensor::Autocast::new(DType::BF16)?;
                let t = run(gpt2_workload(dev, d, layers, heads, batch), 3, steps.min(20))?;
                let tokens = (batch * 1024) as f64 / (t.ms * 1e-3);
                let mfu = tokens * gpt2_flops_per_token(d, layers) / common::PEAK_BF16_FLOPS;
                report_with(name, "bf16 autocast", mode, t, dev, &format!(", \"tokens_per_s\": {tokens:.0}, \"mfu\": {mfu:.4}"));
            }
        }
    }
    Ok(())
}
