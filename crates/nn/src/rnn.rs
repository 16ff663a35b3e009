//! Recurrent layers: `LstmCell`, `GruCell` and the multi-layer, optionally bidirectional
//! `Lstm` and `Gru`, with PyTorch's gate order, parameter names and initialisation, so a
//! PyTorch state dict loads as it is. Built from existing ops: autograd, CUDA and compile
//! (which unrolls the time loop into one graph) come with them.

use crate::init::weight_and_bias;
use crate::layers::dropout;
use crate::module::{join, Forward, Module};
use kiln_tensor::{Device, Error, Flag, Result, Tensor};

/// The gates of one cell: `weight_ih [G*H, I]`, `weight_hh [G*H, H]` and their biases
/// `[G*H]` (G = 4 for an LSTM, 3 for a GRU), all U(-1/sqrt(H), 1/sqrt(H)) as in PyTorch.
#[derive(Debug, Clone)]
pub struct Gates {
    pub weight_ih: Tensor,
    pub weight_hh: Tensor,
    pub bias_ih: Option<Tensor>,
    pub bias_hh: Option<Tensor>,
}

impl Gates {
    fn new(gates: usize, input: usize, hidden: usize, bias: bool, device: Device) -> Result<Gates> {
        // Every parameter's bound is 1/sqrt(hidden): a fan-in of `hidden` for both.
        let g = gates * hidden;
        let (weight_ih, bias_ih) = weight_and_bias(&[g, input], hidden, bias.then_some(g), device)?;
        let (weight_hh, bias_hh) = weight_and_bias(&[g, hidden], hidden, bias.then_some(g), device)?;
        Ok(Gates { weight_ih, weight_hh, bias_ih, bias_hh })
    }

    fn hidden(&self) -> usize {
        self.weight_hh.shape()[1]
    }

    /// `x W_ih^T + b_ih` for inputs of any leading shape (all time steps in one product).
    fn input_part(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.weight_ih, self.bias_ih.as_ref())
    }

    fn hidden_part(&self, h: &Tensor) -> Result<Tensor> {
        h.linear(&self.weight_hh, self.bias_hh.as_ref())
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(&mut self.weight_ih)?;
        f(&mut self.weight_hh)?;
        self.bias_ih.iter_mut().chain(self.bias_hh.iter_mut()).try_for_each(f)
    }

    fn visit(&self, prefix: &str, suffix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(join(prefix, &format!("weight_ih{suffix}")), &self.weight_ih);
        f(join(prefix, &format!("weight_hh{suffix}")), &self.weight_hh);
        if let (Some(bi), Some(bh)) = (&self.bias_ih, &self.bias_hh) {
            f(join(prefix, &format!("bias_ih{suffix}")), bi);
            f(join(prefix, &format!("bias_hh{suffix}")), bh);
        }
    }

    /// An error naming the shapes unless `x` is `[B, I]` and `h` `[B, H]`.
    fn check_step(&self, op: &'static str, x: &Tensor, h: &Tensor) -> Result<()> {
        let (input, hidden) = (self.weight_ih.shape()[1], self.hidden());
        let ok = x.rank() == 2 && x.shape()[1] == input && h.shape() == [x.shape()[0], hidden];
        if ok {
            return Ok(());
        }
        Err(Error::shape(
            op,
            format!(
                "input {:?} and state {:?} for input size {input}, hidden size {hidden}: need [B, {input}] and [B, {hidden}]",
                x.shape(),
                h.shape()
            ),
        ))
    }
}

/// The kind of recurrence: how one step turns the input part and the state into the next state.
trait Cell {
    /// Rows of gates per hidden unit (4 or 3).
    const GATES: usize;
    /// The state carried from step to step: `[h]` for a GRU, `[h, c]` for an LSTM.
    type State: Clone;
    fn gates(&self) -> &Gates;
    fn gates_mut(&mut self) -> &mut Gates;
    /// One step from the precomputed input part `xi = x W_ih^T + b_ih`.
    fn step_from(&self, xi: &Tensor, state: &Self::State) -> Result<Self::State>;
    fn h(state: &Self::State) -> &Tensor;
}

/// `nn.LSTMCell`: gates i, f, g, o in that order; `c' = f c + i g`, `h' = o tanh(c')`.
#[derive(Debug, Clone)]
pub struct LstmCell {
    pub gates: Gates,
}

impl LstmCell {
    pub fn new(input: usize, hidden: usize, bias: bool, device: Device) -> Result<LstmCell> {
        Ok(LstmCell { gates: Gates::new(4, input, hidden, bias, device)? })
    }

