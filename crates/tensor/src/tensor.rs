//! The `Tensor` type and the one dispatch point every op goes through: shape rule, kernel,
//! autograd record, trace hook.

use crate::backend::{self, Buffer};
use crate::mode::{is_anomaly_detection, is_grad_enabled};
use crate::op::{InMeta, Op, OutMeta, Part, Parts};
use crate::shape::Layout;
use crate::storage::{CpuSlice, CpuStorage, IntoCpuStorage, Storage, StorageCell};
use crate::{cpu, DType, Device, Element, Error, Result};
use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A process-unique tensor id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u64);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The id the next tensor made will get (ids only grow): tensors with a smaller id existed
/// before this call.
pub fn next_tensor_id() -> u64 {
    NEXT_ID.load(Ordering::Relaxed)
}

/// What autograd needs to differentiate an op's output: the op and its inputs (with the
/// storage versions they had, to catch in-place writes that would make backward wrong).
/// The output itself is not saved (that would be a cycle); backward receives it.
pub struct GradFn {
    pub op: Op,
    pub inputs: Vec<Tensor>,
    pub versions: Vec<u64>,
    /// A backward of the caller's own in place of `op`'s rule (`Tensor::with_backward`).
    pub custom: Option<CustomBackward>,
    /// Set once a backward walked through this record without retaining the graph: it is
    /// spent, as PyTorch frees a graph's saved tensors, and a second walk is an error.
    spent: AtomicBool,
}

impl GradFn {
    /// The record of `op` (or, with `custom`, the caller's backward) over `inputs`, with the
    /// storage versions they have now.
    fn new(op: Op, inputs: &[&Tensor], custom: Option<CustomBackward>) -> GradFn {
        let versions = inputs.iter().map(|t| t.0.storage.version()).collect();
        GradFn { op, inputs: inputs.iter().map(|t| (*t).clone()).collect(), versions, custom, spent: AtomicBool::new(false) }
    }

    /// Marks the record spent by a backward; whether it already was.
    pub fn spend(&self) -> bool {
        self.spent.swap(true, Ordering::Relaxed)
    }

    /// Whether a backward already walked through this record without retaining it.
    pub fn is_spent(&self) -> bool {
        self.spent.load(Ordering::Relaxed)
    }

    /// The op's name, or the custom backward's.
    pub fn name(&self) -> &str {
        self.custom.as_ref().map_or(self.op.name(), |c| c.name)
    }
}

impl std::fmt::Debug for GradFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradFn").field("op", &self.name()).field("inputs", &self.inputs.len()).finish()
    }
}

/// A backward written by the caller (like a `torch.autograd.Function`'s): given the output's
/// gradient and, when the walk only returns the gradients of some tensors (`grad`), their ids
/// (`None`: it accumulates into the leaves, `backward`), one gradient per input.
#[derive(Clone)]
pub struct CustomBackward {
    pub name: &'static str,
    pub backward: Arc<BackwardFn>,
}

/// `CustomBackward`'s function: (the output's gradient, the wanted ids) to the inputs' gradients.
pub type BackwardFn = dyn Fn(&Tensor, Option<&HashSet<TensorId>>) -> Result<Vec<Option<Tensor>>> + Send + Sync;

/// An n-dimensional array on a device. Cloning is cheap (an `Arc`); views share storage.
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

struct Inner {
    id: TensorId,
    storage: Arc<StorageCell>,
    layout: Layout,
    dtype: DType,
    device: Device,
    grad_fn: Option<Arc<GradFn>>,
    requires_grad: AtomicBool,
    grad: Mutex<Option<Tensor>>,
}

// Dropping a long chain of recorded ops would recurse once per op (Inner -> GradFn -> inputs
// -> Inner ...) and overflow the stack; unlink the chain iteratively instead.
impl Drop for Inner {
    fn drop(&mut self) {
        let Some(first) = self.grad_fn.take() else { return };
        let mut stack = vec![first];
        while let Some(f) = stack.pop() {
            let Ok(mut f) = Arc::try_unwrap(f) else { continue };
            for t in f.inputs.drain(..) {
                if let Ok(mut inner) = Arc::try_unwrap(t.0) {
                    stack.extend(inner.grad_fn.take());
                }
            }
        }
    }
}

