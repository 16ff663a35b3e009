//! 2-D convolution, pooling and resampling (`nn.Conv2d`, `nn.ConvTranspose2d`, `nn.MaxPool2d`,
//! `nn.AvgPool2d`, `F.unfold`, `F.interpolate`) on NCHW tensors, built from views, one copy
//! and a matrix product: each kernel offset's
//! window is a strided view of the padded input (a stride `s` is a reshape to `[.., n, s]`
//! and the first of each `s`), the views are stacked into columns (im2col), and a
//! convolution is one batched product with the weight. Autograd, CUDA and `compile` need
//! nothing of their own: the backward is the views' and the product's.

use crate::init::weight_and_bias;
use crate::module::{Forward, Module};
use kiln_derive::Module;
use kiln_tensor::{Device, Error, Result, Tensor};

/// A pair of sizes for (height, width).
pub type Pair = (usize, usize);

/// Where a kernel of size `kernel` (dilated by `dilation`) lands on the input: the stride and
/// the zero (or -inf for max pooling) padding added on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub kernel: Pair,
    pub stride: Pair,
    pub padding: Pair,
    pub dilation: Pair,
}

impl Window {
    /// A `kernel` window with stride 1, no padding, no dilation.
    pub fn new(kernel: Pair) -> Window {
        Window { kernel, stride: (1, 1), padding: (0, 0), dilation: (1, 1) }
    }
    pub fn stride(self, stride: Pair) -> Window {
        Window { stride, ..self }
    }
    pub fn padding(self, padding: Pair) -> Window {
        Window { padding, ..self }
    }
    pub fn dilation(self, dilation: Pair) -> Window {
        Window { dilation, ..self }
    }

    /// The output's (height, width) for an input of `(h, w)`.
    fn output(&self, op: &'static str, (h, w): Pair) -> Result<Pair> {
        let out = |size: usize, k: usize, s: usize, p: usize, d: usize| -> Option<usize> {
            let span = d.checked_mul(k - 1)?.checked_add(1)?;
            p.checked_mul(2)?.checked_add(size)?.checked_sub(span).map(|r| r / s + 1)
        };
        let (k, s, p, d) = (self.kernel, self.stride, self.padding, self.dilation);
        if [k.0, k.1, s.0, s.1, d.0, d.1].contains(&0) {
            return Err(Error::Msg(format!("{op}: kernel, stride and dilation must be positive, got {self:?}")));
        }
        if h == 0 || w == 0 {
            return Err(Error::shape(op, format!("an input of {h}x{w} has nothing to slide a window over")));
        }
        match (out(h, k.0, s.0, p.0, d.0), out(w, k.1, s.1, p.1, d.1)) {
            (Some(oh), Some(ow)) => Ok((oh, ow)),
            _ => Err(Error::shape(op, format!("input {h}x{w} (padded by {p:?}) is smaller than the kernel {k:?} dilated by {d:?}"))),
        }
    }

    /// Pooling's rule (PyTorch's): padding at most half the kernel, so that every window
    /// holds an input value.
    fn check_pool_padding(&self, op: &'static str) -> Result<()> {
        let (k, p) = (self.kernel, self.padding);
        if p.0 > k.0 / 2 || p.1 > k.1 / 2 {
            return Err(Error::Msg(format!("{op}: padding {p:?} must be at most half the kernel {k:?}")));
        }
        Ok(())
    }
}

/// An input's windows, in one of two layouts.
enum Windows {
    /// Windows that tile the input (stride = kernel, no dilation: most pooling): a view
    /// `[N, C, Ho, kh, Wo, kw]` of the padded input.
    Tiled(Tensor),
    /// Each kernel offset `(i, j)` a strided view of the padded input, stacked:
    /// `[N, C, kh * kw, Ho, Wo]`.
    Stacked(Tensor),
}