    /// One step: `x [B, I]`, `(h, c)` each `[B, H]`, to the next `(h, c)`.
    pub fn forward(&self, x: &Tensor, (h, c): (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
        self.gates.check_step("LSTMCell", x, h)?;
        if c.shape() != h.shape() {
            return Err(Error::shape("LSTMCell", format!("cell state {:?} against hidden state {:?}", c.shape(), h.shape())));
        }
        let [h, c] = self.step_from(&self.gates.input_part(x)?, &[h.clone(), c.clone()])?;
        Ok((h, c))
    }
}

impl Cell for LstmCell {
    const GATES: usize = 4;
    type State = [Tensor; 2];
    fn gates(&self) -> &Gates {
        &self.gates
    }
    fn gates_mut(&mut self) -> &mut Gates {
        &mut self.gates
    }
    fn step_from(&self, xi: &Tensor, [h, c]: &[Tensor; 2]) -> Result<[Tensor; 2]> {
        let z = xi.add(&self.gates.hidden_part(h)?)?;
        let g = z.chunk(4, -1)?;
        let (i, f, cand, o) = (g[0].sigmoid()?, g[1].sigmoid()?, g[2].tanh()?, g[3].sigmoid()?);
        let c = f.mul(c)?.add(&i.mul(&cand)?)?;
        Ok([o.mul(&c.tanh()?)?, c])
    }
    fn h(state: &[Tensor; 2]) -> &Tensor {
        &state[0]
    }
}

impl Module for LstmCell {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.gates.visit(prefix, "", f);
    }
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.gates.visit_mut(f)
    }
}

/// `nn.GRUCell`: gates r, z, n in that order; `n = tanh(x_n + r (h W_hn^T + b_hn))`,
/// `h' = (1 - z) n + z h`.
#[derive(Debug, Clone)]
pub struct GruCell {
    pub gates: Gates,
}

impl GruCell {
    pub fn new(input: usize, hidden: usize, bias: bool, device: Device) -> Result<GruCell> {
        Ok(GruCell { gates: Gates::new(3, input, hidden, bias, device)? })
    }

    /// One step: `x [B, I]`, `h [B, H]`, to the next `h`.
    pub fn forward(&self, x: &Tensor, h: &Tensor) -> Result<Tensor> {
        self.gates.check_step("GRUCell", x, h)?;
        let [h] = self.step_from(&self.gates.input_part(x)?, std::array::from_ref(h))?;
        Ok(h)
    }
}

impl Cell for GruCell {
    const GATES: usize = 3;
    type State = [Tensor; 1];
    fn gates(&self) -> &Gates {
        &self.gates
    }
    fn gates_mut(&mut self) -> &mut Gates {
        &mut self.gates
    }
    fn step_from(&self, xi: &Tensor, [h]: &[Tensor; 1]) -> Result<[Tensor; 1]> {
        let (xg, hg) = (xi.chunk(3, -1)?, self.gates.hidden_part(h)?.chunk(3, -1)?);
        let r = xg[0].add(&hg[0])?.sigmoid()?;
        let z = xg[1].add(&hg[1])?.sigmoid()?;
        let n = xg[2].add(&r.mul(&hg[2])?)?.tanh()?;
        // (1 - z) n + z h = n + z (h - n)
        Ok([n.add(&z.mul(&h.sub(&n)?)?)?])
    }
    fn h(state: &[Tensor; 1]) -> &Tensor {
        &state[0]
    }
}

impl Module for GruCell {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.gates.visit(prefix, "", f);
    }
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.gates.visit_mut(f)
    }
}

/// The options of `nn.LSTM` and `nn.GRU`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RnnConfig {
    pub input_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub bias: bool,
    /// Inputs and outputs `[B, T, ..]` instead of `[T, B, ..]`.
    pub batch_first: bool,
    /// Dropout on each layer's output but the last's, in training.
    pub dropout: f64,
    pub bidirectional: bool,
}

impl RnnConfig {
    /// One layer, biases, time first, no dropout, one direction (PyTorch's defaults).
    pub fn new(input_size: usize, hidden_size: usize) -> RnnConfig {
        RnnConfig { input_size, hidden_size, num_layers: 1, bias: true, batch_first: false, dropout: 0.0, bidirectional: false }
    }
    pub fn num_layers(self, num_layers: usize) -> RnnConfig {
        RnnConfig { num_layers, ..self }
    }
    pub fn batch_first(self, batch_first: bool) -> RnnConfig {
        RnnConfig { batch_first, ..self }
    }
    pub fn dropout(self, dropout: f64) -> RnnConfig {
        RnnConfig { dropout, ..self }
    }
    pub fn bidirectional(self, bidirectional: bool) -> RnnConfig {
        RnnConfig { bidirectional, ..self }
    }
    pub fn bias(self, bias: bool) -> RnnConfig {
        RnnConfig { bias, ..self }
    }
    fn directions(&self) -> usize {
        if self.bidirectional {
            2
        } else {
            1
        }
    }
}

