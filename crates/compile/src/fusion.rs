//! Pointwise fusion for the CPU back end. Chains of elementwise ops over one shape become a
//! group evaluated chunk by chunk: each chunk's inputs are loaded once (any layout, so views
//! and broadcasts cost nothing), every op runs over the chunk in cache, and only values used
//! outside the group are stored. A group's result that is written back to state goes
//! straight into the state buffer when nothing else still needs the old contents, which is
//! how the optimizer update becomes one pass over each parameter.
//!
//! A group runs at its last member's position. A group closes as soon as a node outside it
//! reads one of its values, so every outside reader runs after the group has run.

use crate::graph::{Arg, Graph, Kind, NodeId};
use kiln_tensor::op::{Part, Parts};
use kiln_tensor::{DType, Fused, MatmulEpilogue, Op, ReduceOp};

#[derive(Debug, Clone)]
pub struct Group {
    pub members: Vec<NodeId>,
    pub shape: Vec<usize>,
    /// Computes in f64 (F64 graphs) rather than f32.
    pub f64: bool,
    /// Distinct reads of values computed outside the group.
    pub externals: Vec<Arg>,
    /// Members whose values are needed after the group.
    pub materialize: Vec<NodeId>,
    /// Members written straight into a state slot.
    pub inplace: Vec<(NodeId, usize)>,
    /// Ends in full sums folded by one block (GPU only, `full_sum`): members after a sum are
    /// single values computed once.
    pub folds: bool,
    /// Leads its launch (GPU only, `lead_scalar_groups`): a scalar group that every thread of
    /// the launch's kernel computes first, so that the other groups read it from registers.
    pub lead: bool,
}

impl Group {
    /// An empty group over `shape`.
    fn new(shape: Vec<usize>, f64: bool, folds: bool) -> Group {
        Group { members: vec![], shape, f64, externals: vec![], materialize: vec![], inplace: vec![], folds, lead: false }
    }
}

#[derive(Debug, Clone)]
pub enum Step {
    Node(NodeId),
    /// Fused groups run together: one group, or (on a GPU, `batch_groups`) several
    /// independent ones launched as one kernel.
    Groups(Vec<usize>),
}

#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    pub groups: Vec<Group>,
    /// Products no step makes: the groups reading them compute them (GPU only,
    /// `feed_gpu_products`), reading the products' operands instead.
    pub fed: Vec<NodeId>,
}

impl Plan {
    /// The nodes a step reads.
    pub fn reads(&self, g: &Graph, step: &Step) -> Vec<NodeId> {
        match step {
            Step::Node(i) => g.nodes[*i].args(),
            Step::Groups(gs) => gs
                .iter()
                .flat_map(|&k| &self.groups[k].externals)
                .flat_map(|a| match self.fed_operands(g, a) {
                    Some((x, y)) => std::iter::once(x.node).chain(y.map(|y| y.node)).collect(),
                    None => vec![a.node],
                })
                .collect(),
        }
    }

    /// For a read of a fed product (`feed_gpu_products`), the operands the reading group
    /// computes it from: a and b for the product (at offset 0), a alone for `SumLeft`'s sums.
    pub fn fed_operands<'g>(&self, g: &'g Graph, read: &Arg) -> Option<(&'g Arg, Option<&'g Arg>)> {
        if !self.fed.contains(&read.node) {
            return None;
        }
        match &g.nodes[read.node].kind {
            Kind::Op(_, args) if args.len() == 2 => Some((&args[0], (read.layout.offset == 0).then_some(&args[1]))),
            _ => None,
        }
    }
}

/// The float type a pointwise node computes in, if it can join a group. On a GPU every
/// member computes in its own type (as the eager kernel would, without rounding f16/bf16
/// intermediates), so any pointwise op joins except casts to integers (whose saturating
/// conversion is the eager kernel's).
fn compute_class(g: &Graph, i: NodeId, gpu: bool) -> Option<DType> {
    let n = &g.nodes[i];
    let Kind::Op(op, args) = &n.kind else { return None };
    if gpu {
        let joins = match op {
            Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Where | Op::Contiguous => true,
            Op::Cast(to) => to.is_float(),
            _ => false,
        };
        return joins.then_some(DType::F32);
    }
    let pointwise = match op {
        Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Where => true,
        Op::Cast(to) => matches!(to, DType::F32 | DType::F64),
        _ => false,
    };
    let float_of = |d: DType| matches!(d, DType::F32 | DType::F64).then_some(d);
    let floats: Vec<DType> = args.iter().filter_map(|a| float_of(g.nodes[a.node].dtype)).collect();
    let others_ok = args.iter().all(|a| matches!(g.nodes[a.node].dtype, DType::F32 | DType::F64 | DType::U8));
    let class = match n.dtype {
        // A cast of an f64 value to F32 computes in f64 and rounds (an optimizer's f64
        // scalars end in the kernel that makes them, with their casts).
        DType::F32 if matches!(op, Op::Cast(_)) && floats == [DType::F64] => Some(DType::F64),
        DType::F32 | DType::F64 => Some(n.dtype),
        DType::U8 if matches!(op, Op::Binary(b) | Op::Scalar { op: b, .. } if b.is_comparison()) => floats.first().copied(),
        _ => None,
    }?;
    // Casts change class; everything else keeps one float type throughout.
    let same = matches!(op, Op::Cast(_)) || floats.iter().all(|&f| f == class);
    (pointwise && others_ok && same).then_some(class)
}

/// Whether member `op` of a group rounds to f32 inside it: an f64 group's cast to F32 (which
/// `compute_class` lets join the group of the f64 value it casts) rounds as the eager cast
/// does, and the group goes on in f64. Both CPU executors follow it.
pub(crate) fn rounds_to_f32(op: &Op, group_f64: bool) -> bool {
    group_f64 && matches!(op, Op::Cast(DType::F32))
}

/// Elements a folding group may loop over: one block of 256 threads, up to 128 elements
/// each, is cheaper than a separate reduction launch below this size.
const FOLD_MAX: usize = 1 << 15;

/// A sum joins an existing group of more than `FOLD_JOIN_MEMBERS` members only below
/// `FOLD_JOIN_ANY` elements.
const FOLD_JOIN_MEMBERS: usize = 8;
const FOLD_JOIN_ANY: usize = 4096;

/// On a GPU, a sum of every element of a small float tensor: it can end the group that makes
/// its argument, and scalar ops on the sum can follow it in the same kernel.
fn full_sum(g: &Graph, i: NodeId) -> Option<&Arg> {
    let n = &g.nodes[i];
    let float = |d: DType| matches!(d, DType::F32 | DType::F64);
    match &n.kind {
        Kind::Op(Op::Reduce { op: ReduceOp::Sum, .. }, args) if args.len() == 1 && n.numel() == 1 && float(n.dtype) => {
            let a = &args[0];
            (float(g.nodes[a.node].dtype) && (2..=FOLD_MAX).contains(&a.layout.numel())).then_some(a)
        }
        _ => None,
    }
}

fn identity(a: &Arg, shape: &[usize]) -> bool {
    a.layout.offset == 0 && a.layout.shape == shape && a.layout.is_contiguous()
}

