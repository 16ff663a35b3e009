//! kiln-compile: traces a whole training step (forward, the tape's backward, the optimizer
//! update) into one graph, optimises it and replays it.
//!
//! ```ignore
//! let mut step = kiln_compile::compile_step(Mode::Default, |opt: &mut AdamW, xs: &[Tensor]| {
//!     let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
//!     loss.backward()?;
//!     opt.step()?;
//!     opt.zero_grad()?;
//!     Ok(vec![loss])
//! });
//! let loss = &step.call(&mut opt, &[&x, &y])?[0];
//! ```
//!
//! The first call with a new input signature runs the closure under a tracer (`trace.rs`)
//! with its kernels queued, not run (`kiln_tensor::lazy`), lowers the recording to the graph IR (`lower.rs`, `graph.rs`), runs the
//! passes (`passes.rs`) and keeps the program (`exec.rs`), which then computes the first call
//! too; later calls replay it. So a tensor the closure keeps outside the step other than
//! through its outputs, the parameters' gradients or optimizer state holds unspecified values
//! (as on replays, where the closure does not run at all): return it instead. What the
//! step reads outside its inputs (parameters, gradients, optimizer state, lr, step count) is
//! state: read from and written back into the same buffers, so code outside sees the update.
//! The learning rate and step count are tensors, so schedulers stepping outside the compiled
//! step change them in place and replays see it; random draws take the generator's offset at
//! each call. On the CPU, `ReduceOverhead` and `MaxAutotune` behave like `Default`; on a GPU
//! both replay the step as one CUDA graph (`cuda_exec.rs`).

mod cpu_codegen;
#[cfg(feature = "cuda")]
mod cuda_exec;
mod exec;
mod fused_exec;
pub mod fusion;
pub mod graph;
use kiln_tensor::log;
mod lower;
mod options;
pub mod passes;
mod trace;

pub use graph::Graph;
pub use options::{CompileOptions, Dynamic, Mode};

use exec::contiguous_cell;
use fusion::groups_report;
use kiln_tensor::{lazy, rng, set_tracer, DType, Device, Error, Result, Tensor};
use options::gpu_sources_path;
use std::ops::RangeInclusive;
use std::rc::Rc;
use std::time::{Duration, Instant};
use trace::GradAtStart;

/// What a compiled step is keyed by: each input's shape, dtype and device, the mode and autocast.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Signature {
    inputs: Vec<(Vec<usize>, DType, Device)>,
    mode: Mode,
    /// `kiln_tensor::Autocast` at the call: a trace records its casts.
    autocast: Option<DType>,
    /// Grad mode at the call: under `no_grad` a trace records no backward.
    grad_enabled: bool,
}

impl Signature {
    /// The same call but for the sizes of its inputs: dtypes, devices, ranks, mode and modes.
    fn same_kind(&self, o: &Signature) -> bool {
        let inputs = self.inputs.len() == o.inputs.len()
            && self.inputs.iter().zip(&o.inputs).all(|(a, b)| a.0.len() == b.0.len() && a.1 == b.1 && a.2 == b.2);
        inputs && self.mode == o.mode && self.autocast == o.autocast && self.grad_enabled == o.grad_enabled
    }

    /// The signature with the sizes of `dims` (`(input, dim)`) masked, if it has them all. As
    /// in PyTorch, sizes 0 and 1 stay: a dim of one element lays out and broadcasts unlike a
    /// longer one, so a dynamic graph serves sizes from 2 and a size of 0 or 1 is a graph of
    /// its own (its other dims still dynamic).
    fn masked(&self, dims: &[(usize, usize)]) -> Option<Signature> {
        let mut s = self.clone();
        for &(i, d) in dims {
            let size = s.inputs.get_mut(i)?.0.get_mut(d)?;
            if *size > 1 {
                *size = usize::MAX;
            }
        }
        Some(s)
    }
}

/// A dim made dynamic before the first call (`mark_dynamic`), with the sizes it may take.
#[derive(Debug, Clone)]
struct Mark {
    input: usize,
    dim: usize,
    range: RangeInclusive<usize>,
}

/// A dynamic graph: the calls it serves (their signature with the dynamic dims masked), the
/// shapes ready to run, and the kernel sets built for it. Each new shape is traced and planned
/// (milliseconds) and runs the kernels already built, which take their sizes as parameters.
struct Family {
    key: Signature,
    /// `(input, dim)` of each dynamic dim, and the sizes it may take.
    dims: Vec<(usize, usize)>,
    bounds: Vec<RangeInclusive<usize>>,
    /// By the dynamic dims' sizes, the most recently used last (`CompileOptions::shape_cache`).
    shapes: Vec<(Vec<usize>, Entry)>,
    /// `exec::Program::code_key` of each kernel set built.
    builds: Vec<u64>,
    /// Shapes traced in all (dropped ones included).
    traced: usize,
}

