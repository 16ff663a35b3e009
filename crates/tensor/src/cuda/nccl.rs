//! NCCL communicators for collectives over CUDA tensors (`Op::Collective`): one per group and
//! process, made from the unique id that rank 0 hands the others (`unique_id`, then
//! `init_group` on every rank), each collective launched on the GPU's one stream, so that a
//! compiled step's CUDA graph captures it like any kernel. NCCL is loaded at run time through
//! cudarc; a machine without it gets an error naming the library.

use crate::collective::{next_group_id, Collective, Group, Reduction};
use crate::cuda::gpu::{gpu, is_dry, Gpu};
use crate::cuda::kernels::elementwise::dense;
use crate::cuda::library::held_open;
use crate::op::OutMeta;
use crate::shape::Layout;
use crate::storage::cuda::CudaStorage;
use crate::{DType, Error, Result};
use cudarc::nccl::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// The length of NCCL's unique id, the bytes rank 0 sends the others.
pub const UNIQUE_ID_BYTES: usize = 128;

struct Comm {
    raw: sys::ncclComm_t,
    ordinal: usize,
}

// SAFETY: an NCCL communicator may be used from any thread; Kiln's calls on one are
// serialised by the registry's lock and issued on the GPU's one stream.
unsafe impl Send for Comm {}
// SAFETY: as above: no two calls on one communicator run at once.
unsafe impl Sync for Comm {}

fn comms() -> &'static Mutex<HashMap<u32, Arc<Comm>>> {
    static COMMS: OnceLock<Mutex<HashMap<u32, Arc<Comm>>>> = OnceLock::new();
    COMMS.get_or_init(Default::default)
}

fn nccl_err(what: impl std::fmt::Display) -> impl Fn(result::NcclError) -> Error {
    let what = what.to_string();
    move |e| {
        // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any code.
        let text = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
        Error::Cuda(format!("{what}: NCCL {:?}: {}", e.0, text.to_string_lossy()))
    }
}

/// Whether NCCL loads (cudarc would panic at its first call otherwise).
fn loaded() -> Result<()> {
    static FOUND: OnceLock<bool> = OnceLock::new();
    if *FOUND.get_or_init(|| held_open(&cudarc::get_lib_name_candidates("nccl"))) {
        return Ok(());
    }
    let only_versioned = held_open(&["libnccl.so.2"]);
    Err(Error::Cuda(if only_versioned {
        "NCCL is installed as libnccl.so.2 only, and cudarc loads it as libnccl.so: link libnccl.so to it in a \
         directory on LD_LIBRARY_PATH (NCCL's dev package installs that link)"
            .into()
    } else {
        "NCCL (libnccl.so) is not found: install NCCL (the nvidia-nccl wheel or libnccl2 and libnccl-dev) and put its \
         lib directory on LD_LIBRARY_PATH"
            .into()
    }))
}

/// A new NCCL unique id (on rank 0, to send to the other ranks before `init_group`).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    loaded()?;
    let id = result::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
    Ok(id.internal.map(|c| c as u8))
}

/// Joins the NCCL group of `world` ranks named by `id` as `rank`, on GPU `ordinal`. Blocks
/// until every rank has joined (NCCL's `ncclCommInitRank`).
pub fn init_group(ordinal: usize, rank: usize, world: usize, id: [u8; UNIQUE_ID_BYTES]) -> Result<Group> {
    loaded()?;
    if rank >= world {
        return Err(Error::Msg(format!("NCCL group: rank {rank} is not in a group of {world} ranks")));
    }
    let g = gpu(ordinal)?;
    g.bind()?;
    let unique = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
    let mut raw = std::mem::MaybeUninit::uninit();
    let (n, r) = (world as i32, rank as i32);
    // SAFETY: `raw` is written by NCCL before it is read; the id is the one all ranks share.
    let raw = unsafe {
        result::comm_init_rank(raw.as_mut_ptr(), n, unique, r)
            .map_err(nccl_err(format!("joining the NCCL group as rank {rank} of {world}")))?;
        raw.assume_init()
    };
    let id = next_group_id();
    comms().lock().map_err(|_| Error::Msg("NCCL groups: a thread panicked".into()))?.insert(id, Arc::new(Comm { raw, ordinal }));
    Ok(Group { id, rank, world })
}

/// Ends this rank's part of `group`: with `abort`, at once, failing any collective still in
/// flight (a rank that gives up on the others), else after the work queued on it.
pub fn destroy_group(group: &Group, abort: bool) -> Result<()> {
    let Some(c) = comms().lock().map_err(|_| Error::Msg("NCCL groups: a thread panicked".into()))?.remove(&group.id) else {
        return Ok(());
    };
    // SAFETY: the communicator came from ncclCommInitRank and leaves the registry here, so no
    // later collective can use it.
    unsafe {
        if abort {
            result::comm_abort(c.raw).map_err(nccl_err("ncclCommAbort"))?;
        } else {
            result::comm_destroy(c.raw).map_err(nccl_err("ncclCommDestroy"))?;
        }
    }
    Ok(())
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(r: Reduction) -> sys::ncclRedOp_t {
    match r {
        Reduction::Sum => sys::ncclRedOp_t::ncclSum,
        Reduction::Mean => sys::ncclRedOp_t::ncclAvg,
        Reduction::Max => sys::ncclRedOp_t::ncclMax,
        Reduction::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// Runs collective `kind` for `group.rank` on `x`, into a new buffer, on `g`'s stream.
pub fn run(g: &Arc<Gpu>, group: &Group, kind: Collective, x: (&CudaStorage, &Layout), meta: &OutMeta) -> Result<CudaStorage> {
    let what = kind.name();
    let comm = comms().lock().map_err(|_| Error::Msg("NCCL groups: a thread panicked".into()))?.get(&group.id).cloned();
    let comm = comm.ok_or_else(|| {
        Error::Msg(format!("{what}: group {} has no NCCL communicator: CUDA tensors need a group made by cuda::nccl::init_group", group.id))
    })?;
    if comm.ordinal != g.ordinal {
        let msg = format!("{what}: group {}'s communicator is on cuda:{}, the tensor is not", group.id, comm.ordinal);
        return Err(Error::Device { device: g.device(), msg });
    }
    let src = dense(g, x.0, x.1)?;
    let out = CudaStorage::alloc(&g.mem, meta.dtype, meta.shape.iter().product())?;
    if is_dry() {
        return Ok(out);
    }
    let (send, recv) = (src.ptr() as *const c_void, out.buf.ptr as *mut c_void);
    let (n, dtype) = (x.1.numel(), nccl_dtype(meta.dtype));
    let stream = g.stream.cu_stream() as sys::cudaStream_t;
    // SAFETY: `send` holds `n` elements of `dtype` and `recv` the output's `meta` elements (the
    // shape rule sized it for this collective), both on this communicator's GPU and alive
    // until the stream has run the collective (the caching allocator frees in stream order).
    unsafe {
        match kind {
            Collective::AllReduce(r) => result::all_reduce(send, recv, n, dtype, nccl_op(r), comm.raw, stream),
            Collective::Broadcast { root } => result::broadcast(send, recv, n, dtype, root as i32, comm.raw, stream),
            Collective::AllGather => result::all_gather(send, recv, n, dtype, comm.raw, stream),
            Collective::ReduceScatter(r) => result::reduce_scatter(send, recv, n / group.world, dtype, nccl_op(r), comm.raw, stream),
        }
    }
    .map_err(nccl_err(format!("{what} of {n} {:?} on rank {} of {}", meta.dtype, group.rank, group.world)))?;
    Ok(out)
}
