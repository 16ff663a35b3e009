//! What a compiled step is asked for: the mode and the options.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Fused kernels launched in order.
    #[default]
    Default,
    /// The whole step as one CUDA graph (CPU: as Default).
    ReduceOverhead,
    /// `ReduceOverhead`, with each matmul shape's cuBLASLt candidates (and Kiln's own launch
    /// choices, `kiln_tensor::cuda::tune`) timed on the first run and the fastest kept (on
    /// disk too). CPU: as Default.
    MaxAutotune,
}

/// Which input sizes a compiled step takes as runtime values (torch.compile's `dynamic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dynamic {
    /// The first call specialises to its shapes; when an input dim shows a second value the
    /// step is compiled once more with that dim dynamic (its kernels take sizes as parameters),
    /// and every later value of it reuses those kernels. `mark_dynamic` makes a dim dynamic
    /// from the first call.
    #[default]
    Auto,
    /// Every dim of every input is dynamic from the first call.
    Always,
    /// Every new shape is a graph of its own (up to `recompile_limit`).
    Never,
}

#[derive(Debug, Clone, Copy)]
pub struct CompileOptions {
    pub mode: Mode,
    /// Host reads inside the step are errors instead of an eager fallback.
    pub fullgraph: bool,
    /// How many graphs may be compiled before `call` errors: distinct signatures of
    /// specialised graphs, and the kernel sets of dynamic ones.
    pub recompile_limit: usize,
    /// Which input sizes are runtime values (`Dynamic::Auto`: those seen to change).
    pub dynamic: Dynamic,
    /// How many shapes of a dynamic graph are kept ready to run (each its memory plan and, on
    /// a GPU, its captured CUDA graph), the least recently used dropped first; a dropped shape
    /// coming back is traced and planned again, reusing the built kernels.
    pub shape_cache: usize,
    /// Fuse pointwise chains (off: one kernel per node, for debugging).
    pub fuse: bool,
    /// Check mode: the first `check_steps` replays also run the closure eagerly from the same
    /// state and record the largest difference in outputs and state (`check_report`); the
    /// eager results are kept.
    pub check_steps: usize,
    /// On the CPU, build each fusion group into native code with the system C compiler
    /// (`cpu_codegen`); off, or without a compiler, groups run in the chunked interpreter.
    pub native_cpu: bool,
    /// A product with a short contraction (a weight gradient `g^T x` at a small batch) is made
    /// where its reader needs it: on a GPU inside the kernel of the one launch that reads it
    /// (`fusion::feed_gpu_products`), on the CPU tile by tile for its group
    /// (`fusion::feed_products`). Off: each such product is a kernel of its own.
    pub feed_products: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            mode: Mode::Default,
            fullgraph: false,
            recompile_limit: 8,
            dynamic: Dynamic::Auto,
            shape_cache: 16,
            fuse: true,
            check_steps: 0,
            native_cpu: true,
            feed_products: true,
        }
    }
}

/// `KILN_GPU_SOURCES=path` (a build with the `cuda` feature): a step compiled for the CPU is
/// optimised as for a Hopper GPU, and the CUDA source of its fused kernels is written to
/// `path`, so that their instructions can be read where no GPU is (NVRTC needs none). The
/// step then runs on the CPU as usual. What the model itself picks by device is traced as on
/// the CPU (`nn`'s attention: there as products and a softmax, where a GPU takes the fused op).
pub(crate) fn gpu_sources_path() -> Option<String> {
    if cfg!(feature = "cuda") {
        std::env::var("KILN_GPU_SOURCES").ok().filter(|p| !p.is_empty())
    } else {
        None
    }
}
