//! The fused ops' names, arities and shape rules (the type, `Fused`, is beside `Op`).

use super::shapes::{float_only, index_dtype, same_dtype};
use super::{Fused, InMeta, MatmulEpilogue, Op, OutMeta, Parts};
use crate::{DType, Error, Result};

impl Fused {
    pub fn name(&self) -> &'static str {
        match self {
            Fused::Matmul(MatmulEpilogue::Relu) => "matmul_relu",
            Fused::Matmul(MatmulEpilogue::GeluTanh) => "matmul_gelu_tanh",
            Fused::Matmul(MatmulEpilogue::DGeluTanh) => "matmul_dgelu_tanh",
            Fused::Matmul(MatmulEpilogue::DRelu) => "matmul_drelu",
            Fused::Matmul(MatmulEpilogue::Residual) => "matmul_residual",
            Fused::Matmul(_) => "matmul_sum",
            Fused::GatedSums { .. } => "gated_sums",
            Fused::NormalizeTo { .. } => "normalize_to",
            Fused::LayerNormGrads { .. } => "layer_norm_grads_fused",
            Fused::AttentionHeadsLast { .. } => "attention_heads_last",
            Fused::CrossEntropyMean { .. } => "cross_entropy_mean",
            Fused::LinearCrossEntropyMean { .. } => "linear_cross_entropy_mean",
        }
    }

    /// How many inputs it takes, `given` the count passed (some take an optional last one).
    pub(super) fn arity(&self, given: usize) -> usize {
        match self {
            Fused::Matmul(MatmulEpilogue::Relu | MatmulEpilogue::GeluTanh) if given == 3 => 3,
            Fused::Matmul(MatmulEpilogue::DGeluTanh | MatmulEpilogue::DRelu) => 3,
            Fused::Matmul(MatmulEpilogue::Residual) => given.clamp(3, 4),
            Fused::Matmul(_) | Fused::GatedSums { .. } | Fused::CrossEntropyMean { .. } => 2,
            Fused::AttentionHeadsLast { .. } => 3,
            Fused::NormalizeTo { .. } if given == 3 => 3,
            Fused::NormalizeTo { .. } => 1,
            Fused::LayerNormGrads { .. } => given.clamp(3, 4),
            Fused::LinearCrossEntropyMean { .. } => 4,
        }
    }

    /// The shape rule (the arity already checked).
    pub(super) fn infer(&self, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
        let name = self.name();
        match self {
            Fused::Matmul(e) => matmul(name, *e, inputs),
            Fused::GatedSums { .. } => {
                float_only(name, inputs[0].dtype)?;
                same_dtype(name, inputs[0].dtype, inputs[1].dtype)?;
                let Some(&n) = inputs[0].shape.last().filter(|_| inputs[0].shape == inputs[1].shape) else {
                    return Err(Error::shape(
                        name,
                        format!("a {:?} and h {:?} must have one shape of rank >= 1", inputs[0].shape, inputs[1].shape),
                    ));
                };
                Ok(OutMeta { shape: vec![Parts::with_tail(inputs[0].shape, &[n]).len()], dtype: inputs[0].dtype })
            }
            Fused::NormalizeTo { eps, to } => {
                let out = Op::Normalize { eps: *eps, rms: false }.infer(inputs).map_err(|e| e.in_op(name))?;
                float_only(name, *to)?;
                Ok(OutMeta { shape: out.shape, dtype: *to })
            }
            Fused::LayerNormGrads { eps, sums, copy } => layer_norm_grads(name, inputs, (*eps, *sums, *copy)),
            Fused::AttentionHeadsLast { scale, causal } => {
                let out = Op::Attention { scale: *scale, causal: *causal }.infer(inputs).map_err(|e| e.in_op(name))?;
                match out.shape[..] {
                    [b, h, t, d] => Ok(OutMeta { shape: vec![b, t, h, d], dtype: out.dtype }),
                    _ => Err(Error::shape(name, format!("with the heads last needs q of rank 4 [B, H, T, D], got {:?}", out.shape))),
                }
            }
            Fused::CrossEntropyMean { ignore_index, smoothing } => {
                let rows =
                    Op::CrossEntropy { ignore_index: *ignore_index, smoothing: *smoothing }.infer(inputs).map_err(|e| e.in_op(name))?;
                let classes = inputs[0].shape[1];
                Ok(OutMeta { shape: vec![Parts::cross_entropy_mean(rows.shape[0], classes).len()], dtype: rows.dtype })
            }
            Fused::LinearCrossEntropyMean { .. } => {
                let [h, w, b, t] = [0, 1, 2, 3].map(|i| inputs[i].shape);
                float_only(name, inputs[0].dtype)?;
                inputs[1..3].iter().try_for_each(|x| same_dtype(name, inputs[0].dtype, x.dtype))?;
                index_dtype(name, inputs[3].dtype)?;
                let ok = h.len() == 2 && w.len() == 2 && w[1] == h[1] && b == [w[0]] && t == [h[0]];
                if !ok {
                    return Err(Error::shape(
                        name,
                        format!("expects h [N, H], weight [C, H], bias [C] and targets [N], got {h:?}, {w:?}, {b:?} and {t:?}"),
                    ));
                }
                Ok(OutMeta { shape: vec![Parts::linear_cross_entropy_mean(h[0], w[0], h[1]).len()], dtype: inputs[0].dtype })
            }
        }
    }
}