impl Family {
    /// Whether `sig` is `key` but for sizes of 2 and more where the key has a masked dim (a
    /// check on every call: made in place, never building the masked signature).
    fn covers(&self, sig: &Signature) -> bool {
        let size = |key: usize, s: usize| key == s || (key == usize::MAX && s > 1);
        self.key.same_kind(sig) && self.key.inputs.iter().zip(&sig.inputs).all(|(k, s)| k.0.iter().zip(&s.0).all(|(&a, &b)| size(a, b)))
    }

    fn sizes(&self, sig: &Signature) -> Vec<usize> {
        self.dims.iter().map(|&(i, d)| sig.inputs[i].0[d]).collect()
    }

    /// The first dynamic dim outside its bounds, as an error message.
    fn out_of_bounds(&self, sizes: &[usize]) -> Option<String> {
        let k = (0..sizes.len()).find(|&k| !self.bounds[k].contains(&sizes[k]))?;
        let ((i, d), b) = (self.dims[k], &self.bounds[k]);
        Some(format!(
            "compile: input {i} dim {d} is {}, outside the range {}..={} it was marked dynamic with",
            sizes[k],
            b.start(),
            b.end()
        ))
    }

    fn describe(&self) -> String {
        let dims: Vec<String> = self
            .dims
            .iter()
            .zip(&self.bounds)
            .map(|(&(i, d), b)| match (self.key.inputs[i].0[d], *b.start(), *b.end()) {
                (one @ (0 | 1), ..) => format!("input {i} dim {d} at {one}"),
                (_, 0, usize::MAX) => format!("input {i} dim {d}"),
                (_, lo, hi) => format!("input {i} dim {d} in {lo}..={hi}"),
            })
            .collect();
        format!("{}: {} shapes traced, {} ready, {} kernel sets built", dims.join(", "), self.traced, self.shapes.len(), self.builds.len())
    }
}

/// Where a cached entry lives: a specialised signature, or a shape of a dynamic graph.
#[derive(Debug, Clone, Copy)]
enum At {
    Static(usize),
    Shape(usize, usize),
}

enum Entry {
    Graph(Box<Specialized>),
    /// A graph break: this signature runs eagerly.
    Eager(String),
}

/// One signature's compiled graph: the executable program and what the trace saw.
struct Specialized {
    exec: exec::Program,
    leaf_grads: Vec<lower::LeafGrad>,
    /// The flags the trace read (train/eval modes) and their values then.
    flags: Vec<(kiln_tensor::Flag, bool)>,
    compile_time: Duration,
    nodes_traced: usize,
}

/// A compiled step: call it like the closure.
pub struct Compiled<F> {
    f: F,
    engine: Engine,
}

/// A compiled step over state the caller owns (`compile_step`): each call lends it the
/// state, which the caller keeps between calls (a scheduler or a checkpoint takes
/// `&mut opt` there, no `RefCell` needed).
pub struct CompiledStep<S, F> {
    f: F,
    engine: Engine,
    state: std::marker::PhantomData<fn(&mut S)>,
}

/// The step as the engine runs it eagerly or under the tracer.
type Run<'a> = dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'a;

/// What a compiled step keeps: options, the cache of programs per signature, counters.
struct Engine {
    opts: CompileOptions,
    cache: Vec<(Signature, Entry)>,
    families: Vec<Family>,
    marks: Vec<Mark>,
    calls: usize,
    replays: usize,
    warned: bool,
    /// Check mode: steps compared and the largest difference seen.
    checked: usize,
    worst: f64,
    /// The kernel table of the last `call_profiled`.
    kernel_times: Option<String>,
}

/// `compile_with` with default options and the given mode.
pub fn compile<F>(mode: Mode, f: F) -> Compiled<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    compile_with(CompileOptions { mode, ..Default::default() }, f)
}

pub fn compile_with<F>(opts: CompileOptions, f: F) -> Compiled<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    Compiled { f, engine: Engine::new(opts) }
}

/// `compile` for a step that takes state the caller owns as its first argument: the
/// optimizer, a loss scaler, a struct of them. The caller keeps it between calls and lends
/// it to each (`step.call(&mut opt, &[&x, &y])`); the closure borrows the model as usual.
///
/// ```ignore
/// let mut step = compile_step(Mode::Default, |opt: &mut AdamW, xs: &[Tensor]| {
///     let loss = cross_entropy(&model.forward(&xs[0])?, &xs[1])?;
///     loss.backward()?;
///     opt.step()?;
///     opt.zero_grad()?;
///     Ok(vec![loss])
/// });
/// let loss = &step.call(&mut opt, &[&x, &y])?[0];
/// sched.step(&mut opt)?;
/// ```
pub fn compile_step<S, F>(mode: Mode, f: F) -> CompiledStep<S, F>
where
    F: FnMut(&mut S, &[Tensor]) -> Result<Vec<Tensor>>,
{
    compile_step_with(CompileOptions { mode, ..Default::default() }, f)
}

