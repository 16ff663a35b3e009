//! Compile's fused kernels: a fusion group (pointwise members, folded sums, a fed product)
//! as one generated kernel, and the copy of a captured step's outputs.

use crate::codegen::{compute_type, double_literal, elementwise_expr, strided_index, Numbers};
use crate::cuda::kernels::prelude::{storage_type, PRELUDE};
use crate::op::{Op, ReduceOp};
use crate::DType;

/// Where a fused member's argument comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedSrc {
    Input(usize),
    Member(usize),
}

/// An input of a fused kernel: read at `offset + i` when `strides` is `None`, else at
/// `offset + sum(coord_d * strides_d)` over `shape` (broadcasts have stride 0). With `lead`,
/// the value is output `r` of the kernel's lead group, read from a register (its buffer is
/// still passed: the kernel's last block writes it). With `fed`, the value is a short
/// product computed where it is read, its left operand at `offset` of this input's buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FusedInput {
    pub dtype: DType,
    pub offset: usize,
    pub strided: Option<(Vec<usize>, Vec<usize>)>,
    pub lead: Option<usize>,
    pub fed: Option<Fed>,
}

/// A product with a short contraction computed by the group that reads it (a weight gradient
/// `g^T x` at a small batch, fed to its optimizer update: no launch of its own, and the
/// gradient never written out and read back). Element `i` of the group, at row `r = i / cols`
/// and column `c = i % cols`, is `sum_t a[r sa[0] + t sa[1]] b[t sb[0] + c sb[1]]` over the
/// `k` terms in order (as the thin-product kernel adds them), a from the input's `offset` and
/// b (passed right after a) from `b.0`; with `b` None it is the sum of a's row `r`
/// (`MatmulEpilogue::SumLeft`'s sums, `cols` 1). F32 or F64.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fed {
    pub k: usize,
    pub cols: usize,
    pub a: [usize; 2],
    pub b: Option<(usize, [usize; 2])>,
}

impl Fed {
    /// The elements of a and of b a group of `n` elements reads up to (exclusive), from the
    /// offsets.
    pub fn extents(&self, offset: usize, n: usize) -> (usize, Option<usize>) {
        let (rows, last_t) = (n.div_ceil(self.cols.max(1)).max(1), self.k.max(1) - 1);
        let a = offset + (rows - 1) * self.a[0] + last_t * self.a[1] + 1;
        (a, self.b.map(|(at, sb)| at + last_t * sb[0] + (self.cols.max(1) - 1) * sb[1] + 1))
    }

    /// Whether four neighbouring elements can be made from aligned vector reads: four columns
    /// of one row from b's rows, or four rows' sums from a's columns.
    fn vec4(&self, offset: usize) -> bool {
        match self.b {
            Some((at, sb)) => self.cols.is_multiple_of(4) && sb[1] == 1 && at % 4 == 0 && sb[0] % 4 == 0,
            None => self.cols == 1 && self.a[0] == 1 && offset.is_multiple_of(4) && self.a[1].is_multiple_of(4),
        }
    }

    /// The value (or with `vec` four values as `VI{k}`) of input `k` of group `j` at linear
    /// element `i`.
    fn value(&self, x: &FusedInput, (j, k): (usize, usize), i: &str, narrow: bool, vec: bool) -> String {
        let (r, c) = match narrow {
            true => (format!("((unsigned)({i}) / {}u)", self.cols), format!("((unsigned)({i}) % {}u)", self.cols)),
            false => (format!("(({i}) / {}LL)", self.cols), format!("(({i}) % {}LL)", self.cols)),
        };
        let t = storage_type(x.dtype);
        let (w, one) = if vec { (format!("4, VI{k}"), "") } else { (format!("1, kiln_v1<{t}>"), ".v[0]") };
        let a = format!("p{j}_{k} + {} + (long long){r} * {}LL", x.offset, self.a[0]);
        let call = match self.b {
            Some((at, sb)) => {
                let b = format!("p{j}_{k}b + {at} + (long long){c} * {}LL", sb[1]);
                format!("kiln_fed_dot<{}, {w}>({a}, {}LL, {b}, {}LL)", self.k, self.a[1], sb[0])
            }
            None => format!("kiln_fed_sum<{}, {w}>({a}, {}LL)", self.k, self.a[1]),
        };
        call + one
    }
}

