//! Writes the tensor-core attention kernels' CUDA sources (BF16 or F32, head dim 64, causal)
//! as `fwd.cu`, `dq.cu` and `dkv.cu` into a folder, for `benches/cuda/attn_bench.cpp`, which
//! times variants of them on a GPU machine without a Rust toolchain.
//! `cargo run --release -p kiln-tensor --example flash_sources -- DIR [bf16|f32]`
use kiln_tensor::cuda::kernels::attention::flash_source;
use kiln_tensor::cuda::kernels::attention::AttnKernel;
use kiln_tensor::DType;

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "flash".into());
    let dtype = match std::env::args().nth(2).as_deref() {
        Some("f32") => DType::F32,
        _ => DType::BF16,
    };
    std::fs::create_dir_all(&dir)?;
    for (kind, file) in [(AttnKernel::Fwd, "fwd"), (AttnKernel::Dq, "dq"), (AttnKernel::Dkv, "dkv")] {
        let (src, _) = flash_source(kind, dtype, 64, true);
        std::fs::write(format!("{dir}/{file}.cu"), src)?;
    }
    println!("wrote {dir}/fwd.cu, dq.cu, dkv.cu ({dtype:?})");
    Ok(())
}