/// `compile_step` with options.
pub fn compile_step_with<S, F>(opts: CompileOptions, f: F) -> CompiledStep<S, F>
where
    F: FnMut(&mut S, &[Tensor]) -> Result<Vec<Tensor>>,
{
    CompiledStep { f, engine: Engine::new(opts), state: std::marker::PhantomData }
}

/// The inputs of a call as the engine takes them (`&[Tensor]` and `&[&Tensor]` alike).
fn refs<T: std::borrow::Borrow<Tensor>>(inputs: &[T]) -> Vec<&Tensor> {
    inputs.iter().map(|t| t.borrow()).collect()
}

impl<F> Compiled<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    /// Runs one step (inputs as `&[Tensor]` or `&[&Tensor]`). The returned tensors belong to
    /// the caller: later calls never change them.
    pub fn call<T: std::borrow::Borrow<Tensor>>(&mut self, inputs: &[T]) -> Result<Vec<Tensor>> {
        self.engine.call(&mut self.f, &refs(inputs))
    }

    /// Runs one step (it trains, like `call`) with every kernel launched on its own and
    /// timed on the device; `explain()` then lists the kernels with their times. On a GPU a
    /// captured graph is not replayed for this step.
    pub fn call_profiled<T: std::borrow::Borrow<Tensor>>(&mut self, inputs: &[T]) -> Result<Vec<Tensor>> {
        let f = &mut self.f;
        self.engine.profiled(|e| e.call(f, &refs(inputs)))
    }
}

impl<S, F> CompiledStep<S, F>
where
    F: FnMut(&mut S, &[Tensor]) -> Result<Vec<Tensor>>,
{
    /// Runs one step on `state` (as `Compiled::call`).
    pub fn call<T: std::borrow::Borrow<Tensor>>(&mut self, state: &mut S, inputs: &[T]) -> Result<Vec<Tensor>> {
        let f = &mut self.f;
        self.engine.call(&mut |xs: &[Tensor]| f(state, xs), &refs(inputs))
    }

    /// `call` with every kernel timed (as `Compiled::call_profiled`).
    pub fn call_profiled<T: std::borrow::Borrow<Tensor>>(&mut self, state: &mut S, inputs: &[T]) -> Result<Vec<Tensor>> {
        let f = &mut self.f;
        self.engine.profiled(|e| e.call(&mut |xs: &[Tensor]| f(state, xs), &refs(inputs)))
    }
}

/// What both kinds of compiled step report.
macro_rules! reports {
    ($([$($g:ident),*] $t:ty),*) => {$(
        impl<$($g),*> $t {
            /// Check mode's result so far: steps compared and the largest absolute difference.
            pub fn check_report(&self) -> (usize, f64) {
                (self.engine.checked, self.engine.worst)
            }
            /// How many graphs were compiled, graph breaks, kernels, memory and bytes moved.
            pub fn explain(&self) -> Explain {
                self.engine.explain()
            }
            /// The last compiled graph after passes, with its fusion groups (for snapshots and logs).
            pub fn dump(&self) -> Option<String> {
                self.engine.dump()
            }
            /// Calls so far, and how many of them replayed a compiled graph.
            pub fn counts(&self) -> (usize, usize) {
                (self.engine.calls, self.engine.replays)
            }
            /// Makes dim `dim` of input `input` dynamic from the first call, taking the sizes
            /// in `range` (PyTorch's `torch._dynamo.mark_dynamic`): one graph serves them all.
            /// A call outside the range is an error under `fullgraph`, else a graph of its own.
            pub fn mark_dynamic(&mut self, input: usize, dim: usize, range: RangeInclusive<usize>) -> &mut Self {
                self.engine.marks.push(Mark { input, dim, range });
                self
            }
        }
    )*};
}
reports!([F] Compiled<F>, [S, F] CompiledStep<S, F>);

/// A summary of what a compiled step does.
#[derive(Debug, Clone, Default)]
pub struct Explain {
    /// Graphs compiled: specialised ones, and the kernel sets of dynamic ones.
    pub graphs: usize,
    pub graph_breaks: Vec<String>,
    pub recompiles: usize,
    /// Each dynamic graph: its dynamic dims, the shapes traced for it and the kernel sets built.
    pub dynamic: Vec<String>,
    /// Shapes of dynamic graphs traced and planned in all (each reusing built kernels).
    pub shapes_traced: usize,
    pub nodes_traced: usize,
    pub nodes: usize,
    pub kernels: usize,
    pub state_buffers: usize,
    pub planned_peak_bytes: usize,
    pub bytes_moved: usize,
    pub compile_time: Duration,
    /// Per kernel (plain op kinds and fused kernels by name) of the last `call_profiled`:
    /// device time of each, synchronised one by one (see `kiln_tensor::profile`).
    pub kernel_times: Option<String>,
    /// On the CPU: fusion groups, and how many of them run as native code (`cpu_codegen`).
    pub native_groups: Option<(usize, usize)>,
    /// On the CPU: products made tile by tile for the group that reads them (a weight
    /// gradient feeding its optimizer update, `fusion::feed_products`).
    pub fed_products: usize,
    /// The collectives of the step (a data-parallel step's bucket all-reduces), one line
    /// each: what, where in the step, and how many nodes lie between it and its first reader
    /// (the work it can overlap).
    pub collectives: Vec<String>,
}

