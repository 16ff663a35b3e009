//! CPU kernels. `run` executes one primitive op on CPU storages; each op's kernel lives in the
//! file for its kind (elementwise, reduce, matmul, index).

pub mod attention;
pub mod base;
pub mod collective;
pub mod elementwise;
pub mod index;
pub mod matmul;
pub mod reduce;
pub mod strided;

use crate::op::{Distribution, Fused, MatmulEpilogue, Op, OutMeta, Part, Parts};
use crate::shape::Layout;
use crate::storage::{pool, CpuSlice, CpuStorage, IntoCpuStorage};
use crate::{with_cpu, DType, Element, Error, Result};
use elementwise as ew;
use half::{bf16, f16};
use reduce::RowKernels;
use std::borrow::Cow;

pub use base::{par_chunks, set_flush_denormal, wide, Out, PAR_THRESHOLD};

/// `f` over row-major copies of `x` and of one more tensor of its element type (a gradient,
/// or RMS norm's weight).
fn with_other<T: CpuSlice>(
    x: &[T],
    l: &Layout,
    (sg, lg): (&CpuStorage, &Layout),
    name: &'static str,
    f: impl FnOnce(&[T], &[T]) -> Vec<T>,
) -> Result<Vec<T>> {
    let g = contig(typed::<T>(sg, name)?, lg);
    Ok(f(&contig(x, l), &g))
}

/// `f` over row-major copies of `x` and of two more tensors of its element type (a weight and
/// a bias, or a gradient and a weight).
fn with_affine<T: CpuSlice>(
    x: &[T],
    l: &Layout,
    ((sw, lw), (sb, lb)): ((&CpuStorage, &Layout), (&CpuStorage, &Layout)),
    name: &'static str,
    f: impl FnOnce(&[T], &[T], &[T]) -> Vec<T>,
) -> Result<Vec<T>> {
    let (w, b) = (contig(typed::<T>(sw, name)?, lw), contig(typed::<T>(sb, name)?, lb));
    Ok(f(&contig(x, l), &w, &b))
}

fn typed<'a, T: CpuSlice>(s: &'a CpuStorage, op: &'static str) -> Result<&'a [T]> {
    T::slice(s).ok_or_else(|| Error::dtype(op, format!("expected {:?}, got {:?}", T::DTYPE, s.dtype())))
}

/// The data of a layout in row-major order: borrowed if already contiguous.
fn contig<'a, T: Element>(s: &'a [T], l: &Layout) -> Cow<'a, [T]> {
    if l.is_contiguous() {
        Cow::Borrowed(&s[l.offset..l.offset + l.numel()])
    } else {
        Cow::Owned(ew::map1(s, l, |x| x))
    }
}

/// Converts every element to another dtype.
fn cast<T: Element>(v: &[T], l: &Layout, to: DType) -> CpuStorage {
    fn go<T: Element, U: Element>(v: &[T], l: &Layout) -> Vec<U> {
        ew::map1(v, l, |x| U::from_f64(x.to_f64()))
    }
    match to {
        DType::F32 => CpuStorage::F32(go(v, l)),
        DType::F64 => CpuStorage::F64(go(v, l)),
        DType::F16 => CpuStorage::F16(go(v, l)),
        DType::BF16 => CpuStorage::BF16(go(v, l)),
        DType::I64 => CpuStorage::I64(go(v, l)),
        DType::U8 => CpuStorage::U8(go(v, l)),
    }
}

/// Runs an op that makes a new tensor. `ins` are (storage, layout) per input.
pub fn run(op: &Op, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    match op {
        Op::Full { .. } | Op::Arange { .. } | Op::Rand { .. } => sources(op, meta),
        Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Where | Op::Cast(_) | Op::Contiguous => elementwise(op, ins, meta),
        Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::Normalize { .. }
        | Op::SoftmaxBackward { .. }
        | Op::NormalizeBackward { .. }
        | Op::CrossEntropy { .. }
        | Op::CrossEntropyBackward { .. } => rows(op, ins, meta),
        Op::LayerNormGrads { eps } => layer_norm_grads(*eps, None, ins, meta),
        Op::Attention { .. } | Op::AttentionBackward { .. } => attention(op, ins),
        Op::Matmul => matmul(op, ins, meta),
        Op::IndexSelect { .. } | Op::ArgSort { .. } | Op::Gather { .. } | Op::IndexAdd { .. } | Op::ScatterAdd { .. } | Op::Cat { .. } => {
            indexing(op, ins, meta)
        }
        Op::Fused(_) => fused(op, ins, meta),
        Op::Collective { group, kind } => collective::run(group, *kind, ins[0], meta),
        Op::Reshape(_) | Op::Permute(_) | Op::Narrow { .. } | Op::Expand(_) => {
            Err(Error::Msg(format!("{}: a view runs no kernel", op.name())))
        }
        Op::Assign | Op::UpdateBinary(_) | Op::UpdateScalar(..) => {
            Err(Error::Msg(format!("{}: in-place ops go through run_inplace", op.name())))
        }
    }
}

/// Full, Arange and Rand.
fn sources(op: &Op, meta: &OutMeta) -> Result<CpuStorage> {
    let name = op.name();
    let numel: usize = meta.shape.iter().product();
    Ok(match op {
        Op::Full { value, dtype, .. } => match dtype {
            DType::F32 => CpuStorage::F32(ew::full(numel, *value as f32)),
            DType::F64 => CpuStorage::F64(ew::full(numel, *value)),
            DType::F16 => CpuStorage::F16(ew::full(numel, f16::from_f64(*value))),
            DType::BF16 => CpuStorage::BF16(ew::full(numel, bf16::from_f64(*value))),
            DType::I64 => CpuStorage::I64(ew::full(numel, *value as i64)),
            DType::U8 => CpuStorage::U8(ew::full(numel, *value as u8)),
        },
        Op::Arange { n, dtype } => {
            let v: Vec<f64> = (0..*n).map(|i| i as f64).collect();
            cast(&v, &Layout::contiguous(&[*n]), *dtype)
        }
        Op::Rand { dist, seed, offset, dtype, .. } => {
            let mut v = pool::take::<f32>(numel);
            let (seed, offset) = (*seed, *offset);
            par_chunks(&mut v, |start, chunk| {
                for (j, o) in chunk.iter_mut().enumerate() {
                    let i = (start + j) as u64;
                    *o = match dist {
                        Distribution::Uniform => crate::rng::uniform_at(seed, offset, i),
                        Distribution::Normal => crate::rng::normal_at(seed, offset, i),
                    };
                }
            });
            if *dtype == DType::F32 {
                CpuStorage::F32(v)
            } else {
                // The same f32 -> dtype rounding as `to_dtype` (and the CUDA kernel).
                let f = CpuStorage::F32(v);
                run(&Op::Cast(*dtype), &[(&f, &Layout::contiguous(&meta.shape))], meta)?
            }
        }
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's sources kernels"))),
    })
}

