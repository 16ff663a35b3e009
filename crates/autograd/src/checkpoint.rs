//! Activation checkpointing (`torch.utils.checkpoint`): a function's intermediate values are
//! not kept for backward but recomputed from its inputs when backward reaches its output.

use crate::{backward_with, EnableGradGuard};
use kiln_tensor::{no_grad, rng, Autocast, CustomBackward, Error, Result, Tensor};
use std::sync::Arc;

/// Runs `f` on `inputs` keeping none of its intermediate values for backward: they are
/// recomputed from the inputs when backward reaches the output, one more forward of `f` for
/// the memory of its activations (PyTorch's `torch.utils.checkpoint`, reentrant form). The
/// recomputation draws the same random numbers (dropout) and runs under the same autocast
/// setting as the first run. Parameters that `f` uses get their gradients accumulated by
/// `backward` as usual; `autograd::grad` through a checkpoint is an error (it could not return
/// them). Under a tracer (a compiled step) `f` just runs: the compiled plan frees each buffer
/// after its last use instead.
pub fn checkpoint(f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static, inputs: &[&Tensor]) -> Result<Tensor> {
    let inputs: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    if kiln_tensor::is_tracing() || !kiln_tensor::is_grad_enabled() || !inputs.iter().any(Tensor::requires_grad) {
        return f(&inputs);
    }
    let (generator, autocast) = (rng::state(), kiln_tensor::autocast_dtype());
    let out = no_grad(|| f(&inputs))?;
    let f = Arc::new(f);
    let saved = inputs.clone();
    let backward = move |g: &Tensor, accumulate: bool| -> Result<Vec<Option<Tensor>>> {
        if !accumulate {
            return Err(Error::Msg(
                "checkpoint: autograd::grad cannot return the gradients of parameters inside a checkpointed function; use backward()"
                    .into(),
            ));
        }
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
            let (_grad, _cast) = (EnableGradGuard::new(), Autocast::setting(autocast)?);
            let now = rng::state();
            rng::set_state(generator);
            let out = f(&leaves);
            rng::set_state(now);
            out?
        };
        if out.requires_grad() {
            backward_with(&out, g)?;
        }
        Ok(leaves.iter().map(Tensor::grad).collect())
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    Tensor::with_backward(&out, &refs, CustomBackward { name: "checkpoint", backward: Arc::new(backward) })
}
