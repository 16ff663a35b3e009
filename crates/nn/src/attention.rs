//! Multi-head attention with PyTorch's `nn.MultiheadAttention` semantics and parameter names.
//! Shapes: B batch, T target length, S source length, E embed dim, H heads, D = E / H.

use crate::init::{param, xavier_uniform};
use crate::layers::{dropout, Linear};
use crate::module::Forward;
use kiln_derive::Module;
use kiln_tensor::{default_dtype, DType, Device, Error, Flag, Result, Tensor};

/// Masks for one attention call. U8 masks mark positions to hide with 1 (PyTorch's bool
/// True); a float `attn_mask` is added to the scores instead.
#[derive(Debug, Clone, Default)]
pub struct AttnMasks<'a> {
    /// `[T, S]` or `[B * H, T, S]`.
    pub attn_mask: Option<&'a Tensor>,
    /// `[B, S]`, 1 where a key is padding.
    pub key_padding_mask: Option<&'a Tensor>,
    /// Hide future positions (key index > query index).
    pub is_causal: bool,
}

impl AttnMasks<'_> {
    /// Only the causal mask: `AttnMasks { is_causal: true, ..Default::default() }`.
    pub fn causal() -> AttnMasks<'static> {
        AttnMasks { is_causal: true, ..Default::default() }
    }
}

/// The heads of a projection as attention takes them: `[B, T, H * D]` as `[B, H, T, D]`
/// (`x.view(B, T, H, D).transpose(1, 2)` in PyTorch).
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    match *x.shape() {
        [b, t, c] if heads > 0 && c.is_multiple_of(heads) => x.reshape(&[b, t, heads, c / heads])?.transpose(1, 2),
        _ => Err(Error::shape("split_heads", format!("needs [B, T, H * D] with H = {heads} dividing the last dim, got {:?}", x.shape()))),
    }
}

/// Attention's heads back side by side: `[B, H, T, D]` as `[B, T, H * D]`, what the output
/// projection reads (`y.transpose(1, 2).reshape(B, T, C)`).
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    match *x.shape() {
        [b, h, t, d] => x.transpose(1, 2)?.reshape(&[b, t, h * d]),
        _ => Err(Error::shape("merge_heads", format!("needs [B, H, T, D], got {:?}", x.shape()))),
    }
}

/// `[n, n]` U8 mask with 1 above the diagonal (future positions).
pub fn causal_mask(n: usize, device: Device) -> Result<Tensor> {
    let i = Tensor::arange(n, DType::I64, device)?;
    i.reshape(&[1, n])?.gt(&i.reshape(&[n, 1])?)
}

#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct MultiheadAttention {
    /// `[3E, E]`: the query, key and value projections stacked.
    pub in_proj_weight: Tensor,
    /// `[3E]`.
    pub in_proj_bias: Tensor,
    pub out_proj: Linear,
    pub num_heads: usize,
    pub dropout: f64,
    pub batch_first: bool,
    pub training: Flag,
}

