//! Tensors to and from safetensors bytes (state dicts, optimizer state, checkpoints). The
//! reader faces untrusted files: every malformed input is an `Error`, never a panic.

use crate::storage::IntoCpuStorage;
use crate::{with_cpu, DType, Device, Element, Error, Result, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

/// Little-endian bytes of one element type.
trait LeBytes: Element + Sized {
    const N: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}
macro_rules! le_bytes {
    ($t:ty, $n:expr, $get:expr) => {
        impl LeBytes for $t {
            const N: usize = $n;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; $n];
                a.copy_from_slice(&b[..$n]);
                $get(a)
            }
        }
    };
}
le_bytes!(f32, 4, f32::from_le_bytes);
le_bytes!(f64, 8, f64::from_le_bytes);
le_bytes!(f16, 2, f16::from_le_bytes);
le_bytes!(bf16, 2, bf16::from_le_bytes);
le_bytes!(i64, 8, i64::from_le_bytes);
le_bytes!(u8, 1, |a: [u8; 1]| a[0]);

fn to_bytes<T: LeBytes>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * T::N);
    for &x in v {
        x.put(&mut out);
    }
    out
}

fn from_bytes<T: LeBytes>(b: &[u8]) -> Vec<T>
where
    Vec<T>: IntoCpuStorage,
{
    b.chunks_exact(T::N).map(T::get).collect()
}

/// Serialises named tensors (any device, any layout) to safetensors bytes.
pub fn save_tensors(tensors: &[(String, Tensor)], metadata: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let c = t.to_device(Device::Cpu)?.contiguous()?;
        let bytes = c.with_cpu_storage(|s, l| {
            let n = l.numel();
            with_cpu!(s, v => to_bytes(&v[l.offset..l.offset + n]))
        })?;
        owned.push((name.clone(), st_dtype(t.dtype()), t.shape().to_vec(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Format { what: "safetensors".into(), msg: e.to_string() })?;
    safetensors::serialize(views, metadata).map_err(|e| Error::Format { what: "safetensors".into(), msg: e.to_string() })
}

/// Reads every tensor of a safetensors buffer (on the CPU), sorted by name, and the metadata.
/// Named tensors, in file order.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Reads every tensor (sorted by name) and the metadata.
pub fn load_tensors(bytes: &[u8]) -> Result<(NamedTensors, HashMap<String, String>)> {
    let bad = |msg: String| Error::Format { what: "safetensors".into(), msg };
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        let storage = match view.dtype() {
            Dtype::F32 => from_bytes::<f32>(data).into_storage(),
            Dtype::F64 => from_bytes::<f64>(data).into_storage(),
            Dtype::F16 => from_bytes::<f16>(data).into_storage(),
            Dtype::BF16 => from_bytes::<bf16>(data).into_storage(),
            Dtype::I64 => from_bytes::<i64>(data).into_storage(),
            Dtype::U8 | Dtype::BOOL => from_bytes::<u8>(data).into_storage(),
            other => return Err(bad(format!("tensor '{name}' has dtype {other:?}, which Kiln does not support"))),
        };
        let n: usize = shape.iter().product();
        if storage.len() != n {
            return Err(bad(format!("tensor '{name}': {} elements for shape {shape:?}", storage.len())));
        }
        out.push((name, Tensor::from_storage(crate::storage::Storage::Cpu(storage), &shape)));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((out, metadata))
}