/// Layers of cells, `cells[layer * directions + direction]`, run over a sequence.
#[derive(Debug, Clone)]
struct Stack<C> {
    cfg: RnnConfig,
    cells: Vec<C>,
    training: Flag,
}

impl<C: Cell> Stack<C> {
    fn new(cfg: RnnConfig, make: impl Fn(usize, usize, bool) -> Result<C>) -> Result<Stack<C>> {
        let name = if C::GATES == 4 { "LSTM" } else { "GRU" };
        if cfg.input_size == 0 || cfg.hidden_size == 0 || cfg.num_layers == 0 || !(0.0..1.0).contains(&cfg.dropout) {
            return Err(Error::Msg(format!("{name}: needs positive sizes and layers and dropout in [0, 1), got {cfg:?}")));
        }
        let d = cfg.directions();
        let cells = (0..cfg.num_layers * d)
            .map(|k| make(if k < d { cfg.input_size } else { d * cfg.hidden_size }, cfg.hidden_size, cfg.bias))
            .collect::<Result<Vec<C>>>()?;
        Ok(Stack { cfg, cells, training: Flag::new(true) })
    }

    /// The input as `[T, B, I]`, with an error naming the shapes when it is not a sequence.
    fn time_first(&self, op: &'static str, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 3 || x.shape()[2] != self.cfg.input_size {
            let layout = if self.cfg.batch_first { "[B, T, I]" } else { "[T, B, I]" };
            return Err(Error::shape(op, format!("input {:?} is not {layout} with I = {}", x.shape(), self.cfg.input_size)));
        }
        if self.cfg.batch_first {
            x.transpose(0usize, 1usize)
        } else {
            Ok(x.clone())
        }
    }

    /// Runs every layer and direction over `x [T, B, I]` from the initial states `init[k]`;
    /// returns the last layer's outputs `[T, B, D*H]` and each cell's final state.
    fn run(&self, x: &Tensor, init: Vec<C::State>) -> Result<(Tensor, Vec<C::State>)> {
        let d = self.cfg.directions();
        let mut input = x.clone();
        let mut finals = Vec::with_capacity(self.cells.len());
        for layer in 0..self.cfg.num_layers {
            let mut outs = Vec::with_capacity(d);
            for dir in 0..d {
                let k = layer * d + dir;
                let (seq, last) = run_direction(&self.cells[k], &input, init[k].clone(), dir == 1)?;
                outs.push(seq);
                finals.push(last);
            }
            let refs: Vec<&Tensor> = outs.iter().collect();
            input = if d == 1 { outs[0].clone() } else { Tensor::cat(&refs, 2usize)? };
            if layer + 1 < self.cfg.num_layers {
                input = dropout(&input, self.cfg.dropout, self.training.get())?;
            }
        }
        Ok((input, finals))
    }

    fn cell(&self, layer: usize, direction: usize) -> Option<&C> {
        let d = self.cfg.directions();
        self.cells.get(layer * d + direction).filter(|_| direction < d)
    }

    /// `[T, B, H]` back to the caller's layout.
    fn output(&self, y: Tensor) -> Result<Tensor> {
        if self.cfg.batch_first {
            y.transpose(0usize, 1usize)?.contiguous()
        } else {
            Ok(y)
        }
    }

    /// An initial state `[L*D, B, H]` (zeros when not given) as one `[B, H]` per cell.
    fn split_state(&self, op: &'static str, given: Option<&Tensor>, batch: usize, like: &Tensor) -> Result<Vec<Tensor>> {
        let want = [self.cells.len(), batch, self.cfg.hidden_size];
        let state = match given {
            Some(s) if s.shape() == want => s.clone(),
            Some(s) => return Err(Error::shape(op, format!("initial state {:?}, expected {want:?}", s.shape()))),
            None => Tensor::zeros(&want, like.dtype(), like.device())?,
        };
        (0..want[0]).map(|k| state.narrow(0usize, k, 1)?.squeeze(0usize)).collect()
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        let d = self.cfg.directions();
        for (k, cell) in self.cells.iter().enumerate() {
            let suffix = format!("_l{}{}", k / d, if k % d == 1 { "_reverse" } else { "" });
            cell.gates().visit(prefix, &suffix, f);
        }
    }
}

