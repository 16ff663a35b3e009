//! Row kernels: softmax and its backward, layer norm forward and its fused backward (the
//! parameter gradients and dx in one pass), cross-entropy and its mean, with their launches.

use crate::codegen::compute_type;
use crate::cuda::kernels::prelude::{
    lanes_allreduce, other_dtype, row_allreduce, row_kernel_name, row_prologue, storage_type, INDEX_ARGS, PRELUDE,
};
use crate::cuda::kernels::reduce::REDUCE_ARGS;
use crate::DType;

/// Softmax (or log-softmax) of `scale * x` over the last dim: one warp per row (`block ==
/// false`) or one block per long row. Three sweeps of the row (max, sum of exponentials,
/// write); the row is read through strides (`RArgs`: kept dims, and the last dim's stride in
/// `rst[0]`), the output is contiguous. `causal`: row `i` of each `[qlen, S]` matrix keeps only
/// entries `j <= i` (the rest are written as 0).
pub fn softmax_source(dtype: DType, log: bool, block: bool, causal: bool) -> (String, String) {
    let stem = if log { "log_softmax" } else { "softmax" };
    let name = format!("{}{}", row_kernel_name(stem, dtype, block), if causal { "_causal" } else { "" });
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}{REDUCE_ARGS}\ntypedef {c} C;\n");
    s += &format!("extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ p, RArgs a) {{\n");
    s += row_prologue(block);
    s += "  long long base = a.off, r = row, st_ = a.rst[0];\n";
    s += "  for (int d = a.krank - 1; d >= 0; --d) { base += (r % a.kshape[d]) * a.kst[d]; r /= a.kshape[d]; }\n";
    s += if causal { "  const long long keep = min(a.red, row % a.qlen + 1);\n" } else { "  const long long keep = a.red;\n" };
    s += "  const C sc = (C)a.scale;\n  C acc = -(C)__longlong_as_double(0x7ff0000000000000LL);\n";
    s += "  for (long long j = lane; j < keep; j += tpr) { C v = sc * (C)ld(p[base + j * st_]); acc = (v > acc || v != v) ? v : acc; }\n";
    s += &row_allreduce(block, true);
    s += "  C m = acc; acc = (C)0;\n";
    s += "  for (long long j = lane; j < keep; j += tpr) acc += kexp(sc * (C)ld(p[base + j * st_]) - m);\n";
    s += &row_allreduce(block, false);
    s += "  C sum = acc, lse = m + klog(sum);\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) {\n";
    s += "    if (j >= keep) { st(&o[row * a.red + j], (C)0); continue; }\n    C v = sc * (C)ld(p[base + j * st_]);\n";
    s += if log { "    st(&o[row * a.red + j], v - lse);\n  }\n}\n" } else { "    st(&o[row * a.red + j], kexp(v - m) / sum);\n  }\n}\n" };
    (s, name)
}

/// Cross-entropy over the rows of dense logits `[rows, red]` against I64 targets: the
/// per-row loss (`o[row]`, in the compute type: F32 for BF16/F16/F32 logits), or
/// (`backward`) the logits' gradient in their own dtype from the per-row gradient `g` (in the
/// compute type, read at `row * gst`: a broadcast mean's gradient has stride 0). One sweep for
/// the log-sum-exp (`xent_row`), a second for the sum of the logits under label smoothing,
/// then the write. A target outside `0..red` that is not `ignore` is recorded in the error
/// word (code `code`) and its row counts as ignored.
pub fn cross_entropy_source(dtype: DType, backward: bool, block: bool) -> (String, String) {
    let name = row_kernel_name(if backward { "cross_entropy_backward" } else { "cross_entropy" }, dtype, block);
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {c} C;\n");
    s += XENT_ARGS;
    let out = if backward { t } else { c };
    s += &format!(
        "extern \"C\" __global__ void {name}({out}* __restrict__ o, const {t}* __restrict__ x, const long long* __restrict__ tg, \
         const C* __restrict__ g, long long* err, XArgs a) {{\n"
    );
    s += row_prologue(block);
    s += &xent_row(|max| row_allreduce(block, max));
    if backward {
        s += "  const C gr = skip ? (C)0 : g[row * a.gst];\n";
        s += &xent_grad_loop("o", "");
        s += "}\n";
    } else {
        s += "  (void)g;\n";
        s += XENT_SMOOTHING_SUM;
        s += &row_allreduce(block, false);
        s += "  if (lane == 0) o[row] = skip ? (C)0 : lse - on * (C)ld(x[base + t]) - off * acc;\n}\n";
    }
    (s, name)
}

/// Mirrors `XArgs`.
pub(crate) const XENT_ARGS: &str = "struct XArgs { long long rows, red, ignore, code, gst; double smoothing; int has_ignore, pad; };\n";

/// The row's sum of logits (this thread's part) into `acc`, which label smoothing needs.
pub(crate) const XENT_SMOOTHING_SUM: &str =
    "  acc = (C)0;\n  if (a.smoothing != 0.0) for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(x[base + j]);\n";

/// A cross-entropy row's gradient into `out[base + j]`: `gr` times the softmax less the
/// (smoothed) one-hot target; 0 for a skipped row. Each store runs under `guard` (a C
/// condition, or none).
pub(crate) fn xent_grad_loop(out: &str, guard: &str) -> String {
    let guard = if guard.is_empty() { String::new() } else { format!("if ({guard}) ") };
    format!(
        "  for (long long j = lane; j < a.red; j += tpr) {{\n    C d = kexp((C)ld(x[base + j]) - lse) - (j == t ? on : (C)0) - off;\n    {guard}st(&{out}[base + j], skip ? (C)0 : gr * d);\n  }}\n"
    )
}

/// A cross-entropy row's target check and log-sum-exp (the row's threads in `lane`/`tpr`,
/// whose values `reduce(max)` all-reduces): defines `base`, `t`, `skip`, `lse`, `on`, `off` and
/// leaves `acc` free. One read of the row: each thread keeps a running maximum and its sum of
/// exponentials, rescaled when the maximum grows, and the threads' sums meet at the row's
/// maximum. A NaN logit makes the row's `lse` NaN; `-inf` logits add nothing.
pub(crate) fn xent_row(reduce: impl Fn(bool) -> String) -> String {
    let mut s = String::from("  const long long base = row * a.red, t = tg[row];\n");
    s += "  bool skip = a.has_ignore && t == a.ignore;\n";
    s += "  if (!skip && (t < 0 || t >= a.red)) { if (lane == 0) check_index(err, a.code, t, a.red); skip = true; }\n";
    s += "  const C ninf = -(C)__longlong_as_double(0x7ff0000000000000LL);\n  C mx = ninf, se = (C)0;\n";
    s += "  for (long long j = lane; j < a.red; j += tpr) {\n    const C v = (C)ld(x[base + j]);\n";
    s += "    if (v > mx) { se = (mx == ninf ? (C)0 : se * kexp(mx - v)) + (C)1; mx = v; }\n";
    s += "    else if (v != v) mx = v;\n    else if (v != ninf) se += kexp(v - mx);\n  }\n";
    s += "  C acc = mx;\n";
    s += &reduce(true);
    s += "  const C m = acc;\n  acc = mx == ninf ? (C)0 : se * kexp(mx - m);\n";
    s += &reduce(false);
    s += "  const C lse = m + klog(acc), on = (C)(1.0 - a.smoothing), off = (C)(a.smoothing / (double)a.red);\n";
    s
}

