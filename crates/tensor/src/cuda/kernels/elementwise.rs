//! Elementwise kernels: one template for unary, binary, scalar, where, cast and copy ops over
//! any strided layout (the expression from the op table), the Philox draws, and their launches.

use crate::codegen::fnv1a;
use crate::cuda::kernels::prelude::{storage_type, PRELUDE};
use crate::DType;

/// One elementwise kernel: `out[i] = expr(v0, v1, v2)` over the output's elements, where `vk`
/// is input k loaded in its natural compute type (see `compute_type`); `K(v)` constants are
/// in `compute`. The expression may also use `i` (the linear index) and `a` (the `Args`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Elementwise {
    /// A C++ expression of `v0..v2`, `i` (the element's linear index), `a` (the `Args`).
    pub expr: String,
    pub compute: &'static str,
    pub inputs: Vec<DType>,
    pub out: DType,
    /// Per input: reads `p[off + i]` instead of walking strides.
    pub contiguous: Vec<bool>,
    /// The output walks strides too (in-place updates of a strided destination); the output
    /// is then also input 0's storage (`v0` is read from it).
    pub inplace: bool,
    /// Four elements per thread with aligned vector loads (every operand contiguous, offsets
    /// multiples of four).
    pub vec4: bool,
    /// Four elements per thread over strided operands whose innermost dim is contiguous (or
    /// broadcast) and a multiple of four long: permuted copies, `cat`, slices. Per input, whether
    /// its innermost dim is broadcast (one scalar load for the four). The launcher passes the
    /// innermost dim divided by four and its strides times four.
    pub strided4: Option<Vec<bool>>,
    /// Fewer than 2^32 elements: strided coordinates use 32-bit division (64-bit division
    /// costs several times more, and it is the price of every strided element).
    pub narrow: bool,
}

impl Elementwise {
    /// The kernel's name: readable prefix plus a hash of the whole spec.
    pub fn name(&self, prefix: &str) -> String {
        format!("k_{prefix}_{:012x}", fnv1a(format!("{self:?}").as_bytes()) & 0xffff_ffff_ffff)
    }

    /// The full source (prelude included) and the kernel's name.
    pub fn source(&self, prefix: &str) -> (String, String) {
        let name = self.name(prefix);
        let ot = storage_type(self.out);
        let mut params = vec![format!("{ot}* __restrict__ o")];
        for (k, d) in self.inputs.iter().enumerate() {
            if self.inplace && k == 0 {
                continue; // v0 is read from `o`
            }
            params.push(format!("const {}* __restrict__ p{k}", storage_type(*d)));
        }
        params.push("Args a".into());
        let mut s = format!("{PRELUDE}{PHILOX}\ntypedef {} C;\n#define K(v) ((C)(v))\n", self.compute);
        s += &format!("extern \"C\" __global__ void {name}({}) {{\n", params.join(", "));
        s += "  long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n";
        s += "  long long step = (long long)gridDim.x * blockDim.x;\n";
        if self.vec4 {
            s += &self.vec4_body(ot);
        } else if let Some(bcast) = &self.strided4 {
            s += &self.strided4_body(ot, bcast);
        } else {
            s += &self.scalar_body(ot);
        }
        s += "}\n";
        (s, name)
    }

    fn pointer(&self, k: usize) -> String {
        if self.inplace && k == 0 {
            "o".into()
        } else {
            format!("p{k}")
        }
    }

    /// The element offsets `q{k}` of the strided operands at linear position `var`: one
    /// decomposition over `a.shape` shared by all of them.
    fn strided_offsets(&self, var: &str) -> String {
        let slots: Vec<usize> = (0..self.inputs.len()).filter(|&k| !self.contiguous[k]).collect();
        if slots.is_empty() {
            return String::new();
        }
        let mut b = String::new();
        for &k in &slots {
            b += &format!("    long long q{k} = a.off[{k}];\n");
        }
        if self.narrow {
            b += &format!("    unsigned r = (unsigned){var};\n    for (int d = a.rank - 1; d >= 0; --d) {{\n");
            b += "      unsigned sd = (unsigned)a.shape[d], c = r % sd; r /= sd;\n";
        } else {
            b += &format!("    long long r = {var};\n    for (int d = a.rank - 1; d >= 0; --d) {{\n");
            b += "      long long c = r % a.shape[d]; r /= a.shape[d];\n";
        }
        for &k in &slots {
            b += &format!("      q{k} += (long long)c * a.st[{k}][d];\n");
        }
        b + "    }\n"
    }

