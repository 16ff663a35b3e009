//! Decoding with a key/value cache: each layer keeps the keys and values of the positions
//! seen so far, so a new token attends to them without recomputing the prefix (Hugging
//! Face's `past_key_values`).

use crate::attention::{scaled_dot_product_attention, AttnMasks};
use kiln_tensor::{Error, Result, Tensor};

/// The cached keys and values of every layer, `[B, H_kv, S, D]` each, `S` the positions seen.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache for a model of `n_layers` layers.
    pub fn new(n_layers: usize) -> KvCache {
        KvCache { layers: vec![None; n_layers] }
    }

    /// The positions cached (0 before the first call).
    pub fn len(&self) -> usize {
        self.layers.first().and_then(|l| l.as_ref()).map_or(0, |(k, _)| k.shape()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `k` and `v` (`[B, H_kv, T, D]`, the new positions) to layer `layer`'s cache and
    /// returns all of that layer's keys and values.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = self.layers.len();
        let slot = self.layers.get_mut(layer).ok_or_else(|| Error::Msg(format!("kv cache: layer {layer} of a cache for {n} layers")))?;
        let next = match slot.take() {
            None => (k.clone(), v.clone()),
            Some((pk, pv)) => {
                if pk.shape()[..2] != k.shape()[..2] || pk.shape()[3] != k.shape()[3] {
                    return Err(Error::shape("kv cache", format!("new keys {:?} do not extend the cached {:?}", k.shape(), pk.shape())));
                }
                (Tensor::cat(&[&pk, k], 2)?, Tensor::cat(&[&pv, v], 2)?)
            }
        };
        *slot = Some(next.clone());
        Ok(next)
    }
}

/// Causal attention of queries at positions `offset..offset + T` (`q`: `[B, H, T, D]`) over
/// keys and values at positions `0..offset + T` (`[B, H, offset + T, D]`): query `i` sees
/// keys `0..=offset + i`. With `offset` 0 it is plain causal attention; a single new query
/// sees every key.
pub fn causal_attention_at(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
    let (t, s) = (q.shape()[2], k.shape()[2]);
    if s != offset + t {
        return Err(Error::shape(
            "causal attention",
            format!("q {:?} at offset {offset} needs {} keys, got k {:?}", q.shape(), offset + t, k.shape()),
        ));
    }
    if offset == 0 || t == 1 {
        let masks = AttnMasks { is_causal: offset == 0, ..Default::default() };
        return scaled_dot_product_attention(q, k, v, &masks, 0.0);
    }
    // Query i hides keys j > offset + i.
    let dev = q.device();
    let i = Tensor::arange(t, kiln_tensor::DType::I64, dev)?.add_scalar(offset as f64)?;
    let j = Tensor::arange(s, kiln_tensor::DType::I64, dev)?;
    let hide = j.reshape(&[1, s])?.gt(&i.reshape(&[t, 1])?)?;
    scaled_dot_product_attention(q, k, v, &AttnMasks { attn_mask: Some(&hide), ..Default::default() }, 0.0)
}
