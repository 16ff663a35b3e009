//! `t.i((.., -1, 2..))`: PyTorch's `t[:, -1, 2:]` as one call. Each item of the tuple takes
//! the next dim: `..` keeps it, an integer selects one entry and drops the dim (negative
//! counts from the end), a range keeps a slice of it (ends past the dim are clipped, negative
//! ends count from the end, as Python's slices). Dims after the last item are kept whole.
//! The result is a view.

use crate::{Error, Result, Tensor};
use std::ops::{Range, RangeFrom, RangeFull, RangeTo};

/// One item of a slicing tuple.
pub trait SliceItem {
    /// Applies the item to dim `d` of `t`: the result, and whether the dim stays.
    fn apply(&self, t: &Tensor, d: usize) -> Result<(Tensor, bool)>;
}

impl SliceItem for RangeFull {
    fn apply(&self, t: &Tensor, _d: usize) -> Result<(Tensor, bool)> {
        Ok((t.clone(), true))
    }
}

macro_rules! integer_items {
    ($($t:ty),*) => {$(
        impl SliceItem for $t {
            fn apply(&self, t: &Tensor, d: usize) -> Result<(Tensor, bool)> {
                Ok((t.select(d, *self as i64)?, false))
            }
        }
        impl SliceItem for Range<$t> {
            fn apply(&self, t: &Tensor, d: usize) -> Result<(Tensor, bool)> {
                slice(t, d, Some(self.start as i64), Some(self.end as i64))
            }
        }
        impl SliceItem for RangeFrom<$t> {
            fn apply(&self, t: &Tensor, d: usize) -> Result<(Tensor, bool)> {
                slice(t, d, Some(self.start as i64), None)
            }
        }
        impl SliceItem for RangeTo<$t> {
            fn apply(&self, t: &Tensor, d: usize) -> Result<(Tensor, bool)> {
                slice(t, d, None, Some(self.end as i64))
            }
        }
    )*};
}
integer_items!(usize, i32, i64, isize);

/// `t[.., start:end]` along `d`, Python's clipping.
fn slice(t: &Tensor, d: usize, start: Option<i64>, end: Option<i64>) -> Result<(Tensor, bool)> {
    let size = t.shape()[d] as i64;
    let at = |i: i64| if i < 0 { (i + size).max(0) } else { i.min(size) };
    let (s, e) = (start.map_or(0, at), end.map_or(size, at));
    Ok((t.narrow(d, s as usize, (e - s).max(0) as usize)?, true))
}

/// A tuple of slicing items (or one item).
pub trait SliceSpec {
    fn items(&self) -> Vec<&dyn SliceItem>;
}

impl<T: SliceItem> SliceSpec for T {
    fn items(&self) -> Vec<&dyn SliceItem> {
        vec![self]
    }
}

macro_rules! tuple_specs {
    ($(($($n:ident $i:tt),+)),* $(,)?) => {$(
        impl<$($n: SliceItem),+> SliceSpec for ($($n,)+) {
            fn items(&self) -> Vec<&dyn SliceItem> {
                vec![$(&self.$i),+]
            }
        }
    )*};
}
tuple_specs!((A 0), (A 0, B 1), (A 0, B 1, C 2), (A 0, B 1, C 2, D 3), (A 0, B 1, C 2, D 3, E 4), (A 0, B 1, C 2, D 3, E 4, F 5));

impl Tensor {
    /// `t[spec]` in PyTorch's terms (see the module's notes): `x.i((.., -1))` is `x[:, -1]`,
    /// `x.i((0, 1..3))` is `x[0, 1:3]`.
    pub fn i<S: SliceSpec>(&self, spec: S) -> Result<Tensor> {
        let items = spec.items();
        if items.len() > self.rank() {
            return Err(Error::shape("i", format!("{} indices for a tensor of shape {:?}", items.len(), self.shape())));
        }
        let (mut t, mut d) = (self.clone(), 0);
        for item in items {
            let (next, kept) = item.apply(&t, d)?;
            t = next;
            d += kept as usize;
        }
        Ok(t)
    }
}
