//! From a recording to the graph: storages become SSA values (each write makes a new node),
//! views become argument layouts, in-place ops become pure ops plus a state write, random
//! draws become offsets relative to the generator, and storages the step created that outlive
//! it (lazily made optimizer state, gradients) become state.

use crate::graph::{Arg, Graph, Kind, NodeId, StateInfo};
use crate::trace::{GradAtStart, Recording, TRef};
use kiln_tensor::rng::GeneratorState;
use kiln_tensor::storage::StorageCell;
use kiln_tensor::{Error, Layout, Op, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// A parameter whose `.grad()` the step reads or sets.
pub struct LeafGrad {
    pub leaf: Tensor,
    /// Its gradient when the step first touched it (a guard: a change retraces, unless the
    /// step cleared it first).
    pub at_start: GradAtStart,
    /// The storage of that starting gradient.
    pub start_storage: Option<u64>,
    /// Where its gradient lives after the step: a state slot read through a layout.
    pub end: Option<(usize, Layout)>,
}

pub struct Lowered {
    pub graph: Graph,
    /// The buffer of each state slot.
    pub cells: Vec<Arc<StorageCell>>,
    pub leaf_grads: Vec<LeafGrad>,
    /// Tensors made from host data inside the step, now constants of the graph.
    pub baked: Vec<String>,
}

struct Builder<'a> {
    rec: &'a Recording,
    g: Graph,
    cur: HashMap<u64, NodeId>,
    slot_of: HashMap<u64, usize>,
    cells: Vec<Arc<StorageCell>>,
    inputs: HashMap<u64, usize>,
    first_node: HashMap<u64, NodeId>,
    first_new_storage: u64,
    baked: Vec<String>,
}

impl Builder<'_> {
    fn slot(&mut self, s: u64, created_in_step: bool) -> Result<usize> {
        if let Some(&k) = self.slot_of.get(&s) {
            return Ok(k);
        }
        let info = &self.rec.storages[&s];
        let cell = info.cell.upgrade().ok_or_else(|| Error::Msg("compile: a buffer the step reads was freed during the step".into()))?;
        self.g.state.push(StateInfo { len: info.len, dtype: info.dtype, created_in_step });
        self.cells.push(cell);
        self.slot_of.insert(s, self.g.state.len() - 1);
        Ok(self.g.state.len() - 1)
    }

    /// The node holding storage `s` now, making an input or state node on first use.
    fn value(&mut self, s: u64) -> Result<NodeId> {
        if let Some(&n) = self.cur.get(&s) {
            return Ok(n);
        }
        let info = &self.rec.storages[&s];
        let (len, dtype) = (info.len, info.dtype);
        let kind = match self.inputs.get(&s) {
            Some(&k) => Kind::Input(k),
            None => {
                if s >= self.first_new_storage {
                    self.baked.push(format!("a {dtype:?} tensor of {len} elements"));
                }
                Kind::State(self.slot(s, false)?)
            }
        };
        let n = self.g.push(kind, vec![len], dtype);
        self.cur.insert(s, n);
        Ok(n)
    }

    fn arg(&mut self, r: &TRef) -> Result<Arg> {
        Ok(Arg { node: self.value(r.storage)?, layout: r.layout.clone() })
    }

    fn define(&mut self, out: &TRef, kind: Kind) {
        let n = self.g.push(kind, out.layout.shape.clone(), out.dtype);
        self.cur.insert(out.storage, n);
        self.first_node.entry(out.storage).or_insert(n);
    }

    /// An in-place op as a pure op, then the destination's storage takes its value.
    fn inplace(&mut self, op: &Op, inputs: &[TRef]) -> Result<()> {
        let dst = &inputs[0];
        let d = self.arg(dst)?;
        let shape = dst.layout.shape.clone();
        let pure = match op {
            Op::Assign => {
                let src = &inputs[1];
                let node = self.value(src.storage)?;
                let layout = Layout { shape: shape.clone(), strides: src.layout.broadcast_strides(&shape), offset: src.layout.offset };
                Kind::Op(Op::Contiguous, vec![Arg { node, layout }])
            }
            Op::UpdateBinary(b) => Kind::Op(Op::Binary(*b), vec![d.clone(), self.arg(&inputs[1])?]),
            Op::UpdateScalar(b, v) => Kind::Op(Op::Scalar { op: *b, value: *v, scalar_lhs: false }, vec![d.clone()]),
            other => return Err(Error::Msg(format!("compile: {} is not in-place", other.name()))),
        };
        let v = self.g.push(pure, shape.clone(), dst.dtype);
        let len = self.rec.storages[&dst.storage].len;
        let l = &dst.layout;
        let covers = l.offset == 0 && l.is_contiguous() && l.numel() == len;
        let n = if covers {
            v
        } else {
            let value = Arg { node: v, layout: Layout::contiguous(&shape) };
            self.g.push(Kind::WriteView { base: d.node, layout: l.clone(), value }, vec![len], dst.dtype)
        };
        self.cur.insert(dst.storage, n);
        Ok(())
    }
}

