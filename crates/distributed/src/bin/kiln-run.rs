//! `kiln-run`: starts one process per rank for data-parallel training, as `torchrun` does
//! (`kiln-run --nproc-per-node 8 -- target/release/examples/lm --ddp ...`).

use kiln_distributed::launch::Launch;

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let code = match Launch::parse(&argv) {
        Ok(l) => l.run(),
        Err(e) => {
            eprintln!("kiln-run: {e}");
            2
        }
    };
    std::process::exit(code);
}