/// Observes every op while a compiled step is traced. Installed per thread by `kiln-compile`.
pub trait Tracer {
    /// Called after each op with its inputs and its output (the destination for in-place ops).
    fn record(&self, op: &Op, inputs: &[&Tensor], output: &Tensor);
    /// Called when values are read on the host (`to_vec`, `item`, printing): an error stops the
    /// read (fullgraph), `Ok` lets it happen (the tracer then marks a graph break).
    fn host_read(&self, what: &'static str, t: &Tensor) -> Result<()>;
    /// Called when a `Flag` is read: a compiled step keeps the value as a guard.
    fn flag_read(&self, _flag: &Flag, _value: bool) {}
    /// Called when a tensor's `grad` is set (`cleared`: to None, as `zero_grad` does): a step
    /// that clears a parameter's gradient before reading it replays whatever it held.
    fn grad_set(&self, _t: &Tensor, _cleared: bool) {}
}

/// A switch that changes what a step computes (a module's train/eval mode), set through
/// `&self`. Reading it under a tracer records its value: a compiled step replays only while
/// its flags read as they did at trace time, and traces again otherwise (as torch.compile
/// guards on `module.training`). Cloning makes an independent flag (a cloned model has its
/// own mode); `share` makes a handle to the same one.
#[derive(Debug)]
pub struct Flag(Arc<AtomicBool>);

impl Flag {
    pub fn new(value: bool) -> Flag {
        Flag(Arc::new(AtomicBool::new(value)))
    }

    pub fn get(&self) -> bool {
        let value = self.0.load(Ordering::Relaxed);
        with_tracer(|t| t.flag_read(self, value));
        value
    }

    pub fn set(&self, value: bool) {
        self.0.store(value, Ordering::Relaxed)
    }

    /// A handle to this same flag (what a trace keeps to check it later).
    pub fn share(&self) -> Flag {
        Flag(self.0.clone())
    }

    pub fn same(&self, other: &Flag) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Clone for Flag {
    fn clone(&self) -> Flag {
        Flag::new(self.0.load(Ordering::Relaxed))
    }
}

thread_local! {
    static TRACER: RefCell<Option<Rc<dyn Tracer>>> = const { RefCell::new(None) };
}

/// Installs (or with `None` removes) this thread's tracer; returns the previous one.
pub fn set_tracer(t: Option<Rc<dyn Tracer>>) -> Option<Rc<dyn Tracer>> {
    TRACER.with(|c| c.replace(t))
}

/// Whether a tracer is installed on this thread (hand-fused eager kernels then step aside,
/// so the trace holds primitives only).
pub fn is_tracing() -> bool {
    TRACER.with(|c| c.borrow().is_some())
}

/// Calls `f` with the active tracer, taken out meanwhile so ops it runs are not recorded.
fn with_tracer<R>(f: impl FnOnce(&dyn Tracer) -> R) -> Option<R> {
    let t = TRACER.with(|c| c.borrow_mut().take())?;
    let r = f(&*t);
    TRACER.with(|c| *c.borrow_mut() = Some(t));
    Some(r)
}

impl Tensor {
    fn make(storage: Arc<StorageCell>, layout: Layout, dtype: DType, device: Device, grad_fn: Option<Arc<GradFn>>) -> Tensor {
        let requires_grad = AtomicBool::new(grad_fn.is_some());
        Tensor(Arc::new(Inner {
            id: TensorId(NEXT_ID.fetch_add(1, Ordering::Relaxed)),
            storage,
            layout,
            dtype,
            device,
            grad_fn,
            requires_grad,
            grad: Mutex::new(None),
        }))
    }

