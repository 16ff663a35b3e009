//! The GPU side of a compiled program: every fusion group becomes one generated CUDA kernel
//! (packed into a few NVRTC programs), the first call runs the step dry to compile all its
//! kernels at once, random draws read the generator's seed and offset from a device buffer,
//! and with `capture` (`Mode::ReduceOverhead`) the whole step is captured once into a CUDA
//! graph and replayed.
//!
//! The captured graph owns a private memory pool (every intermediate of the step lives there,
//! at the addresses baked into the graph) and its output buffers, which its last nodes copy
//! into fresh tensors for the caller: a later replay never changes what the caller holds. It reads
//! its inputs where the first call's lay while calls pass tensors there, else from static
//! buffers that each call copies the caller's inputs into.

use crate::fusion::{Group, Plan, Step};
use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::cuda;
use kiln_tensor::cuda::compiled::{self as cc, CudaGraph, FusedModule, OutputCopies, Pool};
use kiln_tensor::cuda::kernels::fused::Fed;
use kiln_tensor::cuda::kernels::fused::FusedGroup;
use kiln_tensor::cuda::kernels::fused::FusedInput;
use kiln_tensor::cuda::kernels::fused::FusedKernel;
use kiln_tensor::cuda::kernels::fused::FusedMember;
use kiln_tensor::cuda::kernels::fused::FusedSrc;
use kiln_tensor::op::OutMeta;
use kiln_tensor::rng::GeneratorState;
use kiln_tensor::storage::StorageCell;
use kiln_tensor::{DType, Device, Distribution, Error, Layout, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What the GPU side reads of the program it runs (`exec::Program`, which owns it): the
/// graph, the plan, the state cells, the device, and the step run kernel by kernel.
pub(crate) trait Host {
    fn graph(&self) -> &Graph;
    fn plan(&self) -> &Plan;
    fn cells(&self) -> &[Arc<StorageCell>];
    fn device(&self) -> Device;
    /// One step kernel by kernel; `copy_outputs` as `exec::Program::execute`.
    fn execute(&self, inputs: &[Arc<StorageCell>], gen: GeneratorState, copy_outputs: bool) -> Result<Vec<Tensor>>;
}

/// A captured step. Field order is drop order: the graph goes before the buffers it uses.
struct Captured {
    graph: CudaGraph,
    inputs: Inputs,
    outputs: Vec<Tensor>,
    /// The graph's own copies of `outputs` into each call's fresh tensors; `None` when an
    /// output is not dense (each call then copies it after the replay).
    copies: Option<Copies>,
    _pool: Arc<Pool>,
}

/// A graph's copies of its outputs (its last nodes, or its last kernel's last block), and the
/// tensors its next replay copies them into.
struct Copies {
    nodes: OutputCopies,
    next: Vec<Tensor>,
}

impl Copies {
    fn new(nodes: OutputCopies, graph: &CudaGraph, outputs: &[Tensor], device: Device) -> Result<Copies> {
        let mut c = Copies { nodes, next: vec![] };
        c.aim(graph, outputs, device)?;
        Ok(c)
    }

    /// Points the copies at new tensors like `outputs` for the next replay, and returns the
    /// ones before (a replay already queued copies into those: destinations are read at
    /// launch). Done after a launch, so the host work overlaps the replay.
    fn aim(&mut self, graph: &CudaGraph, outputs: &[Tensor], device: Device) -> Result<Vec<Tensor>> {
        let fresh: Vec<Tensor> = outputs
            .iter()
            .map(|t| Ok(Tensor::from_cell(cc::alloc_cell(device, t.dtype(), t.numel())?, Layout::contiguous(t.shape()))))
            .collect::<Result<_>>()?;
        let dsts = fresh.iter().map(|t| cc::address(t.storage())).collect::<Result<Vec<u64>>>()?;
        // SAFETY: the copies were captured into `graph`, one per output, and each fresh buffer
        // holds its output's bytes; `next` keeps them alive until the replay that writes them
        // is queued, and a buffer the caller drops sooner is reused only by later work.
        unsafe { cc::set_output_copies(graph, &self.nodes, &dsts)? };
        Ok(std::mem::replace(&mut self.next, fresh))
    }
}

/// Where a captured graph reads its inputs.
enum Inputs {
    /// In the caller's buffers at these addresses (the first call's): a call whose inputs
    /// lie there (a static input buffer the caller refills, as PyTorch advises for CUDA
    /// graphs) replays with no copy.
    Direct(Vec<u64>),
    /// In static buffers of its own, which each call copies the caller's inputs into.
    Copied(Vec<Arc<StorageCell>>),
}

pub struct GpuParts {
    module: FusedModule,
    /// Kernel index in `module` by the first group it runs (groups of one member run as
    /// plain nodes).
    kernel_of: Vec<Option<usize>>,
    /// `[seed, offset]` of the generator at the start of the step, when the step draws.
    rng: Option<Arc<StorageCell>>,
    /// Replay as a CUDA graph (switched off if a capture ever fails).
    capture: AtomicBool,
    captured: Mutex<Option<Captured>>,
    /// The first run is preceded by a dry run that compiles all its kernels at once.
    prepared: AtomicBool,
    /// `Mode::MaxAutotune` before its first run: that run times each new matmul shape's
    /// cuBLASLt candidates (`kiln_tensor::cuda::lt`) and keeps the fastest.
    tune: AtomicBool,
}

/// The kernel's name: its groups' indices and the first ops (of the first group after a
/// lead), so a profile reads back to the IR (`KILN_LOG=fusion` lists the groups).
fn kernel_name(g: &Graph, plan: &Plan, gs: &[usize]) -> String {
    let named = gs.iter().find(|&&k| !plan.groups[k].lead).unwrap_or(&gs[0]);
    let ops: Vec<&str> = plan.groups[*named]
        .members
        .iter()
        .filter_map(|&m| match &g.nodes[m].kind {
            Kind::Op(op, _) => Some(op.name()),
            _ => None,
        })
        .take(5)
        .collect();
    let ids: Vec<String> = gs.iter().take(4).map(|k| k.to_string()).collect();
    let more = if gs.len() > 4 { format!("_and{}more", gs.len() - 4) } else { String::new() };
    format!("kiln_group{}{more}_{}", ids.join("_"), ops.join("_"))
}

/// The kernel spec of one fusion group; `lead`: its launch's lead group (whose values it reads
/// from registers).
fn fused_group(g: &Graph, plan: &Plan, k: usize, lead: Option<&Group>) -> Result<FusedGroup> {
    let gr = &plan.groups[k];
    let n: usize = gr.shape.iter().product();
    let inputs: Vec<FusedInput> = gr
        .externals
        .iter()
        .map(|a| {
            if let Some(operands) = plan.fed_operands(g, a) {
                return Ok(fed_input(g, a, operands));
            }
            let dtype = g.nodes[a.node].dtype;
            let l = &a.layout;
            let strided = if l.is_contiguous() && l.numel() == n {
                None
            } else if l.numel() == 1 {
                // One value for every element (of any rank: a folding group's scalars).
                Some((gr.shape.clone(), vec![0; gr.shape.len()]))
            } else if l.numel() == n && l.shape != gr.shape {
                // A copy into a new shape (a reshape the strides could not express): element
                // i is the i-th of the source in its own row-major order.
                Some((l.shape.clone(), l.strides.clone()))
            } else {
                Some((gr.shape.clone(), l.broadcast_strides(&gr.shape)))
            };
            let lead = lead.and_then(|ld| ld.materialize.iter().position(|&m| m == a.node));
            Ok(FusedInput { dtype, offset: l.offset, strided, lead, fed: None })
        })
        .collect::<Result<_>>()?;
    let pos = |x: NodeId| gr.members.iter().position(|&m| m == x);
    let mut members = Vec::with_capacity(gr.members.len());
    for &m in &gr.members {
        let Kind::Op(op, args) = &g.nodes[m].kind else {
            return Err(Error::Msg(format!("compile: fused group {k} holds a non-op node %{m}")));
        };
        let srcs = args
            .iter()
            .map(|a| match pos(a.node) {
                Some(j) => Ok(FusedSrc::Member(j)),
                None => gr
                    .externals
                    .iter()
                    .position(|e| e == a)
                    .map(FusedSrc::Input)
                    .ok_or_else(|| Error::Msg(format!("compile: group {k} reads %{} from nowhere", a.node))),
            })
            .collect::<Result<Vec<_>>>()?;
        members.push(FusedMember { op: op.clone(), args: srcs, dtype: g.nodes[m].dtype });
    }
    let outputs = gr.materialize.iter().map(|&m| pos(m).unwrap_or(usize::MAX)).collect();
    Ok(FusedGroup { n, inputs, members, outputs })
}

/// A read of a fed product (`fusion::feed_gpu_products`, 2-D operands): the product itself
/// (from a and b) or `SumLeft`'s sums (from a), made where the group reads them.
fn fed_input(g: &Graph, read: &Arg, (a, b): (&Arg, Option<&Arg>)) -> FusedInput {
    let strides = |l: &Layout| [l.strides[0], l.strides[1]];
    let fed = Fed {
        k: a.layout.shape[1],
        cols: b.map_or(1, |b| b.layout.shape[1]),
        a: strides(&a.layout),
        b: b.map(|b| (b.layout.offset, strides(&b.layout))),
    };
    FusedInput { dtype: g.nodes[read.node].dtype, offset: a.layout.offset, strided: None, lead: None, fed: Some(fed) }
}

/// The fused kernels of a plan for the GPU, and for each group the kernel that runs it (set
/// on each launch's first group). Identical launches (the same layer repeated) share one.
/// `generic`: sizes as parameters (a dynamic-shape program).
fn fused_kernels(g: &Graph, plan: &Plan, capture: bool, generic: bool) -> Result<(Vec<FusedKernel>, Vec<Option<usize>>)> {
    let mut specs = Vec::new();
    let mut kernel_of = vec![None; plan.groups.len()];
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let folds = if capture { copying_step(g, plan) } else { None };
    for step in &plan.steps {
        let Step::Groups(gs) = step else { continue };
        let lead = plan.groups[gs[0]].lead.then(|| &plan.groups[gs[0]]);
        let groups: Vec<FusedGroup> = gs.iter().map(|&k| fused_group(g, plan, k, lead.filter(|_| k != gs[0]))).collect::<Result<_>>()?;
        let copies = if folds.is_some_and(|f| std::ptr::eq(f, step)) { g.outputs.len() } else { 0 };
        let key = format!("{}{copies}{groups:?}", lead.is_some());
        let k = *seen.entry(key).or_insert_with(|| {
            specs.push(FusedKernel { name: kernel_name(g, plan, gs), groups, lead: lead.is_some(), copies, generic });
            specs.len() - 1
        });
        kernel_of[gs[0]] = Some(k);
    }
    Ok((specs, kernel_of))
}

/// The CUDA source a GPU would compile for `plan`'s fusion groups (`KILN_GPU_SOURCES`,
/// `exec::Program::new`), after the groups as `KILN_LOG=fusion` lists them.
pub fn gpu_sources(g: &Graph, plan: &Plan, capture: bool, generic: bool) -> Result<String> {
    let (specs, _) = fused_kernels(g, plan, capture, generic)?;
    let report: String = crate::fusion::groups_report(g, plan).lines().filter(|l| !l.is_empty()).map(|l| format!("//{l}\n")).collect();
    Ok(report + &cuda::kernels::fused::fused_module(&specs).map_err(Error::Msg)?)
}

impl GpuParts {
    pub fn new(g: &Graph, plan: &Plan, device: Device, (capture, tune, generic): (bool, bool, bool)) -> Result<GpuParts> {
        let start = std::time::Instant::now();
        let (specs, kernel_of) = fused_kernels(g, plan, capture, generic)?;
        let generated = start.elapsed();
        let module = FusedModule::load(device, specs)?;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        kiln_tensor::log::log(
            "time",
            &format!("fused kernels generated in {:.1} ms, compiled or loaded in {:.1} ms", ms(generated), ms(start.elapsed() - generated)),
        );
        let draws = g.nodes.iter().any(|n| matches!(n.kind, Kind::Rand { .. }));
        let rng = if draws { Some(cc::alloc_cell(device, DType::I64, 2)?) } else { None };
        Ok(GpuParts {
            module,
            kernel_of,
            rng,
            capture: AtomicBool::new(capture),
            captured: Mutex::new(None),
            prepared: AtomicBool::new(false),
            tune: AtomicBool::new(tune),
        })
    }

    /// The fused module's kernels, as a hash (`exec::Program::code_key`).
    pub fn code_key(&self) -> u64 {
        self.module.code_key()
    }

    /// Runs the fusion groups `gs` (one kernel): returns the cells of their materialised members.
    pub fn run_groups(
        &self,
        p: &dyn Host,
        gs: &[usize],
        cell_of: &dyn Fn(NodeId) -> Result<Arc<StorageCell>>,
    ) -> Result<Vec<(NodeId, Arc<StorageCell>)>> {
        let k = self.kernel_of[gs[0]].ok_or_else(|| Error::Msg(format!("compile: group {} has no kernel", gs[0])))?;
        let led = p.plan().groups[gs[0]].lead;
        let (mut made, mut outs, mut ins): (Vec<(NodeId, Arc<StorageCell>)>, _, _) = (Vec::new(), Vec::new(), Vec::new());
        for (q, &gi) in gs.iter().enumerate() {
            let gr = &p.plan().groups[gi];
            let o: Vec<(NodeId, Arc<StorageCell>)> = gr
                .materialize
                .iter()
                .map(|&m| match gr.inplace.iter().find(|x| x.0 == m) {
                    Some(&(_, slot)) => Ok((m, p.cells()[slot].clone())),
                    None => {
                        let node = &p.graph().nodes[m];
                        Ok((m, cc::alloc_cell(p.device(), node.dtype, node.numel())?))
                    }
                })
                .collect::<Result<_>>()?;
            outs.push(o.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>());
            // A lead's values are made by this launch (the groups after it get its buffers,
            // which its last block writes); everything else was made before.
            let from_lead = |x: NodeId| (led && q > 0).then(|| made.iter().find(|(m, _)| *m == x).map(|(_, c)| c.clone())).flatten();
            let mut cells: Vec<Arc<StorageCell>> = Vec::with_capacity(gr.externals.len());
            for a in &gr.externals {
                match p.plan().fed_operands(p.graph(), a) {
                    // A fed product's operands, as `fed_input` passes them.
                    Some((x, y)) => {
                        cells.push(cell_of(x.node)?);
                        if let Some(y) = y {
                            cells.push(cell_of(y.node)?);
                        }
                    }
                    None => cells.push(from_lead(a.node).map_or_else(|| cell_of(a.node), Ok)?),
                }
            }
            ins.push(cells);
            made.extend(o);
        }
        // The step's outputs, for a kernel that copies them (made before it, or by it).
        let copies = match self.module.copies(k) {
            0 => Vec::new(),
            _ => p
                .graph()
                .outputs
                .iter()
                .map(|a| {
                    let cell = made.iter().find(|(m, _)| *m == a.node).map_or_else(|| cell_of(a.node), |(_, c)| Ok(c.clone()))?;
                    Ok((cell, a.layout.offset, a.layout.numel()))
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if kiln_tensor::profile::enabled() {
            cuda::synchronize(p.device())?;
            let t = std::time::Instant::now();
            self.module.launch(k, &outs, &ins, &copies)?;
            cuda::synchronize(p.device())?;
            kiln_tensor::profile::record(format!("fused {}", self.module.name(k)), t.elapsed().as_secs_f64());
        } else {
            self.module.launch(k, &outs, &ins, &copies)?;
        }
        Ok(made)
    }

    /// A `Kind::Rand` node: drawn at the step's generator offset (read on the device) + `offset`.
    pub fn rand(&self, dist: Distribution, offset: u64, meta: &OutMeta) -> Result<Arc<StorageCell>> {
        let state = self.rng.as_ref().ok_or_else(|| Error::Msg("compile: a draw without generator state".into()))?;
        cc::rand_from_state(state, dist, offset, meta)
    }

    /// One step. With `capture`, the first call runs the step and then captures it; later
    /// calls replay the graph (copying the inputs in first unless they lie where the graph
    /// reads them) and copy the outputs out.
    pub fn run(&self, p: &dyn Host, inputs: &[Arc<StorageCell>], gen: GeneratorState) -> Result<Vec<Tensor>> {
        if let Some(state) = &self.rng {
            cc::write_i64(state, &[gen.seed as i64, gen.offset as i64])?;
        }
        // The first call runs the step dry to learn every kernel it needs (fused and per-op),
        // then compiles them all at once on threads instead of one by one as each is reached.
        // (Not in anomaly mode: its host checks would read the dry run's unwritten buffers.)
        if !self.prepared.swap(true, Ordering::Relaxed) && !kiln_tensor::is_anomaly_detection() {
            let (capture, start) = (self.capture.load(Ordering::Relaxed), std::time::Instant::now());
            cc::prepare(p.device(), || (p.execute(inputs, gen, false), capture.then(|| cc::want_output_copies(p.device()))))?;
            kiln_tensor::log::log("time", &format!("per-op kernels found or compiled in {:.1} ms", start.elapsed().as_secs_f64() * 1e3));
        }
        if self.tune.swap(false, Ordering::Relaxed) {
            use kiln_tensor::cuda::{lt, tune};
            let (before, own_before) = (lt::tuning_stats(), tune::tuning_stats());
            tune::set_autotune(true);
            let out = p.execute(inputs, gen, true);
            tune::set_autotune(false);
            let (after, own_after) = (lt::tuning_stats(), tune::tuning_stats());
            eprintln!(
                "kiln compile: max-autotune timed cuBLASLt candidates for {} matmul shapes and Kiln's launch choices for {} kernels in {:.1} ms (others came from the disk cache)",
                after.0 - before.0,
                own_after.0 - own_before.0,
                ((after.1 - before.1) + (own_after.1 - own_before.1)).as_secs_f64() * 1e3
            );
            return out;
        }
        // Timing each kernel needs them launched one by one, and anomaly mode reads every
        // result on the host: neither can run inside a graph.
        if !self.capture.load(Ordering::Relaxed) || kiln_tensor::profile::enabled() || kiln_tensor::is_anomaly_detection() {
            return p.execute(inputs, gen, true);
        }
        let mut slot = self
            .captured
            .lock()
            .map_err(|_| Error::Msg("compile: an earlier step panicked while capturing or replaying its CUDA graph".into()))?;
        if let Some(Captured { inputs: Inputs::Direct(at), .. }) = slot.as_ref() {
            if !same_addresses(at, inputs)? {
                // Inputs elsewhere: from now on the graph reads copies (captured again, the old
                // graph and its pool dropped first).
                *slot = None;
                match self.capture_copied(p, inputs, gen)? {
                    Some(c) => *slot = Some(c),
                    None => return p.execute(inputs, gen, true),
                }
            }
        }
        if let Some(c) = slot.as_mut() {
            if let Inputs::Copied(statics) = &c.inputs {
                for (dst, src) in statics.iter().zip(inputs) {
                    cc::copy_cell(dst, src)?;
                }
            }
            cc::launch_graph(&c.graph)?;
            return match &mut c.copies {
                Some(copies) => copies.aim(&c.graph, &c.outputs, p.device()),
                None => c.outputs.iter().map(|t| t.copy()).collect(),
            };
        }
        // The first run loads every kernel (and cuBLAS) outside the capture.
        let (start, planned) = (std::time::Instant::now(), cuda::lt::planning_stats());
        let out = p.execute(inputs, gen, true)?;
        let (ran, (plans, plan_time, launch_time)) = (start.elapsed(), cuda::lt::planning_stats());
        let pool = cc::new_pool(p.device())?;
        // The graph's outputs stay its own buffers; each call copies them for the caller.
        let addresses = inputs.iter().map(|c| cc::address(c)).collect::<Result<Vec<u64>>>()?;
        match cc::capture(p.device(), &pool, || self.captured_step(p, inputs, gen)) {
            Ok((graph, (outputs, nodes))) => {
                let copies = nodes.map(|n| Copies::new(n, &graph, &outputs, p.device())).transpose()?;
                *slot = Some(Captured { graph, inputs: Inputs::Direct(addresses), outputs, copies, _pool: pool })
            }
            Err(e) => self.capture_failed(e),
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        kiln_tensor::log::log(
            "time",
            &format!(
                "first run {:.1} ms (cuBLASLt: {} plans made in {:.1} ms, first launches {:.1} ms), capture {:.1} ms",
                ms(ran),
                plans - planned.0,
                ms(plan_time - planned.1),
                ms(launch_time - planned.2),
                ms(start.elapsed() - ran)
            ),
        );
        Ok(out)
    }

    /// The step captured reading static buffers like `inputs` (each call copies its inputs
    /// into them); `None` if the capture failed (later calls then run without a graph).
    fn capture_copied(&self, p: &dyn Host, inputs: &[Arc<StorageCell>], gen: GeneratorState) -> Result<Option<Captured>> {
        let pool = cc::new_pool(p.device())?;
        let statics: Vec<Arc<StorageCell>> = inputs
            .iter()
            .map(|c| {
                let dtype = c.read().dtype();
                cc::alloc_cell(p.device(), dtype, c.len())
            })
            .collect::<Result<_>>()?;
        match cc::capture(p.device(), &pool, || self.captured_step(p, &statics, gen)) {
            Ok((graph, (outputs, nodes))) => {
                let copies = nodes.map(|n| Copies::new(n, &graph, &outputs, p.device())).transpose()?;
                Ok(Some(Captured { graph, inputs: Inputs::Copied(statics), outputs, copies, _pool: pool }))
            }
            Err(e) => {
                self.capture_failed(e);
                Ok(None)
            }
        }
    }

    /// The step itself ran and is correct; later calls run it kernel by kernel.
    fn capture_failed(&self, e: Error) {
        eprintln!("kiln compile: capturing the step as a CUDA graph failed ({e}); running it without a graph");
        self.capture.store(false, Ordering::Relaxed);
    }

    /// The step as captured: its outputs, and (when every output is dense) their copies into
    /// the caller's tensors: by its last kernel when that was made to copy them and is the
    /// graph's last node, else as nodes of their own after it.
    fn captured_step(&self, p: &dyn Host, inputs: &[Arc<StorageCell>], gen: GeneratorState) -> Result<(Vec<Tensor>, Option<OutputCopies>)> {
        let outputs = p.execute(inputs, gen, false)?;
        if let Some(f) = self.module.folded_copies()? {
            return Ok((outputs, Some(OutputCopies::Folded(f))));
        }
        if !outputs.iter().all(|t| t.layout().is_contiguous()) {
            return Ok((outputs, None));
        }
        let copies = outputs.iter().map(|t| cc::capture_output_copy(t.storage(), t.layout().offset, t.numel())).collect::<Result<_>>()?;
        Ok((outputs, Some(OutputCopies::Nodes(copies))))
    }
}

/// The most bytes of outputs a step's last kernel copies in its last block (one block, so
/// a loss or a few small tensors; more take copy nodes of a full grid).
const FOLDED_COPY_BYTES: usize = 64 << 10;

/// The plan step whose kernel copies a captured step's outputs: the last, when it is a fused
/// launch and the outputs are dense and small.
fn copying_step<'a>(g: &Graph, plan: &'a Plan) -> Option<&'a Step> {
    let last = plan.steps.last().filter(|s| matches!(s, Step::Groups(_)))?;
    let bytes: usize = g.outputs.iter().map(|a| a.layout.numel() * g.nodes[a.node].dtype.size_in_bytes()).sum();
    let dense = g.outputs.iter().all(|a| a.layout.is_contiguous());
    (dense && !g.outputs.is_empty() && bytes <= FOLDED_COPY_BYTES).then_some(last)
}

/// Whether every input cell lies at the address the graph was captured with.
fn same_addresses(at: &[u64], inputs: &[Arc<StorageCell>]) -> Result<bool> {
    for (a, c) in at.iter().zip(inputs) {
        if cc::address(c)? != *a {
            return Ok(false);
        }
    }
    Ok(at.len() == inputs.len())
}