    /// Grid-stride loop; strided operands share one decomposition of `i` per element.
    fn scalar_body(&self, ot: &str) -> String {
        let mut b = "  for (long long i = tid; i < a.n; i += step) {\n".to_string();
        b += &self.strided_offsets("i");
        for k in 0..self.inputs.len() {
            let idx = if self.contiguous[k] { format!("a.off[{k}] + i") } else { format!("q{k}") };
            b += &format!("    auto v{k} = ld({}[{idx}]);\n", self.pointer(k));
        }
        let oi = if self.inplace {
            if self.contiguous[0] {
                "a.off[0] + i".to_string()
            } else {
                "q0".into()
            }
        } else {
            "i".into()
        };
        b += &format!("    st(({ot}*)&o[{oi}], {});\n  }}\n", self.expr);
        b
    }

    /// The aligned four-element vector type of each input (`V{k}`) and of the output (`VO`).
    fn vector_types(&self, ot: &str) -> String {
        let mut b = String::new();
        for (k, d) in self.inputs.iter().enumerate() {
            let t = storage_type(*d);
            b += &format!("  struct alignas({}) V{k} {{ {t} v[4]; }};\n", 4 * d.size_in_bytes());
        }
        b + &format!("  struct alignas({}) VO {{ {ot} v[4]; }};\n", 4 * self.out.size_in_bytes())
    }

    /// Four consecutive elements of the innermost dim per step: the strided operands' offsets
    /// are decomposed once per four (`a.shape`'s innermost dim is a quarter of the tensor's).
    fn strided4_body(&self, ot: &str, bcast: &[bool]) -> String {
        let mut b = self.vector_types(ot);
        b += "  long long nv = a.n / 4;\n  for (long long q = tid; q < nv; q += step) {\n";
        b += &self.strided_offsets("q");
        for (k, &bc) in bcast.iter().enumerate() {
            let p = self.pointer(k);
            b += &match (self.contiguous[k], bc) {
                (true, _) => format!("    V{k} x{k} = *reinterpret_cast<const V{k}*>({p} + a.off[{k}] + q * 4);\n"),
                (false, false) => format!("    V{k} x{k} = *reinterpret_cast<const V{k}*>({p} + q{k});\n"),
                (false, true) => format!("    auto s{k} = {p}[q{k}];\n"),
            };
        }
        b += "    VO y;\n#pragma unroll\n    for (int j = 0; j < 4; ++j) {\n      long long i = q * 4 + j;\n";
        for (k, &bc) in bcast.iter().enumerate() {
            let v = if !self.contiguous[k] && bc { format!("s{k}") } else { format!("x{k}.v[j]") };
            b += &format!("      auto v{k} = ld({v});\n");
        }
        b += &format!("      st(&y.v[j], {});\n    }}\n", self.expr);
        let dst = match (self.inplace, self.contiguous[0]) {
            (true, false) => "o + q0",
            (true, true) => "o + a.off[0] + q * 4",
            _ => "o + q * 4",
        };
        b += &format!("    *reinterpret_cast<VO*>({dst}) = y;\n  }}\n");
        b
    }

    /// Four elements per thread through aligned vector types, then a scalar tail.
    fn vec4_body(&self, ot: &str) -> String {
        let mut b = self.vector_types(ot);
        b += "  long long nv = a.n / 4;\n  for (long long q = tid; q < nv; q += step) {\n";
        for k in 0..self.inputs.len() {
            b += &format!("    V{k} x{k} = *reinterpret_cast<const V{k}*>({} + a.off[{k}] + q * 4);\n", self.pointer(k));
        }
        b += "    VO y;\n#pragma unroll\n    for (int j = 0; j < 4; ++j) {\n      long long i = q * 4 + j;\n";
        for k in 0..self.inputs.len() {
            b += &format!("      auto v{k} = ld(x{k}.v[j]);\n");
        }
        b += &format!("      st(&y.v[j], {});\n    }}\n", self.expr);
        let oo = if self.inplace { "a.off[0] + " } else { "" };
        b += &format!("    *reinterpret_cast<VO*>(o + {oo}q * 4) = y;\n  }}\n");
        b += "  for (long long i = nv * 4 + tid; i < a.n; i += step) {\n";
        for k in 0..self.inputs.len() {
            b += &format!("    auto v{k} = ld({}[a.off[{k}] + i]);\n", self.pointer(k));
        }
        b += &format!("    st(&o[{oo}i], {});\n  }}\n", self.expr);
        b
    }
}

