//! Runs a compiled graph: the planned steps in order, every argument read through its layout
//! (views cost nothing), each buffer freed after its last use, state written back into the
//! same buffers at the end. On the CPU, nodes run Kiln's CPU kernels and fused groups
//! `fused_exec`; on a GPU, nodes run the eager CUDA kernels and each fused group is one
//! generated kernel (`cuda_exec`, which also captures the step as a CUDA graph).

use crate::fusion::{self, Plan, Step};
use crate::graph::{Graph, Kind, NodeId};
use crate::{cpu_codegen, fused_exec};
use kiln_tensor::op::OutMeta;
use kiln_tensor::rng::GeneratorState;
use kiln_tensor::storage::{CpuStorage, Storage, StorageCell};
use kiln_tensor::{cpu, Device, Error, Layout, Op, Result, Tensor};
use std::sync::{Arc, RwLockReadGuard};

pub struct Program {
    pub graph: Graph,
    pub cells: Vec<Arc<StorageCell>>,
    pub plan: Plan,
    pub device: Device,
    /// The GPU side: fused kernels, device generator state, the captured graph.
    #[cfg(feature = "cuda")]
    gpu: Option<crate::cuda_exec::GpuParts>,
    /// For each node, the last step that reads it (buffers are freed after it).
    last_use: Vec<usize>,
    /// The nodes each step reads, worked out once.
    reads: Vec<Vec<NodeId>>,
    /// State writes, those copying another state buffer first (before that buffer changes).
    pub(crate) writes: Vec<(usize, NodeId)>,
    /// The values of constant nodes (`Node::is_const`), made when the program is built.
    consts: Vec<Option<Arc<StorageCell>>>,
    /// On the CPU, the groups' generated native functions (None: all interpreted).
    pub(crate) native: Option<cpu_codegen::NativeGroups>,
    /// Per step: a product made tile by tile for the next step's group (`feed_products`).
    fed: Vec<bool>,
    /// Per node: for a layer norm's backward with a `copy`, the cast node its kernel also
    /// makes (`passes::ln_dx_copies`); that node's own step then does nothing.
    copies: Vec<Option<NodeId>>,
    made_with: Vec<bool>,
}

/// Locks each distinct cell once and hands out `(storage, layout)` pairs.
fn with_args<R>(cells: &[(&Arc<StorageCell>, &Layout)], f: impl FnOnce(&[(&CpuStorage, &Layout)]) -> Result<R>) -> Result<R> {
    let mut distinct: Vec<&Arc<StorageCell>> = Vec::new();
    let idx: Vec<usize> = cells
        .iter()
        .map(|(c, _)| match distinct.iter().position(|d| Arc::ptr_eq(d, c)) {
            Some(i) => i,
            None => {
                distinct.push(c);
                distinct.len() - 1
            }
        })
        .collect();
    let guards: Vec<RwLockReadGuard<Storage>> = distinct.iter().map(|c| c.read()).collect();
    let mut ins = Vec::with_capacity(cells.len());
    for (i, (_, l)) in idx.iter().zip(cells) {
        ins.push((guards[*i].as_cpu()?, *l));
    }
    f(&ins)
}

/// Node `n`'s computed value.
fn computed(vals: &[Option<Arc<StorageCell>>], n: NodeId) -> Result<&Arc<StorageCell>> {
    vals[n].as_ref().ok_or_else(|| Error::Msg(format!("compile: node {n} used before it was computed")))
}

/// An op's arguments as tensors over the computed values (views, no autograd history).
fn arg_tensors(args: &[crate::graph::Arg], vals: &[Option<Arc<StorageCell>>]) -> Result<Vec<Tensor>> {
    args.iter().map(|a| Ok(Tensor::from_cell(computed(vals, a.node)?.clone(), a.layout.clone()))).collect()
}

fn new_cell(s: CpuStorage) -> Arc<StorageCell> {
    Arc::new(StorageCell::new(Storage::Cpu(s)))
}

