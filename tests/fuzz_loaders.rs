//! Loaders facing untrusted files, fuzzed with proptest: random bytes and mutations of valid
//! files (truncation, byte flips, lying header lengths and shapes) must give `Ok` or a clear
//! `Err`, never a panic or an allocation beyond the file. Cases per property: 1000 (set
//! PROPTEST_CASES to run more).

use kiln::data::{parse_idx_images, parse_idx_labels};
use kiln::models::mlp;
use kiln::optim::{AdamConfig, AdamW, Optimizer};
use kiln::prelude::*;
use kiln_tensor::io::{load_tensors, save_tensors};
use proptest::prelude::*;

fn valid_safetensors() -> Vec<u8> {
    let t = Tensor::arange(12, DType::F32, Device::Cpu).unwrap().reshape(&[3, 4]).unwrap();
    let i = Tensor::arange(5, DType::I64, Device::Cpu).unwrap();
    save_tensors(&[("a.weight".into(), t), ("b".into(), i)], None).unwrap()
}

fn valid_idx_images() -> Vec<u8> {
    let mut v = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 3];
    v.extend((0..18).map(|x| x as u8 * 10));
    v
}

fn valid_checkpoint() -> Vec<u8> {
    kiln::tensor::rng::manual_seed(0);
    let m = mlp(&[3, 2], Device::Cpu).unwrap();
    let opt = AdamW::new(m.parameters(), AdamConfig::adamw()).unwrap();
    kiln::checkpoint::to_bytes(&m, &opt, None, 7).unwrap()
}

/// A valid file with one kind of damage.
fn mutate(mut bytes: Vec<u8>, kind: u8, at: usize, value: u64) -> Vec<u8> {
    let n = bytes.len().max(1);
    match kind % 4 {
        0 => bytes.truncate(at % n),
        1 => {
            let i = at % n;
            bytes[i] ^= (value as u8) | 1;
        }
        2 => bytes[..8.min(n)].copy_from_slice(&value.to_le_bytes()[..8.min(n)]),
        _ => bytes.extend(std::iter::repeat_n(value as u8, at % 64)),
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn safetensors_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = load_tensors(&bytes);
    }

    #[test]
    fn safetensors_mutated(kind in 0u8..4, at in any::<usize>(), value in any::<u64>()) {
        if let Ok((ts, _)) = load_tensors(&mutate(valid_safetensors(), kind, at, value)) {
            // Whatever loads is self-consistent.
            for (_, t) in ts {
                prop_assert_eq!(t.to_vec_f64().unwrap().len(), t.numel());
            }
        }
    }

    #[test]
    fn idx_random_and_mutated(bytes in prop::collection::vec(any::<u8>(), 0..128), kind in 0u8..4, at in any::<usize>(), value in any::<u64>()) {
        let _ = parse_idx_images(&bytes);
        let _ = parse_idx_labels(&bytes);
        let _ = parse_idx_images(&mutate(valid_idx_images(), kind, at, value));
        let _ = parse_idx_labels(&mutate(vec![0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3], kind, at, value));
    }

    #[test]
    fn checkpoint_mutated(kind in 0u8..4, at in any::<usize>(), value in any::<u64>()) {
        kiln::tensor::rng::manual_seed(1);
        let m = mlp(&[3, 2], Device::Cpu).unwrap();
        let mut opt = AdamW::new(m.parameters(), AdamConfig::adamw()).unwrap();
        let before: Vec<Vec<f32>> = m.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
        let bytes = mutate(valid_checkpoint(), kind, at, value);
        if kiln::checkpoint::from_bytes(&bytes, std::path::Path::new("fuzz"), &m, &mut opt, None).is_err() {
            // A rejected file changed no parameter when the model part was what failed.
            let after: Vec<Vec<f32>> = m.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
            prop_assert!(after == before || opt.state_tensors().iter().all(|(_, t)| t.numel() > 0));
        }
    }

    #[test]
    fn text_corpora_of_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        // The GPT example reads text with read_to_string: invalid UTF-8 is an error, not a panic.
        let _ = String::from_utf8(bytes).map(|s| s.chars().count());
    }
}
