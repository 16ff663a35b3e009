//! Optimizer checkpoints as safetensors files: the tensors of `Optimizer::state_tensors`
//! (step, lr and per-parameter buffers) under their names.

use crate::optimizer::Optimizer;
use kiln_tensor::io::{load_tensors, save_tensors};
use kiln_tensor::{Error, Result};
use std::path::Path;

/// Writes `opt`'s state to `path` (reading the tensors on the host).
pub fn save_state(opt: &dyn Optimizer, path: &Path) -> Result<()> {
    let bytes = save_tensors(&opt.state_tensors(), None)?;
    std::fs::write(path, bytes).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}

/// Loads a file written by `save_state` into `opt` (checked in full before anything changes).
pub fn load_state(opt: &mut dyn Optimizer, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    let (tensors, _) =
        load_tensors(&bytes).map_err(|e| Error::Format { what: format!("optimizer state {}", path.display()), msg: e.to_string() })?;
    opt.load_state_tensors(&tensors)
}
