//! Hooks that run when a leaf's gradient has been accumulated during a backward
//! (`register_post_accumulate_grad_hook`, PyTorch's hook of that name): data parallelism starts
//! a bucket's all-reduce as soon as the last gradient of the bucket is in, while the rest of
//! the backward still runs.

use kiln_tensor::{Result, Tensor, TensorId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

type Hook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// Each tensor's hooks, with the keys their handles remove them by.
type Registry = Mutex<HashMap<TensorId, Vec<(u64, Hook)>>>;

/// Hooks registered now: a backward with none (the usual case) skips the registry's lock for
/// every leaf.
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn hooks() -> &'static Registry {
    static HOOKS: OnceLock<Registry> = OnceLock::new();
    HOOKS.get_or_init(Default::default)
}

/// Keeps a hook registered; dropping it removes the hook.
#[must_use = "the hook is removed when its handle is dropped"]
pub struct HookHandle {
    tensor: TensorId,
    key: u64,
}

impl Drop for HookHandle {
    fn drop(&mut self) {
        let mut map = hooks().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = map.get_mut(&self.tensor) {
            let before = list.len();
            list.retain(|(k, _)| *k != self.key);
            LIVE.fetch_sub(before - list.len(), Ordering::Relaxed);
            if list.is_empty() {
                map.remove(&self.tensor);
            }
        }
    }
}

/// Runs `f(leaf)` each time a backward has accumulated `leaf`'s gradient into `.grad()` (the
/// gradient then holds this backward's share). Hooks run in the order they were registered;
/// an error from one ends the backward with it.
pub fn register_post_accumulate_grad_hook(leaf: &Tensor, f: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static) -> HookHandle {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let key = NEXT.fetch_add(1, Ordering::Relaxed);
    hooks().lock().unwrap_or_else(|e| e.into_inner()).entry(leaf.id()).or_default().push((key, Arc::new(f)));
    LIVE.fetch_add(1, Ordering::Relaxed);
    HookHandle { tensor: leaf.id(), key }
}

/// Runs `leaf`'s hooks (outside the registry's lock, so a hook may register others).
pub(crate) fn run_hooks(leaf: &Tensor) -> Result<()> {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    let list: Vec<Hook> = match hooks().lock().unwrap_or_else(|e| e.into_inner()).get(&leaf.id()) {
        Some(l) => l.iter().map(|(_, h)| h.clone()).collect(),
        None => return Ok(()),
    };
    list.iter().try_for_each(|h| h(leaf))
}
