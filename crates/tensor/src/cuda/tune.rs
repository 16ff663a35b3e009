//! `MaxAutotune` for Kiln's own kernels: a launch parameter (a column sum's vector width and
//! chunk count, layer norm's backward's blocks, the F32 GEMM's contraction parts) chosen by
//! timing a bounded set of candidates on the real operands, once per problem and GPU, then
//! kept in memory and on disk (`cache_dir("tuned")`), as `lt.rs` keeps cuBLASLt's algorithms.
//! Without a tuned choice a kernel takes its default. As with cuBLASLt's, a choice tuned by
//! an earlier `MaxAutotune` run on this machine applies in every mode, eager too: a
//! reduction's last bits may then differ from an untuned machine's.

use super::gpu::Gpu;
use crate::Result;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Choices = HashMap<(usize, u64), Option<usize>>;

thread_local! {
    static AUTOTUNE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While on (this thread), new problems are tuned: cuBLASLt's top candidates for a GEMM
/// (`lt.rs`) and the launch parameters of Kiln's own kernels (`choice`), keeping the fastest.
pub fn set_autotune(on: bool) {
    AUTOTUNE.with(|a| a.set(on));
}

/// Whether `set_autotune` is on for this thread.
pub fn autotune() -> bool {
    AUTOTUNE.with(|a| a.get())
}

/// Choices per (GPU ordinal, problem hash): `Some` once tuned (here or on disk), `None` once
/// the disk was found to hold none (so a step's every call does not read it again).
fn chosen() -> &'static Mutex<Choices> {
    static CHOSEN: OnceLock<Mutex<Choices>> = OnceLock::new();
    CHOSEN.get_or_init(Mutex::default)
}

static TUNED: AtomicU64 = AtomicU64::new(0);
static TUNE_NANOS: AtomicU64 = AtomicU64::new(0);

/// Problems tuned so far in this process, and the time spent timing them.
pub fn tuning_stats() -> (u64, Duration) {
    (TUNED.load(Ordering::Relaxed), Duration::from_nanos(TUNE_NANOS.load(Ordering::Relaxed)))
}

/// The choice for `problem` (a kernel's `kind` and what sizes its launch) on `g`: tuned
/// earlier (in this process or on disk, and still one of `candidates()`, so a stale or damaged
/// file can never pick a launch the caller did not offer); else, while autotuning
/// (`set_autotune`, not in a dry run or a capture), the fastest of `candidates()` by
/// `time` (seconds per run; a candidate whose timing fails is skipped; a single distinct
/// candidate is taken untimed); else `default`. A call that finds its choice in memory only
/// hashes `problem` (it runs at every launch of an eager op or an uncaptured step).
pub(crate) fn choice<P: Hash + Debug>(
    g: &Arc<Gpu>,
    (kind, problem): (&'static str, &P),
    default: usize,
    candidates: impl Fn() -> Vec<usize>,
    time: impl Fn(usize) -> Result<f64>,
) -> usize {
    let key = (g.ordinal, super::gpu::spec_key(kind, problem));
    let path = || {
        let name = format!("{kind} {problem:?} sm_{}{} {} SMs", g.arch.0, g.arch.1, g.sms);
        crate::cache::cache_dir("tuned").map(|d| d.join(format!("{:016x}.choice", crate::codegen::fnv1a(name.as_bytes()))))
    };
    let known = chosen().lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
    let known = known.unwrap_or_else(|| {
        let disk: Option<usize> = path().and_then(|p| std::fs::read_to_string(p).ok()).and_then(|s| s.trim().parse().ok());
        let disk = disk.filter(|c| candidates().contains(c));
        chosen().lock().unwrap_or_else(|e| e.into_inner()).insert(key, disk);
        disk
    });
    if let Some(c) = known {
        return c;
    }
    if !autotune() || super::gpu::is_dry() || g.capturing() {
        return default;
    }
    let mut offered = candidates();
    offered.sort_unstable();
    offered.dedup();
    if offered.len() < 2 {
        return offered.first().copied().unwrap_or(default);
    }
    let start = Instant::now();
    let mut best = (f64::INFINITY, default);
    for c in offered {
        if let Ok(secs) = time(c) {
            if secs < best.0 {
                best = (secs, c);
            }
        }
    }
    TUNED.fetch_add(1, Ordering::Relaxed);
    TUNE_NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    chosen().lock().unwrap_or_else(|e| e.into_inner()).insert(key, Some(best.1));
    if let Some(p) = path() {
        crate::cache::cache_put(&p, best.1.to_string().as_bytes());
    }
    if crate::log::enabled("kernels") {
        eprintln!("kiln: tuned {kind} {problem:?}: {} ({:.2} us)", best.1, best.0 * 1e6);
    }
    best.1
}

/// Seconds per run of `f` as a replayed step sees it: `RUNS` runs captured into one CUDA
/// graph, best of three replays. Timed from the host one call at a time, a small kernel's
/// launch cost (several microseconds, which a graph replay does not pay) would hide the
/// differences between candidates. `f` must allocate nothing.
pub(crate) fn time_graph(g: &Arc<Gpu>, f: impl Fn() -> Result<()>) -> Result<f64> {
    const RUNS: u32 = 10;
    f()?;
    g.sync()?;
    // (The pool outlives the graph, as `capture` asks, though the runs allocate nothing.)
    let pool = g.new_pool();
    let (graph, ()) = g.capture(&pool, || (0..RUNS).try_for_each(|_| f()))?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        graph.launch().map_err(super::gpu::cuda_err("graph launch"))?;
        g.sync()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best / RUNS as f64)
}
