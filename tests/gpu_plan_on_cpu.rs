//! The GPU's compile passes checked without a GPU: with `KILN_GPU_SOURCES` set, a step
//! compiled on the CPU goes through the passes a Hopper GPU gets (cuBLASLt epilogues, the
//! folds into layer norm's backward, zero-padded products, ...) and then runs on the CPU.
//! A GPT under BF16 autocast and in F32, trained that way, must match eager CPU training in
//! the same precision, and its graph must show the GPU's rewrites; where NVRTC is found, the
//! fused kernels the GPU would launch for both steps must compile. (What the CUDA kernels
//! compute is checked on the GPU by `cuda_compile` and `cuda_ops`.) Built only with
//! `--features cuda`.
#![cfg(feature = "cuda")]

use common::{assert_runs_agree, drop_key_bias, gpt_step, train_cnn, Run};
use kiln::compile::{compile, Mode};
use kiln::models::{Gpt, GptConfig};
use kiln::optim::{AdamConfig, AdamW};
use kiln::prelude::*;
use kiln::tensor::Distribution;
use std::cell::RefCell;

mod common;

/// `KILN_GPU_SOURCES` is the process's: one test at a time sets it.
static SOURCES_VAR: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Compiles a step's fused GPU kernels (`src`, as `KILN_GPU_SOURCES` wrote them) with NVRTC
/// for sm_90, or says it skipped where NVRTC is missing.
fn nvrtc_compiles(what: &str, src: &str) {
    assert!(src.contains("extern \"C\" __global__"), "the GPU's kernel sources for the {what} step were written");
    if kiln::tensor::cuda::nvrtc::available() {
        let src = kiln::tensor::cuda::kernels::prelude::waiting_for_prior(src);
        let arch = kiln::tensor::cuda::nvrtc::target(&src, (9, 0));
        if let Err(e) = kiln::tensor::cuda::nvrtc::compile(&src, "kiln_fused", &arch, true) {
            panic!("the {what} step's fused kernels do not compile: {e}");
        }
        println!("the {what} step's fused kernels compiled with NVRTC for {arch}");
    } else {
        println!("SKIPPED: no NVRTC here (libnvrtc.so.13), so the {what} step's fused kernels were not compiled");
    }
}

/// `steps` AdamW steps of a small GPT on the CPU, under autocast to `low` or in F32, 1024 rows
/// a batch (so that the head's 11-letter products are padded): eager, or compiled for a GPU's
/// passes (`gpu`). Returns the run and, compiled, the optimised graph.
fn train(gpu: bool, steps: u64, low: Option<DType>) -> (Run, String) {
    kiln::tensor::rng::manual_seed(11);
    let cfg = GptConfig::new(11, 8, 32, 2, 2);
    let model = Gpt::new(cfg, Device::Cpu).unwrap();
    let opt = RefCell::new(AdamW::new(model.parameters(), AdamConfig { lr: 3e-3, ..AdamConfig::adamw() }).unwrap());
    let step_fn = gpt_step(&model, &opt, low);
    let mut step = compile(Mode::Default, step_fn);
    let mut losses = Vec::new();
    for i in 0..steps {
        let tok = |s: u64| {
            let t = Tensor::rand_at(&[128, 8], Distribution::Uniform, s, i * 1024, DType::F32, Device::Cpu).unwrap();
            t.mul_scalar(11.0).unwrap().to_dtype(DType::I64).unwrap()
        };
        let (x, y) = (tok(1), tok(2));
        let out = if gpu { step.call(&[&x, &y]).unwrap() } else { step_fn(&[x, y]).unwrap() };
        losses.push(out[0].item().unwrap() as f32);
    }
    let graph = if gpu { step.dump().unwrap_or_default() } else { String::new() };
    (Run { losses, params: model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect() }, graph)
}

