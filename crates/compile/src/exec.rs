//! The CPU back end: runs a graph's nodes in order with Kiln's CPU kernels, reading every
//! argument through its layout (views cost nothing), freeing each buffer after its last use,
//! and writing state back into the same buffers at the end.

use crate::graph::{Graph, Kind, NodeId};
use kiln_tensor::op::OutMeta;
use kiln_tensor::rng::GeneratorState;
use kiln_tensor::storage::{CpuStorage, Storage, StorageCell};
use kiln_tensor::{cpu, Error, Layout, Op, Result, Tensor};
use std::sync::{Arc, RwLockReadGuard};

pub struct CpuProgram {
    pub graph: Graph,
    pub cells: Vec<Arc<StorageCell>>,
    /// For each node, the last node that reads it (buffers are freed after it).
    last_use: Vec<usize>,
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

fn new_cell(s: CpuStorage) -> Arc<StorageCell> {
    Arc::new(StorageCell::new(Storage::Cpu(s)))
}

impl CpuProgram {
    pub fn new(graph: Graph, cells: Vec<Arc<StorageCell>>) -> CpuProgram {
        let mut last_use: Vec<usize> = (0..graph.nodes.len()).collect();
        for (i, n) in graph.nodes.iter().enumerate() {
            for a in n.args() {
                last_use[a] = i;
            }
        }
        // Outputs and state writes are read after every node.
        for a in graph.outputs.iter().map(|a| a.node).chain(graph.writes.iter().map(|w| w.1)) {
            last_use[a] = usize::MAX;
        }
        CpuProgram { graph, cells, last_use }
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
        let val = |n: NodeId| vals[n].as_ref().ok_or_else(|| Error::Msg(format!("compile: node {n} used before it was computed")));
        Ok(match &node.kind {
            Kind::Input(k) => inputs[*k].clone(),
            Kind::State(s) => self.cells[*s].clone(),
            Kind::Op(op, args) => {
                let cells: Vec<(&Arc<StorageCell>, &Layout)> = args.iter().map(|a| Ok((val(a.node)?, &a.layout))).collect::<Result<_>>()?;
                new_cell(with_args(&cells, |ins| cpu::run(op, ins, &meta))?)
            }
            Kind::Rand { dist, offset } => {
                let op =
                    Op::Rand { shape: node.shape.clone(), dist: *dist, seed: gen.seed, offset: gen.offset + offset, dtype: node.dtype };
                new_cell(cpu::run(&op, &[], &meta)?)
            }
            Kind::WriteView { base, layout, value } => {
                let b = val(*base)?;
                let flat = Layout::contiguous(&self.graph.nodes[*base].shape);
                let mut copy = with_args(&[(b, &flat)], |ins| {
                    cpu::run(&Op::Contiguous, ins, &OutMeta { shape: flat.shape.clone(), dtype: node.dtype })
                })?;
                with_args(&[(val(value.node)?, &value.layout)], |ins| cpu::run_inplace(&Op::Assign, &mut copy, layout, Some(ins[0])))?;
                new_cell(copy)
            }
        })
    }

    /// One step: returns caller-owned copies of the outputs.
    pub fn run(&self, inputs: &[Arc<StorageCell>], gen: GeneratorState) -> Result<Vec<Tensor>> {
        let n = self.graph.nodes.len();
        let mut vals: Vec<Option<Arc<StorageCell>>> = vec![None; n];
        for i in 0..n {
            vals[i] = Some(self.run_node(i, &vals, inputs, gen)?);
            for a in self.graph.nodes[i].args() {
                if self.last_use[a] == i {
                    vals[a] = None;
                }
            }
        }
        let get = |n: NodeId| vals[n].clone().ok_or_else(|| Error::Msg(format!("compile: node {n} has no value")));
        let outputs =
            self.graph.outputs.iter().map(|a| Tensor::from_cell(get(a.node)?, a.layout.clone()).copy()).collect::<Result<Vec<_>>>()?;
        // Writes whose value is another state buffer go first, before that buffer changes.
        let mut writes = self.graph.writes.clone();
        writes.sort_by_key(|&(_, n)| !matches!(self.graph.nodes[n].kind, Kind::State(_) | Kind::Input(_)));
        for (slot, node) in writes {
            let (dst, src) = (&self.cells[slot], get(node)?);
            if Arc::ptr_eq(dst, &src) {
                continue;
            }
            let layout = Layout::contiguous(&[self.graph.state[slot].len]);
            let guard = src.read();
            let mut out = dst.write();
            cpu::run_inplace(&Op::Assign, out.as_cpu_mut()?, &layout, Some((guard.as_cpu()?, &layout)))?;
        }
        Ok(outputs)
    }

    /// Peak bytes of intermediate buffers alive at once (state and inputs excluded).
    pub fn planned_peak_bytes(&self) -> usize {
        let (mut live, mut peak) = (0usize, 0usize);
        for (i, node) in self.graph.nodes.iter().enumerate() {
            if matches!(node.kind, Kind::Op(..) | Kind::Rand { .. } | Kind::WriteView { .. }) {
                live += self.graph.node_bytes(i);
                peak = peak.max(live);
            }
            for a in node.args() {
                if self.last_use[a] == i && matches!(self.graph.nodes[a].kind, Kind::Op(..) | Kind::Rand { .. } | Kind::WriteView { .. }) {
                    live -= self.graph.node_bytes(a);
                }
            }
        }
        peak
    }
}
