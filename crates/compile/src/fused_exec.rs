//! Runs one fusion group on the CPU: chunk by chunk, loading each external input once,
//! evaluating every member over the chunk in scratch buffers, storing what leaves the group.

use crate::cpu_codegen::NativeGroup;
use crate::fusion::{rounds_to_f32, Group};
use crate::graph::{Graph, Kind, NodeId};
use kiln_tensor::cpu::elementwise::{binary_into, load_into, scalar_into, unary_into, where_into, Convert};
use kiln_tensor::cpu::matmul::TileFn;
use kiln_tensor::op::Float;
use kiln_tensor::storage::{CpuStorage, StorageCell};
use kiln_tensor::{with_cpu, Element, Error, Layout, Op, Result};
use rayon::prelude::*;
use std::sync::Arc;

/// Elements per chunk: the scratch of a group stays in L2.
const CHUNK: usize = 2048;

/// Where a member's argument comes from.
#[derive(Clone, Copy)]
enum Src {
    Member(usize),
    Ext(usize),
}

/// An external input: a buffer read through a layout, or the chunk's own slice of an output
/// that the group overwrites in place (read before it is written).
enum Ext<'a> {
    Shared(&'a CpuStorage, &'a Layout),
    Own(usize),
    /// The product that `Feed` computes tile by tile (native functions only).
    Fed,
}

/// A 2-D product the group reads whole, made tile by tile alongside it: `run(after)` computes
/// the product and calls `after(element_0, start, end)` as each tile is ready, for the group
/// to consume while it is in cache (`kiln_tensor::cpu::matmul_by_tiles`).
pub struct Feed<'a> {
    pub node: NodeId,
    pub run: &'a mut dyn FnMut(&TileFn) -> Result<()>,
}

enum Out<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    U8(&'a mut [u8]),
}

fn out_slices(s: &mut CpuStorage) -> Result<Vec<Out<'_>>> {
    Ok(match s {
        CpuStorage::F32(v) => v.chunks_mut(CHUNK).map(Out::F32).collect(),
        CpuStorage::F64(v) => v.chunks_mut(CHUNK).map(Out::F64).collect(),
        CpuStorage::U8(v) => v.chunks_mut(CHUNK).map(Out::U8).collect(),
        other => return Err(Error::Msg(format!("fused group: cannot store {:?}", other.dtype()))),
    })
}

fn store<F: Element>(vals: &[F], out: &mut Out) {
    match out {
        Out::F32(o) => o.iter_mut().zip(vals).for_each(|(d, &v)| *d = v.convert()),
        Out::F64(o) => o.iter_mut().zip(vals).for_each(|(d, &v)| *d = v.convert()),
        Out::U8(o) => o.iter_mut().zip(vals).for_each(|(d, &v)| *d = (v.to_f64() != 0.0) as u8),
    }
}

fn load_own<F: Element>(out: &Out, vals: &mut [F]) {
    match out {
        Out::F32(o) => vals.iter_mut().zip(o.iter()).for_each(|(d, &v)| *d = v.convert()),
        Out::F64(o) => vals.iter_mut().zip(o.iter()).for_each(|(d, &v)| *d = v.convert()),
        Out::U8(o) => vals.iter_mut().zip(o.iter()).for_each(|(d, &v)| *d = v.convert()),
    }
}