/// `Fused::LayerNormGrads`' shape rule: the primitive's with the weight, then the residual
/// gradient (x's shape and dtype) and the dtypes of the sums row and the copy.
fn layer_norm_grads(name: &'static str, inputs: &[InMeta<'_>], (eps, sums, copy): (f64, Option<DType>, Option<DType>)) -> Result<OutMeta> {
    let x = &inputs[0];
    Op::LayerNormGrads { eps }.infer(&inputs[..3]).map_err(|e| e.in_op(name))?;
    if let Some(r) = inputs.get(3) {
        if r.shape != x.shape {
            return Err(Error::shape(name, format!("the residual gradient must be x's shape {:?}, got {:?}", x.shape, r.shape)));
        }
        same_dtype(name, x.dtype, r.dtype)?;
    }
    if let Some(t) = sums.filter(|t| !t.is_float()) {
        return Err(Error::Msg(format!("{name}: the sums row needs a float dtype, got {t:?}")));
    }
    if let Some(t) = copy.filter(|t| !t.is_float() || *t == x.dtype) {
        return Err(Error::Msg(format!("{name}: the copy of x's gradient needs a float dtype other than x's {:?}, got {t:?}", x.dtype)));
    }
    Ok(OutMeta { shape: vec![Parts::layer_norm_grads(x.shape, sums.is_some()).len()], dtype: x.dtype })
}

/// `Fused::Matmul`'s shape rule: the product's, then the epilogue's part after it.
fn matmul(name: &'static str, e: MatmulEpilogue, inputs: &[InMeta<'_>]) -> Result<OutMeta> {
    // (A residual's operands: a, b and the bias after r.)
    let product = match e {
        MatmulEpilogue::Residual => residual_product(name, inputs)?,
        e if e.activation_grad().is_some() => Op::Matmul.infer(&inputs[..2]).map_err(|e| e.in_op(name))?,
        _ => Op::Matmul.infer(inputs).map_err(|e| e.in_op(name))?,
    };
    match e {
        MatmulEpilogue::Relu => Ok(product),
        MatmulEpilogue::GeluTanh => {
            Ok(OutMeta { shape: vec![Parts::with_tail(&product.shape, &product.shape).len()], dtype: product.dtype })
        }
        MatmulEpilogue::DGeluTanh | MatmulEpilogue::DRelu => {
            same_dtype(name, product.dtype, inputs[2].dtype)?;
            if inputs[2].shape != product.shape {
                let h = inputs[2].shape;
                return Err(Error::shape(name, format!("the pre-activation {h:?} must match the product {:?}", product.shape)));
            }
            Ok(product)
        }
        MatmulEpilogue::Residual => {
            // A 16-bit product may join an F32 residual (autocast): the sum is F32.
            let widened = matches!(product.dtype, DType::BF16 | DType::F16) && inputs[2].dtype == DType::F32;
            if !widened {
                same_dtype(name, product.dtype, inputs[2].dtype)?;
            }
            if inputs[2].shape != product.shape {
                let r = inputs[2].shape;
                return Err(Error::shape(name, format!("the residual {r:?} must match the product {:?}", product.shape)));
            }
            Ok(OutMeta { shape: product.shape, dtype: inputs[2].dtype })
        }
        MatmulEpilogue::SumLeft | MatmulEpilogue::SumRight => {
            let (a, b) = (inputs[0].shape, inputs[1].shape);
            if a.len() != 2 || b.len() != 2 {
                return Err(Error::shape(name, format!("needs two 2-D operands, got {a:?} x {b:?}")));
            }
            let sums = if e == MatmulEpilogue::SumLeft { a[0] } else { b[1] };
            Ok(OutMeta { shape: vec![Parts::with_tail(&[a[0], b[1]], &[sums]).len()], dtype: product.dtype })
        }
    }
}

/// `MatmulEpilogue::Residual`'s product (inputs a, b, r, then the bias): the product of a and
/// b with the bias's shape checked; the bias is of the operands' dtype, or of r's when a
/// 16-bit product joins an F32 r (autocast's bias read in F32, as cuBLASLt's epilogue takes it).
fn residual_product(name: &'static str, inputs: &[InMeta]) -> Result<OutMeta> {
    let product = Op::Matmul.infer(&inputs[..2]).map_err(|e| e.in_op(name))?;
    if let (Some(r), Some(bias)) = (inputs.get(2), inputs.get(3)) {
        let n = product.shape[product.shape.len() - 1];
        if bias.shape != [n] {
            return Err(Error::shape(
                name,
                format!("the bias of {:?} x {:?} must be [{n}], got {:?}", inputs[0].shape, inputs[1].shape, bias.shape),
            ));
        }
        let widened = matches!(product.dtype, DType::BF16 | DType::F16) && r.dtype == DType::F32;
        if bias.dtype != product.dtype && !(widened && bias.dtype == r.dtype) {
            return Err(Error::dtype_mismatch(name, product.dtype, bias.dtype));
        }
    }
    Ok(product)
}
