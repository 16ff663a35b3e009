//! Walking strided (non-contiguous, broadcast) layouts in row-major order, in runs along the
//! innermost dim so kernels keep tight inner loops.

/// The shape of an op's output with each input's strides over it (0 on broadcast dims),
/// after dropping size-1 dims and merging dims that are contiguous in every input.
pub struct Strided<const N: usize> {
    shape: Vec<usize>,
    strides: [Vec<usize>; N],
    offsets: [usize; N],
}

impl<const N: usize> Strided<N> {
    pub fn new(shape: &[usize], strides: [&[usize]; N], offsets: [usize; N]) -> Self {
        let mut sh: Vec<usize> = Vec::with_capacity(shape.len());
        let mut st: [Vec<usize>; N] = std::array::from_fn(|_| Vec::with_capacity(shape.len()));
        for (d, &size) in shape.iter().enumerate() {
            if size == 1 {
                continue;
            }
            let mergeable = !sh.is_empty() && (0..N).all(|k| st[k].last() == Some(&(strides[k][d] * size)));
            if mergeable {
                *sh.last_mut().unwrap_or(&mut 0) *= size;
                for k in 0..N {
                    if let Some(s) = st[k].last_mut() {
                        *s = strides[k][d];
                    }
                }
            } else {
                sh.push(size);
                for k in 0..N {
                    st[k].push(strides[k][d]);
                }
            }
        }
        if sh.is_empty() {
            sh.push(1);
            for s in st.iter_mut() {
                s.push(0);
            }
        }
        Strided { shape: sh, strides: st, offsets }
    }

    /// The merged shape and each input's strides over it.
    pub fn merged(&self) -> (&[usize], &[Vec<usize>; N]) {
        (&self.shape, &self.strides)
    }

    /// The length of a run: the innermost merged dim.
    pub fn inner_len(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    /// Strides of the innermost (merged) dim, per input.
    pub fn inner_strides(&self) -> [usize; N] {
        std::array::from_fn(|k| *self.strides[k].last().unwrap_or(&0))
    }

    /// Calls `f(pos, offsets, len)` for consecutive runs covering linear positions
    /// `start..end`; within a run input k advances by `inner_strides()[k]`.
    pub fn runs(&self, start: usize, end: usize, mut f: impl FnMut(usize, [usize; N], usize)) {
        if start >= end {
            return;
        }
        let rank = self.shape.len();
        if rank == 1 {
            // One merged dim: a single run, no index to keep (reductions call this once per
            // output element, where the set-up below would cost more than a short run).
            f(start, std::array::from_fn(|k| self.offsets[k] + start * self.strides[k][0]), end - start);
            return;
        }
        let last = self.shape[rank - 1];
        // On the stack for the usual ranks: reductions call this once per output element.
        let (mut small, mut big) = ([0usize; 8], Vec::new());
        let idx: &mut [usize] = if rank <= small.len() {
            &mut small[..rank]
        } else {
            big.resize(rank, 0);
            &mut big
        };
        let mut rem = start;
        for d in (0..rank).rev() {
            idx[d] = rem % self.shape[d];
            rem /= self.shape[d];
        }
        let mut offs = self.offsets;
        for (k, off) in offs.iter_mut().enumerate() {
            *off += idx.iter().zip(&self.strides[k]).map(|(i, s)| i * s).sum::<usize>();
        }
        let mut pos = start;
        while pos < end {
            let run = (last - idx[rank - 1]).min(end - pos);
            f(pos, offs, run);
            pos += run;
            idx[rank - 1] += run;
            for (k, off) in offs.iter_mut().enumerate() {
                *off += run * self.strides[k][rank - 1];
            }
            let mut d = rank - 1;
            while d > 0 && idx[d] == self.shape[d] {
                for (k, off) in offs.iter_mut().enumerate() {
                    *off = *off - self.shape[d] * self.strides[k][d] + self.strides[k][d - 1];
                }
                idx[d] = 0;
                d -= 1;
                idx[d] += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_visit_a_transposed_layout_in_row_major_order() {
        // A [2, 3] view of a [3, 2] buffer (strides [1, 2]).
        let s = Strided::new(&[2, 3], [&[1, 2]], [0]);
        let mut seen = vec![];
        s.runs(0, 6, |pos, [o], len| {
            for j in 0..len {
                seen.push((pos + j, o + j * s.inner_strides()[0]));
            }
        });
        assert_eq!(seen, vec![(0, 0), (1, 2), (2, 4), (3, 1), (4, 3), (5, 5)]);
        // Starting mid-way gives the same tail.
        let mut tail = vec![];
        s.runs(4, 6, |pos, [o], len| {
            for j in 0..len {
                tail.push((pos + j, o + j * 2));
            }
        });
        assert_eq!(tail, vec![(4, 3), (5, 5)]);
    }

    #[test]
    fn contiguous_dims_merge_into_one_run() {
        let s = Strided::new(&[4, 5, 6], [&[30, 6, 1], &[0, 0, 1]], [0, 0]);
        let mut runs = 0;
        s.runs(0, 120, |_, _, _| runs += 1);
        assert_eq!(runs, 20); // the broadcast input stops dims 0 and 1 merging into dim 2
    }
}
