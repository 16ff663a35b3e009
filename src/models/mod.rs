//! Reference models shared by the examples, tests and benches.

pub mod gpt;

pub use gpt::{Gpt, GptConfig};

use kiln_nn::{Linear, Relu, Sequential};
use kiln_tensor::{Device, Result};

/// A ReLU MLP with the given layer sizes, e.g. `[784, 256, 10]`.
pub fn mlp(sizes: &[usize], device: Device) -> Result<Sequential> {
    let mut s = Sequential::new();
    for (i, w) in sizes.windows(2).enumerate() {
        s = s.add(Linear::new(w[0], w[1], true, device)?);
        if i + 2 < sizes.len() {
            s = s.add(Relu);
        }
    }
    Ok(s)
}
