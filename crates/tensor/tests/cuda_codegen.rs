//! Every family of generated CUDA kernel compiles with NVRTC for sm_90 (built only with
//! `--features cuda`). NVRTC needs no GPU: CI installs it from pip
//! (`nvidia-cuda-nvrtc==13.0.88`) and runs this test, so a code-generation error is caught
//! before anything reaches a GPU. Without NVRTC the test fails saying so; it never passes
//! vacuously.

use kiln_tensor::codegen::elementwise_expr;
use kiln_tensor::cuda::kernels::elementwise::Elementwise;
use kiln_tensor::cuda::kernels::index::Index;
use kiln_tensor::cuda::kernels::index::IndexKind;
use kiln_tensor::cuda::kernels::prelude::waiting_for_prior;
use kiln_tensor::cuda::kernels::reduce::Reduce;
use kiln_tensor::cuda::kernels::reduce::ReduceMode;
use kiln_tensor::cuda::kernels::rows::LayerNormGradsStage;
use kiln_tensor::cuda::kernels::rows::LayerNormGradsWrites;
use kiln_tensor::cuda::nvrtc;
use kiln_tensor::{BinaryOp, DType, Distribution, Op, ReduceOp, UnaryOp};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const ALL: [DType; 6] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U8];

const UNARY: [UnaryOp; 22] = UnaryOp::ALL;
const BINARY: [BinaryOp; 13] = BinaryOp::ALL;

fn need_nvrtc() {
    assert!(
        nvrtc::available(),
        "NO NVRTC: this test compiles generated kernels with libnvrtc.so.13; `pip install nvidia-cuda-nvrtc==13.0.88` and put \
         site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH"
    );
}

/// Compiles one source as `Gpu` does (each kernel waiting for the one before it first, for
/// `sm_90a` where it asks); collects failures
/// so one run reports them all.
fn check(src: &str, name: &str, failures: &mut Vec<String>) {
    let src = waiting_for_prior(src);
    if let Err(e) = nvrtc::compile(&src, name, &nvrtc::target(&src, (9, 0)), true) {
        failures.push(format!("{name}: {e}"));
    }
}

fn ew(op: &Op, ins: &[DType], out: DType, contiguous: bool, inplace: bool) -> (String, String) {
    let (prefix, expr, compute) = elementwise_expr(op, ins).expect("an elementwise op");
    let spec = Elementwise {
        expr,
        compute,
        inputs: ins.to_vec(),
        out,
        contiguous: vec![contiguous; ins.len()],
        inplace,
        vec4: contiguous,
        strided4: None,
        narrow: !inplace,
    };
    spec.source(prefix)
}

/// The four-at-a-time strided form: input 0 strided, input 1 contiguous, input 2 broadcast
/// along the innermost dim.
fn ew4(op: &Op, ins: &[DType], out: DType, inplace: bool) -> (String, String) {
    let (prefix, expr, compute) = elementwise_expr(op, ins).expect("an elementwise op");
    let k = ins.len();
    let spec = Elementwise {
        expr,
        compute,
        inputs: ins.to_vec(),
        out,
        contiguous: (0..k).map(|i| i == 1).collect(),
        inplace,
        vec4: false,
        strided4: Some((0..k).map(|i| i == 2).collect()),
        narrow: true,
    };
    spec.source(prefix)
}

#[test]
fn every_elementwise_kernel_compiles() {
    need_nvrtc();
    let mut fails = Vec::new();
    let mut count = 0;
    for &d in &FLOATS {
        for contiguous in [true, false] {
            for u in UNARY {
                let (s, n) = ew(&Op::Unary(u), &[d], d, contiguous, false);
                check(&s, &n, &mut fails);
                count += 1;
            }
        }
    }
    for &d in &ALL {
        for b in BINARY {
            let out = if b.is_comparison() { DType::U8 } else { d };
            let (s, n) = ew4(&Op::Binary(b), &[d, d], out, false);
            check(&s, &n, &mut fails);
            count += 1;
            for contiguous in [true, false] {
                let (s, n) = ew(&Op::Binary(b), &[d, d], out, contiguous, false);
                check(&s, &n, &mut fails);
                let (s, n) = ew(&Op::Scalar { op: b, value: 2.0, scalar_lhs: !contiguous }, &[d], out, contiguous, false);
                check(&s, &n, &mut fails);
                count += 2;
                if !b.is_comparison() {
                    let (s, n) = ew(&Op::UpdateBinary(b), &[d, d], d, contiguous, true);
                    check(&s, &n, &mut fails);
                    let (s, n) = ew(&Op::UpdateScalar(b, 0.5), &[d], d, contiguous, true);
                    check(&s, &n, &mut fails);
                    count += 2;
                }
            }
        }
        for u in [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Square, UnaryOp::Sign, UnaryOp::Relu] {
            let (s, n) = ew(&Op::Unary(u), &[DType::I64], DType::I64, true, false);
            check(&s, &n, &mut fails);
            count += 1;
        }
        for &to in &ALL {
            let (s, n) = ew(&Op::Cast(to), &[d], to, false, false);
            check(&s, &n, &mut fails);
            let (s, n) = ew(&Op::Where, &[d, to, to], to, true, false);
            check(&s, &n, &mut fails);
            count += 2;
        }
        let (s, n) = ew4(&Op::Assign, &[d, d], d, true);
        check(&s, &n, &mut fails);
        let (s, n) = ew4(&Op::Where, &[DType::U8, d, d], d, false);
        check(&s, &n, &mut fails);
        count += 2;
        let (s, n) = ew(&Op::Assign, &[d, d], d, false, true);
        check(&s, &n, &mut fails);
        for src in [
            Op::Full { shape: vec![2], value: 1.0, dtype: d },
            Op::Arange { n: 2, dtype: d },
            Op::Rand { shape: vec![2], dist: Distribution::Uniform, seed: 1, offset: 0, dtype: d },
            Op::Rand { shape: vec![2], dist: Distribution::Normal, seed: 1, offset: 0, dtype: d },
        ] {
            let (s, n) = ew(&src, &[], d, true, false);
            check(&s, &n, &mut fails);
            count += 1;
        }
    }
    // Before sm_80 the prelude rounds to BF16 in integer steps (`f2b`'s other branch): the
    // casts into BF16 for a Turing GPU (sm_75, the oldest CUDA 13 compiles for).
    for &d in &FLOATS {
        let (s, n) = ew(&Op::Cast(DType::BF16), &[d], DType::BF16, true, false);
        if let Err(e) = nvrtc::compile(&waiting_for_prior(&s), &n, "sm_75", true) {
            fails.push(format!("{n} for sm_75: {e}"));
        }
        count += 1;
    }
    assert!(fails.is_empty(), "{} of {count} kernels failed:\n{}", fails.len(), fails.join("\n\n"));
    assert!(count > 400, "{count}");
}

