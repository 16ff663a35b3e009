//! `Display` in PyTorch's style: `tensor([[1.0000, 2.0000], ...], dtype=float64)`, with the
//! middle of large dims elided.

use crate::{DType, Device, Tensor};
use std::fmt;

/// Dims longer than this show their first and last `EDGE` entries only.
const SUMMARIZE_OVER: usize = 1000;
const EDGE: usize = 3;

fn fmt_value(v: f64, dtype: DType) -> String {
    if dtype.is_float() {
        if v.is_nan() {
            "nan".into()
        } else if v.is_infinite() {
            if v > 0.0 {
                "inf".into()
            } else {
                "-inf".into()
            }
        } else if v != 0.0 && (v.abs() >= 1e8 || v.abs() < 1e-4) {
            format!("{v:.4e}")
        } else {
            format!("{v:.4}")
        }
    } else {
        format!("{}", v as i64)
    }
}

/// What every level of the recursive printer shares.
struct Printer<'a> {
    vals: &'a [String],
    summarize: bool,
    width: usize,
}

impl Printer<'_> {
    fn write_dim(&self, out: &mut String, shape: &[usize], strides: &[usize], base: usize, indent: usize) {
        if shape.is_empty() {
            out.push_str(&format!("{:>w$}", self.vals[base], w = self.width));
            return;
        }
        out.push('[');
        let n = shape[0];
        let show: Vec<Option<usize>> = if self.summarize && n > 2 * EDGE {
            (0..EDGE).map(Some).chain(std::iter::once(None)).chain((n - EDGE..n).map(Some)).collect()
        } else {
            (0..n).map(Some).collect()
        };
        for (k, i) in show.iter().enumerate() {
            if k > 0 {
                if shape.len() == 1 {
                    out.push_str(", ");
                } else {
                    out.push(',');
                    out.push_str(&"\n".repeat(shape.len() - 1));
                    out.push_str(&" ".repeat(indent + 1));
                }
            }
            match i {
                Some(i) => self.write_dim(out, &shape[1..], &strides[1..], base + i * strides[0], indent + 1),
                None => out.push_str("..."),
            }
        }
        out.push(']');
    }
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let vals = match self.to_vec_f64() {
            Ok(v) => v,
            Err(e) => return write!(f, "tensor(<{e}>)"),
        };
        let summarize = vals.len() > SUMMARIZE_OVER;
        let strs: Vec<String> = vals.iter().map(|&v| fmt_value(v, self.dtype())).collect();
        let width = strs.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut out = String::from("tensor(");
        let strides = crate::shape::contiguous_strides(self.shape());
        Printer { vals: &strs, summarize, width }.write_dim(&mut out, self.shape(), &strides, 0, 7);
        if self.dtype() != DType::F32 && self.dtype() != DType::I64 {
            out.push_str(&format!(", dtype={}", self.dtype().as_str()));
        }
        if self.device() != Device::Cpu {
            out.push_str(&format!(", device='{}'", self.device()));
        }
        out.push(')');
        f.write_str(&out)
    }
}
