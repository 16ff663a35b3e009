//! Native CPU kernels for fusion groups, the way TorchInductor's C++ back end works: each
//! group becomes one C function (a flat loop over its elements, the members' per-op
//! expressions from the op table inlined, shapes and strides as literals), the system C
//! compiler builds them into a shared library, cached on disk by source hash, and
//! `libloading` opens it. The compiler auto-vectorises the dense loops, so a group such as an
//! AdamW update is one pass over memory with every intermediate in registers.
//!
//! Without a C compiler (or with `KILN_CPU_CODEGEN=0`) every group runs in the chunked
//! interpreter (`fused_exec`), and a warning says why once. `KILN_CC`, else `CC`, else `cc`
//! names the compiler. Flags keep IEEE results: no FMA contraction, no fast-math.

use crate::fusion::{rounds_to_f32, Group, Plan};
use crate::graph::{Graph, Kind};
use kiln_tensor::codegen::elementwise_expr;
use kiln_tensor::codegen::fnv1a;
use kiln_tensor::codegen::{strided_index, Numbers};
use kiln_tensor::{DType, Op};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// `f(start, end, outputs, inputs, ints, floats)`: elements `start..end` of one group. An
/// input that is read in place from an output buffer is passed as null and read through that
/// output. A size-generic function reads its sizes and scalars from `ints` and `floats`
/// (`Numbers`); a specialised one has them as literals and ignores both.
pub type GroupFn = unsafe extern "C" fn(i64, i64, *const *mut u8, *const *const u8, *const i64, *const f64);

/// A group's native function, the in-place reads it was generated for (`own[k]` is the
/// output that external `k` is read from; `None`: its own buffer) and the numbers it is called
/// with.
pub struct NativeGroup {
    pub f: GroupFn,
    pub own: Vec<Option<usize>>,
    pub nums: Numbers,
}

/// The loaded library of a program's groups, indexed like `Plan::groups`, and its source's hash.
pub struct NativeGroups {
    pub groups: Vec<Option<NativeGroup>>,
    pub key: u64,
    _lib: libloading::Library,
}

/// `-ffp-contract=off`: no FMA, so results match eager's bit for bit. `-fno-trapping-math`:
/// without it GCC 12 will not if-convert the selects of `kerf_f` and `ktanh_f`, and a group
/// holding them stays scalar (not vectorised, which slows the GPT's GELU gradient); it
/// only lets the compiler ignore floating-point exception flags, never changes a value.
const FLAGS: [&str; 7] = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"];

/// Helpers the op table's expressions call (`kexp`, `kdiv`, ...), for float and double; f32
/// `kexp_f`, `kerf_f` and `ktanh_f` come first, from `kiln_tensor::math` (see `prelude`).
const PRELUDE: &str = r#"#define F2(name, ef, ed) static inline float name##_f(float x) { return ef; } static inline double name##_d(double x) { return ed; }
static inline double kexp_d(double x) { return exp(x); }
static inline double kerf_d(double x) { return erf(x); }
F2(klog, logf(x), log(x)) F2(ksqrt, sqrtf(x), sqrt(x)) F2(krsqrt, 1.0f / sqrtf(x), 1.0 / sqrt(x))
static inline double ktanh_d(double x) { return tanh(x); }
F2(ksin, sinf(x), sin(x)) F2(kcos, cosf(x), cos(x))
F2(kabs, fabsf(x), fabs(x))
// The same association as the CPU's `UnaryOp::eval`, so results agree bit for bit.
static inline float ksilu_grad_f(float x) { float s = 1.0f / (1.0f + kexp_f(-x)); return s * (1.0f + x * (1.0f - s)); }
static inline double ksilu_grad_d(double x) { double s = 1.0 / (1.0 + exp(-x)); return s * (1.0 + x * (1.0 - s)); }
static inline float kgelu_tanh_grad_f(float x) {
  float c = (float)0.7978845608028654, t = ktanh_f(c * (x + (float)0.044715 * x * x * x));
  float dinner = c * (1.0f + (float)(3.0 * 0.044715) * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
}
static inline double kgelu_tanh_grad_d(double x) {
  double c = 0.7978845608028654, t = tanh(c * (x + 0.044715 * x * x * x));
  double dinner = c * (1.0 + (3.0 * 0.044715) * x * x);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner;
}
static inline float kpow_f(float a, float b) { return powf(a, b); }
static inline double kpow_d(double a, double b) { return pow(a, b); }
static inline float kdiv_f(float a, float b) { return a / b; }
static inline double kdiv_d(double a, double b) { return a / b; }
#define G1(name, x) _Generic((x), float: name##_f, default: name##_d)(x)
#define kexp(x) G1(kexp, x)
// The CUDA prelude's one-instruction exp for GELU's density: here the exact one, as eager's.
#define kexp_small(x) G1(kexp, x)
#define klog(x) G1(klog, x)
#define ksqrt(x) G1(ksqrt, x)
#define krsqrt(x) G1(krsqrt, x)
#define ksin(x) G1(ksin, x)
#define kcos(x) G1(kcos, x)
#define ktanh(x) G1(ktanh, x)
#define kerf(x) G1(kerf, x)
#define kabs(x) G1(kabs, x)
#define ksilu_grad(x) G1(ksilu_grad, x)
#define kgelu_tanh_grad(x) G1(kgelu_tanh_grad, x)
#define kpow(a, b) _Generic((a), float: kpow_f, default: kpow_d)(a, b)
#define kdiv(a, b) _Generic((a), float: kdiv_f, default: kdiv_d)(a, b)
#define K(v) ((C)(v))
"#;

/// The headers, Kiln's f32 `exp`/`erf`/`tanh` (the eager kernels' own, `kiln_tensor::math`), then
/// `PRELUDE`.
fn prelude() -> String {
    let head = "#include <math.h>\n#include <stdint.h>\n#include <string.h>\n";
    format!("{head}{}{}{}{PRELUDE}", kiln_tensor::math::exp_c(), kiln_tensor::math::erf_c(), kiln_tensor::math::tanh_c())
}

fn c_type(d: DType) -> Option<&'static str> {
    match d {
        DType::F32 => Some("float"),
        DType::F64 => Some("double"),
        DType::U8 => Some("unsigned char"),
        _ => None,
    }
}