/// Threads `Fused::CrossEntropyMean`'s kernel gives a row of `classes` logits: about four logits
/// each, a power of two up to a warp. (A thread per row of 10 logits left most SMs idle and
/// each thread a long serial chain, as in MLP b4096's 4096 rows.)
pub fn xent_mean_threads_per_row(classes: usize) -> usize {
    classes.div_ceil(4).next_power_of_two().min(32)
}

/// Blocks `Fused::CrossEntropyMean`'s kernel may launch (its partial sums), and its threads a
/// block.
pub const XENT_MEAN_BLOCKS: usize = 256;

pub const XENT_MEAN_THREADS: usize = 256;

// The last block reads the partial sums a thread each.
const _: () = assert!(XENT_MEAN_BLOCKS <= XENT_MEAN_THREADS);

/// `Fused::CrossEntropyMean` in one launch of blocks of 256 threads, `tpr` threads a row
/// (`xent_mean_threads_per_row`). Every block counts the real targets itself (all of them, in
/// the same order), so each knows the gradient's `1 / count` at once and writes its rows'
/// gradients in the same pass as their losses. The loss sums the blocks' partial sums: the last
/// block to finish (a ticket in the module's memory, reset by that block) reads them a thread
/// each and adds them in a fixed order, the same bits every step.
pub fn cross_entropy_mean_source(dtype: DType, tpr: usize, grad_at: usize) -> (String, String) {
    let name = format!("k_cross_entropy_mean_{}_t{tpr}_g{grad_at}", format!("{dtype:?}").to_lowercase());
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}{INDEX_ARGS}\ntypedef {c} C;\n");
    s += XENT_ARGS;
    s += &format!("__device__ unsigned int ticket;\n__device__ C partial[{XENT_MEAN_BLOCKS}];\n");
    s += &format!(
        "extern \"C\" __global__ void __launch_bounds__({XENT_MEAN_THREADS}) {name}({t}* __restrict__ o, const {t}* __restrict__ x, \
         const long long* __restrict__ tg, long long* err, XArgs a) {{\n"
    );
    s += "  __shared__ C sh[32];\n  __shared__ bool last;\n  C acc = (C)0;\n";
    s += "#pragma unroll 8\n  for (long long r = threadIdx.x; r < a.rows; r += blockDim.x) acc += (a.has_ignore && tg[r] == a.ignore) ? (C)0 : (C)1;\n";
    s += &row_allreduce(true, false);
    s += "  const C count = acc, gr = (C)1 / count;\n  C loss = (C)0;\n  __syncthreads();\n";
    // A row's threads may share a warp with rows past the end: those run on a copy of row 0
    // and store nothing, so that every lane takes part in the shuffles.
    s += &format!("  const int lane = threadIdx.x % {tpr}, tpr = {tpr};\n");
    s += &format!("  long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / {tpr};\n");
    s += "  const bool valid = row < a.rows;\n  if (!valid) row = 0;\n";
    s += "  if (a.rows > 0) {\n";
    s += &xent_row(|max| lanes_allreduce(max, tpr));
    s += XENT_SMOOTHING_SUM;
    s += &lanes_allreduce(false, tpr);
    s += "  if (valid && lane == 0 && !skip) loss = lse - on * (C)ld(x[base + t]) - off * acc;\n";
    s += &format!("  {t}* __restrict__ go = o + {grad_at};\n");
    s += &xent_grad_loop("go", "valid");
    s += "  }\n";
    s += "  acc = loss;\n";
    s += &row_allreduce(true, false);
    s += "  if (threadIdx.x == 0) { partial[blockIdx.x] = acc; __threadfence(); last = atomicAdd(&ticket, 1u) == gridDim.x - 1; }\n";
    // `last` is the same for the whole block, so the block reduction under it is safe.
    s += "  __syncthreads();\n  if (!last) return;\n  __threadfence();\n";
    s += "  acc = threadIdx.x < gridDim.x ? ((volatile C*)partial)[threadIdx.x] : (C)0;\n";
    s += &row_allreduce(true, false);
    s += "  if (threadIdx.x == 0) { st(&o[0], acc / count); ticket = 0; }\n}\n";
    (s, name)
}

/// The gradient of a softmax (`log`: log-softmax) of `scale * x` over the last dim of dense
/// `[rows, red]` buffers, from its output `y` and the output's gradient `g`: one sweep for
/// `sum(g y)` (or `sum(g)`), one for the write.
pub fn softmax_backward_source(dtype: DType, log: bool, block: bool) -> (String, String) {
    let name = row_kernel_name(if log { "log_softmax_backward" } else { "softmax_backward" }, dtype, block);
    let (t, c) = (storage_type(dtype), compute_type(dtype));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\nstruct SArgs {{ long long rows, red; double scale; }};\n");
    s += &format!(
        "extern \"C\" __global__ void {name}({t}* __restrict__ o, const {t}* __restrict__ y, const {t}* __restrict__ g, SArgs a) {{\n"
    );
    s += row_prologue(block);
    s += "  const long long base = row * a.red; const C sc = (C)a.scale;\n  C acc = (C)0;\n";
    if log {
        s += "  for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(g[base + j]);\n";
        s += &row_allreduce(block, false);
        s += "  for (long long j = lane; j < a.red; j += tpr) st(&o[base + j], sc * ((C)ld(g[base + j]) - kexp((C)ld(y[base + j])) * acc));\n}\n";
    } else {
        s += "  for (long long j = lane; j < a.red; j += tpr) acc += (C)ld(g[base + j]) * (C)ld(y[base + j]);\n";
        s += &row_allreduce(block, false);
        s += "  for (long long j = lane; j < a.red; j += tpr) { C yv = (C)ld(y[base + j]); st(&o[base + j], sc * yv * ((C)ld(g[base + j]) - acc)); }\n}\n";
    }
    (s, name)
}

/// What `layer_norm_grads_source`'s kernel writes beside the parameter gradients'
/// partials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LayerNormGradsWrites {
    /// x's gradient (with the weight `w`).
    pub dx: bool,
    /// A residual gradient `r` added to dx as it is stored.
    pub resid: bool,
    /// A third row of partials: dx's column sums, each value rounded to this dtype first.
    pub sums: Option<DType>,
    /// dx also stored in this dtype.
    pub copy: Option<DType>,
}

/// The longest row `layer_norm_grads_source` takes (32 values per lane).
pub const LAYER_NORM_GRADS_MAX_N: usize = 1024;

/// Warps a block of `layer_norm_grads_source`'s kernel has (two blocks an SM).
pub const LAYER_NORM_GRADS_WARPS: usize = 8;

