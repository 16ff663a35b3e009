//! `#[derive(Module)]`: names, order, buffers and the training flag from a struct's fields,
//! against the names PyTorch gives the same module tree.

use kiln::nn::{Dropout, Embedding, LayerNorm, Linear};
use kiln::prelude::*;
use kiln::tensor::Flag;

const CPU: Device = Device::Cpu;

#[derive(Module)]
struct Block {
    ln_1: LayerNorm,
    attn: Linear,
    #[module(rename = "mlp")]
    feed: Linear,
    drop: Dropout,
    n_head: usize,
    training: Flag,
    checkpointing: Flag,
}

impl Block {
    fn new() -> Result<Block> {
        Ok(Block {
            ln_1: LayerNorm::new(4, 1e-5, CPU)?,
            attn: Linear::new(4, 4, false, CPU)?,
            feed: Linear::new(4, 2, true, CPU)?,
            drop: Dropout::new(0.1),
            n_head: 2,
            training: Flag::new(true),
            checkpointing: Flag::new(true),
        })
    }
}

#[derive(Module)]
struct Net {
    wte: Embedding,
    h: Vec<Block>,
    ln_f: Option<LayerNorm>,
    absent: Option<Linear>,
    pair: [Linear; 2],
    #[module(buffer)]
    mask: Tensor,
    #[module(skip)]
    shared: Tensor,
    #[module(flatten)]
    inner: Head,
    scale: Tensor,
}

#[derive(Module)]
struct Head(Linear);

fn net() -> Result<Net> {
    let wte = Embedding::new(5, 4, CPU)?;
    let shared = wte.weight.clone();
    Ok(Net {
        wte,
        h: vec![Block::new()?, Block::new()?],
        ln_f: Some(LayerNorm::new(4, 1e-5, CPU)?),
        absent: None,
        pair: [Linear::new(4, 4, false, CPU)?, Linear::new(4, 4, false, CPU)?],
        mask: Tensor::ones(&[4, 4], DType::F32, CPU)?,
        shared,
        inner: Head(Linear::new(4, 3, true, CPU)?),
        scale: Tensor::ones(&[1], DType::F32, CPU)?,
    })
}

#[test]
fn fields_are_visited_under_their_names_in_order() -> Result<()> {
    let n = net()?;
    let names: Vec<String> = n.named_parameters().into_iter().map(|(k, _)| k).collect();
    let block = |i: usize| ["ln_1.weight", "ln_1.bias", "attn.weight", "mlp.weight", "mlp.bias"].map(|k| format!("h.{i}.{k}")).to_vec();
    let want: Vec<String> = [
        vec!["wte.weight".to_string()],
        block(0),
        block(1),
        ["ln_f.weight", "ln_f.bias", "pair.0.weight", "pair.1.weight", "0.weight", "0.bias", "scale"].map(String::from).to_vec(),
    ]
    .concat();
    assert_eq!(names, want);
    // The parameters are the fields' own tensors.
    assert!(n.parameters()[0].same_storage(&n.wte.weight));
    assert_eq!(n.num_parameters(), 5 * 4 + 2 * (4 + 4 + 16 + 8 + 2) + 8 + 2 * 16 + 12 + 3 + 1);
    // Buffers: marked fields only; the state dict holds both.
    let buffers: Vec<String> = n.named_buffers().into_iter().map(|(k, _)| k).collect();
    assert_eq!(buffers, ["mask"]);
    assert_eq!(n.named_state().len(), names.len() + 1);
    // A skipped field is not visited: its tensor appears once, as the embedding's weight.
    assert_eq!(n.parameters().iter().filter(|p| p.same_storage(&n.shared)).count(), 1);
    Ok(())
}

#[test]
fn train_and_eval_reach_every_flag_in_the_tree() -> Result<()> {
    let n = net()?;
    n.eval();
    assert!(n.h.iter().all(|b| !b.training.get() && !b.drop.training.get()));
    // Only the flag named `training` follows the mode.
    assert!(n.h.iter().all(|b| b.checkpointing.get() && b.n_head == 2));
    // A dropout in eval mode is the identity.
    let x = Tensor::ones(&[8], DType::F32, CPU)?;
    assert_eq!(n.h[0].drop.forward(&x)?.to_vec::<f32>()?, vec![1.0; 8]);
    n.train();
    assert!(n.h.iter().all(|b| b.training.get() && b.drop.training.get()));
    Ok(())
}