impl std::fmt::Display for Explain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "compiled graphs: {} (recompiles: {})", self.graphs, self.recompiles)?;
        writeln!(f, "graph breaks: {}", self.graph_breaks.len())?;
        for d in &self.dynamic {
            writeln!(f, "dynamic graph: {d}")?;
        }
        for b in &self.graph_breaks {
            writeln!(f, "  - {b}")?;
        }
        writeln!(f, "ops traced: {}, nodes after passes: {}, kernels per step: {}", self.nodes_traced, self.nodes, self.kernels)?;
        if let Some((groups, native)) = self.native_groups {
            writeln!(f, "CPU fusion groups: {groups}, built to native code: {native}")?;
            writeln!(f, "products fed tile by tile to their group: {}", self.fed_products)?;
        } else if self.fed_products > 0 {
            writeln!(f, "products made by the kernels that read them: {}", self.fed_products)?;
        }
        if !self.collectives.is_empty() {
            writeln!(f, "collectives: {}", self.collectives.len())?;
            for c in &self.collectives {
                writeln!(f, "  - {c}")?;
            }
        }
        writeln!(f, "state buffers: {}", self.state_buffers)?;
        writeln!(f, "planned peak of intermediates: {:.2} MiB", self.planned_peak_bytes as f64 / (1 << 20) as f64)?;
        writeln!(f, "bytes moved per step: {:.2} MiB", self.bytes_moved as f64 / (1 << 20) as f64)?;
        write!(f, "compile time: {:.1} ms", self.compile_time.as_secs_f64() * 1e3)?;
        if let Some(t) = &self.kernel_times {
            write!(f, "\nkernels of the last profiled step:\n{t}")?;
        }
        Ok(())
    }
}

impl Engine {
    fn new(opts: CompileOptions) -> Engine {
        Engine {
            opts,
            cache: Vec::new(),
            families: Vec::new(),
            marks: Vec::new(),
            calls: 0,
            replays: 0,
            warned: false,
            checked: 0,
            worst: 0.0,
            kernel_times: None,
        }
    }

    /// One step of `f`: a replay, a trace, or (check mode, graph breaks) an eager run.
    fn call(&mut self, f: &mut Run, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.calls += 1;
        let sig = Signature {
            inputs: inputs.iter().map(|t| (t.shape().to_vec(), t.dtype(), t.device())).collect(),
            mode: self.opts.mode,
            autocast: kiln_tensor::autocast_dtype(),
            grad_enabled: kiln_tensor::is_grad_enabled(),
        };
        if let Some(k) = self.cache.iter().position(|(s, e)| *s == sig && guards_hold(e)) {
            return self.run_at(f, At::Static(k), inputs);
        }
        if let Some(fi) = self.families.iter().position(|fam| fam.covers(&sig)) {
            return self.call_dynamic(f, fi, sig, inputs);
        }
        let dims = self.dynamic_dims(&sig);
        if dims.is_empty() {
            return self.trace_static(f, sig, inputs);
        }
        self.check_limit(&sig)?;
        let bounds: Vec<RangeInclusive<usize>> = dims
            .iter()
            .map(|&(i, d)| self.marks.iter().rev().find(|m| (m.input, m.dim) == (i, d)).map_or(0..=usize::MAX, |m| m.range.clone()))
            .collect();
        let key = sig.masked(&dims).ok_or_else(|| Error::Msg("compile: a dynamic dim past an input's rank".into()))?;
        let named: Vec<String> = dims.iter().map(|(i, d)| format!("input {i} dim {d}")).collect();
        log::log("recompiles", &format!("compiling a dynamic graph for {:?}: {} take any size", sig.inputs, named.join(", ")));
        self.families.push(Family { key, dims, bounds, shapes: Vec::new(), builds: Vec::new(), traced: 0 });
        self.call_dynamic(f, self.families.len() - 1, sig, inputs)
    }

