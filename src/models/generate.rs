//! Sampling from a causal language model with a key/value cache: the prompt runs once
//! (prefill), then each new token is one decode step over the cached keys and values.
//! Greedy (temperature 0) or sampled with temperature, top-k and top-p, from a seed.

use super::gpt::Gpt;
use super::llama::Llama;
use kiln_autograd::NoGradGuard;
use kiln_nn::{KvCache, StaticKvCache};
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// A model `generate` can decode from.
pub trait CausalLm {
    fn vocab(&self) -> usize;
    /// The longest sequence the model takes (its context).
    fn max_seq(&self) -> usize;
    fn n_layers(&self) -> usize;
    fn device(&self) -> Device;
    /// Logits `[B, T, vocab]` of `ids` `[B, T]`, no cache.
    fn logits(&self, ids: &Tensor) -> Result<Tensor>;
    /// Logits of `ids` at positions `cache.len()..`, their keys and values appended.
    fn logits_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor>;
    /// A zeroed cache of `capacity` positions for one sequence (`logits_static`).
    fn static_cache(&self, capacity: usize) -> Result<StaticKvCache>;
    /// Logits of `ids` at `positions` (I64 `[T]`), their keys and values written to `cache`.
    fn logits_static(&self, ids: &Tensor, positions: &Tensor, cache: &StaticKvCache) -> Result<Tensor>;
}

impl CausalLm for Gpt {
    fn vocab(&self) -> usize {
        self.config.vocab
    }
    fn max_seq(&self) -> usize {
        self.config.context
    }
    fn n_layers(&self) -> usize {
        self.config.n_layer
    }
    fn device(&self) -> Device {
        Gpt::device(self)
    }
    fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward(ids)
    }
    fn logits_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_cached(ids, cache)
    }
    fn static_cache(&self, capacity: usize) -> Result<StaticKvCache> {
        let c = &self.config;
        StaticKvCache::new(c.n_layer, 1, c.n_head, capacity, c.d_model / c.n_head, self.tok_emb.weight.dtype(), self.device())
    }
    fn logits_static(&self, ids: &Tensor, positions: &Tensor, cache: &StaticKvCache) -> Result<Tensor> {
        self.forward_static(ids, positions, cache)
    }
}

impl CausalLm for Llama {
    fn vocab(&self) -> usize {
        self.config.vocab
    }
    fn max_seq(&self) -> usize {
        self.config.max_seq
    }
    fn n_layers(&self) -> usize {
        self.config.n_layers
    }
    fn device(&self) -> Device {
        self.embed_tokens.weight.device()
    }
    fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward(ids)
    }
    fn logits_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_cached(ids, cache)
    }
    fn static_cache(&self, capacity: usize) -> Result<StaticKvCache> {
        let c = &self.config;
        let dtype = self.embed_tokens.weight.dtype();
        StaticKvCache::new(c.n_layers, 1, c.n_kv_heads, capacity, c.dim / c.n_heads, dtype, CausalLm::device(self))
    }
    fn logits_static(&self, ids: &Tensor, positions: &Tensor, cache: &StaticKvCache) -> Result<Tensor> {
        self.forward_static(ids, positions, cache)
    }
}

/// How `generate` picks tokens (Hugging Face's `generate` arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateConfig {
    pub max_new_tokens: usize,
    /// 0 picks the most likely token (greedy); else logits are divided by it and sampled.
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities sum to at least `p`.
    pub top_p: Option<f64>,
    pub seed: u64,
    /// Stop after this token (e.g. GPT-2's `<|endoftext|>`, 50256).
    pub stop_token: Option<u32>,
    /// Decode with the key/value cache (else each step recomputes the whole sequence).
    pub use_cache: bool,
    /// Decode through one compiled step over a preallocated cache (`StaticKvCache`), replayed
    /// for every new token (one CUDA graph in `ReduceOverhead` on a GPU). Needs `use_cache`.
    pub compiled: bool,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        GenerateConfig {
            max_new_tokens: 32,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            stop_token: None,
            use_cache: true,
            compiled: false,
        }
    }
}

