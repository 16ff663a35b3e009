//! Finite-difference gradient checking: the analytic gradient of `sum(f(x) * r)` for a fixed
//! random `r` against central differences, element by element, in f64.

use crate::engine::{backward, NoGradGuard};
use kiln_tensor::{DType, Device, Distribution, Error, Result, Tensor};

#[derive(Debug, Clone, Copy)]
pub struct GradcheckConfig {
    pub eps: f64,
    pub atol: f64,
    pub rtol: f64,
}

impl Default for GradcheckConfig {
    fn default() -> Self {
        GradcheckConfig { eps: 1e-6, atol: 1e-7, rtol: 1e-5 }
    }
}

/// Checks every input's gradient. Inputs must be F64 leaves; `f` may use them in any way
/// (views, broadcasting). Returns the largest absolute error seen.
pub fn gradcheck(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], cfg: GradcheckConfig) -> Result<f64> {
    for (i, x) in inputs.iter().enumerate() {
        if x.dtype() != DType::F64 {
            return Err(Error::dtype("gradcheck", format!("input {i} is {:?}; use F64", x.dtype())));
        }
    }
    // Fresh leaves even for inputs that are parameters (a copy of one would carry history).
    let leaves: Vec<Tensor> = inputs.iter().map(|x| x.detach().copy()).collect::<Result<_>>()?;
    for l in &leaves {
        l.set_requires_grad(true);
    }
    let y = f(&leaves)?;
    let r = Tensor::rand_at(y.shape(), Distribution::Normal, 1234, 0, DType::F64, Device::Cpu)?;
    backward(&y.mul(&r)?.sum_all()?)?;
    let scalar = |xs: &[Tensor]| -> Result<f64> { f(xs)?.mul(&r)?.sum_all()?.item() };
    let _guard = NoGradGuard::new();
    let mut worst = 0.0f64;
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = match leaf.grad() {
            Some(g) => g.to_vec::<f64>()?,
            None => vec![0.0; leaf.numel()],
        };
        let base = leaf.to_vec::<f64>()?;
        for j in 0..base.len() {
            let probe = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let mut xs = leaves.clone();
                xs[i] = Tensor::from_vec(v, leaf.shape(), Device::Cpu)?;
                scalar(&xs)
            };
            let numeric = (probe(cfg.eps)? - probe(-cfg.eps)?) / (2.0 * cfg.eps);
            let err = (numeric - analytic[j]).abs();
            worst = worst.max(err);
            // A NaN on either side fails too.
            if err.is_nan() || err > cfg.atol + cfg.rtol * numeric.abs() {
                return Err(Error::Msg(format!(
                    "gradcheck: input {i} (shape {:?}) element {j}: analytic {} vs numeric {numeric} (error {err:e})",
                    leaf.shape(),
                    analytic[j]
                )));
            }
        }
    }
    Ok(worst)
}
