//! Kiln's disk caches (compiled kernels, tuned choices): where they live and how a file is
//! written.

/// Kiln's disk cache for compiled kernels, folder `kind`: `$KILN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
pub fn cache_dir(kind: &str) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let base = std::env::var_os("KILN_CACHE_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(|x| PathBuf::from(x).join("kiln"))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kiln")))
    })?;
    Some(base.join(kind))
}

/// Writes a cache file whole or not at all (a temporary renamed into place), best effort: a
/// cache that cannot be written only costs the work again next time.
pub fn cache_put(path: &std::path::Path, bytes: &[u8]) {
    // (Beside the file's own name: `x.algo` and `x.heuristic` must not share one.)
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    if path.parent().map(std::fs::create_dir_all).transpose().is_ok() && std::fs::write(&tmp, bytes).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}
