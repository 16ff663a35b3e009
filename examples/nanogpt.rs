//! A nanoGPT-style character model written as a PyTorch user writes one: the twin of
//! `benches/pytorch/nanogpt.py` (same model, data, optimizer and loop).
//!
//!   cargo run --release --example nanogpt [-- --compile] [--steps 200]

mod common;

use kiln::compile::{compile_step, Mode};
use kiln::nn::init::{normal_, zeros_};
use kiln::nn::{
    dropout, merge_heads, scaled_dot_product_attention, seq, split_heads, AttnMasks, Dropout, Embedding, Gelu, LayerNorm, Linear,
    Sequential,
};
use kiln::optim::{clip_grad_norm, AdamConfig, AdamW, LrScheduler, Optimizer, WarmupCosine};
use kiln::prelude::*;
use kiln::tensor::Flag;
use rand::{Rng, SeedableRng};

const CTX: usize = 64;
const D: usize = 128;
const LAYERS: usize = 4;
const HEADS: usize = 4;
const DROPOUT: f64 = 0.1;
const CPU: Device = Device::Cpu;

#[derive(Module)]
struct CausalSelfAttention {
    c_attn: Linear,
    c_proj: Linear,
    training: Flag,
}

impl CausalSelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let qkv = self.c_attn.forward(x)?.chunk(3, 2)?;
        let (q, k, v) = (split_heads(&qkv[0], HEADS)?, split_heads(&qkv[1], HEADS)?, split_heads(&qkv[2], HEADS)?);
        let p = if self.training.get() { DROPOUT } else { 0.0 };
        self.c_proj.forward(&merge_heads(&scaled_dot_product_attention(&q, &k, &v, &AttnMasks::causal(), p)?)?)
    }
}

#[derive(Module)]
struct Block {
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    ln_2: LayerNorm,
    mlp: Sequential,
}

impl Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln_1.forward(x)?)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x)?)?
    }
}

#[derive(Module)]
struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
    training: Flag,
}

impl Gpt {
    fn new(vocab: usize) -> Result<Gpt> {
        let block = || -> Result<Block> {
            let attn = CausalSelfAttention {
                c_attn: Linear::new(D, 3 * D, true, CPU)?,
                c_proj: Linear::new(D, D, true, CPU)?,
                training: Flag::new(true),
            };
            let mlp = seq![Linear::new(D, 4 * D, true, CPU)?, Gelu, Linear::new(4 * D, D, true, CPU)?, Dropout::new(DROPOUT)];
            Ok(Block { ln_1: LayerNorm::new(D, 1e-5, CPU)?, attn, ln_2: LayerNorm::new(D, 1e-5, CPU)?, mlp })
        };
        let wte = Embedding::new(vocab, D, CPU)?;
        let lm_head = Linear { weight: wte.weight.clone(), bias: None }; // tied
        let model = Gpt {
            wte,
            wpe: Embedding::new(CTX, D, CPU)?,
            h: (0..LAYERS).map(|_| block()).collect::<Result<_>>()?,
            ln_f: LayerNorm::new(D, 1e-5, CPU)?,
            lm_head,
            training: Flag::new(true),
        };
        for (name, p) in model.named_parameters() {
            if p.rank() == 2 {
                normal_(&p, 0.0, if name.ends_with("c_proj.weight") { 0.02 / (2.0 * LAYERS as f64).sqrt() } else { 0.02 })?;
            } else if name.ends_with("bias") && !name.contains("ln") {
                zeros_(&p)?;
            }
        }
        Ok(model)
    }

    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        let pos = Tensor::arange(idx.dim(1)?, DType::I64, CPU)?;
        let mut x = dropout(&(self.wte.forward(idx)? + self.wpe.forward(&pos)?)?, DROPOUT, self.training.get())?;
        for block in &self.h {
            x = block.forward(&x)?;
        }
        self.lm_head.forward(&self.ln_f.forward(&x)?)
    }
}

fn main() -> Result<()> {
    let (batch, accum, steps, lr) = (16, 2, common::flag("--steps", 200usize), 3e-3);
    let text: String = include_str!("../data/rust_book.txt").chars().take(200_000).collect();
    let mut chars: Vec<char> = text.chars().collect();
    chars.sort_unstable();
    chars.dedup();
    let data: Vec<i64> = text.chars().map(|c| chars.binary_search(&c).unwrap_or(0) as i64).collect();
    kiln::tensor::rng::manual_seed(0);
    let model = Gpt::new(chars.len())?;
    let (decay, no_decay) = model.parameters().into_iter().partition(|p| p.rank() >= 2);
    let mut opt = AdamW::with_groups(vec![(decay, 0.1), (no_decay, 0.0)], AdamConfig { lr, betas: (0.9, 0.95), ..AdamConfig::adamw() })?;
    let mut sched = WarmupCosine::new(lr, 20, steps, lr / 10.0)?;
    sched.apply(&mut opt)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut get_batch = || -> Result<Vec<Tensor>> {
        let starts: Vec<usize> = (0..batch).map(|_| rng.random_range(0..data.len() - CTX - 1)).collect();
        let rows = |off: usize| starts.iter().flat_map(|&s| data[s + off..s + off + CTX].to_vec()).collect::<Vec<_>>();
        Ok(vec![Tensor::from_vec(rows(0), &[batch, CTX], CPU)?, Tensor::from_vec(rows(1), &[batch, CTX], CPU)?])
    };
    let train_step = |opt: &mut AdamW, xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let mut total = Tensor::scalar(0.0, DType::F32, CPU)?;
        for m in 0..accum {
            let loss =
                (kiln::nn::cross_entropy(&model.forward(&xs[2 * m])?.reshape(&(-1, chars.len()))?, &xs[2 * m + 1].reshape(&(-1,))?)?
                    / accum as f64)?;
            loss.backward()?;
            total = (total + loss.detach())?;
        }
        clip_grad_norm(&model.parameters(), 1.0)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(vec![total])
    };
    let mut compiled = compile_step(Mode::Default, train_step);
    for step in 0..steps {
        let xs = [get_batch()?, get_batch()?].concat();
        let loss = if common::has("--compile") { compiled.call(&mut opt, &xs)? } else { train_step(&mut opt, &xs)? };
        sched.step(&mut opt)?;
        if step % 50 == 0 || step == steps - 1 {
            println!("step {step}: loss {:.3}", loss[0].item()?);
        }
    }
    kiln::checkpoint::save("/tmp/nanogpt_kiln.safetensors".as_ref(), &model, &opt, Some(&sched), steps as u64)?;
    model.eval();
    let mut idx: Vec<i64> = "The borrow".chars().map(|c| chars.binary_search(&c).unwrap_or(0) as i64).collect();
    for _ in 0..60 {
        let ctx = &idx[idx.len().saturating_sub(CTX)..];
        let logits = no_grad(|| model.forward(&Tensor::from_slice(ctx, &[1, ctx.len()], CPU)?))?;
        idx.push(logits.i((.., -1, ..))?.argmax(-1, false)?.item()? as i64);
    }
    println!("{}", idx.iter().map(|&i| chars[i as usize]).collect::<String>());
    Ok(())
}