/// Elementwise ops, casts and the dense copy.
fn elementwise(op: &Op, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    let name = op.name();
    Ok(match op {
        Op::Unary(u) => {
            let (s, l) = ins[0];
            match s {
                CpuStorage::F32(v) => CpuStorage::F32(ew::unary(*u, v, l)),
                CpuStorage::F64(v) => CpuStorage::F64(ew::unary(*u, v, l)),
                CpuStorage::F16(v) => CpuStorage::F16(ew::unary(*u, v, l)),
                CpuStorage::BF16(v) => CpuStorage::BF16(ew::unary(*u, v, l)),
                CpuStorage::I64(v) => CpuStorage::I64(ew::unary_int(*u, v, l)),
                CpuStorage::U8(_) => return Err(Error::dtype(name, "not defined for U8")),
            }
        }
        Op::Binary(b) => {
            let ((sa, la), (sb, lb)) = (ins[0], ins[1]);
            let shape = &meta.shape;
            match sa {
                CpuStorage::F32(a) => ew::binary(*b, a, la, typed(sb, name)?, lb, shape).into_storage(),
                CpuStorage::F64(a) => ew::binary(*b, a, la, typed(sb, name)?, lb, shape).into_storage(),
                CpuStorage::F16(a) => ew::binary(*b, a, la, typed(sb, name)?, lb, shape).into_storage(),
                CpuStorage::BF16(a) => ew::binary(*b, a, la, typed(sb, name)?, lb, shape).into_storage(),
                CpuStorage::I64(a) => ew::binary_int(*b, a, la, typed(sb, name)?, lb, shape).into_storage(),
                CpuStorage::U8(a) => ew::binary_int(*b, a, la, typed(sb, name)?, lb, shape).into_storage(),
            }
        }
        Op::Scalar { op: b, value, scalar_lhs } => {
            let (s, l) = ins[0];
            match s {
                CpuStorage::F32(v) => ew::scalar(*b, *value, *scalar_lhs, v, l).into_storage(),
                CpuStorage::F64(v) => ew::scalar(*b, *value, *scalar_lhs, v, l).into_storage(),
                CpuStorage::F16(v) => ew::scalar(*b, *value, *scalar_lhs, v, l).into_storage(),
                CpuStorage::BF16(v) => ew::scalar(*b, *value, *scalar_lhs, v, l).into_storage(),
                CpuStorage::I64(v) => ew::scalar_int(*b, *value, *scalar_lhs, v, l).into_storage(),
                CpuStorage::U8(v) => ew::scalar_int(*b, *value, *scalar_lhs, v, l).into_storage(),
            }
        }
        Op::Where => {
            let ((sc, lc), (sa, la), (sb, lb)) = (ins[0], ins[1], ins[2]);
            let shape = &meta.shape;
            // The condition as u8 (nonzero is true), whatever its dtype.
            let cond: Cow<[u8]> = match sc {
                CpuStorage::U8(c) => Cow::Borrowed(c),
                other => Cow::Owned(with_cpu!(other, c => c.iter().map(|x| (x.to_f64() != 0.0) as u8).collect())),
            };
            fn go<T: CpuSlice>(
                c: &[u8],
                lc: &Layout,
                a: &[T],
                la: &Layout,
                sb: &CpuStorage,
                lb: &Layout,
                shape: &[usize],
            ) -> Result<Vec<T>> {
                Ok(ew::map3((c, lc), (a, la), (typed(sb, "where")?, lb), shape, |c, x, y| if c != 0 { x } else { y }))
            }
            match sa {
                CpuStorage::F32(a) => CpuStorage::F32(go(&cond, lc, a, la, sb, lb, shape)?),
                CpuStorage::F64(a) => CpuStorage::F64(go(&cond, lc, a, la, sb, lb, shape)?),
                CpuStorage::F16(a) => CpuStorage::F16(go(&cond, lc, a, la, sb, lb, shape)?),
                CpuStorage::BF16(a) => CpuStorage::BF16(go(&cond, lc, a, la, sb, lb, shape)?),
                CpuStorage::I64(a) => CpuStorage::I64(go(&cond, lc, a, la, sb, lb, shape)?),
                CpuStorage::U8(a) => CpuStorage::U8(go(&cond, lc, a, la, sb, lb, shape)?),
            }
        }
        Op::Cast(to) => {
            let (s, l) = ins[0];
            match (s, to) {
                (CpuStorage::F32(v), DType::F16) => CpuStorage::F16(ew::map1(v, l, f16::from_f32)),
                (CpuStorage::F32(v), DType::BF16) => CpuStorage::BF16(ew::map1(v, l, bf16::from_f32)),
                (CpuStorage::F16(v), DType::F32) => CpuStorage::F32(ew::map1(v, l, |x| x.to_f32())),
                (CpuStorage::BF16(v), DType::F32) => CpuStorage::F32(ew::map1(v, l, |x| x.to_f32())),
                _ => with_cpu!(s, v => cast(v, l, *to)),
            }
        }
        Op::Contiguous => {
            let (s, l) = ins[0];
            with_cpu!(s, v => ew::map1(v, l, |x| x).into_storage())
        }
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's elementwise kernels"))),
    })
}