/// Runs `gr`, through its native function when it has one (`cpu_codegen`); `cell_of(node)`
/// gives the cell of an external value. Returns the cells of the materialised members (state
/// buffers for in-place ones).
/// With `feed`, its product is made alongside (the native function must apply).
pub fn run_group(
    g: &Graph,
    gr: &Group,
    cells: &[Arc<StorageCell>],
    cell_of: &dyn Fn(NodeId) -> Result<Arc<StorageCell>>,
    native: Option<&NativeGroup>,
    mut feed: Option<Feed>,
) -> Result<Vec<(NodeId, Arc<StorageCell>)>> {
    let fed = |n: NodeId| feed.as_ref().is_some_and(|f| f.node == n);
    let numel: usize = gr.shape.iter().product();
    let outs: Vec<(NodeId, Arc<StorageCell>)> = gr
        .materialize
        .iter()
        .map(|&m| match gr.inplace.iter().find(|x| x.0 == m) {
            Some(&(_, slot)) => (m, cells[slot].clone()),
            None => (m, Arc::new(StorageCell::new(kiln_tensor::storage::Storage::Cpu(CpuStorage::uninit(g.nodes[m].dtype, numel))))),
        })
        .collect();
    let ext_cells: Vec<Option<Arc<StorageCell>>> =
        gr.externals.iter().map(|a| if fed(a.node) { Ok(None) } else { cell_of(a.node).map(Some) }).collect::<Result<_>>()?;
    // Write locks on outputs; read locks on the other distinct external cells.
    let mut out_guards: Vec<_> = outs.iter().map(|(_, c)| c.write()).collect();
    let mut read_cells: Vec<&Arc<StorageCell>> = Vec::new();
    for c in ext_cells.iter().flatten() {
        if !outs.iter().any(|(_, o)| Arc::ptr_eq(o, c)) && !read_cells.iter().any(|r| Arc::ptr_eq(r, c)) {
            read_cells.push(c);
        }
    }
    let read_guards: Vec<_> = read_cells.iter().map(|c| c.read()).collect();
    let mut exts: Vec<Ext> = Vec::with_capacity(ext_cells.len());
    for (c, a) in ext_cells.iter().zip(&gr.externals) {
        let Some(c) = c else {
            exts.push(Ext::Fed);
            continue;
        };
        match outs.iter().position(|(_, o)| Arc::ptr_eq(o, c)) {
            Some(k) => exts.push(Ext::Own(k)),
            None => {
                let r = read_cells.iter().position(|r| Arc::ptr_eq(r, c)).unwrap_or(0);
                exts.push(Ext::Shared(read_guards[r].as_cpu()?, &a.layout));
            }
        }
    }
    if let Some(nat) = native {
        // The function was generated for these in-place reads; any other aliasing interprets.
        let same = |e: &Ext, o: &Option<usize>| match e {
            Ext::Own(k) => *o == Some(*k),
            Ext::Shared(..) | Ext::Fed => o.is_none(),
        };
        if exts.len() == nat.own.len() && exts.iter().zip(&nat.own).all(|(e, o)| same(e, o)) {
            run_native(g, gr, nat, &exts, &mut out_guards, numel, feed.as_mut())?;
            drop(out_guards);
            return Ok(outs);
        }
    }
    if feed.is_some() {
        return Err(Error::Msg("fused group: a product fed tile by tile needs the group's native function".into()));
    }
    // Per chunk, one slice of every output.
    let mut per_output: Vec<Vec<Out>> = Vec::with_capacity(outs.len());
    for gd in out_guards.iter_mut() {
        per_output.push(out_slices(gd.as_cpu_mut()?)?);
    }
    let n_chunks = numel.div_ceil(CHUNK);
    let mut chunks: Vec<Vec<Out>> = (0..n_chunks).map(|_| Vec::with_capacity(outs.len())).collect();
    for slices in per_output {
        for (c, s) in slices.into_iter().enumerate() {
            chunks[c].push(s);
        }
    }
    let srcs: Vec<Vec<Src>> = gr
        .members
        .iter()
        .map(|&m| match &g.nodes[m].kind {
            Kind::Op(_, args) => args
                .iter()
                .map(|a| match gr.members.iter().position(|&x| x == a.node) {
                    Some(j) => Src::Member(j),
                    None => Src::Ext(gr.externals.iter().position(|e| e == a).unwrap_or(0)),
                })
                .collect(),
            _ => vec![],
        })
        .collect();
    let stores: Vec<usize> = gr.materialize.iter().map(|m| gr.members.iter().position(|x| x == m).unwrap_or(0)).collect();
    let ctx = Ctx { g, gr, exts: &exts, srcs: &srcs, stores: &stores };
    if gr.f64 {
        ctx.run::<f64>(chunks, numel)
    } else {
        ctx.run::<f32>(chunks, numel)
    }
    drop(out_guards);
    Ok(outs)
}

