//! LSTM and GRU against a plain-Rust loop of PyTorch's equations (every layer, both
//! directions, batch first, given initial states), their gradients against finite
//! differences, PyTorch's parameter names, and errors naming the shapes. All in F64: this
//! file sets the process-wide default dtype, and each test file is its own process.

use kiln_autograd::{gradcheck, GradcheckConfig};
use kiln_nn::{Forward, Gates, Gru, GruCell, Lstm, LstmCell, Module, RnnConfig};
use kiln_tensor::{set_default_dtype, DType, Device, Distribution, Result, Tensor};

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// One cell's parameters as plain rows.
struct RefGates {
    wi: Vec<f64>,
    wh: Vec<f64>,
    bi: Vec<f64>,
    bh: Vec<f64>,
    input: usize,
    hidden: usize,
}

impl RefGates {
    fn of(g: &Gates) -> RefGates {
        let (rows, input, hidden) = (g.weight_ih.shape()[0], g.weight_ih.shape()[1], g.weight_hh.shape()[1]);
        let or_zero = |b: &Option<Tensor>| b.as_ref().map(f64s).unwrap_or(vec![0.0; rows]);
        RefGates { wi: f64s(&g.weight_ih), wh: f64s(&g.weight_hh), bi: or_zero(&g.bias_ih), bh: or_zero(&g.bias_hh), input, hidden }
    }
    /// (x W_ih^T + b_ih, h W_hh^T + b_hh) for one sample.
    fn parts(&self, x: &[f64], h: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let rows = self.bi.len();
        let xi = (0..rows).map(|r| self.bi[r] + (0..self.input).map(|k| self.wi[r * self.input + k] * x[k]).sum::<f64>()).collect();
        let hh = (0..rows).map(|r| self.bh[r] + (0..self.hidden).map(|k| self.wh[r * self.hidden + k] * h[k]).sum::<f64>()).collect();
        (xi, hh)
    }
    fn lstm(&self, x: &[f64], h: &[f64], c: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (xi, hh) = self.parts(x, h);
        let n = self.hidden;
        let z = |g: usize, j: usize| xi[g * n + j] + hh[g * n + j];
        let c2: Vec<f64> = (0..n).map(|j| sigmoid(z(1, j)) * c[j] + sigmoid(z(0, j)) * z(2, j).tanh()).collect();
        let h2 = (0..n).map(|j| sigmoid(z(3, j)) * c2[j].tanh()).collect();
        (h2, c2)
    }
    fn gru(&self, x: &[f64], h: &[f64]) -> Vec<f64> {
        let (xi, hh) = self.parts(x, h);
        let n = self.hidden;
        (0..n)
            .map(|j| {
                let r = sigmoid(xi[j] + hh[j]);
                let z = sigmoid(xi[n + j] + hh[n + j]);
                let cand = (xi[2 * n + j] + r * hh[2 * n + j]).tanh();
                (1.0 - z) * cand + z * h[j]
            })
            .collect()
    }
}

/// The reference stack over `xs[t][b]` (time first): outputs `[t][b]` of width D*H and the
/// final states `[cell][b]` (h, and c for an LSTM).
type Seq = Vec<Vec<Vec<f64>>>;
fn reference(cells: &[RefGates], dirs: usize, xs: &Seq, h0: &Seq, c0: Option<&Seq>) -> (Seq, Seq, Seq) {
    let (t, b) = (xs.len(), xs[0].len());
    let mut input = xs.clone();
    let (mut hn, mut cn) = (Vec::new(), Vec::new());
    for layer in 0..cells.len() / dirs {
        let mut out: Seq = vec![vec![Vec::new(); b]; t];
        for dir in 0..dirs {
            let k = layer * dirs + dir;
            let (mut h, mut c) = (h0[k].clone(), c0.map(|c| c[k].clone()).unwrap_or_default());
            for s in 0..t {
                let s = if dir == 1 { t - 1 - s } else { s };
                for i in 0..b {
                    if c0.is_some() {
                        (h[i], c[i]) = cells[k].lstm(&input[s][i], &h[i], &c[i]);
                    } else {
                        h[i] = cells[k].gru(&input[s][i], &h[i]);
                    }
                    out[s][i].extend_from_slice(&h[i]);
                }
            }
            hn.push(h);
            cn.push(c);
        }
        input = out;
    }
    (input, hn, cn)
}

