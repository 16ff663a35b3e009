//! What every CPU kernel file shares: when to use the other cores, AVX2 code generation,
//! subnormal flushing, and a kernel's result type.

use crate::storage::{CpuStorage, IntoCpuStorage};
use crate::Element;
use rayon::prelude::*;

/// Below this many elements a kernel stays on the calling thread.
/// NOTE: waking rayon's workers is costly on a 2-core machine; below about
/// 128K elements one thread finishes first.
pub const PAR_THRESHOLD: usize = 1 << 17;

/// Runs `f(start, chunk)` over chunks of `out`, in parallel when `out` is large.
pub fn par_chunks<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    let n = out.len();
    if n < PAR_THRESHOLD {
        f(0, out);
        return;
    }
    let chunk = n.div_ceil(rayon::current_num_threads() * 4).max(PAR_THRESHOLD / 4);
    out.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i * chunk, c));
}

/// Runs `f` compiled for AVX-512 or AVX2 where the CPU has it (x86-64's baseline is SSE2):
/// loops over f32 `exp`/`erf` (`math.rs`, branch-free) then run 16 or 8 lanes at a time. The
/// results are the same bits either way (IEEE operations, never contracted into FMAs).
#[inline(always)]
pub fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            #[target_feature(enable = "avx512f")]
            fn avx512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU has AVX-512F (checked just above), the only requirement of `avx512`.
            return unsafe { avx512(f) };
        }
        if std::is_x86_feature_detected!("avx2") {
            #[target_feature(enable = "avx2")]
            fn avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU has AVX2 (checked just above), the only requirement of `avx2`.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Flushes subnormal floats to zero in CPU arithmetic (results and inputs: x86's FTZ and DAZ
/// bits), on the calling thread and every rayon worker, as `torch.set_flush_denormal` does.
/// Training that drives gradients or Adam's second moment towards zero makes subnormals,
/// and each costs a microcode assist of ~100 cycles, which slows a long run of 32-sample MLP
/// steps markedly (BENCHMARKS.md). Returns whether the CPU supports it (false: nothing set).
pub fn set_flush_denormal(on: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        #[allow(deprecated)]
        fn set(on: bool) {
            use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
            const FTZ_DAZ: u32 = 0x8040;
            // SAFETY: MXCSR is this thread's SSE control register; FTZ and DAZ change only how
            // subnormals round, no memory is touched. SSE is part of x86_64.
            unsafe { _mm_setcsr(if on { _mm_getcsr() | FTZ_DAZ } else { _mm_getcsr() & !FTZ_DAZ }) }
        }
        set(on);
        rayon::broadcast(|_| set(on));
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = on;
        false
    }
}

/// A kernel's result: the input dtype, a U8 mask or I64 indices.
pub enum Out<T> {
    Same(Vec<T>),
    Mask(Vec<u8>),
    Index(Vec<i64>),
}

impl<T: Element> Out<T>
where
    Vec<T>: IntoCpuStorage,
{
    pub(crate) fn into_storage(self) -> CpuStorage {
        match self {
            Out::Same(v) => v.into_storage(),
            Out::Mask(v) => CpuStorage::U8(v),
            Out::Index(v) => CpuStorage::I64(v),
        }
    }
}