/// An exact C double literal.
fn literal(v: f64) -> String {
    if v.is_nan() {
        "__builtin_nan(\"\")".into()
    } else if v.is_infinite() {
        if v > 0.0 { "__builtin_inf()" } else { "(-__builtin_inf())" }.into()
    } else {
        format!("{v:e}")
    }
}

/// The external reads that come from the group's own outputs: a state slot updated in place.
pub fn own_inputs(g: &Graph, gr: &Group) -> Vec<Option<usize>> {
    gr.externals
        .iter()
        .map(|a| match g.nodes[a.node].kind {
            Kind::State(s) => gr.inplace.iter().find(|x| x.1 == s).and_then(|x| gr.materialize.iter().position(|&m| m == x.0)),
            _ => None,
        })
        .collect()
}

/// The body of group `gr` as a C function named `name`, with its numbers (`Numbers`: literals,
/// or parameters when `generic`); None if an op or dtype has no C form.
fn group_source(g: &Graph, gr: &Group, name: &str, generic: bool) -> Option<(String, Numbers)> {
    let mut nums = Numbers::new(generic);
    let body = group_body(g, gr, &mut nums)?;
    let class = if gr.f64 { "double" } else { "float" };
    let mut s = format!(
        "void {name}(long long start, long long end, void* const* o, const void* const* p, const long long* z, const double* f) {{\n  typedef {class} C;\n  (void)z; (void)f;\n"
    );
    for k in 0..nums.ints.len() {
        s += &format!("  const long long z{k} = z[{k}];\n");
    }
    for k in 0..nums.floats.len() {
        s += &format!("  const double f{k} = f[{k}];\n");
    }
    Some((s + &body, nums))
}

