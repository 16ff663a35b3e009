//! `DataLoader` (as `torch.utils.data.DataLoader` over a `TensorDataset`): batches of the rows
//! of tensors that share their first dim, in order or shuffled by a seed and the epoch, each
//! batch gathered on the tensors' device (one `index_select` each) and moved to `device`.

use crate::data::SplitMix64;
use kiln_tensor::{Device, Error, Result, Tensor};

/// Batches over the rows of `tensors` (features, labels, ...).
pub struct DataLoader {
    tensors: Vec<Tensor>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
    device: Option<Device>,
    epoch: u64,
    /// This rank and the world size, under data parallelism (`distributed`).
    shard: (usize, usize),
}

impl DataLoader {
    /// Batches of `batch_size` rows of every tensor, in order; the tensors must agree on
    /// their first dim.
    pub fn new(tensors: Vec<Tensor>, batch_size: usize) -> Result<DataLoader> {
        let Some(first) = tensors.first() else {
            return Err(Error::Msg("DataLoader: needs at least one tensor".into()));
        };
        let rows = |t: &Tensor| t.shape().first().copied();
        if batch_size == 0 || rows(first).is_none() || tensors.iter().any(|t| rows(t) != rows(first)) {
            let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
            return Err(Error::shape(
                "DataLoader",
                format!("needs a positive batch size and tensors with the same first dim; got batch {batch_size}, shapes {shapes:?}"),
            ));
        }
        Ok(DataLoader { tensors, batch_size, shuffle: None, drop_last: false, device: None, epoch: 0, shard: (0, 1) })
    }

    /// A new order every epoch, from `seed` and the epoch's number (so a run is repeatable).
    pub fn shuffle(self, seed: u64) -> DataLoader {
        DataLoader { shuffle: Some(seed), ..self }
    }

    /// Leaves out a last batch smaller than `batch_size` (keeps compiled shapes fixed).
    pub fn drop_last(self, drop: bool) -> DataLoader {
        DataLoader { drop_last: drop, ..self }
    }

    /// Moves each batch to `device`.
    pub fn to_device(self, device: Device) -> DataLoader {
        DataLoader { device: Some(device), ..self }
    }

    /// Rank `rank` of `world`'s share of every epoch (PyTorch's `DistributedSampler`): the
    /// epoch's order (the same on every rank: one seed) padded by its first rows to a
    /// multiple of `world`, then every `world`-th row from `rank`. Each rank sees
    /// `rows() / world` rows (rounded up), and together the ranks see every row.
    pub fn distributed(self, rank: usize, world: usize) -> Result<DataLoader> {
        if world == 0 || rank >= world {
            return Err(Error::Msg(format!("DataLoader::distributed: rank {rank} is not in a world of {world}")));
        }
        Ok(DataLoader { shard: (rank, world), ..self })
    }

    /// Rows in the data set.
    pub fn rows(&self) -> usize {
        self.tensors[0].shape()[0]
    }

    /// Rows this rank sees in an epoch (all of them without `distributed`).
    fn shard_rows(&self) -> usize {
        self.rows().div_ceil(self.shard.1)
    }

