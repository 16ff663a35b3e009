//! Activation checkpointing (`torch.utils.checkpoint`): a function's intermediate values are
//! not kept for backward but recomputed from its inputs when backward reaches its output.

use crate::engine::{backward_with, collect, GradModeGuard, Retain};
use kiln_tensor::{no_grad, rng, Autocast, CustomBackward, Error, Result, Tensor, TensorId};
use std::collections::HashSet;
use std::sync::Arc;

/// Runs `f` on `inputs` keeping none of its intermediate values for backward: they are
/// recomputed from the inputs when backward reaches the output, one more forward of `f` for
/// the memory of its activations (PyTorch's `torch.utils.checkpoint`, reentrant form). The
/// recomputation draws the same random numbers (dropout) and runs under the same autocast
/// setting as the first run; `f` must not write to its inputs in place (an error). Parameters
/// that `f` uses get their gradients accumulated by `backward` as usual; `autograd::grad`
/// gives the gradients of tensors outside `f` (a checkpoint's inputs among them), and asking
/// it for a tensor inside `f` (a parameter it uses) is an error, as that walk cannot return
/// it. Under a tracer (a compiled step) `f` just runs: the compiled plan frees each buffer
/// after its last use instead.
pub fn checkpoint(f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static, inputs: &[&Tensor]) -> Result<Tensor> {
    let inputs: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    if kiln_tensor::is_tracing() || !kiln_tensor::is_grad_enabled() || !inputs.iter().any(Tensor::requires_grad) {
        return f(&inputs);
    }
    let (generator, autocast) = (rng::state(), kiln_tensor::autocast_dtype());
    let versions: Vec<u64> = inputs.iter().map(|t| t.storage().version()).collect();
    let out = no_grad(|| f(&inputs))?;
    // (Under `no_grad` nothing else would catch it, and the recomputation would read new values.)
    if let Some(i) = inputs.iter().zip(&versions).position(|(t, &v)| t.storage().version() != v) {
        return Err(Error::Msg(format!(
            "checkpoint: the function wrote to its input {i} (shape {:?}) in place; it runs again in backward and must not",
            inputs[i].shape()
        )));
    }
    let f = Arc::new(f);
    let saved = inputs.clone();
    let backward = move |g: &Tensor, wanted: Option<&HashSet<TensorId>>| -> Result<Vec<Option<Tensor>>> {
        // The inputs as fresh leaves, so that the recomputed graph ends at them.
        let leaves: Vec<Tensor> = saved
            .iter()
            .map(|t| {
                let leaf = t.detach();
                leaf.set_requires_grad(t.requires_grad());
                leaf
            })
            .collect();
        let out = {
            let (_grad, _cast) = (GradModeGuard::new(true), Autocast::setting(autocast)?);
            let now = rng::state();
            rng::set_state(generator);
            let out = f(&leaves);
            rng::set_state(now);
            out?
        };
        if !out.requires_grad() {
            return Ok(vec![None; leaves.len()]);
        }
        let Some(wanted) = wanted else {
            backward_with(&out, g)?;
            return Ok(leaves.iter().map(Tensor::grad).collect());
        };
        // `autograd::grad`: the leaves' gradients only, nothing accumulated.
        let mut ask: HashSet<TensorId> = leaves.iter().map(Tensor::id).collect();
        ask.extend(wanted);
        let found = collect(&out, g, Some(&ask), Retain::No)?;
        if let Some((t, _)) = found.iter().find(|(t, _)| wanted.contains(&t.id())) {
            return Err(Error::Msg(format!(
                "checkpoint: autograd::grad asked for a tensor (shape {:?}) used inside a checkpointed function, which it cannot return; use backward()",
                t.shape()
            )));
        }
        Ok(leaves.iter().map(|l| found.iter().find(|(t, _)| t.id() == l.id()).map(|(_, d)| d.clone())).collect())
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    Tensor::with_backward(&out, &refs, CustomBackward { name: "checkpoint", backward: Arc::new(backward) })
}
