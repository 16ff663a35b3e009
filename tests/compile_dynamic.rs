//! Dynamic shapes: a compiled step fed batches of changing size and length compiles once or
//! twice in all and matches eager at every shape; marked bounds and their errors.

use common::{random_shapes, train_gpt_shapes, train_mlp_batches};
use kiln::compile::{compile_with, CompileOptions, Dynamic, Mode};
use kiln::prelude::*;

mod common;

#[test]
fn an_mlp_fed_every_batch_size_compiles_twice_and_matches_eager() {
    let batches: Vec<usize> = random_shapes(40, (1, 64), (1, 1)).into_iter().map(|(b, _)| b).collect();
    let eager = train_mlp_batches(Device::Cpu, None, &batches);
    let compiled = train_mlp_batches(Device::Cpu, Some(CompileOptions { shape_cache: 64, ..Default::default() }), &batches);
    common::assert_runs_agree("dynamic MLP vs eager", &compiled.run, &eager.run, (1e-5, 1e-5));
    // The first batch size specialises; the second makes the batch dim dynamic.
    assert_eq!(compiled.graphs, 2, "graphs compiled");
    let others = batches.iter().filter(|&&b| b != batches[0]).collect::<std::collections::BTreeSet<_>>().len();
    assert_eq!(compiled.shapes_traced, others, "each other batch size is traced once for the dynamic graph");
}

#[test]
fn a_gpt_fed_every_batch_and_length_compiles_twice_and_matches_eager() {
    let shapes = random_shapes(14, (1, 64), (8, 256));
    let eager = train_gpt_shapes(Device::Cpu, None, &shapes, &mut || {});
    let auto = train_gpt_shapes(Device::Cpu, Some(CompileOptions::default()), &shapes, &mut || {});
    common::assert_runs_agree("dynamic GPT vs eager", &auto.run, &eager.run, (1e-4, 1e-4));
    // The first shape is (1, 256): specialised; the second makes both dims dynamic. (A later
    // batch of one at another length would be one more graph, as in PyTorch.)
    assert!(shapes[2..].iter().all(|&(b, _)| b > 1));
    assert_eq!(auto.graphs, 2, "automatic: specialised, then one dynamic graph");
    let always =
        train_gpt_shapes(Device::Cpu, Some(CompileOptions { dynamic: Dynamic::Always, ..Default::default() }), &shapes, &mut || {});
    common::assert_runs_agree("dynamic GPT (always) vs eager", &always.run, &eager.run, (1e-4, 1e-4));
    // Dynamic from the first call: one graph for a batch of one (at any length), one for the rest.
    assert_eq!((always.graphs, always.shapes_traced), (2, shapes.len()));
}

/// `x * 2` summed: a step whose result is easy to check at any size.
fn doubled_sum(xs: &[Tensor]) -> Result<Vec<Tensor>> {
    Ok(vec![xs[0].mul_scalar(2.0)?.sum_all()?])
}

#[test]
fn marked_bounds_hold_and_a_shape_outside_them_errors_or_compiles_apart() -> Result<()> {
    let ones = |n: usize| Tensor::ones(&[n, 3], DType::F32, Device::Cpu);
    let strict = CompileOptions { fullgraph: true, ..Default::default() };
    let mut step = compile_with(strict, doubled_sum);
    step.mark_dynamic(0, 0, 2..=16);
    for n in [2, 9, 16, 5] {
        assert_eq!(step.call(&[&ones(n)?])?[0].item()?, 6.0 * n as f64, "rows {n}");
    }
    assert_eq!((step.explain().graphs, step.explain().shapes_traced), (1, 4));
    let e = step.call(&[&ones(17)?]).unwrap_err().to_string();
    assert!(e.contains("input 0 dim 0 is 17, outside the range 2..=16"), "{e}");
    // Without fullgraph the shape gets a graph of its own.
    let mut lax = compile_with(CompileOptions::default(), doubled_sum);
    lax.mark_dynamic(0, 0, 2..=16);
    assert_eq!(lax.call(&[&ones(4)?])?[0].item()?, 24.0);
    assert_eq!(lax.call(&[&ones(40)?])?[0].item()?, 240.0);
    let e = lax.explain();
    assert_eq!((e.graphs, e.dynamic.len()), (2, 1), "{e}");
    assert!(e.dynamic[0].starts_with("input 0 dim 0 in 2..=16: 1 shapes traced"), "{}", e.dynamic[0]);
    Ok(())
}

#[test]
fn dynamic_never_compiles_each_shape_up_to_the_limit() -> Result<()> {
    let opts = CompileOptions { dynamic: Dynamic::Never, recompile_limit: 2, mode: Mode::Default, ..Default::default() };
    let mut step = compile_with(opts, doubled_sum);
    for n in [3, 4, 3] {
        step.call(&[&Tensor::ones(&[n, 2], DType::F32, Device::Cpu)?])?;
    }
    assert_eq!(step.explain().graphs, 2);
    let e = step.call(&[&Tensor::ones(&[5, 2], DType::F32, Device::Cpu)?]).unwrap_err().to_string();
    assert!(e.contains("recompile limit (2) reached") && e.contains("mark_dynamic"), "{e}");
    Ok(())
}

#[test]
fn the_shape_cache_drops_the_least_recently_used_shape_and_retraces_it() -> Result<()> {
    let mut step = compile_with(CompileOptions { dynamic: Dynamic::Always, shape_cache: 2, ..Default::default() }, doubled_sum);
    for n in [2, 3, 4, 2, 4] {
        assert_eq!(step.call(&[&Tensor::ones(&[n], DType::F32, Device::Cpu)?])?[0].item()?, 2.0 * n as f64);
    }
    // 2, 3, 4 traced; 2 was dropped when 4 came, so it is traced again; 4 replays.
    let e = step.explain();
    assert_eq!((e.graphs, e.shapes_traced), (1, 4), "{e}");
    assert_eq!(step.counts(), (5, 1));
    // Sizes 0 and 1 are graphs of their own (they lay out and broadcast unlike longer dims).
    assert_eq!(step.call(&[&Tensor::ones(&[1], DType::F32, Device::Cpu)?])?[0].item()?, 2.0);
    assert_eq!(step.explain().graphs, 2);
    assert!(step.explain().dynamic.iter().any(|d| d.starts_with("input 0 dim 0 at 1:")), "{}", step.explain());
    Ok(())
}