/// Reductions and the row ops: softmax, layer norm and their backwards, cross-entropy.
fn rows(op: &Op, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    let name = op.name();
    let numel: usize = meta.shape.iter().product();
    Ok(match op {
        Op::Reduce { op: r, dims, .. } => {
            let (s, l) = ins[0];
            with_cpu!(s, v => reduce::reduce(*r, v, l, dims, numel).into_storage())
        }
        Op::Softmax { log, scale, causal } => {
            let (s, l) = ins[0];
            let r = l.rank();
            let spec = reduce::SoftmaxSpec { n: l.shape[r - 1], log: *log, scale: *scale, causal_rows: causal.then(|| l.shape[r - 2]) };
            with_cpu!(s, v => RowKernels::softmax_rows(&contig(v, l), spec).into_storage())
        }
        Op::Normalize { eps, rms } => {
            let (s, l) = ins[0];
            let k = reduce::NormSpec { n: l.shape[l.rank() - 1], eps: *eps, rms: *rms };
            match ins {
                // Layer norm with its affine part (weight and bias of x's dtype, checked).
                [_, w, b] => {
                    with_cpu!(s, v => with_affine(v, l, (*w, *b), name, |x, w, b| RowKernels::normalize_rows(x, None, (Some(w), Some(b)), k))?.into_storage())
                }
                // RMS norm's weight.
                [_, w] => {
                    with_cpu!(s, v => with_other(v, l, *w, name, |x, w| RowKernels::normalize_rows(x, None, (Some(w), None), k))?.into_storage())
                }
                _ => with_cpu!(s, v => RowKernels::normalize_rows(&contig(v, l), None, (None, None), k).into_storage()),
            }
        }
        Op::SoftmaxBackward { log, scale } => {
            let ((s, l), g) = (ins[0], ins[1]);
            let n = l.shape[l.rank() - 1];
            with_cpu!(s, v => with_other(v, l, g, name, |y, g| reduce::softmax_backward(y, g, n, *log, *scale))?.into_storage())
        }
        Op::NormalizeBackward { eps, rms } => {
            let ((s, l), g) = (ins[0], ins[1]);
            let k = reduce::NormSpec { n: l.shape[l.rank() - 1], eps: *eps, rms: *rms };
            if let [_, _, w] = ins {
                // With the weight (x's dtype, checked), which scales g.
                return Ok(
                    with_cpu!(s, v => with_affine(v, l, (g, *w), name, |x, g, w| RowKernels::normalize_rows(x, Some(g), (Some(w), None), k))?.into_storage()),
                );
            }
            with_cpu!(s, v => with_other(v, l, g, name, |x, g| RowKernels::normalize_rows(x, Some(g), (None, None), k))?.into_storage())
        }
        Op::CrossEntropy { ignore_index, smoothing } | Op::CrossEntropyBackward { ignore_index, smoothing } => {
            let ((s, l), (st, lt)) = (ins[0], ins[1]);
            let spec = reduce::XentSpec { n: l.shape[1], ignore: *ignore_index, smoothing: *smoothing };
            let targets = contig(typed::<i64>(st, name)?, lt);
            // The losses (and the gradient read by the backward) are F64 for F64 logits, else F32.
            fn go<T: CpuSlice + RowKernels, U: CpuSlice>(
                x: &[T],
                l: &Layout,
                t: &[i64],
                g: Option<&(&CpuStorage, &Layout)>,
                spec: reduce::XentSpec,
            ) -> Result<CpuStorage>
            where
                Vec<T>: IntoCpuStorage,
                Vec<U>: IntoCpuStorage,
            {
                let g = g.map(|(sg, lg)| Ok::<_, Error>(contig(typed::<U>(sg, "cross_entropy_backward")?, lg))).transpose()?;
                Ok(match reduce::cross_entropy::<T, U>(&contig(x, l), t, g.as_deref(), spec)? {
                    reduce::CrossEntropyOut::Losses(v) => v.into_storage(),
                    reduce::CrossEntropyOut::Grad(v) => v.into_storage(),
                })
            }
            let g = ins.get(2);
            with_cpu!(s, v => if s.dtype() == DType::F64 { go::<_, f64>(v, l, &targets, g, spec)? } else { go::<_, f32>(v, l, &targets, g, spec)? })
        }
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's rows kernels"))),
    })
}