/// One op of a fused kernel: an elementwise `Op` over earlier members or inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedMember {
    pub op: Op,
    pub args: Vec<FusedSrc>,
    pub dtype: DType,
}

impl FusedMember {
    /// A reduction member: a folding group's sum (`fold_loop`).
    fn is_sum(&self) -> bool {
        matches!(self.op, Op::Reduce { .. })
    }
}

/// A compiled graph's fusion group: per element, each input is loaded once, the members run
/// in order in registers, and `outputs` (member indices) are stored densely. Shapes and
/// strides are literals in a kernel specialised to its shapes, parameters in a generic one
/// (`FusedKernel::generic`).
///
/// A group may end in full sums (`Op::Reduce` members: every element of one member or input
/// into one value), followed by scalar members over those sums: then one block loops over the
/// `n` elements, folds each sum across its threads, and thread 0 runs the scalar members
/// (`after_fold`). That is how a mean loss (per-row losses, the count of real targets, the
/// division and its gradient's scale) becomes one launch.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedGroup {
    pub n: usize,
    pub inputs: Vec<FusedInput>,
    pub members: Vec<FusedMember>,
    pub outputs: Vec<usize>,
}

/// One kernel running one or more independent groups, each over its own range of blocks
/// (horizontal fusion: e.g. every parameter's optimizer update in one launch). Parameters
/// are each group's outputs then inputs, group after group.
///
/// With `lead`, `groups[0]` is a scalar group (one element, no sums, e.g. AdamW's step count
/// and bias corrections) that every thread computes first, and the other groups read its
/// outputs from registers (`FusedInput::lead`). It gets no blocks: the grid's last block to
/// finish stores its outputs, counted by a ticket (a `u32` that is zero between launches,
/// passed last), since an output may be state the lead reads (the step count).
///
/// With `copies`, that last block also copies `copies` byte ranges (parameters `c{i}s`,
/// `c{i}d`, `c{i}n` before the ticket; none where `c{i}d` is null): the step's outputs into
/// the caller's tensors when this is a captured step's last launch, so that the graph needs
/// no copy node after it.
///
/// With `generic`, the sizes, offsets, strides and scalars are parameters passed after the
/// ticket (`Numbers`), not literals: one source serves a dynamic-shape program at every size.
/// (Fed products, whose contraction length unrolls, are not generic.)
#[derive(Debug, Clone, PartialEq)]
pub struct FusedKernel {
    pub name: String,
    pub groups: Vec<FusedGroup>,
    pub lead: bool,
    pub copies: usize,
    pub generic: bool,
}

/// Threads per block of fused kernels, and the most blocks one group gets (grid-stride beyond).
pub const FUSED_BLOCK: usize = 256;

const FUSED_MAX_BLOCKS: usize = 2048;

impl FusedGroup {
    /// Elements per thread of the vector path (aligned vector loads and stores), or 1 for the
    /// scalar loop: 8 where every input loaded is 16-bit (a 16-byte load each, as an F32
    /// input's four make: with 8-byte loads too few bytes are in flight to reach the
    /// bandwidth), else 4; the length a multiple of it and every input read that many at a
    /// time (`vec_read`).
    pub fn width(&self) -> usize {
        if self.folds() {
            return 1;
        }
        let loads_16bit = self.inputs.iter().filter(|x| x.lead.is_none()).all(|x| x.dtype.size_in_bytes() == 2);
        let fits = |w: usize| self.n >= w && self.n.is_multiple_of(w) && self.inputs.iter().all(|x| vec_read(x, w).is_some());
        [8, 4].into_iter().filter(|&w| w == 4 || loads_16bit).find(|&w| fits(w)).unwrap_or(1)
    }

    /// Whether the group takes the vector path (`width` above 1).
    pub fn vectorised(&self) -> bool {
        self.width() > 1
    }

    /// The widths a generic kernel carries a vector loop for, beside its scalar loop: every
    /// width `width` can take at some size, given how the inputs are laid out (the launch
    /// passes the one this size takes).
    fn widths(&self) -> Vec<usize> {
        if self.folds() || self.inputs.iter().any(|x| vec_kind(x).is_none()) {
            return vec![];
        }
        let loads_16bit = self.inputs.iter().filter(|x| x.lead.is_none()).all(|x| x.dtype.size_in_bytes() == 2);
        [8, 4].into_iter().filter(|&w| w == 4 || loads_16bit).collect()
    }

