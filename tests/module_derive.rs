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
