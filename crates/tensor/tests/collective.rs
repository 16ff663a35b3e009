//! Collectives over a thread group: each rank a thread, results checked against hand sums.

use kiln_tensor::collective::{Collective, Group, Reduction};
use kiln_tensor::cpu::collective::{leave, thread_group};
use kiln_tensor::{Device, Tensor};
use std::time::Duration;

/// Runs `f(rank's group)` on one thread per rank and returns the results in rank order.
fn on_ranks<R: Send>(world: usize, timeout: Duration, f: impl Fn(Group) -> R + Sync) -> Vec<R> {
    let groups = thread_group(world, timeout).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(move || f(g))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank r's tensor: `[r + 1, 10 (r + 1), -(r + 1), 0.5 r]`.
fn mine(g: Group) -> Tensor {
    let r = (g.rank + 1) as f32;
    Tensor::from_vec(vec![r, 10.0 * r, -r, 0.5 * g.rank as f32], &[4], Device::Cpu).unwrap()
}

#[test]
fn reductions_match_hand_sums_on_every_rank() {
    let long = Duration::from_secs(30);
    let out = on_ranks(3, long, |g| {
        let x = mine(g);
        let v = |k| x.collective(g, k).unwrap().to_vec::<f32>().unwrap();
        (
            v(Collective::AllReduce(Reduction::Sum)),
            v(Collective::AllReduce(Reduction::Mean)),
            v(Collective::AllReduce(Reduction::Max)),
            v(Collective::AllReduce(Reduction::Min)),
        )
    });
    for (sum, mean, max, min) in out {
        assert_eq!(sum, vec![6.0, 60.0, -6.0, 1.5]);
        assert_eq!(mean, vec![2.0, 20.0, -2.0, 0.5]);
        assert_eq!(max, vec![3.0, 30.0, -1.0, 1.0]);
        assert_eq!(min, vec![1.0, 10.0, -3.0, 0.0]);
    }
}

#[test]
fn broadcast_gather_and_scatter_place_each_rank_s_part() {
    let out = on_ranks(2, Duration::from_secs(30), |g| {
        let x = mine(g);
        let b = x.collective(g, Collective::Broadcast { root: 1 }).unwrap();
        let ag = x.collective(g, Collective::AllGather).unwrap();
        let rs = x.collective(g, Collective::ReduceScatter(Reduction::Sum)).unwrap();
        (b.to_vec::<f32>().unwrap(), ag.shape().to_vec(), ag.to_vec::<f32>().unwrap(), rs.to_vec::<f32>().unwrap())
    });
    for (rank, (b, ag_shape, ag, rs)) in out.into_iter().enumerate() {
        assert_eq!(b, vec![2.0, 20.0, -2.0, 0.5]);
        assert_eq!(ag_shape, vec![8]);
        assert_eq!(ag, vec![1.0, 10.0, -1.0, 0.0, 2.0, 20.0, -2.0, 0.5]);
        // The sum [3, 30, -3, 0.5] cut in two: rank 0 the first half, rank 1 the second.
        assert_eq!(rs, if rank == 0 { vec![3.0, 30.0] } else { vec![-3.0, 0.5] });
    }
}

#[test]
fn mismatched_shapes_and_bad_arguments_are_errors_naming_them() {
    let out = on_ranks(2, Duration::from_secs(30), |g| {
        let x = Tensor::zeros(&[2 + g.rank], kiln_tensor::DType::F32, Device::Cpu).unwrap();
        x.collective(g, Collective::AllReduce(Reduction::Sum)).unwrap_err().to_string()
    });
    for e in out {
        assert!(e.contains("[2]") && e.contains("[3]"), "{e}");
    }
    let g = thread_group(2, Duration::from_secs(1)).unwrap()[0];
    let odd = Tensor::zeros(&[3], kiln_tensor::DType::F32, Device::Cpu).unwrap();
    let e = odd.collective(g, Collective::ReduceScatter(Reduction::Sum)).unwrap_err().to_string();
    assert!(e.contains("[3]") && e.contains("2 equal parts"), "{e}");
    let e = odd.collective(g, Collective::Broadcast { root: 5 }).unwrap_err().to_string();
    assert!(e.contains("root rank 5"), "{e}");
    let ints = Tensor::zeros(&[2], kiln_tensor::DType::I64, Device::Cpu).unwrap();
    assert!(ints.collective(g, Collective::AllReduce(Reduction::Sum)).is_err());
}

#[test]
fn a_rank_that_leaves_or_never_comes_ends_the_others_wait() {
    // Rank 1 leaves instead of joining: rank 0 fails at once, well before its timeout.
    let out = on_ranks(2, Duration::from_secs(60), |g| {
        if g.rank == 1 {
            leave(&g);
            return String::new();
        }
        mine(g).collective(g, Collective::AllReduce(Reduction::Sum)).unwrap_err().to_string()
    });
    assert!(out[0].contains("rank 1 left the group"), "{}", out[0]);
    // Rank 1 stays away: rank 0 times out, naming it.
    let g = thread_group(2, Duration::from_millis(200)).unwrap()[0];
    let e = mine(g).collective(g, Collective::AllReduce(Reduction::Sum)).unwrap_err().to_string();
    assert!(e.contains("timed out") && e.contains("[1]"), "{e}");
}

#[test]
fn many_rounds_in_a_row_keep_their_order() {
    let out = on_ranks(4, Duration::from_secs(30), |g| {
        (0..50)
            .map(|i| {
                let x = Tensor::from_vec(vec![(i * 4 + g.rank) as f64], &[1], Device::Cpu).unwrap();
                x.collective(g, Collective::AllReduce(Reduction::Sum)).unwrap().to_vec::<f64>().unwrap()[0]
            })
            .collect::<Vec<_>>()
    });
    let want: Vec<f64> = (0..50).map(|i| (16 * i + 6) as f64).collect();
    assert!(out.iter().all(|v| *v == want));
}