/// Calls the group's native function over its elements (split across rayon workers when
/// large), after checking every buffer's dtype and that every read and write is in bounds.
fn run_native(
    g: &Graph,
    gr: &Group,
    nat: &NativeGroup,
    exts: &[Ext],
    outs: &mut [std::sync::RwLockWriteGuard<kiln_tensor::storage::Storage>],
    numel: usize,
    feed: Option<&mut Feed>,
) -> Result<()> {
    let mut optr: Vec<usize> = Vec::with_capacity(outs.len());
    for (k, gd) in outs.iter_mut().enumerate() {
        let want = g.nodes[gr.materialize[k]].dtype;
        let s = gd.as_cpu_mut()?;
        let d = s.dtype();
        let (p, len) = with_cpu!(s, v => (v.as_mut_ptr() as usize, v.len()));
        if d != want || len < numel {
            return Err(Error::Msg(format!("fused group: output {k} is {d:?}[{len}], the kernel writes {want:?}[{numel}]")));
        }
        optr.push(p);
    }
    let mut iptr: Vec<usize> = Vec::with_capacity(exts.len());
    for (k, (e, a)) in exts.iter().zip(&gr.externals).enumerate() {
        let Ext::Shared(s, l) = e else {
            iptr.push(0); // an output's pointer, or the fed product's (per tile)
            continue;
        };
        let (d, (p, len)) = (s.dtype(), with_cpu!(s, v => (v.as_ptr() as usize, v.len())));
        let last = kiln_tensor::shape::last_index(l.offset, &gr.shape, &l.broadcast_strides(&gr.shape));
        let want = g.nodes[a.node].dtype;
        if d != want || (numel > 0 && last >= len) {
            return Err(Error::Msg(format!("fused group: input {k} is {d:?}[{len}], the kernel reads {want:?} up to element {last}")));
        }
        iptr.push(p);
    }
    if numel == 0 && feed.is_none() {
        return Ok(());
    }
    let call = |iptr: &[usize], start: usize, end: usize| {
        // SAFETY: the function was generated for this group's dtypes and layouts (checked
        // above against the buffers, which the caller's guards keep locked and alive; a fed
        // product is `numel` elements of the group's dtype, made by `matmul_by_tiles`); it
        // touches elements start..end of each output and their inputs only.
        unsafe {
            (nat.f)(
                start as i64,
                end as i64,
                optr.as_ptr() as *const *mut u8,
                iptr.as_ptr() as *const *const u8,
                nat.nums.ints.as_ptr(),
                nat.nums.floats.as_ptr(),
            )
        }
    };
    if let Some(feed) = feed {
        let k = exts
            .iter()
            .position(|e| matches!(e, Ext::Fed))
            .ok_or_else(|| Error::Msg("fused group: the fed product is not one of its reads".into()))?;
        return (feed.run)(&|base: *const u8, start: usize, end: usize| {
            let mut ptrs = iptr.clone();
            ptrs[k] = base as usize;
            call(&ptrs, start, end)
        });
    }
    let call = |start: usize, end: usize| call(&iptr, start, end);
    if numel >= kiln_tensor::cpu::PAR_THRESHOLD {
        let piece = numel.div_ceil(rayon::current_num_threads() * 4).next_multiple_of(64);
        (0..numel.div_ceil(piece)).into_par_iter().for_each(|c| call(c * piece, ((c + 1) * piece).min(numel)));
    } else {
        call(0, numel);
    }
    Ok(())
}

/// Whether this CPU runs AVX2 (checked once).
fn wide_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

struct Ctx<'a> {
    g: &'a Graph,
    gr: &'a Group,
    exts: &'a [Ext<'a>],
    srcs: &'a [Vec<Src>],
    stores: &'a [usize],
}

