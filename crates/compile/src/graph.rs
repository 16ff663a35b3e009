//! The graph IR: SSA over flat buffers. Every node produces one buffer (row-major, `shape`);
//! an argument reads a node through a `Layout`, so views cost nothing (they become index
//! arithmetic in the kernels). State (parameters, gradients, optimizer buffers, lr, step) is
//! read through `State` nodes and written back by `writes`.

use kiln_tensor::{DType, Distribution, Fused, Layout, Op};
use std::fmt;

pub type NodeId = usize;

#[derive(Debug, Clone, PartialEq)]
pub struct Arg {
    pub node: NodeId,
    pub layout: Layout,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// The i-th call input (contiguous).
    Input(usize),
    /// A persistent buffer, by slot in `Graph::state`.
    State(usize),
    /// A primitive op (never an in-place or view op) over its arguments.
    Op(Op, Vec<Arg>),
    /// Random numbers drawn at `generator offset + offset` when the step runs.
    Rand { dist: Distribution, offset: u64 },
    /// `base` with the region `layout` overwritten by `value` (a write into a view).
    WriteView { base: NodeId, layout: Layout, value: Arg },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub kind: Kind,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl Node {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// A source op that reads nothing and always makes the same values (`full`, `arange`):
    /// made once per program, never per step.
    pub fn is_const(&self) -> bool {
        matches!(&self.kind, Kind::Op(Op::Full { .. } | Op::Arange { .. }, args) if args.is_empty())
    }
    /// An input, state or a constant: what a step has before it computes anything.
    pub fn is_leaf(&self) -> bool {
        matches!(self.kind, Kind::Input(_) | Kind::State(_)) || self.is_const()
    }
    pub fn args(&self) -> Vec<NodeId> {
        match &self.kind {
            Kind::Input(_) | Kind::State(_) | Kind::Rand { .. } => vec![],
            Kind::Op(_, args) => args.iter().map(|a| a.node).collect(),
            Kind::WriteView { base, value, .. } => vec![*base, value.node],
        }
    }
}

/// Where a state slot's buffer came from (for `explain` and the logs).
#[derive(Debug, Clone, PartialEq)]
pub struct StateInfo {
    pub len: usize,
    pub dtype: DType,
    /// Created inside the traced step (lazily made optimizer state, gradients).
    pub created_in_step: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub state: Vec<StateInfo>,
    /// What the step returns.
    pub outputs: Vec<Arg>,
    /// `(state slot, node)`: the slot's buffer holds the node's value after the step.
    pub writes: Vec<(usize, NodeId)>,
    /// Values the generator offset advances by per step.
    pub rng_advance: u64,
}

impl Graph {
    /// The node reading each state slot, if any.
    pub fn state_nodes(&self) -> Vec<Option<NodeId>> {
        let mut by_slot = vec![None; self.state.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            if let Kind::State(s) = n.kind {
                by_slot[s] = Some(i);
            }
        }
        by_slot
    }

    /// The nodes reading each node, in order (once per argument).
    pub fn users(&self) -> Vec<Vec<NodeId>> {
        let mut users = vec![vec![]; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for a in n.args() {
                users[a].push(i);
            }
        }
        users
    }

    pub fn push(&mut self, kind: Kind, shape: Vec<usize>, dtype: DType) -> NodeId {
        self.nodes.push(Node { kind, shape, dtype });
        self.nodes.len() - 1
    }