/// `t [A, B, C]` as nested rows.
fn nest(t: &Tensor) -> Seq {
    let (s, v) = (t.shape().to_vec(), f64s(t));
    (0..s[0]).map(|a| (0..s[1]).map(|b| v[(a * s[1] + b) * s[2]..(a * s[1] + b + 1) * s[2]].to_vec()).collect()).collect()
}

fn flat(s: &Seq) -> Vec<f64> {
    s.iter().flatten().flatten().copied().collect()
}

fn normal(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_at(shape, Distribution::Normal, seed, 0, DType::F64, Device::Cpu).unwrap()
}

#[test]
fn a_two_layer_bidirectional_lstm_follows_pytorchs_equations() -> Result<()> {
    set_default_dtype(DType::F64);
    kiln_tensor::rng::manual_seed(1);
    let cfg = RnnConfig::new(3, 4).num_layers(2).bidirectional(true).batch_first(true);
    let lstm = Lstm::new(cfg, Device::Cpu)?;
    let (b, t) = (2, 5);
    let x = normal(&[b, t, 3], 10);
    let (h0, c0) = (normal(&[4, b, 4], 11), normal(&[4, b, 4], 12));
    let (y, (hn, cn)) = lstm.forward_with(&x, Some((&h0, &c0)))?;
    assert_eq!((y.shape(), hn.shape(), cn.shape()), (&[b, t, 8][..], &[4, b, 4][..], &[4, b, 4][..]));

    let cells: Vec<RefGates> =
        (0..2).flat_map(|l| (0..2).map(move |d| (l, d))).map(|(l, d)| RefGates::of(&lstm.cell(l, d).unwrap().gates)).collect();
    let xs = nest(&x.transpose(0usize, 1usize)?.contiguous()?);
    let (out, h, c) = reference(&cells, 2, &xs, &nest(&h0), Some(&nest(&c0)));
    close("output", &f64s(&y.transpose(0usize, 1usize)?.contiguous()?), &flat(&out), 1e-12);
    close("h_n", &f64s(&hn), &flat(&h), 1e-12);
    close("c_n", &f64s(&cn), &flat(&c), 1e-12);

    // No initial state is zeros; `forward` is the output alone.
    let zeros = Tensor::zeros(&[4, b, 4], DType::F64, Device::Cpu)?;
    close("zero state", &f64s(&lstm.forward(&x)?), &f64s(&lstm.forward_with(&x, Some((&zeros, &zeros)))?.0), 0.0);
    Ok(())
}

#[test]
fn a_two_layer_gru_and_a_bidirectional_one_without_bias_follow_pytorchs_equations() -> Result<()> {
    set_default_dtype(DType::F64);
    kiln_tensor::rng::manual_seed(2);
    for cfg in [RnnConfig::new(3, 5).num_layers(2), RnnConfig::new(3, 5).bidirectional(true).bias(false)] {
        let gru = Gru::new(cfg, Device::Cpu)?;
        let dirs = if cfg.bidirectional { 2 } else { 1 };
        let x = normal(&[6, 2, 3], 20);
        let h0 = normal(&[2, 2, 5], 21);
        let (y, hn) = gru.forward_with(&x, Some(&h0))?;
        let cells: Vec<RefGates> = (0..2).map(|k| RefGates::of(&gru.cell(k / dirs, k % dirs).unwrap().gates)).collect();
        let (out, h, _) = reference(&cells, dirs, &nest(&x), &nest(&h0), None);
        close("output", &f64s(&y), &flat(&out), 1e-12);
        close("h_n", &f64s(&hn), &flat(&h), 1e-12);
    }
    Ok(())
}