    /// Whether the group ends in sums folded by one block.
    pub fn folds(&self) -> bool {
        self.members.iter().any(FusedMember::is_sum)
    }

    /// Elements of each output: one for a value computed after the fold, else `n`.
    pub fn output_lens(&self) -> Vec<usize> {
        let after = if self.folds() { self.after_fold() } else { vec![] };
        self.outputs.iter().map(|&m| if after.get(m) == Some(&true) { 1 } else { self.n }).collect()
    }

    /// Members computed once after the fold: the sums and every member reading one.
    fn after_fold(&self) -> Vec<bool> {
        let mut after = vec![false; self.members.len()];
        for (q, m) in self.members.iter().enumerate() {
            after[q] = m.is_sum() || m.args.iter().any(|a| matches!(*a, FusedSrc::Member(j) if after[j]));
        }
        after
    }

    /// Whether element indices fit 32 bits (cheaper index arithmetic).
    fn narrow(&self) -> bool {
        self.n <= u32::MAX as usize
    }

    /// Blocks this group gets in its kernel's grid.
    pub fn blocks(&self) -> usize {
        if self.folds() {
            return 1;
        }
        let items = self.n / self.width();
        items.div_ceil(FUSED_BLOCK).clamp(1, FUSED_MAX_BLOCKS)
    }
}

/// How the vector path reads an input `w` elements at a time: `w` aligned neighbours
/// (`Dense` from its offset, or `Rows`: a strided input whose last dim is contiguous, a
/// multiple of `w` long and aligned), or one value for all `w` (`Splat`: broadcast along
/// a last dim that is a multiple of `w` long, such as a bias over rows).
enum VecRead {
    Dense,
    Rows,
    Splat,
    /// Four values of a fed product (`Fed::vec4`).
    Fed,
}

/// How input `x` is read `w` at a time where its sizes and offset allow (`vec_read` without
/// the divisibility and alignment a size decides).
fn vec_kind(x: &FusedInput) -> Option<VecRead> {
    if x.lead.is_some() {
        return Some(VecRead::Splat);
    }
    match (&x.strided, &x.fed) {
        (_, Some(_)) => None,
        (None, None) => Some(VecRead::Dense),
        (Some((_, strides)), None) => match strides.last()? {
            0 => Some(VecRead::Splat),
            1 => Some(VecRead::Rows),
            _ => None,
        },
    }
}

fn vec_read(x: &FusedInput, w: usize) -> Option<VecRead> {
    if x.lead.is_some() {
        return Some(VecRead::Splat);
    }
    if let Some(f) = &x.fed {
        return (w == 4 && f.vec4(x.offset)).then_some(VecRead::Fed);
    }
    let Some((shape, strides)) = &x.strided else { return x.offset.is_multiple_of(w).then_some(VecRead::Dense) };
    let last = shape.len().checked_sub(1)?;
    if shape[last] % w != 0 {
        return None;
    }
    let aligned = x.offset.is_multiple_of(w) && strides[..last].iter().zip(shape).all(|(s, n)| *n == 1 || s % w == 0);
    match strides[last] {
        0 => Some(VecRead::Splat),
        1 if aligned => Some(VecRead::Rows),
        _ => None,
    }
}

impl FusedKernel {
    /// Blocks of the whole launch (none for a lead).
    pub fn blocks(&self) -> usize {
        self.groups.iter().skip(self.lead as usize).map(FusedGroup::blocks).sum()
    }

    /// The kernel's source (without the prelude: `fused_module` adds it once per module).
    pub fn source(&self) -> Result<String, String> {
        self.source_and_numbers().map(|(s, _)| s)
    }