    /// The dims a call with a signature no graph serves makes dynamic: with `Dynamic::Auto`
    /// the marked ones and those whose sizes differ from a graph compiled for a call of the same
    /// kind (with the dims of that kind's dynamic graphs), every dim with `Always`, none with
    /// `Never`.
    fn dynamic_dims(&self, sig: &Signature) -> Vec<(usize, usize)> {
        let every = || sig.inputs.iter().enumerate().flat_map(|(i, x)| (0..x.0.len()).map(move |d| (i, d))).collect();
        let mut dims: Vec<(usize, usize)> = match self.opts.dynamic {
            Dynamic::Never => return vec![],
            Dynamic::Always => every(),
            Dynamic::Auto => {
                let fits = |&(i, d): &(usize, usize)| sig.inputs.get(i).is_some_and(|x| d < x.0.len());
                let mut dims: Vec<(usize, usize)> = self.marks.iter().map(|m| (m.input, m.dim)).filter(fits).collect();
                for (s, _) in self.cache.iter().filter(|(s, e)| matches!(e, Entry::Graph(_)) && s.same_kind(sig)) {
                    for (i, (a, b)) in s.inputs.iter().zip(&sig.inputs).enumerate() {
                        dims.extend((0..a.0.len()).filter(|&d| a.0[d] != b.0[d]).map(|d| (i, d)));
                    }
                }
                if dims.iter().any(|m| !self.marks.iter().any(|k| (k.input, k.dim) == *m)) {
                    for fam in self.families.iter().filter(|fam| fam.key.same_kind(sig)) {
                        dims.extend(&fam.dims);
                    }
                }
                dims
            }
        };
        dims.sort_unstable();
        dims.dedup();
        dims
    }

    /// A call of dynamic graph `fi`: a shape ready to run, or a new one traced and planned.
    fn call_dynamic(&mut self, f: &mut Run, fi: usize, sig: Signature, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let sizes = self.families[fi].sizes(&sig);
        if let Some(msg) = self.families[fi].out_of_bounds(&sizes) {
            if self.opts.fullgraph {
                return Err(Error::Msg(msg));
            }
            log::log("recompiles", &format!("{msg}; compiling this shape on its own"));
            self.check_limit(&sig)?;
            return self.trace_static(f, sig, inputs);
        }
        let fam = &mut self.families[fi];
        if let Some(si) = fam.shapes.iter().position(|(v, e)| *v == sizes && guards_hold(e)) {
            let ready = fam.shapes.remove(si);
            fam.shapes.push(ready);
            let last = fam.shapes.len() - 1;
            return self.run_at(f, At::Shape(fi, last), inputs);
        }
        let (out, entry) = self.trace(f, &sig, inputs, true)?;
        let fam = &mut self.families[fi];
        fam.traced += 1;
        if let Entry::Graph(p) = &entry {
            let code = p.exec.code_key();
            if !fam.builds.contains(&code) {
                if !fam.builds.is_empty() {
                    log::log(
                        "recompiles",
                        &format!("dynamic graph: new kernels for {:?} ({} kernel sets)", sig.inputs, fam.builds.len() + 1),
                    );
                }
                fam.builds.push(code);
            }
        }
        fam.shapes.retain(|(v, _)| *v != sizes);
        fam.shapes.push((sizes, entry));
        let keep = self.opts.shape_cache.max(1);
        if fam.shapes.len() > keep {
            fam.shapes.drain(..fam.shapes.len() - keep);
        }
        Ok(out)
    }

    /// A graph specialised to `sig`'s shapes.
    fn trace_static(&mut self, f: &mut Run, sig: Signature, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.check_limit(&sig)?;
        if self.graphs() > 0 {
            log::log("recompiles", &format!("recompiling for {:?} ({} graphs cached)", sig.inputs, self.graphs()));
        }
        let (out, entry) = self.trace(f, &sig, inputs, false)?;
        self.cache.push((sig, entry));
        Ok(out)
    }

    /// Graphs compiled: specialised signatures (graph breaks included) and the kernel sets
    /// of dynamic graphs.
    fn graphs(&self) -> usize {
        self.cache.len() + self.families.iter().map(|f| f.builds.len().max(1)).sum::<usize>()
    }

    fn check_limit(&self, sig: &Signature) -> Result<()> {
        if self.graphs() < self.opts.recompile_limit {
            return Ok(());
        }
        Err(Error::Msg(format!(
            "compile: recompile limit ({}) reached; new signature {:?} (cached: {:?}). Mark the changing dims dynamic (CompileOptions::dynamic, mark_dynamic), pad inputs to fixed shapes or raise CompileOptions::recompile_limit",
            self.opts.recompile_limit,
            sig.inputs,
            self.cache.iter().map(|(s, _)| &s.inputs).collect::<Vec<_>>()
        )))
    }

    fn entry(&self, at: At) -> &Entry {
        match at {
            At::Static(k) => &self.cache[k].1,
            At::Shape(fi, si) => &self.families[fi].shapes[si].1,
        }
    }

    /// Runs a cached entry, through check mode while it lasts.
    fn run_at(&mut self, f: &mut Run, at: At, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        if self.checked < self.opts.check_steps && matches!(self.entry(at), Entry::Graph(_)) {
            self.run_checked(f, at, inputs)
        } else {
            self.run_entry(f, at, inputs)
        }
    }