impl Ctx<'_> {
    fn run<F: Float + Element>(&self, chunks: Vec<Vec<Out>>, numel: usize) {
        // Scratch sized to the chunk (small groups need little), made once per worker.
        let width = CHUNK.min(numel);
        let buffers = |n: usize| (0..n).map(|_| vec![F::c(0.0); width]).collect::<Vec<_>>();
        let scratch = || (buffers(self.exts.len()), buffers(self.gr.members.len()));
        let wide = wide_vectors();
        let one = |c: usize, outs: &mut [Out], e: &mut [Vec<F>], m: &mut [Vec<F>]| {
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: `wide_vectors` checked at run time that this CPU has AVX2.
                return unsafe { self.chunk_avx2(c, outs, e, m) };
            }
            let _ = wide;
            self.chunk(c, outs, e, m)
        };
        if numel >= kiln_tensor::cpu::PAR_THRESHOLD {
            let per_worker = chunks.len().div_ceil(rayon::current_num_threads()).max(1);
            chunks
                .into_par_iter()
                .enumerate()
                .with_min_len(per_worker)
                .for_each_init(scratch, |(e, m), (c, mut outs)| one(c, &mut outs, e, m));
        } else {
            let (mut e, mut m) = scratch();
            for (c, mut outs) in chunks.into_iter().enumerate() {
                one(c, &mut outs, &mut e, &mut m);
            }
        }
    }

    /// The same chunk compiled for 256-bit vectors (no FMA: results stay bit-identical to the
    /// baseline path and to eager kernels).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn chunk_avx2<F: Float + Element>(&self, c: usize, outs: &mut [Out], ext: &mut [Vec<F>], mem: &mut [Vec<F>]) {
        self.chunk(c, outs, ext, mem)
    }

    #[inline(always)]
    fn chunk<F: Float + Element>(&self, c: usize, outs: &mut [Out], ext: &mut [Vec<F>], mem: &mut [Vec<F>]) {
        let start = c * CHUNK;
        let len = match outs.first() {
            Some(Out::F32(o)) => o.len(),
            Some(Out::F64(o)) => o.len(),
            Some(Out::U8(o)) => o.len(),
            None => return,
        };
        for (k, e) in self.exts.iter().enumerate() {
            let dst = &mut ext[k][..len];
            match e {
                Ext::Shared(s, l) => with_cpu!(s, v => load_into(v, l, &self.gr.shape, start, dst)),
                Ext::Own(o) => load_own(&outs[*o], dst),
                Ext::Fed => unreachable!("fed products run natively"),
            }
        }
        for (j, &m) in self.gr.members.iter().enumerate() {
            let mut out = std::mem::take(&mut mem[j]);
            {
                let arg = |i: usize| -> &[F] {
                    match self.srcs[j][i] {
                        Src::Member(x) => &mem[x][..len],
                        Src::Ext(x) => &ext[x][..len],
                    }
                };
                let o = &mut out[..len];
                match &self.g.nodes[m].kind {
                    Kind::Op(Op::Unary(u), _) => unary_into(*u, arg(0), o),
                    Kind::Op(Op::Binary(b), _) => binary_into(*b, arg(0), arg(1), o),
                    Kind::Op(Op::Scalar { op, value, scalar_lhs }, _) => scalar_into(*op, F::c(*value), *scalar_lhs, arg(0), o),
                    Kind::Op(Op::Where, _) => where_into(arg(0), arg(1), arg(2), o),
                    Kind::Op(op @ Op::Cast(_), _) if rounds_to_f32(op, self.gr.f64) => {
                        o.iter_mut().zip(arg(0)).for_each(|(d, &v)| *d = F::c(v.to_f64() as f32 as f64))
                    }
                    Kind::Op(Op::Cast(_), _) => o.copy_from_slice(arg(0)),
                    _ => {}
                }
            }
            mem[j] = out;
        }
        for (k, &j) in self.stores.iter().enumerate() {
            store(&mem[j][..len], &mut outs[k]);
        }
    }
}