impl Windows {
    /// `[N, C, kh, kw, Ho, Wo]` or `[N, C, kh * kw, Ho, Wo]`: channel, offset, position.
    fn by_offset(self) -> Result<Tensor> {
        match self {
            Windows::Tiled(t) => t.permute(&[0, 1, 3, 5, 2, 4]),
            Windows::Stacked(t) => Ok(t),
        }
    }

    /// `[N, C, Ho, Wo, kh * kw]`: each window's values along the last dim (copied).
    fn by_position(self) -> Result<Tensor> {
        let t = match self {
            Windows::Tiled(t) => t.permute(&[0, 1, 2, 4, 3, 5])?,
            Windows::Stacked(t) => t.permute(&[0, 1, 3, 4, 2])?,
        };
        let s = t.shape().to_vec();
        t.reshape(&[s[0], s[1], s[2], s[3], s[4..].iter().product()])
    }

    /// Each window's mean, `[N, C, Ho, Wo]`, without moving the values.
    fn mean(self) -> Result<Tensor> {
        match self {
            Windows::Tiled(t) => t.mean(&[3usize, 5][..], false),
            Windows::Stacked(t) => t.mean(&[2usize][..], false),
        }
    }
}

/// `x`'s windows under `win`, padding filled with `pad`.
fn windows(op: &'static str, x: &Tensor, win: &Window, pad: f64) -> Result<Windows> {
    let [n, c, h, w] = *x.shape() else {
        return Err(Error::shape(op, format!("needs an NCHW input of rank 4, got {:?}", x.shape())));
    };
    let (oh, ow) = win.output(op, (h, w))?;
    let (k, s, p, d) = (win.kernel, win.stride, win.padding, win.dilation);
    if s == k && d == (1, 1) {
        let x = pad_dim(&pad_dim(x, 2, p.0, p.0, pad)?, 3, p.1, p.1, pad)?;
        let tiled = x.narrow(2usize, 0, k.0 * oh)?.narrow(3usize, 0, k.1 * ow)?;
        return Ok(Windows::Tiled(tiled.reshape(&[n, c, oh, k.0, ow, k.1])?));
    }
    // A single output needs no stride (and a huge stride must not pad a huge input).
    let s = (if oh == 1 { 1 } else { s.0 }, if ow == 1 { 1 } else { s.1 });
    // Room for a whole last stride at every offset: `d * (k - 1) + s * o` rows (under
    // `2 * (h + 2 * p)` once `o >= 2`).
    let (rows, cols) = (d.0 * (k.0 - 1) + s.0 * oh, d.1 * (k.1 - 1) + s.1 * ow);
    let x = pad_dim(x, 2, p.0, rows.saturating_sub(h + p.0).max(p.0), pad)?;
    let x = pad_dim(&x, 3, p.1, cols.saturating_sub(w + p.1).max(p.1), pad)?;
    let mut taken = Vec::with_capacity(k.0 * k.1);
    for i in 0..k.0 {
        let r = every(&x.narrow(2usize, i * d.0, s.0 * oh)?, 2, oh, s.0)?;
        for j in 0..k.1 {
            taken.push(every(&r.narrow(3usize, j * d.1, s.1 * ow)?, 3, ow, s.1)?);
        }
    }
    let refs: Vec<&Tensor> = taken.iter().collect();
    Ok(Windows::Stacked(Tensor::stack(&refs, 2usize)?))
}

/// `x` with `before` and `after` entries of `value` added along `dim`.
fn pad_dim(x: &Tensor, dim: usize, before: usize, after: usize, value: f64) -> Result<Tensor> {
    if before == 0 && after == 0 {
        return Ok(x.clone());
    }
    let fill = |len: usize| -> Result<Tensor> {
        let mut shape = x.shape().to_vec();
        shape[dim] = len;
        Tensor::full(value, &shape, x.dtype(), x.device())
    };
    let (b, a) = (fill(before)?, fill(after)?);
    let parts: Vec<&Tensor> = [(&b, before), (x, 1), (&a, after)].into_iter().filter(|(_, len)| *len > 0).map(|(t, _)| t).collect();
    Tensor::cat(&parts, dim)
}