/// Dynamic shared memory of a staged `layer_norm_grads_source` kernel over rows of `n`
/// values: two row slots a warp, each x's and g's row (and with `LayerNormGradsStage::RowsAndResidual`, r's).
pub fn layer_norm_grads_stage_bytes(n: usize, dtype: DType, gdt: DType, stage: LayerNormGradsStage) -> usize {
    let xs = match stage {
        LayerNormGradsStage::Off => return 0,
        LayerNormGradsStage::Rows => 1,
        LayerNormGradsStage::RowsAndResidual => 2,
    };
    LAYER_NORM_GRADS_WARPS * 2 * n * (xs * dtype.size_in_bytes() + gdt.size_in_bytes())
}

/// What a `layer_norm_grads_source` kernel copies ahead into shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerNormGradsStage {
    /// Nothing: rows are loaded straight into registers.
    Off,
    /// x's and g's rows.
    Rows,
    /// x's, g's and the residual gradient r's rows (with `LayerNormGradsWrites::resid`).
    RowsAndResidual,
}

/// Layer norm's parameter gradients, first pass: block `b` folds rows `b * chunk ..` into
/// `part[b] = [sum g * xhat | sum g]` (`2 n` values of the compute type). Each warp takes a
/// row at a time (mean and variance as `normalize_source` computes them), each lane keeps its
/// `tiles` columns' sums in registers, and the warps add theirs in a fixed order, so the
/// result does not depend on scheduling. With `dx`, the same pass also writes the input's
/// gradient (`normalize_source`'s backward with the weight `w`) from the row it holds, so the
/// layer norm's whole backward reads x and g once. Staged (`stage`; rows of whole 16-byte pieces,
/// 16-byte aligned, `layer_norm_grads_stage_bytes` of dynamic shared memory): each warp copies its
/// next row into shared memory asynchronously while it works on this one; loaded straight into
/// registers, a warp's row would wait on memory between its reductions (BENCHMARKS.md).
/// `LayerNormGradsStage::RowsAndResidual`: r's next row comes with them (read at the store, it would be a
/// wait on memory at the end of every row, which slows GPT BF16's step). `parts.sums` (with dx): a third row of partials, the column sums of dx (plus r) as
/// rounded to that dtype (`Op::LayerNormGrads`'s `sums`); the weight is then read from
/// shared memory, so that the row's accumulators take the registers it held. `parts.copy`
/// (with dx): dx (plus r) also stored in that dtype to `cp` (the op's `copy`).
pub fn layer_norm_grads_source(
    dtype: DType,
    tiles: usize,
    parts: LayerNormGradsWrites,
    gdt: DType,
    stage: LayerNormGradsStage,
) -> (String, String) {
    // g may be in another float dtype (a BF16 product's gradient under autocast), read as C.
    let LayerNormGradsWrites { dx, resid, sums, copy } = parts;
    let (sums, copy) = (sums.filter(|_| dx), copy.filter(|_| dx));
    let (staged, stage_r) = (stage != LayerNormGradsStage::Off, stage == LayerNormGradsStage::RowsAndResidual && dx && resid);
    let tag = |what: &str, t: Option<DType>| t.map_or(String::new(), |t| format!("_{what}_{}", storage_type(t).replace(' ', "_")));
    let name = format!(
        "k_ln_{}grads_{}_{tiles}{}{}{}{}{}",
        if dx { "" } else { "param_" },
        storage_type(dtype).replace(' ', "_"),
        other_dtype("g", dtype, gdt),
        if stage_r {
            "_staged_r"
        } else if staged {
            "_staged"
        } else {
            ""
        },
        if resid { "_residual" } else { "" },
        tag("sums", sums),
        tag("copy", copy)
    );
    let (t, c, gt) = (storage_type(dtype), compute_type(dtype), storage_type(gdt));
    let rows = 2 + sums.is_some() as usize;
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\ntypedef {t} X;\ntypedef {gt} G;\nstruct NArgs {{ long long rows, red; double eps; }};\n#define TILES {tiles}\n#define PROWS {rows}\n");
    if let Some(st) = sums {
        s += &format!("typedef {} S;\n", storage_type(st));
    }
    s += &format!("typedef {} Q;\n", storage_type(copy.unwrap_or(dtype)));
    if resid {
        s += "__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }\n";
        s += "__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }\n";
    }
    s += &format!("extern \"C\" __global__ void __launch_bounds__({}) {name}(C* __restrict__ part, const X* __restrict__ x, const G* __restrict__ g, NArgs a, long long chunk, X* __restrict__ dx, const X* __restrict__ w, const X* __restrict__ r, Q* __restrict__ cp) {{\n", LAYER_NORM_GRADS_WARPS * 32);
    s += "  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;\n";
    s += "  const long long r1 = min(a.rows, (blockIdx.x + 1) * chunk); const C n = (C)a.red;\n";
    s += "  C dw[TILES], db[TILES];\n#pragma unroll\n  for (int t = 0; t < TILES; ++t) { dw[t] = (C)0; db[t] = (C)0; }\n";
    if sums.is_some() {
        // The weights in shared memory (registers go to the sums), zeros past the row.
        s += "  C ds[TILES];\n#pragma unroll\n  for (int t = 0; t < TILES; ++t) ds[t] = (C)0;\n";
        s += "  __shared__ C wsh[32 * TILES];\n  for (int j = threadIdx.x; j < 32 * TILES; j += blockDim.x) wsh[j] = j < a.red ? (C)ld(w[j]) : (C)0;\n";
        s += "  __syncthreads();\n#define WR(t) wsh[lane + 32 * (t)]\n";
    } else if dx {
        // The lane's columns are the same in every row: their weights are loaded once.
        s += "  C wr[TILES];\n#pragma unroll\n  for (int t = 0; t < TILES; ++t) wr[t] = lane + 32LL * t < a.red ? (C)ld(w[lane + 32LL * t]) : (C)0;\n";
        s += "#define WR(t) wr[t]\n";
    }
    let (xrow, grow) = if staged {
        s += &staged_row_loop(stage_r);
        ("xs[j]", "gs[j]")
    } else {
        s += "  for (long long row = blockIdx.x * chunk + warp; row < r1; row += nw) {\n";
        ("x[base + j]", "g[base + j]")
    };
    // The row's x and g are loaded once into registers (all loads in flight together); the
    // mean and variance sum them in `normalize_source`'s order (warp sums).
    s += "    const long long base = row * a.red; C xr[TILES], gr[TILES], acc = (C)0;\n";
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) {\n      const long long j = lane + 32LL * t;\n";
    s += &format!("      xr[t] = j < a.red ? (C)ld({xrow}) : (C)0; gr[t] = j < a.red ? (C)ld({grow}) : (C)0;\n    }}\n");
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) if (lane + 32LL * t < a.red) acc += xr[t];\n";
    s += &row_allreduce(false, false);
    s += "    const C mean = acc / n; acc = (C)0;\n";
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) if (lane + 32LL * t < a.red) { C d = xr[t] - mean; acc += d * d; }\n";
    s += &row_allreduce(false, false);
    s += "    const C rstd = (C)1 / ksqrt(acc / n + (C)a.eps);\n";
    s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) { xr[t] = (xr[t] - mean) * rstd; dw[t] += gr[t] * xr[t]; db[t] += gr[t]; }\n";
    if dx {
        // dx = rstd (gw - mean(gw) - xhat mean(gw xhat)), xr now holding xhat.
        s += "    acc = (C)0;\n#pragma unroll\n    for (int t = 0; t < TILES; ++t) acc += gr[t] * WR(t);\n";
        s += &row_allreduce(false, false);
        s += "    const C mg = acc / n; acc = (C)0;\n";
        s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) acc += gr[t] * WR(t) * xr[t];\n";
        s += &row_allreduce(false, false);
        s += "    const C mgx = acc / n;\n";
        s += "#pragma unroll\n    for (int t = 0; t < TILES; ++t) {\n      const long long j = lane + 32LL * t;\n";
        // With a residual gradient, added after dx is rounded as eager stores it (no FMA).
        s += "      if (j < a.red) {\n        X v; st(&v, rstd * (gr[t] * WR(t) - mg - xr[t] * mgx));\n";
        if resid {
            s += &format!("        st(&v, add_rn(ld(v), ld({})));\n", if stage_r { "rs[j]" } else { "r[base + j]" });
        }
        s += "        dx[base + j] = v;\n";
        if sums.is_some() {
            // Summed as the product's operand holds it: rounded to S.
            s += "        S q; st(&q, ld(v)); ds[t] += (C)ld(q);\n";
        }
        if copy.is_some() {
            s += "        { Q c; st(&c, ld(v)); cp[base + j] = c; }\n";
        }
        s += "      }\n    }\n";
    }
    if staged {
        // Every lane has read the slot before the next iteration's fetch refills it.
        s += "    __syncwarp();\n";
    }
    s += "  }\n";
    s += &block_partials(sums.is_some());
    (s, name)
}