/// Layer norm's parameter gradients (`Op::LayerNormGrads`), with x's gradient when given the
/// weight; with the residual gradient and the `sums` row of `Fused::LayerNormGrads`.
fn layer_norm_grads(eps: f64, sums: Option<DType>, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    let name = "layer_norm_grads";
    Ok(match sums {
        Some(t) => {
            // The flat result without the sums row, then the row spliced in before x's gradient.
            let (x, n) = (ins[0], ins[0].1.shape[ins[0].1.rank() - 1]);
            let (from, to) =
                (Parts::layer_norm_grads(&x.1.shape, false).offset(Part::Dx)?, Parts::layer_norm_grads(&x.1.shape, true).offset(Part::Dx)?);
            let plain = layer_norm_grads(eps, None, ins, &OutMeta { shape: vec![from + x.1.numel()], dtype: meta.dtype })?;
            let dx = Layout { offset: from, ..Layout::contiguous(&[x.1.numel() / n.max(1), n]) };
            let low = run(&Op::Cast(t), &[(&plain, &dx)], &OutMeta { shape: dx.shape.clone(), dtype: t })?;
            let back = run(
                &Op::Cast(meta.dtype),
                &[(&low, &Layout::contiguous(&dx.shape))],
                &OutMeta { shape: dx.shape.clone(), dtype: meta.dtype },
            )?;
            let sum = Op::Reduce { op: crate::ReduceOp::Sum, dims: vec![0], keepdim: false };
            let row = run(&sum, &[(&back, &Layout::contiguous(&dx.shape))], &OutMeta { shape: vec![n], dtype: meta.dtype })?;
            with_cpu!(&plain, v => {
                let mut out = v[..2 * n].to_vec();
                out.extend_from_slice(typed(&row, name)?);
                out.resize(to, Default::default());
                out.extend_from_slice(&v[from..]);
                out.into_storage()
            })
        }
        None if ins[1].0.dtype() != ins[0].0.dtype() => {
            // g in another float dtype: read as x's.
            let (x, (gs, gl)) = (ins[0], ins[1]);
            let g = run(&Op::Cast(x.0.dtype()), &[(gs, gl)], &OutMeta { shape: gl.shape.clone(), dtype: x.0.dtype() })?;
            let gl = Layout::contiguous(&gl.shape);
            let mut with_g: Vec<(&CpuStorage, &Layout)> = ins.to_vec();
            with_g[1] = (&g, &gl);
            layer_norm_grads(eps, None, &with_g, meta)?
        }
        None if ins.len() >= 3 && ins.iter().all(|(s, _)| matches!(s, CpuStorage::F32(_))) => {
            // f32 with the weight (and a residual gradient r, added as x's gradient is written):
            // one pass.
            let x = ins[0];
            let (n, dx_at) = (x.1.shape[x.1.rank() - 1], Parts::layer_norm_grads(&x.1.shape, false).offset(Part::Dx)?);
            let c: Vec<Cow<[f32]>> = ins.iter().map(|(s, l)| Ok(contig(typed::<f32>(s, name)?, l))).collect::<Result<_>>()?;
            reduce::layer_norm_backward_f32(&c[0], &c[1], &c[2], c.get(3).map(|r| &r[..]), (n, eps, dx_at)).into_storage()
        }
        None if ins.len() == 4 => {
            // With a residual gradient r: the three-input result, then r added to x's gradient.
            let flat = layer_norm_grads(eps, None, &ins[..3], meta)?;
            let at = Parts::layer_norm_grads(&ins[0].1.shape, false).offset(Part::Dx)?;
            let (r, len) = (ins[3], meta.shape[0]);
            let dx = Layout { shape: r.1.shape.clone(), strides: Layout::contiguous(&r.1.shape).strides, offset: at };
            let sum = run(&Op::Binary(crate::BinaryOp::Add), &[(&flat, &dx), r], &OutMeta { shape: r.1.shape.clone(), dtype: meta.dtype })?;
            with_cpu!(&flat, f => {
                let mut v = f.to_vec();
                v[at..len].copy_from_slice(typed(&sum, name)?);
                v.into_storage()
            })
        }
        None if ins.len() == 3 => {
            // With the weight: the parameter gradients, then x's gradient (`Parts::layer_norm_grads`).
            let x = ins[0];
            let n = x.1.shape[x.1.rank() - 1];
            let dx_at = Parts::layer_norm_grads(&x.1.shape, false).offset(Part::Dx)?;
            let both = layer_norm_grads(eps, None, &ins[..2], &OutMeta { shape: vec![2, n], dtype: meta.dtype })?;
            let dx = run(&Op::NormalizeBackward { eps, rms: false }, ins, &OutMeta { shape: x.1.shape.clone(), dtype: meta.dtype })?;
            with_cpu!(&both, p => {
                let mut v = p.to_vec();
                v.resize(dx_at, Default::default());
                v.extend_from_slice(typed(&dx, name)?);
                v.into_storage()
            })
        }
        None => {
            let (x, g) = (ins[0], ins[1]);
            if let CpuStorage::F32(v) = x.0 {
                let n = meta.shape[1];
                return Ok(with_other(v, x.1, g, name, |x, g| reduce::layer_norm_grads_f32(x, g, n, eps))?.into_storage());
            }
            // Other dtypes: the unfused ops.
            let rows: Vec<usize> = (0..x.1.rank() - 1).collect();
            let n = meta.shape[1];
            let like = |d: DType| OutMeta { shape: x.1.shape.clone(), dtype: d };
            let xhat = run(&Op::Normalize { eps, rms: false }, &[x], &like(meta.dtype))?;
            let gx = run(&Op::Binary(crate::BinaryOp::Mul), &[g, (&xhat, &Layout::contiguous(&x.1.shape))], &like(meta.dtype))?;
            let sum = Op::Reduce { op: crate::ReduceOp::Sum, dims: rows, keepdim: false };
            let vec_meta = OutMeta { shape: vec![n], dtype: meta.dtype };
            let (dw, db) = (run(&sum, &[(&gx, &Layout::contiguous(&x.1.shape))], &vec_meta)?, run(&sum, &[g], &vec_meta)?);
            with_cpu!(&dw, w => {
                let mut v = w.to_vec();
                v.extend_from_slice(typed(&db, name)?);
                v.into_storage()
            })
        }
    })
}

/// Attention and its backward.
fn attention(op: &Op, ins: &[(&CpuStorage, &Layout)]) -> Result<CpuStorage> {
    let name = op.name();
    Ok(match op {
        Op::Attention { scale, causal } | Op::AttentionBackward { scale, causal } => {
            let (s0, l0) = ins[0];
            let r = l0.rank();
            let spec = attention::AttnSpec {
                n: l0.shape[..r - 2].iter().product(),
                heads: crate::op::attention_heads(&l0.shape),
                rep: crate::op::attention_kv_repeat(&l0.shape, &ins[1].1.shape).unwrap_or(1),
                t: l0.shape[r - 2],
                s: ins[1].1.shape[r - 2],
                d: l0.shape[r - 1],
                scale: *scale,
                causal: *causal,
            };
            // `_like` fixes the element type from the first input.
            fn go<T: CpuSlice>(
                _like: &[T],
                ins: &[(&CpuStorage, &Layout)],
                spec: attention::AttnSpec,
                name: &'static str,
            ) -> Result<Vec<T>> {
                let x: Vec<Cow<[T]>> = ins.iter().map(|(s, l)| Ok(contig(typed::<T>(s, name)?, l))).collect::<Result<_>>()?;
                Ok(match x.len() {
                    3 => attention::forward(&x[0], &x[1], &x[2], spec),
                    _ => attention::backward(&x[0], &x[1], &x[2], &x[4], spec),
                })
            }
            with_cpu!(s0, v => go(v, ins, spec, name)?.into_storage())
        }
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's attention kernels"))),
    })
}