/// Every `step`-th entry of `x` along `dim` (whose length is `n * step`): a view.
fn every(x: &Tensor, dim: usize, n: usize, step: usize) -> Result<Tensor> {
    if step == 1 {
        return Ok(x.clone());
    }
    let mut shape = x.shape().to_vec();
    shape.splice(dim..=dim, [n, step]);
    x.reshape(&shape)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

/// `F.unfold`: `[N, C, H, W]` to columns `[N, C * kh * kw, L]`, `L = Ho * Wo`, zero padded.
pub fn unfold(x: &Tensor, win: &Window) -> Result<Tensor> {
    let t = windows("unfold", x, win, 0.0)?.by_offset()?;
    let (s, r) = (t.shape(), t.rank());
    t.reshape(&[s[0], s[1..r - 2].iter().product(), s[r - 2] * s[r - 1]])
}

/// `F.conv2d` (groups 1): `x [N, C, H, W]`, `weight [O, C, kh, kw]`, optional `bias [O]`, to
/// `[N, O, Ho, Wo]`. The kernel size is the weight's.
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, win: &Window) -> Result<Tensor> {
    conv2d_groups(x, weight, bias, win, 1)
}

/// `F.conv2d` with `groups`: the channels split into `groups` runs, each convolved with its
/// own `O / groups` filters over `C / groups` channels (`weight [O, C / groups, kh, kw]`;
/// `groups = C` is a depthwise convolution). One batched product over the groups.
pub fn conv2d_groups(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, win: &Window, groups: usize) -> Result<Tensor> {
    let [o, cg, kh, kw] = *weight.shape() else {
        return Err(Error::shape("conv2d", format!("needs a weight [out, in / groups, kh, kw], got {:?}", weight.shape())));
    };
    if (kh, kw) != win.kernel {
        return Err(Error::shape("conv2d", format!("weight {:?} against the window's kernel {:?}", weight.shape(), win.kernel)));
    }
    let c = cg * groups;
    if groups == 0 || o % groups != 0 || x.rank() != 4 || x.shape()[1] != c {
        return Err(Error::shape(
            "conv2d",
            format!("input {:?} against weight {:?} in {groups} group(s): needs an NCHW input with {c} channels and out channels divisible by the groups", x.shape(), weight.shape()),
        ));
    }
    if let Some(b) = bias.filter(|b| b.shape() != [o]) {
        return Err(Error::shape("conv2d", format!("bias {:?} for {o} output channels", b.shape())));
    }
    let n = x.shape()[0];
    let (oh, ow) = win.output("conv2d", (x.shape()[2], x.shape()[3]))?;
    let k = cg * kh * kw;
    // [G, O/G, K] @ [N, G, K, L]: the columns are grouped by channel already.
    let cols = unfold(x, win)?.reshape(&[n, groups, k, oh * ow])?;
    let y = weight.reshape(&[groups, o / groups, k])?.matmul(&cols)?.reshape(&[n, o, oh * ow])?;
    // The bias in the product's dtype (autocast's 16-bit product stays 16-bit, as in PyTorch).
    let y = match bias {
        Some(b) => y.add(&b.to_dtype(y.dtype())?.reshape(&[o, 1])?)?,
        None => y,
    };
    y.reshape(&[n, o, oh, ow])
}

/// `F.conv1d`: `x [N, C, L]`, `weight [O, C / groups, k]`, optional `bias [O]`, to `[N, O, Lo]`;
/// the window's second numbers (`Window::new((1, k)).stride((1, s))`, ..) apply along `L`.
/// A convolution over a `[N, C, 1, L]` image.
pub fn conv1d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, win: &Window, groups: usize) -> Result<Tensor> {
    if x.rank() != 3 || weight.rank() != 3 || win.kernel.0 != 1 || win.padding.0 != 0 {
        return Err(Error::shape(
            "conv1d",
            format!(
                "needs x [N, C, L], weight [O, C / groups, k] and a (1, k) window without row padding; got {:?}, {:?}, {win:?}",
                x.shape(),
                weight.shape()
            ),
        ));
    }
    conv2d_groups(&x.unsqueeze(2usize)?, &weight.unsqueeze(2usize)?, bias, win, groups)?.squeeze(2usize)
}