/// Groups for the CPU back end, or with `gpu` for generated CUDA kernels. A `generic`
/// (dynamic-shape) program folds no sums into one block: whether that pays depends on the
/// size, and the same groups must serve every size.
pub fn plan(g: &Graph, gpu: bool, generic: bool) -> Plan {
    let n = g.nodes.len();
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut groups: Vec<Group> = Vec::new();
    let mut open: Vec<bool> = Vec::new();
    // Values a folding group computes after its sums (the sums and scalar ops on them).
    let mut after_fold: Vec<bool> = vec![false; n];
    // Casts a layer norm's backward makes beside its output (`passes::ln_dx_copies`): no group.
    let mut made_with = vec![false; n];
    crate::passes::dx_copies(g).into_iter().flatten().for_each(|c| made_with[c] = true);
    for i in 0..n {
        let args: Vec<&Arg> = match &g.nodes[i].kind {
            Kind::Op(_, a) => a.iter().collect(),
            Kind::WriteView { value, .. } => vec![value],
            _ => vec![],
        };
        let all_args = g.nodes[i].args();
        if gpu && !generic && fold(g, i, &mut groups, &mut group_of, &mut open, &mut after_fold) {
            // Joined (or started) a folding group.
        } else if let Some(class) = compute_class(g, i, gpu).filter(|_| !made_with[i]) {
            let shape = &g.nodes[i].shape;
            // Join the latest open group that feeds this node through whole, in-order reads.
            let joinable = |k: usize| {
                open[k]
                    && groups[k].shape == *shape
                    && groups[k].f64 == (class == DType::F64)
                    && args.iter().filter(|a| group_of[a.node] == Some(k)).all(|a| identity(a, shape))
            };
            // Every open group feeding it can merge into one: none has an outside reader yet,
            // so running them all at this node's position keeps every dependency in order.
            let mut targets: Vec<usize> = args.iter().filter_map(|a| group_of[a.node]).filter(|&k| joinable(k)).collect();
            targets.sort_unstable();
            targets.dedup();
            let k = match targets.split_first() {
                Some((&first, rest)) => {
                    merge(&mut groups, &mut group_of, &mut open, first, rest);
                    first
                }
                None => {
                    groups.push(Group::new(shape.clone(), class == DType::F64, false));
                    open.push(true);
                    groups.len() - 1
                }
            };
            groups[k].members.push(i);
            group_of[i] = Some(k);
        }
        for a in all_args {
            if let Some(h) = group_of[a] {
                if group_of[i] != Some(h) {
                    open[h] = false;
                }
            }
        }
    }
    finish(g, groups, group_of, gpu)
}

/// Moves the members of groups `rest` into group `first` (all open, none read from outside yet).
fn merge(groups: &mut [Group], group_of: &mut [Option<usize>], open: &mut [bool], first: usize, rest: &[usize]) {
    for &other in rest {
        let moved = std::mem::take(&mut groups[other].members);
        for &m in &moved {
            group_of[m] = Some(first);
        }
        groups[first].members.extend(moved);
        groups[first].folds |= groups[other].folds;
        open[other] = false;
    }
    groups[first].members.sort_unstable();
}

/// GPU folds: a full sum (`full_sum`) ends the open group making its argument (or starts a
/// group reading it), and a scalar pointwise op whose folded arguments all come from open
/// folding groups of one shape joins them after the fold. Returns whether `i` joined.
fn fold(
    g: &Graph,
    i: NodeId,
    groups: &mut Vec<Group>,
    group_of: &mut [Option<usize>],
    open: &mut Vec<bool>,
    after_fold: &mut [bool],
) -> bool {
    if let Some(a) = full_sum(g, i) {
        // A sum ends its argument's group unless that group is large and busy, whose
        // elements many blocks would compute faster than one (the sum then folds alone).
        let light = |k: usize| groups[k].members.len() <= FOLD_JOIN_MEMBERS || a.layout.numel() <= FOLD_JOIN_ANY;
        let k = match group_of[a.node] {
            Some(k) if open[k] && !after_fold[a.node] && identity(a, &groups[k].shape) && light(k) => k,
            _ => {
                groups.push(Group::new(a.layout.shape.clone(), false, true));
                open.push(true);
                groups.len() - 1
            }
        };
        groups[k].folds = true;
        groups[k].members.push(i);
        group_of[i] = Some(k);
        after_fold[i] = true;
        return true;
    }
    let node = &g.nodes[i];
    let Kind::Op(_, args) = &node.kind else { return false };
    if node.numel() != 1 || compute_class(g, i, true).is_none() {
        return false;
    }
    let mut targets: Vec<usize> = args.iter().filter(|a| after_fold[a.node]).filter_map(|a| group_of[a.node]).collect();
    targets.sort_unstable();
    targets.dedup();
    let Some((&first, rest)) = targets.split_first() else { return false };
    // Every argument a single value: a folded one of a target, or one computed elsewhere.
    let fits = targets.iter().all(|&k| open[k] && groups[k].folds && groups[k].shape == groups[first].shape)
        && args.iter().all(|a| a.layout.numel() == 1 && (after_fold[a.node] || group_of[a.node].is_none_or(|k| !targets.contains(&k))));
    if !fits {
        return false;
    }
    merge(groups, group_of, open, first, rest);
    groups[first].members.push(i);
    group_of[i] = Some(first);
    after_fold[i] = true;
    true
}