    fn run_entry(&mut self, f: &mut Run, at: At, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let graph = matches!(self.entry(at), Entry::Graph(_));
        self.replays += graph as usize;
        match self.entry(at) {
            Entry::Eager(_) => {
                let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
                f(&owned)
            }
            Entry::Graph(p) => run_program(p, inputs),
        }
    }

    /// Check mode: compiled, then eager from the same state; compares, keeps eager's.
    fn run_checked(&mut self, f: &mut Run, at: At, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let cells: Vec<Tensor> = match self.entry(at) {
            Entry::Graph(p) => {
                p.exec.cells.iter().map(|c| Tensor::from_cell(c.clone(), kiln_tensor::Layout::contiguous(&[c.len()]))).collect()
            }
            Entry::Eager(_) => return self.run_entry(f, at, inputs),
        };
        let before: Vec<Tensor> = cells.iter().map(|t| t.copy()).collect::<Result<_>>()?;
        let gen = rng::state();
        let compiled = self.run_entry(f, at, inputs)?;
        let after: Vec<Tensor> = cells.iter().map(|t| t.copy()).collect::<Result<_>>()?;
        kiln_tensor::no_grad(|| cells.iter().zip(&before).try_for_each(|(c, b)| c.assign(b)))?;
        rng::set_state(gen);
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        let eager = f(&owned)?;
        let mut worst = 0.0f64;
        for (a, b) in compiled.iter().chain(&after).zip(eager.iter().chain(&cells)) {
            let (x, y) = (a.to_vec_f64()?, b.to_vec_f64()?);
            worst = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(worst, f64::max);
        }
        self.checked += 1;
        self.worst = self.worst.max(worst);
        if self.checked == self.opts.check_steps {
            eprintln!("kiln compile check: {} steps compared with eager; largest difference {:e}", self.checked, self.worst);
        }
        Ok(eager)
    }

    /// `call` (through `run`) with every kernel timed; the table is kept for `explain`.
    fn profiled(&mut self, run: impl FnOnce(&mut Engine) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        kiln_tensor::profile::reset();
        kiln_tensor::profile::set_enabled(true);
        let out = run(self);
        kiln_tensor::profile::set_enabled(false);
        self.kernel_times = Some(kiln_tensor::profile::report());
        kiln_tensor::profile::reset();
        out
    }

    /// Traces `f` on `inputs` and compiles the graph (`generic`: kernels taking their sizes
    /// as parameters); returns this call's results and the entry to keep.
    fn trace(&mut self, f: &mut Run, sig: &Signature, inputs: &[&Tensor], generic: bool) -> Result<(Vec<Tensor>, Entry)> {
        let start = Instant::now();
        // Inputs become fresh buffers so the trace can tell them from state.
        let owned: Vec<Tensor> = inputs.iter().map(|t| t.copy()).collect::<Result<_>>()?;
        let first_tensor = kiln_tensor::next_tensor_id();
        let recorder = Rc::new(trace::Recorder { rec: Default::default(), fullgraph: self.opts.fullgraph, first_tensor });
        let (gen0, first_new) = (rng::state(), kiln_tensor::storage::next_storage_id());
        let lazy = lazy::begin()?;
        let prev = set_tracer(Some(recorder.clone()));
        let result = f(&owned);
        set_tracer(prev);
        // The trace queued its kernels without running them. If some ran already (a host read
        // or a device copy flushed them), on a graph break, or on an error, all of them run:
        // the step has its eager effects and this call returns its eager results. Otherwise
        // only the fills run (buffers the step creates and keeps start from them), the rest
        // is dropped before lowering (which tells state from temporaries by what is still
        // alive), and the compiled program computes this first step.
        let queue = lazy.stop();
        let host_reads = !recorder.rec.borrow().host_reads.is_empty();
        let lazy_first = !(result.is_err() || host_reads || queue.flushed);
        let traced = start.elapsed();
        let ran = if lazy_first {
            let (ran, fills) = queue.run_fills()?;
            format!("kernels queued, {ran} of {fills} fills run")
        } else {
            queue.run_all()?;
            "run eagerly".to_string()
        };
        log::log(
            "time",
            &format!("traced in {:.1} ms, {ran} in {:.1} ms", traced.as_secs_f64() * 1e3, (start.elapsed() - traced).as_secs_f64() * 1e3),
        );
        let outputs = result?;
        let gen1 = rng::state();
        let rec = recorder.rec.borrow();
        if host_reads {
            let reason = rec.host_reads[0].clone();
            if !self.warned {
                eprintln!("kiln compile: graph break, running this step eagerly: {reason}");
                self.warned = true;
            }
            log::log("recompiles", &format!("graph break for {:?}: {reason}", sig.inputs));
            return Ok((outputs, Entry::Eager(reason)));
        }
        let program = match self.build(&rec, (&owned, &outputs, inputs), (gen0, gen1), first_new, (start, generic)) {
            Ok(p) => p,
            Err(e) => {
                if lazy_first {
                    // The step did not happen: drop the gradients the trace attached (never
                    // computed), so the model is as before the call.
                    rec.leaves.iter().filter(|(_, at)| *at != GradAtStart::Present).for_each(|(leaf, _)| leaf.set_grad(None));
                    rng::set_state(gen0);
                }
                return Err(e);
            }
        };
        let out = if lazy_first {
            drop((outputs, owned));
            rng::set_state(gen0);
            run_program(&program, inputs)?
        } else {
            outputs
        };
        Ok((out, Entry::Graph(Box::new(program))))
    }