impl MultiheadAttention {
    pub fn new(embed_dim: usize, num_heads: usize, dropout: f64, batch_first: bool, device: Device) -> Result<MultiheadAttention> {
        if num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(Error::shape("multihead_attention", format!("embed_dim {embed_dim} is not divisible by num_heads {num_heads}")));
        }
        let out_proj = Linear::new(embed_dim, embed_dim, true, device)?;
        if let Some(b) = &out_proj.bias {
            kiln_tensor::no_grad(|| b.zero_())?;
        }
        Ok(MultiheadAttention {
            in_proj_weight: param(xavier_uniform(&[3 * embed_dim, embed_dim], default_dtype(), device)?),
            in_proj_bias: param(Tensor::zeros(&[3 * embed_dim], default_dtype(), device)?),
            out_proj,
            num_heads,
            dropout,
            batch_first,
            training: Flag::new(true),
        })
    }

    fn embed_dim(&self) -> usize {
        self.in_proj_weight.shape()[1]
    }

    /// Rows `i*E..(i+1)*E` of the stacked projection (i = 0 query, 1 key, 2 value).
    fn project(&self, x: &Tensor, i: usize) -> Result<Tensor> {
        let e = self.embed_dim();
        let w = self.in_proj_weight.narrow(0, i * e, e)?;
        let b = self.in_proj_bias.narrow(0, i * e, e)?;
        x.linear(&w, Some(&b))
    }

    /// `[B, L, E]` to `[B, H, L, D]`.
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, l, e) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        x.reshape(&[b, l, self.num_heads, e / self.num_heads])?.transpose(1, 2)
    }

    /// Attention of `query` over `key`/`value`; returns the output only (need_weights=False).
    pub fn forward(&self, query: &Tensor, key: &Tensor, value: &Tensor, masks: &AttnMasks) -> Result<Tensor> {
        let e = self.embed_dim();
        for (name, t) in [("query", query), ("key", key), ("value", value)] {
            if t.rank() != 3 || t.shape()[2] != e {
                return Err(Error::shape(
                    "multihead_attention",
                    format!("{name} must be 3-D ending in embed_dim {e}, got {:?}", t.shape()),
                ));
            }
        }
        let bf = |t: &Tensor| if self.batch_first { Ok(t.clone()) } else { t.transpose(0, 1) };
        let (q_in, k_in, v_in) = (bf(query)?, bf(key)?, bf(value)?);
        let (q, k, v) = if query.id() == key.id() && key.id() == value.id() {
            // Self-attention: one product for all three projections.
            let qkv = q_in.linear(&self.in_proj_weight, Some(&self.in_proj_bias))?;
            (qkv.narrow(2, 0, e)?, qkv.narrow(2, e, e)?, qkv.narrow(2, 2 * e, e)?)
        } else if key.id() == value.id() {
            // Cross-attention over one memory: one product for the key and value, as PyTorch's
            // `_in_projection_packed`.
            let w = self.in_proj_weight.narrow(0, e, 2 * e)?;
            let kv = k_in.linear(&w, Some(&self.in_proj_bias.narrow(0, e, 2 * e)?))?;
            (self.project(&q_in, 0)?, kv.narrow(2, 0, e)?, kv.narrow(2, e, e)?)
        } else {
            (self.project(&q_in, 0)?, self.project(&k_in, 1)?, self.project(&v_in, 2)?)
        };
        let out = scaled_dot_product_attention(
            &self.split_heads(&q)?,
            &self.split_heads(&k)?,
            &self.split_heads(&v)?,
            masks,
            if self.training.get() { self.dropout } else { 0.0 },
        )?;
        let (b, t) = (q_in.shape()[0], q_in.shape()[1]);
        let merged = out.transpose(1, 2)?.reshape(&[b, t, e])?;
        let y = self.out_proj.forward(&merged)?;
        if self.batch_first {
            Ok(y)
        } else {
            y.transpose(0, 1)
        }
    }
}

/// The switch below, first read from `KILN_FUSED_ATTENTION` (`1` on, `0` off, unset auto).
static FUSED_ATTENTION: std::sync::LazyLock<std::sync::atomic::AtomicU8> = std::sync::LazyLock::new(|| {
    std::sync::atomic::AtomicU8::new(match std::env::var("KILN_FUSED_ATTENTION").as_deref() {
        Ok("1") => ON,
        Ok("0") => OFF,
        _ => AUTO,
    })
});
/// The largest head dim F32 attention is fused for by default: F32's kernels hold twice the
/// registers (split fragments), past 64 they spill (NVRTC: about 1 KB a thread at D = 128),
/// and larger head dims are not measured against the unfused ops.
const F32_FUSED_MAX_D: usize = 64;
const AUTO: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