/// `group_source`'s declarations and loops.
fn group_body(g: &Graph, gr: &Group, nums: &mut Numbers) -> Option<String> {
    let own = own_inputs(g, gr);
    let mut s = String::new();
    for (k, &m) in gr.materialize.iter().enumerate() {
        let t = c_type(g.nodes[m].dtype)?;
        s += &format!("  {t}* __restrict o{k} = ({t}*)o[{k}];\n");
    }
    for (k, a) in gr.externals.iter().enumerate() {
        if own[k].is_none() {
            let t = c_type(g.nodes[a.node].dtype)?;
            s += &format!("  const {t}* __restrict p{k} = (const {t}*)p[{k}];\n");
        }
    }
    // Loads: a dense input reads `p[off + i]`; a broadcast scalar is loaded once, before the
    // loops (a load that does not move with `i` inside the loop stops GCC vectorising it);
    // any other view walks rows of the last dim: its row base is computed once per row, then
    // the inner loop reads at a fixed stride (0 for a broadcast row, 1 for a dense one).
    let rank = gr.shape.len();
    let inner = gr.shape.last().copied().unwrap_or(1).max(1);
    let (mut row, mut body) = (String::new(), String::new());
    for (k, a) in gr.externals.iter().enumerate() {
        let strides = a.layout.broadcast_strides(&gr.shape);
        let load = match own[k] {
            // In place: the fusion plan only updates a state through its whole dense view.
            Some(o) if a.layout.offset == 0 && a.layout.is_contiguous() && a.layout.shape == gr.shape => format!("o{o}[i]"),
            Some(_) => return None,
            None if strides.iter().all(|&st| st == 0) => {
                s += &format!("  const C x{k} = (C)p{k}[{}];\n", nums.int(a.layout.offset, ""));
                continue;
            }
            None if a.layout.is_contiguous() && a.layout.shape == gr.shape => format!("p{k}[{} + i]", nums.int(a.layout.offset, "")),
            None if rank == 0 => return None,
            None => {
                let base = strided_index("r", a.layout.offset, &gr.shape[..rank - 1], &strides[..rank - 1], false, nums);
                row += &format!("    const long long b{k} = {base};\n");
                match strides[rank - 1] {
                    0 => {
                        row += &format!("    const C x{k} = (C)p{k}[b{k}];\n");
                        continue;
                    }
                    1 => format!("p{k}[b{k} + c]"),
                    st => format!("p{k}[b{k} + c * {}]", nums.int(st, "LL")),
                }
            }
        };
        body += &format!("    C x{k} = (C){load};\n");
    }
    if row.is_empty() {
        s += "  {\n  for (long long i = start; i < end; ++i) {\n";
    } else {
        let inner = nums.int(inner, "LL");
        s += &format!("  for (long long i = start; i < end;) {{\n    const long long r = i / {inner};\n");
        s += &format!("    const long long stop = end < (r + 1) * {inner} ? end : (r + 1) * {inner};\n{row}");
        s += &format!("    for (long long c = i - r * {inner}; i < stop; ++i, ++c) {{\n");
    }
    s += &body;
    for (q, &m) in gr.members.iter().enumerate() {
        let Kind::Op(op, args) = &g.nodes[m].kind else { return None };
        let dtypes: Vec<DType> = args.iter().map(|a| g.nodes[a.node].dtype).collect();
        let (_, expr, _) = elementwise_expr(op, &dtypes)?;
        let expr = if rounds_to_f32(op, gr.f64) { "(C)(float)v0".to_string() } else { expr };
        let scalar = match op {
            Op::Scalar { value, .. } => nums.float(*value, literal),
            _ => literal(0.0),
        };
        s += &format!("    C m{q};\n    {{\n      struct {{ double s; }} a = {{ {scalar} }}; (void)a;\n");
        for (v, arg) in args.iter().enumerate() {
            let src = match gr.members.iter().position(|&x| x == arg.node) {
                Some(j) => format!("m{j}"),
                None => format!("x{}", gr.externals.iter().position(|e| e == arg)?),
            };
            s += &format!("      C v{v} = {src};\n");
        }
        s += &format!("      m{q} = {expr};\n    }}\n");
    }
    for (k, &m) in gr.materialize.iter().enumerate() {
        let j = gr.members.iter().position(|&x| x == m)?;
        s += &match g.nodes[m].dtype {
            DType::U8 => format!("    o{k}[i] = (unsigned char)(m{j} != 0);\n"),
            d => format!("    o{k}[i] = ({})m{j};\n", c_type(d)?),
        };
    }
    s += "    }\n  }\n}\n";
    Some(s)
}

fn warn_once(msg: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| eprintln!("kiln compile: {msg}; CPU fusion groups run in the interpreter"));
}

fn compiler() -> String {
    std::env::var("KILN_CC").or_else(|_| std::env::var("CC")).unwrap_or_else(|_| "cc".into())
}

/// Whether native CPU kernels are wanted (`KILN_CPU_CODEGEN=0` turns them off).
pub fn enabled() -> bool {
    std::env::var("KILN_CPU_CODEGEN").map(|v| v != "0").unwrap_or(true)
}

/// The CPU the code is built for (`-march=native`), part of the cache key: the feature flags
/// and model from /proc/cpuinfo where there is one (a cache shared by two kinds of CPU must
/// not hand one the other's instructions), else the features Rust detects.
fn cpu_identity() -> String {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let pick = |key: &str| info.lines().find(|l| l.starts_with(key)).unwrap_or("").to_string();
        let mut id = format!("{} {} {}", std::env::consts::ARCH, pick("model name"), pick("flags"));
        id += &pick("Features"); // aarch64
        #[cfg(target_arch = "x86_64")]
        for (name, on) in
            [("avx2", std::arch::is_x86_feature_detected!("avx2")), ("avx512f", std::arch::is_x86_feature_detected!("avx512f"))]
        {
            id += &format!(" {name}={on}");
        }
        id
    })
    .clone()
}