/// Externals, materialised members, in-place state writes and the step order.
fn finish(g: &Graph, mut groups: Vec<Group>, mut group_of: Vec<Option<usize>>, gpu: bool) -> Plan {
    // Singletons gain nothing from the group path on the CPU: they run as plain kernels,
    // except ops built on `exp`/`erf`/`tanh`, whose native code runs wider vectors (`-march=native`)
    // than eager's AVX2 loops (as for GELU over the GPT's [1024, 512]).
    // On a GPU they stay groups: the generated kernel knows the shapes (index arithmetic by
    // constants) and independent ones share a launch (`batch_groups`).
    for gr in &mut groups {
        if gr.members.len() == 1 && !gpu && !matches!(&g.nodes[gr.members[0]].kind, Kind::Op(Op::Unary(u), _) if u.uses_math()) {
            group_of[gr.members[0]] = None;
            gr.members.clear();
        }
    }
    let state_nodes = g.state_nodes();
    let users = g.users();
    let exits: Vec<NodeId> = g.outputs.iter().map(|a| a.node).chain(g.writes.iter().map(|w| w.1)).collect();
    let pos = |i: NodeId, group_of: &[Option<usize>], groups: &[Group]| group_of[i].map_or(i, |k| *groups[k].members.last().unwrap_or(&i));
    for k in 0..groups.len() {
        if groups[k].members.is_empty() {
            continue;
        }
        let members = groups[k].members.clone();
        let inside = |x: NodeId| group_of[x] == Some(k);
        let mut ext: Vec<Arg> = Vec::new();
        for &m in &members {
            if let Kind::Op(_, args) = &g.nodes[m].kind {
                for a in args.iter().filter(|a| !inside(a.node)) {
                    if !ext.contains(a) {
                        ext.push(a.clone());
                    }
                }
            }
        }
        groups[k].externals = ext;
        groups[k].materialize = members.iter().copied().filter(|&m| exits.contains(&m) || users[m].iter().any(|&u| !inside(u))).collect();
        let at = pos(members[members.len() - 1], &group_of, &groups);
        for &(slot, node) in &g.writes {
            if !inside(node) {
                continue;
            }
            let safe = match state_nodes[slot] {
                None => true,
                Some(s) => {
                    !exits.contains(&s)
                        && users[s].iter().all(|&u| {
                            if inside(u) {
                                match &g.nodes[u].kind {
                                    Kind::Op(_, args) => args.iter().filter(|a| a.node == s).all(|a| {
                                        // A GPU kernel reads element i before it writes element i
                                        // in the same thread: any dense whole view will do.
                                        identity(a, &groups[k].shape)
                                            || (gpu
                                                && a.layout.offset == 0
                                                && a.layout.is_contiguous()
                                                && a.layout.numel() == g.nodes[node].numel())
                                    }),
                                    _ => false,
                                }
                            } else {
                                pos(u, &group_of, &groups) < at
                            }
                        })
                }
            };
            if safe && g.nodes[node].numel() == g.state[slot].len {
                groups[k].inplace.push((node, slot));
            }
        }
    }
    let mut steps = Vec::new();
    for (i, g) in group_of.iter().enumerate() {
        match *g {
            None => steps.push(Step::Node(i)),
            Some(k) if groups[k].members.last() == Some(&i) => steps.push(Step::Groups(vec![k])),
            Some(_) => {}
        }
    }
    Plan { steps, groups, fed: vec![] }
}

/// Groups one launch runs at most: NVRTC's time grows faster than linearly with a kernel's
/// size (a batch of 32 AdamW updates compiles far slower than four of 8; BENCHMARKS.md), and
/// the batches of one graph compile in parallel.
const MAX_BATCH: usize = 8;

/// Horizontal fusion: a run of fused groups separated only by steps that compute nothing
/// (inputs, state) becomes one step when no group in it reads what an earlier one makes, and
/// none writes in place a state buffer that an earlier one reads (in one kernel they run at
/// the same time). The optimizer's per-parameter updates become one launch this way.
pub fn batch_groups(g: &Graph, plan: Plan) -> Plan {
    let plan = hoist_early_groups(g, plan);
    let state_nodes = g.state_nodes();
    let mut steps: Vec<Step> = Vec::new();
    let mut run: Vec<usize> = Vec::new();
    let (mut made, mut read): (Vec<NodeId>, Vec<NodeId>) = (vec![], vec![]);
    let flush = |run: &mut Vec<usize>, steps: &mut Vec<Step>, made: &mut Vec<NodeId>, read: &mut Vec<NodeId>| {
        if !run.is_empty() {
            steps.push(Step::Groups(std::mem::take(run)));
        }
        made.clear();
        read.clear();
    };
    for step in plan.steps {
        match step {
            Step::Groups(gs) => {
                for k in gs {
                    let gr = &plan.groups[k];
                    let depends = gr.externals.iter().any(|a| made.contains(&a.node));
                    let clobbers = gr.inplace.iter().any(|&(_, slot)| state_nodes[slot].is_some_and(|s| read.contains(&s)));
                    if depends || clobbers || run.len() == MAX_BATCH {
                        flush(&mut run, &mut steps, &mut made, &mut read);
                    }
                    run.push(k);
                    made.extend(&gr.materialize);
                    read.extend(gr.externals.iter().map(|a| a.node));
                }
            }
            // Steps that launch nothing: inputs, state, constants (made once per program).
            Step::Node(i)
                if matches!(&g.nodes[i].kind, Kind::Input(_) | Kind::State(_) | Kind::Op(Op::Full { .. } | Op::Arange { .. }, _)) =>
            {
                steps.push(Step::Node(i))
            }
            other => {
                flush(&mut run, &mut steps, &mut made, &mut read);
                steps.push(other);
            }
        }
    }
    flush(&mut run, &mut steps, &mut made, &mut read);
    lead_scalar_groups(g, Plan { steps, groups: plan.groups, fed: plan.fed })
}

/// Whether group `gr` is a scalar group free to run anywhere before its readers: one value,
/// reading only inputs, state and constants, and writing in place only state that nothing
/// outside it reads (the optimizer's step count).
fn free_scalar(g: &Graph, gr: &Group, state_nodes: &[Option<NodeId>], users: &[Vec<NodeId>]) -> bool {
    gr.shape.iter().product::<usize>() == 1
        && !gr.folds
        && gr.externals.iter().all(|a| g.nodes[a.node].is_leaf())
        && gr.inplace.iter().all(|&(_, slot)| state_nodes[slot].is_none_or(|s| users[s].iter().all(|u| gr.members.contains(u))))
}

/// A free scalar group left in a launch of its own (no launch before it to join; several
/// such groups are first merged, `merge_scalar_launch`) leads the next launch instead: every
/// thread of that kernel computes its few values first, the other groups read them from
/// registers, and the kernel's last block stores them
/// (`FusedKernel::lead`). AdamW's step count and bias corrections so ride on its update. Only
/// where no step in between reads the group's values and no group of that launch overwrites
/// state the scalar group reads.
fn lead_scalar_groups(g: &Graph, mut plan: Plan) -> Plan {
    let (state_nodes, users) = (g.state_nodes(), g.users());
    let mut k = 0;
    while k < plan.steps.len() {
        let Step::Groups(gs) = plan.steps[k].clone() else {
            k += 1;
            continue;
        };
        let s = match merge_scalar_launch(g, &mut plan, &gs, &state_nodes, &users) {
            Some(merged) => {
                plan.steps[k] = Step::Groups(vec![merged]);
                merged
            }
            None if gs.len() == 1 && free_scalar(g, &plan.groups[gs[0]], &state_nodes, &users) => gs[0],
            None => {
                k += 1;
                continue;
            }
        };
        let sg = &plan.groups[s];
        let next = plan.steps.iter().enumerate().skip(k + 1).find_map(|(j, st)| match st {
            Step::Groups(gs) => Some((j, gs)),
            Step::Node(_) => None,
        });
        let Some((j, gs)) = next else { break };
        let read_between = plan.steps[k + 1..j].iter().any(|st| plan.reads(g, st).iter().any(|x| sg.materialize.contains(x)));
        let clobbers = gs
            .iter()
            .flat_map(|&q| &plan.groups[q].inplace)
            .any(|&(_, slot)| state_nodes[slot].is_some_and(|st| sg.externals.iter().any(|a| a.node == st)));
        if read_between || clobbers || gs.len() >= MAX_BATCH || plan.groups[gs[0]].lead {
            k += 1;
            continue;
        }
        let led: Vec<usize> = std::iter::once(s).chain(gs.iter().copied()).collect();
        plan.groups[s].lead = true;
        plan.steps[j] = Step::Groups(led);
        plan.steps.remove(k);
    }
    plan
}

