//! Products over every operand layout against a loop over the logical elements: sequence-first
//! activations (a batch folded into the rows of one product), permuted and transposed
//! operands (packed once), broadcast batches on either side, 4-D batches, a bias, and 16-bit
//! dtypes.

use kiln_tensor::{DType, Device, Result, Tensor};

/// `a @ b (+ bias)` over the logical elements of `a [..batch, m, k]` and `b [..batch, k, n]`
/// (batch dims broadcast), in f64.
fn reference(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<(Vec<usize>, Vec<f64>)> {
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let nbatch = ra.max(rb) - 2;
    let pad = |s: &[usize]| [vec![1; nbatch - s.len()], s.to_vec()].concat();
    let (sa, sb) = (pad(&a.shape()[..ra - 2]), pad(&b.shape()[..rb - 2]));
    let batch: Vec<usize> = sa.iter().zip(&sb).map(|(x, y)| *x.max(y)).collect();
    let a = a.broadcast_to(&[batch.clone(), vec![m, k]].concat())?.to_vec_f64()?;
    let b = b.broadcast_to(&[batch.clone(), vec![k, n]].concat())?.to_vec_f64()?;
    let bias = bias.map(|t| t.to_vec_f64()).transpose()?;
    let nb: usize = batch.iter().product();
    let mut out = vec![0.0; nb * m * n];
    for t in 0..nb {
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k).map(|p| a[t * m * k + i * k + p] * b[t * k * n + p * n + j]).sum();
                out[t * m * n + i * n + j] = dot + bias.as_ref().map_or(0.0, |v| v[j]);
            }
        }
    }
    Ok(([batch, vec![m, n]].concat(), out))
}

fn check(what: &str, a: &Tensor, b: &Tensor, bias: Option<&Tensor>, tol: f64) -> Result<()> {
    let got = match bias {
        Some(c) => a.matmul_bias(b, c)?,
        None => a.matmul(b)?,
    };
    let (shape, want) = reference(a, b, bias)?;
    assert_eq!(got.shape(), &shape[..], "{what}: shape");
    for (i, (g, w)) in got.to_vec_f64()?.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i} is {g}, the reference {w}");
    }
    Ok(())
}

fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32, Device::Cpu)
}

#[test]
fn sequence_first_activations_times_a_weight() -> Result<()> {
    kiln_tensor::rng::manual_seed(1);
    let (x, w, bias) = (randn(&[10, 4, 6])?, randn(&[5, 6])?, randn(&[5])?);
    // nn.Linear on `[seq, batch, d]`: x @ W^T, with and without the bias.
    check("x @ W^T", &x, &w.t()?, None, 1e-5)?;
    check("x @ W^T + b", &x, &w.t()?, Some(&bias), 1e-5)?;
    // A contiguous weight, and a 4-D batch.
    check("x @ W", &x, &randn(&[6, 5])?, None, 1e-5)?;
    check("4-D @ W^T", &randn(&[2, 3, 4, 6])?, &w.t()?, Some(&bias), 1e-5)?;
    // The weight as a `[1, k, n]` batch broadcast over the activation's batch.
    check("x @ W[None]", &x, &randn(&[1, 6, 5])?, None, 1e-5)?;
    Ok(())
}

#[test]
fn permuted_and_transposed_activations() -> Result<()> {
    kiln_tensor::rng::manual_seed(2);
    let w = randn(&[5, 6])?;
    // Batch-first views of sequence-first data, and the reverse: batch and row dims that do
    // not walk as one stride.
    let seq_first = randn(&[10, 4, 6])?;
    check("permuted (1, 0, 2)", &seq_first.permute(&[1, 0, 2])?, &w.t()?, None, 1e-5)?;
    check("permuted, bias", &randn(&[4, 10, 6])?.permute(&[1, 0, 2])?, &w.t()?, Some(&randn(&[5])?), 1e-5)?;
    // Rows and columns swapped (a transposed activation) and a batch broadcast from size 1.
    check("transposed", &randn(&[3, 6, 4])?.transpose(1, 2)?, &w.t()?, None, 1e-5)?;
    check("expanded batch", &randn(&[1, 4, 6])?.expand(&[3, 4, 6])?, &w.t()?, None, 1e-5)?;
    // A narrowed feature dim (row stride larger than k).
    check("narrowed k", &randn(&[10, 4, 8])?.narrow(2, 1, 6)?, &w.t()?, None, 1e-5)?;
    Ok(())
}

#[test]
fn batched_right_operands_keep_one_product_per_entry() -> Result<()> {
    kiln_tensor::rng::manual_seed(3);
    check("bmm", &randn(&[3, 4, 6])?, &randn(&[3, 6, 5])?, None, 1e-5)?;
    check("a broadcast over b's batch", &randn(&[4, 6])?, &randn(&[3, 6, 5])?, None, 1e-5)?;
    check("attention-like", &randn(&[2, 8, 10, 16])?, &randn(&[2, 8, 10, 16])?.transpose(2, 3)?, None, 1e-5)?;
    Ok(())
}

#[test]
fn sixteen_bit_products_fold_too() -> Result<()> {
    kiln_tensor::rng::manual_seed(4);
    for dt in [DType::BF16, DType::F16, DType::F64] {
        let x = randn(&[10, 4, 6])?.to_dtype(dt)?;
        let w = randn(&[5, 6])?.to_dtype(dt)?;
        let tol = if dt == DType::F64 { 1e-12 } else { 2e-2 };
        check(&format!("{dt:?} x @ W^T"), &x, &w.t()?, None, tol)?;
        check(&format!("{dt:?} permuted"), &x.permute(&[1, 0, 2])?, &w.t()?, None, tol)?;
    }
    Ok(())
}

/// Products large enough to spread over the threads: by column blocks (wide), by rows
/// (narrow: too few columns to split), with transposed, permuted and sequence-first operands
/// and a bias.
#[test]
fn products_split_over_threads_keep_every_layout() -> Result<()> {
    kiln_tensor::rng::manual_seed(5);
    let (w, bias) = (randn(&[512, 96])?, randn(&[512])?);
    let seq_first = randn(&[16, 8, 96])?;
    check("wide, sequence-first @ W^T + b", &seq_first, &w.t()?, Some(&bias), 1e-4)?;
    check("wide, permuted @ W^T", &seq_first.permute(&[1, 0, 2])?, &w.t()?, None, 1e-4)?;
    check("wide, transposed left", &randn(&[96, 128])?.t()?, &randn(&[96, 512])?, None, 1e-4)?;
    let narrow = randn(&[96, 8])?;
    check("narrow, many rows", &randn(&[4096, 96])?, &narrow, None, 1e-4)?;
    check("narrow, permuted rows", &randn(&[64, 64, 96])?.permute(&[1, 0, 2])?, &narrow, None, 1e-4)?;
    Ok(())
}