    /// A tensor over an existing storage cell with any layout (no autograd history). The
    /// compiler uses it to hand out views of its persistent buffers.
    pub fn from_cell(cell: Arc<StorageCell>, layout: Layout) -> Tensor {
        let (dtype, device) = {
            let s = cell.read();
            match &*s {
                Storage::Cpu(c) => (c.dtype(), Device::Cpu),
                #[cfg(feature = "cuda")]
                Storage::Cuda(c) => (c.dtype(), c.device()),
            }
        };
        Tensor::make(cell, layout, dtype, device, None)
    }

    pub(crate) fn from_storage(s: Storage, shape: &[usize]) -> Tensor {
        let (dtype, device) = match &s {
            Storage::Cpu(c) => (c.dtype(), Device::Cpu),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => (c.dtype(), c.device()),
        };
        Tensor::make(Arc::new(StorageCell::new(s)), Layout::contiguous(shape), dtype, device, None)
    }

    /// A tensor holding `data` with `shape` on `device`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize], device: Device) -> Result<Tensor>
    where
        Vec<T>: IntoCpuStorage,
    {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::shape("from_vec", format!("{} elements do not fill shape {shape:?} ({n} elements)", data.len())));
        }
        let t = Tensor::from_storage(Storage::Cpu(data.into_storage()), shape);
        t.to_device(device)
    }

