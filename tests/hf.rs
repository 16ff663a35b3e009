//! Hugging Face checkpoints and generation: the tiny GPT-2 and Llama in `tests/data/hf`
//! were made and saved by `transformers` (`benches/pytorch/hf_reference.py make`), with
//! their logits and greedy continuations in `reference.json`; Kiln loads them and must give
//! the same logits and tokens. Kiln's own saves load back exactly; damaged checkpoints are
//! refused naming the tensor or file; decoding with the key/value cache equals decoding
//! without it.

use kiln::models::{generate, CausalLm, GenerateConfig, Gpt, GptConfig, Llama, LlamaConfig};
use kiln::nn::{KvCache, Module};
use kiln::prelude::*;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf").join(name)
}

fn reference(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(data("reference.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()[name].clone()
}

fn ids(v: &[u32]) -> Result<Tensor> {
    Tensor::from_vec(v.iter().map(|&i| i as i64).collect::<Vec<_>>(), &[1, v.len()], CPU)
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The model's logits on the reference prompt within 1e-4 of `transformers`', and its greedy
/// continuation (with and without the cache) equal to `transformers`' `generate`.
fn matches_transformers(model: &dyn CausalLm, name: &str) -> Result<()> {
    let want = reference(name);
    let prompt = u32s(&want["ids"]);
    let logits = no_grad(|| model.logits(&ids(&prompt)?))?.to_vec::<f32>()?;
    let expect: Vec<f64> = want["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(logits.len(), expect.len(), "{name}: logits count");
    let worst = logits.iter().zip(&expect).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-4, "{name}: logits differ from transformers' by {worst:e}");
    let greedy = u32s(&want["greedy"]);
    for (use_cache, compiled) in [(true, false), (false, false), (true, true)] {
        let cfg = GenerateConfig { max_new_tokens: greedy.len(), use_cache, compiled, ..GenerateConfig::default() };
        assert_eq!(generate(model, &prompt, &cfg)?.tokens, greedy, "{name}: greedy tokens (cache {use_cache}, compiled {compiled})");
    }
    Ok(())
}

#[test]
fn gpt2_saved_by_transformers_gives_its_logits_and_tokens() -> Result<()> {
    let model = Gpt::from_pretrained(data("gpt2"), CPU)?;
    assert_eq!(model.config.activation, kiln::nn::Activation::GeluTanh);
    assert!(model.config.tied_head);
    matches_transformers(&model, "gpt2")
}

#[test]
fn llama_saved_by_transformers_gives_its_logits_and_tokens() -> Result<()> {
    let model = Llama::from_pretrained(data("llama"), CPU)?;
    assert_eq!((model.config.n_heads, model.config.n_kv_heads), (4, 2));
    matches_transformers(&model, "llama")?;
    // The same weights in 20 KB shards with their index.
    assert!(data("llama_sharded").join("model.safetensors.index.json").exists());
    matches_transformers(&Llama::from_pretrained(data("llama_sharded"), CPU)?, "llama")
}

fn same_state(a: &dyn Module, b: &dyn Module) -> Result<()> {
    let (sa, sb) = (a.named_state(), b.named_state());
    assert_eq!(sa.len(), sb.len());
    for ((na, ta), (nb, tb)) in sa.iter().zip(&sb) {
        assert_eq!(na, nb);
        assert_eq!(ta.to_vec::<f32>()?, tb.to_vec::<f32>()?, "{na}");
    }
    Ok(())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln_hf_{}_{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn tiny_gpt(tied_head: bool) -> Result<Gpt> {
    Gpt::new(GptConfig { vocab: 40, context: 16, tied_head, ..GptConfig::gpt2(16, 2, 2) }, CPU)
}

#[test]
fn kiln_saves_load_back_exactly_tied_untied_and_sharded() -> Result<()> {
    kiln::tensor::rng::manual_seed(5);
    for tied in [true, false] {
        let (model, dir) = (tiny_gpt(tied)?, tmp(&format!("gpt_{tied}")));
        model.save_pretrained(&dir)?;
        let back = Gpt::from_pretrained(&dir, CPU)?;
        assert_eq!(back.config, model.config);
        same_state(&model, &back)?;
        // GPT-2's files keep Conv1D's [in, out] weights under transformer.*.
        let (st, _) = kiln::tensor::io::load_tensors(&std::fs::read(dir.join("model.safetensors")).unwrap())?;
        let names: Vec<&str> = st.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"transformer.h.1.attn.c_attn.weight"));
        assert_eq!(names.contains(&"lm_head.weight"), !tied);
        let c_fc = &st.iter().find(|(n, _)| n == "transformer.h.0.mlp.c_fc.weight").unwrap().1;
        assert_eq!(c_fc.shape(), &[16, 64]);
        assert_eq!(c_fc.to_vec::<f32>()?, model.blocks[0].fc.weight.t()?.contiguous()?.to_vec::<f32>()?);
    }
    let model = Llama::new(LlamaConfig { vocab: 40, max_seq: 32, ..LlamaConfig::tiny(40) }, CPU)?;
    let dir = tmp("llama_sharded");
    model.save_pretrained_sharded(&dir, Some(30_000))?;
    let index = std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap();
    assert!(index.contains("model-00002-of-"), "several shards: {index}");
    same_state(&model, &Llama::from_pretrained(&dir, CPU)?)
}

/// A copy of a checkpoint directory with its tensors changed by `edit`.
fn damaged(from: &str, name: &str, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) -> PathBuf {
    let dir = tmp(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(data(from).join("config.json"), dir.join("config.json")).unwrap();
    let (mut st, _) = kiln::tensor::io::load_tensors(&std::fs::read(data(from).join("model.safetensors")).unwrap()).unwrap();
    edit(&mut st);
    std::fs::write(dir.join("model.safetensors"), kiln::tensor::io::save_tensors(&st, None).unwrap()).unwrap();
    dir
}

#[test]
fn damaged_checkpoints_are_refused_naming_what_is_wrong() -> Result<()> {
    let err = |r: Result<Gpt>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let missing = damaged("gpt2", "missing", |st| st.retain(|(n, _)| n != "transformer.h.1.mlp.c_proj.weight"));
    let e = err(Gpt::from_pretrained(&missing, CPU));
    assert!(e.contains("h.1.mlp.c_proj.weight"), "{e}");
    let extra =
        damaged("gpt2", "extra", |st| st.push(("transformer.h.9.ln_1.weight".into(), Tensor::zeros(&[32], DType::F32, CPU).unwrap())));
    let e = err(Gpt::from_pretrained(&extra, CPU));
    assert!(e.contains("unexpected tensor 'transformer.h.9.ln_1.weight'"), "{e}");
    let shape = damaged("gpt2", "shape", |st| {
        let t = st.iter_mut().find(|(n, _)| n == "transformer.wpe.weight").unwrap();
        t.1 = Tensor::zeros(&[31, 32], DType::F32, CPU).unwrap();
    });
    let e = err(Gpt::from_pretrained(&shape, CPU));
    assert!(e.contains("transformer.wpe.weight") && e.contains("[31, 32]") && e.contains("model.safetensors"), "{e}");
    // A config that does not match the tensors.
    let dir = damaged("gpt2", "config", |_| {});
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"n_embd\": 32", "\"n_embd\": 48");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let e = err(Gpt::from_pretrained(&dir, CPU));
    assert!(e.contains("wte.weight") && e.contains("[96, 48]"), "{e}");
    // An index naming a tensor its shard lacks; no config at all.
    let dir = tmp("index");
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(data("llama_sharded")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let index = std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), index.replacen("\"lm_head.weight\"", "\"lm_head.weights\"", 1)).unwrap();
    let e = Llama::from_pretrained(&dir, CPU).err().unwrap().to_string();
    assert!(e.contains("lm_head.weights") && e.contains("model.safetensors.index.json"), "{e}");
    let e = Llama::from_pretrained(tmp("nothing"), CPU).err().unwrap().to_string();
    assert!(e.contains("config.json"), "{e}");
    Ok(())
}

#[test]
fn the_cache_gives_the_full_forwards_logits() -> Result<()> {
    kiln::tensor::rng::manual_seed(9);
    let gpt = tiny_gpt(true)?;
    let llama = Llama::new(LlamaConfig { vocab: 40, max_seq: 32, ..LlamaConfig::tiny(40) }, CPU)?;
    let tokens: Vec<u32> = vec![1, 7, 3, 30, 12, 5, 9, 22, 2];
    for model in [&gpt as &dyn CausalLm, &llama] {
        let full = no_grad(|| model.logits(&ids(&tokens)?))?;
        // The prompt in chunks of 4, 1, 3 and 1 tokens through one cache.
        let mut cache = KvCache::new(model.n_layers());
        let mut parts = Vec::new();
        for (a, b) in [(0, 4), (4, 5), (5, 8), (8, 9)] {
            parts.push(no_grad(|| model.logits_cached(&ids(&tokens[a..b])?, &mut cache))?);
        }
        assert_eq!(cache.len(), tokens.len());
        let cached = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 1)?;
        let worst = full.sub(&cached)?.abs()?.to_vec::<f32>()?.into_iter().fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "cached logits differ by {worst}");
        // The same chunks through a static cache of 12 positions, positions as tensors.
        let fixed = model.static_cache(12)?;
        let mut parts = Vec::new();
        for (a, b) in [(0, 4), (4, 5), (5, 8), (8, 9)] {
            let pos = Tensor::arange(b - a, DType::I64, CPU)?.add_scalar(a as f64)?;
            parts.push(no_grad(|| model.logits_static(&ids(&tokens[a..b])?, &pos, &fixed))?);
        }
        let fixed_logits = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 1)?;
        let worst = full.sub(&fixed_logits)?.abs()?.to_vec::<f32>()?.into_iter().fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "static-cache logits differ by {worst}");
        let past = model.logits_static(&ids(&tokens[..4])?, &Tensor::arange(4, DType::I64, CPU)?.add_scalar(10.0)?, &fixed);
        assert!(past.is_err(), "positions past the capacity are refused");
    }
    Ok(())
}