    /// The kernel's source and the numbers a generic one is launched with (after the ticket).
    pub fn source_and_numbers(&self) -> Result<(String, Numbers), String> {
        let mut nums = Numbers::new(self.generic);
        let body = self.body(&mut nums)?;
        let mut params: Vec<String> = Vec::new();
        for (j, gr) in self.groups.iter().enumerate() {
            for (k, &m) in gr.outputs.iter().enumerate() {
                let d = gr.members.get(m).ok_or_else(|| format!("{}: output {k} names no member", self.name))?.dtype;
                params.push(format!("{}* o{j}_{k}", storage_type(d)));
            }
            for (k, x) in gr.inputs.iter().enumerate() {
                params.push(format!("const {}* p{j}_{k}", storage_type(x.dtype)));
                if x.fed.as_ref().is_some_and(|f| f.b.is_some()) {
                    params.push(format!("const {}* p{j}_{k}b", storage_type(x.dtype)));
                }
            }
        }
        for i in 0..self.copies {
            params.push(format!("const unsigned char* c{i}s, unsigned char* c{i}d, unsigned long long c{i}n"));
        }
        if self.ticket() {
            params.push("unsigned int* kiln_ticket".into());
        }
        params.extend(nums.params("const "));
        Ok((format!("extern \"C\" __global__ void {}({}) {{\n{body}}}\n", self.name, params.join(", ")), nums))
    }

    /// The statements of the kernel, its numbers collected in `nums`.
    fn body(&self, nums: &mut Numbers) -> Result<String, String> {
        let mut s = "  long long blk = blockIdx.x;\n".to_string();
        let lead = self.groups.first().filter(|_| self.lead);
        if let Some(lead) = lead {
            s += &lead_values(lead, nums)?;
        }
        let mut first = 0usize;
        for (j, gr) in self.groups.iter().enumerate().skip(self.lead as usize) {
            if self.generic && gr.inputs.iter().any(|x| x.fed.is_some()) {
                return Err(format!("{}: a generic kernel cannot feed a product (its contraction unrolls)", self.name));
            }
            let nb = gr.blocks();
            let (from, to) = (nums.int(first, "LL"), nums.int(first + nb, "LL"));
            s += &format!("  if (blk >= {from} && blk < {to}) {{\n");
            let start = format!("(blk - {from}) * {FUSED_BLOCK}LL + threadIdx.x");
            if gr.folds() {
                s += &fold_loop(gr, j, nums)?;
            } else if self.generic {
                // Every width the group can take, the one this size takes passed at launch.
                let width = nums.int(gr.width(), "");
                for w in gr.widths() {
                    s += &format!("  if ({width} == {w}) {{\n{}  }} else\n", vector_loop(gr, j, (&start, nb * FUSED_BLOCK), w, nums)?);
                }
                s += &format!("  {{\n{}  }}\n", scalar_loop(gr, j, (&start, nb * FUSED_BLOCK), nums)?);
            } else if gr.vectorised() {
                s += &vector_loop(gr, j, (&start, nb * FUSED_BLOCK), gr.width(), nums)?;
            } else {
                s += &scalar_loop(gr, j, (&start, nb * FUSED_BLOCK), nums)?;
            }
            s += "  }\n";
            first += nb;
        }
        if self.ticket() {
            s += &last_block(lead, self.copies);
        }
        Ok(s)
    }

    /// Whether the launch counts its finished blocks (`last_block`): it takes a ticket.
    pub fn ticket(&self) -> bool {
        self.lead || self.copies > 0
    }
}

/// A lead group's outputs `L{r}` (stored values, so that readers see what memory would hold),
/// computed by every thread from element 0 of its inputs.
fn lead_values(gr: &FusedGroup, nums: &mut Numbers) -> Result<String, String> {
    if gr.n != 1 || gr.folds() || gr.inputs.iter().any(|x| x.lead.is_some()) {
        return Err(format!("a lead group must be one element without sums or leads of its own (n = {}, sums: {})", gr.n, gr.folds()));
    }
    let mut s = String::new();
    for (r, &m) in gr.outputs.iter().enumerate() {
        let d = gr.members.get(m).ok_or_else(|| format!("lead output {r} names no member"))?.dtype;
        s += &format!("  {} L{r};\n", storage_type(d));
    }
    let loads: Vec<String> = gr.inputs.iter().enumerate().map(|(k, x)| format!("p0_{k}[{}]", nums.int(x.offset, ""))).collect();
    let stores: Vec<String> = (0..gr.outputs.len()).map(|r| format!("L{r}")).collect();
    s += "  {\n";
    s += &group_body(gr, &loads, &stores, nums)?;
    s += "  }\n";
    Ok(s)
}