    pub fn from_slice<T: Element>(data: &[T], shape: &[usize], device: Device) -> Result<Tensor>
    where
        Vec<T>: IntoCpuStorage,
    {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    pub fn id(&self) -> TensorId {
        self.0.id
    }
    pub fn shape(&self) -> &[usize] {
        &self.0.layout.shape
    }
    /// The size of one dim (negative counts from the end).
    pub fn dim<D: crate::Dim>(&self, d: D) -> Result<usize> {
        Ok(self.shape()[d.to_index("dim", self.shape())?])
    }
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    pub fn device(&self) -> Device {
        self.0.device
    }
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub fn strides(&self) -> &[usize] {
        &self.0.layout.strides
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// The shared storage (views of one tensor return the same cell).
    pub fn storage(&self) -> &Arc<StorageCell> {
        &self.0.storage
    }
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    // ---- autograd slots (the rules and the walk live in kiln-autograd) ----

    /// The op that made this tensor, when it was recorded for autograd.
    pub fn grad_fn(&self) -> Option<&Arc<GradFn>> {
        self.0.grad_fn.as_ref()
    }
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }
    /// Marks a leaf as a parameter whose gradient backward accumulates.
    pub fn set_requires_grad(&self, on: bool) -> &Tensor {
        self.0.requires_grad.store(on, Ordering::Relaxed);
        self
    }
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }
    /// The accumulated gradient of a leaf, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set_grad(&self, g: Option<Tensor>) {
        with_tracer(|t| t.grad_set(self, g.is_none()));
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }
    /// The same data with no autograd history (shares storage, like torch's `detach`).
    /// An identity view made with grad mode off, so a tracer still sees where it came from.
    pub fn detach(&self) -> Tensor {
        let view = crate::mode::no_grad(|| Tensor::apply(Op::Reshape(self.shape().to_vec()), &[self], self.device()));
        view.unwrap_or_else(|_| Tensor::make(self.0.storage.clone(), self.0.layout.clone(), self.0.dtype, self.0.device, None))
    }

    /// `value` (shared, not copied) recorded as the output of `inputs` with a backward of the
    /// caller's own, when grad mode is on, `value` is a float and some input requires grad;
    /// else `value` itself. Nothing is traced: under a tracer, record the ops themselves instead.
    pub fn with_backward(value: &Tensor, inputs: &[&Tensor], backward: CustomBackward) -> Result<Tensor> {
        if is_tracing() {
            return Err(Error::Msg(format!("{}: a custom backward cannot be traced; run its ops plainly under a tracer", backward.name)));
        }
        if !is_grad_enabled() || !value.dtype().is_float() || !inputs.iter().any(|t| t.requires_grad()) {
            return Ok(value.clone());
        }
        // (The op is a placeholder: the walk runs `backward` instead of its rule.)
        let f = Arc::new(GradFn::new(Op::Contiguous, inputs, Some(backward)));
        Ok(Tensor::make(value.0.storage.clone(), value.0.layout.clone(), value.0.dtype, value.0.device, Some(f)))
    }

    // ---- dispatch ----

    /// Runs one primitive op. Every tensor op ends here: check devices, apply the shape rule,
    /// run the kernel (or build the view), record for autograd and tell the tracer.
    pub fn apply(op: Op, inputs: &[&Tensor], device: Device) -> Result<Tensor> {
        if op.is_inplace() {
            return Err(Error::Msg(format!("{}: in-place ops go through apply_inplace", op.name())));
        }
        let device = common_device(op.name(), inputs, device)?;
        let metas: Vec<InMeta> = inputs.iter().map(|t| InMeta { shape: t.shape(), dtype: t.dtype() }).collect();
        let meta = op.infer(&metas)?;
        let (storage, layout) = match view_layout(&op, inputs) {
            Some(layout) => (inputs[0].0.storage.clone(), layout),
            None => {
                let kernel_op = match &op {
                    Op::Reshape(_) => Op::Contiguous, // a reshape the strides cannot express copies
                    other => other.clone(),
                };
                let cell = match crate::lazy::defer(&kernel_op, inputs, &meta, device)? {
                    Some(cell) => cell,
                    None => {
                        Arc::new(StorageCell::new(profiled(&kernel_op, &meta, device, || backend::run(&kernel_op, inputs, &meta, device))?))
                    }
                };
                (cell, Layout::contiguous(&meta.shape))
            }
        };
        let differentiable = meta.dtype.is_float() && is_grad_enabled() && inputs.iter().any(|t| t.requires_grad());
        let grad_fn = differentiable.then(|| Arc::new(GradFn::new(op.clone(), inputs, None)));
        let out = Tensor::make(storage, layout, meta.dtype, device, grad_fn);
        if is_anomaly_detection() && !op.is_view() {
            check_finite(&op, inputs, &out)?;
        }
        with_tracer(|t| t.record(&op, inputs, &out));
        Ok(out)
    }

    /// Runs an in-place op (`Assign`, `UpdateBinary`, `UpdateScalar`) writing into `self`.
    pub fn apply_inplace(&self, op: Op, src: Option<&Tensor>) -> Result<()> {
        self.apply_inplace_as(op.name(), op, src)
    }

    /// `apply_inplace` for the user's call `name` (`zero_`, `fill_`, ...), which its errors
    /// name.
    pub(crate) fn apply_inplace_as(&self, name: &'static str, op: Op, src: Option<&Tensor>) -> Result<()> {
        if !op.is_inplace() {
            return Err(Error::Msg(format!("{name}: not an in-place op")));
        }
        let mut inputs: Vec<&Tensor> = vec![self];
        inputs.extend(src);
        common_device(name, &inputs, self.device())?;
        let metas: Vec<InMeta> = inputs.iter().map(|t| InMeta { shape: t.shape(), dtype: t.dtype() }).collect();
        op.infer(&metas)?;
        if is_grad_enabled() && inputs.iter().any(|t| t.requires_grad()) {
            return Err(Error::Msg(format!(
                "{name}: in-place update of a tensor that requires grad (shape {:?}); run optimizer-style updates inside no_grad",
                self.shape()
            )));
        }
        if self.0.layout.shape.iter().zip(&self.0.layout.strides).any(|(&d, &s)| d > 1 && s == 0) {
            return Err(Error::Msg(format!(
                "{name}: cannot write into an expanded view (shape {:?}, strides {:?})",
                self.shape(),
                self.strides()
            )));
        }
        // A source sharing the destination's storage is copied first (no aliasing while writing).
        let src_copy;
        let src = match src {
            Some(s) if s.same_storage(self) => {
                src_copy = s.copy()?;
                Some(&src_copy)
            }
            other => other,
        };
        if !crate::lazy::defer_inplace(&op, self, src) {
            let meta = OutMeta { shape: self.shape().to_vec(), dtype: self.dtype() };
            profiled(&op, &meta, self.device(), || backend::run_inplace(&op, self, src, true))?;
        }
        if is_anomaly_detection() {
            check_finite(&op, &inputs, self)?;
        }
        with_tracer(|t| t.record(&op, &inputs, self));
        Ok(())
    }

    /// How many elements are NaN, and how many infinite (no host-read hook: a debugging aid).
    pub fn count_nan_inf(&self) -> Result<(usize, usize)> {
        if !self.dtype().is_float() {
            return Ok((0, 0));
        }
        let t = self.to_device(Device::Cpu)?;
        t.with_cpu_storage(|s, l| {
            let kinds: Vec<u8> = crate::with_cpu!(s, v => cpu::elementwise::map1(v, l, |x| {
                let f = x.to_f64();
                if f.is_nan() { 1u8 } else if f.is_infinite() { 2 } else { 0 }
            }));
            (kinds.iter().filter(|&&k| k == 1).count(), kinds.iter().filter(|&&k| k == 2).count())
        })
    }

    /// A fresh contiguous copy that shares nothing with `self`.
    pub fn copy(&self) -> Result<Tensor> {
        Tensor::apply(Op::Contiguous, &[self], self.device())
    }

    /// The data as a Vec of `T` in row-major order (`T` must be the dtype).
    pub fn to_vec<T: CpuSlice>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype("to_vec", format!("tensor is {:?}, asked for {:?}", self.dtype(), T::DTYPE)));
        }
        self.host_read("to_vec")?;
        let t = self.to_device(Device::Cpu)?;
        let guard = t.0.storage.read();
        let s = guard.as_cpu()?;
        let v = T::slice(s).ok_or_else(|| Error::dtype("to_vec", "storage dtype mismatch"))?;
        Ok(cpu::elementwise::map1(v, t.layout(), |x| x))
    }

    /// The data converted to f64, whatever the dtype.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        self.host_read("to_vec")?;
        let t = self.to_device(Device::Cpu)?;
        let guard = t.0.storage.read();
        let s = guard.as_cpu()?;
        Ok(crate::with_cpu!(s, v => cpu::elementwise::map1(v, t.layout(), |x| x.to_f64())))
    }

    /// The single value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::shape("item", format!("needs exactly one element, got shape {:?}", self.shape())));
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// Tells the tracer (if any) that values are read on the host, then runs queued kernels.
    pub(crate) fn host_read(&self, what: &'static str) -> Result<()> {
        with_tracer(|t| t.host_read(what, self)).unwrap_or(Ok(()))?;
        crate::lazy::flush()
    }

    /// Copies to another device (a no-op returning `self` when already there).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        crate::lazy::flush()?;
        // A strided CPU view uploads its own elements only, made dense here first.
        let src = if self.device() == Device::Cpu { self.contiguous()? } else { self.clone() };
        let storage = crate::cuda::to_device(&src.0.storage.read(), &src.0.layout, device)?;
        Ok(Tensor::from_storage(storage, self.shape()))
    }

    /// Runs `f` with the CPU storage of a tensor on the CPU (for loaders and savers).
    pub fn with_cpu_storage<R>(&self, f: impl FnOnce(&CpuStorage, &Layout) -> R) -> Result<R> {
        crate::lazy::flush()?;
        let guard = self.0.storage.read();
        match &*guard {
            Storage::Cpu(s) => Ok(f(s, &self.0.layout)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(Error::Msg("with_cpu_storage: tensor is on a CUDA device".into())),
        }
    }
}