/// Whether `scaled_dot_product_attention` takes the fused attention op (`Tensor::attention`)
/// on a GPU: `Some(true)` for every float dtype but F64, `Some(false)` never, `None` (the
/// default) where it runs on tensor cores: f16/bf16 (or F32 under `Autocast`) with a head dim
/// that is a multiple of 16 up to 128, and F32 (three TF32 products per step, about F32's
/// precision, as PyTorch's F32 SDPA) with one that is a multiple of 8 up to 64 (forced on,
/// up to 128). Other head dims run on the FMA units, slower than the unfused ops at the GPT
/// shapes (BENCHMARKS.md).
pub fn set_fused_attention(on: Option<bool>) {
    let v = match on {
        Some(true) => ON,
        Some(false) => OFF,
        None => AUTO,
    };
    FUSED_ATTENTION.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the fused attention op is used for `q` (see `set_fused_attention`); the FMA
/// kernels take at most `ATTN_FMA_MAX_MATRICES` batch matrices.
fn fused_attention_on(q: &Tensor) -> bool {
    let r = q.rank();
    if !q.device().is_cuda() || r < 2 || q.dtype() == DType::F64 {
        return false;
    }
    let (matrices, d): (usize, usize) = (q.shape()[..r - 2].iter().product(), q.shape()[r - 1]);
    let low = match (q.dtype(), kiln_tensor::autocast_dtype()) {
        (DType::F32, Some(low)) => low,
        (dt, _) => dt,
    };
    use kiln_tensor::cuda::kernels::attention::flash_supported;
    use kiln_tensor::cuda::kernels::attention::ATTN_FMA_MAX_MATRICES;
    let fits = d <= 128 && (matrices <= ATTN_FMA_MAX_MATRICES || flash_supported(low, d));
    match FUSED_ATTENTION.load(std::sync::atomic::Ordering::Relaxed) {
        ON => fits,
        OFF => false,
        _ => fits && flash_supported(low, d) && (low != DType::F32 || d <= F32_FUSED_MAX_D),
    }
}

/// Whether the fused op takes `[B, H, T, D]` q over k and v (`set_fused_attention`'s rule, k
/// and v of one shape pairing with q); with S keys apart from T, only a few queries (a
/// decoding step's) whose scores fit its kernel: longer query blocks go through the products.
pub(crate) fn fused_takes(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    use kiln_tensor::cuda::kernels::attention::{attention_rows_fit, ATTN_SHORT_MAX_T};
    let (t, s, d) = (q.shape()[2], k.shape()[2], q.shape()[3]);
    let lengths = s == t || (t <= ATTN_SHORT_MAX_T && attention_rows_fit(t, s, d));
    lengths && v.shape() == k.shape() && kiln_tensor::op::attention_kv_repeat(q.shape(), k.shape()).is_some() && fused_attention_on(q)
}

/// `softmax(q k^T / sqrt(D) + masks) v` over `[B, H, T, D]` inputs; with no masks but the
/// causal one and no dropout, one fused op on a GPU (see `set_fused_attention`). k and v may
/// have fewer heads than q (`[B, H_kv, S, D]`, `H_kv` dividing `H`: grouped-query attention)
/// and another length S; `is_causal` with S and T apart is PyTorch's mask, aligned to the
/// top left (query i sees keys `0..=i`).
pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, masks: &AttnMasks, dropout_p: f64) -> Result<Tensor> {
    let (b, h, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let s = k.shape()[2];
    let scale = 1.0 / (d as f64).sqrt();
    let plain = masks.attn_mask.is_none() && masks.key_padding_mask.is_none();
    // (The fused op's causal mask is aligned to the bottom right: equal only for S = T.)
    if plain && dropout_p == 0.0 && (s == t || !masks.is_causal) && fused_takes(q, k, v) {
        // One kernel each way; the [T, S] scores are never stored, and grouped-query k and v
        // are read per group, never repeated.
        return q.attention(k, v, scale, masks.is_causal);
    }
    // Grouped-query k and v (fewer heads than q) repeated to q's heads for the products.
    let (k, v) = match kiln_tensor::op::kv_head_repeat(h, k.shape()[1]) {
        Some(rep) if k.rank() == 4 && rep > 1 => (&repeat_kv(k, rep)?, &repeat_kv(v, rep)?),
        _ => (k, v),
    };
    let raw = q.matmul(&k.transpose(-2i64, -1)?)?;
    if masks.is_causal && plain {
        // The common causal case: scale, mask and softmax in one kernel (and one backward).
        return dropout(&raw.softmax_scaled(scale, true)?, dropout_p, dropout_p > 0.0)?.matmul(v);
    }
    let mut scores = raw.mul_scalar(scale)?;
    let neg_inf = Tensor::scalar(f64::NEG_INFINITY, scores.dtype(), scores.device())?;
    if masks.is_causal {
        scores = Tensor::where_cond(&causal_mask(t.max(s), q.device())?.narrow(0, 0, t)?.narrow(1, 0, s)?, &neg_inf, &scores)?;
    }
    if let Some(m) = masks.attn_mask {
        let m = match m.rank() {
            2 => m.clone(),
            3 => m.reshape(&[b, h, t, s])?,
            _ => return Err(Error::shape("attention", format!("attn_mask must be [T, S] or [B*H, T, S], got {:?}", m.shape()))),
        };
        scores = if m.dtype().is_float() { scores.add(&m)? } else { Tensor::where_cond(&m, &neg_inf, &scores)? };
    }
    if let Some(kpm) = masks.key_padding_mask {
        if kpm.shape() != [b, s] {
            return Err(Error::shape("attention", format!("key_padding_mask must be [B, S] = [{b}, {s}], got {:?}", kpm.shape())));
        }
        let kpm = kpm.reshape(&[b, 1, 1, s])?;
        scores = if kpm.dtype().is_float() { scores.add(&kpm)? } else { Tensor::where_cond(&kpm, &neg_inf, &scores)? };
    }
    let p = dropout(&scores.softmax(-1)?, dropout_p, dropout_p > 0.0)?;
    p.matmul(v)
}

/// Grouped-query attention's keys or values (`[B, H_kv, T, D]`) with each head repeated
/// `n_rep` times: `[B, H_kv * n_rep, T, D]`, head `h` of the result being head `h / n_rep`
/// of `x` (Llama's `repeat_kv`).
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    let &[b, h, t, d] = x.shape() else {
        return Err(Error::shape("repeat_kv", format!("needs [B, H_kv, T, D], got {:?}", x.shape())));
    };
    match n_rep {
        0 => Err(Error::shape("repeat_kv", format!("n_rep must be at least 1 for {:?}", x.shape()))),
        1 => Ok(x.clone()),
        _ => x.unsqueeze(2)?.expand(&[b, h, n_rep, t, d])?.reshape(&[b, h * n_rep, t, d]),
    }
}
