//! The backward walk: the tape in reverse topological order, one rule per op (`rules.rs`),
//! gradients accumulated into the leaves; grad-mode guards.

use crate::rules;
use kiln_tensor::{no_grad, Error, Layout, Op, Result, Tensor, TensorId};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Sets grad mode while alive and puts back the previous mode after: `GradModeGuard::new(true)`
/// is `torch.enable_grad()` (recording inside a `no_grad` region).
pub struct GradModeGuard {
    prev: bool,
}

impl GradModeGuard {
    pub fn new(on: bool) -> GradModeGuard {
        GradModeGuard { prev: kiln_tensor::set_grad_enabled(on) }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        kiln_tensor::set_grad_enabled(self.prev);
    }
}

/// Turns recording off while alive (like `torch.no_grad()` used as a context manager).
pub struct NoGradGuard {
    _mode: GradModeGuard,
}

impl NoGradGuard {
    #[allow(clippy::new_without_default)]
    pub fn new() -> NoGradGuard {
        NoGradGuard { _mode: GradModeGuard::new(false) }
    }
}

/// `loss.backward()` for tensors.
pub trait Backward {
    /// Accumulates d(self)/d(leaf) into every leaf that requires grad; `self` must hold one
    /// element. The graph is spent: a second backward through it is an error, as in PyTorch.
    fn backward(&self) -> Result<()>;
    /// `loss.backward(retain_graph=True)`: the same, leaving the graph for another backward.
    fn backward_retain_graph(&self) -> Result<()>;
}

impl Backward for Tensor {
    fn backward(&self) -> Result<()> {
        backward(self)
    }
    fn backward_retain_graph(&self) -> Result<()> {
        let seed = one_element_seed(self)?;
        run(self, &seed, None, Retain::Yes, &mut accumulate_and_hook)
    }
}

/// Whether a backward leaves the graph for another one (PyTorch's `retain_graph`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retain {
    Yes,
    No,
}

fn one_element_seed(root: &Tensor) -> Result<Tensor> {
    if root.numel() != 1 {
        return Err(Error::shape(
            "backward",
            format!("needs a one-element loss, got shape {:?}; use backward_with for other shapes", root.shape()),
        ));
    }
    no_grad(|| root.ones_like())
}

/// Adds a leaf's finished gradient into its `.grad()`, then runs its hooks
/// (`register_post_accumulate_grad_hook`).
fn accumulate_and_hook(leaf: &Tensor, g: Tensor) -> Result<()> {
    accumulate(leaf, g)?;
    crate::hooks::run_hooks(leaf)
}

/// The gradients `run` finds, collected instead of accumulated.
pub(crate) fn collect(root: &Tensor, seed: &Tensor, wanted: Option<&HashSet<TensorId>>, retain: Retain) -> Result<Vec<(Tensor, Tensor)>> {
    let mut found = Vec::new();
    run(root, seed, wanted, retain, &mut |t, g| {
        found.push((t.clone(), g));
        Ok(())
    })?;
    Ok(found)
}

/// Backward from a one-element tensor (seeded with 1); the graph is spent.
pub fn backward(root: &Tensor) -> Result<()> {
    let seed = one_element_seed(root)?;
    backward_with(root, &seed)
}

/// Backward from any tensor, seeded with `grad` (same shape); the graph is spent.
pub fn backward_with(root: &Tensor, grad: &Tensor) -> Result<()> {
    run(root, grad, None, Retain::No, &mut accumulate_and_hook)
}

/// Gradients of `root` with respect to `inputs` (seeded with ones), without touching any
/// `.grad()`: like `torch.autograd.grad` with `retain_graph=True` (the graph stays for a
/// later `backward()`). An input `root` does not depend on gets `None`.
pub fn grad(root: &Tensor, inputs: &[&Tensor]) -> Result<Vec<Option<Tensor>>> {
    let seed = no_grad(|| root.ones_like())?;
    let wanted: HashSet<TensorId> = inputs.iter().map(|t| t.id()).collect();
    let found = collect(root, &seed, Some(&wanted), Retain::Yes)?;
    Ok(inputs.iter().map(|t| found.iter().find(|(l, _)| l.id() == t.id()).map(|(_, g)| g.clone())).collect())
}

