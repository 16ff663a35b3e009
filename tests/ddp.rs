//! Data-parallel training on the CPU, ranks as threads (`ProcessGroup::threads`): one rank
//! through Ddp is the plain run bit for bit (eager and compiled); two ranks on half batches
//! follow the one-rank run on whole batches; a rank that leaves ends the others' step.

mod common;

use common::{assert_runs_agree, dp_gpt_run, Parallel, Run};
use kiln::compile::Mode;
use kiln::distributed::{Ddp, DdpOptions, ProcessGroup, Reduction};
use kiln::nn::Linear;
use kiln::optim::{AdamConfig, AdamW, Optimizer};
use kiln::prelude::*;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

/// `f(rank's group)` on one thread per rank; results in rank order.
fn on_ranks<R: Send>(world: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    let groups = ProcessGroup::threads(world, LONG).unwrap();
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.into_iter().map(|pg| s.spawn(move || f(pg))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn same_bits(what: &str, a: &Run, b: &Run) {
    assert_eq!(a.losses, b.losses, "{what}: losses");
    assert_eq!(a.params, b.params, "{what}: parameters");
}

#[test]
fn one_rank_through_ddp_is_the_plain_run_bit_for_bit() {
    for mode in [None, Some(Mode::Default), Some(Mode::ReduceOverhead)] {
        let plain = dp_gpt_run(Device::Cpu, None, Parallel::Plain, mode, 50, 5).unwrap();
        let pg = ProcessGroup::threads(1, LONG).unwrap().remove(0);
        let ddp = dp_gpt_run(Device::Cpu, Some(&pg), Parallel::Ddp, mode, 50, 5).unwrap();
        same_bits(&format!("{mode:?}"), &plain, &ddp);
    }
}

#[test]
fn two_ranks_on_half_batches_follow_one_rank_on_whole_batches() {
    for mode in [None, Some(Mode::Default)] {
        let whole = dp_gpt_run(Device::Cpu, None, Parallel::Plain, mode, 12, 5).unwrap();
        // Rank 1 starts from other weights: Ddp copies rank 0's.
        let runs = on_ranks(2, |pg| dp_gpt_run(Device::Cpu, Some(&pg), Parallel::Ddp, mode, 12, 5 + pg.rank() as u64).unwrap());
        assert_eq!(runs[0].params, runs[1].params, "{mode:?}: the ranks hold the same parameters");
        // Each rank's loss is its half's; their mean is the whole batch's loss.
        let mean = Run {
            losses: runs[0].losses.iter().zip(&runs[1].losses).map(|(a, b)| (a + b) / 2.0).collect(),
            params: runs[0].params.clone(),
        };
        assert_runs_agree(&format!("{mode:?}"), &mean, &whole, (1e-5, 1e-4));
    }
}

#[test]
fn collectives_average_and_broadcast_between_ranks() {
    let out = on_ranks(3, |pg| {
        let x = Tensor::from_vec(vec![pg.rank() as f32, 1.0], &[2], Device::Cpu).unwrap();
        let mean = pg.all_reduce(&x, Reduction::Mean).unwrap().to_vec::<f32>().unwrap();
        pg.broadcast_(&x, 2).unwrap();
        pg.barrier().unwrap();
        (mean, x.to_vec::<f32>().unwrap())
    });
    for (mean, x) in out {
        assert_eq!(mean, vec![1.0, 1.0]);
        assert_eq!(x, vec![2.0, 1.0]);
    }
}

fn linear_pair(seed: u64) -> (Linear, Linear) {
    let _lock = common::SEEDED.lock();
    kiln::tensor::rng::manual_seed(seed);
    (Linear::new(3, 2, true, Device::Cpu).unwrap(), Linear::new(3, 2, true, Device::Cpu).unwrap())
}

#[test]
fn no_sync_keeps_gradients_local_until_a_synced_step() {
    let out = on_ranks(2, |pg| {
        let (lin, _) = linear_pair(1);
        let ddp = Ddp::new(&lin, &pg, DdpOptions::default()).unwrap();
        let x = Tensor::full((pg.rank() + 1) as f64, &[1, 3], DType::F32, Device::Cpu).unwrap();
        ddp.no_sync(|| {
            lin.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
            ddp.sync_gradients().unwrap();
        });
        let local = lin.weight.grad().unwrap().to_vec::<f32>().unwrap();
        ddp.sync_gradients().unwrap();
        (local, lin.weight.grad().unwrap().to_vec::<f32>().unwrap())
    });
    // d sum(x W^T + b) / dW = x per output row: rank 0's x is 1, rank 1's is 2.
    assert_eq!(out[0].0, vec![1.0; 6]);
    assert_eq!(out[1].0, vec![2.0; 6]);
    assert_eq!(out[0].1, vec![1.5; 6]);
    assert_eq!(out[1].1, vec![1.5; 6]);
}

/// Two layers, the second unused by the loss.
#[derive(kiln::nn::Module)]
struct TwoHeads {
    used: Linear,
    unused: Linear,
}

#[test]
fn an_unused_parameter_is_named_unless_it_is_allowed() {
    let out = on_ranks(2, |pg| {
        let (used, unused) = linear_pair(2);
        let m = TwoHeads { used, unused };
        let x = Tensor::ones(&[1, 3], DType::F32, Device::Cpu).unwrap();
        let strict = Ddp::new(&m, &pg, DdpOptions { bucket_cap_mb: 0.0, first_bucket_mb: 0.0, ..DdpOptions::default() }).unwrap();
        m.used.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
        let err = strict.sync_gradients().unwrap_err().to_string();
        let lenient = Ddp::new(&m, &pg, DdpOptions { find_unused_parameters: true, ..DdpOptions::default() }).unwrap();
        lenient.sync_gradients().unwrap();
        (err, m.unused.weight.grad().unwrap().to_vec::<f32>().unwrap())
    });
    for (err, unused_grad) in out {
        assert!(err.contains("'unused.bias' has no gradient") && err.contains("find_unused_parameters"), "{err}");
        assert_eq!(unused_grad, vec![0.0; 6]);
    }
}

#[test]
fn a_rank_that_leaves_mid_run_ends_the_others_step_with_an_error() {
    let out = on_ranks(2, |pg| -> Result<usize> {
        let (lin, _) = linear_pair(3);
        let ddp = Ddp::new(&lin, &pg, DdpOptions::default()).unwrap();
        let x = Tensor::ones(&[2, 3], DType::F32, Device::Cpu).unwrap();
        for step in 0..5 {
            if pg.rank() == 1 && step == 2 {
                return Ok(step); // drops its group: the failure of a rank
            }
            lin.forward(&x)?.sum_all()?.backward()?;
            ddp.sync_gradients()?;
            lin.weight.set_grad(None);
            lin.bias.as_ref().unwrap().set_grad(None);
        }
        Ok(5)
    });
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 1 left the group"), "{e}");
    assert_eq!(out[1].as_ref().ok(), Some(&2));
}

#[test]
fn the_bucket_plan_is_explained() {
    let (lin, _) = linear_pair(4);
    let pg = ProcessGroup::threads(1, LONG).unwrap().remove(0);
    let ddp = Ddp::new(&lin, &pg, DdpOptions::default()).unwrap();
    // Reverse order: the bias first; 32 bytes in one bucket under the first 1 MiB cap.
    assert_eq!(ddp.buckets().len(), 1);
    assert_eq!(ddp.buckets()[0].params, vec![1, 0]);
    assert!(ddp.explain().contains("bucket 0: 2 params, 0.00 MiB F32, bias .. weight"), "{}", ddp.explain());
}

#[test]
fn zero1_follows_ddp_with_the_optimizer_state_split_over_the_ranks() {
    for mode in [None, Some(Mode::Default)] {
        let ddp = on_ranks(2, |pg| dp_gpt_run(Device::Cpu, Some(&pg), Parallel::Ddp, mode, 12, 5).unwrap());
        let zero = on_ranks(2, |pg| dp_gpt_run(Device::Cpu, Some(&pg), Parallel::Zero1, mode, 12, 5 + pg.rank() as u64).unwrap());
        assert_eq!(zero[0].params, zero[1].params, "{mode:?}: the ranks gathered the same parameters");
        assert_runs_agree(&format!("{mode:?}: zero1 vs ddp"), &zero[0], &ddp[0], (1e-5, 1e-4));
    }
    // Each rank keeps AdamW's moments for half of the bucket of a Linear(3, 2): its 3 * 2 + 2
    // elements in two slots of 64 floats (`Bucket::slots`).
    let sizes = on_ranks(2, |pg| {
        let (lin, _) = linear_pair(6);
        let zero = kiln::distributed::Zero1::new(&lin, &pg, None, |p| AdamW::new(p, AdamConfig::adamw())).unwrap();
        zero.inner().params().iter().map(|p| p.numel()).collect::<Vec<_>>()
    });
    assert_eq!(sizes, vec![vec![64], vec![64]]);
}

/// A data-parallel GPT run from `seed` on `pg`: steps `from..to` (eager), rank 0 saving a
/// checkpoint to `save` after step `save_at`; with `resume`, loaded from it first.
fn checkpointed_run(
    pg: &ProcessGroup,
    seed: u64,
    steps: std::ops::Range<u64>,
    save: (&std::path::Path, u64),
    resume: bool,
) -> Vec<Vec<f32>> {
    use kiln::models::{Gpt, GptConfig};
    let model = {
        let _lock = common::SEEDED.lock();
        kiln::tensor::rng::manual_seed(seed);
        Gpt::new(GptConfig::new(13, 8, 16, 2, 2), Device::Cpu).unwrap()
    };
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap();
    if resume {
        assert_eq!(kiln::checkpoint::load(save.0, &model, &mut opt, None).unwrap().step, save.1);
    }
    let ddp = Ddp::new(&model, pg, DdpOptions::default()).unwrap();
    for i in steps {
        if i == save.1 && !resume {
            if pg.rank() == 0 {
                kiln::checkpoint::save(save.0, &model, &opt, None, i).unwrap();
            }
            pg.barrier().unwrap();
        }
        let (x, y) = common::ddp_batch(i, pg.rank(), pg.world_size(), Device::Cpu).unwrap();
        model.loss(&x, &y).unwrap().backward().unwrap();
        ddp.sync_gradients().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

#[test]
fn rank_0_s_checkpoint_resumes_every_rank_to_the_same_run() {
    let dir = std::env::temp_dir().join(format!("kiln-ddp-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("step4.kiln");
    let straight = on_ranks(2, |pg| checkpointed_run(&pg, 5 + pg.rank() as u64, 0..8, (&path, 4), false));
    // Fresh ranks from other weights: every rank loads rank 0's file and goes on.
    let resumed = on_ranks(2, |pg| checkpointed_run(&pg, 70 + pg.rank() as u64, 4..8, (&path, 4), true));
    assert_eq!(straight[0], straight[1]);
    assert_eq!(resumed[0], straight[0], "rank 0 resumed bit for bit");
    assert_eq!(resumed[1], straight[1], "rank 1 resumed bit for bit");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn explain_lists_the_bucket_all_reduces_of_a_compiled_step() {
    let (lin, _) = linear_pair(8);
    let pg = ProcessGroup::threads(1, LONG).unwrap().remove(0);
    let ddp = Ddp::new(&lin, &pg, DdpOptions::default()).unwrap();
    let mut opt = AdamW::new(lin.parameters(), AdamConfig::adamw()).unwrap();
    let mut step = kiln::compile::compile_step(Mode::Default, |o: &mut AdamW, xs: &[Tensor]| {
        let loss = lin.forward(&xs[0])?.sum_all()?;
        loss.backward()?;
        ddp.sync_gradients()?;
        o.step()?;
        o.zero_grad()?;
        Ok(vec![loss])
    });
    let x = Tensor::ones(&[4, 3], DType::F32, Device::Cpu).unwrap();
    for _ in 0..2 {
        step.call(&mut opt, &[&x]).unwrap();
    }
    let e = step.explain();
    assert_eq!(e.collectives.len(), 1, "{e}");
    // The bucket: bias (2) then weight (6), each in a slot of 256 bytes, one flat all-reduce.
    assert!(e.collectives[0].starts_with("all_reduce [128] F32 over 1 ranks at node "), "{e}");
    assert!(e.to_string().contains("collectives: 1"), "{e}");
}

/// Two layers in a row.
#[derive(kiln::nn::Module)]
struct TwoLayers {
    fc1: Linear,
    fc2: Linear,
}

#[test]
fn buckets_start_during_the_backward_as_their_gradients_come_in() {
    use std::sync::{Arc, Mutex, OnceLock, Weak};
    let out = on_ranks(2, |pg| {
        let m = {
            let _lock = common::SEEDED.lock();
            kiln::tensor::rng::manual_seed(9);
            TwoLayers { fc1: Linear::new(3, 4, true, Device::Cpu).unwrap(), fc2: Linear::new(4, 2, true, Device::Cpu).unwrap() }
        };
        // A hook on fc1's weight that runs before Ddp's own: how many buckets had started
        // when that gradient came in.
        let ddp_cell: Arc<OnceLock<Weak<Ddp>>> = Arc::new(OnceLock::new());
        let seen = Arc::new(Mutex::new(None));
        let probe = {
            let (cell, seen) = (ddp_cell.clone(), seen.clone());
            kiln::autograd::register_post_accumulate_grad_hook(&m.fc1.weight, move |_| {
                *seen.lock().unwrap() = cell.get().and_then(Weak::upgrade).map(|d| d.started());
                Ok(())
            })
        };
        // Every parameter its own bucket, in reverse order: fc2.bias, fc2.weight, fc1.bias, fc1.weight.
        let tiny = DdpOptions { bucket_cap_mb: 0.0, first_bucket_mb: 0.0, ..DdpOptions::default() };
        let ddp = Arc::new(Ddp::new(&m, &pg, tiny).unwrap());
        ddp_cell.set(Arc::downgrade(&ddp)).unwrap();
        let x = Tensor::full((pg.rank() + 1) as f64, &[1, 3], DType::F32, Device::Cpu).unwrap();
        m.fc2.forward(&m.fc1.forward(&x).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let (during, after) = (seen.lock().unwrap().expect("the probe ran"), ddp.started());
        ddp.sync_gradients().unwrap();
        drop(probe);
        (during, after, m.fc2.bias.as_ref().unwrap().grad().unwrap().to_vec::<f32>().unwrap())
    });
    for (during, after, bias_grad) in out {
        // fc2's two buckets had started while fc1's gradients were still being made.
        assert!((2..4).contains(&during), "{during} buckets had started when fc1's weight gradient came in");
        assert_eq!(after, 4, "every bucket started by the end of the backward");
        assert_eq!(bias_grad, vec![1.0, 1.0], "d sum / d bias is 1 on both ranks");
    }
}