/// The product.
fn matmul(op: &Op, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    let name = op.name();
    Ok(match op {
        Op::Matmul => {
            let ((sa, la), (sb, lb)) = (ins[0], ins[1]);
            let r = meta.shape.len();
            let (m, n) = (meta.shape[r - 2], meta.shape[r - 1]);
            let k = la.shape[la.rank() - 1];
            let s = matmul::MatmulShape { batch: &meta.shape[..r - 2], m, k, n };
            // The bias, if any, as a contiguous `[n]`.
            fn bias<'a, T: CpuSlice>(ins: &[(&'a CpuStorage, &Layout)], name: &'static str) -> Result<Option<Cow<'a, [T]>>> {
                ins.get(2).map(|(s, l)| Ok(contig(typed::<T>(s, name)?, l))).transpose()
            }
            match sa {
                CpuStorage::F32(a) => CpuStorage::F32(matmul::matmul((a, la), (typed(sb, name)?, lb), bias(ins, name)?.as_deref(), s)),
                CpuStorage::F64(a) => CpuStorage::F64(matmul::matmul((a, la), (typed(sb, name)?, lb), bias(ins, name)?.as_deref(), s)),
                CpuStorage::F16(a) => CpuStorage::F16(matmul::matmul((a, la), (typed(sb, name)?, lb), bias(ins, name)?.as_deref(), s)),
                CpuStorage::BF16(a) => {
                    CpuStorage::BF16(matmul::matmul_bf16((a, la), (typed(sb, name)?, lb), bias(ins, name)?.as_deref(), s))
                }
                _ => return Err(Error::dtype(name, format!("not defined for {:?}", sa.dtype()))),
            }
        }
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's matmul kernels"))),
    })
}

/// Indexing, argsort and concatenation.
fn indexing(op: &Op, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    let name = op.name();
    Ok(match op {
        Op::IndexSelect { dim } => {
            let ((s, l), (si, li)) = (ins[0], ins[1]);
            let idx = contig(typed::<i64>(si, name)?, li);
            with_cpu!(s, v => index::index_select(&contig(v, l), &l.shape, *dim, &idx)?.into_storage())
        }
        Op::ArgSort { descending } => {
            let (s, l) = ins[0];
            let n = l.shape[l.rank() - 1];
            CpuStorage::I64(with_cpu!(s, v => index::argsort(&contig(v, l), n, *descending)))
        }
        Op::Gather { dim } => {
            let ((s, l), (si, li)) = (ins[0], ins[1]);
            let idx = contig(typed::<i64>(si, name)?, li);
            with_cpu!(s, v => index::gather(&contig(v, l), &l.shape, *dim, &idx, &li.shape)?.into_storage())
        }
        Op::IndexAdd { .. } | Op::ScatterAdd { .. } if matches!(ins[0].0.dtype(), DType::F16 | DType::BF16) => {
            // Accumulated in F32 and rounded once, as the CUDA kernels do: rounding to 16 bits
            // at every add lost the small terms of long sums (an embedding's gradient).
            let wide = |(s, l): (&CpuStorage, &Layout)| {
                run(&Op::Cast(DType::F32), &[(s, l)], &OutMeta { shape: l.shape.clone(), dtype: DType::F32 })
            };
            let (base, src) = (wide(ins[0])?, wide(ins[2])?);
            let (lb, ls) = (Layout::contiguous(&ins[0].1.shape), Layout::contiguous(&ins[2].1.shape));
            let sum = run(op, &[(&base, &lb), ins[1], (&src, &ls)], &OutMeta { shape: meta.shape.clone(), dtype: DType::F32 })?;
            run(&Op::Cast(meta.dtype), &[(&sum, &Layout::contiguous(&meta.shape))], meta)?
        }
        Op::IndexAdd { dim } | Op::ScatterAdd { dim } => {
            let ((s, l), (si, li), (ss, ls)) = (ins[0], ins[1], ins[2]);
            let idx = contig(typed::<i64>(si, name)?, li);
            fn go<T: CpuSlice>(
                op: &Op,
                (base, l): (&[T], &Layout),
                (idx, li): (&[i64], &Layout),
                (ss, ls): (&CpuStorage, &Layout),
                dim: usize,
            ) -> Result<Vec<T>>
            where
                Vec<T>: IntoCpuStorage,
            {
                let mut out = ew::map1(base, l, |x| x);
                let src = contig(typed::<T>(ss, op.name())?, ls);
                if matches!(op, Op::IndexAdd { .. }) {
                    index::index_add(&mut out, &l.shape, dim, idx, &src)?;
                } else {
                    index::scatter_add(&mut out, &l.shape, dim, idx, &li.shape, &src)?;
                }
                Ok(out)
            }
            with_cpu!(s, v => go(op, (v, l), (&idx, li), (ss, ls), *dim)?.into_storage())
        }
        Op::Cat { dim } => {
            fn go<T: CpuSlice>(ins: &[(&CpuStorage, &Layout)], dim: usize, shape: &[usize]) -> Result<Vec<T>> {
                let parts: Vec<(&[T], &Layout)> = ins.iter().map(|(s, l)| Ok((typed::<T>(s, "cat")?, *l))).collect::<Result<_>>()?;
                Ok(index::cat(&parts, dim, shape))
            }
            match ins[0].0.dtype() {
                DType::F32 => CpuStorage::F32(go(ins, *dim, &meta.shape)?),
                DType::F64 => CpuStorage::F64(go(ins, *dim, &meta.shape)?),
                DType::F16 => CpuStorage::F16(go(ins, *dim, &meta.shape)?),
                DType::BF16 => CpuStorage::BF16(go(ins, *dim, &meta.shape)?),
                DType::I64 => CpuStorage::I64(go(ins, *dim, &meta.shape)?),
                DType::U8 => CpuStorage::U8(go(ins, *dim, &meta.shape)?),
            }
        }
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's indexing kernels"))),
    })
}

