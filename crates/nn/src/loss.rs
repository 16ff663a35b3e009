//! Losses, built from primitives (cross-entropy from one fused per-row primitive) so autograd
//! and the compiler see through them. No host reads: the count of non-ignored targets stays a
//! tensor.

use kiln_tensor::{DType, Error, Result, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    #[default]
    Mean,
    Sum,
    None,
}

#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyConfig {
    /// Targets equal to this contribute nothing (PyTorch's default is -100).
    pub ignore_index: Option<i64>,
    /// Mixes the one-hot target with the uniform distribution (0 = off).
    pub label_smoothing: f64,
    pub reduction: Reduction,
}

impl Default for CrossEntropyConfig {
    fn default() -> Self {
        CrossEntropyConfig { ignore_index: Some(-100), label_smoothing: 0.0, reduction: Reduction::Mean }
    }
}

/// Cross-entropy of `logits [N, C]` against class indices `targets [N]` (I64), mean over the
/// non-ignored rows.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_with(logits, targets, CrossEntropyConfig::default())
}

pub fn cross_entropy_with(logits: &Tensor, targets: &Tensor, cfg: CrossEntropyConfig) -> Result<Tensor> {
    check(logits, targets, "cross_entropy")?;
    // One fused kernel per row (forward and backward) instead of log-softmax, gather, masks
    // and their backward: ~6 kernels for the whole loss instead of ~20.
    let per_row = logits.cross_entropy_rows(targets, cfg.ignore_index, cfg.label_smoothing)?;
    match (cfg.reduction, cfg.ignore_index) {
        (Reduction::Mean, Some(ig)) => per_row.sum_all()?.div(&targets.ne_scalar(ig as f64)?.to_dtype(logits.dtype())?.sum_all()?),
        (Reduction::Mean, None) => per_row.sum_all()?.mul_scalar(1.0 / targets.shape()[0] as f64),
        (Reduction::Sum, _) => per_row.sum_all(),
        (Reduction::None, _) => Ok(per_row),
    }
}

/// Negative log-likelihood of log-probabilities `[N, C]`.
pub fn nll_loss(logp: &Tensor, targets: &Tensor, ignore_index: Option<i64>, reduction: Reduction) -> Result<Tensor> {
    check(logp, targets, "nll_loss")?;
    let (picked, valid) = pick(logp, targets, ignore_index)?;
    reduce(&picked.neg()?.mul(&valid)?, &valid, reduction)
}

pub fn mse_loss(pred: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    if pred.shape() != target.shape() {
        return Err(Error::shape("mse_loss", format!("prediction {:?} and target {:?} differ", pred.shape(), target.shape())));
    }
    let sq = pred.sub(target)?.square()?;
    match reduction {
        Reduction::Mean => sq.mean_all(),
        Reduction::Sum => sq.sum_all(),
        Reduction::None => Ok(sq),
    }
}

fn check(logits: &Tensor, targets: &Tensor, op: &'static str) -> Result<()> {
    if logits.rank() != 2 || targets.rank() != 1 || targets.shape()[0] != logits.shape()[0] {
        return Err(Error::shape(op, format!("expects input [N, C] and targets [N], got {:?} and {:?}", logits.shape(), targets.shape())));
    }
    if targets.dtype() != DType::I64 {
        return Err(Error::dtype(op, format!("targets must be I64 class indices, got {:?}", targets.dtype())));
    }
    Ok(())
}

/// `logp[i, targets[i]]` per row, and a float mask of the rows that count.
fn pick(logp: &Tensor, targets: &Tensor, ignore: Option<i64>) -> Result<(Tensor, Tensor)> {
    let (t, valid) = match ignore {
        Some(ig) => {
            let keep = targets.ne_scalar(ig as f64)?;
            let zero = Tensor::zeros(&[], DType::I64, targets.device())?;
            (Tensor::where_cond(&keep, targets, &zero)?, keep.to_dtype(logp.dtype())?)
        }
        None => (targets.clone(), Tensor::ones(targets.shape(), logp.dtype(), logp.device())?),
    };
    let picked = logp.gather(1, &t.unsqueeze(1)?)?.squeeze(1)?;
    Ok((picked, valid))
}

fn reduce(per_row: &Tensor, valid: &Tensor, reduction: Reduction) -> Result<Tensor> {
    match reduction {
        Reduction::Mean => per_row.sum_all()?.div(&valid.sum_all()?),
        Reduction::Sum => per_row.sum_all(),
        Reduction::None => Ok(per_row.clone()),
    }
}