#[derive(Module)]
struct Tied {
    wte: Embedding,
    lm_head: Linear,
}

#[test]
fn a_tied_weight_is_one_parameter_and_saved_under_both_names() -> Result<()> {
    use kiln::optim::{AdamConfig, AdamW, Optimizer};
    let wte = Embedding::new(6, 4, CPU)?;
    let lm_head = Linear { weight: wte.weight.clone(), bias: None };
    let m = Tied { wte, lm_head };
    let names: Vec<String> = m.named_parameters().into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["wte.weight"]);
    let state: Vec<String> = m.named_state().into_iter().map(|(k, _)| k).collect();
    assert_eq!(state, ["wte.weight", "lm_head.weight"]);
    // Both uses' gradients meet in the one tensor, and AdamW takes it once.
    let before = m.wte.weight.to_vec::<f32>()?;
    let ids = Tensor::from_vec(vec![1i64, 3], &[2], CPU)?;
    let loss = m.lm_head.forward(&m.wte.forward(&ids)?)?.sum_all()?;
    loss.backward()?;
    let mut opt = AdamW::new(m.parameters(), AdamConfig::default())?;
    opt.step()?;
    let after = m.wte.weight.to_vec::<f32>()?;
    // Every entry of the weight moves (the head reads all rows): one Adam step of lr 1e-3.
    assert!(before.iter().zip(&after).all(|(b, a)| ((b - a).abs() - 1e-3).abs() < 1e-5), "{before:?} {after:?}");
    Ok(())
}

/// `apply` reaches every submodule under its PyTorch name, children before their parent and
/// the root last (`""`), and an initialiser applied by type changes exactly those modules.
#[test]
fn apply_walks_submodules_by_type_as_pytorch_does() -> Result<()> {
    let n = net()?;
    let mut seen = Vec::new();
    n.apply(&mut |name, m| {
        let kind = if m.is::<Linear>() {
            "Linear"
        } else if m.is::<LayerNorm>() {
            "LayerNorm"
        } else if m.is::<Block>() {
            "Block"
        } else if m.is::<Net>() {
            "Net"
        } else {
            "other"
        };
        seen.push(format!("{name}:{kind}"));
    });
    let block = |i: usize| {
        [
            format!("h.{i}.ln_1:LayerNorm"),
            format!("h.{i}.attn:Linear"),
            format!("h.{i}.mlp:Linear"),
            format!("h.{i}.drop:other"),
            format!("h.{i}:Block"),
        ]
    };
    let mut want = vec!["wte:other".to_string()];
    want.extend(block(0));
    want.extend(block(1));
    want.extend(["ln_f:LayerNorm", "pair.0:Linear", "pair.1:Linear", "0:Linear", ":Head", ":Net"].map(String::from));
    // The flattened `inner: Head(Linear)` keeps its parent's prefix; `Head` itself is "other".
    let want: Vec<String> = want.into_iter().map(|s| if s == ":Head" { ":other".into() } else { s }).collect();
    assert_eq!(seen, want);
    // Every Linear's weight set to 0.5 through `apply`; nothing else touched.
    n.apply(&mut |_, m| {
        if let Some(l) = m.downcast_ref::<Linear>() {
            kiln::nn::init::constant_(&l.weight, 0.5).unwrap();
        }
    });
    for (name, p) in n.named_parameters() {
        let linear_weight =
            name.ends_with("attn.weight") || name.ends_with("mlp.weight") || name.starts_with("pair.") || name == "0.weight";
        let all_half = p.to_vec_f64()?.iter().all(|&v| v == 0.5);
        assert_eq!(all_half, linear_weight, "{name}");
    }
    Ok(())
}