#[test]
fn every_reduction_and_index_kernel_compiles() {
    need_nvrtc();
    let mut fails = Vec::new();
    for &d in &ALL {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax, ReduceOp::ArgMin] {
            let out = if matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) { DType::I64 } else { d };
            for one_dim in [true, false] {
                for mode in [ReduceMode::Warp, ReduceMode::Block, ReduceMode::Column, ReduceMode::ColumnTile] {
                    let (s, n) = Reduce { op, input: d, out, one_dim, mode }.source();
                    check(&s, &n, &mut fails);
                }
            }
        }
        for (kind, rows) in [(IndexKind::Select, false), (IndexKind::Select, true), (IndexKind::Gather, false)] {
            let (s, n) = Index { kind, dtype: d, rows }.source();
            check(&s, &n, &mut fails);
        }
    }
    // A bias gradient's sums over rows: 16 or 8 bytes a lane (what `MaxAutotune` also times)
    // or one value, then the chunks added; and with a gate.
    for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for v in [1, 8 / d.size_in_bytes(), 16 / d.size_in_bytes()] {
            let (s, n) = kiln_tensor::cuda::kernels::reduce::column_sums_source(d, v, None);
            check(&s, &n, &mut fails);
            // `Fused::GatedSums`: an activation's gradient made, stored and summed.
            for gate in [UnaryOp::GeluGrad, UnaryOp::SiluGrad] {
                let (s, n) = kiln_tensor::cuda::kernels::reduce::column_sums_source(d, v, Some(gate));
                check(&s, &n, &mut fails);
            }
        }
        let (s, n) = kiln_tensor::cuda::kernels::reduce::column_sums_fold_source(d);
        check(&s, &n, &mut fails);
    }
    for d in ALL {
        for descending in [false, true] {
            let (s, n) = kiln_tensor::cuda::kernels::index::argsort_source(d, descending);
            check(&s, &n, &mut fails);
        }
    }
    for d in FLOATS {
        for (log, block) in [(false, false), (true, false), (false, true), (true, true)] {
            for causal in [false, true] {
                let (s, n) = kiln_tensor::cuda::kernels::rows::softmax_source(d, log, block, causal);
                check(&s, &n, &mut fails);
            }
            use kiln_tensor::cuda::kernels::rows::{normalize_source, NormKernel};
            for (affine, rms) in [(false, false), (true, false), (false, true), (true, true)] {
                let (s, n) = normalize_source(NormKernel { dtype: d, backward: log, affine, rms }, block, d);
                check(&s, &n, &mut fails);
            }
            // The forward writing a folded cast's dtype.
            let (s, n) = normalize_source(NormKernel { dtype: d, backward: false, affine: true, rms: false }, block, DType::BF16);
            check(&s, &n, &mut fails);
            let (s, n) = kiln_tensor::cuda::kernels::rows::softmax_backward_source(d, log, block);
            check(&s, &n, &mut fails);
            let (s, n) = kiln_tensor::cuda::kernels::rows::cross_entropy_source(d, log, block);
            check(&s, &n, &mut fails);
        }
        for n in [1, 10, kiln_tensor::cuda::kernels::products::NARROW_MAX_N] {
            let (s, name) = kiln_tensor::cuda::kernels::products::matmul_narrow_source(d, n);
            check(&s, &name, &mut fails);
        }
        if d == DType::F32 {
            let (s, name) = kiln_tensor::cuda::kernels::products::matmul_few_source();
            check(&s, &name, &mut fails);
        }
        for (m, sums) in [(1, false), (10, true), (kiln_tensor::cuda::kernels::products::SHORT_MAX_M, false)] {
            let (s, name) = kiln_tensor::cuda::kernels::products::matmul_short_source(d, m, sums);
            check(&s, &name, &mut fails);
        }
        for (k, drelu, vec4) in
            [(1, false, false), (10, true, true), (kiln_tensor::cuda::kernels::products::THIN_MAX_K, true, false), (3, false, true)]
        {
            let (s, name) = kiln_tensor::cuda::kernels::products::matmul_thin_source(d, k, drelu, vec4, k == 10);
            check(&s, &name, &mut fails);
        }
        for tpr in [1, 4, 32] {
            let grad_at = kiln_tensor::op::Parts::cross_entropy_mean(8, 10).offset(kiln_tensor::op::Part::Dx).unwrap();
            let (s, n) = kiln_tensor::cuda::kernels::rows::cross_entropy_mean_source(d, tpr, grad_at);
            check(&s, &n, &mut fails);
        }
        if d == DType::F32 {
            for cluster in [false, true] {
                let (s, n) = kiln_tensor::cuda::kernels::products::linear_xent_source(d, cluster);
                check(&s, &n, &mut fails);
            }
        }
        for ams in [false, true] {
            let (s, n) = kiln_tensor::cuda::kernels::adam::adam_source(d, ams);
            check(&s, &n, &mut fails);
        }
        // Without dx, with it, with dx plus a residual gradient, and with the sums row (in
        // BF16 and in x's dtype).
        for (tiles, (dx, resid, sums, copy)) in [
            (1, (false, false, None, None)),
            (12, (false, false, None, None)),
            (32, (false, false, None, None)),
            (1, (true, false, None, None)),
            (12, (true, true, None, None)),
            (32, (true, false, None, None)),
            (12, (true, true, Some(DType::BF16), None)),
            (32, (true, false, Some(d), None)),
            (12, (true, true, Some(DType::BF16), Some(DType::BF16))),
            (12, (true, false, None, Some(DType::F16))),
        ] {
            let parts = LayerNormGradsWrites { dx, resid, sums, copy };
            let (s, n) = kiln_tensor::cuda::kernels::rows::layer_norm_grads_source(d, tiles, parts, d, LayerNormGradsStage::Off);
            check(&s, &n, &mut fails);
        }
        // g in BF16 (a product's gradient under autocast) for an F32 layer norm.
        // And staged through shared memory (r's rows too), with and without dx, g in F32 and BF16.
        let (off, rows, with_r) = (LayerNormGradsStage::Off, LayerNormGradsStage::Rows, LayerNormGradsStage::RowsAndResidual);
        for ((dx, resid, sums, copy), gdt, staged) in [
            ((true, false, None, None), DType::BF16, off),
            ((true, false, None, None), DType::BF16, rows),
            ((true, true, None, None), DType::BF16, rows),
            ((true, true, None, None), DType::BF16, with_r),
            ((false, false, None, None), DType::F32, rows),
            ((true, false, None, None), DType::F32, rows),
            ((true, true, Some(DType::BF16), None), DType::BF16, with_r),
            ((true, true, Some(DType::F32), None), DType::F32, rows),
            ((true, true, Some(DType::F32), None), DType::F32, with_r),
            ((true, true, Some(DType::BF16), Some(DType::BF16)), DType::BF16, rows),
            ((true, true, Some(DType::BF16), Some(DType::BF16)), DType::BF16, with_r),
        ] {
            let parts = LayerNormGradsWrites { dx, resid, sums, copy };
            let (s, n) = kiln_tensor::cuda::kernels::rows::layer_norm_grads_source(DType::F32, 12, parts, gdt, staged);
            check(&s, &n, &mut fails);
        }
    }
    use kiln_tensor::cuda::kernels::attention::flash_source;
    use kiln_tensor::cuda::kernels::attention::tiled_source;
    use kiln_tensor::cuda::kernels::attention::AttnKernel;
    for kind in [AttnKernel::Fwd, AttnKernel::Dq, AttnKernel::Dkv] {
        for d in [DType::F32, DType::F16, DType::BF16] {
            // 48: a row's 16-byte pieces do not divide the block (the tile loader's general loop).
            for (hd, causal) in [(64, true), (32, false), (128, true), (48, false)] {
                let (s, n) = flash_source(kind, d, hd, causal);
                check(&s, &n, &mut fails);
            }
        }
        for d in [DType::F32, DType::F16, DType::BF16] {
            for (hd, causal) in [(64, true), (24, false), (128, true)] {
                let (s, n) = tiled_source(kind, d, hd, causal);
                check(&s, &n, &mut fails);
            }
        }
    }
    for d in [DType::F32, DType::F64] {
        for (kind, rows) in [(IndexKind::Add, true), (IndexKind::ScatterAdd, false)] {
            let (s, n) = Index { kind, dtype: d, rows }.source();
            check(&s, &n, &mut fails);
        }
    }
    assert!(fails.is_empty(), "{} kernels failed:\n{}", fails.len(), fails.join("\n\n"));
}

