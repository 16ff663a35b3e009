//! Checkpoint directories: reading and writing `config.json` and safetensors (one file or
//! shards with their index), and loading a module's tensors under a checkpoint's names.

use kiln_nn::Module;
use kiln_tensor::io::{load_tensors, save_tensors};
use kiln_tensor::{no_grad, DType, Error, Result, Tensor};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// A checkpoint directory read into memory: its config and every tensor with its file.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Value,
    /// Each tensor and the file it came from.
    pub tensors: BTreeMap<String, (Tensor, PathBuf)>,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {e}", path.display()))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Format { what: path.display().to_string(), msg: format!("not valid JSON: {e}") })
}

/// `dir`'s `config.json` `model_type` (`"gpt2"`, `"llama"`, ...), to pick the model to load.
pub fn model_type(dir: &Path) -> Result<String> {
    let path = dir.join("config.json");
    let config = read_json(&path)?;
    let found = config.get("model_type").and_then(Value::as_str).map(str::to_string);
    found.ok_or_else(|| Error::Format { what: path.display().to_string(), msg: "no \"model_type\"".into() })
}

/// Reads `dir`'s `config.json` and its weights: `model.safetensors`, or the shards named by
/// `model.safetensors.index.json`, whose `weight_map` must list exactly the shards' tensors.
pub fn read_dir(dir: &Path) -> Result<Checkpoint> {
    let config = read_json(&dir.join("config.json"))?;
    let mut tensors = BTreeMap::new();
    let index_path = dir.join(INDEX);
    if index_path.exists() {
        let index = read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::Format { what: index_path.display().to_string(), msg: "no \"weight_map\" object".into() })?;
        let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| Error::Format {
                what: index_path.display().to_string(),
                msg: format!("weight_map entry '{name}' is not a file name"),
            })?;
            shards.entry(file).or_default().push(name);
        }
        for (file, names) in shards {
            let path = dir.join(file);
            let got = read_file(&path)?;
            for name in &names {
                if !got.contains_key(*name) {
                    return Err(Error::Format {
                        what: index_path.display().to_string(),
                        msg: format!("lists tensor '{name}' in {file}, which does not hold it"),
                    });
                }
            }
            if let Some(extra) = got.keys().find(|k| !names.contains(&k.as_str())) {
                return Err(Error::Format {
                    what: index_path.display().to_string(),
                    msg: format!("does not list tensor '{extra}' of {file}"),
                });
            }
            tensors.extend(got.into_iter().map(|(n, t)| (n, (t, path.clone()))));
        }
    } else {
        let path = dir.join(WEIGHTS);
        tensors.extend(read_file(&path)?.into_iter().map(|(n, t)| (n, (t, path.clone()))));
    }
    Ok(Checkpoint { dir: dir.to_path_buf(), config, tensors })
}

fn read_file(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let (tensors, _) = load_tensors(&bytes).map_err(|e| Error::Format { what: path.display().to_string(), msg: e.to_string() })?;
    Ok(tensors.into_iter().collect())
}

/// How a module's tensor is stored in a checkpoint.
pub(crate) struct Stored {
    /// Its name in the checkpoint.
    pub name: String,
    /// Stored transposed (GPT-2's `Conv1D` weights are `[in, out]`).
    pub transposed: bool,
}