/// Philox 4x32-10 and the uniform/normal draws of `rng.rs`, bit for bit.
pub const PHILOX: &str = r#"
__device__ __forceinline__ unsigned int philox_word(unsigned long long seed, unsigned long long n) {
  unsigned long long blk = n / 4;
  unsigned int c0 = (unsigned int)blk, c1 = (unsigned int)(blk >> 32), c2 = 0, c3 = 0;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
    unsigned int n0 = ((unsigned int)(p1 >> 32)) ^ c1 ^ k0, n1 = (unsigned int)p1;
    unsigned int n2 = ((unsigned int)(p0 >> 32)) ^ c3 ^ k1, n3 = (unsigned int)p0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  unsigned int w = n % 4;
  return w == 0 ? c0 : w == 1 ? c1 : w == 2 ? c2 : c3;
}
__device__ __forceinline__ float k_uniform(unsigned long long seed, unsigned long long off, long long i) {
  return (float)(philox_word(seed, off + i) >> 8) * (1.0f / 16777216.0f);
}
__device__ __forceinline__ float k_normal(unsigned long long seed, unsigned long long off, long long i) {
  long long j = i & ~1LL;
  float u1 = 1.0f - k_uniform(seed, off, j), u2 = k_uniform(seed, off, j + 1);
  double r = sqrt(-2.0 * log((double)u1)), th = 6.283185307179586 * (double)u2;
  return (float)((i & 1) == 0 ? r * cos(th) : r * sin(th));
}
"#;

#[cfg(feature = "cuda")]
pub(crate) use launch::*;

/// The launches (feature `cuda`).
#[cfg(feature = "cuda")]
mod launch {
    use super::Elementwise;
    use crate::codegen::{compute_type, elementwise_expr};
    use crate::cuda::gpu::Gpu;
    use crate::cuda::kernels::prelude::{coalesce, too_many_dims, CudaStorage, MAX_RANK, SLOTS};
    use crate::op::{Op, OutMeta};
    use crate::shape::Layout;
    use crate::{DType, Error, Result};
    use std::ffi::c_void;
    use std::sync::Arc;

