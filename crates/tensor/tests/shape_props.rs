//! Property tests for the shape algebra: broadcasting, reshape and permute round trips.

use kiln_tensor::shape::broadcast_shapes;
use kiln_tensor::{DType, Device, Tensor};
use proptest::prelude::*;

fn shape_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..5, 0..5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn broadcasting_with_ones_is_identity_and_symmetric(shape in shape_strategy(), mask in prop::collection::vec(any::<bool>(), 5)) {
        let ones: Vec<usize> = shape.iter().zip(&mask).map(|(&d, &m)| if m { 1 } else { d }).collect();
        prop_assert_eq!(broadcast_shapes("t", &shape, &ones)?, shape.clone());
        prop_assert_eq!(broadcast_shapes("t", &ones, &shape)?, shape.clone());
        // A broadcast add equals adding the explicitly expanded tensor.
        let n: usize = ones.iter().product();
        let a = Tensor::arange(shape.iter().product(), DType::F32, Device::Cpu)?.reshape(&shape)?;
        let b = Tensor::arange(n, DType::F32, Device::Cpu)?.reshape(&ones)?;
        let direct = a.add(&b)?.to_vec::<f32>()?;
        let expanded = a.add(&b.broadcast_to(&shape)?.contiguous()?)?.to_vec::<f32>()?;
        prop_assert_eq!(direct, expanded);
    }

    #[test]
    fn permute_then_inverse_round_trips(shape in prop::collection::vec(1usize..5, 1..5), seed in any::<u64>()) {
        let rank = shape.len();
        let mut perm: Vec<usize> = (0..rank).collect();
        let mut s = seed;
        for i in (1..rank).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            perm.swap(i, (s >> 33) as usize % (i + 1));
        }
        let mut inv = vec![0; rank];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let n: usize = shape.iter().product();
        let x = Tensor::arange(n, DType::F32, Device::Cpu)?.reshape(&shape)?;
        let p = x.permute(&perm)?;
        let want: Vec<usize> = perm.iter().map(|&i| shape[i]).collect();
        prop_assert_eq!(p.shape(), want.as_slice());
        // Through a copy (contiguous) and back.
        let back = p.contiguous()?.permute(&inv)?;
        prop_assert_eq!(back.to_vec::<f32>()?, x.to_vec::<f32>()?);
    }

    #[test]
    fn reshape_round_trips_and_keeps_order(shape in shape_strategy(), split in 1usize..4) {
        let n: usize = shape.iter().product();
        let x = Tensor::arange(n, DType::F32, Device::Cpu)?.reshape(&shape)?;
        let flat = x.reshape(&[-1])?;
        prop_assert_eq!(flat.shape(), &[n]);
        prop_assert_eq!(flat.reshape(&shape)?.to_vec::<f32>()?, x.to_vec::<f32>()?);
        if n.is_multiple_of(split) {
            let y = x.reshape(&[split as i64, -1])?;
            prop_assert_eq!(y.shape(), &[split, n / split]);
            prop_assert!(y.same_storage(&x)); // contiguous reshapes are views
        }
    }
}