/// The grid's last block to finish (every other block has read what the lead read, and its
/// writes are visible) stores the lead's outputs, makes the copies, and resets the ticket for
/// the next launch.
fn last_block(lead: Option<&FusedGroup>, copies: usize) -> String {
    let mut s = String::from("  __shared__ bool kiln_last;\n  __syncthreads();\n  if (threadIdx.x == 0) {\n    __threadfence();\n");
    s += "    kiln_last = atomicAdd(kiln_ticket, 1u) == gridDim.x - 1;\n  }\n  __syncthreads();\n  if (kiln_last) {\n";
    s += "    __threadfence();\n    if (threadIdx.x == 0) {\n";
    for r in 0..lead.map_or(0, |gr| gr.outputs.len()) {
        s += &format!("      o0_{r}[0] = L{r};\n");
    }
    s += "      *kiln_ticket = 0u;\n    }\n";
    for i in 0..copies {
        s += &format!("    kiln_copy_out(c{i}s, c{i}d, c{i}n);\n");
    }
    s += "  }\n";
    s
}

/// Group `j`'s loop over `w` elements per thread: vector loads, the members per element,
/// vector stores.
fn vector_loop(gr: &FusedGroup, j: usize, (start, stride): (&str, usize), w: usize, nums: &mut Numbers) -> Result<String, String> {
    let mut s = String::new();
    let vec_type =
        |name: String, d: DType| format!("  struct alignas({}) {name} {{ {} v[{w}]; }};\n", w * d.size_in_bytes(), storage_type(d));
    for (k, x) in gr.inputs.iter().enumerate() {
        s += &vec_type(format!("VI{k}"), x.dtype);
    }
    for (k, &m) in gr.outputs.iter().enumerate() {
        let d = gr.members.get(m).ok_or_else(|| format!("output {k} names no member"))?.dtype;
        s += &vec_type(format!("VO{k}"), d);
    }
    let (items, stride) = (nums.int(gr.n / w, "LL"), nums.int(stride, "LL"));
    s += &format!("  for (long long q = {start}; q < {items}; q += {stride}) {{\n");
    let mut loads: Vec<String> = Vec::new();
    for (k, x) in gr.inputs.iter().enumerate() {
        let at = |(shape, strides): &(Vec<usize>, Vec<usize>), nums: &mut Numbers| {
            strided_index(&format!("q * {w}"), x.offset, shape, strides, gr.narrow(), nums)
        };
        if let Some(r) = x.lead {
            loads.push(format!("L{r}"));
            continue;
        }
        // A generic kernel reads as the layout allows; the launch takes this loop only at a
        // size whose divisibility and alignment allow it too.
        let read = if nums.generic { vec_kind(x) } else { vec_read(x, w) };
        match (read, &x.strided, &x.fed) {
            // (`Fed::value` makes four values: `vec_read` offers a fed input only at width 4.)
            (Some(VecRead::Fed), _, Some(f)) if w == 4 => {
                s += &format!("    const VI{k} a{k} = {};\n", f.value(x, (j, k), "q * 4", gr.narrow(), true));
            }
            (_, _, Some(_)) => return Err(format!("input {k}: a fed product read {w} at a time (it takes four, from aligned rows)")),
            (Some(VecRead::Splat), Some(st), None) => {
                s += &format!("    const auto a{k} = p{j}_{k}[{}];\n", at(st, nums));
                loads.push(format!("a{k}"));
                continue;
            }
            (Some(VecRead::Rows), Some(st), None) => {
                s += &format!("    VI{k} a{k} = *reinterpret_cast<const VI{k}*>(p{j}_{k} + {});\n", at(st, nums))
            }
            _ => s += &format!("    VI{k} a{k} = *reinterpret_cast<const VI{k}*>(p{j}_{k} + {} + q * {w});\n", nums.int(x.offset, "")),
        }
        loads.push(format!("a{k}.v[e]"));
    }
    for k in 0..gr.outputs.len() {
        s += &format!("    VO{k} b{k};\n");
    }
    s += &format!("#pragma unroll\n    for (int e = 0; e < {w}; ++e) {{\n");
    let stores: Vec<String> = (0..gr.outputs.len()).map(|k| format!("b{k}.v[e]")).collect();
    s += &group_body(gr, &loads, &stores, nums)?;
    s += "    }\n";
    for k in 0..gr.outputs.len() {
        s += &format!("    *reinterpret_cast<VO{k}*>(o{j}_{k} + q * {w}) = b{k};\n");
    }
    s += "  }\n";
    Ok(s)
}

