//! `exp`, `erf` and `tanh` for f32 without branches or library calls, so that a loop over
//! them vectorises (the C library's `expf`/`erff`/`tanhf` are scalar calls, and GELU spent
//! most of its time in them). Every CPU kernel computes f32 `exp`/`erf`/`tanh` here;
//! kiln-compile's generated C (`cpu_codegen`) writes the same operations in the same order
//! from `exp_c`, `erf_c` and `tanh_c`, with these coefficients, so eager and compiled results
//! agree bit for bit. Accuracy against the exact functions: `exp` within 1 ulp, `erf` and
//! `tanh` within 1.3 ulp (coefficients fitted by least squares on Chebyshev nodes; checked in
//! `tests/math.rs`). f64 keeps the C library's functions.

/// `e^r = 1 + r + r^2 * P(r)` for `|r| <= ln(2) / 2`.
pub const EXP_POLY: [f32; 6] = [0.5, 0.16666667, 0.041666467, 0.008333298, 0.0013933646, 0.00019899276];
/// `erf(x) = x + x * P(x^2)` for `|x| < 1`.
pub const ERF_SMALL: [f32; 7] = [0.12837917, -0.3761263, 0.11283612, -0.026854808, 0.005190053, -0.00080243516, 0.00007898202];
/// `erfc(x) = e^(-x^2) * w * P(w)`, `w = 1 / x`, for `1 <= x < 4` (`erf` rounds to 1 beyond).
pub const ERF_TAIL: [f32; 9] =
    [0.5639978, 0.002848367, -0.2965422, 0.008631646, 0.6395583, -1.0073054, 0.78326315, -0.32363513, 0.05676704];

/// `tanh(x) = x + x * x^2 * P(x^2)` for `|x| < 0.625`.
pub const TANH_SMALL: [f32; 6] = [-0.3333333, 0.13333212, -0.053947464, 0.021704039, -0.008184744, 0.002149053];

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two: `k * LN2_HI` is exact for the `k` that occur (|k| <= 150).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding 1.5 * 2^23 rounds a float below 2^22 to an integer (to nearest, ties to even).
const ROUND: f32 = 12_582_912.0;

#[inline(always)]
fn horner(c: &[f32], t: f32) -> f32 {
    let mut acc = c[c.len() - 1];
    for &v in c[..c.len() - 1].iter().rev() {
        acc = acc * t + v;
    }
    acc
}

/// `e^x`. Inputs are clamped to [-104, 89] (the results there are already 0 and inf); the
/// power of two is applied in two halves so that subnormal results round once.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // NaN stays NaN (as the C form's comparisons keep it).
    let xc = x.clamp(-104.0, 89.0);
    let t = xc * LOG2E + ROUND;
    let k = t - ROUND;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 + (r + r * r * horner(&EXP_POLY, r));
    let ki = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let k1 = ki >> 1;
    let k2 = ki.wrapping_sub(k1);
    let s1 = f32::from_bits((k1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((k2.wrapping_add(127) as u32) << 23);
    p * s1 * s2
}

/// `erf(x)`: a polynomial below 1, `1 - erfc` from 1 to 4, and 1 beyond; NaN stays NaN.
#[inline(always)]
pub fn erf_f32(x: f32) -> f32 {
    let a = x.abs();
    let u = a * a;
    let small = a + a * horner(&ERF_SMALL, u);
    let w = 1.0 / if a > 1.0 { a } else { 1.0 };
    let big = 1.0 - exp_f32(-u) * (w * horner(&ERF_TAIL, w));
    let tail = if a < 4.0 { big } else { 1.0 };
    let r = if a < 1.0 { small } else { tail };
    if x.is_nan() {
        x
    } else {
        r.copysign(x)
    }
}

/// `tanh(x)`: a polynomial below 0.625, `1 - 2 / (e^(2|x|) + 1)` beyond (1 once `e^(2|x|)`
/// overflows); NaN stays NaN.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let u = a * a;
    let small = a + a * (u * horner(&TANH_SMALL, u));
    let big = 1.0 - 2.0 / (exp_f32(a + a) + 1.0);
    let r = if a < 0.625 { small } else { big };
    if x.is_nan() {
        x
    } else {
        r.copysign(x)
    }
}

/// `horner` as a C expression of `t` (the same association).
fn horner_c(c: &[f32], t: &str) -> String {
    let mut acc = format!("{:e}f", c[c.len() - 1]);
    for &v in c[..c.len() - 1].iter().rev() {
        acc = format!("({acc} * {t} + {v:e}f)");
    }
    acc
}

/// `exp_f32` as a C function `kexp_f` (for generated CPU code; needs `<stdint.h>`, `<string.h>`).
pub fn exp_c() -> String {
    format!(
        "static inline float kexp_f(float x) {{\n  float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);\n  \
         float t = xc * {LOG2E:e}f + {ROUND:e}f;\n  float k = t - {ROUND:e}f;\n  float r = (xc - k * {LN2_HI:e}f) - k * {LN2_LO:e}f;\n  \
         float p = 1.0f + (r + r * r * {poly});\n  uint32_t tb; memcpy(&tb, &t, 4);\n  int32_t ki = (int32_t)(tb - {round_bits}u);\n  \
         int32_t k1 = ki >> 1, k2 = (int32_t)((uint32_t)ki - (uint32_t)k1);\n  uint32_t b1 = ((uint32_t)k1 + 127u) << 23, b2 = ((uint32_t)k2 + 127u) << 23;\n  \
         float s1, s2; memcpy(&s1, &b1, 4); memcpy(&s2, &b2, 4);\n  return p * s1 * s2;\n}}\n",
        poly = horner_c(&EXP_POLY, "r"),
        round_bits = ROUND.to_bits(),
    )
}

/// `erf_f32` as a C function `kerf_f` (after `exp_c`).
pub fn erf_c() -> String {
    format!(
        "static inline float kerf_f(float x) {{\n  float a = fabsf(x), u = a * a;\n  float small = a + a * {small};\n  \
         float w = 1.0f / (a > 1.0f ? a : 1.0f);\n  float big = 1.0f - kexp_f(-u) * (w * {tail});\n  \
         float tl = a < 4.0f ? big : 1.0f;\n  float r = a < 1.0f ? small : tl;\n  return x != x ? x : copysignf(r, x);\n}}\n",
        small = horner_c(&ERF_SMALL, "u"),
        tail = horner_c(&ERF_TAIL, "w"),
    )
}

/// `tanh_f32` as a C function `ktanh_f` (after `exp_c`).
pub fn tanh_c() -> String {
    format!(
        "static inline float ktanh_f(float x) {{\n  float a = fabsf(x), u = a * a;\n  float small = a + a * (u * {small});\n  \
         float big = 1.0f - 2.0f / (kexp_f(a + a) + 1.0f);\n  float r = a < 0.625f ? small : big;\n  \
         return x != x ? x : copysignf(r, x);\n}}\n",
        small = horner_c(&TANH_SMALL, "u"),
    )
}
