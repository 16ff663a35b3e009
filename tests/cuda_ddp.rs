//! Data-parallel training over NCCL on the GPU machine: a group of one rank (what a machine of
//! one GPU allows) through `Ddp` gives the plain run's parameters bit for bit after 50 steps,
//! eager and compiled in every mode, the compiled step still one graph (in `ReduceOverhead`
//! one CUDA graph replay, the all-reduces captured in it). Built only with `--features cuda`;
//! without a GPU or NCCL each test fails saying so.

mod common;

use common::{dp_gpt_run, Parallel};
use kiln::compile::Mode;
use kiln::distributed::{ProcessGroup, Reduction, DEFAULT_TIMEOUT};
use kiln::prelude::*;

fn gpu() -> Device {
    let d = Device::cuda_if_available(0);
    assert!(d.is_cuda(), "NO GPU: this CUDA test needs an NVIDIA GPU and driver (run it on the GPU machine)");
    d
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn one_rank_over_nccl_is_the_plain_run_bit_for_bit_in_every_mode() {
    let _s = SERIAL.lock();
    let dev = gpu();
    let pg = ProcessGroup::from_env(dev, DEFAULT_TIMEOUT).expect("an NCCL group of one rank");
    // Every mode runs; the ones that differ are named together at the end.
    let mut differ = Vec::new();
    for mode in [None, Some(Mode::Default), Some(Mode::ReduceOverhead), Some(Mode::MaxAutotune)] {
        let plain = dp_gpt_run(dev, None, Parallel::Plain, mode, 50, 5).unwrap();
        let ddp = dp_gpt_run(dev, Some(&pg), Parallel::Ddp, mode, 50, 5).unwrap();
        let step = plain.losses.iter().zip(&ddp.losses).position(|(a, b)| a.to_bits() != b.to_bits());
        let params: Vec<usize> = (0..plain.params.len()).filter(|&i| plain.params[i] != ddp.params[i]).collect();
        if step.is_none() && params.is_empty() {
            println!("{mode:?}: 50 steps, loss {} -> {}, parameters equal bit for bit", ddp.losses[0], ddp.losses[49]);
        } else {
            let again = dp_gpt_run(dev, None, Parallel::Plain, mode, 50, 5).unwrap();
            let repeats = again.losses == plain.losses && again.params == plain.params;
            // Which parameters part first: after 1, 2, 4 and 8 steps.
            let mut first = String::new();
            for n in [1u64, 2, 4, 8] {
                let p = dp_gpt_run(dev, None, Parallel::Plain, mode, n, 5).unwrap();
                let d = dp_gpt_run(dev, Some(&pg), Parallel::Ddp, mode, n, 5).unwrap();
                let apart: Vec<usize> = (0..p.params.len()).filter(|&i| p.params[i] != d.params[i]).collect();
                first += &format!(" after {n}: {apart:?};");
            }
            differ.push(format!(
                "{mode:?}: first loss apart at step {step:?}, parameters apart {params:?} (the plain run repeats itself: {repeats});{first}"
            ));
        }
    }
    assert!(differ.is_empty(), "one rank over NCCL against the plain run:\n{}", differ.join("\n"));
}

#[test]
fn nccl_collectives_of_one_rank_and_their_errors() {
    let _s = SERIAL.lock();
    let dev = gpu();
    let pg = ProcessGroup::from_env(dev, DEFAULT_TIMEOUT).unwrap();
    let x = Tensor::from_vec(vec![1.5f32, -2.0, 3.0, 0.25], &[4], Device::Cpu).unwrap().to_device(dev).unwrap();
    for r in [Reduction::Sum, Reduction::Mean, Reduction::Max, Reduction::Min] {
        assert_eq!(pg.all_reduce(&x, r).unwrap().to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.0, 0.25], "{r:?}");
    }
    let bf = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(
        pg.all_reduce(&bf, Reduction::Sum).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        vec![1.5, -2.0, 3.0, 0.25]
    );
    assert_eq!(pg.broadcast(&x, 0).unwrap().to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.0, 0.25]);
    assert_eq!(pg.all_gather(&x).unwrap().shape(), &[4]);
    // A strided view is sent as its elements in order.
    let t = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3], Device::Cpu).unwrap().to_device(dev).unwrap();
    let tt = t.transpose(0usize, 1usize).unwrap();
    assert_eq!(pg.all_reduce(&tt, Reduction::Sum).unwrap().to_vec::<f32>().unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    pg.barrier().unwrap();
    let cpu = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    let e = pg.all_reduce(&cpu, Reduction::Sum).unwrap_err().to_string();
    assert!(e.contains("Cpu") && e.contains("Cuda"), "{e}");
}

#[test]
fn zero1_of_one_rank_over_nccl_follows_the_plain_run() {
    let _s = SERIAL.lock();
    let dev = gpu();
    let pg = ProcessGroup::from_env(dev, DEFAULT_TIMEOUT).unwrap();
    for mode in [None, Some(Mode::ReduceOverhead)] {
        let plain = dp_gpt_run(dev, None, Parallel::Plain, mode, 50, 5).unwrap();
        let zero = dp_gpt_run(dev, Some(&pg), Parallel::Zero1, mode, 50, 5).unwrap();
        // Zero1 clips by a norm summed shard by shard, so the key biases (whose Adam steps
        // follow rounding noise: `drop_key_bias`) are left out of the comparison.
        let (zero_k, plain_k) = (common::drop_key_bias(&zero, 16), common::drop_key_bias(&plain, 16));
        common::assert_runs_agree(&format!("{mode:?}: zero1"), &zero_k, &plain_k, (1e-5, 1e-4));
        println!("{mode:?}: Zero1 50 steps, loss {} -> {}", zero.losses[0], zero.losses[49]);
    }
}