/// Anomaly mode's check: an op whose inputs are finite must not make NaN or infinity.
fn check_finite(op: &Op, inputs: &[&Tensor], out: &Tensor) -> Result<()> {
    let (nan, inf) = out.count_nan_inf()?;
    // Masks legitimately hold -inf (attention), so infinity counts only when made from finite
    // values by arithmetic.
    let inf_ok = matches!(op, Op::Full { .. } | Op::Where | Op::Cat { .. } | Op::Contiguous | Op::Assign | Op::Reduce { .. });
    if nan == 0 && (inf == 0 || inf_ok) {
        return Ok(());
    }
    let shapes: Vec<String> = inputs.iter().map(|t| format!("{:?} {:?}", t.shape(), t.dtype())).collect();
    let mut inputs_inf = false;
    for (i, t) in inputs.iter().enumerate() {
        let (n, f) = t.count_nan_inf()?;
        if n > 0 && nan > 0 {
            return Err(Error::Msg(format!(
                "anomaly: input {i} of {} (inputs {}) already held NaN; it was made outside Kiln's ops",
                op.name(),
                shapes.join(", ")
            )));
        }
        inputs_inf |= f > 0;
    }
    if nan == 0 && inputs_inf {
        return Ok(());
    }
    Err(Error::Msg(format!(
        "anomaly: {} produced {nan} NaN and {inf} infinite value(s) in its output {:?} from inputs {}",
        op.name(),
        out.shape(),
        shapes.join(", ")
    )))
}