/// `layer_norm_grads_source`'s row loop over rows staged in shared memory: two slots per
/// warp, the next row fetched with `cp.async` while this one is worked on; `xs`, `gs` (and
/// with `stage_r`, `rs`) point into this row's slot.
fn staged_row_loop(stage_r: bool) -> String {
    let mut s = String::new();
    // Slot s of this warp: the row's x, then its g (then its r). A fetch always commits a
    // group (empty past the warp's rows), so that waiting for all but the newest is this row's.
    s += "  extern __shared__ __align__(16) unsigned char dyn[];\n";
    s += &format!(
        "  const int x_bytes = (int)a.red * (int)sizeof(X), g_bytes = (int)a.red * (int)sizeof(G), slot_bytes = {} * x_bytes + g_bytes;\n",
        1 + stage_r as u8
    );
    s += "  unsigned char* mine = dyn + warp * 2 * slot_bytes;\n";
    s += "  auto fetch = [&](long long row, int slot) {\n    if (row < r1) {\n";
    s += "      const unsigned dst = (unsigned)__cvta_generic_to_shared(mine + slot * slot_bytes);\n";
    s += "      const char* xs = (const char*)(x + row * a.red); const char* gs = (const char*)(g + row * a.red);\n";
    s += "      for (int o = lane * 16; o < x_bytes; o += 512) asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(dst + o), \"l\"(xs + o));\n";
    s += "      for (int o = lane * 16; o < g_bytes; o += 512) asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(dst + x_bytes + o), \"l\"(gs + o));\n";
    if stage_r {
        s += "      const char* rs = (const char*)(r + row * a.red);\n";
        s += "      for (int o = lane * 16; o < x_bytes; o += 512) asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(dst + x_bytes + g_bytes + o), \"l\"(rs + o));\n";
    }
    s += "    }\n    asm volatile(\"cp.async.commit_group;\" ::);\n  };\n";
    s += "  int slot = 0;\n  fetch(blockIdx.x * chunk + warp, 0);\n";
    s += "  for (long long row = blockIdx.x * chunk + warp; row < r1; row += nw, slot ^= 1) {\n";
    s += "    fetch(row + nw, slot ^ 1);\n    asm volatile(\"cp.async.wait_group 1;\" ::: \"memory\");\n    __syncwarp();\n";
    s += "    const X* xs = (const X*)(mine + slot * slot_bytes); const G* gs = (const G*)(mine + slot * slot_bytes + x_bytes);\n";
    if stage_r {
        s += "    const X* rs = (const X*)(mine + slot * slot_bytes + x_bytes + g_bytes);\n";
    }
    s
}

/// `layer_norm_grads_source`'s end: each block sums its warps' partials (dw, db and the
/// sums row) in shared memory and stores them, a row of `PROWS * n` per block.
fn block_partials(sums: bool) -> String {
    let mut s = String::new();
    s += "  __shared__ C sh[PROWS * 32 * TILES];\n";
    s += "  for (int w = 0; w < nw; ++w) {\n    if (warp == w) {\n#pragma unroll\n      for (int t = 0; t < TILES; ++t) {\n";
    s += "        const long long j = lane + 32LL * t;\n        if (j < a.red) { sh[j] = (w ? sh[j] : (C)0) + dw[t]; sh[a.red + j] = (w ? sh[a.red + j] : (C)0) + db[t];";
    s += if sums { " sh[2 * a.red + j] = (w ? sh[2 * a.red + j] : (C)0) + ds[t]; }\n" } else { " }\n" };
    s += "      }\n    }\n    __syncthreads();\n  }\n";
    s += "  for (long long j = threadIdx.x; j < PROWS * a.red; j += blockDim.x) part[blockIdx.x * PROWS * a.red + j] = sh[j];\n}\n";
    s
}

/// Layer norm's normalisation over the last dim of a dense buffer (`affine`: times `w`, plus
/// `b`, per column), or (`backward`) its input gradient from `x` and the output gradient `g`
/// (`affine`: g times `w`): the row's mean and variance (two sweeps), then for the backward
/// the sums of `g` and `g xhat`, then the write. RMS norm (`rms`) takes the mean as 0 (one
/// sweep fewer each way, and its forward weight has no bias). Arguments: out, x, g (backward), args, w,
/// b (the forward's `affine`). The output is written in `out` (x's dtype, or the forward's
/// folded cast: `Fused::NormalizeTo`).
pub fn normalize_source(k: NormKernel, block: bool, out: DType) -> (String, String) {
    let NormKernel { dtype, backward, affine, rms } = k;
    let kind = match (backward, affine, rms) {
        (true, true, false) => "layer_norm_backward",
        (true, false, false) => "normalize_backward",
        (false, true, false) => "layer_norm",
        (false, false, false) => "normalize",
        (true, true, true) => "rms_norm_backward",
        (true, false, true) => "rms_normalize_backward",
        (false, true, true) => "rms_norm",
        (false, false, true) => "rms_normalize",
    };
    let name = row_kernel_name(kind, dtype, block) + &other_dtype("to_", dtype, out);
    let (t, c, ot) = (storage_type(dtype), compute_type(dtype), storage_type(out));
    let mut s = format!("{PRELUDE}\ntypedef {c} C;\nstruct NArgs {{ long long rows, red; double eps; }};\n");
    s += &format!(
        "extern \"C\" __global__ void {name}({ot}* __restrict__ o, const {t}* __restrict__ x, const {t}* __restrict__ g, NArgs a, const {t}* __restrict__ w, const {t}* __restrict__ b) {{\n"
    );
    s += row_prologue(block);
    s += "  const long long base = row * a.red; const C n = (C)a.red;\n  C acc = (C)0;\n";
    // RMS norm: the mean is 0, the variance the mean square.
    s += &row_mean("mean", "(C)ld(x[base + j])", block, rms);
    s += "  for (long long j = lane; j < a.red; j += tpr) { C d = (C)ld(x[base + j]) - mean; acc += d * d; }\n";
    s += &row_allreduce(block, false);
    s += "  const C rstd = (C)1 / ksqrt(acc / n + (C)a.eps);\n";
    if backward {
        // The gradient of xhat: g, times the weight with `affine`.
        let gj = if affine { "((C)ld(g[base + j]) * (C)ld(w[j]))" } else { "(C)ld(g[base + j])" };
        s += &format!("#define GJ {gj}\n");
        s += &row_mean("mg", "GJ", block, rms);
        s += "  for (long long j = lane; j < a.red; j += tpr) acc += GJ * (((C)ld(x[base + j]) - mean) * rstd);\n";
        s += &row_allreduce(block, false);
        s += "  const C mgx = acc / n;\n";
        s += "  for (long long j = lane; j < a.red; j += tpr) {\n";
        s += "    C xh = ((C)ld(x[base + j]) - mean) * rstd;\n    st(&o[base + j], rstd * (GJ - mg - xh * mgx));\n  }\n}\n";
    } else {
        let affine = match (affine, rms) {
            (true, false) => " * (C)ld(w[j]) + (C)ld(b[j])",
            (true, true) => " * (C)ld(w[j])",
            (false, _) => "",
        };
        s += &format!("  (void)g;\n  for (long long j = lane; j < a.red; j += tpr) st(&o[base + j], ((C)ld(x[base + j]) - mean) * rstd{affine});\n}}\n");
    }
    (s, name)
}

