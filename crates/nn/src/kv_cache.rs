//! Decoding with a key/value cache: each layer keeps the keys and values of the positions
//! seen so far, so a new token attends to them without recomputing the prefix (Hugging
//! Face's `past_key_values`).

use crate::attention::{scaled_dot_product_attention, AttnMasks};
use kiln_tensor::{DType, Device, Error, Result, Tensor};

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

/// A cache of fixed capacity, made up front: `[B, H_kv, capacity, D]` keys and values per
/// layer, written at positions that a tensor holds. Every decode step then has the same
/// shapes and takes its position as an input, so one compiled step (one CUDA graph replay in
/// `ReduceOverhead`) serves every position, as a static cache does under `torch.compile`.
#[derive(Debug, Clone)]
pub struct StaticKvCache {
    layers: Vec<(Tensor, Tensor)>,
    capacity: usize,
}

impl StaticKvCache {
    /// Zeroed keys and values for `n_layers` layers of `kv_heads` heads of `head_dim`, for
    /// `capacity` positions of `batch` sequences.
    pub fn new(
        n_layers: usize,
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        head_dim: usize,
        dtype: DType,
        device: Device,
    ) -> Result<StaticKvCache> {
        let zeros = || Tensor::zeros(&[batch, kv_heads, capacity, head_dim], dtype, device);
        let layers = (0..n_layers).map(|_| Ok((zeros()?, zeros()?))).collect::<Result<_>>()?;
        Ok(StaticKvCache { layers, capacity })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Zeroes every slot: before a new sequence (a write adds into a zeroed slot).
    pub fn reset(&self) -> Result<()> {
        kiln_tensor::no_grad(|| self.layers.iter().try_for_each(|(k, v)| k.zero_().and_then(|_| v.zero_())))
    }

    /// Writes `k` and `v` (`[B, H_kv, T, D]`) at `positions` (I64 `[T]`) of layer `layer`;
    /// returns the layer's whole keys and values.
    fn write(&self, layer: usize, k: &Tensor, v: &Tensor, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = self.layers.len();
        let (ck, cv) =
            self.layers.get(layer).ok_or_else(|| Error::Msg(format!("static kv cache: layer {layer} of a cache for {n} layers")))?;
        if ck.shape()[..2] != k.shape()[..2] || ck.shape()[3] != k.shape()[3] || v.shape() != k.shape() {
            return Err(Error::shape(
                "static kv cache",
                format!("new keys {:?} and values {:?} do not fit the cache's {:?}", k.shape(), v.shape(), ck.shape()),
            ));
        }
        kiln_tensor::no_grad(|| -> Result<()> {
            ck.assign(&ck.index_add(2usize, positions, &k.to_dtype(ck.dtype())?)?)?;
            cv.assign(&cv.index_add(2usize, positions, &v.to_dtype(cv.dtype())?)?)
        })?;
        Ok((ck.clone(), cv.clone()))
    }
}

/// The cache a forward pass reads and extends: a growing `KvCache` (positions known on the
/// host) or a `StaticKvCache` with the new tokens' positions as a tensor.
pub enum Cache<'a> {
    Growing { cache: &'a mut KvCache, offset: usize },
    Static { cache: &'a StaticKvCache, positions: &'a Tensor },
}

impl<'a> Cache<'a> {
    /// New tokens after the ones `cache` holds.
    pub fn growing(cache: &'a mut KvCache) -> Cache<'a> {
        let offset = cache.len();
        Cache::Growing { cache, offset }
    }

    /// The new tokens' positions (I64 `[t]` on `device`).
    pub fn positions(&self, t: usize, device: Device) -> Result<Tensor> {
        match self {
            Cache::Growing { offset, .. } => Tensor::arange(t, DType::I64, device)?.add_scalar(*offset as f64),
            Cache::Static { positions, .. } if positions.shape() == [t] => Ok((*positions).clone()),
            Cache::Static { positions, .. } => {
                Err(Error::shape("static kv cache", format!("positions {:?} for {t} new tokens (must be [{t}])", positions.shape())))
            }
        }
    }

    /// The positions after the new `t` tokens that the cache can hold: an error when they
    /// run past `max` (a growing cache) or its capacity (a static one).
    pub fn check_room(&self, t: usize, max: usize) -> Result<()> {
        let (end, room) = match self {
            Cache::Growing { offset, .. } => (offset + t, max),
            Cache::Static { cache, .. } => (t, cache.capacity.min(max)),
        };
        if end > room {
            return Err(Error::shape("kv cache", format!("{t} new tokens run past the {room} positions there are")));
        }
        Ok(())
    }

    /// Causal attention of `q` (`[B, H, T, D]`, the new tokens) over layer `layer`'s cached
    /// keys and values with the new `k` and `v` (`[B, H_kv, T, D]`) added to the cache.
    pub fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        match self {
            Cache::Growing { cache, offset } => {
                let (k, v) = cache.append(layer, k, v)?;
                causal_attention_at(q, &k, &v, *offset)
            }
            Cache::Static { cache, positions } => {
                let (k, v) = cache.write(layer, k, v, positions)?;
                // Query i hides the keys after its position (and the slots not written yet).
                let j = Tensor::arange(cache.capacity, DType::I64, q.device())?.reshape(&[1, cache.capacity])?;
                let hide = j.gt(&positions.reshape(&[positions.numel(), 1])?)?;
                scaled_dot_product_attention(q, &k, &v, &AttnMasks { attn_mask: Some(&hide), ..Default::default() }, 0.0)
            }
        }
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
    if crate::attention::fused_takes(q, k, v) {
        // One fused op: its causal mask, aligned to the bottom right, is exactly this one.
        return q.attention(k, v, 1.0 / (q.shape()[3] as f64).sqrt(), true);
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
