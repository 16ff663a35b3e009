//! Kiln's f32 `exp`, `erf` and `tanh` (`kiln_tensor::math`) against the C library's f64 functions,
//! over their whole range, and their special values.

use kiln_tensor::math::{erf_f32, exp_f32, tanh_f32};

#[cfg_attr(unix, link(name = "m"))]
unsafe extern "C" {
    fn erf(x: f64) -> f64;
}

fn erf64(x: f64) -> f64 {
    // SAFETY: a pure C99 math function, defined for every input.
    unsafe { erf(x) }
}

/// The distance from `got` to the exact `want` in units of f32's spacing at `want`.
fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    let spacing = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
    (got as f64 - want).abs() / spacing
}

/// Every `step`-th f32 bit pattern between `lo` and `hi` (both positive and negative).
fn sweep(lo: f32, hi: f32, step: u32) -> impl Iterator<Item = f32> {
    (lo.to_bits()..hi.to_bits()).step_by(step as usize).flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
}

/// The largest error of `f` against `exact` over `xs`, in ulps, and where.
fn worst(f: fn(f32) -> f32, exact: fn(f64) -> f64, xs: impl Iterator<Item = f32>) -> (f64, f32) {
    xs.map(|x| (ulps(f(x), exact(x as f64)), x)).fold((0.0, 0.0), |w, e| if e.0 > w.0 { e } else { w })
}

#[test]
fn exp_is_within_one_ulp_of_the_exact_value() {
    let worst = worst(exp_f32, f64::exp, sweep(1e-8, 88.7, 97).filter(|&x| x > -87.3));
    assert!(worst.0 <= 1.0, "exp({}) is {} ulp off", worst.1, worst.0);
    // Subnormal results round once: within one subnormal spacing (2^-149).
    for x in [-87.5f32, -95.0, -100.0, -103.0] {
        let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
        assert!((got - want).abs() <= 1.5e-45, "exp({x}) = {got:e}, exact {want:e}");
        assert!(got > 0.0, "exp({x}) is a subnormal, not 0");
    }
}

#[test]
fn exp_special_values() {
    assert_eq!(exp_f32(0.0), 1.0);
    assert_eq!(exp_f32(-0.0), 1.0);
    assert_eq!(exp_f32(1.0), std::f32::consts::E);
    assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
    assert_eq!(exp_f32(89.0), f32::INFINITY);
    assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_f32(-110.0), 0.0);
    assert!(exp_f32(f32::NAN).is_nan());
    assert!(ulps(exp_f32(88.72), (88.72f32 as f64).exp()) <= 1.0, "exp near the overflow");
}

#[test]
fn erf_is_within_one_and_a_half_ulps_of_the_exact_value() {
    let worst = worst(erf_f32, erf64, sweep(1e-30, 10.0, 61));
    assert!(worst.0 <= 1.5, "erf({}) is {} ulp off", worst.1, worst.0);
}

/// Special values shared by `erf` and `tanh`: signed zeros kept, +-1 at the infinities and
/// from `one_at` on, NaN kept, and odd at `points`.
fn odd_and_saturating(f: fn(f32) -> f32, one_at: f32, points: &[f32]) {
    assert_eq!(f(0.0).to_bits(), 0.0f32.to_bits());
    assert_eq!(f(-0.0).to_bits(), (-0.0f32).to_bits());
    assert_eq!(f(f32::INFINITY), 1.0);
    assert_eq!(f(f32::NEG_INFINITY), -1.0);
    assert_eq!(f(one_at), 1.0);
    assert!(f(f32::NAN).is_nan());
    for &x in points {
        assert_eq!(f(-x), -f(x), "odd at {x}");
    }
}

#[test]
fn erf_special_values_and_symmetry() {
    odd_and_saturating(erf_f32, 4.0, &[1e-20, 0.3, 0.999, 1.0, 1.5, 3.9]);
    // 2/sqrt(pi) * x for tiny x.
    assert!(ulps(erf_f32(1e-20), 1e-20f32 as f64 * 2.0 / std::f64::consts::PI.sqrt()) <= 1.0);
}

#[test]
fn tanh_is_within_one_and_a_half_ulps_of_the_exact_value() {
    let worst = worst(tanh_f32, f64::tanh, sweep(1e-30, 12.0, 61));
    assert!(worst.0 <= 1.5, "tanh({}) is {} ulp off", worst.1, worst.0);
}

#[test]
fn tanh_special_values_and_symmetry() {
    odd_and_saturating(tanh_f32, 50.0, &[1e-20, 0.3, 0.6249999, 0.625, 2.0, 9.0]);
}