/// Group `j`'s loop of one element per thread.
fn scalar_loop(gr: &FusedGroup, j: usize, (start, stride): (&str, usize), nums: &mut Numbers) -> Result<String, String> {
    let (n, stride) = (nums.int(gr.n, "LL"), nums.int(stride, "LL"));
    let mut s = format!("  for (long long i = {start}; i < {n}; i += {stride}) {{\n");
    let stores: Vec<String> = (0..gr.outputs.len()).map(|k| format!("o{j}_{k}[i]")).collect();
    let loads = element_loads(gr, j, nums);
    s += &group_body(gr, &loads, &stores, nums)?;
    Ok(s + "  }\n")
}

/// Element `i` of each input of group `j`.
fn element_loads(gr: &FusedGroup, j: usize, nums: &mut Numbers) -> Vec<String> {
    let at = |(k, x): (usize, &FusedInput)| match (&x.strided, x.lead, &x.fed) {
        (_, Some(r), _) => format!("L{r}"),
        (_, None, Some(f)) => f.value(x, (j, k), "i", gr.narrow(), false),
        (None, None, None) => format!("p{j}_{k}[{} + i]", nums.int(x.offset, "")),
        (Some((shape, strides)), None, None) => format!("p{j}_{k}[{}]", strided_index("i", x.offset, shape, strides, gr.narrow(), nums)),
    };
    gr.inputs.iter().enumerate().map(at).collect()
}

/// One element of a group: `loads[k]` reads input k, the members run in order, output k is
/// stored to `stores[k]`.
fn group_body(gr: &FusedGroup, loads: &[String], stores: &[String], nums: &mut Numbers) -> Result<String, String> {
    let mut s = String::new();
    for (k, load) in loads.iter().enumerate() {
        s += &format!("    auto x{k} = ld({load});\n");
    }
    for q in 0..gr.members.len() {
        s += &member_code(gr, q, nums)?;
    }
    for (store, &m) in stores.iter().zip(&gr.outputs) {
        s += &format!("    st(&{store}, m{m});\n");
    }
    Ok(s)
}

/// Member `q` (elementwise) as `m{q}`, from inputs `x{k}` and earlier members `m{k}`.
fn member_code(gr: &FusedGroup, q: usize, nums: &mut Numbers) -> Result<String, String> {
    let m = &gr.members[q];
    let dtype_of = |src: &FusedSrc| match *src {
        FusedSrc::Input(k) => gr.inputs.get(k).map(|x| x.dtype),
        FusedSrc::Member(m) => gr.members.get(m).map(|x| x.dtype),
    };
    let dtypes: Vec<DType> =
        m.args.iter().map(|a| dtype_of(a).ok_or_else(|| format!("member {q} reads a missing value"))).collect::<Result<_, _>>()?;
    let (_, expr, compute) = elementwise_expr(&m.op, &dtypes).ok_or_else(|| format!("{}: not elementwise", m.op.name()))?;
    let scalar = match &m.op {
        Op::Scalar { value, .. } => nums.float(*value, double_literal),
        _ => double_literal(0.0),
    };
    let mut s = format!("    {} m{q};\n    {{\n      typedef {compute} C;\n", compute_type(m.dtype));
    s += &format!("      struct {{ double s; }} a = {{ {scalar} }}; (void)a;\n");
    for (v, src) in m.args.iter().enumerate() {
        s += &format!("      auto v{v} = {};\n", src_name(*src));
    }
    s += &format!("      m{q} = {expr};\n    }}\n");
    Ok(s)
}

fn src_name(src: FusedSrc) -> String {
    match src {
        FusedSrc::Input(k) => format!("x{k}"),
        FusedSrc::Member(k) => format!("m{k}"),
    }
}

