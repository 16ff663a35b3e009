//! Reference models shared by the examples, tests and benches.

pub mod generate;
pub mod gpt;
pub mod llama;

pub use generate::{generate, CausalLm, GenerateConfig, Generation};
pub use gpt::{Gpt, GptConfig};
pub use llama::{Llama, LlamaConfig};

use kiln_nn::{BatchNorm, Conv2d, Flatten, Forward, Linear, Lstm, MaxPool2d, Module, Relu, RnnConfig, Sequential, Window};
use kiln_tensor::{Device, Error, Result, Tensor};

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

/// A small LeNet-style CNN for `rows x cols` grey images given as flat rows `[N, rows * cols]`:
/// two 3x3 convolutions (8 and 16 channels, padded) each with batch norm, ReLU and 2x2 max
/// pooling, then a linear layer to `classes`. Batch norm uses batch statistics in training
/// and its running ones after `eval()`.
pub fn cnn(rows: usize, cols: usize, classes: usize, device: Device) -> Result<Sequential> {
    let (conv, pool) = (Window::new((3, 3)).padding((1, 1)), Window::new((2, 2)).stride((2, 2)));
    Ok(Sequential::new()
        .add(Image { rows, cols, channel: true })
        .add(Conv2d::new(1, 8, conv, false, device)?)
        .add(BatchNorm::new(8, device)?)
        .add(Relu)
        .add(MaxPool2d(pool))
        .add(Conv2d::new(8, 16, conv, false, device)?)
        .add(BatchNorm::new(16, device)?)
        .add(Relu)
        .add(MaxPool2d(pool))
        .add(Flatten)
        .add(Linear::new(16 * (rows / 4) * (cols / 4), classes, true, device)?))
}

/// The classic sequence view of images: each image's `rows` rows read in order by a
/// batch-first LSTM of `hidden` units (`cols` inputs a step), its last output through a
/// linear layer to `classes`.
pub fn lstm_classifier(rows: usize, cols: usize, hidden: usize, classes: usize, device: Device) -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Image { rows, cols, channel: false })
        .add(Lstm::new(RnnConfig::new(cols, hidden).batch_first(true), device)?)
        .add(LastStep)
        .add(Linear::new(hidden, classes, true, device)?))
}

/// Flat image rows `[N, rows * cols]` viewed as `[N, 1, rows, cols]` (`channel`) or as a
/// sequence of rows `[N, rows, cols]`.
#[derive(Module)]
struct Image {
    rows: usize,
    cols: usize,
    channel: bool,
}

impl Forward for Image {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 2 || x.shape()[1] != self.rows * self.cols {
            return Err(Error::shape(
                "image model",
                format!("needs flat {}x{} images [N, {}], got {:?}", self.rows, self.cols, self.rows * self.cols, x.shape()),
            ));
        }
        if self.channel {
            x.reshape(&[x.shape()[0], 1, self.rows, self.cols])
        } else {
            x.reshape(&[x.shape()[0], self.rows, self.cols])
        }
    }
}

/// `[N, T, H]` to the last step's `[N, H]`.
#[derive(Module)]
struct LastStep;

impl Forward for LastStep {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match x.dim(1usize)? {
            0 => Err(Error::shape("last step", format!("an empty sequence {:?}", x.shape()))),
            t => x.narrow(1usize, t - 1, 1)?.squeeze(1usize),
        }
    }
}
