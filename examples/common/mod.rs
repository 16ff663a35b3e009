//! Small helpers the examples share: flag parsing and progress bars.
#![allow(dead_code)]

use indicatif::{ProgressBar, ProgressStyle};

/// `--name value` from the command line, parsed, or the default.
pub fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Whether `--name` was given.
pub fn has(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// `--name value` as a string, if given.
pub fn opt(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// `--device cpu|cuda|cuda:N`; by default the first GPU when one is usable, else the CPU.
pub fn device() -> kiln::Device {
    match opt("--device").as_deref() {
        Some("cpu") => kiln::Device::Cpu,
        Some(d) if d.starts_with("cuda") => kiln::Device::Cuda(d.strip_prefix("cuda:").and_then(|n| n.parse().ok()).unwrap_or(0)),
        _ => kiln::Device::cuda_if_available(0),
    }
}

pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(what.to_string());
    pb
}

/// `--compile-mode default|reduce-overhead|max-autotune`; by default one CUDA graph per step
/// on a GPU (`ReduceOverhead`) and `Default` on the CPU (where the modes are the same).
pub fn compile_mode(device: kiln::Device) -> kiln::compile::Mode {
    use kiln::compile::Mode;
    match opt("--compile-mode").as_deref() {
        Some("default") => Mode::Default,
        Some("reduce-overhead") => Mode::ReduceOverhead,
        Some("max-autotune") => Mode::MaxAutotune,
        _ if device.is_cuda() => Mode::ReduceOverhead,
        _ => Mode::Default,
    }
}

/// Dense BF16 peak of an H100 or H200 SXM, for model FLOPs utilisation.
pub const PEAK_BF16_FLOPS: f64 = 989e12;

/// nanoGPT's estimate of a training step's FLOPs per token: 6 per parameter (`params`, a
/// learned position table left out) and `12 L d T` for attention.
pub fn train_flops_per_token(params: usize, layers: usize, d_model: usize, context: usize) -> f64 {
    (6 * params + 12 * layers * d_model * context) as f64
}