/// A group ending in sums (`FusedGroup::folds`), run by one block: the threads stride over
/// the elements (members before the fold, sums accumulated in registers), `kiln_block_sum`
/// folds each sum, and thread 0 runs the members after the fold and stores their values.
fn fold_loop(gr: &FusedGroup, j: usize, nums: &mut Numbers) -> Result<String, String> {
    let after = gr.after_fold();
    check_fold(gr, &after)?;
    let sums: Vec<usize> = (0..gr.members.len()).filter(|&q| gr.members[q].is_sum()).collect();
    // The inputs read inside the loop (`in_loop`) or after the fold.
    let reads = |in_loop: bool| {
        let mut used = vec![false; gr.inputs.len()];
        for (q, m) in gr.members.iter().enumerate() {
            // A sum reads its argument inside the loop.
            let inside = !after[q] || m.is_sum();
            for a in &m.args {
                if let FusedSrc::Input(k) = *a {
                    used[k] |= inside == in_loop;
                }
            }
        }
        used
    };
    let mut s = String::new();
    for &q in &sums {
        s += &format!("  {} r{q} = 0;\n", compute_type(gr.members[q].dtype));
    }
    s += &format!("  for (long long i = threadIdx.x; i < {}; i += {FUSED_BLOCK}LL) {{\n", nums.int(gr.n, "LL"));
    let loads = element_loads(gr, j, nums);
    for (k, used) in reads(true).into_iter().enumerate() {
        if used {
            s += &format!("    auto x{k} = ld({});\n", loads[k]);
        }
    }
    for q in (0..gr.members.len()).filter(|&q| !after[q]) {
        s += &member_code(gr, q, nums)?;
    }
    for &q in &sums {
        let arg = gr.members[q].args.first().ok_or_else(|| format!("sum member {q} has no argument"))?;
        s += &format!("    r{q} += {};\n", src_name(*arg));
    }
    for (k, &m) in gr.outputs.iter().enumerate() {
        if !after[m] {
            s += &format!("    st(&o{j}_{k}[i], m{m});\n");
        }
    }
    s += "  }\n";
    for &q in &sums {
        s += &format!("  r{q} = kiln_block_sum(r{q});\n");
    }
    s += "  if (threadIdx.x == 0) {\n";
    // Inputs read after the fold are single values broadcast over the group: element 0.
    for (k, used) in reads(false).into_iter().enumerate() {
        if used {
            let x = &gr.inputs[k];
            if x.fed.is_some() {
                return Err(format!("input {k}: a fed product read after the fold"));
            }
            let value = match x.lead {
                Some(r) => format!("L{r}"),
                None => format!("p{j}_{k}[{}]", nums.int(x.offset, "")),
            };
            s += &format!("    auto x{k} = ld({value});\n");
        }
    }
    for q in (0..gr.members.len()).filter(|&q| after[q]) {
        s += &match gr.members[q].is_sum() {
            true => format!("    {} m{q} = r{q};\n", compute_type(gr.members[q].dtype)),
            false => member_code(gr, q, nums)?,
        };
    }
    for (k, &m) in gr.outputs.iter().enumerate() {
        if after[m] {
            s += &format!("    st(&o{j}_{k}[0], m{m});\n");
        }
    }
    s += "  }\n";
    Ok(s)
}

/// What `fold_loop` can generate: sums (of inputs or loop values) and, after them, members
/// reading only sums, later scalars and inputs.
fn check_fold(gr: &FusedGroup, after: &[bool]) -> Result<(), String> {
    let reads_loop = |a: &FusedSrc| matches!(*a, FusedSrc::Member(j) if !after[j]);
    let reads_loop_or_input = |a: &FusedSrc| matches!(*a, FusedSrc::Input(_)) || reads_loop(a);
    for (q, m) in gr.members.iter().enumerate().filter(|&(q, _)| after[q]) {
        match &m.op {
            Op::Reduce { op: ReduceOp::Sum, .. } if !m.args.iter().all(reads_loop_or_input) => {
                return Err(format!("member {q} sums a value computed after the fold"))
            }
            Op::Reduce { op: ReduceOp::Sum, .. } => {}
            Op::Reduce { op, .. } => return Err(format!("member {q}: a fused group folds sums only, not {}", op.name())),
            _ if m.args.iter().any(reads_loop) => return Err(format!("member {q} runs after the fold but reads a per-element value")),
            _ => {}
        }
    }
    Ok(())
}

/// A block's sum of one value per thread (the whole block calls it; the result is thread 0's).
/// Fixed order, so a step gives the same bits every time.
const BLOCK_SUM: &str = r#"
template <typename T> __device__ __forceinline__ T kiln_block_sum(T v) {
  __shared__ T part[32];
  for (int w = 16; w > 0; w /= 2) v += __shfl_down_sync(0xffffffffu, v, w);
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : (T)0;
  if (threadIdx.x < 32)
    for (int w = 16; w > 0; w /= 2) v += __shfl_down_sync(0xffffffffu, v, w);
  return v;
}
"#;