/// The fused ops (`Fused`): each a reference for its CUDA kernel, matching the unfused ops.
fn fused(op: &Op, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    let name = op.name();
    Ok(match op {
        Op::Fused(Fused::GatedSums { gate }) => {
            // The two ops as eager runs them, then y's sums over its rows after the tail offset.
            let ((a, h), dtype) = ((ins[0], ins[1]), meta.dtype);
            let (shape, n) = (a.1.shape.clone(), a.1.shape[a.1.rank() - 1]);
            let numel = a.1.numel();
            let like = OutMeta { shape: shape.clone(), dtype };
            let gated = run(&Op::Unary(*gate), &[h], &like)?;
            let y = run(&Op::Binary(crate::BinaryOp::Mul), &[a, (&gated, &Layout::contiguous(&shape))], &like)?;
            let sum = Op::Reduce { op: crate::ReduceOp::Sum, dims: vec![0], keepdim: false };
            let rows = Layout::contiguous(&[numel.checked_div(n).unwrap_or(0), n]);
            let sums = run(&sum, &[(&y, &rows)], &OutMeta { shape: vec![n], dtype })?;
            with_cpu!(&y, v => {
                let mut out = v.to_vec();
                out.resize(Parts::with_tail(&shape, &[n]).offset(Part::Tail)?, Default::default());
                out.extend_from_slice(typed(&sums, name)?);
                out.into_storage()
            })
        }
        Op::Fused(Fused::CrossEntropyMean { ignore_index, smoothing }) => cross_entropy_mean(ins, *ignore_index, *smoothing, meta.dtype)?,
        Op::Fused(Fused::LinearCrossEntropyMean { ignore_index, smoothing, drelu }) => {
            linear_cross_entropy_mean(ins, *ignore_index, *smoothing, *drelu, meta)?
        }
        Op::Fused(Fused::AttentionHeadsLast { scale, causal }) => {
            // [B, H, T, D], then the heads moved after T.
            let (b, h, t, d) = (ins[0].1.shape[0], ins[0].1.shape[1], ins[0].1.shape[2], ins[0].1.shape[3]);
            let plain = OutMeta { shape: vec![b, h, t, d], dtype: meta.dtype };
            let out = run(&Op::Attention { scale: *scale, causal: *causal }, ins, &plain)?;
            run(&Op::Contiguous, &[(&out, &Layout::contiguous(&plain.shape).permuted(&[0, 2, 1, 3]))], meta)?
        }
        Op::Fused(Fused::Matmul(e)) => matmul_fused(*e, ins, meta)?,
        Op::Fused(Fused::NormalizeTo { eps, to }) => {
            // In x's dtype, then cast.
            let plain =
                run(&Op::Normalize { eps: *eps, rms: false }, ins, &OutMeta { shape: meta.shape.clone(), dtype: ins[0].0.dtype() })?;
            run(&Op::Cast(*to), &[(&plain, &Layout::contiguous(&meta.shape))], meta)?
        }
        Op::Fused(Fused::LayerNormGrads { eps, sums, .. }) => layer_norm_grads(*eps, *sums, ins, meta)?,
        _ => return Err(Error::Msg(format!("{name}: not an op of the CPU's fused kernels"))),
    })
}

/// `Fused::CrossEntropyMean` through the unfused ops, as eager runs them: the rows' losses, their
/// sum over the count of real targets, and the backward with every row's gradient `1 / count`.
fn cross_entropy_mean(ins: &[(&CpuStorage, &Layout)], ignore_index: Option<i64>, smoothing: f64, dtype: DType) -> Result<CpuStorage> {
    let (rows, classes) = (ins[0].1.shape[0], ins[0].1.shape[1]);
    let meta = |shape: &[usize]| OutMeta { shape: shape.to_vec(), dtype };
    let losses = run(&Op::CrossEntropy { ignore_index, smoothing }, ins, &meta(&[rows]))?;
    let targets = contig(typed::<i64>(ins[1].0, "cross_entropy_mean")?, ins[1].1);
    let count = targets.iter().filter(|&&t| Some(t) != ignore_index).count() as f64;
    let sum = Op::Reduce { op: crate::ReduceOp::Sum, dims: vec![0], keepdim: false };
    let total = run(&sum, &[(&losses, &Layout::contiguous(&[rows]))], &meta(&[]))?;
    let by_count = Op::Scalar { op: crate::BinaryOp::Div, value: count, scalar_lhs: false };
    let loss = run(&by_count, &[(&total, &Layout::contiguous(&[]))], &meta(&[]))?;
    let one = run(&Op::Full { shape: vec![], value: 1.0, dtype }, &[], &meta(&[]))?;
    let scale = run(&by_count, &[(&one, &Layout::contiguous(&[]))], &meta(&[]))?;
    let per_row = Layout { shape: vec![rows], strides: vec![0], offset: 0 };
    let backward = Op::CrossEntropyBackward { ignore_index, smoothing };
    let grad = run(&backward, &[ins[0], ins[1], (&scale, &per_row)], &meta(&[rows, classes]))?;
    Ok(with_cpu!(&loss, l => {
        let mut v = l.to_vec();
        v.resize(Parts::cross_entropy_mean(rows, classes).offset(Part::Dx)?, Default::default());
        v.extend_from_slice(typed(&grad, "cross_entropy_mean")?);
        v.into_storage()
    }))
}