/// A launch of several free scalar groups of one shape and precision (AdamW's bias
/// corrections and decay factor, each from the step count or the rate) becomes one group,
/// so that it can lead the next launch as one. The groups of one launch are independent, so
/// their members in node order are in order. Returns the merged group.
fn merge_scalar_launch(g: &Graph, plan: &mut Plan, gs: &[usize], state_nodes: &[Option<NodeId>], users: &[Vec<NodeId>]) -> Option<usize> {
    let (&first, rest) = gs.split_first()?;
    let like = |k: usize| {
        let (a, b) = (&plan.groups[k], &plan.groups[first]);
        free_scalar(g, a, state_nodes, users) && a.shape == b.shape && a.f64 == b.f64
    };
    if rest.is_empty() || !gs.iter().all(|&k| like(k)) {
        return None;
    }
    for &k in rest {
        let gr = std::mem::replace(&mut plan.groups[k], Group::new(vec![], false, false));
        let into = &mut plan.groups[first];
        into.members.extend(gr.members);
        into.externals.extend(gr.externals.into_iter().filter(|a| !into.externals.contains(a)).collect::<Vec<_>>());
        into.materialize.extend(gr.materialize);
        into.inplace.extend(gr.inplace);
    }
    let into = &mut plan.groups[first];
    into.members.sort_unstable();
    into.materialize.sort_unstable();
    Some(first)
}

/// Groups that read only inputs, state and constants join the step's first fused launch
/// instead of making their own; the steps naming what they read move with them. Their values
/// are then ready early, which every later reader allows. Two kinds:
/// - scalar groups that write in place only state that nothing else reads (the optimizer's
///   step count and bias corrections), at most `MAX_BATCH - 1` of them;
/// - groups that write nothing in place: autocast's casts of the weights to BF16, one small
///   launch each in every layer's forward (GPT BF16 has 24),
///   which `batch_groups` then runs `MAX_BATCH` to a launch. Only in a step that writes
///   state (training), where those values were alive from each layer's forward through its
///   backward already; in a forward alone they would all be alive at once.
fn hoist_early_groups(g: &Graph, mut plan: Plan) -> Plan {
    let Some(target) = plan.steps.iter().position(|s| matches!(s, Step::Groups(_))) else { return plan };
    let (state_nodes, users) = (g.state_nodes(), g.users());
    let free = |gr: &Group| free_scalar(g, gr, &state_nodes, &users);
    let training = !g.writes.is_empty();
    let reads_leaves =
        |gr: &Group| training && !gr.folds && gr.inplace.is_empty() && gr.externals.iter().all(|a| g.nodes[a.node].is_leaf());
    let (mut hoisted, mut scalars): (Vec<usize>, usize) = (Vec::new(), 0);
    let mut moved: Vec<NodeId> = Vec::new();
    for step in &plan.steps[target + 1..] {
        if let Step::Groups(gs) = step {
            if let [k] = gs[..] {
                let scalar = free(&plan.groups[k]) && scalars + 1 < MAX_BATCH;
                if scalar || reads_leaves(&plan.groups[k]) {
                    hoisted.push(k);
                    scalars += scalar as usize;
                    moved.extend(plan.groups[k].externals.iter().map(|a| a.node));
                }
            }
        }
    }
    if hoisted.is_empty() {
        return plan;
    }
    // What the hoisted groups read and is named only after the first launch moves before it;
    // steps before that launch stay where they are (an earlier reader may need them).
    let before: Vec<NodeId> = plan.steps[..target].iter().filter_map(|s| if let Step::Node(i) = s { Some(*i) } else { None }).collect();
    moved.retain(|i| !before.contains(i));
    moved.sort_unstable();
    moved.dedup();
    let stays = |s: &Step| match s {
        Step::Groups(gs) => !(gs.len() == 1 && hoisted.contains(&gs[0])),
        Step::Node(i) => !moved.contains(i),
    };
    let mut steps: Vec<Step> = plan.steps[..target].to_vec();
    steps.extend(moved.iter().copied().map(Step::Node));
    let Step::Groups(first) = &plan.steps[target] else { return plan };
    steps.push(Step::Groups(first.iter().copied().chain(hoisted.iter().copied()).collect()));
    steps.extend(plan.steps[target + 1..].iter().filter(|s| stays(s)).cloned());
    plan.steps = steps;
    plan
}

/// The longest inner dimension of a product fed to its group. Each tile repacks the whole
/// right operand (k x n), cheap for a weight gradient at a small batch (k = the batch), whose
/// cost is mostly writing the gradient; at batch 1024 the product is compute-bound and its
/// tiles gain nothing over splitting the product's rows across the threads.
const FEED_MAX_K: usize = 256;

/// The rows and columns of a 2-D product that can be made tile by tile for one group
/// (`kiln_tensor::cpu::matmul_by_tiles`): a plain `Matmul` or one with operand sums, F32/F64.
fn tiled_product(g: &Graph, i: NodeId) -> Option<[usize; 2]> {
    let n = &g.nodes[i];
    let Kind::Op(op, args) = &n.kind else { return None };
    let product = matches!(op, Op::Matmul | Op::Fused(Fused::Matmul(MatmulEpilogue::SumLeft | MatmulEpilogue::SumRight)));
    let two_d = args.len() >= 2 && args[0].layout.rank() == 2 && args[1].layout.rank() == 2;
    let fits = two_d && args[0].layout.shape[1] <= FEED_MAX_K && matches!(n.dtype, DType::F32 | DType::F64);
    (product && fits).then(|| [args[0].layout.shape[0], args[1].layout.shape[1]])
}

/// CPU: a 2-D product whose first reader is a group reading it whole as its only read of it
/// (an optimizer update reading a weight gradient) moves to just before that group, and the
/// two run together (`exec`): the group consumes each tile of the product as it is made, in
/// cache, so the gradient is never written out and read back. Only where no step in between
/// reads the product or overwrites in place a state buffer the product reads; `native(k)`:
/// group k has a native function. Returns the steps so moved, each before its group.
pub fn feed_products(g: &Graph, plan: &mut Plan, native: &dyn Fn(usize) -> bool) -> Vec<bool> {
    let state_nodes = g.state_nodes();
    let (mut fed, mut fed_groups): (Vec<NodeId>, Vec<usize>) = (Vec::new(), Vec::new());
    let mut kp = 0;
    while kp < plan.steps.len() {
        let p = match plan.steps[kp] {
            Step::Node(p) if !fed.contains(&p) => p,
            _ => {
                kp += 1;
                continue;
            }
        };
        let Some(shape) = tiled_product(g, p) else {
            kp += 1;
            continue;
        };
        let Some(kr) = (kp + 1..plan.steps.len()).find(|&k| plan.reads(g, &plan.steps[k]).contains(&p)) else {
            kp += 1;
            continue;
        };
        let ok = match &plan.steps[kr] {
            // One product per group: the product runs right before it.
            Step::Groups(gs) if gs.len() == 1 && native(gs[0]) && !fed_groups.contains(&gs[0]) => {
                let gr = &plan.groups[gs[0]];
                let of_p: Vec<&Arg> = gr.externals.iter().filter(|a| a.node == p).collect();
                let product_args = g.nodes[p].args();
                let clobbers = plan.steps[kp + 1..=kr].iter().any(|s| match s {
                    Step::Groups(gs) => gs
                        .iter()
                        .flat_map(|&k| &plan.groups[k].inplace)
                        .any(|&(_, slot)| state_nodes[slot].is_some_and(|s| product_args.contains(&s))),
                    Step::Node(_) => false,
                });
                // The group locks its reads while the product locks its own: none shared.
                let shares = gr.externals.iter().any(|a| product_args.contains(&a.node));
                gr.shape == shape && of_p.len() == 1 && identity(of_p[0], &shape) && !clobbers && !shares
            }
            _ => false,
        };
        if ok {
            fed.push(p);
            if let Step::Groups(gs) = &plan.steps[kr] {
                fed_groups.push(gs[0]);
            }
            if kr > kp + 1 {
                // Moved up to its group; this position now holds the next step.
                let step = plan.steps.remove(kp);
                plan.steps.insert(kr - 1, step);
                continue;
            }
        }
        kp += 1;
    }
    plan.steps.iter().map(|s| matches!(s, Step::Node(i) if fed.contains(i))).collect()
}

