//! 2-D convolution and pooling (`nn.Conv2d`, `nn.MaxPool2d`, `nn.AvgPool2d`, `F.unfold`) on
//! NCHW tensors, built from views, one copy and a matrix product: each kernel offset's
//! window is a strided view of the padded input (a stride `s` is a reshape to `[.., n, s]`
//! and the first of each `s`), the views are stacked into columns (im2col), and a
//! convolution is one batched product with the weight. Autograd, CUDA and `compile` need
//! nothing of their own: the backward is the views' and the product's.

use crate::init::weight_and_bias;
use crate::{visit_weight_bias, Forward, Module};
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
#[derive(Debug, Clone)]
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
        let (weight, bias) = weight_and_bias(&[out, inp, kernel], inp * kernel, bias, device)?;
        Ok(Conv1d { weight, bias, window: Window::new((1, kernel)).stride((1, stride)).padding((0, padding)), groups: 1 })
    }
}

impl Forward for Conv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv1d(x, &self.weight, self.bias.as_ref(), &self.window, self.groups)
    }
}

impl Module for Conv1d {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        visit_weight_bias(prefix, f, &self.weight, self.bias.as_ref());
    }
}

/// `nn.Conv2d`: weight `[out, in / groups, kh, kw]` and bias `[out]`, initialised as PyTorch
/// does (both U(-1/sqrt(fan_in), 1/sqrt(fan_in)), `fan_in = in / groups * kh * kw`).
#[derive(Debug, Clone)]
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
        if groups == 0 || inp % groups != 0 || out % groups != 0 {
            return Err(Error::Msg(format!("Conv2d: {inp} in and {out} out channels must both divide into {groups} groups")));
        }
        let (kh, kw) = window.kernel;
        let (weight, bias) = weight_and_bias(&[out, inp / groups, kh, kw], inp / groups * kh * kw, bias, device)?;
        Ok(Conv2d { weight, bias, window, groups })
    }
}

impl Forward for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv2d_groups(x, &self.weight, self.bias.as_ref(), &self.window, self.groups)
    }
}

impl Module for Conv2d {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        visit_weight_bias(prefix, f, &self.weight, self.bias.as_ref());
    }
}

/// `nn.AdaptiveAvgPool2d`: average pooling to a fixed output size (`(1, 1)`: global pooling).
#[derive(Debug, Clone, Copy)]
pub struct AdaptiveAvgPool2d(pub Pair);

impl Forward for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        adaptive_avg_pool2d(x, self.0)
    }
}

impl Module for AdaptiveAvgPool2d {
    fn visit(&self, _: &str, _: &mut dyn FnMut(String, &Tensor)) {}
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
#[derive(Debug, Clone, Copy, Default)]
pub struct Flatten;

impl Forward for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(1i64, -1)
    }
}

impl Module for Flatten {
    fn visit(&self, _: &str, _: &mut dyn FnMut(String, &Tensor)) {}
}
