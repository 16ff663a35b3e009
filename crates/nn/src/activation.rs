//! Activation modules (no parameters).

use crate::{Forward, Module};
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