    /// Lowers a recording, runs the passes and plans the program. State buffers the trace
    /// made without memory (lazy placeholders) get some; an older one is an error.
    fn build(
        &mut self,
        rec: &trace::Recording,
        (owned, outputs, inputs): (&[Tensor], &[Tensor], &[&Tensor]),
        gens: (rng::GeneratorState, rng::GeneratorState),
        first_new: u64,
        (start, generic): (Instant, bool),
    ) -> Result<Specialized> {
        let traced_at = start.elapsed();
        let lowered = lower::lower(rec, owned, outputs, gens, first_new)?;
        if !lowered.baked.is_empty() && !self.warned {
            eprintln!("kiln compile: {} tensor(s) made from host data inside the step are baked in as constants ({}); pass them as inputs if they change", lowered.baked.len(), lowered.baked.join(", "));
            self.warned = true;
        }
        let nodes_traced = rec.events.len();
        log::log("graph", &format!("traced graph ({} ops):\n{}", nodes_traced, lowered.graph));
        debug_verify(&lowered.graph)?;
        let traced = start.elapsed();
        for c in &lowered.cells {
            if c.id() >= first_new {
                lazy::materialize(c)?;
            } else {
                lazy::check_cell(c)?;
            }
        }
        let device = step_device(inputs, &lowered.cells);
        if let Device::Cuda(i) = device {
            if needs_blas(&lowered.graph) {
                kiln_tensor::cuda::start_blas(i);
            }
        }
        let mut mark = Instant::now();
        let target = match device {
            Device::Cuda(i) => passes::Target::Gpu { clusters: kiln_tensor::cuda::has_clusters(i) },
            _ if gpu_sources_path().is_some() => passes::Target::Gpu { clusters: true },
            _ => passes::Target::Cpu,
        };
        let graph = passes::optimise(lowered.graph, target, |name, g| {
            log::log("passes", &format!("after {name}: {} nodes ({:.1} ms)", g.nodes.len(), mark.elapsed().as_secs_f64() * 1e3));
            mark = Instant::now();
            debug_verify(g).unwrap_or_else(|e| eprintln!("kiln compile: verifier after {name}: {e}"));
        });
        log::log("graph", &format!("optimised graph:\n{graph}"));
        let planned = Instant::now();
        let exec = exec::Program::new(graph, lowered.cells, &self.opts, device, generic)?;
        log::log(
            "time",
            &format!(
                "trace {:.1} ms, lowering {:.1} ms, passes {:.1} ms, plan and kernels {:.1} ms",
                traced_at.as_secs_f64() * 1e3,
                (traced - traced_at).as_secs_f64() * 1e3,
                (planned - start - traced).as_secs_f64() * 1e3,
                planned.elapsed().as_secs_f64() * 1e3
            ),
        );
        log::log("fusion", &fusion_report(&exec));
        let compile_time = start.elapsed();
        log::log("time", &format!("compiled in {:.1} ms", compile_time.as_secs_f64() * 1e3));
        let flags = rec.flags.iter().map(|(f, v)| (f.share(), *v)).collect();
        Ok(Specialized { exec, leaf_grads: lowered.leaf_grads, flags, compile_time, nodes_traced })
    }

    fn explain(&self) -> Explain {
        let mut e = Explain {
            recompiles: self.graphs().saturating_sub(1),
            kernel_times: self.kernel_times.clone(),
            dynamic: self.families.iter().map(Family::describe).collect(),
            shapes_traced: self.families.iter().map(|f| f.traced).sum(),
            ..Default::default()
        };
        e.graphs = self.families.iter().map(|f| f.builds.len()).sum();
        let dynamic = self.families.iter().flat_map(|f| &f.shapes).map(|(_, entry)| (entry, true));
        for (entry, shape) in self.cache.iter().map(|(_, entry)| (entry, false)).chain(dynamic) {
            match entry {
                Entry::Eager(reason) => e.graph_breaks.push(reason.clone()),
                Entry::Graph(p) => {
                    let g = &p.exec.graph;
                    e.graphs += !shape as usize;
                    e.nodes_traced = p.nodes_traced;
                    e.nodes = g.nodes.len();
                    e.kernels = p.exec.kernels();
                    e.native_groups = p.exec.native_groups();
                    e.fed_products = p.exec.fed_products();
                    e.state_buffers = g.state.len();
                    e.planned_peak_bytes = p.exec.planned_peak_bytes();
                    e.bytes_moved = p.exec.bytes_moved();
                    e.collectives = g.collectives();
                    e.compile_time += p.compile_time;
                }
            }
        }
        e
    }

