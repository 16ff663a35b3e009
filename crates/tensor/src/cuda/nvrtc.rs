//! NVRTC: CUDA C++ source to a CUBIN for one architecture, cached on disk by source hash,
//! architecture and NVRTC version (a CUBIN loads quickly; PTX would cost a driver JIT).

use crate::codegen::fnv1a;
use crate::{Error, Result};
use cudarc::nvrtc::{result as nr, sys as ns};
use std::ffi::CString;
use std::path::PathBuf;

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise); it then stays
/// loaded (`library::held_open`).
pub fn available() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| super::library::held_open(&cudarc::get_lib_name_candidates("nvrtc")))
}

fn version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { ns::nvrtcVersion(&mut a, &mut b) };
    (a, b)
}

/// Where CUBINs are kept: the `cubin` folder of `kiln_tensor::cache_dir`.
pub fn cache_dir() -> Option<PathBuf> {
    crate::cache::cache_dir("cubin")
}

/// The NVRTC target for `src` on a GPU of compute capability `cc`: `sm_90`, or `sm_90a` for a
/// source that starts with `kernels::prelude::ARCH_SPECIFIC` (`wgmma` exists only there).
pub fn target(src: &str, cc: (i32, i32)) -> String {
    let suffix = if src.starts_with(super::kernels::prelude::ARCH_SPECIFIC) { "a" } else { "" };
    format!("sm_{}{}{suffix}", cc.0, cc.1)
}

/// The CUBIN for `src` and `arch` (e.g. "sm_90"), from the disk cache or freshly compiled
/// (and then cached).
pub fn cubin(src: &str, name: &str, arch: &str) -> Result<Vec<u8>> {
    if !available() {
        return Err(Error::Cuda("NVRTC (libnvrtc.so) not found; it compiles Kiln's CUDA kernels".into()));
    }
    let (va, vb) = version();
    let key = fnv1a(format!("{src}\n// {arch} nvrtc {va}.{vb}").as_bytes());
    let path = cache_dir().map(|d| d.join(format!("{name}-{key:016x}-{arch}.cubin")));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(bytes);
    }
    let start = std::time::Instant::now();
    let bin = compile(src, name, arch, true)?;
    if crate::log::enabled("nvrtc") {
        eprintln!("[kiln nvrtc] {name} for {arch}: {:.0} ms", start.elapsed().as_secs_f64() * 1e3);
    }
    if let Some(p) = path {
        crate::cache::cache_put(&p, &bin);
    }
    Ok(bin)
}

/// `cubin` for several sources (source, name) at once on up to one thread a core (NVRTC
/// compiles independent programs concurrently; the longest sources start first), for a GPU of
/// compute capability `cc`; the results in order.
pub fn cubins(jobs: &[(String, String)], cc: (i32, i32)) -> Vec<Result<Vec<u8>>> {
    if let [(src, name)] = jobs {
        return vec![cubin(src, name, &target(src, cc))];
    }
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].0.len()));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<Vec<u8>>>>> = jobs.iter().map(|_| Default::default()).collect();
    let work = || {
        while let Some(&i) = order.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            let (src, name) = &jobs[i];
            *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(cubin(src, name, &target(src, cc)));
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        // A thread that cannot be started leaves its share to the others (and to this one).
        for _ in 1..cores.min(jobs.len()) {
            let _ = std::thread::Builder::new().spawn_scoped(scope, work);
        }
        work();
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| Err(Error::Msg("NVRTC thread panicked".into()))))
        .collect()
}

/// Compiles `src` for `arch` (e.g. "sm_90"): a CUBIN when `binary`, else PTX text bytes.
/// Errors carry NVRTC's log.
pub fn compile(src: &str, name: &str, arch: &str, binary: bool) -> Result<Vec<u8>> {
    compile_with(src, name, arch, binary, &[]).map(|(out, _)| out)
}

/// What a compiled kernel holds per thread (ptxas's report, for a real `sm_XX` arch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_bytes: u32,
}

/// The registers and spills of `src`'s one kernel for `arch`, from ptxas's verbose report: a
/// check on the register budget of a kernel that no GPU is needed for.
pub fn resources(src: &str, name: &str, arch: &str) -> Result<Resources> {
    let (_, log) = compile_with(src, name, arch, true, &["--ptxas-options=-v".to_string()])?;
    let number_before = |what: &str| -> Option<u32> {
        let at = log.find(what)?;
        log[..at].split_whitespace().last()?.parse().ok()
    };
    match (number_before(" registers"), number_before(" bytes spill stores")) {
        (Some(registers), Some(spill_bytes)) => Ok(Resources { registers, spill_bytes }),
        _ => Err(Error::Cuda(format!("ptxas gave no register report for {name}:\n{log}"))),
    }
}

/// `compile` with more NVRTC options; also hands back the program's log.
fn compile_with(src: &str, name: &str, arch: &str, binary: bool, more: &[String]) -> Result<(Vec<u8>, String)> {
    let csrc = CString::new(src).map_err(|_| Error::Msg("kernel source has a NUL".into()))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| Error::Msg("kernel name has a NUL".into()))?;
    let prog = nr::create_program(&csrc, Some(&cname)).map_err(|e| Error::Cuda(format!("nvrtc create_program: {e:?}")))?;
    let opts: Vec<String> =
        [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()].into_iter().chain(more.iter().cloned()).collect();
    // SAFETY: `prog` is live until destroy_program below.
    let compiled = unsafe { nr::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { nr::get_program_log(prog) }.map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>()).unwrap_or_default();
    let out = match compiled {
        Err(e) => Err(Error::Cuda(format!("nvrtc could not compile {name} for {arch}: {e:?}\n{log}"))),
        Ok(()) if binary => {
            let mut size = 0usize;
            // SAFETY: as above; `buf` is sized from NVRTC's own answer. No early return: the
            // program is destroyed below whatever happens here.
            unsafe {
                ns::nvrtcGetCUBINSize(prog, &mut size).result().and_then(|()| {
                    let mut buf = vec![0u8; size];
                    ns::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _).result().map(|()| buf)
                })
            }
            .map_err(|e| Error::Cuda(format!("nvrtc could not hand back the CUBIN of {name}: {e:?}")))
        }
        Ok(()) => {
            // SAFETY: as above.
            let ptx = unsafe { nr::get_ptx(prog) }.map_err(|e| Error::Cuda(format!("nvrtc get_ptx: {e:?}")))?;
            Ok(ptx.iter().map(|&c| c as u8).collect())
        }
    };
    // SAFETY: `prog` was created above and is not used after this.
    let _ = unsafe { nr::destroy_program(prog) };
    out.map(|o| (o, log))
}
