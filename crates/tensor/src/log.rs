//! `KILN_LOG=graph,passes,fusion,kernels,nvrtc,recompiles,time` (or `all`): what Kiln tells
//! about its work, on stderr. Read once per process.

use std::sync::OnceLock;

fn topics() -> &'static [String] {
    static TOPICS: OnceLock<Vec<String>> = OnceLock::new();
    TOPICS.get_or_init(|| {
        std::env::var("KILN_LOG").unwrap_or_default().split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
    })
}

/// Whether `KILN_LOG` names `topic` (or `all`).
pub fn enabled(topic: &str) -> bool {
    topics().iter().any(|t| t == topic || t == "all")
}

/// Prints `msg` under `topic`, when `KILN_LOG` asks for it.
pub fn log(topic: &str, msg: &str) {
    if enabled(topic) {
        eprintln!("[kiln {topic}] {msg}");
    }
}
