//! A CPU buffer pool. Freed tensor buffers are kept by (type, length) and handed to the next
//! op that needs the same size, so a training step stops paying for page faults and zeroing
//! once its sizes have been seen (glibc returns large buffers to the OS on every free).
//!
//! When a freed buffer would take the pool over its cap, buffers of the sizes used longest
//! ago make room for it: a workload whose sizes change (eager steps, then a compiled step's
//! other buffers) keeps its own sizes pooled, rather than the first workload's.

use crate::Element;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Buffers smaller than this are left to the allocator (it is fast for them).
const MIN_POOLED_BYTES: usize = 4096;
/// The cap at least, and without `/proc/meminfo`.
const MIN_CAP: usize = 1 << 30;

/// Bytes the pool keeps at most: an eighth of the machine's memory, at least 1 GiB (GPT's
/// CPU step at batch 64 frees about 3 GB of intermediates a step).
fn cap() -> usize {
    static CAP: OnceLock<usize> = OnceLock::new();
    *CAP.get_or_init(|| {
        let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok().map(|kib| kib * 1024)
        });
        total.map_or(MIN_CAP, |t| (t / 8).max(MIN_CAP))
    })
}

type Key = (TypeId, usize);

/// The buffers of one (type, length) and when that size was last taken or given.
struct Class {
    bufs: Vec<Box<dyn Any + Send>>,
    bytes_each: usize,
    used: u64,
}

struct Pool {
    free: HashMap<Key, Class>,
    bytes: usize,
    tick: u64,
    cap: usize,
}

impl Pool {
    fn new(cap: usize) -> Pool {
        Pool { free: HashMap::new(), bytes: 0, tick: 0, cap }
    }

    fn take<T: Element>(&mut self, len: usize) -> Option<Vec<T>> {
        self.tick += 1;
        let key = (TypeId::of::<T>(), len);
        let class = self.free.get_mut(&key)?;
        class.used = self.tick;
        let buf = class.bufs.pop()?;
        self.bytes -= class.bytes_each;
        if class.bufs.is_empty() {
            // An empty class holds nothing: dropping it keeps eviction's scan to held sizes.
            self.free.remove(&key);
        }
        buf.downcast::<Vec<T>>().ok().map(|v| *v)
    }

    /// Keeps `v`, first dropping buffers of the sizes used longest ago while it would not fit;
    /// drops `v` itself if the others cannot make room.
    fn give<T: Element>(&mut self, v: Vec<T>) {
        let (key, bytes) = ((TypeId::of::<T>(), v.len()), std::mem::size_of_val(v.as_slice()));
        self.tick += 1;
        if bytes > self.cap {
            return;
        }
        while self.bytes + bytes > self.cap {
            let oldest = self.free.iter().filter(|(k, _)| **k != key).min_by_key(|(_, c)| c.used).map(|(k, _)| *k);
            let Some(k) = oldest else { return };
            let class = self.free.get_mut(&k).expect("a class just found");
            class.bufs.pop();
            self.bytes -= class.bytes_each;
            if class.bufs.is_empty() {
                self.free.remove(&k);
            }
        }
        let class = self.free.entry(key).or_insert_with(|| Class { bufs: Vec::new(), bytes_each: bytes, used: 0 });
        class.used = self.tick;
        class.bufs.push(Box::new(v));
        self.bytes += bytes;
    }
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// A `Vec<T>` of exactly `len` elements. Its contents are unspecified (zeros or old values):
/// callers overwrite every element.
pub fn take<T: Element>(len: usize) -> Vec<T> {
    if len * std::mem::size_of::<T>() >= MIN_POOLED_BYTES {
        let mut guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = guard.as_mut().and_then(|p| p.take(len)) {
            return v;
        }
    }
    // Zeroed by the allocator: large buffers come as fresh zero pages, touched only where
    // written (`vec![bf16::ZERO; n]` would write every byte first; a lazy trace's outputs are
    // never written).
    bytemuck::zeroed_vec(len)
}

/// Return a buffer for reuse.
pub fn give<T: Element>(v: Vec<T>) {
    if std::mem::size_of_val(v.as_slice()) < MIN_POOLED_BYTES || v.len() != v.capacity() {
        return;
    }
    let mut guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guard.get_or_insert_with(|| Pool::new(cap())).give(v);
}

/// Bytes currently held by the pool.
pub fn pooled_bytes() -> usize {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |p| p.bytes)
}

/// Drop every pooled buffer.
pub fn clear() {
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

#[cfg(test)]
mod tests {
    use super::Pool;

    #[test]
    fn a_full_pool_drops_the_sizes_used_longest_ago() {
        // Room for three buffers of 1024 f32 and one of 1025.
        let mut p = Pool::new(4 * 4096 + 4);
        for len in [1024usize, 1024, 1024] {
            p.give(vec![0f32; len]);
        }
        p.give(vec![1f32; 1024 + 1]);
        // A size taken since (the three 1024s) is newer than the 1025 given before it.
        assert!(p.take::<f32>(1024).is_some());
        p.give(vec![0f32; 1024]);
        // Full: a buffer of 2048 evicts the 1025 first (the oldest use) and one 1024 next.
        p.give(vec![2f32; 2048]);
        assert_eq!(p.bytes, 4096 * 2 + 8192);
        assert!(p.take::<f32>(1024 + 1).is_none());
        assert_eq!(p.take::<f32>(2048).expect("kept"), vec![2f32; 2048]);
        assert!(p.take::<f32>(1024).is_some() && p.take::<f32>(1024).is_some() && p.take::<f32>(1024).is_none());
        // Emptied sizes are dropped, so eviction scans only the sizes held.
        assert!(p.free.is_empty() && p.bytes == 0);
        // A buffer larger than the cap is not kept, and evicts nothing it cannot replace.
        p.give(vec![0f32; 1024]);
        p.give(vec![0f64; 4096]);
        assert_eq!(p.bytes, 4096);
        assert!(p.take::<f64>(4096).is_none());
        // Types are told apart: an f64 buffer of the same length is another size.
        assert!(p.take::<f64>(1024).is_none() && p.take::<f32>(1024).is_some());
    }
}
