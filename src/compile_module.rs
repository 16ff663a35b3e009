//! `torch.compile(model)`: a module compiled as a whole, called like the model. Its forward
//! runs as one compiled graph; with grad mode on and parameters (or the input) requiring
//! grad, the output is differentiable, and `loss.backward()` runs the module's backward as a
//! second compiled graph that writes the parameters' `.grad()` as the eager tape would, so an
//! eager optimizer steps after it. The backward graph recomputes the forward from the input
//! (as activation checkpointing does), so no activation outlives the forward call.
//!
//! ```no_run
//! use kiln::prelude::*;
//! use kiln::compile::Mode;
//! let model = kiln::nn::Linear::new(784, 10, true, Device::Cpu)?;
//! let compiled = kiln::compile_module(Mode::Default, &model);
//! let x = Tensor::randn(&[32, 784], DType::F32, Device::Cpu)?;
//! compiled.forward(&x)?.square()?.mean_all()?.backward()?;
//! assert!(model.weight.grad().is_some());
//! # Ok::<(), kiln::Error>(())
//! ```

use kiln_autograd::{GradModeGuard, NoGradGuard};
use kiln_compile::{compile, Compiled, Mode};
use kiln_nn::{Forward, Module};
use kiln_tensor::{CustomBackward, Error, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

/// A compiled step: inputs in, outputs out.
type Step = Compiled<Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>>>;

thread_local! {
    /// The compiled backward graphs of this thread's live compiled modules, by id: the
    /// autograd walk reaches them through a `Send` handle (the id), and a module's graphs hold
    /// thread-bound state.
    static BACKWARDS: RefCell<HashMap<usize, Backward>> = RefCell::new(HashMap::new());
    static NEXT_ID: Cell<usize> = const { Cell::new(0) };
}

/// One module's backward graphs (with and without the input's gradient) and which outputs
/// of each are gradients (a parameter the output does not depend on gets none).
struct Backward {
    with_dx: Step,
    params_only: Step,
    present: [Rc<RefCell<Vec<bool>>>; 2],
}

/// A module compiled as a whole (`compile_module`).
pub struct CompiledModule<M> {
    forward: RefCell<Step>,
    params: Vec<Tensor>,
    id: usize,
    _model: std::marker::PhantomData<M>,
}

/// Compiles `model` as a whole, as `torch.compile(model)` does: the result is called like the
/// model (`Forward`), its forward one compiled graph per input signature, its output
/// differentiable (see the module's docs). The compiled module keeps a clone of `model`,
/// which shares its parameters: training either one trains both.
pub fn compile_module<M>(mode: Mode, model: &M) -> CompiledModule<M>
where
    M: Module + Forward + Clone + 'static,
{
    let m = model.clone();
    let forward: Step = compile(mode, Box::new(move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?])));
    let params = model.parameters();
    let backward = |dx: bool| {
        let (m, params) = (model.clone(), params.clone());
        let present = Rc::new(RefCell::new(Vec::new()));
        let seen = present.clone();
        let step: Step = compile(
            mode,
            Box::new(move |xs: &[Tensor]| {
                let x = xs[0].detach();
                x.set_requires_grad(dx);
                let root = m.forward(&x)?.mul(&xs[1])?.sum_all()?;
                let wrt: Vec<&Tensor> = dx.then_some(&x).into_iter().chain(&params).collect();
                let grads = kiln_autograd::grad(&root, &wrt)?;
                *seen.borrow_mut() = grads.iter().map(Option::is_some).collect();
                Ok(grads.into_iter().flatten().collect())
            }),
        );
        (step, present)
    };
    let ((with_dx, p1), (params_only, p2)) = (backward(true), backward(false));
    let id = NEXT_ID.with(|n| n.replace(n.get() + 1));
    BACKWARDS.with(|b| b.borrow_mut().insert(id, Backward { with_dx, params_only, present: [p1, p2] }));
    CompiledModule { forward: RefCell::new(forward), params, id, _model: std::marker::PhantomData }
}

impl<M> Forward for CompiledModule<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let differentiable = kiln_tensor::is_grad_enabled() && (x.requires_grad() || self.params.iter().any(Tensor::requires_grad));
        let out = {
            let _plain = NoGradGuard::new();
            let mut f =
                self.forward.try_borrow_mut().map_err(|_| Error::Msg("compile_module: the compiled module called itself".into()))?;
            f.call(&[x.detach()])?.remove(0)
        };
        if !differentiable {
            return Ok(out);
        }
        let (id, input) = (self.id, x.detach());
        let dx = x.requires_grad();
        let backward = move |g: &Tensor, _: Option<&std::collections::HashSet<kiln_tensor::TensorId>>| run_backward(id, &input, g, dx);
        let inputs: Vec<&Tensor> = std::iter::once(x).chain(&self.params).collect();
        Tensor::with_backward(&out, &inputs, CustomBackward { name: "compile_module", backward: Arc::new(backward) })
    }
}

/// The gradients of module `id`'s inputs (x, then its parameters) for the output gradient
/// `g`, by its compiled backward graph; `dx`: whether x's gradient is wanted.
fn run_backward(id: usize, x: &Tensor, g: &Tensor, dx: bool) -> Result<Vec<Option<Tensor>>> {
    let gone = || {
        Error::Msg(format!("compile_module: the backward of compiled module {id} runs on another thread or after the module was dropped"))
    };
    // Taken out while it runs (its trace may reach other compiled modules), then put back.
    let mut b = BACKWARDS.with(|m| m.borrow_mut().remove(&id)).ok_or_else(gone)?;
    let result = {
        let _grad = GradModeGuard::new(true);
        let step = if dx { &mut b.with_dx } else { &mut b.params_only };
        step.call(&[x, &g.detach()])
    };
    let present = b.present[usize::from(!dx)].borrow().clone();
    BACKWARDS.with(|m| m.borrow_mut().insert(id, b));
    let mut grads = result?.into_iter();
    let mut out: Vec<Option<Tensor>> = present.iter().map(|&p| if p { grads.next() } else { None }).collect();
    if !dx {
        out.insert(0, None);
    }
    Ok(out)
}

impl<M> Drop for CompiledModule<M> {
    fn drop(&mut self) {
        BACKWARDS.with(|m| m.borrow_mut().remove(&self.id));
    }
}

impl<M> CompiledModule<M> {
    /// What the compiled forward does (graphs, kernels, memory), as `Compiled::explain`.
    pub fn explain(&self) -> kiln_compile::Explain {
        self.forward.borrow().explain()
    }
}
