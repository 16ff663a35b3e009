//! Per-op timing for finding where a step's time goes (`KILN_PROFILE=1`). Each op on a GPU is
//! then synchronised before and after, so the table shows device time per op kind (launch
//! latency included); it slows the run down and is for diagnosis only.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;

/// Whether `KILN_PROFILE` is set (read once), or this thread has switched timing on.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    if PAUSED.with(|p| p.get()) {
        return false;
    }
    FORCED.with(|f| f.get()) || *ON.get_or_init(|| std::env::var_os("KILN_PROFILE").is_some_and(|v| v != "0"))
}

/// Switches per-op timing on or off for this thread (e.g. `Compiled::call_profiled`).
pub fn set_enabled(on: bool) {
    FORCED.with(|f| f.set(on));
}

thread_local! {
    static TABLE: RefCell<HashMap<String, (u64, f64)>> = RefCell::new(HashMap::new());
    static FORCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PAUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with timing off on this thread (a dry run's skipped launches are not timed).
pub fn paused<R>(f: impl FnOnce() -> R) -> R {
    struct Resume(bool);
    impl Drop for Resume {
        fn drop(&mut self) {
            PAUSED.with(|p| p.set(self.0));
        }
    }
    let _resume = Resume(PAUSED.with(|p| p.replace(true)));
    f()
}

pub fn record(key: String, secs: f64) {
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let e = t.entry(key).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += secs;
    });
}

pub fn reset() {
    TABLE.with(|t| t.borrow_mut().clear());
}

/// The table so far on this thread, largest total first.
pub fn report() -> String {
    TABLE.with(|t| {
        let t = t.borrow();
        let mut rows: Vec<_> = t.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        let mut s = format!("{:>10} {:>8} {:>10}  op\n", "total ms", "calls", "us/call");
        for (k, (n, secs)) in rows.iter().take(40) {
            s += &format!("{:>10.3} {:>8} {:>10.1}  {k}\n", secs * 1e3, n, secs * 1e6 / *n as f64);
        }
        s + &format!("{:>10.3}  all ops\n", total * 1e3)
    })
}
