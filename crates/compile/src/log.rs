//! `KILN_LOG=graph,passes,fusion,kernels,recompiles,time` (or `all`) prints what the compiler
//! does, to stderr.

use std::sync::OnceLock;

fn topics() -> &'static Vec<String> {
    static TOPICS: OnceLock<Vec<String>> = OnceLock::new();
    TOPICS.get_or_init(|| {
        std::env::var("KILN_LOG").unwrap_or_default().split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
    })
}

pub fn enabled(topic: &str) -> bool {
    topics().iter().any(|t| t == topic || t == "all")
}

pub fn log(topic: &str, msg: &str) {
    if enabled(topic) {
        eprintln!("[kiln {topic}] {msg}");
    }
}
