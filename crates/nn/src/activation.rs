//! Activation modules (no parameters).

use crate::module::{Forward, Module};
use kiln_tensor::{Result, Tensor};

macro_rules! activation {
    ($name:ident, $method:ident, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $name;
        impl Forward for $name {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                x.$method()
            }
        }
        impl Module for $name {
            fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
        }
    };
}
activation!(Relu, relu, "max(x, 0)");
activation!(Gelu, gelu, "GELU, exact erf form (nn.GELU's default)");
activation!(Silu, silu, "x sigmoid(x)");
activation!(Tanh, tanh, "tanh(x)");
activation!(Sigmoid, sigmoid, "1 / (1 + exp(-x))");

/// `x` where positive, `negative_slope x` elsewhere (`nn.LeakyReLU`, default slope 0.01).
#[derive(Debug, Clone, Copy)]
pub struct LeakyRelu {
    pub negative_slope: f64,
}

impl Default for LeakyRelu {
    fn default() -> Self {
        LeakyRelu { negative_slope: 0.01 }
    }
}

/// Leaky ReLU as a function (the gradient at 0 is the slope's, as PyTorch's).
pub fn leaky_relu(x: &Tensor, negative_slope: f64) -> Result<Tensor> {
    Tensor::where_cond(&x.gt_scalar(0.0)?, x, &x.mul_scalar(negative_slope)?)
}

impl Forward for LeakyRelu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        leaky_relu(x, self.negative_slope)
    }
}

impl Module for LeakyRelu {
    fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
}

/// An activation chosen at run time (Transformer layers take one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    #[default]
    Relu,
    Gelu,
    GeluTanh,
    Silu,
}

impl Activation {
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Silu => x.silu(),
        }
    }
}