/// The longest contraction a group computes a product over itself (`feed_gpu_products`; the
/// CUDA back end's thin-product kernel takes the same, `kiln_tensor::cuda::kernels::products::THIN_MAX_K`).
const GPU_FEED_MAX_K: usize = 32;

/// GPU: a product with a short contraction (a weight gradient `g^T x` at a small batch, with
/// `SumLeft` its bias's gradient) that only one later launch reads, each of its groups
/// reading the product whole or the sums whole, is made by those groups where they read it
/// (`kiln_tensor::cuda::kernels::fused::Fed`) instead of by a kernel of its own: one launch fewer, and the gradient is
/// never written out and read back. Not where a group in between overwrites in place a state
/// buffer the product reads, nor for a step's outputs or state writes.
pub fn feed_gpu_products(g: &Graph, plan: &mut Plan) {
    let state_nodes = g.state_nodes();
    let kept: Vec<NodeId> = g.outputs.iter().map(|a| a.node).chain(g.writes.iter().map(|w| w.1)).collect();
    let mut fed: Vec<NodeId> = Vec::new();
    for kp in 0..plan.steps.len() {
        let Step::Node(p) = plan.steps[kp] else { continue };
        let Some(reads) = gpu_fed_reads(g, p) else { continue };
        let readers: Vec<usize> = (kp + 1..plan.steps.len()).filter(|&k| plan.reads(g, &plan.steps[k]).contains(&p)).collect();
        let (false, &[kr]) = (kept.contains(&p), &readers[..]) else { continue };
        let Step::Groups(gs) = &plan.steps[kr] else { continue };
        let args = g.nodes[p].args();
        let clobbers = plan.steps[kp + 1..=kr].iter().any(|s| match s {
            Step::Groups(gs) => {
                gs.iter().flat_map(|&k| &plan.groups[k].inplace).any(|&(_, slot)| state_nodes[slot].is_some_and(|s| args.contains(&s)))
            }
            Step::Node(_) => false,
        });
        // Each part read whole by one group at most, a group of the part's own shape.
        let mut taken = [false; 2];
        let fits = gs.iter().all(|&k| {
            let gr = &plan.groups[k];
            let of_p: Vec<&Arg> = gr.externals.iter().filter(|a| a.node == p).collect();
            match of_p[..] {
                [] => true,
                [a] if !gr.folds && !gr.lead => reads.iter().enumerate().any(|(part, (offset, shape))| {
                    let whole = a.layout.offset == *offset && a.layout.shape == *shape && a.layout.is_contiguous();
                    let ok = whole && gr.shape == *shape && !taken[part];
                    taken[part] |= ok;
                    ok
                }),
                _ => false,
            }
        });
        if fits && !clobbers {
            fed.push(p);
        }
    }
    plan.steps.retain(|s| !matches!(s, Step::Node(i) if fed.contains(i)));
    plan.fed = fed;
}

/// The parts of a product a group can compute where it reads them (`feed_gpu_products`), as
/// (offset, shape): the product `[m, n]` and the sums `[m]` after it. Only a 2-D F32/F64
/// `SumLeft` (a weight gradient and its bias's) that the CUDA back end's thin-product kernel
/// would take: a contraction of at most `GPU_FEED_MAX_K`, b's rows contiguous, no empty
/// side; a group then adds the same terms in the same order. (A plain product goes to a
/// GEMM, which reads b once for all rows where a group reads it once a row.)
fn gpu_fed_reads(g: &Graph, i: NodeId) -> Option<Vec<(usize, Vec<usize>)>> {
    let n = &g.nodes[i];
    let Kind::Op(Op::Fused(Fused::Matmul(MatmulEpilogue::SumLeft)), args) = &n.kind else { return None };
    let [a, b] = &args[..] else { return None };
    let (sa, sb) = (&a.layout.shape, &b.layout.shape);
    if sa.len() != 2 || sb.len() != 2 {
        return None;
    }
    let (m, k, cols) = (sa[0], sa[1], sb[1]);
    let b_rows = b.layout.strides[1] == 1 || cols == 1;
    let fits = (1..=GPU_FEED_MAX_K).contains(&k) && m > 0 && cols > 0 && b_rows && matches!(n.dtype, DType::F32 | DType::F64);
    let same = g.nodes[a.node].dtype == n.dtype && g.nodes[b.node].dtype == n.dtype;
    let sums_at = Parts::with_tail(&[m, cols], &[m]).offset(Part::Tail).ok()?;
    (fits && same).then(|| vec![(0, vec![m, cols]), (sums_at, vec![m])])
}

