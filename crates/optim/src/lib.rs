//! kiln-optim: PyTorch's optimizers (`SGD`, `Adam`, `AdamW`, `RmsProp`, `Adagrad`, and `Lion`), learning-rate
//! schedulers, gradient clipping, F16's dynamic loss scaling (`GradScaler`) and optimizer
//! checkpoints, with `torch.optim`'s semantics.
//!
//! Built so `kiln-compile` can trace a whole optimizer step and replay it:
//! - every update is an in-place tensor op run under `no_grad`, so parameters, gradients and
//!   state buffers keep their storage from step to step;
//! - the step count and the learning rate are 0-dim tensors that the math reads, so a traced
//!   step does not bake them in as constants (a scheduler changes them in place);
//! - gradient clipping stays on the device (no host read of the norm).

mod adagrad;
mod adam;
mod clip;
mod common;
mod optimizer;
mod rmsprop;
mod scaler;
mod scheduler;
mod sgd;
mod state;

pub use adagrad::{Adagrad, AdagradConfig, Lion, LionConfig};
pub use adam::{split_for_weight_decay, Adam, AdamConfig, AdamW};
pub use clip::{clip_coefficient, clip_grad_norm, clip_grad_value};
pub use optimizer::Optimizer;
pub use rmsprop::{RmsProp, RmsPropConfig};
pub use scaler::{GradScaler, GradScalerConfig};
pub use scheduler::{
    CosineAnnealingLR, CosineAnnealingWarmRestarts, ExponentialLR, LambdaLR, LinearLR, LrScheduler, MultiStepLR, OneCycleLR, PlateauMode,
    PolynomialLR, ReduceLROnPlateau, StepLR, WarmupCosine,
};
pub use sgd::{SgdConfig, SGD};
pub use state::{load_state, save_state};