/// `F.conv_transpose2d`: `x [N, C, H, W]`, `weight [C, O / groups, kh, kw]` (PyTorch's
/// layout), optional `bias [O]`, to `[N, O, Ho, Wo]` with `Ho = (H - 1) s - 2 p + d (kh - 1)
/// + output_padding + 1`: the gradient of `conv2d` with respect to its input. Computed as a
/// convolution, stride 1, of the input with `s - 1` zeros between its values, padded by
/// `d (k - 1) - p` (cropped where that is negative), with the flipped, transposed kernel.
pub fn conv_transpose2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    win: &Window,
    output_padding: Pair,
    groups: usize,
) -> Result<Tensor> {
    let [c, og, kh, kw] = *weight.shape() else {
        return Err(Error::shape("conv_transpose2d", format!("needs a weight [in, out / groups, kh, kw], got {:?}", weight.shape())));
    };
    let (s, p, d) = (win.stride, win.padding, win.dilation);
    if (kh, kw) != win.kernel || [s.0, s.1, d.0, d.1, groups].contains(&0) {
        return Err(Error::Msg(format!("conv_transpose2d: weight {:?} against window {win:?} in {groups} group(s)", weight.shape())));
    }
    if c % groups != 0 || x.rank() != 4 || x.shape()[1] != c {
        return Err(Error::shape(
            "conv_transpose2d",
            format!(
                "input {:?} against weight {:?} in {groups} group(s): needs an NCHW input with {c} channels",
                x.shape(),
                weight.shape()
            ),
        ));
    }
    // PyTorch's rule: the extra rows must be less than the stride or the dilation.
    if output_padding.0 >= s.0.max(d.0) || output_padding.1 >= s.1.max(d.1) {
        return Err(Error::Msg(format!(
            "conv_transpose2d: output_padding {output_padding:?} must be smaller than the stride {s:?} or the dilation {d:?}"
        )));
    }
    let mut y = x.clone();
    for (dim, k, s, p, d, extra) in [(2, kh, s.0, p.0, d.0, output_padding.0), (3, kw, s.1, p.1, d.1, output_padding.1)] {
        let n = y.shape()[dim];
        if s > 1 {
            // [.., n, ..] to [.., n, s, ..] (the value, then s - 1 zeros), flattened, the
            // trailing zeros dropped.
            let spread = pad_dim(&y.unsqueeze(dim + 1)?, dim + 1, 0, s - 1, 0.0)?;
            let mut shape = y.shape().to_vec();
            shape[dim] = n * s;
            y = spread.reshape(&shape)?.narrow(dim, 0, (n - 1) * s + 1)?;
        }
        let edge = (d * (k - 1)) as isize - p as isize;
        y = pad_or_crop("conv_transpose2d", &y, dim, edge, edge + extra as isize)?;
    }
    // [C, O/G, kh, kw] to [O, C/G, kh, kw], flipped in space.
    let w = weight.reshape(&[groups, c / groups, og, kh, kw])?.transpose(1usize, 2usize)?.reshape(&[groups * og, c / groups, kh, kw])?;
    let w = w.flip(&[2usize, 3])?;
    conv2d_groups(&y, &w, bias, &Window::new((kh, kw)).dilation(d), groups)
}