/// Compiles `src` into `so` (unique temporary names, removed whatever happens).
fn compile_to(cc: &str, src: &str, c_path: &Path, so: &Path) -> Result<(), String> {
    std::fs::write(c_path, src).map_err(|e| format!("cannot write {}: {e}", c_path.display()))?;
    let out = std::process::Command::new(cc).args(FLAGS).arg("-o").arg(so).arg(c_path).arg("-lm").output();
    let _ = std::fs::remove_file(c_path);
    let out = out.map_err(|e| format!("cannot run the C compiler `{cc}`: {e}"))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(so);
        return Err(format!("`{cc}` failed: {}", String::from_utf8_lossy(&out.stderr).lines().take(20).collect::<Vec<_>>().join("\n")));
    }
    Ok(())
}

/// A library built from `src`, and whether it is a private temporary to delete once loaded.
/// With a cache folder (`kiln_tensor::cache_dir`) it is built there once, under its source
/// hash; without one (no HOME), in a fresh private folder, never a shared predictable path.
fn build_library(src: &str) -> Result<(PathBuf, bool), String> {
    let cc = compiler();
    let key = fnv1a(format!("{src}\n// {cc} {} {}", FLAGS.join(" "), cpu_identity()).as_bytes());
    // Temporaries unique to this process and build: concurrent builds (other processes, or
    // other threads compiling the same graph) never see or move a partial file.
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let unique = format!("kiln_{key:016x}.{}.{build}", std::process::id());
    let Some(dir) = kiln_tensor::cache_dir("cpu") else {
        let private = std::env::temp_dir().join(&unique);
        // `create_dir` fails if the path exists: nobody else's folder is used.
        std::fs::create_dir(&private).map_err(|e| format!("cannot create {}: {e}", private.display()))?;
        let so = private.join("kiln.so");
        compile_to(&cc, src, &private.join("kiln.c"), &so)?;
        return Ok((so, true));
    };
    let lib = dir.join(format!("kiln_{key:016x}.so"));
    if lib.exists() {
        return Ok((lib, false));
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let so_tmp = dir.join(format!("{unique}.so"));
    compile_to(&cc, src, &dir.join(format!("{unique}.c")), &so_tmp)?;
    std::fs::rename(&so_tmp, &lib).map_err(|e| {
        let _ = std::fs::remove_file(&so_tmp);
        format!("cannot move {} into the cache: {e}", so_tmp.display())
    })?;
    Ok((lib, false))
}

fn load(path: &Path, names: Vec<Option<(String, Numbers)>>, g: &Graph, plan: &Plan) -> Result<NativeGroups, String> {
    // SAFETY: the library is Kiln's own generated code, built just now or earlier from the
    // same source (the file name is the source's hash); it has no initialisers.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    let mut groups = Vec::with_capacity(names.len());
    for (gr, name) in plan.groups.iter().zip(names) {
        groups.push(match name {
            None => None,
            Some((n, nums)) => {
                // SAFETY: every function in the source has the `GroupFn` signature.
                let f: GroupFn = unsafe { *lib.get::<GroupFn>(n.as_bytes()).map_err(|e| format!("{n}: {e}"))? };
                Some(NativeGroup { f, own: own_inputs(g, gr), nums })
            }
        });
    }
    Ok(NativeGroups { groups, key: 0, _lib: lib })
}

/// Native functions for the plan's groups, or None (interpreter) when there are none, they
/// are turned off, or the compiler is missing or fails (warned once). With `generic`, each
/// function takes its sizes and scalars as parameters (a dynamic-shape program: one library
/// for every size).
pub fn build(g: &Graph, plan: &Plan, generic: bool) -> Option<NativeGroups> {
    if plan.groups.is_empty() || !enabled() {
        return None;
    }
    let mut src = prelude();
    let mut seen: Vec<u64> = Vec::new();
    let names: Vec<Option<(String, Numbers)>> = plan
        .groups
        .iter()
        .map(|gr| {
            if gr.members.is_empty() {
                return None; // a singleton the plan left to the plain kernel
            }
            // Identical groups (repeated layers) share one function, named by its body's hash.
            let (body, nums) = group_source(g, gr, "NAME", generic)?;
            let h = fnv1a(body.as_bytes());
            let name = format!("kiln_cpu_{h:016x}");
            if !seen.contains(&h) {
                seen.push(h);
                src += &body.replacen("NAME", &name, 1);
            }
            Some((name, nums))
        })
        .collect();
    kiln_tensor::log::log("kernels", &format!("generated C for {} CPU groups:\n{src}", seen.len()));
    let loaded = build_library(&src).and_then(|(path, temporary)| {
        let n = load(&path, names, g, plan);
        if temporary {
            // Loaded (or failed): the private folder is not needed any more.
            let _ = path.parent().map(std::fs::remove_dir_all);
        }
        n
    });
    match loaded {
        Ok(n) => Some(NativeGroups { key: fnv1a(src.as_bytes()), ..n }),
        Err(e) => {
            warn_once(&e);
            None
        }
    }
}