fn common_device(op: &'static str, inputs: &[&Tensor], default: Device) -> Result<Device> {
    let Some(first) = inputs.first() else { return Ok(default) };
    for t in &inputs[1..] {
        if t.device() != first.device() {
            return Err(Error::DeviceMismatch { op, lhs: first.device(), rhs: t.device() });
        }
    }
    Ok(first.device())
}

/// The layout of a view op's output, or None when the op needs a kernel (including a reshape
/// that the input's strides cannot express).
fn view_layout(op: &Op, inputs: &[&Tensor]) -> Option<Layout> {
    let l = inputs.first()?.layout();
    match op {
        Op::Reshape(shape) if *shape == l.shape => Some(l.clone()),
        Op::Reshape(shape) => l.reshaped(shape),
        Op::Permute(perm) => Some(l.permuted(perm)),
        Op::Narrow { dim, start, len } => {
            let mut out = l.clone();
            out.offset += start * l.strides[*dim];
            out.shape[*dim] = *len;
            Some(out)
        }
        Op::Expand(shape) => Some(Layout { shape: shape.clone(), strides: l.broadcast_strides(shape), offset: l.offset }),
        _ => None,
    }
}

/// Runs `f`, timing it per op kind when `KILN_PROFILE` is set (GPU work synchronised).
pub(crate) fn profiled<R>(op: &Op, meta: &OutMeta, device: Device, f: impl FnOnce() -> Result<R>) -> Result<R> {
    if !crate::profile::enabled() {
        return f();
    }
    crate::cuda::synchronize(device)?;
    let t = std::time::Instant::now();
    let r = f()?;
    crate::cuda::synchronize(device)?;
    let shape = if matches!(op, Op::Matmul | Op::Reduce { .. }) { format!(" -> {:?}", meta.shape) } else { String::new() };
    crate::profile::record(format!("{} {:?}{shape}", op.name(), meta.dtype), t.elapsed().as_secs_f64());
    Ok(r)
}

impl Buffer for Tensor {
    fn cell(&self) -> &Arc<StorageCell> {
        &self.0.storage
    }
    fn layout(&self) -> &Layout {
        &self.0.layout
    }
}

impl Tensor {
    /// One result of an op with several (`Parts`), as a view of its flat output `self`.
    pub(crate) fn part(&self, parts: &Parts, part: Part) -> Result<Tensor> {
        let at = parts.view(part)?;
        self.narrow(0, at.offset, at.numel())?.reshape(&at.shape)
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor[{:?}, {:?}, {}]", self.shape(), self.dtype(), self.device())
    }
}
