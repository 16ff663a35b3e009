//! Bad input of every kind gives an error whose text names the op, shapes, dtypes or devices.

use kiln_tensor::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

fn f(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, CPU).unwrap()
}

fn err(r: kiln_tensor::Result<Tensor>) -> String {
    match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.shape()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn shape_errors_name_both_shapes_and_the_dim() {
    assert_eq!(err(f(&[2, 3]).add(&f(&[2, 4]))), "add: cannot broadcast [2, 3] with [2, 4] (dim 1: 3 vs 4)");
    assert_eq!(err(f(&[2, 3]).matmul(&f(&[4, 5]))), "matmul: inner dims differ: [2, 3] x [4, 5] (3 vs 4)");
    assert!(err(f(&[2, 3]).reshape(&[4, 2])).contains("cannot reshape [2, 3] (6 elements) into [4, 2] (8 elements)"));
    assert!(err(f(&[2, 3]).reshape(&[-1, -1])).contains("at most one -1"));
    assert!(err(f(&[2, 3]).narrow(1, 2, 2)).contains("range 2..4 out of bounds for dim 1 of shape [2, 3]"));
    assert!(err(f(&[2, 3]).broadcast_to(&[3, 3])).contains("cannot expand [2, 3] to [3, 3]"));
    assert!(
        err(Tensor::cat(&[&f(&[2, 3]), &f(&[2, 4])], 0)).contains("input 1 has shape [2, 4], which does not match [2, 3] outside dim 0")
    );
    assert!(err(f(&[2, 3]).permute(&[0, 0])).contains("is not a permutation"));
    assert!(err(Tensor::from_vec(vec![1.0f32; 5], &[2, 3], CPU)).contains("5 elements do not fill shape [2, 3]"));
    assert!(err(f(&[3]).item().map(|_| f(&[1]))).contains("needs exactly one element, got shape [3]"));
}

#[test]
fn rank_and_dim_errors() {
    assert_eq!(err(f(&[2, 3]).sum(&[2], false)), "sum: dim 2 out of range for a tensor of rank 2 (shape [2, 3])");
    assert!(err(f(&[2, 3]).transpose(0, -3)).contains("dim -3 out of range for a tensor of rank 2"));
    assert!(err(f(&[2, 3]).sum(&[1, -1], false)).contains("dim 1 repeated"));
    assert!(err(f(&[]).matmul(&f(&[2]))).contains("needs rank >= 1"));
    assert!(err(f(&[3]).t()).contains("needs rank >= 2, got shape [3]"));
}

#[test]
fn dtype_errors_name_the_dtypes() {
    let i = Tensor::zeros(&[2], DType::I64, CPU).unwrap();
    assert!(err(f(&[2]).add(&i)).contains("add: dtype mismatch: F32 vs I64"));
    assert!(err(i.exp()).contains("exp: not defined for I64 tensors"));
    assert!(err(f(&[2, 2]).index_select(0, &f(&[1]))).contains("index_select: index must be I64, got F32"));
    assert!(f(&[2]).to_vec::<f64>().unwrap_err().to_string().contains("tensor is F32, asked for F64"));
}

#[test]
fn index_errors_name_the_index_and_the_size() {
    let w = f(&[3, 2]);
    let bad = Tensor::from_slice(&[0i64, 3], &[2], CPU).unwrap();
    assert_eq!(err(w.index_select(0, &bad)), "index_select: index 3 out of range for dim 0 of size 3");
    assert!(err(w.embedding(&Tensor::from_slice(&[-1i64], &[1], CPU).unwrap())).contains("index -1 out of range"));
    let g = Tensor::from_slice(&[5i64, 0], &[2, 1], CPU).unwrap();
    assert!(err(w.gather(1, &g)).contains("gather: index 5 out of range for dim 1 of size 2"));
    assert!(err(w.scatter_add(1, &g, &f(&[2, 1]))).contains("scatter_add: index 5 out of range"));
}

/// Built without the `cuda` feature, every CUDA request is an error that says how to get it.
/// (With the feature, `tests/cuda_basics.rs` checks the errors on a real GPU.)
#[cfg(not(feature = "cuda"))]
#[test]
fn device_errors_are_clear_without_cuda() {
    let e = Tensor::zeros(&[2], DType::F32, Device::Cuda(0)).unwrap_err().to_string();
    assert!(e.starts_with("device Cuda(0):") && e.contains("--features cuda"), "{e}");
    assert!(f(&[2]).to_device(Device::Cuda(0)).is_err());
    assert_eq!(Device::cuda_if_available(0), Device::Cpu);
}

#[test]
fn in_place_errors() {
    let x = f(&[2, 3]);
    assert!(x.assign(&f(&[3, 3])).unwrap_err().to_string().contains("assign: cannot broadcast [2, 3] with [3, 3]"));
    assert!(x.assign(&f(&[4])).is_err());
    let e = f(&[1, 3]).broadcast_to(&[2, 3]).unwrap();
    assert!(e.add_scalar_(1.0).unwrap_err().to_string().contains("cannot write into an expanded view"));
    let p = f(&[2]);
    p.set_requires_grad(true);
    assert!(p.add_scalar_(1.0).unwrap_err().to_string().contains("requires grad"));
    kiln_tensor::no_grad(|| p.add_scalar_(1.0)).unwrap();
}