/// `x` with `before` and `after` zeros added along `dim`, or as many entries cut where they
/// are negative; an error when nothing would be left.
fn pad_or_crop(op: &'static str, x: &Tensor, dim: usize, before: isize, after: isize) -> Result<Tensor> {
    let n = x.shape()[dim] as isize;
    let cut = before.min(0).abs() + after.min(0).abs();
    if cut >= n {
        return Err(Error::shape(op, format!("padding crops all {n} rows of dim {dim} of {:?}", x.shape())));
    }
    let x = x.narrow(dim, before.min(0).unsigned_abs(), (n - cut) as usize)?;
    pad_dim(&x, dim, before.max(0) as usize, after.max(0) as usize, 0.0)
}

/// How `interpolate` fills in values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interpolation {
    /// The value at `floor(dst * in / out)` (PyTorch's `mode='nearest'`).
    Nearest,
    /// Linear along each axis (`mode='bilinear'`), pixel centres aligned unless
    /// `align_corners`, which maps the corner pixels onto each other.
    Bilinear { align_corners: bool },
}

/// `F.interpolate` of `[N, C, H, W]` to `[N, C, size.0, size.1]`. Nearest picks rows and
/// columns (an exact copy whose gradient adds back); bilinear multiplies by `[out, in]`
/// interpolation matrices on each side.
pub fn interpolate(x: &Tensor, size: Pair, mode: Interpolation) -> Result<Tensor> {
    let [_, _, h, w] = *x.shape() else {
        return Err(Error::shape("interpolate", format!("needs an NCHW input, got {:?}", x.shape())));
    };
    if size.0 == 0 || size.1 == 0 || h == 0 || w == 0 {
        return Err(Error::shape("interpolate", format!("to {size:?} from {:?}: sizes must be positive", x.shape())));
    }
    match mode {
        Interpolation::Nearest => {
            // PyTorch computes the source index in single precision.
            let pick = |n: usize, out: usize| -> Result<Tensor> {
                let scale = n as f32 / out as f32;
                let idx: Vec<i64> = (0..out).map(|i| ((i as f32 * scale).floor() as usize).min(n - 1) as i64).collect();
                Tensor::from_vec(idx, &[out], x.device())
            };
            x.index_select(2usize, &pick(h, size.0)?)?.index_select(3usize, &pick(w, size.1)?)
        }
        Interpolation::Bilinear { align_corners } => {
            let ah = linear_weights(h, size.0, align_corners, x)?;
            let aw = linear_weights(w, size.1, align_corners, x)?;
            ah.matmul(&x.matmul(&aw.t()?)?)
        }
    }
}

/// The `[out, n]` matrix of linear interpolation from `n` points to `out` (PyTorch's source
/// coordinates), in `like`'s dtype and device.
fn linear_weights(n: usize, out: usize, align_corners: bool, like: &Tensor) -> Result<Tensor> {
    let mut a = vec![0.0f64; out * n];
    for i in 0..out {
        let src = if align_corners {
            if out > 1 {
                i as f64 * (n - 1) as f64 / (out - 1) as f64
            } else {
                0.0
            }
        } else {
            ((i as f64 + 0.5) * n as f64 / out as f64 - 0.5).max(0.0)
        };
        let lo = (src.floor() as usize).min(n - 1);
        let hi = (lo + 1).min(n - 1);
        let t = src - lo as f64;
        a[i * n + lo] += 1.0 - t;
        a[i * n + hi] += t;
    }
    Tensor::from_vec(a, &[out, n], like.device())?.to_dtype(like.dtype())
}

/// `F.max_pool2d`: the largest value of each window (padding counts as -inf). As in PyTorch,
/// the gradient goes to one element of a window, its first largest (ties do not share it).
pub fn max_pool2d(x: &Tensor, win: &Window) -> Result<Tensor> {
    win.check_pool_padding("max_pool2d")?;
    let t = windows("max_pool2d", x, win, f64::NEG_INFINITY)?.by_position()?;
    t.gather(4usize, &t.argmax(4usize, true)?)?.squeeze(4usize)
}

