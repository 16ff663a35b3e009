//! State-dict round trips and every kind of bad file: clear errors, nothing partly loaded.

use kiln_nn::{load_state_dict_from_bytes, state_dict_to_bytes, Forward, Linear, Module, Relu, Sequential};
use kiln_tensor::{Device, Result, Tensor};

fn mlp() -> Sequential {
    Sequential::new().add(Linear::new(4, 3, true, Device::Cpu).unwrap()).add(Relu).add(Linear::new(3, 2, true, Device::Cpu).unwrap())
}

fn values(m: &dyn Module) -> Vec<Vec<f64>> {
    m.parameters().iter().map(|p| p.to_vec_f64().unwrap()).collect()
}

#[test]
fn names_follow_pytorch_and_round_trip() -> Result<()> {
    let a = mlp();
    let names: Vec<String> = a.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
    let b = mlp();
    assert_ne!(values(&a), values(&b));
    load_state_dict_from_bytes(&b, &state_dict_to_bytes(&a)?, true)?;
    assert_eq!(values(&a), values(&b));
    let x = Tensor::ones(&[1, 4], kiln_tensor::DType::F32, Device::Cpu)?;
    assert_eq!(a.forward(&x)?.to_vec::<f32>()?, b.forward(&x)?.to_vec::<f32>()?);
    Ok(())
}

#[test]
fn bad_state_dicts_error_and_load_nothing() -> Result<()> {
    let a = mlp();
    let good = state_dict_to_bytes(&a)?;
    let target = mlp();
    let before = values(&target);
    let err = |bytes: &[u8]| load_state_dict_from_bytes(&target, bytes, true).unwrap_err().to_string();
    // Truncated and random files.
    assert!(err(&good[..good.len() / 2]).contains("safetensors"), "{}", err(&good[..good.len() / 2]));
    assert!(err(&good[..5]).contains("safetensors"));
    assert!(err(b"not a safetensors file at all").contains("safetensors"));
    // A missing tensor, an extra one and a wrong shape.
    let mut params = a.named_parameters();
    let dropped = kiln_tensor::io::save_tensors(&params[1..], None)?;
    assert!(err(&dropped).contains("missing tensor '0.weight' (shape [3, 4])"));
    params.push(("extra.weight".into(), Tensor::zeros(&[1], kiln_tensor::DType::F32, Device::Cpu)?));
    let extra = kiln_tensor::io::save_tensors(&params, None)?;
    assert!(err(&extra).contains("unexpected tensors in the file: [\"extra.weight\"]"));
    params.pop();
    params[3].1 = Tensor::zeros(&[5], kiln_tensor::DType::F32, Device::Cpu)?;
    let wrong = kiln_tensor::io::save_tensors(&params, None)?;
    assert!(err(&wrong).contains("tensor '2.bias' has shape [5] in the file but [2] in the module"));
    // None of these changed a single parameter (the bad one is last, the others came first).
    assert_eq!(values(&target), before);
    Ok(())
}