/// What `generate` made: the new tokens and how fast.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The generated tokens (the prompt not included), the stop token last if it came.
    pub tokens: Vec<u32>,
    /// Seconds the prompt took (the first new token included).
    pub prefill_s: f64,
    /// Decode steps a second after the first token (0 with fewer than two new tokens); with
    /// `compiled`, after the first decode step (which traces and compiles).
    pub tokens_per_s: f64,
    /// With `compiled`: seconds of the first decode step (trace, compile, first run).
    pub compile_s: f64,
}

/// Continues `prompt` (token ids, batch 1) by up to `cfg.max_new_tokens` tokens.
///
/// ```
/// use kiln::models::{generate, GenerateConfig, Gpt, GptConfig};
/// use kiln::prelude::*;
/// let model = Gpt::new(GptConfig { vocab: 64, context: 32, ..GptConfig::gpt2(32, 2, 2) }, Device::Cpu)?;
/// let greedy = GenerateConfig { max_new_tokens: 8, ..GenerateConfig::default() };
/// let out = generate(&model, &[1, 2, 3], &greedy)?;
/// assert_eq!(out.tokens.len(), 8);
/// // Sampling: tempered, cut to the 10 most likely tokens, seeded.
/// let sampled = GenerateConfig { temperature: 0.8, top_k: Some(10), seed: 7, ..greedy };
/// assert_eq!(generate(&model, &[1, 2, 3], &sampled)?.tokens, generate(&model, &[1, 2, 3], &sampled)?.tokens);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn generate(model: &dyn CausalLm, prompt: &[u32], cfg: &GenerateConfig) -> Result<Generation> {
    check_prompt(model, prompt, cfg)?;
    check_sampling(cfg)?;
    let _no_grad = NoGradGuard::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mut seq: Vec<u32> = prompt.to_vec();
    let (start, mut first_at, mut second_at) = (Instant::now(), None, None);
    let mut next_logits = logits_source(model, prompt.len() + cfg.max_new_tokens, cfg)?;
    while seq.len() < prompt.len() + cfg.max_new_tokens {
        let logits = next_logits(&seq)?;
        let t = logits.shape()[1];
        let last = logits.narrow(1, t - 1, 1)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        let next = pick(&last, cfg, &mut rng);
        seq.push(next);
        if first_at.is_some() {
            second_at.get_or_insert_with(|| start.elapsed().as_secs_f64());
        }
        first_at.get_or_insert_with(|| start.elapsed().as_secs_f64());
        if cfg.stop_token == Some(next) {
            break;
        }
    }
    let prefill_s = first_at.unwrap_or(0.0);
    let steps = seq.len() - prompt.len();
    let compile_s = if cfg.compiled { second_at.map_or(0.0, |t| t - prefill_s) } else { 0.0 };
    // Steps timed: after the first token, and with `compiled` after the compiling one.
    let timed = (steps - 1).saturating_sub(usize::from(cfg.compiled));
    let decode_s = start.elapsed().as_secs_f64() - prefill_s - compile_s;
    let tokens_per_s = if timed > 0 && decode_s > 0.0 { timed as f64 / decode_s } else { 0.0 };
    Ok(Generation { tokens: seq.split_off(prompt.len()), prefill_s, tokens_per_s, compile_s })
}

/// The logits of the last position, from the sequence so far.
type LogitsOf<'a> = Box<dyn FnMut(&[u32]) -> Result<Tensor> + 'a>;

