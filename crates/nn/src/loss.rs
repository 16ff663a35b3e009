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
        (Reduction::Mean, Some(ig)) => per_row.sum_all()?.div(&targets.ne_scalar(ig as f64)?.to_dtype(per_row.dtype())?.sum_all()?),
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

/// Mean squared error between same-shaped tensors (`nn.MSELoss`).
pub fn mse_loss(pred: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    same_shape("mse_loss", pred, target)?;
    elementwise(pred.sub(target)?.square()?, reduction)
}

/// Mean absolute error (`nn.L1Loss`).
pub fn l1_loss(pred: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    same_shape("l1_loss", pred, target)?;
    elementwise(pred.sub(target)?.abs()?, reduction)
}

/// `nn.HuberLoss`: `0.5 d²` where `|d| < delta`, else `delta (|d| - 0.5 delta)`.
pub fn huber_loss(pred: &Tensor, target: &Tensor, delta: f64, reduction: Reduction) -> Result<Tensor> {
    elementwise(piecewise_quadratic("huber_loss", "delta", pred, target, delta)?.mul_scalar(delta)?, reduction)
}

/// `nn.SmoothL1Loss`: `0.5 d² / beta` where `|d| < beta`, else `|d| - 0.5 beta` (Huber / beta);
/// `beta = 0` is the L1 loss.
pub fn smooth_l1_loss(pred: &Tensor, target: &Tensor, beta: f64, reduction: Reduction) -> Result<Tensor> {
    if beta == 0.0 {
        return l1_loss(pred, target, reduction);
    }
    elementwise(piecewise_quadratic("smooth_l1_loss", "beta", pred, target, beta)?, reduction)
}

/// `0.5 d² / k` where `|d| < k`, else `|d| - 0.5 k`, per element (`k` named `what`).
fn piecewise_quadratic(op: &'static str, what: &str, pred: &Tensor, target: &Tensor, k: f64) -> Result<Tensor> {
    same_shape(op, pred, target)?;
    if !(k > 0.0 && k.is_finite()) {
        return Err(Error::Msg(format!("{op}: {what} must be positive and finite, got {k}")));
    }
    let d = pred.sub(target)?;
    let a = d.abs()?;
    let quadratic = d.square()?.mul_scalar(0.5 / k)?;
    Tensor::where_cond(&a.lt_scalar(k)?, &quadratic, &a.sub_scalar(0.5 * k)?)
}

/// `nn.BCEWithLogitsLoss`: binary cross-entropy of `sigmoid(logits)` against targets in
/// [0, 1], in the stable form `(1 - y) x + w (log(1 + exp(-|x|)) + max(-x, 0))` with
/// `w = 1 + (pos_weight - 1) y` (`w = 1` without `pos_weight`, which broadcasts over the
/// last dim as PyTorch's does).
pub fn binary_cross_entropy_with_logits(
    logits: &Tensor,
    target: &Tensor,
    pos_weight: Option<&Tensor>,
    reduction: Reduction,
) -> Result<Tensor> {
    same_shape("binary_cross_entropy_with_logits", logits, target)?;
    // log(1 + e^-x) = log(1 + e^-|x|) + max(-x, 0), with both parts chosen by one `x > 0` mask
    // (not abs and relu, whose zero derivative at 0 would give a wrong gradient at x = 0).
    let (pos, neg) = (logits.gt_scalar(0.0)?, logits.neg()?);
    let minus_abs = Tensor::where_cond(&pos, &neg, logits)?;
    let softplus_neg = minus_abs.exp()?.add_scalar(1.0)?.log()?.add(&Tensor::where_cond(&pos, &logits.zeros_like()?, &neg)?)?;
    let rest = target.rsub_scalar(1.0)?.mul(logits)?;
    let per = match pos_weight {
        None => rest.add(&softplus_neg)?,
        Some(pw) => {
            let w = pw.sub_scalar(1.0)?.mul(target)?.add_scalar(1.0)?;
            rest.add(&w.mul(&softplus_neg)?)?
        }
    };
    elementwise(per, reduction)
}

/// `nn.BCELoss`: binary cross-entropy of probabilities in [0, 1]; each log is clamped at -100
/// as PyTorch's is, so a probability of exactly 0 or 1 gives a finite loss (and gradient).
pub fn binary_cross_entropy(probs: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    same_shape("binary_cross_entropy", probs, target)?;
    let log_p = log_or(probs, -100.0)?.maximum_scalar(-100.0)?;
    let log_q = log_or(&probs.rsub_scalar(1.0)?, -100.0)?.maximum_scalar(-100.0)?;
    let per = target.mul(&log_p)?.add(&target.rsub_scalar(1.0)?.mul(&log_q)?)?.neg()?;
    elementwise(per, reduction)
}

/// `nn.KLDivLoss`: `target (log target - input)` per element for log-probabilities `input`
/// (zero where the target is zero); with `log_target` the target is given as log-probabilities.
/// PyTorch's `reduction="batchmean"` is `Reduction::Sum` divided by the batch size.
pub fn kl_div(input: &Tensor, target: &Tensor, log_target: bool, reduction: Reduction) -> Result<Tensor> {
    same_shape("kl_div", input, target)?;
    let per = if log_target {
        target.exp()?.mul(&target.sub(input)?)?
    } else {
        // xlogy: 0 log 0 = 0.
        target.mul(&log_or(target, 0.0)?.sub(input)?)?
    };
    elementwise(per, reduction)
}

/// `log(x)` where `x > 0`, else `zero_value`; the log reads `x` floored at the dtype's smallest
/// normal number, so neither branch's gradient is infinite or NaN at `x = 0`.
fn log_or(x: &Tensor, zero_value: f64) -> Result<Tensor> {
    let tiny = match x.dtype() {
        DType::F64 => f64::MIN_POSITIVE,
        DType::F16 => 6.103515625e-5,
        _ => f32::MIN_POSITIVE as f64,
    };
    Tensor::where_cond(&x.gt_scalar(0.0)?, &x.maximum_scalar(tiny)?.log()?, &x.full_like(zero_value)?)
}

/// Input and target shapes must match (no broadcasting, as PyTorch warns); dtypes follow the
/// ops' type promotion (an autocast BF16 prediction against an F32 target).
fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(op, format!("input {:?} and target {:?} differ", a.shape(), b.shape())));
    }
    Ok(())
}

/// A per-element loss reduced as asked.
fn elementwise(per: Tensor, reduction: Reduction) -> Result<Tensor> {
    match reduction {
        Reduction::Mean => per.mean_all(),
        Reduction::Sum => per.sum_all(),
        Reduction::None => Ok(per),
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