#[test]
fn sampling_is_seeded_and_cut_by_top_k_and_top_p() -> Result<()> {
    kiln::tensor::rng::manual_seed(2);
    let model = tiny_gpt(true)?;
    let prompt = [4u32, 8, 15];
    let sample = |seed, top_k, top_p| {
        let cfg = GenerateConfig { max_new_tokens: 10, temperature: 1.5, top_k, top_p, seed, ..GenerateConfig::default() };
        generate(&model, &prompt, &cfg).map(|g| g.tokens)
    };
    assert_eq!(sample(1, None, None)?, sample(1, None, None)?);
    assert_ne!(sample(1, None, None)?, sample(2, None, None)?);
    let greedy = generate(&model, &prompt, &GenerateConfig { max_new_tokens: 10, ..GenerateConfig::default() })?.tokens;
    assert_eq!(sample(3, Some(1), None)?, greedy, "top_k 1 is greedy");
    assert_eq!(sample(4, None, Some(1e-9))?, greedy, "a tiny top_p keeps only the most likely token");
    // By hand: logits [0, ln 2, ln 5, ln 2] at temperature 1 are p = [.1, .2, .5, .2]; top_p
    // 0.6 keeps tokens 2 and 1 (the first of the ties), top_k 1 token 2.
    let logits = [0.0f32, 2f32.ln(), 5f32.ln(), 2f32.ln()];
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
    let cfg = GenerateConfig { temperature: 1.0, top_p: Some(0.6), ..GenerateConfig::default() };
    let mut seen = [0usize; 4];
    (0..2000).for_each(|_| seen[kiln::models::generate::pick(&logits, &cfg, &mut rng) as usize] += 1);
    assert_eq!((seen[0], seen[3]), (0, 0), "{seen:?}");
    assert!((seen[2] as f64 / 2000.0 - 5.0 / 7.0).abs() < 0.04, "{seen:?}");
    Ok(())
}

#[test]
fn bad_prompts_are_errors_naming_the_token() -> Result<()> {
    let model = tiny_gpt(true)?;
    let e = generate(&model, &[1, 2, 40], &GenerateConfig::default()).unwrap_err().to_string();
    assert!(e.contains("token 40 at position 2") && e.contains("vocabulary of 40"), "{e}");
    let e = generate(&model, &[1; 10], &GenerateConfig { max_new_tokens: 7, ..GenerateConfig::default() }).unwrap_err().to_string();
    assert!(e.contains("10 tokens plus 7") && e.contains("16 positions"), "{e}");
    let e = generate(&model, &[], &GenerateConfig::default()).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    let e = generate(&model, &[1], &GenerateConfig { temperature: -1.0, max_new_tokens: 4, ..GenerateConfig::default() })
        .unwrap_err()
        .to_string();
    assert!(e.contains("temperature -1"), "{e}");
    Ok(())
}