/// From this many multiply-adds a fed product's tiles spread over the threads.
const PAR_FED_FLOPS: usize = 1 << 20;

/// The fusion plan of `graph`, for a GPU (`gpu`) or the CPU; a `generic` program's kernels
/// feed no products (their contraction length is unrolled into the kernel).
fn plan_for(graph: &Graph, opts: &crate::options::CompileOptions, gpu: bool, generic: bool) -> Plan {
    let mut plan = if opts.fuse {
        fusion::plan(graph, gpu, generic)
    } else {
        Plan { steps: (0..graph.nodes.len()).map(Step::Node).collect(), groups: vec![], fed: vec![] }
    };
    if gpu {
        // One launch for independent groups (each parameter's optimizer update, ...).
        plan = fusion::batch_groups(graph, plan);
        if opts.fuse && opts.feed_products && !generic {
            fusion::feed_gpu_products(graph, &mut plan);
        }
    }
    plan
}

impl Program {
    /// Plans `graph` for `device`; in `Mode::ReduceOverhead` a GPU step is captured as one CUDA
    /// graph, and on the CPU fusion groups are built to native code unless `native_cpu` is off.
    /// With `generic` (a dynamic-shape program) the generated kernels take their sizes as
    /// parameters, so every size of the program shares them.
    pub fn new(
        graph: Graph,
        cells: Vec<Arc<StorageCell>>,
        opts: &crate::options::CompileOptions,
        device: Device,
        generic: bool,
    ) -> Result<Program> {
        let capture = matches!(opts.mode, crate::options::Mode::ReduceOverhead | crate::options::Mode::MaxAutotune);
        let mut plan = plan_for(&graph, opts, device.is_cuda(), generic);
        #[cfg(feature = "cuda")]
        if let (Device::Cpu, Some(path)) = (device, crate::options::gpu_sources_path()) {
            // For reading a GPU step's kernels (their SASS) on a machine without one.
            let src = crate::cuda_exec::gpu_sources(&graph, &plan_for(&graph, opts, true, generic), capture, generic)?;
            std::fs::write(&path, src).map_err(|e| Error::Msg(format!("KILN_GPU_SOURCES: writing {path}: {e}")))?;
        }
        let native = if device == Device::Cpu && opts.native_cpu { cpu_codegen::build(&graph, &plan, generic) } else { None };
        let fed = match &native {
            Some(nat) if opts.fuse && opts.feed_products && !generic => {
                fusion::feed_products(&graph, &mut plan, &|k| nat.groups[k].is_some())
            }
            _ => vec![false; plan.steps.len()],
        };
        let reads: Vec<Vec<NodeId>> = plan.steps.iter().map(|s| plan.reads(&graph, s)).collect();
        let mut last_use: Vec<usize> = vec![0; graph.nodes.len()];
        for (k, r) in reads.iter().enumerate() {
            for &a in r {
                last_use[a] = k;
            }
        }
        let mut writes = graph.writes.clone();
        writes.sort_by_key(|&(_, n)| !matches!(graph.nodes[n].kind, Kind::State(_) | Kind::Input(_)));
        // Outputs and state writes are read after every step.
        for a in graph.outputs.iter().map(|a| a.node).chain(graph.writes.iter().map(|w| w.1)) {
            last_use[a] = usize::MAX;
        }
        #[cfg(feature = "cuda")]
        let gpu = match device {
            Device::Cuda(_) => {
                let tune = opts.mode == crate::options::Mode::MaxAutotune;
                Some(crate::cuda_exec::GpuParts::new(&graph, &plan, device, (capture, tune, generic))?)
            }
            Device::Cpu => None,
        };
        #[cfg(not(feature = "cuda"))]
        if device.is_cuda() {
            let _ = capture;
            return Err(Error::Device { device, msg: "compile: Kiln was built without the `cuda` feature".into() });
        }
        let copies = crate::passes::dx_copies(&graph);
        let mut made_with = vec![false; graph.nodes.len()];
        copies.iter().flatten().for_each(|&c| made_with[c] = true);
        let mut p = Program {
            native,
            fed,
            copies,
            made_with,
            graph,
            cells,
            plan,
            device,
            #[cfg(feature = "cuda")]
            gpu,
            last_use,
            reads,
            writes,
            consts: vec![],
        };
        let gen = GeneratorState { seed: 0, offset: 0 };
        p.consts = (0..p.graph.nodes.len())
            .map(|i| if p.graph.nodes[i].is_const() { p.run_node(i, &[], &[], gen).map(Some) } else { Ok(None) })
            .collect::<Result<_>>()?;
        Ok(p)
    }