    /// Batches an epoch gives.
    pub fn len(&self) -> usize {
        if self.drop_last {
            self.shard_rows() / self.batch_size
        } else {
            self.shard_rows().div_ceil(self.batch_size)
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next epoch's batches, each `Vec<Tensor>` in the order of the tensors.
    pub fn epoch(&mut self) -> impl Iterator<Item = Result<Vec<Tensor>>> + '_ {
        let order = self.shard_of(self.order(self.epoch));
        self.epoch += 1;
        let (b, n) = (self.batch_size, self.len());
        (0..n).map(move |k| self.gather(&order[k * b..((k + 1) * b).min(order.len())]))
    }

    /// Epoch `epoch`'s order of the rows: Fisher-Yates from the seed and the epoch, or 0, 1, ...
    fn order(&self, epoch: u64) -> Vec<i64> {
        let mut order: Vec<i64> = (0..self.rows() as i64).collect();
        if let Some(seed) = self.shuffle {
            let mut rng = SplitMix64::new(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
        }
        order
    }

    /// This rank's rows of an epoch's `order` (all of it without `distributed`).
    fn shard_of(&self, order: Vec<i64>) -> Vec<i64> {
        let (rank, world) = self.shard;
        if world == 1 {
            return order;
        }
        let padded = order.iter().cycle().take(self.shard_rows() * world);
        padded.skip(rank).step_by(world).copied().collect()
    }

    fn gather(&self, rows: &[i64]) -> Result<Vec<Tensor>> {
        let device = self.tensors[0].device();
        let idx = Tensor::from_vec(rows.to_vec(), &[rows.len()], Device::Cpu)?.to_device(device)?;
        self.tensors
            .iter()
            .map(|t| {
                let batch = t.index_select(0usize, &idx)?;
                match self.device {
                    Some(d) => batch.to_device(d),
                    None => Ok(batch),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_tensor::DType;

    fn rows_of(t: &Tensor) -> Vec<i64> {
        t.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap()
    }

    #[test]
    fn an_epoch_covers_every_row_once_in_batches() -> Result<()> {
        let x = Tensor::from_vec((0..10).map(|i| i as f32).collect(), &[5, 2], Device::Cpu)?;
        let y = Tensor::from_vec((0..5i64).collect(), &[5], Device::Cpu)?;
        let mut dl = DataLoader::new(vec![x, y], 2)?;
        let batches: Vec<Vec<Tensor>> = dl.epoch().collect::<Result<_>>()?;
        assert_eq!(batches.iter().map(|b| b[1].shape()[0]).collect::<Vec<_>>(), [2, 2, 1], "in order, a short last batch");
        assert_eq!(rows_of(&batches[1][0]), [4, 5, 6, 7], "rows 2 and 3 of x");
        assert_eq!(rows_of(&batches[2][1]), [4]);

        let mut dl = DataLoader::new(dl.tensors.clone(), 2)?.shuffle(7).drop_last(true);
        assert_eq!(dl.len(), 2);
        let seen = |dl: &mut DataLoader| -> Result<Vec<i64>> {
            let mut all = Vec::new();
            for b in dl.epoch() {
                let b = b?;
                // Features and labels stay paired: x's first column is twice the label.
                let (x, y) = (rows_of(&b[0]), rows_of(&b[1]));
                assert!(y.iter().zip(x.chunks(2)).all(|(l, r)| r[0] == 2 * l), "{x:?} {y:?}");
                all.extend(y);
            }
            Ok(all)
        };
        let (e1, e2) = (seen(&mut dl)?, seen(&mut dl)?);
        assert_eq!((e1.len(), e2.len()), (4, 4), "drop_last leaves the fifth row out");
        assert_ne!(e1, e2, "each epoch its own order");
        let mut again = DataLoader::new(dl.tensors.clone(), 2)?.shuffle(7).drop_last(true);
        assert_eq!(seen(&mut again)?, e1, "the same seed, the same first epoch");
        let mut all = seen(&mut DataLoader::new(dl.tensors.clone(), 2)?.shuffle(3))?;
        all.sort_unstable();
        assert_eq!(all, [0, 1, 2, 3, 4], "a shuffled epoch holds every row once");
        Ok(())
    }

    #[test]
    fn mismatched_rows_and_a_zero_batch_are_errors() {
        let (a, b) = (Tensor::zeros(&[4, 2], DType::F32, Device::Cpu).unwrap(), Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap());
        let e = DataLoader::new(vec![a.clone(), b], 2).err().unwrap().to_string();
        assert!(e.contains("[4, 2]") && e.contains("[3]"), "{e}");
        assert!(DataLoader::new(vec![a], 0).is_err());
        assert!(DataLoader::new(vec![], 2).is_err());
    }

    #[test]
    fn distributed_ranks_share_an_epoch_and_together_see_every_row() -> Result<()> {
        let t = Tensor::arange(5, DType::F32, Device::Cpu)?;
        let shares: Vec<Vec<i64>> = (0..2)
            .map(|r| {
                let mut dl = DataLoader::new(vec![t.clone()], 2)?.shuffle(9).distributed(r, 2)?;
                assert_eq!(dl.len(), 2, "3 rows each (5 padded to 6), in batches of 2");
                let mut seen = Vec::new();
                for b in dl.epoch() {
                    seen.extend(rows_of(&b?[0]));
                }
                Ok(seen)
            })
            .collect::<Result<_>>()?;
        let order = DataLoader::new(vec![t.clone()], 2)?.shuffle(9).order(0);
        // Rank 0 takes positions 0, 2, 4 of the order, rank 1 positions 1, 3 and 0 (the pad).
        assert_eq!(shares[0], vec![order[0], order[2], order[4]]);
        assert_eq!(shares[1], vec![order[1], order[3], order[0]]);
        assert!(DataLoader::new(vec![t], 2)?.distributed(2, 2).is_err());
        Ok(())
    }
}
