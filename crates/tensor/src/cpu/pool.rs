//! A CPU buffer pool. Freed tensor buffers are kept by (type, length) and handed to the next
//! op that needs the same size, so a training step stops paying for page faults and zeroing
//! once its sizes have been seen (glibc returns large buffers to the OS on every free).

use crate::Element;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Mutex;

/// Buffers kept at most, in bytes; beyond this freed buffers go back to the allocator.
const MAX_POOLED_BYTES: usize = 1 << 30;
/// Buffers smaller than this are left to the allocator (it is fast for them).
const MIN_POOLED_BYTES: usize = 4096;

struct Pool {
    free: HashMap<(TypeId, usize), Vec<Box<dyn Any + Send>>>,
    bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// A `Vec<T>` of exactly `len` elements. Its contents are unspecified (zeros or old values):
/// callers overwrite every element.
pub fn take<T: Element>(len: usize) -> Vec<T> {
    let bytes = len * std::mem::size_of::<T>();
    if bytes >= MIN_POOLED_BYTES {
        let mut guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = guard.as_mut() {
            if let Some(list) = pool.free.get_mut(&(TypeId::of::<T>(), len)) {
                if let Some(buf) = list.pop() {
                    pool.bytes -= bytes;
                    if let Ok(v) = buf.downcast::<Vec<T>>() {
                        return *v;
                    }
                }
            }
        }
    }
    vec![T::zero(); len]
}

/// Return a buffer for reuse.
pub fn give<T: Element>(v: Vec<T>) {
    let bytes = v.len() * std::mem::size_of::<T>();
    if bytes < MIN_POOLED_BYTES || v.len() != v.capacity() {
        return;
    }
    let mut guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let pool = guard.get_or_insert_with(|| Pool { free: HashMap::new(), bytes: 0 });
    if pool.bytes + bytes > MAX_POOLED_BYTES {
        return;
    }
    pool.bytes += bytes;
    pool.free.entry((TypeId::of::<T>(), v.len())).or_default().push(Box::new(v));
}

/// Bytes currently held by the pool.
pub fn pooled_bytes() -> usize {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |p| p.bytes)
}

/// Drop every pooled buffer.
pub fn clear() {
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = None;
}
