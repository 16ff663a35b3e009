//! CUDA basics on a real GPU (built only with `--features cuda`; run on the GPU machine through
//! ../shared/gpu/pack). Without a GPU these tests fail with a message saying so: they never
//! pass vacuously.

use half::{bf16, f16};
use kiln_tensor::{DType, Device, Distribution, Tensor};

fn gpu() -> Device {
    let d = Device::cuda_if_available(0);
    assert!(d.is_cuda(), "NO GPU: this CUDA test needs an NVIDIA GPU and driver (run it on the GPU machine)");
    d
}

#[test]
fn round_trips_every_dtype_and_views() {
    let dev = gpu();
    let x = Tensor::rand_at(&[3, 5], Distribution::Normal, 1, 0, DType::F32, Device::Cpu).unwrap();
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let h = x.to_dtype(dt).unwrap();
        let g = h.to_device(dev).unwrap();
        assert_eq!((g.device(), g.dtype(), g.shape()), (dev, dt, &[3usize, 5][..]));
        assert_eq!(g.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap(), h.to_vec_f64().unwrap(), "{dt:?}");
    }
    let i = Tensor::arange(7, DType::I64, Device::Cpu).unwrap();
    assert_eq!(i.to_device(dev).unwrap().to_vec::<i64>().unwrap(), (0..7).collect::<Vec<i64>>());
    let m = Tensor::from_slice(&[1u8, 0, 1], &[3], Device::Cpu).unwrap();
    assert_eq!(m.to_device(dev).unwrap().to_vec::<u8>().unwrap(), vec![1, 0, 1]);
    // A transposed view of a device tensor reads back in its own order.
    let g = x.to_device(dev).unwrap();
    assert_eq!(g.t().unwrap().to_vec::<f32>().unwrap(), x.t().unwrap().contiguous().unwrap().to_vec::<f32>().unwrap());
    let _ = (f16::ZERO, bf16::ZERO);
}

#[test]
fn bad_requests_are_errors_not_crashes() {
    let dev = gpu();
    let a = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    let b = a.to_device(dev).unwrap();
    let e = a.add(&b).unwrap_err().to_string();
    assert!(e.contains("different devices"), "{e}");
    assert_eq!(b.add(&b).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
    let e = a.to_device(Device::Cuda(99)).unwrap_err().to_string();
    assert!(e.contains("Cuda(99)"), "{e}");
}

#[test]
fn a_dry_run_notes_kernels_and_changes_nothing() {
    use kiln_tensor::cuda::compiled::{dry_run, prepare};
    let dev = gpu();
    let p = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3], Device::Cpu).unwrap().to_device(dev).unwrap();
    let m = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.5, 0.25, -0.75], &[2, 3], Device::Cpu).unwrap().to_device(dev).unwrap();
    // A product (cuBLAS), kernels (one of a shape no other test uses, so not loaded yet) and
    // in-place updates: in a dry run none of it may reach the device.
    let work = || -> kiln_tensor::Result<()> {
        let y = m.matmul(&p.reshape(&[3, 1])?)?.reshape(&[2])?;
        let z = y.sin()?.mul_scalar(0.37)?.sum_all()?;
        p.add_(&z.expand(&[3])?)?;
        p.mul_scalar_(3.0)?;
        Ok(())
    };
    let (r, noted) = dry_run(work);
    r.unwrap();
    assert!(!noted.is_empty(), "the dry run noted no kernels");
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0], "a dry run changed a tensor");
    // Nested, the inner run's notes are the outer run's too, and the outer run stays dry after it.
    let (inner, outer) = dry_run(|| {
        let (r, inner) = dry_run(work);
        r.unwrap();
        p.mul_scalar_(5.0).unwrap();
        inner
    });
    assert!(!inner.is_empty() && outer.len() >= inner.len(), "{} noted inside, {} outside", inner.len(), outer.len());
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0], "a nested dry run changed a tensor");
    // Preparing compiles them; the real run then gives the eager answer.
    let n = prepare(dev, work).unwrap();
    assert!(n >= 1, "prepare compiled {n} programs");
    work().unwrap();
    let y = [0.5f32 * 1.0 - 2.0 + 6.0, 1.5 + 0.5 - 2.25];
    let z = 0.37 * (y[0].sin() + y[1].sin());
    let want: Vec<f32> = [1.0f32, 2.0, 3.0].iter().map(|v| (v + z) * 3.0).collect();
    let got = p.to_vec::<f32>().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "after the real run: {got:?}, want {want:?}");
    }
}
