//! Optimizer checkpoints as safetensors files: the tensors of `Optimizer::state_tensors`
//! (step, lr and per-parameter buffers) under their names. F32 and F64 only.

use crate::Optimizer;
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// Writes `opt`'s state to `path` (reading the tensors on the host).
pub fn save_state(opt: &dyn Optimizer, path: &Path) -> Result<()> {
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = opt
        .state_tensors()
        .into_iter()
        .map(|(name, t)| {
            let (dtype, bytes) = encode(&name, &t)?;
            Ok((name, dtype, t.shape().to_vec(), bytes))
        })
        .collect::<Result<_>>()?;
    let io_err = |e: safetensors::SafeTensorError| Error::Io(format!("{}: {e}", path.display()));
    let views = encoded
        .iter()
        .map(|(name, dtype, shape, bytes)| Ok((name.as_str(), TensorView::new(*dtype, shape.clone(), bytes).map_err(io_err)?)))
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(io_err)
}

/// Loads a file written by `save_state` into `opt` (checked in full before anything changes).
pub fn load_state(opt: &mut dyn Optimizer, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| format_err(path, format!("not a valid safetensors file: {e}")))?;
    let tensors = file.tensors().into_iter().map(|(name, view)| Ok((name.clone(), decode(path, &name, &view)?))).collect::<Result<Vec<_>>>()?;
    opt.load_state_tensors(&tensors)
}

/// Little-endian bytes of an F32 or F64 tensor.
fn encode(name: &str, t: &Tensor) -> Result<(Dtype, Vec<u8>)> {
    match t.dtype() {
        DType::F32 => Ok((Dtype::F32, t.to_vec::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect())),
        DType::F64 => Ok((Dtype::F64, t.to_vec::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect())),
        other => Err(Error::dtype("save_state", format!("'{name}' is {other:?}; only F32 and F64 state can be saved"))),
    }
}

/// A CPU tensor from a stored F32 or F64 tensor (safetensors has checked the byte count).
fn decode(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Tensor> {
    let shape = view.shape();
    match view.dtype() {
        Dtype::F32 => Tensor::from_vec(from_le(view.data(), f32::from_le_bytes), shape, Device::Cpu),
        Dtype::F64 => Tensor::from_vec(from_le(view.data(), f64::from_le_bytes), shape, Device::Cpu),
        other => Err(format_err(path, format!("tensor '{name}' is {other}; optimizer state is F32 or F64"))),
    }
}

fn from_le<const N: usize, T>(data: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    data.chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

fn format_err(path: &Path, msg: String) -> Error {
    Error::Format { what: format!("optimizer state {}", path.display()), msg }
}
