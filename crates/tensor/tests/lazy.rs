//! Lazy tracing (`kiln_tensor::lazy`): kernels queued while a step is traced, run before any
//! host read, and dropped (except fills) when the trace ends.

use kiln_tensor::lazy;
use kiln_tensor::{DType, Device, Result, Tensor};

fn v(t: &Tensor) -> Result<Vec<f32>> {
    t.to_vec::<f32>()
}

#[test]
fn a_host_read_runs_the_queue_and_values_match_eager() -> Result<()> {
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu)?;
    let queue = lazy::begin()?;
    assert!(lazy::active());
    assert!(lazy::begin().is_err(), "one queue per thread: a nested trace is refused");
    let b = a.add_scalar(1.0)?; // [2, 3, 4]
    let c = b.mul(&b)?; // [4, 9, 16]
    a.add_scalar_(10.0)?; // queued in-place write: a = [11, 12, 13]
    let d = a.add(&c)?; // [15, 21, 29]
    assert_eq!(v(&d)?, vec![15.0, 21.0, 29.0], "the read ran every queued kernel in order");
    let e = d.mul_scalar(2.0)?; // queued again after the flush
    let stopped = queue.stop();
    assert!(stopped.flushed, "the read ran part of the queue");
    stopped.run_all()?;
    assert!(!lazy::active());
    assert_eq!(v(&e)?, vec![30.0, 42.0, 58.0]);
    assert_eq!(v(&a)?, vec![11.0, 12.0, 13.0]);
    Ok(())
}

#[test]
fn ending_with_sources_drops_updates_but_keeps_fills() -> Result<()> {
    let p = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?;
    let queue = lazy::begin()?;
    let m = Tensor::full(3.0, &[2], DType::F32, Device::Cpu)?; // a buffer the step creates and keeps
    m.add_scalar_(1.0)?;
    let t = Tensor::full(5.0, &[2], DType::F32, Device::Cpu)?; // a temporary: its fill is dropped
    p.assign(&m.add(&t)?)?;
    drop(t);
    let stopped = queue.stop();
    assert!(!stopped.flushed);
    assert_eq!(stopped.run_fills()?, (1, 2), "m's fill ran; t's, a temporary's, was dropped");
    assert_eq!(v(&p)?, vec![1.0, 2.0], "the queued write into p was dropped");
    assert_eq!(v(&m)?, vec![3.0, 3.0], "the fill ran, the update after it did not");
    Ok(())
}

#[test]
fn a_queued_in_place_write_counts_for_autograd_when_queued() -> Result<()> {
    let x = Tensor::from_vec(vec![0.5f32, 1.5], &[2], Device::Cpu)?;
    let before = x.storage().version();
    let queue = lazy::begin()?;
    x.add_scalar_(1.0)?;
    assert_eq!(x.storage().version(), before + 1, "counted at the call, as in eager");
    queue.stop().run_all()?;
    assert_eq!(x.storage().version(), before + 1, "running the queue does not count it twice");
    assert_eq!(v(&x)?, vec![1.5, 2.5]);
    Ok(())
}

#[test]
fn a_dropped_guard_stops_queueing() -> Result<()> {
    let a = Tensor::from_vec(vec![1.0f32], &[1], Device::Cpu)?;
    {
        let _queue = lazy::begin()?;
        a.add_scalar(1.0)?;
    } // dropped without `stop`, as by a panic in the step
    assert!(!lazy::active());
    assert_eq!(v(&a.add_scalar(1.0)?)?, vec![2.0], "kernels run eagerly again");
    Ok(())
}