/// A compiled graph's fused kernels: one module whose kernels chain every unary, binary and
/// scalar op, a comparison feeding a `where`, casts between f32 and f64, and inputs read
/// contiguously, at an offset, through strides and broadcast; a group over dense inputs takes the
/// vector path (eight elements a thread where every input is 16-bit); one kernel runs them all.
#[test]
fn a_module_of_fused_group_kernels_compiles() {
    use kiln_tensor::cuda::kernels::fused::fused_module;
    use kiln_tensor::cuda::kernels::fused::FusedGroup;
    use kiln_tensor::cuda::kernels::fused::FusedInput;
    use kiln_tensor::cuda::kernels::fused::FusedKernel;
    use kiln_tensor::cuda::kernels::fused::FusedMember;
    use kiln_tensor::cuda::kernels::fused::FusedSrc;
    need_nvrtc();
    let shape = vec![4usize, 6];
    let inputs = |d: DType| {
        vec![
            FusedInput { dtype: d, offset: 0, strided: None, lead: None, fed: None },
            FusedInput { dtype: d, offset: 3, strided: None, lead: None, fed: None },
            FusedInput { dtype: d, offset: 1, strided: Some((shape.clone(), vec![1, 4])), lead: None, fed: None },
            FusedInput { dtype: d, offset: 0, strided: Some((shape.clone(), vec![0, 1])), lead: None, fed: None },
        ]
    };
    let mut groups = Vec::new();
    for d in [DType::F32, DType::F64] {
        let mut members: Vec<FusedMember> = Vec::new();
        let last = |m: &Vec<FusedMember>| if m.is_empty() { FusedSrc::Input(0) } else { FusedSrc::Member(m.len() - 1) };
        for u in UNARY {
            let a = last(&members);
            members.push(FusedMember { op: Op::Unary(u), args: vec![a], dtype: d });
        }
        for (k, b) in BINARY.into_iter().enumerate() {
            let (a, out) = (last(&members), if b.is_comparison() { DType::U8 } else { d });
            if b.is_comparison() {
                members.push(FusedMember { op: Op::Binary(b), args: vec![a, FusedSrc::Input(1 + k % 3)], dtype: out });
                let c = FusedSrc::Member(members.len() - 1);
                members.push(FusedMember { op: Op::Where, args: vec![c, FusedSrc::Input(2), FusedSrc::Input(3)], dtype: d });
            } else {
                members.push(FusedMember { op: Op::Binary(b), args: vec![a, FusedSrc::Input(1 + k % 3)], dtype: out });
                let a = last(&members);
                members.push(FusedMember {
                    op: Op::Scalar { op: b, value: f64::INFINITY, scalar_lhs: k % 2 == 0 },
                    args: vec![a],
                    dtype: d,
                });
            }
        }
        let other = if d == DType::F32 { DType::F64 } else { DType::F32 };
        let a = last(&members);
        members.push(FusedMember { op: Op::Cast(other), args: vec![a], dtype: other });
        let outputs = vec![members.len() - 1, members.len() - 2, 0];
        groups.push(FusedGroup { n: 24, inputs: inputs(d), members, outputs });
    }
    // The same members over dense inputs take the 4-wide vector path.
    let dense: Vec<FusedInput> =
        (0..4).map(|k| FusedInput { dtype: DType::F32, offset: 4 * k, strided: None, lead: None, fed: None }).collect();
    let vec = FusedGroup { inputs: dense, ..groups[0].clone() };
    assert!(vec.vectorised() && !groups[0].vectorised());
    groups.push(vec);
    // Rows of a wider buffer and a per-row broadcast also take it; a column broadcast does not.
    let rows_and_splat = vec![
        FusedInput { dtype: DType::F32, offset: 0, strided: None, lead: None, fed: None },
        FusedInput { dtype: DType::F32, offset: 8, strided: Some((vec![3, 8], vec![12, 1])), lead: None, fed: None },
        FusedInput { dtype: DType::F32, offset: 0, strided: Some((vec![3, 8], vec![1, 0])), lead: None, fed: None },
        FusedInput { dtype: DType::F32, offset: 0, strided: Some((vec![3, 8], vec![0, 1])), lead: None, fed: None },
    ];
    let mixed = FusedGroup { inputs: rows_and_splat.clone(), ..groups[0].clone() };
    assert!(mixed.vectorised());
    let mut columns = rows_and_splat;
    columns[1].strided = Some((vec![3, 8], vec![1, 3]));
    assert!(!FusedGroup { inputs: columns, ..groups[0].clone() }.vectorised());
    groups.push(mixed);
    // A group whose loaded inputs are all 16-bit takes eight elements a thread (16-byte loads),
    // its F32 output stored eight at a time too; a row of 12 or an F32 input keeps four.
    let bf = |offset: usize, strided: Option<(Vec<usize>, Vec<usize>)>, dtype: DType| FusedInput {
        dtype,
        offset,
        strided,
        lead: None,
        fed: None,
    };
    let grad = |cols: usize, g: DType| FusedGroup {
        n: 3 * cols,
        inputs: vec![
            bf(8, None, DType::BF16),
            bf(0, Some((vec![3, cols], vec![2 * cols, 1])), g),
            bf(0, Some((vec![3, cols], vec![0, 1])), DType::BF16),
        ],
        members: vec![
            FusedMember { op: Op::Binary(BinaryOp::Add), args: vec![FusedSrc::Input(0), FusedSrc::Input(2)], dtype: DType::BF16 },
            FusedMember { op: Op::Unary(UnaryOp::GeluGrad), args: vec![FusedSrc::Member(0)], dtype: DType::BF16 },
            FusedMember { op: Op::Binary(BinaryOp::Mul), args: vec![FusedSrc::Member(1), FusedSrc::Input(1)], dtype: DType::BF16 },
            FusedMember { op: Op::Cast(DType::F32), args: vec![FusedSrc::Member(2)], dtype: DType::F32 },
        ],
        outputs: vec![2, 3],
    };
    let (wide, twelve, with_f32) = (grad(16, DType::BF16), grad(12, DType::BF16), grad(16, DType::F32));
    assert_eq!((wide.width(), twelve.width(), with_f32.width()), (8, 4, 4));
    assert_eq!(wide.blocks(), 1);
    groups.extend([wide, twelve]);
    // One kernel per group, and one running them side by side.
    let mut kernels: Vec<FusedKernel> = groups
        .iter()
        .enumerate()
        .map(|(k, g)| FusedKernel { name: format!("kiln_group{k}"), groups: vec![g.clone()], lead: false, copies: 0, generic: false })
        .collect();
    kernels.push(FusedKernel { name: "kiln_groups_side_by_side".into(), groups, lead: false, copies: 0, generic: false });
    let src = fused_module(&kernels).expect("every member is elementwise");
    let mut fails = Vec::new();
    check(&src, "kiln_fused", &mut fails);
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// A group ending in sums, then scalar members on them (a mean loss: per-row losses summed,
/// real targets counted, the division and the gradient's scale), alone and beside a plain
/// group in one kernel.
#[test]
fn a_group_folding_its_sums_in_one_block_compiles() {
    use kiln_tensor::cuda::kernels::fused::fused_module;
    use kiln_tensor::cuda::kernels::fused::FusedGroup;
    use kiln_tensor::cuda::kernels::fused::FusedInput;
    use kiln_tensor::cuda::kernels::fused::FusedKernel;
    use kiln_tensor::cuda::kernels::fused::FusedMember;
    use kiln_tensor::cuda::kernels::fused::FusedSrc;
    need_nvrtc();
    let n = 300;
    let inputs = vec![
        FusedInput { dtype: DType::F32, offset: 0, strided: None, lead: None, fed: None },
        FusedInput { dtype: DType::I64, offset: 0, strided: None, lead: None, fed: None },
        FusedInput { dtype: DType::F32, offset: 2, strided: Some((vec![n], vec![0])), lead: None, fed: None },
    ];
    let sum = Op::Reduce { op: ReduceOp::Sum, dims: vec![0], keepdim: false };
    let m = |op: Op, args: Vec<FusedSrc>, dtype: DType| FusedMember { op, args, dtype };
    let members = vec![
        m(Op::Scalar { op: BinaryOp::Ne, value: -100.0, scalar_lhs: false }, vec![FusedSrc::Input(1)], DType::U8),
        m(Op::Cast(DType::F32), vec![FusedSrc::Member(0)], DType::F32),
        m(sum.clone(), vec![FusedSrc::Member(1)], DType::F32),
        m(sum, vec![FusedSrc::Input(0)], DType::F32),
        m(Op::Binary(BinaryOp::Div), vec![FusedSrc::Member(3), FusedSrc::Member(2)], DType::F32),
        m(Op::Binary(BinaryOp::Mul), vec![FusedSrc::Member(4), FusedSrc::Input(2)], DType::F32),
        m(Op::Cast(DType::F64), vec![FusedSrc::Member(5)], DType::F64),
    ];
    let fold = FusedGroup { n, inputs, members, outputs: vec![6, 1, 2] };
    assert!(fold.folds() && !fold.vectorised() && fold.blocks() == 1);
    assert_eq!(fold.output_lens(), vec![1, n, 1]);
    let plain = FusedGroup {
        n: 64,
        inputs: vec![FusedInput { dtype: DType::F32, offset: 0, strided: None, lead: None, fed: None }],
        members: vec![m(Op::Unary(UnaryOp::Exp), vec![FusedSrc::Input(0)], DType::F32)],
        outputs: vec![0],
    };
    let kernels = vec![
        FusedKernel { name: "kiln_fold".into(), groups: vec![fold.clone()], lead: false, copies: 0, generic: false },
        FusedKernel { name: "kiln_fold_and_plain".into(), groups: vec![plain, fold], lead: false, copies: 0, generic: false },
    ];
    let src = fused_module(&kernels).expect("sums and elementwise members");
    // A member after the fold may not read a value of the loop other than a sum.
    let mut bad = kernels[0].clone();
    bad.groups[0].members[5].args[1] = FusedSrc::Member(1);
    assert!(fused_module(&[bad]).is_err_and(|e| e.contains("member 5")));
    assert!(src.contains("kiln_block_sum(r2)") && src.contains("kiln_block_sum(r3)"), "{src}");
    let mut fails = Vec::new();
    check(&src, "kiln_fold", &mut fails);
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// A kernel led by a scalar group (AdamW's step count and bias correction): every thread
/// computes the lead's values, a vector group, a strided group and a folding group read them
/// from registers, and the last block stores them (the step count in place) after a ticket.
#[test]
fn a_kernel_led_by_a_scalar_group_compiles() {
    use kiln_tensor::cuda::kernels::fused::fused_module;
    use kiln_tensor::cuda::kernels::fused::Fed;
    use kiln_tensor::cuda::kernels::fused::FusedGroup;
    use kiln_tensor::cuda::kernels::fused::FusedInput;
    use kiln_tensor::cuda::kernels::fused::FusedKernel;
    use kiln_tensor::cuda::kernels::fused::FusedMember;
    use kiln_tensor::cuda::kernels::fused::FusedSrc;
    need_nvrtc();
    let m = |op: Op, args: Vec<FusedSrc>, dtype: DType| FusedMember { op, args, dtype };
    let dense = |dtype: DType| FusedInput { dtype, offset: 0, strided: None, lead: None, fed: None };
    // step + 1 (F64, written back), then 1 - 0.9^t as F32.
    let lead = FusedGroup {
        n: 1,
        inputs: vec![dense(DType::F64)],
        members: vec![
            m(Op::Scalar { op: BinaryOp::Add, value: 1.0, scalar_lhs: false }, vec![FusedSrc::Input(0)], DType::F64),
            m(Op::Cast(DType::F32), vec![FusedSrc::Member(0)], DType::F32),
            m(Op::Scalar { op: BinaryOp::Pow, value: 0.9, scalar_lhs: true }, vec![FusedSrc::Member(1)], DType::F32),
            m(Op::Scalar { op: BinaryOp::Sub, value: 1.0, scalar_lhs: true }, vec![FusedSrc::Member(2)], DType::F32),
        ],
        outputs: vec![0, 3],
    };
    let corr = |n: usize| FusedInput { dtype: DType::F32, offset: 0, strided: Some((vec![n], vec![0])), lead: Some(1), fed: None };
    let divide = vec![m(Op::Binary(BinaryOp::Div), vec![FusedSrc::Input(0), FusedSrc::Input(1)], DType::F32)];
    let vector = FusedGroup { n: 4096, inputs: vec![dense(DType::F32), corr(4096)], members: divide.clone(), outputs: vec![0] };
    let strided = FusedGroup { n: 10, inputs: vec![dense(DType::F32), corr(10)], members: divide.clone(), outputs: vec![0] };
    let mut folded = divide;
    folded.push(m(Op::Reduce { op: ReduceOp::Sum, dims: vec![0], keepdim: false }, vec![FusedSrc::Member(0)], DType::F32));
    folded.push(m(Op::Binary(BinaryOp::Mul), vec![FusedSrc::Member(1), FusedSrc::Input(1)], DType::F32));
    let fold = FusedGroup { n: 300, inputs: vec![dense(DType::F32), corr(300)], members: folded, outputs: vec![2] };
    assert!(vector.vectorised() && !strided.vectorised() && fold.folds());
    let k = FusedKernel {
        name: "kiln_led".into(),
        groups: vec![lead, vector.clone(), strided.clone(), fold.clone()],
        lead: true,
        copies: 0,
        generic: false,
    };
    // The lead gets no blocks: 4096 / 4 / 256 for the vector group, one each for the others.
    assert_eq!(k.blocks(), 4 + 1 + 1);
    let src = fused_module(std::slice::from_ref(&k)).expect("a plain scalar lead");
    let body = &src[src.find("kiln_led(").expect("the kernel")..];
    // Readers take the lead's values from registers, not from the buffers passed for them.
    for (needle, count) in [
        ("unsigned int* kiln_ticket)", 1),
        ("atomicAdd(kiln_ticket, 1u) == gridDim.x - 1", 1),
        ("o0_0[0] = L0;", 1),
        ("o0_1[0] = L1;", 1),
        ("= ld(L1)", 4),
    ] {
        assert_eq!(body.matches(needle).count(), count, "{needle} in {body}");
    }
    for unread in ["p1_1", "p2_1", "p3_1"] {
        assert_eq!(body.matches(unread).count(), 1, "{unread} only in the signature: {body}");
    }
    // A lead that folds sums or reads another lead is refused.
    let bad = FusedKernel { groups: vec![fold, vector.clone()], ..k.clone() };
    assert!(fused_module(&[bad]).is_err_and(|e| e.contains("lead group")));
    // The last block may also copy a step's outputs: after the lead's stores, or alone.
    let led_copying = FusedKernel { name: "kiln_led_copying".into(), copies: 2, ..k.clone() };
    let plain = FusedGroup { inputs: vec![dense(DType::F32), dense(DType::F32)], ..vector.clone() };
    let copying = FusedKernel { name: "kiln_copying".into(), groups: vec![plain], lead: false, copies: 1, generic: false };
    assert!(copying.ticket() && !FusedKernel { copies: 0, ..copying.clone() }.ticket());
    let src2 = fused_module(&[led_copying, copying]).expect("kernels with output copies");
    let led = &src2[src2.find("kiln_led_copying(").expect("the led kernel")..src2.find("kiln_copying(").expect("the other")];
    let alone = &src2[src2.find("kiln_copying(").expect("the kernel")..];
    for (body, copies, stores) in [(led, 2, 1), (alone, 1, 0)] {
        for (needle, count) in [
            ("unsigned char* c0d, unsigned long long c0n", 1),
            ("unsigned char* c1d, unsigned long long c1n", copies - 1),
            ("unsigned int* kiln_ticket)", 1),
            ("atomicAdd(kiln_ticket, 1u) == gridDim.x - 1", 1),
            ("kiln_copy_out(c0s, c0d, c0n);", 1),
            ("kiln_copy_out(c1s, c1d, c1n);", copies - 1),
            ("o0_1[0] = L1;", stores),
        ] {
            assert_eq!(body.matches(needle).count(), count, "{needle} in {body}");
        }
    }
    let mut fails = Vec::new();
    check(&src, "kiln_led", &mut fails);
    check(&src2, "kiln_led_copying", &mut fails);
    // Generic (a dynamic-shape program's): the same source at another size of every group,
    // the sizes and scalars passed after the ticket.
    let resized = |g: &FusedGroup, n: usize| FusedGroup {
        n,
        inputs: g.inputs.iter().map(|x| FusedInput { strided: x.strided.as_ref().map(|_| (vec![n], vec![0])), ..x.clone() }).collect(),
        ..g.clone()
    };
    let generic = |scale: usize| FusedKernel {
        name: "kiln_generic".into(),
        groups: vec![
            k.groups[0].clone(),
            resized(&vector, 4096 * scale),
            resized(&strided, 10 * scale),
            resized(&k.groups[3], 300 * scale),
        ],
        generic: true,
        ..k.clone()
    };
    let (small, large) = (generic(1).source_and_numbers().expect("generic"), generic(3).source_and_numbers().expect("generic"));
    assert_eq!(small.0, large.0, "one source for every size");
    assert_ne!(small.1.ints, large.1.ints);
    assert_eq!(small.1.floats, vec![1.0, 0.9, 1.0], "the lead's scalars");
    assert!(small.0.contains("unsigned int* kiln_ticket, const long long z0") && !small.0.contains("4096"), "{}", small.0);
    check(&fused_module(&[generic(2)]).expect("a generic kernel"), "kiln_generic", &mut fails);
    let fed = FusedGroup {
        inputs: vec![FusedInput { fed: Some(Fed { k: 4, cols: 4, a: [4, 1], b: None }), ..dense(DType::F32) }],
        ..vector.clone()
    };
    assert!(FusedKernel { groups: vec![fed], lead: false, ..generic(1) }.source().is_err_and(|e| e.contains("cannot feed")));
    // The output-copy node's kernel shares the fused kernels' copy.
    let (copy, name) = kiln_tensor::cuda::kernels::fused::copy_out_source();
    check(&copy, &name, &mut fails);
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// Kiln's Hopper F32 GEMM in its four layouts with each epilogue the back end asks for, with
/// and without A's row map.
#[test]
fn every_hopper_gemm_variant_compiles() {
    use kiln_tensor::cuda::kernels::wgmma::Spec;
    need_nvrtc();
    let mut fails = Vec::new();
    let epilogues = [
        (false, false, None, None),
        (true, false, Some(UnaryOp::Relu), None),
        (true, true, Some(UnaryOp::GeluTanh), None),
        (false, true, Some(UnaryOp::GeluTanh), None),
        (false, false, None, Some(UnaryOp::GeluTanhGrad)),
        (false, false, None, Some(UnaryOp::Step)),
    ];
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for (bias, keep, act, dact) in epilogues {
            // The row map only where A is K-contiguous (`blas::mapped_rows`).
            for map_a in if ta { vec![false] } else { vec![false, true] } {
                let (s, n) = Spec { ta, tb, bias, keep, act, dact, residual: false, map_a }.source();
                check(&s, &n, &mut fails);
            }
        }
        // A residual connection's add, with and without a bias.
        for bias in [false, true] {
            let (s, n) = Spec { ta, tb, bias, keep: false, act: None, dact: None, residual: true, map_a: !ta }.source();
            check(&s, &n, &mut fails);
        }
    }
    assert!(fails.is_empty(), "{} kernels failed:\n{}", fails.len(), fails.join("\n\n"));
}

/// The short-sequence attention forward and the forward of unequal lengths (a query row a
/// block) for every dtype, head dims past and below a warp, causal or not.
#[test]
fn short_attention_kernels_compile() {
    need_nvrtc();
    let mut fails = Vec::new();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for (d, causal) in [(20, true), (64, false), (128, true)] {
            let (s, n) = kiln_tensor::cuda::kernels::attention::attention_short_source(dt, d, causal);
            check(&s, &n, &mut fails);
            let (s, n) = kiln_tensor::cuda::kernels::attention::attention_rows_source(dt, d, causal);
            check(&s, &n, &mut fails);
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// The register-resident layer norm forward at each row width it takes, writing F32 or a
/// folded cast's F16/BF16.
#[test]
fn layer_norm_rows_kernels_compile() {
    need_nvrtc();
    let mut fails = Vec::new();
    for tiles in 1..=kiln_tensor::cuda::kernels::rows::LN_ROWS_MAX_N / 128 {
        for (affine, out) in [(false, DType::F32), (true, DType::F32), (true, DType::BF16), (false, DType::F16)] {
            let (s, n) = kiln_tensor::cuda::kernels::rows::normalize_rows_source(tiles, affine, out);
            check(&s, &n, &mut fails);
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// `nvrtc::cubins` (kernels compiled together on threads: a fused step's modules, an
/// attention's three kernels) returns each source's CUBIN in order, the same bytes as
/// compiling them one at a time, and a failing source's error in its own place.
#[test]
fn kernels_compiled_together_come_back_in_order() {
    need_nvrtc();
    let mut jobs: Vec<(String, String)> = [1, 7, 30]
        .iter()
        .map(|&k| kiln_tensor::cuda::kernels::products::matmul_thin_source(DType::F32, k, k == 7, false, k == 30))
        .collect();
    jobs.insert(1, ("extern \"C\" __global__ void k_broken() { not_a_function(); }".to_string(), "k_broken".to_string()));
    let together = nvrtc::cubins(&jobs, (9, 0));
    assert_eq!(together.len(), 4);
    for ((src, name), got) in jobs.iter().zip(&together) {
        let alone = nvrtc::compile(src, name, "sm_90", true);
        match (got, alone) {
            (Ok(a), Ok(b)) => assert!(a == &b && !a.is_empty(), "{name}: the CUBIN differs from a lone compile"),
            (Err(e), Err(_)) => assert!(name == "k_broken" && e.to_string().contains("not_a_function"), "{name}: {e}"),
            (got, alone) => panic!("{name}: together {:?}, alone {:?}", got.is_ok(), alone.is_ok()),
        }
    }
}

#[test]
fn every_kernel_waits_for_the_one_before_it_first() {
    let src = "extern \"C\" __global__ void __launch_bounds__(128) a(float* o, Args g) {\n  int i = 0; { o[i] = 1; }\n}\n\
               __device__ float f(float x) { return x; }\n\
               extern \"C\" __global__ void b(float* o) { o[0] = f(2); }\n";
    let out = waiting_for_prior(src);
    let wait = "\n#if __CUDA_ARCH__ >= 900\n  asm volatile(\"griddepcontrol.wait;";
    assert_eq!(out.matches(wait).count(), 2, "{out}");
    // Each right after its kernel's opening brace, before the body's first statement.
    assert!(out.contains(&format!("a(float* o, Args g) {{{wait}")), "{out}");
    assert!(out.contains(&format!("b(float* o) {{{wait}")), "{out}");
    assert!(out.contains("__device__ float f(float x) { return x; }"), "{out}");
    // Nothing else changes: without the inserted lines the source is as it was.
    let (start, per) = (out.find(wait).unwrap(), (out.len() - src.len()) / 2);
    let block = &out[start..start + per];
    assert!(
        block.ends_with("#endif\n") && block.contains("#ifndef LATE_NEXT\n  asm volatile(\"griddepcontrol.launch_dependents;"),
        "{block}"
    );
    assert_eq!(out.replace(block, ""), src);
}

/// A weight's update reading its gradient `g^T x` and its bias's reading `sum(g)` as fed
/// products (`Fed`), four at a time and one at a time, F32 and F64.
#[test]
fn groups_computing_their_fed_products_compile() {
    use kiln_tensor::cuda::kernels::fused::fused_module;
    use kiln_tensor::cuda::kernels::fused::Fed;
    use kiln_tensor::cuda::kernels::fused::FusedGroup;
    use kiln_tensor::cuda::kernels::fused::FusedInput;
    use kiln_tensor::cuda::kernels::fused::FusedKernel;
    use kiln_tensor::cuda::kernels::fused::FusedMember;
    use kiln_tensor::cuda::kernels::fused::FusedSrc;
    need_nvrtc();
    let mut fails = Vec::new();
    for d in [DType::F32, DType::F64] {
        let dense = FusedInput { dtype: d, offset: 0, strided: None, lead: None, fed: None };
        // g [32, 256] read as g^T (row stride 1, k stride 256); x [32, 784] from element 8.
        let dot = |cols: usize| Fed { k: 32, cols, a: [1, 256], b: Some((8, [cols, 1])) };
        let sums = Fed { k: 32, cols: 1, a: [1, 256], b: None };
        let fed = |f: Fed, offset: usize| FusedInput { dtype: d, offset, strided: None, lead: None, fed: Some(f) };
        let sub = vec![FusedMember { op: Op::Binary(BinaryOp::Sub), args: vec![FusedSrc::Input(0), FusedSrc::Input(1)], dtype: d }];
        let group = |n: usize, x: FusedInput| FusedGroup { n, inputs: vec![dense.clone(), x], members: sub.clone(), outputs: vec![0] };
        // Four columns a thread from b's rows; the bias's sums from a's columns; and, with a
        // row of 6 columns and an odd offset, one element a thread.
        let weight = group(256 * 784, fed(dot(784), 0));
        let bias = group(256, fed(sums.clone(), 0));
        let odd = group(256 * 6, fed(Fed { b: Some((3, [6, 1])), ..dot(6) }, 0));
        let odd_sums = group(256, fed(sums, 1));
        assert!(weight.vectorised() && bias.vectorised() && !odd.vectorised() && !odd_sums.vectorised());
        let k = FusedKernel {
            name: format!("kiln_fed_{d:?}"),
            groups: vec![weight, bias, odd, odd_sums],
            lead: false,
            copies: 0,
            generic: false,
        };
        let src = fused_module(std::slice::from_ref(&k)).expect("fed products");
        let body = &src[src.find(&k.name).expect("the kernel")..];
        // b's buffer follows a's for the products, not for the sums; each fed input is made,
        // never loaded.
        for (needle, count) in [("p0_1b", 2), ("p2_1b", 2), ("p1_1b", 0), ("kiln_fed_dot<32, 4, VI1>", 1), ("kiln_fed_sum<32, 4, VI1>", 1)]
        {
            assert_eq!(body.matches(needle).count(), count, "{needle} in {body}");
        }
        assert_eq!(body.matches("kiln_fed_dot<32, 1,").count() + body.matches("kiln_fed_sum<32, 1,").count(), 2, "{body}");
        check(&src, &k.name, &mut fails);
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// The register budgets the launches count on, from ptxas's report (NVRTC, no GPU needed):
/// layer norm's backward at GPT's rows of 384 (12 tiles), in each form compile makes of it,
/// holds at most 128 registers a thread and spills nothing, so that two blocks of 256 threads
/// fit an SM; the gated column sums spill nothing.
#[test]
fn layer_norm_grads_and_gated_sums_keep_their_register_budgets() {
    need_nvrtc();
    let mut fails = Vec::new();
    let mut budget = |(src, name): (String, String), most: u32| {
        let src = waiting_for_prior(&src);
        match nvrtc::resources(&src, &name, &nvrtc::target(&src, (9, 0))) {
            Ok(r) if r.registers <= most && r.spill_bytes == 0 => println!("{name}: {r:?}"),
            Ok(r) => fails.push(format!("{name}: {r:?} (at most {most} registers, no spills)")),
            Err(e) => fails.push(format!("{name}: {e}")),
        }
    };
    let bf16 = Some(DType::BF16);
    for (gdt, sums, copy) in
        [(DType::F32, None, None), (DType::F32, Some(DType::F32), None), (DType::BF16, None, None), (DType::BF16, bf16, bf16)]
    {
        for staged in [LayerNormGradsStage::Off, LayerNormGradsStage::Rows, LayerNormGradsStage::RowsAndResidual] {
            for resid in [false, true] {
                let parts = LayerNormGradsWrites { dx: true, resid, sums, copy };
                budget(kiln_tensor::cuda::kernels::rows::layer_norm_grads_source(DType::F32, 12, parts, gdt, staged), 128);
            }
        }
    }
    for d in [DType::F32, DType::BF16] {
        for v in [1, 16 / d.size_in_bytes()] {
            budget(kiln_tensor::cuda::kernels::reduce::column_sums_source(d, v, Some(UnaryOp::GeluGrad)), 255);
        }
    }
    assert!(fails.is_empty(), "{} kernels over their budget:\n{}", fails.len(), fails.join("\n"));
}

/// The offsets and size C gives a struct of the scalar types Kiln's argument structs use
/// (`long long`, `unsigned long long`, `double`, `int`, `unsigned`, `float`, arrays of them,
/// lengths as numbers or `#define`d names), read from `text` (the defines, then the struct).
fn c_layout(text: &str) -> Result<(Vec<(String, usize)>, usize), String> {
    let defines: std::collections::HashMap<&str, usize> = text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("#define")).then(|| Some((w.next()?, w.next()?.parse().ok()?))).flatten()
        })
        .collect();
    let at_struct = text.find("struct ").ok_or("no struct")?;
    let body = text[at_struct..].split_once('{').and_then(|(_, b)| b.rsplit_once('}')).ok_or("no struct body")?.0;
    let (mut fields, mut at, mut align) = (Vec::new(), 0usize, 1usize);
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        let ty_end = ["unsigned long long", "long long", "double", "unsigned", "float", "int"]
            .iter()
            .find(|t| decl.starts_with(*t))
            .ok_or(format!("a field of unknown type: {decl}"))?;
        let size = match *ty_end {
            "int" | "unsigned" | "float" => 4,
            _ => 8,
        };
        for name in decl[ty_end.len()..].split(',').map(str::trim) {
            let (field, dims) = name.split_once('[').map_or((name, ""), |(f, d)| (f, d));
            let mut count = 1;
            for d in dims.split(['[', ']']).filter(|d| !d.trim().is_empty()) {
                count *= d.trim().parse::<usize>().ok().or_else(|| defines.get(d.trim()).copied()).ok_or(format!("array length {d}"))?;
            }
            at = at.next_multiple_of(size);
            fields.push((field.trim().to_string(), at));
            at += size * count;
            align = align.max(size);
        }
    }
    Ok((fields, at.next_multiple_of(align)))
}

/// Every `#[repr(C)]` argument struct lays out as its C twin in the generated source: the
/// same size, and each field at the same offset (the C struct laid out by C's rules from
/// the kernel source's own text).
#[test]
fn argument_structs_lay_out_as_their_c_twins() {
    let layouts = kiln_tensor::cuda::kernels::argument_layouts();
    assert!(layouts.len() >= 13, "{} argument structs", layouts.len());
    for l in &layouts {
        let (c_fields, c_size) = c_layout(&l.c_text).unwrap_or_else(|e| panic!("{} as {}: {e}\n{}", l.rust, l.c_name, l.c_text));
        assert_eq!(c_size, l.size, "{} is {} bytes, C's {} {c_size}:\n{}", l.rust, l.size, l.c_name, l.c_text);
        let names: Vec<&str> = c_fields.iter().map(|(f, _)| f.as_str()).collect();
        let paired: Vec<&str> = l.offsets.iter().map(|(f, _)| *f).collect();
        assert_eq!(names, paired, "{}: every field of C's {} paired, in order", l.rust, l.c_name);
        for ((field, c_at), (_, rust_at)) in c_fields.iter().zip(&l.offsets) {
            assert_eq!(c_at, rust_at, "{}.{field}: offset {rust_at} in Rust, {c_at} in C's {}", l.rust, l.c_name);
        }
    }
    // The reader itself: C's padding before a double after an int, and at the end.
    assert_eq!(c_layout("struct T { int a; double b; int c; };"), Ok((vec![("a".into(), 0), ("b".into(), 8), ("c".into(), 16)], 24)));
}