/// `F.avg_pool2d` (PyTorch's default `count_include_pad=True`: padding counts as zeros).
pub fn avg_pool2d(x: &Tensor, win: &Window) -> Result<Tensor> {
    win.check_pool_padding("avg_pool2d")?;
    windows("avg_pool2d", x, win, 0.0)?.mean()
}

/// `F.adaptive_avg_pool2d`: `[N, C, H, W]` to `[N, C, oh, ow]`, output cell `(i, j)` the mean
/// of rows `floor(i H / oh)..ceil((i + 1) H / oh)` and the columns likewise (PyTorch's
/// windows). `(1, 1)` is a mean; sizes that divide the input are average pooling; others
/// are products with averaging matrices.
pub fn adaptive_avg_pool2d(x: &Tensor, (oh, ow): Pair) -> Result<Tensor> {
    let [_, _, h, w] = *x.shape() else {
        return Err(Error::shape("adaptive_avg_pool2d", format!("needs an NCHW input, got {:?}", x.shape())));
    };
    if oh == 0 || ow == 0 || h == 0 || w == 0 {
        return Err(Error::shape(
            "adaptive_avg_pool2d",
            format!("output {:?} from input {:?}: sizes must be positive", (oh, ow), x.shape()),
        ));
    }
    if (oh, ow) == (1, 1) {
        return x.mean(&[2usize, 3][..], true);
    }
    if h % oh == 0 && w % ow == 0 {
        let k = (h / oh, w / ow);
        return avg_pool2d(x, &Window::new(k).stride(k));
    }
    // [oh, H] and [W, ow] averaging matrices: out = A_h x A_w^T per image.
    let averaging = |n: usize, out: usize| -> Vec<f64> {
        let mut a = vec![0.0; out * n];
        for i in 0..out {
            let (lo, hi) = (i * n / out, ((i + 1) * n).div_ceil(out));
            (lo..hi).for_each(|r| a[i * n + r] = 1.0 / (hi - lo) as f64);
        }
        a
    };
    let ah = Tensor::from_vec(averaging(h, oh), &[oh, h], x.device())?.to_dtype(x.dtype())?;
    let aw = Tensor::from_vec(averaging(w, ow), &[ow, w], x.device())?.to_dtype(x.dtype())?;
    ah.matmul(&x.matmul(&aw.t()?)?)
}

/// `nn.Conv1d`: weight `[out, in / groups, k]` and bias `[out]`, initialised as PyTorch does.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Conv1d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// A `(1, k)` window: `Window::new((1, k)).stride((1, s)).padding((0, p))`.
    pub window: Window,
    pub groups: usize,
}

impl Conv1d {
    /// `kernel`, `stride` and `padding` along the length (fan-in `inp * kernel`).
    pub fn new(inp: usize, out: usize, kernel: usize, stride: usize, padding: usize, bias: bool, device: Device) -> Result<Conv1d> {
        let (weight, bias) = weight_and_bias(&[out, inp, kernel], inp * kernel, bias.then_some(out), device)?;
        Ok(Conv1d { weight, bias, window: Window::new((1, kernel)).stride((1, stride)).padding((0, padding)), groups: 1 })
    }
}

impl Forward for Conv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv1d(x, &self.weight, self.bias.as_ref(), &self.window, self.groups)
    }
}

/// `nn.Conv2d`: weight `[out, in / groups, kh, kw]` and bias `[out]`, initialised as PyTorch
/// does (both U(-1/sqrt(fan_in), 1/sqrt(fan_in)), `fan_in = in / groups * kh * kw`).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub window: Window,
    pub groups: usize,
}

impl Conv2d {
    pub fn new(inp: usize, out: usize, window: Window, bias: bool, device: Device) -> Result<Conv2d> {
        Conv2d::with_groups(inp, out, window, 1, bias, device)
    }