/// Loads `ck` into `module`: each of the module's tensors (`named_state`) from the
/// checkpoint name `stored` gives it (None: not stored, e.g. a tied head), trying `prefixes`
/// in turn; every checkpoint tensor must be used unless `ignored` says so. Checks all names
/// and shapes before writing anything.
pub(crate) fn load_into(
    module: &dyn Module,
    ck: &Checkpoint,
    stored: impl Fn(&str) -> Option<Stored>,
    prefixes: &[&str],
    ignored: impl Fn(&str) -> bool,
) -> Result<()> {
    let mut plan = Vec::new();
    let mut used = std::collections::HashSet::new();
    for (name, p) in module.named_state() {
        let Some(s) = stored(&name) else { continue };
        let found = prefixes.iter().map(|pre| format!("{pre}{}", s.name)).find(|n| ck.tensors.contains_key(n));
        let Some(key) = found else {
            return Err(Error::Msg(format!("{}: no tensor '{}' (for {name}, shape {:?})", ck.dir.display(), s.name, p.shape())));
        };
        let (t, file) = &ck.tensors[&key];
        let t = if s.transposed && t.rank() == 2 { t.t()? } else { t.clone() };
        if t.shape() != p.shape() || !t.dtype().is_float() {
            return Err(Error::shape(
                "from_pretrained",
                format!(
                    "tensor '{key}' in {} is {:?} {:?}{}, the model needs {:?}",
                    file.display(),
                    t.dtype(),
                    ck.tensors[&key].0.shape(),
                    if s.transposed { " (stored transposed)" } else { "" },
                    p.shape()
                ),
            ));
        }
        plan.push((p, t));
        used.insert(key);
    }
    if let Some((extra, (_, file))) = ck.tensors.iter().find(|(k, _)| !used.contains(*k) && !ignored(k)) {
        return Err(Error::Msg(format!("{}: unexpected tensor '{extra}' that the model has no place for", file.display())));
    }
    no_grad(|| plan.iter().try_for_each(|(p, t)| p.assign(&t.to_dtype(p.dtype())?.to_device(p.device())?)))
}

/// The tensors to save, under their checkpoint names (transposed where stored so), on the CPU.
pub(crate) fn stored_tensors(module: &dyn Module, stored: impl Fn(&str) -> Option<Stored>) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for (name, t) in module.named_state() {
        if let Some(s) = stored(&name) {
            let t = if s.transposed { t.t()?.contiguous()? } else { t };
            out.push((s.name, t));
        }
    }
    Ok(out)
}

/// `transformers`' name for a dtype (`torch_dtype`).
pub(crate) fn torch_dtype(d: DType) -> &'static str {
    match d {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// Writes `config` and `tensors` into `dir` (created if missing): one `model.safetensors`, or
/// with `max_shard_bytes` shards of about that size and the index.
pub fn write_dir(dir: &Path, config: &Value, tensors: &[(String, Tensor)], max_shard_bytes: Option<usize>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(config).map_err(|e| io_err(&config_path, e))?;
    std::fs::write(&config_path, text + "\n").map_err(|e| io_err(&config_path, e))?;
    let meta = || Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let size = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
    let Some(limit) = max_shard_bytes else {
        let path = dir.join(WEIGHTS);
        return std::fs::write(&path, save_tensors(tensors, meta())?).map_err(|e| io_err(&path, e));
    };
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
    let mut filled = 0;
    for (n, t) in tensors {
        if filled > 0 && filled + size(t) > limit {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += size(t);
        shards.last_mut().expect("one shard at least").push((n.clone(), t.clone()));
    }
    let mut map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len());
        let path = dir.join(&file);
        std::fs::write(&path, save_tensors(shard, meta())?).map_err(|e| io_err(&path, e))?;
        shard.iter().for_each(|(n, _)| drop(map.insert(n.clone(), Value::String(file.clone()))));
    }
    let total: usize = tensors.iter().map(|(_, t)| size(t)).sum();
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
    let index_path = dir.join(INDEX);
    std::fs::write(&index_path, serde_json::to_string_pretty(&index).map_err(|e| io_err(&index_path, e))? + "\n")
        .map_err(|e| io_err(&index_path, e))
}

/// A config field as a count, or an error naming it.
pub(crate) fn usize_field(c: &Value, key: &str, what: &str) -> Result<usize> {
    c.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| Error::Format { what: what.into(), msg: format!("config.json has no whole number \"{key}\"") })
}

/// A float config field, `default` when absent.
pub(crate) fn f64_field(c: &Value, key: &str, default: f64) -> f64 {
    c.get(key).and_then(Value::as_f64).unwrap_or(default)
}