/// A fed product's `W` neighbouring values (`Fed::value`): `kiln_fed_dot`, columns of one
/// row (b's rows read as vectors of `V`), and `kiln_fed_sum`, the sums of neighbouring rows
/// (a's columns read as vectors). Each term is added in order, as the thin-product kernel does.
const FED: &str = r#"
template <class T> struct kiln_v1 { T v[1]; };
template <int K, int W, class V, class T>
__device__ __forceinline__ V kiln_fed_dot(const T* __restrict__ a, long long sa, const T* __restrict__ b, long long sb) {
  V acc;
#pragma unroll
  for (int e = 0; e < W; ++e) acc.v[e] = (T)0;
#pragma unroll
  for (int t = 0; t < K; ++t) {
    const T u = a[t * sa];
    const V w = *reinterpret_cast<const V*>(b + t * sb);
#pragma unroll
    for (int e = 0; e < W; ++e) acc.v[e] += u * w.v[e];
  }
  return acc;
}
template <int K, int W, class V, class T>
__device__ __forceinline__ V kiln_fed_sum(const T* __restrict__ a, long long sa) {
  V acc;
#pragma unroll
  for (int e = 0; e < W; ++e) acc.v[e] = (T)0;
#pragma unroll
  for (int t = 0; t < K; ++t) {
    const V w = *reinterpret_cast<const V*>(a + t * sa);
#pragma unroll
    for (int e = 0; e < W; ++e) acc.v[e] += w.v[e];
  }
  return acc;
}
"#;

/// A copy of `n` bytes from `s` to `d`, this thread taking pieces `i`, `i + step`, ...: 16
/// bytes a piece where both ends are 16-byte aligned, else one. Loads bypass L1, since other
/// blocks of the launch may have written `s`. (Output copies: a graph node's whole grid,
/// `copy_out_source`, or a fused kernel's last block, `COPY_OUT`.)
const COPY_BYTES: &str = r#"
__device__ __forceinline__ void kiln_copy_bytes(const unsigned char* s, unsigned char* d, unsigned long long n,
                                                unsigned long long i, unsigned long long step) {
  const unsigned long long words = (((unsigned long long)s | (unsigned long long)d) % 16 == 0) ? n / 16 : 0;
  for (unsigned long long w = i; w < words; w += step) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(s + 16 * w));
    reinterpret_cast<uint4*>(d)[w] = v;
  }
  for (unsigned long long b = words * 16 + i; b < n; b += step) d[b] = ((const volatile unsigned char*)s)[b];
}
"#;

/// The output-copy node's kernel (`compiled::capture_output_copy`): `bytes` bytes from `src`
/// to `dst` over the whole grid.
pub fn copy_out_source() -> (String, String) {
    let s = format!(
        "{COPY_BYTES}extern \"C\" __global__ void kiln_copy_out(const unsigned char* src, unsigned char* dst, unsigned long long bytes) {{\n  \
         kiln_copy_bytes(src, dst, bytes, blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x, gridDim.x * (unsigned long long)blockDim.x);\n}}\n"
    );
    (s, "kiln_copy_out".to_string())
}

/// A block's copy of `n` bytes (`kiln_copy_bytes`), none where `d` is null.
const COPY_OUT: &str = r#"
__device__ __forceinline__ void kiln_copy_out(const unsigned char* s, unsigned char* d, unsigned long long n) {
  if (d != 0) kiln_copy_bytes(s, d, n, threadIdx.x, blockDim.x);
}
"#;

/// One CUDA module holding every fused kernel of a compiled graph (one NVRTC call).
pub fn fused_module(kernels: &[FusedKernel]) -> Result<String, String> {
    let mut s = module_prelude(kernels);
    for k in kernels {
        s += &k.source()?;
    }
    Ok(s)
}

/// What a module of `kernels` declares before them: the prelude and the helpers they call.
pub fn module_prelude(kernels: &[FusedKernel]) -> String {
    let mut s = format!("{PRELUDE}\n#define K(v) ((C)(v))\n");
    if kernels.iter().any(|k| k.groups.iter().any(FusedGroup::folds)) {
        s += BLOCK_SUM;
    }
    if kernels.iter().any(|k| k.groups.iter().any(|g| g.inputs.iter().any(|x| x.fed.is_some()))) {
        s += FED;
    }
    if kernels.iter().any(|k| k.copies > 0) {
        s += COPY_BYTES;
        s += COPY_OUT;
    }
    s
}