    /// Checks SSA order, argument ranges and that every read stays inside its buffer.
    pub fn verify(&self) -> Result<(), String> {
        let in_bounds = |a: &Arg, at: usize| -> Result<(), String> {
            if a.node >= at {
                return Err(format!("node {at} reads node {} which is not defined before it", a.node));
            }
            let len = self.nodes[a.node].numel();
            let l = &a.layout;
            let last = l.last_index();
            if l.shape.iter().product::<usize>() > 0 && last >= len {
                return Err(format!("node {at} reads node {} (len {len}) past its end through {l:?}", a.node));
            }
            Ok(())
        };
        for (i, n) in self.nodes.iter().enumerate() {
            match &n.kind {
                Kind::Op(op, args) => {
                    if op.is_inplace() || op.is_view() {
                        return Err(format!("node {i}: {} must have been lowered", op.name()));
                    }
                    args.iter().try_for_each(|a| in_bounds(a, i))?
                }
                Kind::WriteView { base, value, .. } => {
                    if *base >= i {
                        return Err(format!("node {i} writes into node {base} defined after it"));
                    }
                    in_bounds(value, i)?
                }
                Kind::State(s) if *s >= self.state.len() => return Err(format!("node {i}: no state slot {s}")),
                _ => {}
            }
        }
        for a in &self.outputs {
            in_bounds(a, self.nodes.len())?;
        }
        for &(s, n) in &self.writes {
            if s >= self.state.len() || n >= self.nodes.len() || self.nodes[n].numel() != self.state[s].len {
                return Err(format!("bad state write: slot {s} <- node {n}"));
            }
        }
        Ok(())
    }

    /// Each collective node described: its kind, shape and dtype, its place in the step, and
    /// how many nodes lie between it and its first reader (what it can overlap).
    pub fn collectives(&self) -> Vec<String> {
        let n = self.nodes.len();
        let mut first_reader = vec![n; n];
        for (i, node) in self.nodes.iter().enumerate() {
            for a in node.args() {
                first_reader[a] = first_reader[a].min(i);
            }
        }
        let mut out = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let Kind::Op(op @ Op::Collective { group, .. }, _) = &node.kind else { continue };
            let gap = match first_reader[i] {
                r if r == n => "read only after the step".to_string(),
                r => format!("{} nodes before its first reader", r - i - 1),
            };
            let (name, shape, dtype) = (op.name(), &node.shape, node.dtype);
            out.push(format!("{name} {shape:?} {dtype:?} over {} ranks at node {i} of {n}, {gap}", group.world));
        }
        out
    }

    /// Nodes whose value is used (by outputs, writes or live nodes).
    pub fn live(&self) -> Vec<bool> {
        let mut live = vec![false; self.nodes.len()];
        let mut stack: Vec<NodeId> = self.outputs.iter().map(|a| a.node).chain(self.writes.iter().map(|w| w.1)).collect();
        while let Some(n) = stack.pop() {
            if !std::mem::replace(&mut live[n], true) {
                stack.extend(self.nodes[n].args());
            }
        }
        live
    }

    /// Bytes of all node buffers that are not state or inputs.
    pub fn node_bytes(&self, n: NodeId) -> usize {
        self.nodes[n].numel() * self.nodes[n].dtype.size_in_bytes()
    }
}

fn fmt_arg(a: &Arg, g: &Graph) -> String {
    let n = &g.nodes[a.node];
    if a.layout.shape == n.shape && a.layout.is_contiguous() && a.layout.offset == 0 {
        format!("%{}", a.node)
    } else {
        format!("%{}{:?}@{:?}+{}", a.node, a.layout.shape, a.layout.strides, a.layout.offset)
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.nodes.iter().enumerate() {
            let rhs = match &n.kind {
                Kind::Input(k) => format!("input {k}"),
                Kind::State(s) => format!("state {s}{}", if self.state[*s].created_in_step { " (made in step)" } else { "" }),
                Kind::Op(op, args) => {
                    let a: Vec<String> = args.iter().map(|a| fmt_arg(a, self)).collect();
                    if a.is_empty() {
                        op_label(op)
                    } else {
                        format!("{} {}", op_label(op), a.join(", "))
                    }
                }
                Kind::Rand { dist, offset } => format!("rand {dist:?} @+{offset}"),
                Kind::WriteView { base, layout, value } => {
                    format!("write %{base}[{:?}@{:?}+{}] = {}", layout.shape, layout.strides, layout.offset, fmt_arg(value, self))
                }
            };
            writeln!(f, "%{i}: {:?}{:?} = {rhs}", n.dtype, n.shape)?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|a| fmt_arg(a, self)).collect();
        writeln!(f, "return {}", outs.join(", "))?;
        for (s, n) in &self.writes {
            writeln!(f, "state {s} <- %{n}")?;
        }
        Ok(())
    }
}