/// `Fused::LinearCrossEntropyMean` from the unfused ops it stands for: the head's product, the
/// mean cross-entropy, the weight and bias gradients (`SumLeft`) and h's gradient.
fn linear_cross_entropy_mean(
    ins: &[(&CpuStorage, &Layout)],
    ignore_index: Option<i64>,
    smoothing: f64,
    drelu: bool,
    meta: &OutMeta,
) -> Result<CpuStorage> {
    let [h, w, bias, targets] = [ins[0], ins[1], ins[2], ins[3]];
    let (n, c, f) = (h.1.shape[0], w.1.shape[0], h.1.shape[1]);
    let with_shape = |shape: Vec<usize>| OutMeta { shape, dtype: meta.dtype };
    let wt = Layout { shape: vec![f, c], strides: vec![w.1.strides[1], w.1.strides[0]], offset: w.1.offset };
    let logits = run(&Op::Matmul, &[h, (w.0, &wt), bias], &with_shape(vec![n, c]))?;
    let xent = Op::Fused(Fused::CrossEntropyMean { ignore_index, smoothing });
    let xent_parts = Parts::cross_entropy_mean(n, c);
    let ce = run(&xent, &[(&logits, &Layout::contiguous(&[n, c])), targets], &with_shape(vec![xent_parts.len()]))?;
    let g = xent_parts.view(Part::Dx)?;
    let gt = Layout { shape: vec![c, n], strides: vec![1, c], offset: g.offset };
    let sums = Parts::with_tail(&[c, f], &[c]);
    let dw = run(&Op::Fused(Fused::Matmul(MatmulEpilogue::SumLeft)), &[(&ce, &gt), h], &with_shape(vec![sums.len()]))?;
    let dh = match drelu {
        true => run(&Op::Fused(Fused::Matmul(MatmulEpilogue::DRelu)), &[(&ce, &g), w, h], &with_shape(vec![n, f]))?,
        false => run(&Op::Matmul, &[(&ce, &g), w], &with_shape(vec![n, f]))?,
    };
    let parts = Parts::linear_cross_entropy_mean(n, c, f);
    let (dw_at, dh_at) = (parts.offset(Part::Dw)?, parts.offset(Part::Dx)?);
    Ok(with_cpu!(&ce, loss => {
        let mut v = vec![Default::default(); parts.len()];
        v[0] = loss[0];
        let dw = typed(&dw, "linear_cross_entropy_mean")?;
        v[dw_at..dw_at + dw.len()].copy_from_slice(dw);
        v[dh_at..].copy_from_slice(typed(&dh, "linear_cross_entropy_mean")?);
        v.into_storage()
    }))
}

/// `Fused::Matmul`: the product, then the rest through the same kernels as the unfused
/// ops, so compiled CPU steps match eager ones exactly.
fn matmul_fused(e: MatmulEpilogue, ins: &[(&CpuStorage, &Layout)], meta: &OutMeta) -> Result<CpuStorage> {
    use crate::UnaryOp;
    let dense = |shape: &[usize]| Layout::contiguous(shape);
    let with_shape = |shape: Vec<usize>| OutMeta { shape, dtype: meta.dtype };
    match e {
        MatmulEpilogue::Relu => {
            let product = run(&Op::Matmul, ins, meta)?;
            run(&Op::Unary(UnaryOp::Relu), &[(&product, &dense(&meta.shape))], meta)
        }
        MatmulEpilogue::GeluTanh => {
            // The product's shape, as the shape rule gives it.
            let pm =
                Op::Matmul.infer(&ins.iter().map(|(s, l)| crate::op::InMeta { shape: &l.shape, dtype: s.dtype() }).collect::<Vec<_>>())?;
            let product = run(&Op::Matmul, ins, &pm)?;
            let act = run(&Op::Unary(UnaryOp::GeluTanh), &[(&product, &dense(&pm.shape))], &pm)?;
            append(&act, &product)
        }
        MatmulEpilogue::DGeluTanh | MatmulEpilogue::DRelu => {
            let product = run(&Op::Matmul, &ins[..2], meta)?;
            let u = e.activation_grad().ok_or_else(|| crate::Error::Msg("matmul: no activation gradient".into()))?;
            let grad = run(&Op::Unary(u), &ins[2..], meta)?;
            let l = dense(&meta.shape);
            run(&Op::Binary(crate::BinaryOp::Mul), &[(&product, &l), (&grad, &l)], meta)
        }
        MatmulEpilogue::Residual => {
            // (A 16-bit product joining an F32 residual is rounded, then widened: the CPU
            // keeps eager's bits; a GPU epilogue adds the unrounded product. A bias of r's
            // dtype, not the operands', is added after the widening.)
            let (dtype, l) = (ins[0].0.dtype(), dense(&meta.shape));
            let late_bias = ins.get(3).filter(|b| b.0.dtype() != dtype);
            let ab: Vec<(&CpuStorage, &Layout)> = if late_bias.is_some() { ins[..2].to_vec() } else { [&ins[..2], &ins[3..]].concat() };
            let mut sum = run(&Op::Matmul, &ab, &OutMeta { shape: meta.shape.clone(), dtype })?;
            if dtype != meta.dtype {
                sum = run(&Op::Cast(meta.dtype), &[(&sum, &l)], meta)?;
            }
            if let Some(&bias) = late_bias {
                sum = run(&Op::Binary(crate::BinaryOp::Add), &[(&sum, &l), bias], meta)?;
            }
            run(&Op::Binary(crate::BinaryOp::Add), &[(&sum, &l), ins[2]], meta)
        }
        MatmulEpilogue::SumLeft | MatmulEpilogue::SumRight => {
            let s = matmul::MatmulShape { batch: &[], m: ins[0].1.shape[0], k: ins[0].1.shape[1], n: ins[1].1.shape[1] };
            match matmul_by_tiles(&Op::Fused(Fused::Matmul(e)), ins, meta, s.m, &|_, _, _| {})? {
                Some(out) => Ok(out),
                // F16 and BF16 (rare here): the product, then a copy into the longer buffer.
                None => {
                    let product = run(&Op::Matmul, ins, &with_shape(vec![s.m, s.n]))?;
                    append(&product, &operand_sums(e, ins, meta.dtype)?)
                }
            }
        }
    }
}

/// A fused matmul's operand sums: the left operand's rows (`SumLeft`, `[m]`) or the right's
/// columns (`SumRight`, `[n]`).
fn operand_sums(e: MatmulEpilogue, ins: &[(&CpuStorage, &Layout)], dtype: DType) -> Result<CpuStorage> {
    let (src, dim) = if e == MatmulEpilogue::SumLeft { (ins[0], 1) } else { (ins[1], 0) };
    let len = src.1.shape[1 - dim];
    run(&Op::Reduce { op: crate::ReduceOp::Sum, dims: vec![dim], keepdim: false }, &[src], &OutMeta { shape: vec![len], dtype })
}

