//! Llama's blocks built from tensor ops: rotary embeddings against their definition (a loop
//! over pairs of dims), at an offset, and by finite differences; SwiGLU against its formula;
//! `repeat_kv` against indexing; grouped-query attention against attention on repeated heads.

use kiln_autograd::{gradcheck, GradcheckConfig};
use kiln_nn::{repeat_kv, scaled_dot_product_attention, AttnMasks, Forward, Module, RotaryEmbedding, SwiGlu};
use kiln_tensor::{DType, Device, Distribution, Result, Tensor};

const CPU: Device = Device::Cpu;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F64, CPU).unwrap()
}

#[test]
fn rope_rotates_each_pair_of_dims_by_its_angle() -> Result<()> {
    let (h, t, d, theta) = (2, 5, 8, 10000.0f64);
    let rope = RotaryEmbedding::new(d, 16, theta, DType::F64, CPU)?;
    let x = randn(&[1, h, t, d], 1);
    let y = rope.apply(&x, 3)?.to_vec::<f64>()?;
    let xv = x.to_vec::<f64>()?;
    let half = d / 2;
    for head in 0..h {
        for p in 0..t {
            let base = (head * t + p) * d;
            for j in 0..half {
                let a = (p + 3) as f64 * theta.powf(-2.0 * j as f64 / d as f64);
                let (x1, x2) = (xv[base + j], xv[base + j + half]);
                let (y1, y2) = (x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin());
                assert!((y[base + j] - y1).abs() < 1e-12 && (y[base + j + half] - y2).abs() < 1e-12, "head {head} pos {p} dim {j}");
            }
        }
    }
    Ok(())
}

#[test]
fn rope_at_an_offset_is_the_full_sequence_rope_sliced() -> Result<()> {
    let rope = RotaryEmbedding::new(4, 10, 10000.0, DType::F32, CPU)?;
    let x = randn(&[2, 3, 7, 4], 2).to_dtype(DType::F32)?;
    let full = rope.apply(&x, 0)?.narrow(2, 4, 3)?;
    let tail = rope.apply(&x.narrow(2, 4, 3)?, 4)?;
    assert_eq!(full.to_vec::<f32>()?, tail.to_vec::<f32>()?);
    // Past the table, or the wrong head size: errors naming the shapes.
    let err = rope.apply(&x, 5).unwrap_err().to_string();
    assert!(err.contains("5..12") && err.contains("10"), "{err}");
    let err = rope.apply(&x.narrow(3, 0, 2)?, 0).unwrap_err().to_string();
    assert!(err.contains("[2, 3, 7, 2]"), "{err}");
    assert!(RotaryEmbedding::new(5, 4, 10000.0, DType::F32, CPU).is_err());
    Ok(())
}

#[test]
fn rope_backward_matches_finite_differences() {
    let rope = RotaryEmbedding::new(6, 8, 100.0, DType::F64, CPU).unwrap();
    let err = gradcheck(|v| rope.apply(&v[0], 2)?.square()?.sum_all(), &[randn(&[2, 4, 6], 3)], GradcheckConfig::default()).unwrap();
    assert!(err < 1e-6, "gradcheck error {err}");
}

#[test]
fn swiglu_is_down_of_silu_gate_times_up() -> Result<()> {
    let m = SwiGlu::new(4, 6, CPU)?;
    let names: Vec<String> = m.named_parameters().into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]);
    let x = randn(&[3, 4], 4).to_dtype(DType::F32)?;
    let (g, u, dw) = (m.gate_proj.weight.to_vec::<f32>()?, m.up_proj.weight.to_vec::<f32>()?, m.down_proj.weight.to_vec::<f32>()?);
    let xv = x.to_vec::<f32>()?;
    let y = m.forward(&x)?.to_vec::<f32>()?;
    for r in 0..3 {
        let dot = |w: &[f32], o: usize| (0..4).map(|i| f64::from(w[o * 4 + i]) * f64::from(xv[r * 4 + i])).sum::<f64>();
        let hidden: Vec<f64> = (0..6).map(|o| dot(&g, o) / (1.0 + (-dot(&g, o)).exp()) * dot(&u, o)).collect();
        for o in 0..4 {
            let want: f64 = (0..6).map(|k| f64::from(dw[o * 6 + k]) * hidden[k]).sum();
            assert!((f64::from(y[r * 4 + o]) - want).abs() < 1e-5, "row {r} out {o}");
        }
    }
    Ok(())
}

