//! Per-thread modes every op reads: grad mode, autocast and anomaly detection.

use crate::{DType, Error, Result};
use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on tensors that require grad record what backward needs (on this thread).
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Sets grad mode on this thread and returns the previous mode (see `kiln_autograd::no_grad`).
pub fn set_grad_enabled(on: bool) -> bool {
    GRAD_ENABLED.with(|g| g.replace(on))
}

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// The dtype matrix products compute in on this thread (`Autocast`), if any.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// Mixed precision in the manner of `torch.autocast`, while the guard lives (on this thread):
/// matrix products and attention cast F32 inputs to `dtype` (BF16 or F16), multiply on the
/// tensor cores with F32 accumulation and return `dtype`; softmax and layer norm cast F16/BF16
/// inputs up and compute in F32; cross-entropy reads F16/BF16 logits as they are, computes in
/// F32 and returns F32 losses (its gradient in the logits' dtype); binary ops of mixed float dtypes
/// compute in the wider one. Parameters and their gradients stay F32 (the casts' backward
/// returns F32 gradients).
/// A compiled step traced under autocast records the casts, and is keyed by the setting.
pub struct Autocast {
    prev: Option<DType>,
    /// The setting is per thread: the guard stays on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Autocast {
    pub fn new(dtype: DType) -> Result<Autocast> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::Msg(format!("autocast: computes in BF16 or F16, not {dtype:?}")));
        }
        Ok(Autocast { prev: AUTOCAST.with(|a| a.replace(Some(dtype))), _not_send: std::marker::PhantomData })
    }

    /// The setting `dtype` while the guard lives: autocast to it, or (`None`) off.
    pub fn setting(dtype: Option<DType>) -> Result<Autocast> {
        match dtype {
            Some(d) => Autocast::new(d),
            None => Ok(Autocast { prev: AUTOCAST.with(|a| a.replace(None)), _not_send: std::marker::PhantomData }),
        }
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.prev));
    }
}

thread_local! {
    static DETECT_ANOMALY: Cell<bool> = const { Cell::new(false) };
}

/// Anomaly mode on this thread (like `torch.autograd.set_detect_anomaly`): every op's float
/// output is checked, and the first op that makes NaN from inputs without NaN (or infinity
/// from finite inputs, masks excepted) returns an error naming it and its input shapes.
/// Costs a pass over every output; for debugging.
pub fn set_detect_anomaly(on: bool) {
    DETECT_ANOMALY.with(|c| c.set(on));
}

/// Whether anomaly mode is on for this thread (`set_detect_anomaly`).
pub fn is_anomaly_detection() -> bool {
    DETECT_ANOMALY.with(|c| c.get())
}

/// Runs `f` with autograd recording off on this thread (ops still reach the tracer).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let prev = set_grad_enabled(false);
    let r = f();
    set_grad_enabled(prev);
    r
}