/// A line per fusion group: its shape, members, how many nodes it reads, what it stores and
/// updates in place.
pub(crate) fn groups_report(g: &Graph, plan: &Plan) -> String {
    let mut s = String::new();
    for (k, gr) in plan.groups.iter().enumerate().filter(|(_, g)| !g.members.is_empty()) {
        let ops: Vec<String> = gr
            .members
            .iter()
            .map(|&m| match &g.nodes[m].kind {
                Kind::Op(op, _) => crate::graph::op_label(op),
                _ => "?".into(),
            })
            .collect();
        s += &format!(
            "\n  group {k} {:?}: [{}] reads {} stores {:?} in place {:?}",
            gr.shape,
            ops.join(", "),
            gr.externals.len(),
            gr.materialize,
            gr.inplace
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::testing::{mean_loss, whole};
    use kiln_tensor::{BinaryOp, Layout};

    #[test]
    fn a_mean_loss_folds_into_one_gpu_group() {
        let (g, chain) = mean_loss();
        let plan = plan(&g, true, false);
        let folding: Vec<&Group> = plan.groups.iter().filter(|gr| !gr.members.is_empty()).collect();
        assert_eq!(folding.len(), 1, "{folding:?}");
        let gr = folding[0];
        assert!(gr.folds);
        assert_eq!(gr.members, chain.to_vec());
        assert_eq!(gr.shape, vec![4]);
        // The loss (returned) and the gradient's scale (read by the backward) leave the kernel.
        assert_eq!(gr.materialize, vec![chain[4], chain[5]]);
        // Cross-entropy, its backward and the loss chain: three launches.
        let launches = plan
            .steps
            .iter()
            .filter(|s| match s {
                Step::Groups(_) => true,
                Step::Node(i) => matches!(g.nodes[*i].kind, Kind::Op(..)) && !g.nodes[*i].is_const(),
            })
            .count();
        assert_eq!(launches, 3);
    }

    #[test]
    fn the_step_count_and_its_scalars_join_the_first_launch() {
        use crate::graph::StateInfo;
        let slot = StateInfo { len: 1, dtype: DType::F64, created_in_step: false };
        let mut g = Graph { state: vec![slot.clone(), slot], ..Graph::default() };
        // The learning rate, also read by an eager op (a cast to an integer) before any group.
        let lr = g.push(Kind::State(1), vec![1], DType::F64);
        let as_int = g.push(Kind::Op(Op::Cast(DType::I64), vec![whole(&g, lr)]), vec![1], DType::I64);
        // exp over more than FOLD_MAX elements, then its sum as a reduction kernel.
        let x = g.push(Kind::Input(0), vec![1 << 16], DType::F32);
        let e = g.push(Kind::Op(Op::Unary(kiln_tensor::UnaryOp::Exp), vec![whole(&g, x)]), vec![1 << 16], DType::F32);
        let sum = Op::Reduce { op: ReduceOp::Sum, dims: vec![0], keepdim: false };
        let total = g.push(Kind::Op(sum, vec![whole(&g, e)]), vec![], DType::F32);
        // The step count advanced in place, and a bias correction from it times the rate.
        let step = g.push(Kind::State(0), vec![1], DType::F64);
        let scalar = Layout { shape: vec![], strides: vec![], offset: 0 };
        let add = Op::Scalar { op: BinaryOp::Add, value: 1.0, scalar_lhs: false };
        let next = g.push(Kind::Op(add, vec![Arg { node: step, layout: scalar.clone() }]), vec![], DType::F64);
        let t = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, next)]), vec![], DType::F32);
        let pow = Op::Scalar { op: BinaryOp::Pow, value: 0.9, scalar_lhs: true };
        let decay = g.push(Kind::Op(pow, vec![whole(&g, t)]), vec![], DType::F32);
        let rate = g.push(Kind::Op(Op::Cast(DType::F32), vec![Arg { node: lr, layout: scalar.clone() }]), vec![], DType::F32);
        let corr = g.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![whole(&g, decay), whole(&g, rate)]), vec![], DType::F32);
        let y = g.push(Kind::Input(1), vec![4], DType::F32);
        let spread = Arg { node: corr, layout: Layout { shape: vec![4], strides: vec![0], offset: 0 } };
        let scaled = g.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![whole(&g, y), spread]), vec![4], DType::F32);
        g.outputs = vec![whole(&g, scaled), whole(&g, total), whole(&g, as_int)];
        g.writes = vec![(0, next)];
        let plan = batch_groups(&g, plan(&g, true, false));
        let launches: Vec<&Step> = plan.steps.iter().filter(|s| matches!(s, Step::Groups(_))).collect();
        let group_of = |node: NodeId| plan.groups.iter().position(|gr| gr.members.contains(&node)).expect("a group");
        // exp and the step count's group in one launch, then the product.
        assert_eq!(launches.len(), 2, "{plan:?}");
        assert!(matches!(launches[0], Step::Groups(gs) if *gs == vec![group_of(e), group_of(next)]), "{plan:?}");
        assert_eq!(plan.groups[group_of(next)].inplace, vec![(next, 0)]);
        // The state it reads is named before that launch; the large sum stays a kernel after it.
        let position = |want: &dyn Fn(&Step) -> bool| plan.steps.iter().position(want).expect("a step");
        let first = position(&|s| std::ptr::eq(s, launches[0]));
        assert!(position(&|s| matches!(s, Step::Node(i) if *i == step)) < first);
        // The rate stays before the eager op that reads it too.
        let lr_at = position(&|s| matches!(s, Step::Node(i) if *i == lr));
        assert!(lr_at < position(&|s| matches!(s, Step::Node(i) if *i == as_int)));
        assert!(position(&|s| matches!(s, Step::Node(i) if *i == total)) > first);
    }

    /// Autocast's shape: two layers, each `x @ cast(w)` then a ReLU, and the first weight
    /// updated in place from the second's cast (a training step's write). The second weight's
    /// cast joins the first's launch; the ReLUs, which read products, and the update, which
    /// writes state in place, stay where they are; without the write (a forward alone)
    /// nothing moves.
    #[test]
    fn weight_casts_join_the_first_launch() {
        use crate::graph::StateInfo;
        let w = StateInfo { len: 64, dtype: DType::F32, created_in_step: false };
        let mut g = Graph { state: vec![w.clone(), w], ..Graph::default() };
        let x = g.push(Kind::Input(0), vec![4, 8], DType::BF16);
        let mut h = x;
        let mut casts = Vec::new();
        let mut relus = Vec::new();
        for slot in 0..2 {
            let p = g.push(Kind::State(slot), vec![8, 8], DType::F32);
            let c = g.push(Kind::Op(Op::Cast(DType::BF16), vec![whole(&g, p)]), vec![8, 8], DType::BF16);
            let y = g.push(Kind::Op(Op::Matmul, vec![whole(&g, h), whole(&g, c)]), vec![4, 8], DType::BF16);
            h = g.push(Kind::Op(Op::Unary(kiln_tensor::UnaryOp::Relu), vec![whole(&g, y)]), vec![4, 8], DType::BF16);
            casts.push(c);
            relus.push(h);
        }
        g.outputs = vec![whole(&g, h)];
        let group_of = |plan: &Plan, node: NodeId| plan.groups.iter().position(|gr| gr.members.contains(&node)).expect("a group");
        let launches = |plan: &Plan| plan.steps.iter().filter(|s| matches!(s, Step::Groups(_))).cloned().collect::<Vec<Step>>();
        // A forward alone: the second cast stays after the first product.
        let forward = batch_groups(&g, plan(&g, true, false));
        assert!(matches!(&launches(&forward)[0], Step::Groups(gs) if *gs == vec![group_of(&forward, casts[0])]), "{forward:?}");
        let w0 = g.nodes[casts[0]].args()[0];
        let back = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, casts[1])]), vec![8, 8], DType::F32);
        let update = g.push(Kind::Op(Op::Binary(BinaryOp::Sub), vec![whole(&g, w0), whole(&g, back)]), vec![8, 8], DType::F32);
        g.writes = vec![(0, update)];
        let unbatched = plan(&g, true, false);
        assert_eq!(launches(&unbatched).len(), 5, "{unbatched:?}");
        let batched = batch_groups(&g, plan(&g, true, false));
        let got = launches(&batched);
        assert_eq!(got.len(), 3, "{batched:?}");
        let [c0, c1, r0, r1, u] = [casts[0], casts[1], relus[0], relus[1], update].map(|n| group_of(&batched, n));
        assert!(!batched.groups[u].inplace.is_empty(), "{batched:?}");
        assert!(matches!(&got[0], Step::Groups(gs) if *gs == vec![c0, c1]), "{batched:?}");
        assert!(matches!(&got[1], Step::Groups(gs) if *gs == vec![r0]), "{batched:?}");
        // (The update, independent of the last ReLU, shares its launch.)
        assert!(matches!(&got[2], Step::Groups(gs) if *gs == vec![r1, u]), "{batched:?}");
        // The second weight is named before the launch that now reads it.
        let at = |want: &dyn Fn(&Step) -> bool| batched.steps.iter().position(want).expect("a step");
        let second = g.nodes[casts[1]].args()[0];
        assert!(at(&|s| matches!(s, Step::Node(i) if *i == second)) < at(&|s| matches!(s, Step::Groups(gs) if gs.contains(&c0))));
    }

    /// AdamW's shape: step + 1 (written back) and 1 - 0.9^t, then p - grad / corr; with
    /// `reader`, a product reading the scalars between them. Returns (graph, next, corr, updated).
    fn count_then_update(reader: bool) -> (Graph, NodeId, NodeId, NodeId) {
        use crate::graph::StateInfo;
        let count = StateInfo { len: 1, dtype: DType::F64, created_in_step: false };
        let param = StateInfo { len: 8, dtype: DType::F32, created_in_step: false };
        let mut g = Graph { state: vec![count, param], ..Graph::default() };
        let scalar = Layout { shape: vec![], strides: vec![], offset: 0 };
        let step = g.push(Kind::State(0), vec![1], DType::F64);
        let add = Op::Scalar { op: BinaryOp::Add, value: 1.0, scalar_lhs: false };
        let next = g.push(Kind::Op(add, vec![Arg { node: step, layout: scalar.clone() }]), vec![], DType::F64);
        let t = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, next)]), vec![], DType::F32);
        let pow = Op::Scalar { op: BinaryOp::Pow, value: 0.9, scalar_lhs: true };
        let decay = g.push(Kind::Op(pow, vec![whole(&g, t)]), vec![], DType::F32);
        let one_minus = Op::Scalar { op: BinaryOp::Sub, value: 1.0, scalar_lhs: true };
        let corr = g.push(Kind::Op(one_minus, vec![whole(&g, decay)]), vec![], DType::F32);
        if reader {
            let x = g.push(Kind::Input(1), vec![1, 8], DType::F32);
            let column = Arg { node: corr, layout: Layout { shape: vec![8, 1], strides: vec![0, 0], offset: 0 } };
            let product = g.push(Kind::Op(Op::Matmul, vec![whole(&g, x), column]), vec![1, 1], DType::F32);
            g.outputs = vec![whole(&g, product)];
        }
        let p = g.push(Kind::State(1), vec![8], DType::F32);
        let grad = g.push(Kind::Input(0), vec![8], DType::F32);
        let spread = Arg { node: corr, layout: Layout { shape: vec![8], strides: vec![0], offset: 0 } };
        let scaled = g.push(Kind::Op(Op::Binary(BinaryOp::Div), vec![whole(&g, grad), spread]), vec![8], DType::F32);
        let updated = g.push(Kind::Op(Op::Binary(BinaryOp::Sub), vec![whole(&g, p), whole(&g, scaled)]), vec![8], DType::F32);
        g.writes = vec![(0, next), (1, updated)];
        (g, next, corr, updated)
    }

    #[test]
    fn a_lone_step_count_group_leads_the_update_launch() {
        let group_of = |plan: &Plan, node: NodeId| plan.groups.iter().position(|gr| gr.members.contains(&node)).expect("a group");
        let launches = |plan: &Plan| plan.steps.iter().filter(|s| matches!(s, Step::Groups(_))).cloned().collect::<Vec<Step>>();
        let (g, next, corr, updated) = count_then_update(false);
        // Without leads: the scalars, then the update.
        let alone = plan(&g, true, false);
        assert_eq!(launches(&alone).len(), 2, "{alone:?}");
        let led = batch_groups(&g, plan(&g, true, false));
        let (s, u) = (group_of(&led, next), group_of(&led, updated));
        assert!(matches!(&launches(&led)[..], [Step::Groups(gs)] if *gs == vec![s, u]), "{led:?}");
        assert!(led.groups[s].lead && !led.groups[u].lead);
        assert_eq!(led.groups[s].inplace, vec![(next, 0)]);
        assert!(led.groups[u].externals.iter().any(|a| a.node == corr) && led.groups[s].materialize.contains(&corr));
        // A product between them reading the scalars keeps them apart.
        let (g, ..) = count_then_update(true);
        let apart = batch_groups(&g, plan(&g, true, false));
        assert_eq!(launches(&apart).len(), 2, "{apart:?}");
        assert!(apart.groups.iter().all(|gr| !gr.lead));
    }

    /// AdamW's scalars as it traces them: the step count advanced and `1 - 0.9^t` in f64 from
    /// it, `1 - 0.01 lr` in f64 from the rate, each cast to F32 for `p * decay - grad / corr`.
    /// The two scalar groups become one, which leads the update's launch.
    #[test]
    fn several_scalar_groups_merge_and_lead_the_update_launch() {
        use crate::graph::StateInfo;
        let one = StateInfo { len: 1, dtype: DType::F64, created_in_step: false };
        let param = StateInfo { len: 8, dtype: DType::F32, created_in_step: false };
        let mut g = Graph { state: vec![one.clone(), one, param], ..Graph::default() };
        let scalar = Layout { shape: vec![], strides: vec![], offset: 0 };
        let op = |op: BinaryOp, value: f64, scalar_lhs: bool| Op::Scalar { op, value, scalar_lhs };
        let step = g.push(Kind::State(0), vec![1], DType::F64);
        let next = g.push(Kind::Op(op(BinaryOp::Add, 1.0, false), vec![Arg { node: step, layout: scalar.clone() }]), vec![], DType::F64);
        let pow = g.push(Kind::Op(op(BinaryOp::Pow, 0.9, true), vec![whole(&g, next)]), vec![], DType::F64);
        let bc = g.push(Kind::Op(op(BinaryOp::Sub, 1.0, true), vec![whole(&g, pow)]), vec![], DType::F64);
        let corr = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, bc)]), vec![], DType::F32);
        let lr = g.push(Kind::State(1), vec![1], DType::F64);
        let wd = g.push(Kind::Op(op(BinaryOp::Mul, 0.01, false), vec![Arg { node: lr, layout: scalar.clone() }]), vec![], DType::F64);
        let keep = g.push(Kind::Op(op(BinaryOp::Sub, 1.0, true), vec![whole(&g, wd)]), vec![], DType::F64);
        let decay = g.push(Kind::Op(Op::Cast(DType::F32), vec![whole(&g, keep)]), vec![], DType::F32);
        let p = g.push(Kind::State(2), vec![8], DType::F32);
        let grad = g.push(Kind::Input(0), vec![8], DType::F32);
        let spread = |node: NodeId| Arg { node, layout: Layout { shape: vec![8], strides: vec![0], offset: 0 } };
        let decayed = g.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![whole(&g, p), spread(decay)]), vec![8], DType::F32);
        let scaled = g.push(Kind::Op(Op::Binary(BinaryOp::Div), vec![whole(&g, grad), spread(corr)]), vec![8], DType::F32);
        let updated = g.push(Kind::Op(Op::Binary(BinaryOp::Sub), vec![whole(&g, decayed), whole(&g, scaled)]), vec![8], DType::F32);
        g.writes = vec![(0, next), (2, updated)];
        let group_of = |plan: &Plan, node: NodeId| plan.groups.iter().position(|gr| gr.members.contains(&node)).expect("a group");
        let alone = plan(&g, true, false);
        assert_ne!(group_of(&alone, corr), group_of(&alone, decay), "{alone:?}");
        let led = batch_groups(&g, plan(&g, true, false));
        let launches: Vec<&Step> = led.steps.iter().filter(|s| matches!(s, Step::Groups(_))).collect();
        let (s, u) = (group_of(&led, next), group_of(&led, updated));
        assert!(matches!(&launches[..], [Step::Groups(gs)] if *gs == vec![s, u]), "{led:?}");
        let lead = &led.groups[s];
        assert!(lead.lead && group_of(&led, decay) == s, "{led:?}");
        assert_eq!(lead.members, vec![next, pow, bc, corr, wd, keep, decay]);
        assert_eq!(lead.materialize, vec![next, corr, decay]);
        assert_eq!(lead.inplace, vec![(next, 0)]);
        assert_eq!(lead.externals.iter().map(|a| a.node).collect::<Vec<_>>(), vec![step, lr]);
    }

    /// SGD on a `[4, 8]` weight and its `[4]` bias from `SumLeft(g^T, x)` over a batch of 6;
    /// `read_twice`: the weight's update also reads the product transposed. Returns (graph,
    /// product, g, x).
    fn weight_gradient_update(read_twice: bool) -> (Graph, NodeId, NodeId, NodeId) {
        use crate::graph::StateInfo;
        let slot = |len: usize| StateInfo { len, dtype: DType::F32, created_in_step: false };
        let mut g = Graph { state: vec![slot(32), slot(4)], ..Graph::default() };
        let grad = g.push(Kind::Input(0), vec![6, 4], DType::F32);
        let x = g.push(Kind::Input(1), vec![6, 8], DType::F32);
        let gt = Arg { node: grad, layout: Layout { shape: vec![4, 6], strides: vec![1, 4], offset: 0 } };
        let len = Parts::with_tail(&[4, 8], &[4]).len();
        let p = g.push(Kind::Op(Op::Fused(Fused::Matmul(MatmulEpilogue::SumLeft)), vec![gt, whole(&g, x)]), vec![len], DType::F32);
        let view = |shape: Vec<usize>, strides: Vec<usize>, offset: usize| Arg { node: p, layout: Layout { shape, strides, offset } };
        let (w, b) = (g.push(Kind::State(0), vec![4, 8], DType::F32), g.push(Kind::State(1), vec![4], DType::F32));
        let sub = Op::Binary(BinaryOp::Sub);
        let mut dw = g.push(Kind::Op(sub.clone(), vec![whole(&g, w), view(vec![4, 8], vec![8, 1], 0)]), vec![4, 8], DType::F32);
        if read_twice {
            let add = Op::Binary(BinaryOp::Add);
            dw = g.push(Kind::Op(add, vec![whole(&g, dw), view(vec![4, 8], vec![1, 4], 0)]), vec![4, 8], DType::F32);
        }
        let db = g.push(Kind::Op(sub, vec![whole(&g, b), view(vec![4], vec![1], len - 4)]), vec![4], DType::F32);
        g.writes = vec![(0, dw), (1, db)];
        (g, p, grad, x)
    }

    #[test]
    fn a_short_weight_gradient_is_made_by_the_update_that_reads_it() {
        let (g, p, grad, x) = weight_gradient_update(false);
        let mut fed = batch_groups(&g, plan(&g, true, false));
        feed_gpu_products(&g, &mut fed);
        assert_eq!(fed.fed, vec![p]);
        // No step makes the product: the one launch (both updates) reads its operands.
        assert!(!fed.steps.iter().any(|s| matches!(s, Step::Node(i) if *i == p)), "{fed:?}");
        let launches: Vec<&Step> = fed.steps.iter().filter(|s| matches!(s, Step::Groups(_))).collect();
        assert!(matches!(launches[..], [Step::Groups(gs)] if gs.len() == 2), "{fed:?}");
        let reads = fed.reads(&g, launches[0]);
        assert!(reads.contains(&grad) && reads.contains(&x) && !reads.contains(&p), "{reads:?}");
        // Read other than whole (transposed, as well): the product keeps its own kernel.
        let (g, p, ..) = weight_gradient_update(true);
        let mut kept = batch_groups(&g, plan(&g, true, false));
        feed_gpu_products(&g, &mut kept);
        assert!(kept.fed.is_empty() && kept.steps.iter().any(|s| matches!(s, Step::Node(i) if *i == p)), "{kept:?}");
        // So does a product the step returns.
        let (mut g, p, ..) = weight_gradient_update(false);
        g.outputs = vec![whole(&g, p)];
        let mut kept = batch_groups(&g, plan(&g, true, false));
        feed_gpu_products(&g, &mut kept);
        assert!(kept.fed.is_empty(), "{kept:?}");
    }

    #[test]
    fn the_cpu_plan_keeps_sums_as_their_own_kernels() {
        let (g, chain) = mean_loss();
        let plan = plan(&g, false, false);
        assert!(plan.groups.iter().all(|gr| !gr.folds));
        for sum in [chain[0], chain[3]] {
            assert!(plan.steps.iter().any(|s| matches!(s, Step::Node(i) if *i == sum)));
        }
    }

    #[test]
    fn a_scalar_reading_a_sum_and_a_big_value_does_not_join() {
        // sum(x) * y[0..1] where y is a [4] member of the same group: y is per element, so the
        // product cannot run after the fold.
        let mut g = Graph::default();
        let x = g.push(Kind::Input(0), vec![4], DType::F32);
        let y = g.push(Kind::Op(Op::Unary(kiln_tensor::UnaryOp::Exp), vec![whole(&g, x)]), vec![4], DType::F32);
        let s = g.push(Kind::Op(Op::Reduce { op: ReduceOp::Sum, dims: vec![0], keepdim: false }, vec![whole(&g, y)]), vec![], DType::F32);
        let first = Arg { node: y, layout: Layout { shape: vec![], strides: vec![], offset: 0 } };
        let p = g.push(Kind::Op(Op::Binary(BinaryOp::Mul), vec![whole(&g, s), first]), vec![], DType::F32);
        g.outputs = vec![whole(&g, p)];
        let plan = plan(&g, true, false);
        let gr = plan.groups.iter().find(|gr| gr.members.contains(&s)).expect("the sum's group");
        assert_eq!(gr.members, vec![y, s]);
        assert!(!gr.members.contains(&p));
    }
}
