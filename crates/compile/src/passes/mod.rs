//! Graph passes, each graph in, graph out. `optimise` runs `PIPELINE` in order: the generic
//! passes any model gains from (`generic.rs`) and the pattern fusions, each a named rule in
//! the file of what it rewrites (`products.rs`, `loss.rs`, `layer_norm.rs`, `attention.rs`),
//! with the target it runs for and, in its doc, the shapes it applies to. A new model family
//! adds its rule there and one line to `PIPELINE`.

mod attention;
mod edit;
mod generic;
mod layer_norm;
mod loss;
mod products;
#[cfg(test)]
mod tests;

use crate::graph::Graph;
use attention::attention_heads_last;
use generic::{cse, dce, fold_constants, merge_zero_writes, read_dense_copies_in_place, simplify};
use layer_norm::{fold_layer_norm_casts, fold_residual_into_layer_norm_grads, ln_bias_sums, ln_dx_copies};
use loss::{fuse_linear_cross_entropy, fuse_mean_cross_entropy};
use products::{fuse_gated_sums, fuse_matmuls, pad_unaligned_products};

pub use layer_norm::dx_copies;

/// What a graph is optimised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Cpu,
    /// A CUDA GPU; `clusters`: it runs thread block clusters (Hopper on), which the fused
    /// classifier head's kernel needs to spread over several SMs.
    Gpu {
        clusters: bool,
    },
}

/// The targets a pass runs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum On {
    Any,
    Gpu,
    /// A GPU with thread block clusters.
    Clusters,
}

impl On {
    fn takes(self, target: Target) -> bool {
        match self {
            On::Any => true,
            On::Gpu => target != Target::Cpu,
            On::Clusters => target == Target::Gpu { clusters: true },
        }
    }
}

/// One pass of the pipeline: its name (what `KILN_LOG=passes` prints), the targets it runs
/// for, and the rewrite.
struct Pass {
    name: &'static str,
    on: On,
    run: fn(&Graph, Target) -> Graph,
}

/// The pipeline, in order.
const PIPELINE: &[Pass] = &[
    Pass { name: "dce", on: On::Any, run: |g, _| dce(g) },
    Pass { name: "fold_constants", on: On::Any, run: |g, _| fold_constants(g) },
    Pass { name: "simplify", on: On::Any, run: |g, _| simplify(g) },
    Pass { name: "merge_zero_writes", on: On::Any, run: |g, _| merge_zero_writes(g) },
    Pass { name: "cse", on: On::Any, run: |g, _| cse(g) },
    // (Before `fuse_matmuls`, which would otherwise take the bias sums into the products.)
    Pass { name: "fold_residual_into_layer_norm_grads", on: On::Gpu, run: |g, _| fold_residual_into_layer_norm_grads(g) },
    Pass { name: "ln_bias_sums", on: On::Gpu, run: |g, _| ln_bias_sums(g) },
    Pass { name: "ln_dx_copies", on: On::Gpu, run: |g, _| ln_dx_copies(g) },
    Pass { name: "fuse_gated_sums", on: On::Gpu, run: |g, _| fuse_gated_sums(g) },
    Pass { name: "fuse_matmuls", on: On::Any, run: |g, t| fuse_matmuls(g, t != Target::Cpu) },
    Pass { name: "fuse_mean_cross_entropy", on: On::Gpu, run: |g, _| fuse_mean_cross_entropy(g) },
    Pass { name: "fuse_linear_cross_entropy", on: On::Clusters, run: |g, _| fuse_linear_cross_entropy(g) },
    Pass { name: "attention_heads_last", on: On::Gpu, run: |g, _| attention_heads_last(g) },
    Pass { name: "fold_layer_norm_casts", on: On::Gpu, run: |g, _| fold_layer_norm_casts(g) },
    Pass { name: "pad_unaligned_products", on: On::Gpu, run: |g, _| pad_unaligned_products(g) },
    Pass { name: "read_dense_copies_in_place", on: On::Any, run: |g, _| read_dense_copies_in_place(g) },
];

/// The pipeline's passes for `target`, in order; `log` sees the graph after each.
pub fn optimise(g: Graph, target: Target, mut log: impl FnMut(&str, &Graph)) -> Graph {
    PIPELINE.iter().filter(|p| p.on.takes(target)).fold(g, |g, p| {
        let g = (p.run)(&g, target);
        log(p.name, &g);
        g
    })
}