/// `to_dtype` (and `to_device`, the same walk over `visit_mut`) replaces every floating
/// parameter and buffer in place, as PyTorch's `model.to(..)`: values kept, `requires_grad`
/// and gradients carried, a tied weight still one tensor, skipped fields moved too, modules
/// written by hand (an LSTM) and `Sequential` included; a view of a tied weight and a layer
/// shared with a clone are errors saying so.
#[test]
fn to_dtype_and_to_device_replace_every_tensor_in_place_keeping_ties() -> Result<()> {
    use kiln::nn::{Lstm, RnnConfig, Sequential};
    let mut m = net()?;
    m.wte.forward(&Tensor::from_vec(vec![1i64, 3], &[2], CPU)?)?.sum_all()?.backward()?;
    let before: Vec<(String, Vec<f32>, bool)> =
        m.named_state().into_iter().map(|(k, t)| (k, t.to_vec::<f32>().unwrap(), t.requires_grad())).collect();
    let grad = m.wte.weight.grad().expect("a gradient").to_vec::<f32>()?;
    m.to_dtype(DType::F64)?;
    let after = m.named_state();
    assert_eq!(after.len(), before.len());
    for ((name, t), (was, values, rg)) in after.iter().zip(&before) {
        assert_eq!(name, was);
        assert_eq!(t.dtype(), DType::F64, "{name}");
        assert_eq!(t.requires_grad(), *rg, "{name}");
        let v: Vec<f32> = t.to_vec::<f64>()?.iter().map(|&x| x as f32).collect();
        assert_eq!(&v, values, "{name}");
    }
    let g = m.wte.weight.grad().expect("the gradient moved with the weight");
    assert_eq!(g.dtype(), DType::F64);
    assert_eq!(g.to_vec::<f64>()?.iter().map(|&x| x as f32).collect::<Vec<_>>(), grad);
    assert_eq!(m.shared.id(), m.wte.weight.id(), "a skipped field holding the weight follows it");
    // Tied: still one tensor, one parameter.
    let wte = Embedding::new(6, 4, CPU)?;
    let lm_head = Linear { weight: wte.weight.clone(), bias: None };
    let mut tied = Tied { wte, lm_head };
    tied.to_dtype(DType::F64)?;
    assert_eq!(tied.wte.weight.id(), tied.lm_head.weight.id());
    assert_eq!(tied.named_parameters().len(), 1);
    // Already there: the very same tensors.
    let ids: Vec<_> = tied.named_state().iter().map(|(_, t)| t.id()).collect();
    tied.to_device(CPU)?;
    tied.to_dtype(DType::F64)?;
    assert_eq!(tied.named_state().iter().map(|(_, t)| t.id()).collect::<Vec<_>>(), ids);
    // Hand-written modules and Sequential.
    let mut lstm = Lstm::new(RnnConfig::new(3, 4).num_layers(2), CPU)?;
    lstm.to_dtype(DType::F64)?;
    assert!(lstm.parameters().iter().all(|p| p.dtype() == DType::F64 && p.requires_grad()));
    let mut seq = Sequential::new().add(Linear::new(2, 2, true, CPU)?).add(kiln::nn::Relu);
    seq.to_dtype(DType::F64)?;
    assert!(seq.parameters().iter().all(|p| p.dtype() == DType::F64));
    let _clone = seq.clone();
    let e = seq.to_dtype(DType::F32).unwrap_err().to_string();
    assert!(e.contains("layer 0 is shared with a clone"), "{e}");
    // A head tied through a view of the embedding cannot stay tied.
    let wte = Embedding::new(6, 4, CPU)?;
    let view = wte.weight.narrow(0, 0, 6)?;
    let mut bad = Tied { wte, lm_head: Linear { weight: view, bias: None } };
    let e = bad.to_dtype(DType::F64).unwrap_err().to_string();
    assert!(e.contains("view of a tied weight") && e.contains("[6, 4]"), "{e}");
    // A refusal leaves the module as it was (nothing converted half way).
    assert!(bad.named_state().iter().all(|(_, t)| t.dtype() == DType::F32));
    let mut seq = Sequential::new().add(Linear::new(2, 2, true, CPU)?).add(Linear::new(2, 2, true, CPU)?);
    let _clone = Sequential { layers: vec![seq.layers[1].clone()] };
    assert!(seq.to_dtype(DType::F64).unwrap_err().to_string().contains("layer 1 is shared"));
    assert!(seq.parameters().iter().all(|p| p.dtype() == DType::F32), "layer 0 left as it was");
    Ok(())
}