/// The walk's order: the tensors made last first (PyTorch's engine orders by sequence number
/// too), so that the gradients of the last layers' parameters are finished, and handed on,
/// while the first layers' backward still runs. Tensor ids grow with creation, so an op's
/// inputs come after it; where that does not hold, the reversed depth-first order.
fn latest_first(inputs_first: Vec<Tensor>) -> Vec<Tensor> {
    let mut order = inputs_first;
    let mut by_id = order.clone();
    by_id.sort_by_key(|t| std::cmp::Reverse(t.id()));
    let topological = by_id.iter().all(|t| t.grad_fn().is_none_or(|f| f.inputs.iter().all(|i| i.id() < t.id())));
    if topological {
        by_id
    } else {
        order.reverse();
        order
    }
}

/// Tensors reachable from `root` through recorded ops, inputs before the ops that use them.
fn topo_order(root: &Tensor) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    // Iterative post-order DFS: deep graphs must not overflow the stack.
    let mut stack: Vec<(Tensor, bool)> = vec![(root.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        stack.push((t.clone(), true));
        if let Some(f) = t.grad_fn() {
            for i in f.inputs.iter().filter(|i| i.requires_grad()) {
                if !seen.contains(&i.id()) {
                    stack.push((i.clone(), false));
                }
            }
        }
    }
    order
}

/// Walks the graph and hands `sink` the gradient of every leaf that requires grad (or, with
/// `wanted`, of those tensors whether leaves or not) as soon as it is complete: a leaf's
/// gradient is final when the walk reaches it, so a leaf whose gradient comes early in the
/// backward is handed over while the rest of the backward still runs.
pub(crate) fn run(
    root: &Tensor,
    seed: &Tensor,
    wanted: Option<&HashSet<TensorId>>,
    retain: Retain,
    sink: &mut dyn FnMut(&Tensor, Tensor) -> Result<()>,
) -> Result<()> {
    if !root.requires_grad() {
        return Err(Error::Msg(format!(
            "backward: the tensor (shape {:?}) does not require grad: no parameter it depends on has requires_grad set",
            root.shape()
        )));
    }
    if seed.shape() != root.shape() {
        return Err(Error::shape("backward", format!("seed gradient {:?} does not match the output {:?}", seed.shape(), root.shape())));
    }
    let _guard = NoGradGuard::new();
    let order = latest_first(topo_order(root));
    let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
    let mut slices: HashMap<TensorId, Vec<Slice>> = HashMap::new();
    grads.insert(root.id(), seed.clone());
    for t in &order {
        let g = match (grads.remove(&t.id()), slices.remove(&t.id())) {
            (None, None) => continue,
            (dense, parts) => join_slices(t, dense, parts.unwrap_or_default())?,
        };
        let want = wanted.is_some_and(|w| w.contains(&t.id()));
        if want || (wanted.is_none() && t.is_leaf() && t.requires_grad()) {
            sink(t, g.clone())?;
        }
        let Some(f) = t.grad_fn() else { continue };
        if f.is_spent() {
            return Err(Error::Msg(format!(
                "backward: the graph through {} (shape {:?}) was spent by an earlier backward; call backward_retain_graph() \
                 the first time to go through it again (PyTorch's retain_graph=True)",
                f.name(),
                t.shape()
            )));
        }
        if retain == Retain::No {
            f.spend();
        }
        for (i, (inp, &ver)) in f.inputs.iter().zip(&f.versions).enumerate() {
            if inp.storage().version() != ver {
                return Err(Error::Msg(format!(
                    "backward: input {i} of {} (shape {:?}) was modified in place after it was used; autograd needs its old value",
                    f.name(),
                    inp.shape()
                )));
            }
        }
        if let (Op::Narrow { dim, start, .. }, [inp]) = (&f.op, &f.inputs[..]) {
            // Kept apart until the sliced tensor's turn (`join_slices`).
            if inp.requires_grad() {
                let g = if g.dtype() != inp.dtype() { g.to_dtype(inp.dtype())? } else { g };
                slices.entry(inp.id()).or_default().push(Slice { dim: *dim, start: *start, grad: g });
            }
            continue;
        }
        let needs: Vec<bool> = f.inputs.iter().map(|i| i.requires_grad()).collect();
        let dins = match &f.custom {
            Some(c) => {
                let d = (c.backward)(&g, wanted)?;
                if d.len() != f.inputs.len() {
                    return Err(Error::Msg(format!("backward: {} returned {} gradients for {} inputs", c.name, d.len(), f.inputs.len())));
                }
                d
            }
            None => rules::backward(&f.op, &f.inputs, &needs, t, &g)?,
        };
        for (inp, d) in f.inputs.iter().zip(dins) {
            let Some(d) = d else { continue };
            if !inp.requires_grad() {
                continue;
            }
            let d = if d.dtype() != inp.dtype() { d.to_dtype(inp.dtype())? } else { d };
            match grads.remove(&inp.id()) {
                Some(prev) => grads.insert(inp.id(), prev.add(&d)?),
                None => grads.insert(inp.id(), d),
            };
        }
    }
    Ok(())
}

