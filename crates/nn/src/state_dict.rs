//! State dicts as safetensors, with PyTorch's names: a file saved by
//! `safetensors.torch.save_file(model.state_dict(), path)` loads into the matching module.
//! Loading validates every name, shape and dtype first and writes nothing on any error.

use crate::module::Module;
use kiln_tensor::io::{load_tensors, save_tensors};
use kiln_tensor::{no_grad, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

pub fn state_dict_to_bytes(m: &dyn Module) -> Result<Vec<u8>> {
    save_tensors(&m.named_state(), None)
}

pub fn save_state_dict(m: &dyn Module, path: &Path) -> Result<()> {
    std::fs::write(path, state_dict_to_bytes(m)?).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}

/// Loads a state dict into `m` in place. `strict`: the file must hold exactly the module's
/// parameters and buffers (extra entries are errors too, as in PyTorch). Values of another float dtype
/// are converted; shapes must match.
pub fn load_state_dict_from_bytes(m: &dyn Module, bytes: &[u8], strict: bool) -> Result<()> {
    let (tensors, _) = load_tensors(bytes)?;
    let file: BTreeMap<String, Tensor> = tensors.into_iter().collect();
    let params = m.named_state();
    let mut plan = Vec::with_capacity(params.len());
    for (name, p) in &params {
        let Some(t) = file.get(name) else {
            if strict {
                return Err(Error::Msg(format!("load_state_dict: missing tensor '{name}' (shape {:?})", p.shape())));
            }
            continue;
        };
        if t.shape() != p.shape() {
            return Err(Error::shape(
                "load_state_dict",
                format!("tensor '{name}' has shape {:?} in the file but {:?} in the module", t.shape(), p.shape()),
            ));
        }
        if !t.dtype().is_float() && p.dtype().is_float() {
            return Err(Error::dtype(
                "load_state_dict",
                format!("tensor '{name}' is {:?} in the file but {:?} in the module", t.dtype(), p.dtype()),
            ));
        }
        plan.push((p.clone(), t.to_dtype(p.dtype())?));
    }
    if strict {
        let known: std::collections::HashSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&String> = file.keys().filter(|k| !known.contains(k.as_str())).collect();
        if !extra.is_empty() {
            return Err(Error::Msg(format!("load_state_dict: unexpected tensors in the file: {extra:?}")));
        }
    }
    no_grad(|| {
        for (p, t) in &plan {
            p.assign(&t.to_device(p.device())?)?;
        }
        Ok(())
    })
}

pub fn load_state_dict(m: &dyn Module, path: &Path, strict: bool) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    load_state_dict_from_bytes(m, &bytes, strict)
}