    fn dump(&self) -> Option<String> {
        let dynamic = self.families.iter().rev().flat_map(|f| f.shapes.iter().rev().map(|(_, e)| e));
        dynamic.chain(self.cache.iter().rev().map(|(_, e)| e)).find_map(|e| match e {
            Entry::Graph(p) => Some(format!("{}\n{}", p.exec.graph, fusion_report(&p.exec))),
            Entry::Eager(_) => None,
        })
    }
}

/// Runs a compiled program on `inputs` from the generator's current state, then points each
/// parameter's `grad` at the buffer holding its gradient.
fn run_program(p: &Specialized, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let cells = inputs.iter().map(|t| contiguous_cell(t)).collect::<Result<Vec<_>>>()?;
    let gen = rng::state();
    let out = p.exec.run(&cells, gen)?;
    rng::set_state(rng::GeneratorState { seed: gen.seed, offset: gen.offset + p.exec.graph.rng_advance });
    for lg in &p.leaf_grads {
        match &lg.end {
            Some((slot, layout)) => {
                let cell = &p.exec.cells[*slot];
                if !lg.leaf.grad().is_some_and(|g| std::sync::Arc::ptr_eq(g.storage(), cell) && g.layout() == layout) {
                    lg.leaf.set_grad(Some(Tensor::from_cell(cell.clone(), layout.clone())));
                }
            }
            // Cleared by the step and not written again: cleared by the replay too.
            None if lg.at_start == GradAtStart::Cleared => lg.leaf.set_grad(None),
            None => {}
        }
    }
    Ok(out)
}

/// A cached graph stays valid while every parameter's gradient is present exactly when it
/// was at trace time, in the same buffer, and every flag it read (train/eval) reads the same.
fn guards_hold(e: &Entry) -> bool {
    match e {
        Entry::Eager(_) => true,
        Entry::Graph(p) => {
            // Only gradients the step wrote: a forward alone leaves them be, whatever they are.
            let grads = p.leaf_grads.iter().filter(|lg| lg.end.is_some()).all(|lg| match (lg.leaf.grad(), lg.at_start) {
                (_, GradAtStart::Cleared) | (None, GradAtStart::Absent) => true,
                (Some(g), GradAtStart::Present) => lg.start_storage.is_none_or(|s| g.storage().id() == s),
                _ => false,
            });
            grads && p.flags.iter().all(|(f, v)| f.get() == *v)
        }
    }
}

/// Where a step runs: the first GPU among its inputs, else among its state, else the CPU.
fn step_device(inputs: &[&Tensor], cells: &[std::sync::Arc<kiln_tensor::storage::StorageCell>]) -> Device {
    let from_cells = || cells.iter().map(|c| c.read().device()).find(|d| d.is_cuda());
    inputs.iter().map(|t| t.device()).find(|d| d.is_cuda()).or_else(from_cells).unwrap_or(Device::Cpu)
}

/// The fusion groups, one line each: members, shape, what they store and write in place.
fn fusion_report(p: &exec::Program) -> String {
    let groups = p.plan.groups.iter().filter(|g| !g.members.is_empty()).count();
    format!("{groups} groups, {} kernels per step{}", p.kernels(), groups_report(&p.graph, &p.plan))
}

fn debug_verify(g: &Graph) -> Result<()> {
    if cfg!(debug_assertions) {
        g.verify().map_err(|e| Error::Msg(format!("compile: graph verifier: {e}")))?;
    }
    Ok(())
}

/// Whether a traced step holds a product that cuBLAS likely runs (every side over 32: the
/// smaller ones take Kiln's few-rows, thin and narrow kernels). cuBLAS then starts on a
/// thread at once, beside the passes and the dry run, rather than at the dry run's first
/// such product; a guess wrong either way costs only when that start happens.
fn needs_blas(g: &graph::Graph) -> bool {
    g.nodes.iter().any(|n| match &n.kind {
        graph::Kind::Op(kiln_tensor::op::Op::Matmul, args) if args.len() == 2 => {
            let (a, b) = (&args[0].layout.shape, &args[1].layout.shape);
            a.len() >= 2 && b.len() >= 2 && a[a.len() - 2..].iter().chain(&b[b.len() - 1..]).all(|&d| d > 32)
        }
        _ => false,
    })
}