/// How each step's logits come: from the whole sequence (no cache), from the new tokens over
/// a growing cache, or (compiled) from one compiled decode step over a static cache, the
/// prompt run eagerly into the same cache first. Each call gets the sequence so far.
fn logits_source<'a>(model: &'a dyn CausalLm, capacity: usize, cfg: &GenerateConfig) -> Result<LogitsOf<'a>> {
    let dev = model.device();
    if cfg.compiled && !cfg.use_cache {
        return Err(Error::Msg("generate: compiled decoding runs over a cache: set use_cache too".into()));
    }
    if !cfg.use_cache {
        return Ok(Box::new(move |seq| model.logits(&ids(seq, dev)?)));
    }
    if !cfg.compiled {
        let mut cache = KvCache::new(model.n_layers());
        return Ok(Box::new(move |seq| {
            let new = &seq[cache.len()..];
            model.logits_cached(&ids(new, dev)?, &mut cache)
        }));
    }
    let cache = std::sync::Arc::new(model.static_cache(capacity)?);
    let held = cache.clone();
    let mut step = kiln_compile::compile(kiln_compile::Mode::ReduceOverhead, move |xs: &[Tensor]| {
        Ok(vec![model.logits_static(&xs[0], &xs[1], &held)?])
    });
    let mut done = 0;
    Ok(Box::new(move |seq| {
        let new = &seq[done..];
        let positions = Tensor::arange(new.len(), DType::I64, dev)?.add_scalar(done as f64)?;
        let logits = if done == 0 {
            model.logits_static(&ids(new, dev)?, &positions, &cache)?
        } else {
            step.call(&[ids(new, dev)?, positions])?.remove(0)
        };
        done = seq.len();
        Ok(logits)
    }))
}

fn ids(tokens: &[u32], device: Device) -> Result<Tensor> {
    let v: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    Tensor::from_vec(v, &[1, tokens.len()], Device::Cpu)?.to_device(device)
}

fn check_prompt(model: &dyn CausalLm, prompt: &[u32], cfg: &GenerateConfig) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::Msg("generate: the prompt is empty (give at least one token)".into()));
    }
    if let Some((at, &id)) = prompt.iter().enumerate().find(|(_, &id)| id as usize >= model.vocab()) {
        return Err(Error::Msg(format!("generate: prompt token {id} at position {at} is outside the vocabulary of {}", model.vocab())));
    }
    let total = prompt.len() + cfg.max_new_tokens;
    if total > model.max_seq() {
        return Err(Error::Msg(format!(
            "generate: a prompt of {} tokens plus {} new ones runs past the model's {} positions",
            prompt.len(),
            cfg.max_new_tokens,
            model.max_seq()
        )));
    }
    Ok(())
}

fn check_sampling(cfg: &GenerateConfig) -> Result<()> {
    let ok = cfg.temperature >= 0.0 && cfg.temperature.is_finite() && cfg.top_k != Some(0) && cfg.top_p.is_none_or(|p| p > 0.0 && p <= 1.0);
    if !ok {
        return Err(Error::Msg(format!(
            "generate: temperature {} must be finite and >= 0, top_k {:?} > 0, top_p {:?} in (0, 1]",
            cfg.temperature, cfg.top_k, cfg.top_p
        )));
    }
    Ok(())
}

/// The next token from one row of logits: the first most likely one at temperature 0, else
/// a draw from the tempered distribution cut to top-k, then to top-p.
pub fn pick(logits: &[f32], cfg: &GenerateConfig, rng: &mut impl Rng) -> u32 {
    let argmax = || logits.iter().enumerate().fold(0, |b, (i, &x)| if x > logits[b] { i } else { b });
    if cfg.temperature == 0.0 {
        return argmax() as u32;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(cfg.top_k.unwrap_or(order.len()).max(1));
    let top = logits[order[0]] as f64;
    let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - top) / cfg.temperature).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(p) = cfg.top_p {
        // Keep the smallest prefix whose mass reaches p (at least one token).
        let mut mass = 0.0;
        let keep = probs.iter().take_while(|&&q| {
            let before = mass;
            mass += q;
            before < p
        });
        let n = keep.count().max(1);
        order.truncate(n);
        probs.truncate(n);
    }
    let mut u = rng.random::<f64>() * probs.iter().sum::<f64>();
    for (&i, &q) in order.iter().zip(&probs) {
        if u < q {
            return i as u32;
        }
        u -= q;
    }
    order[order.len() - 1] as u32
}