/// Compile's CPU back end: a 2-D `Matmul` (bias optional) or a `Fused::Matmul` with operand
/// sums, in F32 or F64, computed `tile` rows at a time with `after` run on each tile of the
/// product as soon as it is made (`matmul::by_tiles`). None (nothing run) for any other op,
/// dtype or rank. The sums and padding of a fused output are written before the product.
pub fn matmul_by_tiles(
    op: &Op,
    ins: &[(&CpuStorage, &Layout)],
    meta: &OutMeta,
    tile: usize,
    after: &matmul::TileFn,
) -> Result<Option<CpuStorage>> {
    let fused_sums = match op {
        Op::Matmul => None,
        Op::Fused(Fused::Matmul(e @ (MatmulEpilogue::SumLeft | MatmulEpilogue::SumRight))) => Some(*e),
        _ => return Ok(None),
    };
    if ins.len() < 2 || ins[0].1.rank() != 2 || ins[1].1.rank() != 2 || !matches!(meta.dtype, DType::F32 | DType::F64) {
        return Ok(None);
    }
    let (m, k, n) = (ins[0].1.shape[0], ins[0].1.shape[1], ins[1].1.shape[1]);
    let sums = fused_sums.map(|e| operand_sums(e, ins, meta.dtype)).transpose()?;
    fn go<T: matmul::GemmElem + CpuSlice>(
        ins: &[(&CpuStorage, &Layout)],
        s: matmul::MatmulShape,
        sums: Option<&CpuStorage>,
        tile: usize,
        after: &matmul::TileFn,
    ) -> Result<Vec<T>> {
        let mn = s.m * s.n;
        let at = match sums {
            Some(t) => Parts::with_tail(&[s.m, s.n], &[t.len()]).offset(Part::Tail)?,
            None => mn,
        };
        let mut v = pool::take::<T>(at + sums.map_or(0, |t| t.len()));
        v[mn..at].fill(T::zero());
        if let Some(t) = sums {
            v[at..].copy_from_slice(typed::<T>(t, "matmul_sum")?);
        }
        let bias = ins.get(2).map(|(b, l)| Ok::<_, Error>(contig(typed::<T>(b, "matmul")?, l))).transpose()?;
        let (a, b) = ((typed::<T>(ins[0].0, "matmul")?, ins[0].1), (typed::<T>(ins[1].0, "matmul")?, ins[1].1));
        matmul::by_tiles(a, b, bias.as_deref(), s, &mut v, tile.min(s.m), after);
        Ok(v)
    }
    let s = matmul::MatmulShape { batch: &[], m, k, n };
    Ok(Some(match meta.dtype {
        DType::F32 => CpuStorage::F32(go(ins, s, sums.as_ref(), tile, after)?),
        _ => CpuStorage::F64(go(ins, s, sums.as_ref(), tile, after)?),
    }))
}

/// `head`, zeros up to the tail's aligned start, then `tail`: a fused matmul's flat output
/// (`Parts::with_tail`).
fn append(head: &CpuStorage, tail: &CpuStorage) -> Result<CpuStorage> {
    let at = Parts::with_tail(&[head.len()], &[tail.len()]).offset(Part::Tail)?;
    Ok(with_cpu!(head, h => {
        let mut v = Vec::with_capacity(at + tail.len());
        v.extend_from_slice(h);
        v.resize(at, Default::default());
        v.extend_from_slice(typed(tail, "matmul_fused")?);
        v.into_storage()
    }))
}

/// Runs an in-place op on `dst`; `src` is the second input where the op has one.
pub fn run_inplace(op: &Op, dst: &mut CpuStorage, ld: &Layout, src: Option<(&CpuStorage, &Layout)>) -> Result<()> {
    let name = op.name();
    match dst {
        CpuStorage::F32(d) => float_update(op, name, d, ld, src),
        CpuStorage::F64(d) => float_update(op, name, d, ld, src),
        CpuStorage::F16(d) => float_update(op, name, d, ld, src),
        CpuStorage::BF16(d) => float_update(op, name, d, ld, src),
        CpuStorage::I64(d) => int_update(op, name, d, ld, src),
        CpuStorage::U8(d) => int_update(op, name, d, ld, src),
    }
}

fn float_update<T: ew::Compute + CpuSlice>(
    op: &Op,
    name: &'static str,
    d: &mut [T],
    ld: &Layout,
    src: Option<(&CpuStorage, &Layout)>,
) -> Result<()> {
    let source = || src.ok_or_else(|| Error::Msg(format!("{name}: no source tensor")));
    match op {
        Op::Assign => {
            let (s, ls) = source()?;
            ew::update(d, ld, typed::<T>(s, name)?, ls, |_, y| y);
        }
        Op::UpdateBinary(b) => {
            let (s, ls) = source()?;
            let s = typed::<T>(s, name)?;
            ew::per_binary!(*b, OP => ew::update(d, ld, s, ls, |x: T, y: T| T::down(OP.eval(x.up(), y.up()))));
        }
        Op::UpdateScalar(b, v) => {
            let v = <T::F as crate::op::Float>::c(*v);
            ew::per_binary!(*b, OP => ew::update_scalar(d, ld, |x: T| T::down(OP.eval(x.up(), v))));
        }
        _ => return Err(Error::Msg(format!("{name}: not an in-place op"))),
    }
    Ok(())
}

fn int_update<T: CpuSlice>(op: &Op, name: &'static str, d: &mut [T], ld: &Layout, src: Option<(&CpuStorage, &Layout)>) -> Result<()> {
    let f = |b: crate::op::BinaryOp, x: T, y: f64| T::from_f64(b.eval_int(x.to_f64() as i64, y as i64) as f64);
    let source = || src.ok_or_else(|| Error::Msg(format!("{name}: no source tensor")));
    match op {
        Op::Assign => {
            let (s, ls) = source()?;
            ew::update(d, ld, typed::<T>(s, name)?, ls, |_, y| y);
        }
        Op::UpdateBinary(b) => {
            let (s, ls) = source()?;
            ew::update(d, ld, typed::<T>(s, name)?, ls, |x, y| f(*b, x, y.to_f64()));
        }
        Op::UpdateScalar(b, v) => ew::update_scalar(d, ld, |x| f(*b, x, *v)),
        _ => return Err(Error::Msg(format!("{name}: not an in-place op"))),
    }
    Ok(())
}