/// `normalize_source`'s row mean of `term` (over `j`) as `C name`, leaving `acc` at 0; with
/// `zero` the mean is known to be 0 and takes no sweep.
fn row_mean(name: &str, term: &str, block: bool, zero: bool) -> String {
    if zero {
        return format!("  const C {name} = (C)0; acc = (C)0;\n");
    }
    let sweep = format!("  acc = (C)0;\n  for (long long j = lane; j < a.red; j += tpr) acc += {term};\n");
    format!("{sweep}{}  const C {name} = acc / n; acc = (C)0;\n", row_allreduce(block, false))
}

/// Which `normalize_source` kernel: the element type, forward or backward, with the weight
/// (and in a layer norm's forward the bias), and RMS norm (no mean) or layer norm.
#[derive(Debug, Clone, Copy)]
pub struct NormKernel {
    pub dtype: DType,
    pub backward: bool,
    pub affine: bool,
    pub rms: bool,
}

/// The widest F32 row `normalize_rows_source` holds in registers (eight float4s a lane).
pub const LN_ROWS_MAX_N: usize = 1024;

/// Layer norm's forward for F32 rows of `32 * 4 * tiles` values (`tiles <= 8`), a warp per row
/// held in registers: each lane loads its `tiles` float4s at once, so the row costs one trip to
/// memory where `normalize_source`'s loop makes one a value (faster for rows such as the
/// Transformer's 320 of 512). Same arguments; all pointers 16-byte aligned. The output is
/// written in `out`: F32, or F16/BF16 (a folded cast, four values as one 8-byte store).
pub fn normalize_rows_source(tiles: usize, affine: bool, out: DType) -> (String, String) {
    let name = format!("k_layer_norm_rows{tiles}_f32{}{}", if affine { "" } else { "_plain" }, other_dtype("to_", DType::F32, out));
    let ot = storage_type(out);
    let mut s = format!("{PRELUDE}\ntypedef float C;\nstruct NArgs {{ long long rows, red; double eps; }};\n#define T {tiles}\n");
    s += match out {
        DType::BF16 => "__device__ __forceinline__ unsigned pack2(float a, float b) { return f2b(a) | ((unsigned)f2b(b) << 16); }\n",
        DType::F16 => "__device__ __forceinline__ unsigned pack2(float a, float b) { return f2h(a) | ((unsigned)f2h(b) << 16); }\n",
        _ => "",
    };
    s += &format!(
        "extern \"C\" __global__ void {name}({ot}* __restrict__ o, const float* __restrict__ x, const float* __restrict__ g, NArgs a, const float* __restrict__ w, const float* __restrict__ b) {{\n"
    );
    s += "  (void)g;\n  const long long row = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; const int lane = threadIdx.x % 32;\n";
    s += "  if (row >= a.rows) return;\n  const float4* xr = (const float4*)(x + row * a.red);\n  float4 v[T];\n  C acc = 0.f;\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) v[t] = __ldg(xr + lane + 32 * t);\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) acc += (v[t].x + v[t].y) + (v[t].z + v[t].w);\n";
    s += &row_allreduce(false, false);
    s += "  const C n = (C)a.red, mean = acc / n;\n  acc = 0.f;\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) {\n    const float4 d = make_float4(v[t].x - mean, v[t].y - mean, v[t].z - mean, v[t].w - mean);\n";
    s += "    acc += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);\n  }\n";
    s += &row_allreduce(false, false);
    s += "  const C rstd = 1.f / ksqrt(acc / n + (C)a.eps);\n";
    s += "#pragma unroll\n  for (int t = 0; t < T; ++t) {\n    const int j = lane + 32 * t;\n";
    s += "    float4 y = make_float4((v[t].x - mean) * rstd, (v[t].y - mean) * rstd, (v[t].z - mean) * rstd, (v[t].w - mean) * rstd);\n";
    if affine {
        s += "    const float4 wj = __ldg((const float4*)w + j), bj = __ldg((const float4*)b + j);\n";
        s += "    y = make_float4(y.x * wj.x + bj.x, y.y * wj.y + bj.y, y.z * wj.z + bj.z, y.w * wj.w + bj.w);\n";
    }
    s += if out == DType::F32 {
        "    ((float4*)(o + row * a.red))[j] = y;\n  }\n}\n"
    } else {
        "    ((uint2*)(o + row * a.red))[j] = make_uint2(pack2(y.x, y.y), pack2(y.z, y.w));\n  }\n}\n"
    };
    (s, name)
}

