//! Checkpoints for long runs: model, optimizer state, scheduler position, generator state and
//! step in one safetensors file, written atomically (temporary file in the same folder,
//! fsync, rename), so a crash mid-write leaves the previous checkpoint intact.
//!
//! Tensors are stored as `model.<name>` and `optim.<name>`; the metadata holds the step, the
//! scheduler's last step and the generator's seed and offset.

use kiln_nn::{load_state_dict_from_bytes, Module};
use kiln_optim::{LrScheduler, Optimizer};
use kiln_tensor::io::{load_tensors, save_tensors};
use kiln_tensor::rng::{self, GeneratorState};
use kiln_tensor::{Error, Result, Tensor};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

const FORMAT: &str = "kiln-checkpoint-1";

/// What a checkpoint restores besides the tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    pub step: u64,
    pub scheduler_step: Option<usize>,
    pub generator: GeneratorState,
}

/// The checkpoint's bytes: tensors of the model and optimizer, and the metadata.
pub fn to_bytes(model: &dyn Module, opt: &dyn Optimizer, sched: Option<&dyn LrScheduler>, step: u64) -> Result<Vec<u8>> {
    let mut tensors: Vec<(String, Tensor)> = model.named_state().into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect();
    tensors.extend(opt.state_tensors().into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
    let g = rng::state();
    let mut meta = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("step".to_string(), step.to_string()),
        ("generator_seed".to_string(), g.seed.to_string()),
        ("generator_offset".to_string(), g.offset.to_string()),
    ]);
    if let Some(s) = sched {
        meta.insert("scheduler_step".into(), s.last_step().to_string());
    }
    save_tensors(&tensors, Some(meta))
}

/// Writes `bytes` to `path` atomically; `write` does the writing into the temporary file
/// (tests pass one that fails part way).
pub fn write_atomic_with(path: &Path, bytes: &[u8], write: impl FnOnce(&mut std::fs::File, &[u8]) -> std::io::Result<()>) -> Result<()> {
    let io = |e: std::io::Error| Error::Io(format!("{}: {e}", path.display()));
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::Io(format!("{}: not a file path", path.display())))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        write(&mut f, bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename itself is durable once the folder is synced.
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

pub fn save(path: &Path, model: &dyn Module, opt: &dyn Optimizer, sched: Option<&dyn LrScheduler>, step: u64) -> Result<()> {
    let bytes = to_bytes(model, opt, sched, step)?;
    write_atomic_with(path, &bytes, |f, b| f.write_all(b))
}

fn meta_u64(meta: &HashMap<String, String>, key: &str, path: &Path) -> Result<u64> {
    let bad = |msg: String| Error::Format { what: format!("checkpoint {}", path.display()), msg };
    meta.get(key)
        .ok_or_else(|| bad(format!("metadata has no '{key}'")))?
        .parse()
        .map_err(|_| bad(format!("metadata '{key}' is not a number")))
}

/// Restores model, optimizer, scheduler and generator from `bytes` (everything is checked
/// before anything is written, except that a failing optimizer load leaves the model loaded).
pub fn from_bytes(
    bytes: &[u8],
    path: &Path,
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    sched: Option<&mut dyn LrScheduler>,
) -> Result<Resume> {
    let bad = |msg: String| Error::Format { what: format!("checkpoint {}", path.display()), msg };
    let (tensors, meta) = load_tensors(bytes).map_err(|e| bad(e.to_string()))?;
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(bad(format!("not a Kiln checkpoint (format {:?}, expected {FORMAT})", meta.get("format"))));
    }
    let step = meta_u64(&meta, "step", path)?;
    let generator = GeneratorState { seed: meta_u64(&meta, "generator_seed", path)?, offset: meta_u64(&meta, "generator_offset", path)? };
    let scheduler_step = meta.get("scheduler_step").map(|_| meta_u64(&meta, "scheduler_step", path)).transpose()?.map(|s| s as usize);
    let pick = |prefix: &str| -> Vec<(String, Tensor)> {
        tensors.iter().filter_map(|(n, t)| n.strip_prefix(prefix).map(|k| (k.to_string(), t.clone()))).collect()
    };
    let model_bytes = save_tensors(&pick("model."), None)?;
    load_state_dict_from_bytes(model, &model_bytes, true)?;
    opt.load_state_tensors(&pick("optim."))?;
    if let (Some(s), Some(k)) = (sched, scheduler_step) {
        s.set_last_step(k);
        s.apply(opt)?;
    }
    rng::set_state(generator);
    Ok(Resume { step, scheduler_step, generator })
}

pub fn load(path: &Path, model: &dyn Module, opt: &mut dyn Optimizer, sched: Option<&mut dyn LrScheduler>) -> Result<Resume> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    from_bytes(&bytes, path, model, opt, sched)
}

/// Numbered checkpoints in a folder, keeping the last `keep`.
pub struct Checkpoints {
    pub dir: PathBuf,
    pub keep: usize,
}

impl Checkpoints {
    pub fn path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("ckpt-{step:010}.safetensors"))
    }

    /// Saves step `step` and deletes the oldest beyond `keep`.
    pub fn save(&self, model: &dyn Module, opt: &dyn Optimizer, sched: Option<&dyn LrScheduler>, step: u64) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::Io(format!("{}: {e}", self.dir.display())))?;
        let path = self.path(step);
        save(&path, model, opt, sched, step)?;
        let all = self.list()?;
        for old in all.iter().take(all.len().saturating_sub(self.keep.max(1))) {
            let _ = std::fs::remove_file(old);
        }
        Ok(path)
    }

    /// Checkpoint files, oldest first.
    pub fn list(&self) -> Result<Vec<PathBuf>> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return Ok(vec![]) };
        let mut v: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("ckpt-") && n.ends_with(".safetensors")))
            .collect();
        v.sort();
        Ok(v)
    }

    pub fn latest(&self) -> Result<Option<PathBuf>> {
        Ok(self.list()?.pop())
    }
}
