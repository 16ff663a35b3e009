//! `set_flush_denormal` (its own test binary: it changes the FP mode of rayon's workers).

use kiln_tensor::{set_flush_denormal, DType, Device, Result, Tensor};

/// 1e-20 squared is 1e-40, below f32's smallest normal (1.18e-38): a subnormal, or zero when
/// flushed. Checked on the calling thread (a small op) and on rayon's workers (a large one).
#[test]
fn flush_denormal_turns_subnormal_results_into_zeros_and_back() -> Result<()> {
    let squares = |n: usize| -> Result<Vec<f32>> {
        let x = Tensor::full(1e-20, &[n], DType::F32, Device::Cpu)?;
        x.mul(&x)?.to_vec::<f32>()
    };
    let subnormal = 1e-20f32 * 1e-20f32;
    assert!(subnormal > 0.0 && !subnormal.is_normal(), "the test's premise: {subnormal:e} is subnormal");
    for n in [8usize, 1 << 20] {
        assert!(squares(n)?.iter().all(|&v| v == subnormal), "n = {n}: IEEE by default");
    }
    if !set_flush_denormal(true) {
        eprintln!("SKIPPED: this CPU has no flush-to-zero control Kiln sets");
        return Ok(());
    }
    for n in [8usize, 1 << 20] {
        assert!(squares(n)?.iter().all(|&v| v == 0.0), "n = {n}: flushed to zero");
    }
    assert!(set_flush_denormal(false));
    for n in [8usize, 1 << 20] {
        assert!(squares(n)?.iter().all(|&v| v == subnormal), "n = {n}: IEEE again");
    }
    Ok(())
}