#[test]
fn cells_step_once_and_parameters_carry_pytorchs_names_and_init() -> Result<()> {
    set_default_dtype(DType::F64);
    kiln_tensor::rng::manual_seed(3);
    let (x, h, c) = (normal(&[2, 3], 30), normal(&[2, 4], 31), normal(&[2, 4], 32));
    let cell = LstmCell::new(3, 4, true, Device::Cpu)?;
    let (h2, c2) = cell.forward(&x, (&h, &c))?;
    let g = RefGates::of(&cell.gates);
    let (rx, rh, rc) = (nest(&x.unsqueeze(0usize)?), nest(&h.unsqueeze(0usize)?), nest(&c.unsqueeze(0usize)?));
    for i in 0..2 {
        let (wh, wc) = g.lstm(&rx[0][i], &rh[0][i], &rc[0][i]);
        close("LSTMCell h", &f64s(&h2)[i * 4..i * 4 + 4], &wh, 1e-12);
        close("LSTMCell c", &f64s(&c2)[i * 4..i * 4 + 4], &wc, 1e-12);
    }
    let gru = GruCell::new(3, 4, true, Device::Cpu)?;
    let g = RefGates::of(&gru.gates);
    let want: Vec<f64> = (0..2).flat_map(|i| g.gru(&rx[0][i], &rh[0][i])).collect();
    close("GRUCell", &f64s(&gru.forward(&x, &h)?), &want, 1e-12);

    let lstm = Lstm::new(RnnConfig::new(3, 4).num_layers(2).bidirectional(true), Device::Cpu)?;
    let names: Vec<String> = lstm.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(&names[..4], ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]);
    assert_eq!(names[4], "weight_ih_l0_reverse");
    assert_eq!(names.len(), 16);
    let shapes: Vec<Vec<usize>> = lstm.parameters().iter().map(|p| p.shape().to_vec()).collect();
    assert_eq!((&shapes[0], &shapes[8]), (&vec![16, 3], &vec![16, 8]), "layer 1 reads both directions");
    // U(-1/sqrt(H), 1/sqrt(H)) = U(-0.5, 0.5), every parameter a leaf that trains.
    for p in lstm.parameters() {
        assert!(p.requires_grad());
        assert!(f64s(&p).iter().all(|v| v.abs() <= 0.5));
    }
    let spread = f64s(&lstm.parameters()[8]).iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(spread > 0.4, "the draws fill the range: {spread}");
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    set_default_dtype(DType::F64);
    kiln_tensor::rng::manual_seed(4);
    let cfg = GradcheckConfig { atol: 1e-6, rtol: 1e-5, ..GradcheckConfig::default() };
    // Through both layers and directions: the input and the initial states.
    let lstm = Lstm::new(RnnConfig::new(2, 3).num_layers(2).bidirectional(true), Device::Cpu)?;
    let ins = [normal(&[4, 2, 2], 40), normal(&[4, 2, 3], 41), normal(&[4, 2, 3], 42)];
    gradcheck(
        |t| {
            let (y, (h, c)) = lstm.forward_with(&t[0], Some((&t[1], &t[2])))?;
            y.square()?.sum_all()?.add(&h.sum_all()?)?.add(&c.mul(&c)?.sum_all()?)
        },
        &ins,
        cfg,
    )?;
    // A GRU cell's weights and biases over three steps.
    let cell = GruCell::new(2, 3, true, Device::Cpu)?;
    let g = cell.gates.clone();
    let params = [g.weight_ih, g.weight_hh, g.bias_ih.unwrap(), g.bias_hh.unwrap(), normal(&[3, 2, 2], 43)];
    gradcheck(
        |t| {
            let c = GruCell {
                gates: Gates { weight_ih: t[0].clone(), weight_hh: t[1].clone(), bias_ih: Some(t[2].clone()), bias_hh: Some(t[3].clone()) },
            };
            let mut h = Tensor::zeros(&[2, 3], DType::F64, Device::Cpu)?;
            for s in 0..3 {
                h = c.forward(&t[4].narrow(0usize, s, 1)?.squeeze(0usize)?, &h)?;
            }
            h.tanh()?.sum_all()
        },
        &params,
        cfg,
    )?;
    Ok(())
}

#[test]
fn bad_shapes_are_errors_that_name_them() -> Result<()> {
    set_default_dtype(DType::F64);
    let lstm = Lstm::new(RnnConfig::new(3, 4).num_layers(2), Device::Cpu)?;
    let e = lstm.forward(&normal(&[5, 2, 7], 1)).unwrap_err().to_string();
    assert!(e.contains("[5, 2, 7]") && e.contains("I = 3"), "{e}");
    let e = lstm.forward(&normal(&[5, 3], 1)).unwrap_err().to_string();
    assert!(e.contains("[5, 3]"), "{e}");
    let (x, bad) = (normal(&[5, 2, 3], 1), normal(&[1, 2, 4], 2));
    let e = lstm.forward_with(&x, Some((&bad, &bad))).unwrap_err().to_string();
    assert!(e.contains("[1, 2, 4]") && e.contains("[2, 2, 4]"), "{e}");
    let cell = GruCell::new(3, 4, true, Device::Cpu)?;
    let e = cell.forward(&normal(&[2, 3], 1), &normal(&[3, 4], 2)).unwrap_err().to_string();
    assert!(e.contains("[2, 3]") && e.contains("[3, 4]"), "{e}");
    let e = Gru::new(RnnConfig::new(3, 4).dropout(1.5), Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("dropout"), "{e}");
    Ok(())
}