#[cfg(feature = "cuda")]
pub(crate) use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::*;
    use crate::cuda::gpu::{Gpu, XENT_CODE};
    use crate::cuda::kernels::elementwise::{dense, Dense};
    use crate::cuda::kernels::prelude::{coalesce, kernel_params, storages, too_many_dims, CudaStorage, View, MAX_RANK};
    use crate::cuda::kernels::reduce::{accumulator, reduce_into, RArgs};
    use crate::op::{Fused, Op, Part, Parts, ReduceOp};
    use crate::shape::Layout;
    use crate::storage::Storage;
    use crate::{DType, Device, Error, Result};
    use std::sync::Arc;

    /// Softmax over the last dim of `s` read through `l`, into a contiguous buffer.
    pub(crate) fn softmax(g: &Arc<Gpu>, (s, l): (&CudaStorage, &Layout), (log, scale, causal): (bool, f64, bool)) -> Result<CudaStorage> {
        let out = CudaStorage::alloc(&g.mem, s.dtype, l.numel())?;
        let r = l.rank();
        let (ks, kst) = coalesce(&l.shape[..r - 1], &[l.strides[..r - 1].to_vec()]);
        if ks.len() > MAX_RANK {
            return Err(too_many_dims(&l.shape));
        }
        let (rows, n): (usize, usize) = (ks.iter().product(), l.shape[r - 1]);
        if rows == 0 || n == 0 {
            return Ok(out);
        }
        let (block, grid, threads) = row_launch(rows, n);
        let k = g.kernel(crate::cuda::gpu::spec_key("softmax", &(s.dtype, log, block, causal)), || {
            softmax_source(s.dtype, log, block, causal)
        })?;
        let qlen = if r >= 2 { l.shape[r - 2].max(1) as i64 } else { 1 };
        let mut a = RArgs {
            rows: rows as i64,
            red: n as i64,
            off: l.offset as i64,
            chunks: 1,
            chunk_len: n as i64,
            krank: ks.len() as i32,
            rrank: 1,
            scale,
            qlen,
            ..RArgs::default()
        };
        for (d, (&x, &y)) in ks.iter().zip(&kst[0]).enumerate() {
            (a.kshape[d], a.kst[d]) = (x as i64, y as i64);
        }
        (a.rshape[0], a.rst[0]) = (n as i64, l.strides[r - 1] as i64);
        let (mut o, mut p) = (out.buf.ptr, s.buf.ptr);
        let mut params = kernel_params![o, p, a];
        // SAFETY: (out, input, RArgs) matches the generated signature; the output holds every
        // element and the input is read within its layout.
        unsafe { g.launch(k, grid, threads, 0, &mut params)? };
        Ok(out)
    }

    /// The launch shape of the row kernels (`crate::cuda::kernels::prelude::row_prologue`): a warp per row, eight rows
    /// a block, or a 1024-thread block per row longer than 1024. Returns (block mode, grid, threads).
    fn row_launch(rows: usize, n: usize) -> (bool, (u32, u32), u32) {
        if n > 1024 {
            (true, (rows as u32, 1), 1024)
        } else {
            (false, (rows.div_ceil(8) as u32, 1), 256)
        }
    }

    /// Mirrors `struct NArgs` and `struct SArgs`: rows, row length, and the op's one scalar.
    #[repr(C)]
    struct RowArgs {
        rows: i64,
        red: i64,
        value: f64,
    }

    /// A row kernel over the last dim of `x` and (if given) a gradient of its shape, both read as
    /// dense copies, with `(out, x, g, RowArgs)` parameters; `kernel` picks the kernel for block
    /// mode or not, and whether every pointer (extras included) is 16-byte aligned.
    fn row_pair(
        g: &Arc<Gpu>,
        (s, l): (&CudaStorage, &Layout),
        grad: Option<(&CudaStorage, &Layout)>,
        (value, extra): (f64, [u64; 2]),
        out_dtype: DType,
        kernel: impl FnOnce(bool, bool) -> Result<crate::cuda::gpu::Kernel>,
    ) -> Result<CudaStorage> {
        let out = CudaStorage::alloc(&g.mem, out_dtype, l.numel())?;
        let n = l.shape[l.rank() - 1];
        let rows = l.numel().checked_div(n).unwrap_or(0);
        if rows == 0 {
            return Ok(out);
        }
        let x = dense(g, s, l)?;
        let gd = grad.map(|(sg, lg)| dense(g, sg, lg)).transpose()?;
        let (block, grid, threads) = row_launch(rows, n);
        let (mut o, mut px) = (out.buf.ptr, x.ptr());
        let mut pg = gd.as_ref().map_or(0, |d| d.ptr());
        let k = kernel(block, [o, px, pg, extra[0], extra[1]].iter().all(|p| p % 16 == 0))?;
        let mut a = RowArgs { rows: rows as i64, red: n as i64, value };
        let [mut e0, mut e1] = extra;
        let mut params = kernel_params![o, px, pg, a, e0, e1];
        // SAFETY: (out, x, g, RowArgs) matches the generated signatures, followed by layer norm's
        // weight and bias (null unless its kernel reads them: `[n]` and dense; the other kernels
        // take four arguments and the driver reads no more); x and g are dense with `rows * n` elements,
        // and so is the output (g is unused, and may be null, in layer norm's forward).
        unsafe { g.launch(k, grid, threads, 0, &mut params)? };
        Ok(out)
    }

    /// `Fused::LayerNormGrads` with `copy: Some(t)`: the flat output, and x's gradient (plus r)
    /// stored in `t` by the same kernel.
    pub(crate) fn layer_norm_grads_with_copy(op: &Op, ins: &[&Storage], layouts: &[&Layout], device: Device) -> Result<(Storage, Storage)> {
        let (Device::Cuda(ordinal), Op::Fused(Fused::LayerNormGrads { eps, sums, copy: Some(t) })) = (device, op) else {
            return Err(Error::Msg(format!("layer_norm_grads_with_copy: {op:?} on {device:?}")));
        };
        let g = crate::cuda::gpu::gpu(ordinal)?;
        let cs = storages(ins)?;
        let x: Vec<View> = cs.iter().copied().zip(layouts.iter().copied()).collect();
        if x.len() < 3 {
            return Err(Error::Msg("layer_norm_grads_with_copy: the copy needs the weight".into()));
        }
        let copy = CudaStorage::alloc(&g.mem, *t, x[0].1.numel())?;
        let flat = layer_norm_param_grads(&g, x[0], x[1], (x.get(2).copied(), x.get(3).copied()), (*eps, *sums), Some(&copy))?;
        Ok((Storage::Cuda(flat), Storage::Cuda(copy)))
    }

    /// Layer norm's parameter gradients `[2, n]` from x and the output gradient: per-block
    /// partial sums in one pass over both (`layer_norm_grads_source`), then one
    /// column sum of the partials. With the weight `w`, the same pass writes the input's gradient
    /// too, after the `[2, n]` (`[3, n]` with `sums`: dx's column sums as rounded to that dtype)
    /// (`Parts::layer_norm_grads`). With `copy` (dense,
    /// x's shape) and the weight, the pass also stores dx (plus r) to it in its dtype.
    pub(crate) fn layer_norm_param_grads(
        g: &Arc<Gpu>,
        x: (&CudaStorage, &Layout),
        grad: (&CudaStorage, &Layout),
        (w, r): (Option<View>, Option<View>),
        (eps, sums): (f64, Option<DType>),
        copy: Option<&CudaStorage>,
    ) -> Result<CudaStorage> {
        let (dtype, n) = (x.0.dtype, x.1.shape[x.1.rank() - 1]);
        let rows = x.1.numel().checked_div(n).unwrap_or(0);
        let sums = sums.filter(|_| w.is_some());
        let parts = Parts::layer_norm_grads(&x.1.shape, sums.is_some());
        let dx_at = parts.offset(Part::Dx)?;
        // Rows of partials each block writes: dw, db (and the sums).
        let rows_k = 2 + sums.is_some() as usize;
        let out = CudaStorage::alloc(&g.mem, dtype, if w.is_some() { parts.len() } else { 2 * n })?;
        let tiles = n.div_ceil(32);
        if n > LAYER_NORM_GRADS_MAX_N {
            return Err(Error::shape("layer_norm_grads", format!("rows of {n} exceed the kernel's {}", LAYER_NORM_GRADS_MAX_N)));
        }
        if rows == 0 || n == 0 {
            g.zero(&out)?;
            return Ok(out);
        }
        let (xd, gd) = (dense(g, x.0, x.1)?, dense(g, grad.0, grad.1)?);
        let wd = w.map(|(s, l)| dense(g, s, l)).transpose()?;
        // The residual gradient added to x's (only with the weight: the op's shape rule).
        let rd = r.filter(|_| w.is_some()).map(|(s, l)| dense(g, s, l)).transpose()?;
        let with_dx = wd.is_some();
        let gdt = grad.0.dtype;
        let (px, pg, pr) = (xd.ptr(), gd.ptr(), rd.as_ref().map_or(0, |r| r.ptr()));
        // Staged (each warp's next rows copied to shared memory while it works on this one) where
        // F32 rows of x, g (and r) are whole, aligned 16-byte pieces, and two blocks' slots fit an SM.

        let resid = rd.is_some();
        let pieces = dtype == DType::F32 && gdt.is_float() && [dtype, gdt].iter().all(|d| (n * d.size_in_bytes()) % 16 == 0);
        // With the kernel's static arrays (the partials' rows, and with sums the weights), within
        // 96 KiB: two blocks an SM on Hopper, and under the 99 KiB a block of sm_86/89 may take.
        let fixed = (rows_k + sums.is_some() as usize) * 32 * tiles * accumulator(dtype).size_in_bytes();
        let fits = |s: LayerNormGradsStage| layer_norm_grads_stage_bytes(32 * tiles, dtype, gdt, s) + fixed <= 96 * 1024;
        let stage_r = resid && pr % 16 == 0;
        let stage = match (pieces && (px | pg) % 16 == 0, stage_r) {
            (true, true) if fits(LayerNormGradsStage::RowsAndResidual) => LayerNormGradsStage::RowsAndResidual,
            (true, _) if fits(LayerNormGradsStage::Rows) => LayerNormGradsStage::Rows,
            _ => LayerNormGradsStage::Off,
        };
        let (most, shared) =
            (layer_norm_grads_stage_bytes(32 * tiles, dtype, gdt, stage), layer_norm_grads_stage_bytes(n, dtype, gdt, stage));
        let copy = copy.filter(|_| with_dx);
        let parts = LayerNormGradsWrites { dx: with_dx, resid, sums, copy: copy.map(|c| c.dtype) };
        let k = g.kernel_shared(crate::cuda::gpu::spec_key("layer_norm_grads", &(dtype, tiles, gdt, stage, parts)), most as u32, || {
            layer_norm_grads_source(dtype, tiles, parts, gdt, stage)
        })?;
        let pc = copy.map_or(0, |c| c.buf.ptr);
        let (pdx, pw) = match &wd {
            Some(w) => (out.ptr_at(dx_at), w.ptr()),
            None => (0, 0),
        };
        // The kernel on about `want` blocks, each folding a run of rows into `part` (room for
        // `want x rows_k n` partials), then the partials added in order into `out`.
        let run = |want: usize, part: &CudaStorage| -> Result<()> {
            let chunk = rows.div_ceil(want.clamp(1, rows));
            let blocks = rows.div_ceil(chunk);
            let mut a = RowArgs { rows: rows as i64, red: n as i64, value: eps };
            let (mut o, mut ch, mut px, mut pg, mut pdx, mut pw, mut pr) = (part.buf.ptr, chunk as i64, px, pg, pdx, pw, pr);
            let mut pc = pc;
            let mut params = kernel_params![o, px, pg, a, ch, pdx, pw, pr, pc];
            // SAFETY: (part, x, g, NArgs, chunk, dx, w, r, cp) matches the generated signature; x
            // and g are dense `rows * n` buffers, `part` holds `blocks * rows_k n` partials of the
            // compute type (blocks at most `want`), and with the weight (dense, `n`) `out` holds
            // `rows * n` more elements from `dx_at`; without it the kernel reads neither dx nor w;
            // r (dense, x's shape and dtype) is read only by the kernel made for it, and cp (the
            // caller's dense `rows * n` copy of its dtype) written only by the kernel made for it.
            // Staged, `shared` bytes hold the warps' row slots (the kernel loaded with room for
            // `most`), and x's, g's and r's rows are 16-byte aligned.
            unsafe { g.launch(k, (blocks as u32, 1), (LAYER_NORM_GRADS_WARPS * 32) as u32, shared as u32, &mut params)? };
            reduce_into(g, ReduceOp::Sum, part, &Layout::contiguous(&[blocks, rows_k * n]), &[0], &out, false)
        };
        // About two blocks of 8 warps per SM by default. (Four blocks of 16 warps are no
        // faster, and F64's 32 tiles need more registers than 16 warps have.) `MaxAutotune` times
        // one to six blocks an SM.
        let sms = g.sms as usize;
        let default = rows.min(sms * 2);
        let candidates = || [2, 1, 3, 4, 6].iter().map(|b| (b * sms).min(rows)).collect();
        let problem = (dtype, gdt, rows, n, stage, parts);
        let want = crate::cuda::tune::choice(g, ("layer_norm_grads", &problem), default, candidates, |b| {
            let part = CudaStorage::alloc(&g.mem, accumulator(dtype), b * rows_k * n)?;
            crate::cuda::tune::time_graph(g, || run(b, &part))
        });
        let part = CudaStorage::alloc(&g.mem, accumulator(dtype), want * rows_k * n)?;
        run(want, &part)?;
        Ok(out)
    }

    /// Layer norm's normalisation over the last dim, with its affine part when `affine` holds
    /// the weight and bias (or, with `grad`, the input gradient, the weight scaling `grad` when
    /// `affine` holds it).
    pub(crate) fn normalize(
        g: &Arc<Gpu>,
        x: (&CudaStorage, &Layout),
        grad: Option<(&CudaStorage, &Layout)>,
        affine: &[(&CudaStorage, &Layout)],
        (eps, rms, to): (f64, bool, Option<DType>),
    ) -> Result<CudaStorage> {
        let (dtype, backward) = (x.0.dtype, grad.is_some());
        let out = to.unwrap_or(dtype);
        let wb: Vec<Dense> = affine.iter().map(|(s, l)| dense(g, s, l)).collect::<Result<_>>()?;
        let extra = match &wb[..] {
            [w, b] => [w.ptr(), b.ptr()],
            [w] => [w.ptr(), 0],
            _ => [0, 0],
        };
        let has = extra[0] != 0;
        let n = x.1.shape[x.1.rank() - 1];
        // Rows that fit in registers as float4s take the one-trip kernel (F32 forward, with the
        // weight and bias or neither).
        let rows_kernel = !rms && dtype == DType::F32 && !backward && n.is_multiple_of(128) && n <= LN_ROWS_MAX_N && (extra[1] != 0) == has;
        row_pair(g, x, grad, (eps, extra), out, |block, aligned| {
            if rows_kernel && !block && aligned {
                return g.kernel(crate::cuda::gpu::spec_key("normalize_rows", &(n, has, out)), || normalize_rows_source(n / 128, has, out));
            }
            g.kernel(crate::cuda::gpu::spec_key("normalize", &(dtype, backward, has, block, out, rms)), || {
                normalize_source(NormKernel { dtype, backward, affine: has, rms }, block, out)
            })
        })
    }

    /// A softmax's (or log-softmax's) input gradient over the last dim, from its output `y` and
    /// the output's gradient.
    pub(crate) fn softmax_backward(
        g: &Arc<Gpu>,
        y: (&CudaStorage, &Layout),
        grad: (&CudaStorage, &Layout),
        log: bool,
        scale: f64,
    ) -> Result<CudaStorage> {
        let dtype = y.0.dtype;
        row_pair(g, y, Some(grad), (scale, [0, 0]), dtype, |block, _| {
            g.kernel(crate::cuda::gpu::spec_key("softmax_backward", &(dtype, log, block)), || softmax_backward_source(dtype, log, block))
        })
    }

    /// Mirrors `struct XArgs`.
    #[repr(C)]
    pub(crate) struct XArgs {
        rows: i64,
        red: i64,
        ignore: i64,
        code: i64,
        gst: i64,
        smoothing: f64,
        has_ignore: i32,
        pad: i32,
    }

    /// Cross-entropy per row of dense logits (`x`: logits, targets, and for the backward the
    /// per-row gradient, read through its stride): `[rows]` losses or the `[rows, C]` gradient.
    pub(crate) fn cross_entropy(g: &Arc<Gpu>, x: &[(&CudaStorage, &Layout)], ignore: Option<i64>, smoothing: f64) -> Result<CudaStorage> {
        let ((s, l), (st, lt)) = (x[0], x[1]);
        let (rows, n) = (l.shape[0], l.shape[1]);
        let backward = x.len() == 3;
        let loss = crate::op::cross_entropy_loss_dtype(s.dtype);
        let out = if backward { CudaStorage::alloc(&g.mem, s.dtype, rows * n)? } else { CudaStorage::alloc(&g.mem, loss, rows)? };
        if rows == 0 {
            return Ok(out);
        }
        if n == 0 {
            return Err(Error::shape("cross_entropy", format!("needs at least one class, got logits {:?}", l.shape)));
        }
        let (logits, targets) = (dense(g, s, l)?, dense(g, st, lt)?);
        let (block, grid, threads) = row_launch(rows, n);
        let k = g.kernel(crate::cuda::gpu::spec_key("cross_entropy", &(s.dtype, backward, block)), || {
            cross_entropy_source(s.dtype, backward, block)
        })?;
        let (mut pg, gst) =
            x.get(2).map_or((0, 0), |(sg, lg)| (sg.buf.ptr + (lg.offset * sg.dtype.size_in_bytes()) as u64, lg.strides[0] as i64));
        let mut a = XArgs::new(rows, n, ignore, smoothing, gst);
        let (mut o, mut px, mut pt, mut pe) = (out.buf.ptr, logits.ptr(), targets.ptr(), g.err);
        let mut params = kernel_params![o, px, pt, pg, pe, a];
        // SAFETY: (out, logits, targets, grad, err, XArgs) matches the generated signature; logits
        // are dense [rows, n], targets dense [rows]; the gradient (backward only; null and unread in
        // the forward) holds `rows` values at stride `gst` from its offset; `err` is the error word.
        unsafe { g.launch(k, grid, threads, 0, &mut params)? };
        Ok(out)
    }

    impl XArgs {
        pub(crate) fn new(rows: usize, n: usize, ignore: Option<i64>, smoothing: f64, gst: i64) -> XArgs {
            let (has_ignore, ignore) = (ignore.is_some() as i32, ignore.unwrap_or(0));
            XArgs { rows: rows as i64, red: n as i64, ignore, code: XENT_CODE, gst, smoothing, has_ignore, pad: 0 }
        }
    }

    /// `Fused::CrossEntropyMean`: the loss and the logits' gradient in one launch
    /// (`cross_entropy_mean_source`).
    pub(crate) fn cross_entropy_mean(
        g: &Arc<Gpu>,
        x: &[(&CudaStorage, &Layout)],
        ignore: Option<i64>,
        smoothing: f64,
    ) -> Result<CudaStorage> {
        let ((s, l), (st, lt)) = (x[0], x[1]);
        let (rows, n) = (l.shape[0], l.shape[1]);
        let parts = Parts::cross_entropy_mean(rows, n);
        let (out, grad_at) = (CudaStorage::alloc(&g.mem, s.dtype, parts.len())?, parts.offset(Part::Dx)?);
        if n == 0 && rows > 0 {
            return Err(Error::shape("cross_entropy_mean", format!("needs at least one class, got logits {:?}", l.shape)));
        }
        let (logits, targets) = (dense(g, s, l)?, dense(g, st, lt)?);
        let tpr = xent_mean_threads_per_row(n);
        let threads = XENT_MEAN_THREADS;
        let blocks = (rows * tpr).div_ceil(threads).max(1);
        if blocks > XENT_MEAN_BLOCKS {
            let most = XENT_MEAN_BLOCKS;
            return Err(Error::shape(
                "cross_entropy_mean",
                format!("logits {:?} need {blocks} blocks, more than the kernel's {most}", l.shape),
            ));
        }
        let k = g.kernel(crate::cuda::gpu::spec_key("cross_entropy_mean", &(s.dtype, tpr, grad_at)), || {
            cross_entropy_mean_source(s.dtype, tpr, grad_at)
        })?;
        let mut a = XArgs::new(rows, n, ignore, smoothing, 0);
        let (mut o, mut px, mut pt, mut pe) = (out.buf.ptr, logits.ptr(), targets.ptr(), g.err);
        let mut params = kernel_params![o, px, pt, pe, a];
        // SAFETY: (out, logits, targets, err, XArgs) matches the generated signature; logits are
        // dense [rows, n], targets dense [rows], `out` holds the loss and, from `grad_at`,
        // rows x n values; `err` is the error word. `blocks` covers the rows (a thread or a warp
        // each) and fits the module's partial sums.
        unsafe { g.launch(k, (blocks as u32, 1), threads as u32, 0, &mut params)? };
        Ok(out)
    }

    /// `RowArgs` (as softmax's backward and layer norm's C twins name its value) and `XArgs` against
    /// their C twins (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::layout_check;
        vec![
            layout_check!(softmax_backward_source(DType::F32, false, false).0, "SArgs", RowArgs, { rows => rows, red => red, value => scale }),
            layout_check!(normalize_source(NormKernel { dtype: DType::F32, backward: false, affine: false, rms: false }, false, DType::F32).0, "NArgs", RowArgs, {
                rows => rows, red => red, value => eps
            }),
            layout_check!(XENT_ARGS, "XArgs", XArgs, {
                rows => rows, red => red, ignore => ignore, code => code, gst => gst, smoothing => smoothing, has_ignore => has_ignore,
                pad => pad
            }),
        ]
    }
}