#[test]
fn repeat_kv_repeats_each_head_in_place() -> Result<()> {
    let x = randn(&[2, 3, 4, 5], 5);
    let y = repeat_kv(&x, 2)?;
    assert_eq!(y.shape(), &[2, 6, 4, 5]);
    for b in 0..2 {
        for h in 0..6 {
            assert_eq!(y.narrow(0, b, 1)?.narrow(1, h, 1)?.to_vec::<f64>()?, x.narrow(0, b, 1)?.narrow(1, h / 2, 1)?.to_vec::<f64>()?);
        }
    }
    assert!(repeat_kv(&x.narrow(0, 0, 1)?.squeeze(0)?, 2).is_err());
    assert!(repeat_kv(&x, 0).is_err());
    Ok(())
}

/// The fused attention op with grouped-query k and v (`[B, H_kv, T, D]`, `H_kv` dividing `H`)
/// equals the op on k and v repeated to q's heads, forward and backward (dk and dv summed over
/// each group), causal or not; shapes that do not pair are errors naming them.
#[test]
fn grouped_query_attention_equals_attention_on_repeated_heads() -> Result<()> {
    use kiln_autograd::grad;
    let rand = |shape: &[usize], seed: u64| Tensor::rand_at(shape, kiln_tensor::Distribution::Normal, seed, 0, DType::F64, Device::Cpu);
    for (h, hkv, causal) in [(4, 2, true), (6, 1, false), (3, 3, true)] {
        let (q, k, v) = (rand(&[2, h, 5, 8], 1)?, rand(&[2, hkv, 5, 8], 2)?, rand(&[2, hkv, 5, 8], 3)?);
        let w = rand(&[2, h, 5, 8], 4)?;
        [&q, &k, &v].iter().for_each(|t| _ = t.set_requires_grad(true));
        let grouped = q.attention(&k, &v, 0.35, causal)?;
        let repeated = q.attention(&repeat_kv(&k, h / hkv)?, &repeat_kv(&v, h / hkv)?, 0.35, causal)?;
        let (a, b) = (grouped.to_vec::<f64>()?, repeated.to_vec::<f64>()?);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-12), "forward H {h} H_kv {hkv}");
        let ga = grad(&grouped.mul(&w)?.sum_all()?, &[&q, &k, &v])?;
        let gb = grad(&repeated.mul(&w)?.sum_all()?, &[&q, &k, &v])?;
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
            assert_eq!(x.shape(), y.shape());
            let close = x.to_vec::<f64>()?.iter().zip(y.to_vec::<f64>()?).all(|(p, q)| (p - q).abs() < 1e-12);
            assert!(close, "gradient {i} of H {h} H_kv {hkv} causal {causal}");
        }
    }
    let (q, k) = (rand(&[2, 4, 5, 8], 1)?, rand(&[2, 3, 5, 8], 2)?);
    let e = q.attention(&k, &k, 1.0, false).unwrap_err().to_string();
    assert!(e.contains("[2, 4, 5, 8]") && e.contains("[2, 3, 5, 8]") && e.contains("H_kv"), "{e}");
    Ok(())
}

