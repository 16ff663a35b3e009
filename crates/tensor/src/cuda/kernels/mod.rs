//! Every CUDA kernel family in a file of its own, holding its source generator, its
//! argument struct and its launcher (the launchers need feature `cuda`; the sources are pure
//! text, built and tested without a GPU). `run` and `run_inplace` map each primitive op to
//! its family's launch.

pub mod adam;
pub mod attention;
pub mod elementwise;
pub mod fused;
pub mod index;
pub mod prelude;
pub mod products;
pub mod reduce;
pub mod rows;
pub mod wgmma;

#[cfg(feature = "cuda")]
pub use dispatch::*;

/// Every `#[repr(C)]` argument struct beside its C twin's text (`prelude::ArgLayout`):
/// `cuda_codegen`'s test lays the C struct out by C's rules and compares.
#[cfg(feature = "cuda")]
pub fn argument_layouts() -> Vec<prelude::ArgLayout> {
    [
        elementwise::layout_checks(),
        reduce::layout_checks(),
        index::layout_checks(),
        adam::layout_checks(),
        rows::layout_checks(),
        products::layout_checks(),
        attention::layout_checks(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Op to launch (feature `cuda`).
#[cfg(feature = "cuda")]
mod dispatch {
    use crate::codegen::elementwise_expr;
    use crate::cuda::kernels::attention::attention;
    use crate::cuda::kernels::elementwise::{dense_copy, ew_with, launch_ew, NO_EXTRA};
    use crate::cuda::kernels::index::{argsort, cat, index_add, index_read, IndexKind};
    use crate::cuda::kernels::prelude::{storages, CudaStorage};
    use crate::cuda::kernels::products::linear_cross_entropy_mean;
    use crate::cuda::kernels::reduce::{gated_sums, reduce};
    use crate::cuda::kernels::rows::{cross_entropy, cross_entropy_mean, layer_norm_param_grads, normalize, softmax, softmax_backward};
    use crate::op::{Fused, Op, OutMeta};
    use crate::shape::Layout;
    use crate::storage::Storage;
    use crate::{DType, Device, Error, Result};

    /// Runs an op that makes a new tensor on `device`.
    pub fn run(op: &Op, ins: &[&Storage], layouts: &[&Layout], meta: &OutMeta, device: Device) -> Result<Storage> {
        let Device::Cuda(ordinal) = device else { return Err(Error::Msg("cuda::run on a CPU device".into())) };
        let g = crate::cuda::gpu::gpu(ordinal)?;
        let cs = storages(ins)?;
        let x: Vec<(&CudaStorage, &Layout)> = cs.iter().copied().zip(layouts.iter().copied()).collect();
        let dtypes: Vec<DType> = x.iter().map(|(s, _)| s.dtype).collect();
        let extra = match op {
            Op::Full { value, .. } | Op::Scalar { value, .. } => (*value, 0, 0),
            Op::Rand { seed, offset, .. } => (0.0, *seed, *offset),
            _ => NO_EXTRA,
        };
        let out = match op {
            // Also a reshape the strides cannot express: the copy is read back in the new shape.
            Op::Contiguous => dense_copy(&g, x[0].0, x[0].1)?,
            // Zeros (every dtype's zero is all zero bytes) need no kernel: a memset.
            Op::Full { value, .. } if value.to_bits() == 0 => {
                let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
                g.zero(&out)?;
                out
            }
            Op::Full { .. }
            | Op::Arange { .. }
            | Op::Rand { .. }
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Scalar { .. }
            | Op::Where
            | Op::Cast(_) => {
                let (prefix, expr, compute) =
                    elementwise_expr(op, &dtypes).ok_or_else(|| Error::Msg(format!("{}: no kernel", op.name())))?;
                ew_with(&g, prefix, expr, compute, &x, meta, extra)?
            }
            Op::Reduce { op: r, dims, .. } => reduce(&g, *r, x[0], dims, meta)?,
            Op::Softmax { log, scale, causal } => softmax(&g, x[0], (*log, *scale, *causal))?,
            Op::Normalize { eps, rms } => normalize(&g, x[0], None, &x[1..], (*eps, *rms, None))?,
            Op::Fused(Fused::NormalizeTo { eps, to }) => normalize(&g, x[0], None, &x[1..], (*eps, false, Some(*to)))?,
            Op::NormalizeBackward { eps, rms } => normalize(&g, x[0], Some(x[1]), &x[2..], (*eps, *rms, None))?,
            Op::Fused(Fused::GatedSums { gate }) => gated_sums(&g, x[0], x[1], *gate)?,
            Op::LayerNormGrads { eps } => layer_norm_param_grads(&g, x[0], x[1], (x.get(2).copied(), None), (*eps, None), None)?,
            Op::Fused(Fused::LayerNormGrads { eps, sums, .. }) => {
                layer_norm_param_grads(&g, x[0], x[1], (x.get(2).copied(), x.get(3).copied()), (*eps, *sums), None)?
            }
            Op::SoftmaxBackward { log, scale } => softmax_backward(&g, x[0], x[1], *log, *scale)?,
            Op::Attention { scale, causal } => attention(&g, &x, (*scale, *causal), false, false)?,
            Op::Fused(Fused::AttentionHeadsLast { scale, causal }) => attention(&g, &x, (*scale, *causal), false, true)?,
            Op::AttentionBackward { scale, causal } => attention(&g, &x, (*scale, *causal), true, false)?,
            Op::CrossEntropy { ignore_index, smoothing } => cross_entropy(&g, &x, *ignore_index, *smoothing)?,
            Op::CrossEntropyBackward { ignore_index, smoothing } => cross_entropy(&g, &x, *ignore_index, *smoothing)?,
            Op::Fused(Fused::CrossEntropyMean { ignore_index, smoothing }) => cross_entropy_mean(&g, &x, *ignore_index, *smoothing)?,
            Op::Fused(Fused::LinearCrossEntropyMean { ignore_index, smoothing, drelu }) => {
                linear_cross_entropy_mean(&g, &x, *ignore_index, *smoothing, *drelu)?
            }
            Op::Matmul => crate::cuda::blas::matmul(&g, x[0], x[1], x.get(2).copied(), meta)?,
            Op::Fused(Fused::Matmul(e)) => crate::cuda::blas::matmul_fused(&g, x[0], x[1], &x[2..], Some(*e), meta)?,
            Op::IndexSelect { dim } => index_read(&g, IndexKind::Select, x[0], x[1], *dim, meta)?,
            Op::Gather { dim } => index_read(&g, IndexKind::Gather, x[0], x[1], *dim, meta)?,
            Op::IndexAdd { dim } | Op::ScatterAdd { dim } => index_add(&g, op, x[0], x[1], x[2], *dim)?,
            Op::ArgSort { descending } => argsort(&g, x[0], *descending)?,
            Op::Cat { dim } => cat(&g, &x, *dim, meta)?,
            Op::Collective { group, kind } => crate::cuda::nccl::run(&g, group, *kind, x[0], meta)?,
            Op::Reshape(_) | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_) => {
                return Err(Error::Msg(format!("{}: a view runs no kernel", op.name())))
            }
            Op::Assign | Op::UpdateBinary(_) | Op::UpdateScalar(..) => {
                return Err(Error::Msg(format!("{}: in-place ops go through run_inplace", op.name())))
            }
        };
        Ok(Storage::Cuda(out))
    }

    /// Runs an in-place op on `dst` (read and written through `ld`).
    pub fn run_inplace(op: &Op, dst: &mut Storage, ld: &Layout, src: Option<(&Storage, &Layout)>) -> Result<()> {
        let Storage::Cuda(d) = dst else { return Err(Error::Msg("cuda::run_inplace on a CPU buffer".into())) };
        let g = crate::cuda::gpu::gpu(d.ordinal())?;
        let source = || -> Result<(&CudaStorage, &Layout)> {
            match src {
                Some((Storage::Cuda(s), l)) => Ok((s, l)),
                _ => Err(Error::Msg(format!("{}: needs a CUDA source tensor", op.name()))),
            }
        };
        let (second, extra) = match op {
            Op::Assign | Op::UpdateBinary(_) => (Some(source()?), 0.0),
            Op::UpdateScalar(_, v) => (None, *v),
            _ => return Err(Error::Msg(format!("{}: not an in-place op", op.name()))),
        };
        let (prefix, expr, c) = elementwise_expr(op, &[d.dtype]).ok_or_else(|| Error::Msg(format!("{}: no kernel", op.name())))?;
        let mut ins: Vec<(&CudaStorage, &Layout)> = vec![(&*d, ld)];
        ins.extend(second);
        launch_ew(&g, prefix, expr, c, &ins, &ld.shape, d, true, (extra, 0, 0))
    }
}