/// Builds the graph of a recorded step.
pub fn lower(
    rec: &Recording,
    inputs: &[Tensor],
    outputs: &[Tensor],
    gen: (GeneratorState, GeneratorState),
    first_new_storage: u64,
) -> Result<Lowered> {
    let mut b = Builder {
        rec,
        g: Graph::default(),
        cur: HashMap::new(),
        slot_of: HashMap::new(),
        cells: Vec::new(),
        inputs: inputs.iter().enumerate().map(|(k, t)| (t.storage().id(), k)).collect(),
        first_node: HashMap::new(),
        first_new_storage,
        baked: Vec::new(),
    };
    let (g0, g1) = gen;
    for ev in &rec.events {
        match &ev.op {
            Op::Rand { dist, seed, offset, .. } => {
                if *seed != g0.seed {
                    return Err(Error::Msg("compile: the generator was reseeded inside the step".into()));
                }
                b.define(&ev.output, Kind::Rand { dist: *dist, offset: offset - g0.offset });
            }
            op if op.is_view() => {
                // A view shares its input's storage; a reshape the strides could not express
                // made a copy.
                if ev.output.storage != ev.inputs[0].storage {
                    let a = b.arg(&ev.inputs[0])?;
                    b.define(&ev.output, Kind::Op(Op::Contiguous, vec![a]));
                }
            }
            op if op.is_inplace() => b.inplace(op, &ev.inputs)?,
            op => {
                let args = ev.inputs.iter().map(|r| b.arg(r)).collect::<Result<Vec<_>>>()?;
                b.define(&ev.output, Kind::Op(op.clone(), args));
            }
        }
    }
    b.g.rng_advance = g1.offset - g0.offset;
    for t in outputs {
        let r = TRef { storage: t.storage().id(), layout: t.layout().clone(), dtype: t.dtype() };
        let a = b.arg(&r)?;
        b.g.outputs.push(a);
    }
    // Leaves' gradients at the end of the step are state the step leaves behind.
    let mut leaf_grads = Vec::new();
    for (leaf, at_start) in &rec.leaves {
        let end = match leaf.grad() {
            Some(gr) => {
                let s = gr.storage().id();
                let created = rec.storages.get(&s).is_some_and(|i| i.created_by.is_some());
                if !rec.storages.contains_key(&s) {
                    None // a gradient the step never touched stays as it is
                } else {
                    Some((b.slot(s, created)?, gr.layout().clone()))
                }
            }
            None => None,
        };
        let start_storage = if *at_start == GradAtStart::Present { end.as_ref().map(|(k, _)| b.cells[*k].id()) } else { None };
        leaf_grads.push(LeafGrad { leaf: leaf.clone(), at_start: *at_start, start_storage, end });
    }
    // Storages made in the step by a source op that outlive it (optimizer state created on the
    // first step) start from their current contents on later steps.
    let mut made: Vec<(u64, NodeId)> = b.first_node.iter().map(|(&s, &n)| (s, n)).collect();
    made.sort_unstable();
    for (s, first) in made {
        let info = &rec.storages[&s];
        let alive = info.cell.strong_count() > 0;
        let is_source = matches!(&b.g.nodes[first].kind, Kind::Op(Op::Full { .. } | Op::Arange { .. }, _));
        if alive && is_source && !b.inputs.contains_key(&s) && !outputs.iter().any(|t| t.storage().id() == s) {
            let k = b.slot(s, true)?;
            b.g.nodes[first].kind = Kind::State(k);
        }
    }
    // Every state buffer whose value changed is written back.
    let mut slots: Vec<(u64, usize)> = b.slot_of.iter().map(|(&s, &k)| (s, k)).collect();
    slots.sort_unstable_by_key(|x| x.1);
    for (s, k) in slots {
        if let Some(&n) = b.cur.get(&s) {
            if b.g.nodes[n].kind != Kind::State(k) {
                b.g.writes.push((k, n));
            }
        }
    }
    normalise_writes(&mut b.g);
    Ok(Lowered { graph: b.g, cells: b.cells, leaf_grads, baked: b.baked })
}

/// A state write needs a node of the buffer's length; views of state written whole become
/// contiguous copies.
fn normalise_writes(g: &mut Graph) {
    for w in 0..g.writes.len() {
        let (k, n) = g.writes[w];
        if g.nodes[n].numel() != g.state[k].len {
            let shape = vec![g.state[k].len];
            let dtype = g.nodes[n].dtype;
            let a = Arg { node: n, layout: Layout::contiguous(&g.nodes[n].shape.clone()) };
            let c = g.push(Kind::Op(Op::Contiguous, vec![a]), shape, dtype);
            g.writes[w].1 = c;
        }
    }
}