/// The fused op with S keys for T queries (a decoding step over the cache): query i sits at
/// position i + S - T, so causally it sees keys 0..=i + S - T, the rows `causal_attention_at`
/// masks explicitly; with grouped-query heads; its backward (through the scores) equals the
/// explicit mask's; the fused backward refuses unequal lengths, naming them.
#[test]
fn attention_over_more_keys_than_queries_is_the_masked_attention() -> Result<()> {
    use kiln_autograd::grad;
    let rand = |shape: &[usize], seed: u64| Tensor::rand_at(shape, kiln_tensor::Distribution::Normal, seed, 0, DType::F64, Device::Cpu);
    for (h, hkv, t, s) in [(4, 2, 3, 7), (2, 2, 1, 6), (3, 1, 4, 4)] {
        let (q, k, v) = (rand(&[2, h, t, 8], 11)?, rand(&[2, hkv, s, 8], 12)?, rand(&[2, hkv, s, 8], 13)?);
        let w = rand(&[2, h, t, 8], 14)?;
        [&q, &k, &v].iter().for_each(|x| _ = x.set_requires_grad(true));
        let fused = q.attention(&k, &v, 1.0 / 8f64.sqrt(), true)?;
        // The explicit form: q at positions s - t .. s, keys after a query's position hidden.
        let (kr, vr) = (repeat_kv(&k, h / hkv)?, repeat_kv(&v, h / hkv)?);
        let i = Tensor::arange(t, DType::I64, Device::Cpu)?.add_scalar((s - t) as f64)?;
        let hide = Tensor::arange(s, DType::I64, Device::Cpu)?.reshape(&[1, s])?.gt(&i.reshape(&[t, 1])?)?;
        let masks = AttnMasks { attn_mask: Some(&hide), ..Default::default() };
        let masked = scaled_dot_product_attention(&q, &kr, &vr, &masks, 0.0)?;
        let (a, b) = (fused.to_vec::<f64>()?, masked.to_vec::<f64>()?);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-12), "forward H {h} H_kv {hkv} T {t} S {s}");
        let ga = grad(&fused.mul(&w)?.sum_all()?, &[&q, &k, &v])?;
        let gb = grad(&masked.mul(&w)?.sum_all()?, &[&q, &k, &v])?;
        for (n, (x, y)) in ga.iter().zip(&gb).enumerate() {
            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
            assert_eq!(x.shape(), y.shape());
            let close = x.to_vec::<f64>()?.iter().zip(y.to_vec::<f64>()?).all(|(p, q)| (p - q).abs() < 1e-12);
            assert!(close, "gradient {n} of H {h} H_kv {hkv} T {t} S {s}");
        }
    }
    let (q, k) = (rand(&[1, 2, 3, 4], 1)?, rand(&[1, 2, 5, 4], 2)?);
    let o = q.attention(&k, &k, 0.5, true)?;
    let e = q.attention_backward(&k, &k, &o, &o, 0.5, true).unwrap_err().to_string();
    assert!(e.contains("[1, 2, 3, 4]") && e.contains("[1, 2, 5, 4]"), "{e}");
    Ok(())
}

/// `split_heads` gives head h of token t as the columns `h D..(h + 1) D` of the projection
/// (PyTorch's `view(B, T, H, D).transpose(1, 2)`), `merge_heads` puts them back; shapes that
/// do not split are errors naming them.
#[test]
fn split_heads_and_merge_heads_are_pytorchs_view_and_transpose() -> Result<()> {
    use kiln_nn::{merge_heads, split_heads};
    let x = Tensor::from_vec((0..48).map(|v| v as f64).collect(), &[2, 3, 8], Device::Cpu)?;
    let h = split_heads(&x, 4)?;
    assert_eq!(h.shape(), [2, 4, 3, 2]);
    let (hv, xv) = (h.contiguous()?.to_vec::<f64>()?, x.to_vec::<f64>()?);
    for (b, hh, t, d) in (0..2).flat_map(|b| (0..4).flat_map(move |hh| (0..3).flat_map(move |t| (0..2).map(move |d| (b, hh, t, d))))) {
        assert_eq!(hv[((b * 4 + hh) * 3 + t) * 2 + d], xv[(b * 3 + t) * 8 + hh * 2 + d]);
    }
    assert_eq!(merge_heads(&h)?.to_vec::<f64>()?, xv);
    let e = split_heads(&x, 3).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 8]") && e.contains("H = 3"), "{e}");
    assert!(merge_heads(&x).unwrap_err().to_string().contains("[2, 3, 8]"));
    Ok(())
}