#[test]
fn a_gpt_compiled_with_the_gpu_passes_matches_eager_on_the_cpu_in_bf16_and_f32() {
    let _var = SOURCES_VAR.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("kiln-gpu-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("KILN_GPU_SOURCES", dir.join("step.cu"));
    let sources = || std::fs::read_to_string(dir.join("step.cu")).unwrap_or_default();
    let (eager, _) = train(false, 12, Some(DType::BF16));
    let (compiled, graph) = train(true, 12, Some(DType::BF16));
    let bf16_sources = sources();
    let (eager32, _) = train(false, 12, None);
    let (compiled32, graph32) = train(true, 12, None);
    let f32_sources = sources();
    std::env::remove_var("KILN_GPU_SOURCES");
    std::fs::remove_dir_all(&dir).ok();
    // The GPU's fused kernels for both steps, written, and compiled where NVRTC is (CI
    // installs it from pip for this test and `cuda_codegen`).
    for (what, src) in [("BF16", &bf16_sources), ("F32", &f32_sources)] {
        nvrtc_compiles(what, src);
    }
    // The GPU's rewrites are in the graph that ran.
    for (what, pattern) in [
        ("autocast's residual adds in the products' epilogue", "= matmul_residual"),
        ("the head's weight padded to 16 rows", "BF16[16, 32] = cat"),
        ("the logits' gradient padded to 16 columns", "BF16[1024, 16] = cat"),
        ("layer norm's backward with the residual gradient", "= layer_norm_grads_fused"),
        ("the proj and fc2 bias sums from layer norm's backward", "= layer_norm_grads_fused sums BF16"),
    ] {
        assert!(graph.contains(pattern), "{what}: no `{pattern}` in\n{graph}");
    }
    // Each layer's proj and fc2 biases (fc2's from the next layer norm's backward, the last
    // one's from the final layer norm's); x's gradient then moves from 64 to 128.
    assert_eq!(graph.matches("= layer_norm_grads_fused sums BF16").count(), 4, "{graph}");
    assert_eq!(graph32.matches("= layer_norm_grads_fused sums F32").count(), 4, "{graph32}");
    // The BF16 copies of the same four layer norms' dx, made by their backward.
    assert_eq!(graph.matches("= layer_norm_grads_fused sums BF16 copy BF16").count(), 4, "{graph}");
    // Each layer's GELU gradient with fc1's bias sums.
    assert_eq!((graph.matches("= gated_sums").count(), graph32.matches("= gated_sums").count()), (2, 2), "{graph}");
    assert_runs_agree(
        "GPU passes vs eager, BF16 autocast on the CPU",
        &drop_key_bias(&compiled, 32),
        &drop_key_bias(&eager, 32),
        (5e-4, 2e-2),
    );
    assert_runs_agree("GPU passes vs eager, F32 on the CPU", &compiled32, &eager32, (1e-5, 1e-4));
}

/// A dynamic GPT compiled with the GPU's passes: one source of fused kernels serves every
/// shape of two rows and more up to a pass's size limit (what a GPU builds once; a size of
/// one is a graph of its own), it compiles, and training matches eager at every shape.
#[test]
fn a_dynamic_gpt_with_the_gpu_passes_shares_its_kernels_between_shapes_and_matches_eager() {
    let _var = SOURCES_VAR.lock().unwrap_or_else(|e| e.into_inner());
    let path = std::env::temp_dir().join(format!("kiln-gpu-dynamic-{}.cu", std::process::id()));
    std::env::set_var("KILN_GPU_SOURCES", &path);
    let shapes = common::random_shapes(6, (2, 64), (8, 256));
    let always = kiln::compile::CompileOptions { dynamic: kiln::compile::Dynamic::Always, ..Default::default() };
    let mut sources: Vec<String> = Vec::new();
    let compiled = common::train_gpt_shapes(Device::Cpu, Some(always), &shapes, &mut || {
        let src = std::fs::read_to_string(&path).unwrap_or_default();
        // The first lines list the groups with their shapes; the kernels follow.
        sources.push(src.lines().filter(|l| !l.starts_with("//")).collect::<Vec<_>>().join("\n"));
    });
    std::env::remove_var("KILN_GPU_SOURCES");
    std::fs::remove_file(&path).ok();
    let eager = common::train_gpt_shapes(Device::Cpu, None, &shapes, &mut || {});
    assert_runs_agree("dynamic GPT with the GPU passes vs eager", &compiled.run, &eager.run, (1e-4, 1e-4));
    // One kernel set, and one more for the shapes past the one-launch mean cross-entropy's
    // size (`passes::loss`), which the larger batches here cross.
    sources.sort();
    sources.dedup();
    assert_eq!(sources.len(), 2, "kernel sets for shapes {shapes:?}");
    for src in &sources {
        assert!(src.contains("const long long z0"), "sizes as parameters");
        nvrtc_compiles("dynamic GPT", src);
    }
}

/// The small CNN (`common::train_cnn`: windows as views, max pooling by argmax and gather)
/// compiled with the GPU's passes matches eager on the CPU, and its fused kernels compile.
#[test]
fn a_cnn_compiled_with_the_gpu_passes_matches_eager_on_the_cpu() {
    let _var = SOURCES_VAR.lock().unwrap_or_else(|e| e.into_inner());
    let path = std::env::temp_dir().join(format!("kiln-gpu-plan-cnn-{}.cu", std::process::id()));
    std::env::set_var("KILN_GPU_SOURCES", &path);
    let compiled = train_cnn(Device::Cpu, Some(Mode::Default), 12);
    std::env::remove_var("KILN_GPU_SOURCES");
    let src = std::fs::read_to_string(&path).unwrap_or_default();
    std::fs::remove_file(&path).ok();
    nvrtc_compiles("CNN", &src);
    assert_runs_agree("GPU passes vs eager, the CNN on the CPU", &compiled, &train_cnn(Device::Cpu, None, 12), (1e-5, 1e-5));
}

/// The LSTM and GRU classifiers compiled with the GPU's passes match eager on the CPU, and
/// their fused kernels compile.
#[test]
fn recurrent_classifiers_compiled_with_the_gpu_passes_match_eager_on_the_cpu() {
    let _var = SOURCES_VAR.lock().unwrap_or_else(|e| e.into_inner());
    for lstm in [true, false] {
        let path = std::env::temp_dir().join(format!("kiln-gpu-plan-rnn{lstm}-{}.cu", std::process::id()));
        std::env::set_var("KILN_GPU_SOURCES", &path);
        let compiled = common::train_recurrent(Device::Cpu, Some(Mode::Default), 8, lstm);
        std::env::remove_var("KILN_GPU_SOURCES");
        let src = std::fs::read_to_string(&path).unwrap_or_default();
        std::fs::remove_file(&path).ok();
        nvrtc_compiles(if lstm { "LSTM" } else { "GRU" }, &src);
        assert_runs_agree(
            "GPU passes vs eager, recurrent on the CPU",
            &compiled,
            &common::train_recurrent(Device::Cpu, None, 8, lstm),
            (1e-5, 1e-5),
        );
    }
}