    /// `nn.Conv2d(.., groups=groups)`: weight `[out, inp / groups, kh, kw]`, fan-in
    /// `inp / groups * kh * kw`.
    pub fn with_groups(inp: usize, out: usize, window: Window, groups: usize, bias: bool, device: Device) -> Result<Conv2d> {
        if groups == 0 || !inp.is_multiple_of(groups) || !out.is_multiple_of(groups) {
            return Err(Error::Msg(format!("Conv2d: {inp} in and {out} out channels must both divide into {groups} groups")));
        }
        let (kh, kw) = window.kernel;
        let (weight, bias) = weight_and_bias(&[out, inp / groups, kh, kw], inp / groups * kh * kw, bias.then_some(out), device)?;
        Ok(Conv2d { weight, bias, window, groups })
    }
}

impl Forward for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv2d_groups(x, &self.weight, self.bias.as_ref(), &self.window, self.groups)
    }
}

/// `nn.ConvTranspose2d`: weight `[in, out / groups, kh, kw]` and bias `[out]`, initialised
/// as PyTorch does (its fan-in is `out / groups * kh * kw`, the weight's second dim on).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct ConvTranspose2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub window: Window,
    pub output_padding: Pair,
    pub groups: usize,
}

impl ConvTranspose2d {
    pub fn new(inp: usize, out: usize, window: Window, bias: bool, device: Device) -> Result<ConvTranspose2d> {
        let (kh, kw) = window.kernel;
        let (weight, bias) = weight_and_bias(&[inp, out, kh, kw], out * kh * kw, bias.then_some(out), device)?;
        Ok(ConvTranspose2d { weight, bias, window, output_padding: (0, 0), groups: 1 })
    }
    pub fn output_padding(self, output_padding: Pair) -> ConvTranspose2d {
        ConvTranspose2d { output_padding, ..self }
    }
}

impl Forward for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv_transpose2d(x, &self.weight, self.bias.as_ref(), &self.window, self.output_padding, self.groups)
    }
}

/// `nn.Upsample(scale_factor=(sh, sw), mode=..)`: each image `sh` times taller and `sw`
/// times wider.
#[derive(Debug, Clone, Copy, Module)]
#[module(crate = "crate")]
pub struct Upsample {
    pub scale: Pair,
    pub mode: Interpolation,
}

impl Forward for Upsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 4 {
            return Err(Error::shape("Upsample", format!("needs an NCHW input, got {:?}", x.shape())));
        }
        interpolate(x, (x.shape()[2] * self.scale.0, x.shape()[3] * self.scale.1), self.mode)
    }
}

/// `nn.AdaptiveAvgPool2d`: average pooling to a fixed output size (`(1, 1)`: global pooling).
#[derive(Debug, Clone, Copy, Module)]
#[module(crate = "crate")]
pub struct AdaptiveAvgPool2d(pub Pair);

impl Forward for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        adaptive_avg_pool2d(x, self.0)
    }
}

/// A pooling layer over a `Window`: `new(k)` strides by the kernel, PyTorch's default.
macro_rules! pool_layer {
    ($name:ident, $f:ident, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy)]
        pub struct $name(pub Window);

        impl $name {
            pub fn new(kernel: Pair) -> $name {
                $name(Window::new(kernel).stride(kernel))
            }
        }

        impl Forward for $name {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                $f(x, &self.0)
            }
        }

        impl Module for $name {
            fn visit(&self, _: &str, _: &mut dyn FnMut(String, &Tensor)) {}
        }
    };
}

pool_layer!(MaxPool2d, max_pool2d, "`nn.MaxPool2d`; `MaxPool2d::new(k)` strides by the kernel, PyTorch's default.");
pool_layer!(AvgPool2d, avg_pool2d, "`nn.AvgPool2d`; `AvgPool2d::new(k)` strides by the kernel, PyTorch's default.");

/// `nn.Flatten`: every dim from the second on into one (`[N, C, H, W]` to `[N, C * H * W]`).
#[derive(Debug, Clone, Copy, Default, Module)]
#[module(crate = "crate")]
pub struct Flatten;

impl Forward for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(1i64, -1)
    }
}
