//! Kernel throughput on the CPU: elementwise add (GB/s, against a plain Rust loop) and a
//! 1024^3 f32 matmul (GFLOP/s, against the `gemm` crate, the kernel Kiln calls, called
//! directly on all threads and on one).
//! `cargo bench --bench ops`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kiln::{DType, Device, Tensor};
use kiln_tensor::Distribution;
use std::hint::black_box;

fn elementwise(c: &mut Criterion) {
    let mut g = c.benchmark_group("add_f32");
    for n in [1usize << 16, 1 << 22] {
        // Bytes moved: two reads and one write of n floats.
        g.throughput(Throughput::Bytes((3 * 4 * n) as u64));
        let a = Tensor::rand_at(&[n], Distribution::Uniform, 1, 0, DType::F32, Device::Cpu).unwrap();
        let b = Tensor::rand_at(&[n], Distribution::Uniform, 2, 0, DType::F32, Device::Cpu).unwrap();
        g.bench_with_input(BenchmarkId::new("kiln", n), &n, |bch, _| bch.iter(|| black_box(a.add(&b).unwrap())));
        let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let mut out = vec![0f32; n];
        g.bench_with_input(BenchmarkId::new("plain_loop", n), &n, |bch, _| {
            bch.iter(|| {
                for ((o, x), y) in out.iter_mut().zip(&av).zip(&bv) {
                    *o = x + y;
                }
                black_box(&out);
            })
        });
    }
    g.finish();
}

fn matmul(c: &mut Criterion) {
    let n = 1024;
    let mut g = c.benchmark_group("matmul_f32_1024");
    g.sample_size(20);
    g.throughput(Throughput::Elements((2 * n * n * n) as u64)); // FLOPs, read as "elements"
    let a = Tensor::rand_at(&[n, n], Distribution::Normal, 3, 0, DType::F32, Device::Cpu).unwrap();
    let b = Tensor::rand_at(&[n, n], Distribution::Normal, 4, 0, DType::F32, Device::Cpu).unwrap();
    g.bench_function("kiln", |bch| bch.iter(|| black_box(a.matmul(&b).unwrap())));
    let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let mut out = vec![0f32; n * n];
    let threads = rayon::current_num_threads();
    // All threads, and one (as Kiln's split gives each thread its block of columns).
    for (name, par) in [("gemm_direct", gemm::Parallelism::Rayon(threads)), ("gemm_direct_one_thread", gemm::Parallelism::None)] {
        g.bench_function(name, |bch| {
            bch.iter(|| {
                // SAFETY: all three buffers hold n*n f32 in row-major order.
                unsafe {
                    let nn = n as isize;
                    gemm::gemm(
                        n,
                        n,
                        n,
                        out.as_mut_ptr(),
                        1,
                        nn,
                        false,
                        av.as_ptr(),
                        1,
                        nn,
                        bv.as_ptr(),
                        1,
                        nn,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    );
                }
                black_box(&out);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, elementwise, matmul);
criterion_main!(benches);