/// One direction of one layer over `x [T, B, I]`: outputs `[T, B, H]` in time order and the
/// final state. The input products of all steps are one matmul.
fn run_direction<C: Cell>(cell: &C, x: &Tensor, mut state: C::State, reverse: bool) -> Result<(Tensor, C::State)> {
    let t = x.shape()[0];
    let xi = cell.gates().input_part(x)?;
    let mut outs: Vec<Tensor> = Vec::with_capacity(t);
    for s in 0..t {
        let s = if reverse { t - 1 - s } else { s };
        state = cell.step_from(&xi.narrow(0usize, s, 1)?.squeeze(0usize)?, &state)?;
        outs.push(C::h(&state).clone());
    }
    if reverse {
        outs.reverse();
    }
    let refs: Vec<&Tensor> = outs.iter().collect();
    Ok((Tensor::stack(&refs, 0usize)?, state))
}

/// `[L*D, B, H]` from one `[B, H]` per cell.
fn stack_states(states: impl Iterator<Item = Tensor>) -> Result<Tensor> {
    let states: Vec<Tensor> = states.collect();
    let refs: Vec<&Tensor> = states.iter().collect();
    Tensor::stack(&refs, 0usize)
}

/// `nn.LSTM`. `forward(x, Some((h0, c0)))` with `x [T, B, I]` (`[B, T, I]` batch first) and
/// states `[L*D, B, H]` gives `(output [T, B, D*H], (h_n, c_n))`; no states start from zeros.
#[derive(Debug, Clone)]
pub struct Lstm(Stack<LstmCell>);

impl Lstm {
    pub fn new(cfg: RnnConfig, device: Device) -> Result<Lstm> {
        Ok(Lstm(Stack::new(cfg, |i, h, b| LstmCell::new(i, h, b, device))?))
    }
    pub fn config(&self) -> &RnnConfig {
        &self.0.cfg
    }
    /// The cell of `layer` (0 first) and `direction` (1 the reverse).
    pub fn cell(&self, layer: usize, direction: usize) -> Option<&LstmCell> {
        self.0.cell(layer, direction)
    }

    pub fn forward_with(&self, x: &Tensor, state: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, (Tensor, Tensor))> {
        let x = self.0.time_first("LSTM", x)?;
        let b = x.shape()[1];
        let h0 = self.0.split_state("LSTM", state.map(|s| s.0), b, &x)?;
        let c0 = self.0.split_state("LSTM", state.map(|s| s.1), b, &x)?;
        let init = h0.into_iter().zip(c0).map(|(h, c)| [h, c]).collect();
        let (y, finals) = self.0.run(&x, init)?;
        let h = stack_states(finals.iter().map(|[h, _]| h.clone()))?;
        let c = stack_states(finals.into_iter().map(|[_, c]| c))?;
        Ok((self.0.output(y)?, (h, c)))
    }
}

impl Forward for Lstm {
    /// The output sequence alone (what `Sequential` passes on).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with(x, None)?.0)
    }
}

impl Module for Lstm {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.0.visit(prefix, f);
    }
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.0.cells.iter_mut().try_for_each(|c| c.gates_mut().visit_mut(f))
    }
    fn set_training(&self, training: bool) {
        self.0.training.set(training);
    }
}

/// `nn.GRU`. `forward(x, Some(h0))` with `x [T, B, I]` (`[B, T, I]` batch first) and `h0
/// [L*D, B, H]` gives `(output [T, B, D*H], h_n)`; no state starts from zeros.
#[derive(Debug, Clone)]
pub struct Gru(Stack<GruCell>);

impl Gru {
    pub fn new(cfg: RnnConfig, device: Device) -> Result<Gru> {
        Ok(Gru(Stack::new(cfg, |i, h, b| GruCell::new(i, h, b, device))?))
    }
    pub fn config(&self) -> &RnnConfig {
        &self.0.cfg
    }
    /// The cell of `layer` (0 first) and `direction` (1 the reverse).
    pub fn cell(&self, layer: usize, direction: usize) -> Option<&GruCell> {
        self.0.cell(layer, direction)
    }

    pub fn forward_with(&self, x: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let x = self.0.time_first("GRU", x)?;
        let h0 = self.0.split_state("GRU", h0, x.shape()[1], &x)?;
        let (y, finals) = self.0.run(&x, h0.into_iter().map(|h| [h]).collect())?;
        let h = stack_states(finals.into_iter().map(|[h]| h))?;
        Ok((self.0.output(y)?, h))
    }
}

impl Forward for Gru {
    /// The output sequence alone (what `Sequential` passes on).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with(x, None)?.0)
    }
}

impl Module for Gru {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.0.visit(prefix, f);
    }
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.0.cells.iter_mut().try_for_each(|c| c.gates_mut().visit_mut(f))
    }
    fn set_training(&self, training: bool) {
        self.0.training.set(training);
    }
}