/// The gradient of one `narrow` of a tensor: its dim, its first index there, the gradient.
struct Slice {
    dim: usize,
    start: usize,
    grad: Tensor,
}

/// The gradient of `t` from a dense part and the gradients of its slices. Slices that tile
/// `t` along one dim (q, k, v cut from one projection) are joined by one `cat`, as PyTorch's
/// `split` backward does; others are written into zeros (summed where they overlap). Zeros
/// and a sum per slice would move several times the bytes.
fn join_slices(t: &Tensor, dense: Option<Tensor>, mut parts: Vec<Slice>) -> Result<Tensor> {
    parts.sort_by_key(|p| (p.dim, p.start));
    let Some(dim) = parts.first().map(|p| p.dim) else {
        return dense.ok_or_else(|| Error::Msg("backward: a gradient with no parts".into()));
    };
    // Tiling: one dim, each slice starting where the last ended, the last ending at the end.
    let (mut tiles, mut end) = (true, 0);
    for p in &parts {
        tiles &= p.dim == dim && p.start == end;
        end = p.start + p.grad.shape()[p.dim];
    }
    tiles &= end == t.shape()[dim];
    let sliced = if tiles {
        match adjacent_views(t, dim, &parts) {
            Some(whole) => whole,
            None => Tensor::cat(&parts.iter().map(|p| &p.grad).collect::<Vec<_>>(), dim)?,
        }
    } else {
        let out = Tensor::zeros(t.shape(), t.dtype(), t.device())?;
        // Slices along the first dim that start past every earlier one overwrite zeros.
        let mut covered = 0;
        for p in &parts {
            let len = p.grad.shape()[p.dim];
            let dst = out.narrow(p.dim, p.start, len)?;
            if p.dim == dim && p.start >= covered {
                dst.assign(&p.grad)?;
            } else {
                dst.add_(&p.grad)?;
            }
            if p.dim == dim {
                covered = covered.max(p.start + len);
            }
        }
        out
    };
    match dense {
        Some(d) => d.add(&sliced),
        None => Ok(sliced),
    }
}

/// The joined gradient with no copy, when the slices' gradients already lie side by side in
/// one buffer exactly as the joined tensor would (the attention backward packs dq, dk and dv
/// that way: `Op::AttentionBackward`): that buffer, viewed whole.
fn adjacent_views(t: &Tensor, dim: usize, parts: &[Slice]) -> Option<Tensor> {
    let whole = Layout::contiguous(t.shape());
    let cell = parts.first()?.grad.storage();
    let lies_in_place = |p: &Slice| {
        let l = p.grad.layout();
        Arc::ptr_eq(p.grad.storage(), cell)
            && p.grad.dtype() == t.dtype()
            && l.shape == p.grad.shape()
            && l.strides == whole.strides
            && l.offset == p.start * whole.strides[dim]
    };
    (cell.len() == t.numel() && parts.iter().all(lies_in_place)).then(|| Tensor::from_cell(cell.clone(), whole))
}

/// Adds `g` into `leaf.grad()`, in place when a gradient is already there (so its buffer
/// stays the same across steps); a fresh gradient gets its own contiguous storage.
fn accumulate(leaf: &Tensor, g: Tensor) -> Result<()> {
    let _guard = NoGradGuard::new();
    match leaf.grad() {
        Some(prev) => prev.add_(&g),
        None => {
            let owned =
                if g.is_contiguous() && g.layout().offset == 0 && std::sync::Arc::strong_count(g.storage()) == 1 { g } else { g.copy()? };
            leaf.set_grad(Some(owned));
            Ok(())
        }
    }
}
