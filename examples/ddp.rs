//! Data-parallel training (`Ddp`) of the 784-256-10 MLP on the embedded digits: one process
//! per GPU, each on its share of every batch, gradients averaged over NCCL.
//!
//!   cargo build --release --features cuda --example ddp --bin kiln-run
//!   target/release/kiln-run --nproc-per-node 8 -- target/release/examples/ddp --compile
//!   options: --epochs 3 --batch 256 (the global batch) --lr 1e-3 --compile
//!            [--compile-mode default|reduce-overhead|max-autotune] --device cpu|cuda
//!
//! Started alone it trains as a group of one rank (on the CPU, or over NCCL on a GPU).

mod common;

use common::{bar, compile_mode, flag, has, opt};
use kiln::compile::compile_step;
use kiln::data::synthetic_digits;
use kiln::distributed::{Ddp, DdpOptions, DistEnv, ProcessGroup, Reduction, DEFAULT_TIMEOUT};
use kiln::loader::DataLoader;
use kiln::nn::cross_entropy;
use kiln::optim::{AdamConfig, AdamW, Optimizer};
use kiln::prelude::*;
use std::time::Instant;

fn main() -> Result<()> {
    let env = DistEnv::from_env()?;
    // Each rank takes the GPU of its LOCAL_RANK; alone, the device asked for.
    let device = match (&env, opt("--device").as_deref()) {
        (_, Some("cpu")) => Device::Cpu,
        (Some(e), _) => Device::Cuda(e.local_rank),
        (None, _) => common::device(),
    };
    let pg = ProcessGroup::from_env(device, DEFAULT_TIMEOUT)?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let (epochs, global_batch, lr) = (flag("--epochs", 3usize), flag("--batch", 256usize), flag("--lr", 1e-3f64));
    if global_batch % world != 0 {
        return Err(Error::Msg(format!("--batch {global_batch} does not split over {world} ranks")));
    }
    kiln::tensor::rng::manual_seed(0);
    let model = kiln::models::mlp(&[784, 256, 10], device)?;
    let ddp = Ddp::new(&model, &pg, DdpOptions::default())?;
    if rank == 0 {
        print!("{world} rank(s) on {device:?}, global batch {global_batch} ({} a rank)\n{}", global_batch / world, ddp.explain());
    }
    let mut opt = AdamW::new(model.parameters(), AdamConfig { lr, ..AdamConfig::adamw() })?;
    let step = |o: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
        loss.backward()?;
        ddp.sync_gradients()?;
        o.step()?;
        o.zero_grad()?;
        Ok(vec![loss])
    };
    let mut compiled = has("--compile").then(|| compile_step(compile_mode(device), step));
    let (train, test) = (synthetic_digits(8192, 1), synthetic_digits(1024, 2));
    let (x, y) = train.to_tensors()?;
    let mut loader =
        DataLoader::new(vec![x, y], global_batch / world)?.shuffle(0).drop_last(true).distributed(rank, world)?.to_device(device);
    let t0 = Instant::now();
    for epoch in 0..epochs {
        let pb = bar(if rank == 0 { loader.len() as u64 } else { 0 }, &format!("epoch {epoch}"));
        let mut sum = Tensor::zeros(&[1], DType::F32, device)?;
        for b in loader.epoch() {
            let b = b?;
            let loss = match &mut compiled {
                Some(c) => c.call(&mut opt, &b)?,
                None => step(&mut opt, &b)?,
            };
            sum = sum.add(&loss[0].reshape(&[1])?)?;
            pb.inc(1);
        }
        pb.finish_and_clear();
        // Every rank's mean loss, averaged over the ranks.
        let mean = pg.all_reduce(&sum, Reduction::Mean)?.item()? / loader.len() as f64;
        if rank == 0 {
            println!("epoch {epoch}: mean loss {mean:.4} over all ranks ({:.1} s)", t0.elapsed().as_secs_f64());
        }
    }
    if rank == 0 {
        let (tx, ty) = test.to_tensors()?;
        let pred = no_grad(|| model.forward(&tx.to_device(device)?))?.argmax(1, false)?;
        let correct = pred.eq(&ty.to_device(device)?)?.to_dtype(DType::I64)?.sum_all()?.item()?;
        println!("test accuracy {:.1}% after {epochs} epochs", 100.0 * correct / test.len() as f64);
    }
    pg.barrier()
}