    /// What identifies the kernels this program built: the CPU library's source hash, or the
    /// GPU's fused module's (0 where nothing was built). Two shapes of a dynamic graph with the
    /// same key ran the same kernels.
    pub fn code_key(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return gpu.code_key();
        }
        self.native.as_ref().map_or(0, |n| n.key)
    }

    /// On the CPU: the fusion groups, and how many run as native code.
    pub fn native_groups(&self) -> Option<(usize, usize)> {
        let native = self.native.as_ref().map_or(0, |n| n.groups.iter().filter(|g| g.is_some()).count());
        let groups = self.plan.groups.iter().filter(|g| !g.members.is_empty()).count();
        (self.device == Device::Cpu).then_some((groups, native))
    }

    /// Products made where their reader needs them: on the CPU tile by tile for their group
    /// (`fusion::feed_products`), on a GPU inside the kernel that reads them (`feed_gpu_products`).
    pub fn fed_products(&self) -> usize {
        self.fed.iter().filter(|&&f| f).count() + self.plan.fed.len()
    }

    /// Kernels one step launches: plain nodes that compute, plus one per fused group.
    pub fn kernels(&self) -> usize {
        self.plan
            .steps
            .iter()
            .filter(|s| match s {
                Step::Groups(_) => true,
                Step::Node(i) => {
                    !matches!(self.graph.nodes[*i].kind, Kind::Input(_) | Kind::State(_))
                        && self.consts[*i].is_none()
                        && !self.made_with[*i]
                }
            })
            .count()
    }

    fn run_node(
        &self,
        i: NodeId,
        vals: &[Option<Arc<StorageCell>>],
        inputs: &[Arc<StorageCell>],
        gen: GeneratorState,
    ) -> Result<Arc<StorageCell>> {
        let node = &self.graph.nodes[i];
        let meta = OutMeta { shape: node.shape.clone(), dtype: node.dtype };
        let val = |n: NodeId| computed(vals, n);
        Ok(match &node.kind {
            Kind::Input(k) => inputs[*k].clone(),
            Kind::State(s) => self.cells[*s].clone(),
            Kind::Op(op, args) if self.device.is_cuda() => {
                // The eager kernels, through the one dispatch point (no tracer, no grad here).
                let ts = arg_tensors(args, vals)?;
                let refs: Vec<&Tensor> = ts.iter().collect();
                Tensor::apply(op.clone(), &refs, self.device)?.storage().clone()
            }
            Kind::Op(op, args) => {
                let cells: Vec<(&Arc<StorageCell>, &Layout)> = args.iter().map(|a| Ok((val(a.node)?, &a.layout))).collect::<Result<_>>()?;
                new_cell(with_args(&cells, |ins| cpu::run(op, ins, &meta))?)
            }
            #[cfg(feature = "cuda")]
            Kind::Rand { dist, offset } if self.device.is_cuda() => self.gpu()?.rand(*dist, *offset, &meta)?,
            Kind::Rand { dist, offset } => {
                let op =
                    Op::Rand { shape: node.shape.clone(), dist: *dist, seed: gen.seed, offset: gen.offset + offset, dtype: node.dtype };
                new_cell(cpu::run(&op, &[], &meta)?)
            }
            Kind::WriteView { base, layout, value } => {
                let copy = Tensor::from_cell(val(*base)?.clone(), Layout::contiguous(&self.graph.nodes[*base].shape)).copy()?;
                let v = Tensor::from_cell(val(value.node)?.clone(), value.layout.clone());
                Tensor::from_cell(copy.storage().clone(), layout.clone()).apply_inplace(Op::Assign, Some(&v))?;
                copy.storage().clone()
            }
        })
    }

    /// Layer norm's backward `i` with its `copy`: the flat output and the copy, from one kernel
    /// on a GPU (`kiln_tensor::fused::layer_norm_grads_with_copy`).
    fn run_with_copy(&self, i: NodeId, vals: &[Option<Arc<StorageCell>>]) -> Result<(Arc<StorageCell>, Arc<StorageCell>)> {
        let Kind::Op(op, args) = &self.graph.nodes[i].kind else { return Err(Error::Msg(format!("compile: node {i} is no op"))) };
        let ts = arg_tensors(args, vals)?;
        let (flat, copy) = kiln_tensor::fused::layer_norm_grads_with_copy(op, &ts.iter().collect::<Vec<_>>())?;
        Ok((flat.storage().clone(), copy.storage().clone()))
    }

    /// Product `p` (step `k`) made tile by tile for the group of step `k + 1`, which consumes
    /// each tile as it is made. Returns the product's cell and the group's.
    fn run_fed(&self, p: NodeId, k: usize, vals: &[Option<Arc<StorageCell>>]) -> Result<Vec<(NodeId, Arc<StorageCell>)>> {
        let node = &self.graph.nodes[p];
        let (Kind::Op(op, args), Some(Step::Groups(gs))) = (&node.kind, self.plan.steps.get(k + 1)) else {
            return Err(Error::Msg(format!("compile: step {k} is not a product before a group")));
        };
        let val = |n: NodeId| computed(vals, n).cloned();
        let arg_cells: Vec<Arc<StorageCell>> = args.iter().map(|a| val(a.node)).collect::<Result<_>>()?;
        let cells: Vec<(&Arc<StorageCell>, &Layout)> = arg_cells.iter().zip(args).map(|(c, a)| (c, &a.layout)).collect();
        let meta = OutMeta { shape: node.shape.clone(), dtype: node.dtype };
        // Tiles of at most about 64K elements (the gradient tile and the state it updates stay
        // in L2), as many as a multiple of the threads so that none waits on a short last one;
        // a small product is one tile (splitting it costs more than it saves).
        let [rows, depth] = [args[0].layout.shape[0].max(1), args[0].layout.shape[1]];
        let (cols, threads) = (args[1].layout.shape[1].max(1), rayon::current_num_threads());
        let tiles = match rows * cols * depth >= PAR_FED_FLOPS {
            true => (rows * cols).div_ceil(65536).next_multiple_of(threads).min(rows),
            false => 1,
        };
        let tile = rows.div_ceil(tiles);
        let mut product: Option<CpuStorage> = None;
        let mut run = |after: &cpu::matmul::TileFn| -> Result<()> {
            product = with_args(&cells, |ins| cpu::matmul_by_tiles(op, ins, &meta, tile, after))?;
            Ok(())
        };
        let feed = fused_exec::Feed { node: p, run: &mut run };
        let native = self.native.as_ref().and_then(|n| n.groups[gs[0]].as_ref());
        let mut made = fused_exec::run_group(&self.graph, &self.plan.groups[gs[0]], &self.cells, &val, native, Some(feed))?;
        let product = product.ok_or_else(|| Error::Msg(format!("compile: node {p} is not a product made by tiles")))?;
        made.push((p, new_cell(product)));
        Ok(made)
    }

    /// A write into a view of a base that another write made and nothing reads after this
    /// step: done in the base's own buffer, no copy.
    fn write_in_place(&self, i: NodeId, k: usize, vals: &[Option<Arc<StorageCell>>]) -> Result<Option<Arc<StorageCell>>> {
        let Kind::WriteView { base, layout, value } = &self.graph.nodes[i].kind else { return Ok(None) };
        if !matches!(self.graph.nodes[*base].kind, Kind::WriteView { .. }) || self.last_use[*base] != k || value.node == *base {
            return Ok(None);
        }
        let (Some(b), Some(v)) = (&vals[*base], &vals[value.node]) else { return Ok(None) };
        let v = Tensor::from_cell(v.clone(), value.layout.clone());
        Tensor::from_cell(b.clone(), layout.clone()).apply_inplace(Op::Assign, Some(&v))?;
        Ok(Some(b.clone()))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn gpu(&self) -> Result<&crate::cuda_exec::GpuParts> {
        self.gpu.as_ref().ok_or_else(|| Error::Msg("compile: a CPU program ran a GPU step".into()))
    }

    /// One step: returns caller-owned copies of the outputs.
    pub fn run(&self, inputs: &[Arc<StorageCell>], gen: GeneratorState) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return gpu.run(self, inputs, gen);
        }
        // The whole step runs on a pool worker: its parallel kernels then start at once on the
        // awake team instead of each handing work from the caller's thread to sleeping workers
        // and waiting, which takes longer a region (on 2 vCPUs; BENCHMARKS.md).
        // Not in the diagnostic modes: profiling and anomaly detection are the caller thread's.
        let diagnosing = kiln_tensor::profile::enabled() || kiln_tensor::is_anomaly_detection();
        match rayon::current_thread_index().is_none() && !diagnosing {
            true => rayon::scope(|_| self.execute(inputs, gen, true)),
            false => self.execute(inputs, gen, true),
        }
    }

    /// Runs every step, returns the outputs (copies the caller owns with `copy_outputs`, else
    /// views of the program's buffers) and writes the state back.
    pub(crate) fn execute(&self, inputs: &[Arc<StorageCell>], gen: GeneratorState, copy_outputs: bool) -> Result<Vec<Tensor>> {
        let n = self.graph.nodes.len();
        let mut vals: Vec<Option<Arc<StorageCell>>> = vec![None; n];
        for (k, step) in self.plan.steps.iter().enumerate() {
            // On a GPU the kernels time themselves (`profile`); on the CPU, time each step here.
            let timer = (self.device == Device::Cpu && kiln_tensor::profile::enabled()).then(std::time::Instant::now);
            // A group fed by the product before it ran with that product.
            let ran_early = k > 0 && self.fed[k - 1];
            match step {
                Step::Groups(_) if ran_early => {}
                Step::Node(i) if self.fed[k] => {
                    for (m, c) in self.run_fed(*i, k, &vals)? {
                        vals[m] = Some(c);
                    }
                }
                // Made by its layer norm's step.
                Step::Node(i) if self.made_with[*i] => {}
                Step::Node(i) => match self.copies[*i] {
                    Some(c) => {
                        let (flat, copy) = self.run_with_copy(*i, &vals)?;
                        (vals[*i], vals[c]) = (Some(flat), Some(copy));
                    }
                    None => {
                        vals[*i] = Some(match &self.consts[*i] {
                            Some(c) => c.clone(),
                            None => match self.write_in_place(*i, k, &vals)? {
                                Some(c) => c,
                                None => self.run_node(*i, &vals, inputs, gen)?,
                            },
                        })
                    }
                },
                Step::Groups(gs) => {
                    let cell_of = |x: NodeId| computed(&vals, x).cloned();
                    let made = match self.device {
                        #[cfg(feature = "cuda")]
                        Device::Cuda(_) => self.gpu()?.run_groups(self, gs, &cell_of)?,
                        _ => {
                            let mut made = Vec::new();
                            for &gi in gs {
                                let native = self.native.as_ref().and_then(|n| n.groups[gi].as_ref());
                                let group = &self.plan.groups[gi];
                                made.extend(fused_exec::run_group(&self.graph, group, &self.cells, &cell_of, native, None)?);
                            }
                            made
                        }
                    };
                    for (m, c) in made {
                        vals[m] = Some(c);
                    }
                }
            }
            if let Some(t) = timer {
                if !ran_early {
                    kiln_tensor::profile::record(self.timed_label(k), t.elapsed().as_secs_f64());
                }
            }
            if kiln_tensor::is_anomaly_detection() {
                self.check_finite(step, &vals)?;
            }
            for &a in &self.reads[k] {
                if self.last_use[a] == k {
                    vals[a] = None;
                }
            }
        }
        let get = |n: NodeId| vals[n].clone().ok_or_else(|| Error::Msg(format!("compile: node {n} has no value")));
        let output = |a: &crate::graph::Arg| -> Result<Tensor> {
            let t = Tensor::from_cell(get(a.node)?, a.layout.clone());
            if copy_outputs {
                t.copy()
            } else {
                Ok(t)
            }
        };
        let outputs = self.graph.outputs.iter().map(output).collect::<Result<Vec<_>>>()?;
        for &(slot, node) in &self.writes {
            let (dst, src) = (&self.cells[slot], get(node)?);
            if Arc::ptr_eq(dst, &src) {
                continue;
            }
            let layout = Layout::contiguous(&[self.graph.state[slot].len]);
            let src = Tensor::from_cell(src, layout.clone());
            Tensor::from_cell(dst.clone(), layout).apply_inplace(Op::Assign, Some(&src))?;
        }
        Ok(outputs)
    }

    /// A step's name in profiles: the op, or the fused groups it runs.
    fn step_label(&self, step: &Step) -> String {
        match step {
            Step::Node(i) => match &self.graph.nodes[*i].kind {
                Kind::Op(op, _) => format!("{} {:?}", crate::graph::op_label(op), self.graph.nodes[*i].shape),
                Kind::Rand { .. } => "rand".into(),
                Kind::WriteView { .. } => "write_view".into(),
                Kind::Input(_) | Kind::State(_) => "input/state".into(),
            },
            Step::Groups(gs) => format!("fused groups {gs:?}"),
        }
    }

    /// A step's profile label, with a fed product named with its group.
    fn timed_label(&self, k: usize) -> String {
        match (self.fed.get(k), self.plan.steps.get(k + 1)) {
            (Some(true), Some(next)) => format!("{} + {}", self.step_label(&self.plan.steps[k]), self.step_label(next)),
            _ => self.step_label(&self.plan.steps[k]),
        }
    }

    /// Anomaly mode: the first kernel that makes NaN or infinity is an error naming its ops.
    fn check_finite(&self, step: &Step, vals: &[Option<Arc<StorageCell>>]) -> Result<()> {
        let made: Vec<NodeId> = match step {
            Step::Node(i) => vec![*i],
            Step::Groups(gs) => gs.iter().flat_map(|&k| self.plan.groups[k].materialize.clone()).collect(),
        };
        for i in made {
            let node = &self.graph.nodes[i];
            if !node.dtype.is_float() || matches!(node.kind, Kind::Input(_) | Kind::State(_)) {
                continue;
            }
            let Some(cell) = &vals[i] else { continue };
            let (bad, _) = Tensor::from_cell(cell.clone(), Layout::contiguous(&node.shape)).count_nan_inf()?;
            if bad > 0 {
                let what = match (&node.kind, step) {
                    (_, Step::Groups(gs)) => {
                        let k = gs.iter().find(|&&k| self.plan.groups[k].members.contains(&i)).unwrap_or(&gs[0]);
                        format!("fused group {k} ({} ops)", self.plan.groups[*k].members.len())
                    }
                    (Kind::Op(op, _), _) => crate::graph::op_label(op),
                    _ => "a kernel".into(),
                };
                return Err(Error::Msg(format!("anomaly: {what} produced {bad} NaN value(s) in node %{i} {:?}", node.shape)));
            }
        }
        Ok(())
    }

    /// Bytes the kernels of one step read and write (a fused group reads its externals and
    /// stores its materialised members once).
    pub fn bytes_moved(&self) -> usize {
        let g = &self.graph;
        let arg_bytes = |a: &crate::graph::Arg| a.layout.numel() * g.nodes[a.node].dtype.size_in_bytes();
        self.plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Node(i) if self.consts[*i].is_some() => 0,
                // A copy written by its layer norm's kernel: only the write.
                Step::Node(i) if self.made_with[*i] => g.node_bytes(*i),
                Step::Node(i) => match &g.nodes[*i].kind {
                    Kind::Op(_, args) => args.iter().map(arg_bytes).sum::<usize>() + g.node_bytes(*i),
                    Kind::Rand { .. } | Kind::WriteView { .. } => 2 * g.node_bytes(*i),
                    Kind::Input(_) | Kind::State(_) => 0,
                },
                Step::Groups(gs) => gs
                    .iter()
                    .map(|&k| {
                        let gr = &self.plan.groups[k];
                        let n: usize = gr.shape.iter().product();
                        let read = |a: &crate::graph::Arg| match self.plan.fed_operands(g, a) {
                            // A fed product reads its operands, not the product.
                            Some((x, y)) => arg_bytes(x) + y.map_or(0, arg_bytes),
                            None => n.min(a.layout.numel()) * g.nodes[a.node].dtype.size_in_bytes(),
                        };
                        gr.externals.iter().map(read).sum::<usize>() + gr.materialize.iter().map(|&m| g.node_bytes(m)).sum::<usize>()
                    })
                    .sum(),
            })
            .sum()
    }

    /// Peak bytes of intermediate buffers alive at once (state, inputs and values a fused
    /// group keeps in its scratch excluded).
    pub fn planned_peak_bytes(&self) -> usize {
        let computed = |i: NodeId| matches!(self.graph.nodes[i].kind, Kind::Op(..) | Kind::Rand { .. } | Kind::WriteView { .. });
        let (mut live, mut peak) = (0usize, 0usize);
        for (k, step) in self.plan.steps.iter().enumerate() {
            let made: Vec<NodeId> = match step {
                Step::Node(i) => vec![*i],
                Step::Groups(gs) => gs
                    .iter()
                    .flat_map(|&g| {
                        let gr = &self.plan.groups[g];
                        gr.materialize.iter().copied().filter(|m| !gr.inplace.iter().any(|x| x.0 == *m)).collect::<Vec<_>>()
                    })
                    .collect(),
            };
            live += made.iter().filter(|&&i| computed(i)).map(|&i| self.graph.node_bytes(i)).sum::<usize>();
            peak = peak.max(live);
            for &a in &self.reads[k] {
                if self.last_use[a] == k && computed(a) {
                    live = live.saturating_sub(self.graph.node_bytes(a));
                }
            }
        }
        peak
    }
}

#[cfg(feature = "cuda")]
impl crate::cuda_exec::Host for Program {
    fn graph(&self) -> &Graph {
        &self.graph
    }
    fn plan(&self) -> &Plan {
        &self.plan
    }
    fn cells(&self) -> &[Arc<StorageCell>] {
        &self.cells
    }
    fn device(&self) -> Device {
        self.device
    }
    fn execute(&self, inputs: &[Arc<StorageCell>], gen: GeneratorState, copy_outputs: bool) -> Result<Vec<Tensor>> {
        Program::execute(self, inputs, gen, copy_outputs)
    }
}

/// The input's buffer when it is contiguous and whole, else a contiguous copy's.
pub(crate) fn contiguous_cell(t: &Tensor) -> Result<std::sync::Arc<kiln_tensor::storage::StorageCell>> {
    kiln_tensor::lazy::check_cell(t.storage())?;
    if t.is_contiguous() && t.layout().offset == 0 && t.storage().len() == t.numel() {
        return Ok(t.storage().clone());
    }
    Ok(t.copy()?.storage().clone())
}
