//! Counter-based random numbers (Philox 4x32-10, as in cuRAND and PyTorch's CUDA generator).
//!
//! Element `i` of a draw at `(seed, offset)` depends only on `seed` and `offset + i`, so the same
//! numbers come out on any device, in any order, and inside a compiled graph where the offset is
//! device state.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4x32 with 10 rounds: four 32-bit outputs for one 128-bit counter and a 64-bit key.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The `i`-th uniform value in [0, 1) of the stream `(seed, offset)`, with 24 random bits
/// (exactly representable in f32).
pub fn uniform_at(seed: u64, offset: u64, i: u64) -> f32 {
    let n = offset + i;
    let block = philox4x32([(n / 4) as u32, ((n / 4) >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
    (block[(n % 4) as usize] >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The `i`-th standard normal value of `(seed, offset)`: Box-Muller on the pair (2j, 2j+1).
pub fn normal_at(seed: u64, offset: u64, i: u64) -> f32 {
    let j = i & !1;
    let u1 = 1.0 - uniform_at(seed, offset, j); // (0, 1]: log is finite
    let u2 = uniform_at(seed, offset, j + 1);
    let r = (-2.0 * (u1 as f64).ln()).sqrt();
    let theta = 2.0 * std::f64::consts::PI * u2 as f64;
    (if i & 1 == 0 { r * theta.cos() } else { r * theta.sin() }) as f32
}

/// Seed and offset of the default generator. Every draw takes `numel` values (rounded up to
/// a multiple of 4) and advances the offset by that much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneratorState {
    pub seed: u64,
    pub offset: u64,
}

// NOTE: one default generator per thread, so a data-loading thread (or another test) never
// shifts the training thread's stream; `manual_seed` seeds the calling thread's generator.
thread_local! {
    static DEFAULT: std::cell::Cell<GeneratorState> = const { std::cell::Cell::new(GeneratorState { seed: 0x5EED, offset: 0 }) };
}

/// Reseeds this thread's default generator (like `torch.manual_seed`).
pub fn manual_seed(seed: u64) {
    set_state(GeneratorState { seed, offset: 0 });
}

pub fn state() -> GeneratorState {
    DEFAULT.with(|g| g.get())
}

pub fn set_state(s: GeneratorState) {
    DEFAULT.with(|g| g.set(s));
}

/// Reserves `n` values from this thread's default generator; returns `(seed, offset)`.
pub fn reserve(n: usize) -> (u64, u64) {
    let g = state();
    set_state(GeneratorState { seed: g.seed, offset: g.offset + (n as u64).div_ceil(4) * 4 });
    (g.seed, g.offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_random123_known_answer() {
        // Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32_10).
        assert_eq!(philox4x32([0, 0, 0, 0], [0, 0]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32([0xffffffff; 4], [0xffffffff; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
    }

    #[test]
    fn uniform_and_normal_have_the_right_moments() {
        let n = 100_000;
        let u: Vec<f64> = (0..n).map(|i| uniform_at(7, 0, i) as f64).collect();
        let mean = u.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let z: Vec<f64> = (0..n).map(|i| normal_at(7, 0, i) as f64).collect();
        let m = z.iter().sum::<f64>() / n as f64;
        let v = z.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n as f64;
        assert!(m.abs() < 0.02 && (v - 1.0).abs() < 0.02, "mean {m} var {v}");
    }
}
