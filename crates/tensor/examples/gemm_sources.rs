//! Writes the 3xTF32 GEMM kernels' CUDA sources (`kiln_tensor::cuda::gemm`: `MaxAutotune`'s
//! candidates for every operand layout, and with `--all` more tiles) into a folder, one
//! `NAME.cu` per kernel, for `benches/cuda/gemm_bench.cpp` on a GPU machine without Rust.
//! `cargo run --release -p kiln-tensor --example gemm_sources -- DIR [--all]`
use kiln_tensor::cuda::gemm::{candidates, source, GemmTile};

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "gemm".into());
    let all = std::env::args().any(|a| a == "--all");
    std::fs::create_dir_all(&dir)?;
    let mut tiles: Vec<GemmTile> = Vec::new();
    for (a_k, b_k) in [(true, true), (true, false), (false, true), (false, false)] {
        tiles.extend(candidates(a_k, b_k));
        if all {
            let t = |bm, bn, bk, wm, wn, stages| GemmTile { bm, bn, bk, wm, wn, stages, a_k, b_k };
            tiles.extend([t(128, 128, 32, 64, 32, 3), t(128, 128, 16, 64, 32, 4), t(128, 128, 16, 64, 64, 3), t(256, 128, 16, 64, 64, 3)]);
            tiles.extend([t(64, 128, 16, 32, 32, 3), t(64, 64, 32, 32, 32, 3), t(128, 64, 32, 64, 32, 3), t(64, 64, 16, 32, 16, 4)]);
        }
    }
    for t in tiles.iter().filter(|t| t.valid()) {
        let (src, name) = source(t);
        std::fs::write(format!("{dir}/{name}.cu"), src)?;
    }
    println!("wrote {} kernels to {dir}", tiles.iter().filter(|t| t.valid()).count());
    Ok(())
}