/// A short name with the op's parameters.
pub fn op_label(op: &Op) -> String {
    match op {
        Op::Unary(u) => u.name().to_string(),
        Op::Binary(b) => b.name().to_string(),
        Op::Scalar { op, value, scalar_lhs } => {
            if *scalar_lhs {
                format!("{}({value}, _)", op.name())
            } else {
                format!("{}(_, {value})", op.name())
            }
        }
        Op::Reduce { op, dims, keepdim } => format!("{}{dims:?}{}", op.name(), if *keepdim { " keepdim" } else { "" }),
        Op::Cast(d) => format!("cast {d:?}"),
        Op::Fused(Fused::NormalizeTo { to, .. }) => format!("{} {to:?}", op.name()),
        Op::Fused(Fused::LayerNormGrads { sums, copy, .. }) => {
            let part = |what: &str, d: &Option<DType>| d.map_or(String::new(), |d| format!(" {what} {d:?}"));
            format!("{}{}{}", op.name(), part("sums", sums), part("copy", copy))
        }
        Op::Full { value, .. } => format!("full {value}"),
        other => other.name().to_string(),
    }
}

/// Graphs for the passes' and the planner's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use kiln_tensor::{BinaryOp, DType, Layout, Op, ReduceOp};

    pub fn whole(g: &Graph, node: NodeId) -> Arg {
        Arg { node, layout: Layout::contiguous(&g.nodes[node].shape) }
    }

    /// A mean cross-entropy with ignored targets and its gradient's scale, as autograd records it.
    pub fn mean_loss() -> (Graph, [NodeId; 6]) {
        let mut g = Graph::default();
        let logits = g.push(Kind::Input(0), vec![4, 3], DType::F32);
        let targets = g.push(Kind::Input(1), vec![4], DType::I64);
        let ce = Op::CrossEntropy { ignore_index: Some(-100), smoothing: 0.0 };
        let rows = g.push(Kind::Op(ce, vec![whole(&g, logits), whole(&g, targets)]), vec![4], DType::F32);
        let sum = || Op::Reduce { op: ReduceOp::Sum, dims: vec![0], keepdim: false };
        let total = g.push(Kind::Op(sum(), vec![whole(&g, rows)]), vec![], DType::F32);
        let ne = Op::Scalar { op: BinaryOp::Ne, value: -100.0, scalar_lhs: false };
        let real = g.push(Kind::Op(ne, vec![whole(&g, targets)]), vec![4], DType::U8);
        let real_f = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, real)]), vec![4], DType::F32);
        let count = g.push(Kind::Op(sum(), vec![whole(&g, real_f)]), vec![], DType::F32);
        let div = Op::Binary(BinaryOp::Div);
        let loss = g.push(Kind::Op(div.clone(), vec![whole(&g, total), whole(&g, count)]), vec![], DType::F32);
        let one = g.push(Kind::Op(Op::Full { shape: vec![], value: 1.0, dtype: DType::F32 }, vec![]), vec![], DType::F32);
        let scale = g.push(Kind::Op(div, vec![whole(&g, one), whole(&g, count)]), vec![], DType::F32);
        let row_scale = Arg { node: scale, layout: Layout { shape: vec![4], strides: vec![0], offset: 0 } };
        let ceb = Op::CrossEntropyBackward { ignore_index: Some(-100), smoothing: 0.0 };
        let dlogits = g.push(Kind::Op(ceb, vec![whole(&g, logits), whole(&g, targets), row_scale]), vec![4, 3], DType::F32);
        g.outputs = vec![whole(&g, loss), whole(&g, dlogits)];
        (g, [total, real, real_f, count, loss, scale])
    }
}