    /// Mirrors `struct Args` in the kernel prelude.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Args {
        n: i64,
        off: [i64; SLOTS],
        shape: [i64; MAX_RANK],
        st: [[i64; MAX_RANK]; SLOTS],
        s: f64,
        seed: u64,
        roff: u64,
        rank: i32,
        pad: i32,
    }

    /// Launches one elementwise kernel. `ins` are read through their layouts (broadcast to
    /// `shape`); the output is a fresh contiguous buffer, or with `inplace` the first input.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_ew(
        g: &Arc<Gpu>,
        prefix: &str,
        expr: String,
        compute: &'static str,
        ins: &[(&CudaStorage, &Layout)],
        shape: &[usize],
        out: &CudaStorage,
        inplace: bool,
        extra: (f64, u64, u64),
    ) -> Result<()> {
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let strides: Vec<Vec<usize>> = ins.iter().map(|(_, l)| l.broadcast_strides(shape)).collect();
        let contiguous: Vec<bool> =
            strides.iter().map(|st| Layout { shape: shape.to_vec(), strides: st.clone(), offset: 0 }.is_contiguous()).collect();
        let (cs, cst) = coalesce(shape, &strides);
        if cs.len() > MAX_RANK {
            return Err(too_many_dims(shape));
        }
        let offsets: Vec<usize> = ins.iter().map(|(_, l)| l.offset).collect();
        let vec4 = contiguous.iter().all(|&c| c) && offsets.iter().all(|o| o % 4 == 0) && n >= 4;
        let strided4 = if vec4 { None } else { strided4(&cs, &cst, &contiguous, &offsets) };
        let four_strided = strided4.is_some();
        let narrow = n <= u32::MAX as usize;
        let spec = Elementwise {
            expr,
            compute,
            inputs: ins.iter().map(|(s, _)| s.dtype).collect(),
            out: out.dtype,
            contiguous,
            inplace,
            vec4,
            strided4,
            narrow,
        };
        let k = g.kernel(crate::cuda::gpu::spec_key(prefix, &spec), || spec.source(prefix))?;
        let mut a = Args { n: n as i64, rank: cs.len() as i32, s: extra.0, seed: extra.1, roff: extra.2, ..Args::default() };
        for (d, &x) in cs.iter().enumerate() {
            a.shape[d] = x as i64;
        }
        for (slot, st) in cst.iter().enumerate() {
            a.off[slot] = offsets[slot] as i64;
            for (d, &x) in st.iter().enumerate() {
                a.st[slot][d] = x as i64;
            }
        }
        if four_strided {
            // Positions count groups of four along the innermost dim.
            let last = cs.len() - 1;
            a.shape[last] /= 4;
            for st in a.st.iter_mut().take(cst.len()) {
                st[last] *= 4;
            }
        }
        let mut ptrs: Vec<u64> = vec![out.buf.ptr];
        ptrs.extend(ins.iter().enumerate().filter(|(i, _)| !(inplace && *i == 0)).map(|(_, (s, _))| s.buf.ptr));
        let mut params: Vec<*mut c_void> = ptrs.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
        params.push(&mut a as *mut Args as *mut c_void);
        let work = if vec4 || four_strided { n / 4 } else { n };
        // SAFETY: the parameters match the generated signature (output, inputs, Args); every
        // buffer is alive for the call and sized by the shape rule; the stream orders later use.
        unsafe { g.launch(k, (g.grid_for(work), 1), 256, 0, &mut params) }
    }

    /// Whether an elementwise kernel over the coalesced `shape` can move four elements at a time
    /// through strided operands: the innermost dim is a multiple of four long, and every operand
    /// either is contiguous, or reads it with stride 1 (then its other strides and its offset are
    /// multiples of four, so the vectors are aligned), or broadcasts it (stride 0). Gives, per
    /// operand, whether it broadcasts the innermost dim.
    fn strided4(shape: &[usize], strides: &[Vec<usize>], contiguous: &[bool], offsets: &[usize]) -> Option<Vec<bool>> {
        let last = shape.len().checked_sub(1)?;
        if !shape[last].is_multiple_of(4) {
            return None;
        }
        let mut bcast = Vec::with_capacity(strides.len());
        for ((st, &c), &off) in strides.iter().zip(contiguous).zip(offsets) {
            let aligned = off % 4 == 0 && st[..last].iter().all(|s| s % 4 == 0);
            match (c, st[last]) {
                (true, _) if off % 4 == 0 => bcast.push(false),
                (false, 1) if aligned => bcast.push(false),
                (false, 0) => bcast.push(true),
                _ => return None,
            }
        }
        Some(bcast)
    }

    /// Kernel arguments beyond the inputs: the scalar, and a draw's seed and offset.
    pub(crate) const NO_EXTRA: (f64, u64, u64) = (0.0, 0, 0);

    /// Makes a fresh buffer and fills it with `expr` over `ins`.
    pub(crate) fn ew_with(
        g: &Arc<Gpu>,
        prefix: &str,
        expr: String,
        compute: &'static str,
        ins: &[(&CudaStorage, &Layout)],
        meta: &OutMeta,
        extra: (f64, u64, u64),
    ) -> Result<CudaStorage> {
        let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
        launch_ew(g, prefix, expr, compute, ins, &meta.shape, &out, false, extra)?;
        Ok(out)
    }

    /// `out += x` over a dense `out` of `shape`, `x` broadcast to it: a matmul's bias (`[n]`) or
    /// residual where no epilogue added it.
    pub(crate) fn add_into(g: &Arc<Gpu>, out: &CudaStorage, shape: &[usize], bias: (&CudaStorage, &Layout)) -> Result<()> {
        let op = Op::UpdateBinary(crate::BinaryOp::Add);
        let (prefix, expr, c) = elementwise_expr(&op, &[out.dtype]).ok_or_else(|| Error::Msg("matmul bias: no kernel".into()))?;
        let lo = Layout::contiguous(shape);
        launch_ew(g, prefix, expr, c, &[(out, &lo), bias], shape, out, true, NO_EXTRA)
    }

    /// `out = u(out)` over a dense `out` of `shape`: a fused matmul's activation where no
    /// epilogue applied it.
    pub(crate) fn unary_in_place(g: &Arc<Gpu>, out: &CudaStorage, shape: &[usize], u: crate::UnaryOp) -> Result<()> {
        let (prefix, expr, c) =
            elementwise_expr(&Op::Unary(u), &[out.dtype]).ok_or_else(|| Error::Msg(format!("matmul {}: no kernel", u.name())))?;
        let lo = Layout::contiguous(shape);
        launch_ew(g, prefix, expr, c, &[(out, &lo)], shape, out, true, NO_EXTRA)
    }

    /// `out *= u(x)` over a dense `out` of `shape` (the product of a fused matmul by an
    /// activation's gradient), as the unfused `mul` computes it.
    pub(crate) fn mul_by_unary(
        g: &Arc<Gpu>,
        out: &CudaStorage,
        shape: &[usize],
        u: crate::UnaryOp,
        x: (&CudaStorage, &Layout),
    ) -> Result<()> {
        let (prefix, expr, c) =
            elementwise_expr(&Op::Unary(u), &[x.0.dtype]).ok_or_else(|| Error::Msg(format!("matmul {}: no kernel", u.name())))?;
        let grad = ew_with(g, prefix, expr, c, &[x], &OutMeta { shape: shape.to_vec(), dtype: out.dtype }, NO_EXTRA)?;
        let op = Op::UpdateBinary(crate::BinaryOp::Mul);
        let (prefix, expr, c) = elementwise_expr(&op, &[out.dtype]).ok_or_else(|| Error::Msg("matmul: no mul kernel".into()))?;
        let lo = Layout::contiguous(shape);
        launch_ew(g, prefix, expr, c, &[(out, &lo), (&grad, &lo)], shape, out, true, NO_EXTRA)
    }

    pub(crate) fn cast(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout, to: DType) -> Result<CudaStorage> {
        let meta = OutMeta { shape: l.shape.clone(), dtype: to };
        ew_with(g, "cast", "v0".into(), compute_type(s.dtype), &[(s, l)], &meta, NO_EXTRA)
    }

    /// A dense row-major copy of `s` read through `l`.
    pub fn dense_copy(g: &Arc<Gpu>, s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
        let meta = OutMeta { shape: l.shape.clone(), dtype: s.dtype };
        ew_with(g, "copy", "v0".into(), compute_type(s.dtype), &[(s, l)], &meta, NO_EXTRA)
    }

    /// `s` through `l` as a dense buffer: the same memory where the view is dense and starts on
    /// 16 bytes (a part of a flat output, such as layer norm's dx, is read where it lies), else a
    /// dense copy.
    pub(crate) enum Dense<'a> {
        /// The first element's address in memory the caller's storage keeps.
        Borrowed(u64, std::marker::PhantomData<&'a CudaStorage>),
        Owned(CudaStorage),
    }

    impl Dense<'_> {
        /// The address of the first element.
        pub(crate) fn ptr(&self) -> u64 {
            match self {
                Dense::Borrowed(p, _) => *p,
                Dense::Owned(s) => s.buf.ptr,
            }
        }
    }

    pub(crate) fn dense<'a>(g: &Arc<Gpu>, s: &'a CudaStorage, l: &Layout) -> Result<Dense<'a>> {
        let p = s.ptr_at(l.offset);
        if l.is_contiguous() && p.is_multiple_of(16) {
            Ok(Dense::Borrowed(p, std::marker::PhantomData))
        } else {
            Ok(Dense::Owned(dense_copy(g, s, l)?))
        }
    }

    /// `Args` against its C twin (`kernels::argument_layouts`).
    pub(crate) fn layout_checks() -> Vec<crate::cuda::kernels::prelude::ArgLayout> {
        use crate::cuda::kernels::prelude::{layout_check, PRELUDE};
        vec![layout_check!(PRELUDE, "Args", Args, {
            n => n, off => off, shape => shape, st => st, s => s, seed => seed, roff => roff, rank => rank, pad => pad
        })]
    }
}
