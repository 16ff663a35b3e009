//! The launcher (`kiln-run`, as `torchrun`): starts one process per rank with the
//! rendezvous variables set, prefixes each line they print with their rank, and when one
//! fails stops the others and says which failed and how.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

/// What to start: `nproc_per_node` copies of `program args..` on node `node_rank` of `nnodes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub program: String,
    pub args: Vec<String>,
}

pub const USAGE: &str = "usage: kiln-run [--nproc-per-node N] [--nnodes M --node-rank K] [--master-addr HOST] \
[--master-port PORT] -- PROGRAM [ARGS..]";

impl Launch {
    /// Parses the launcher's arguments (those after the launcher's own name).
    pub fn parse(argv: &[String]) -> Result<Launch, String> {
        let split = argv.iter().position(|a| a == "--").ok_or_else(|| format!("no `--` before the program\n{USAGE}"))?;
        let (opts, rest) = (&argv[..split], &argv[split + 1..]);
        let program = rest.first().cloned().ok_or_else(|| format!("no program after `--`\n{USAGE}"))?;
        let mut l = Launch {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            program,
            args: rest[1..].to_vec(),
        };
        let mut it = opts.iter();
        while let Some(flag) = it.next() {
            let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
            let num = |v: &str| v.parse::<usize>().map_err(|_| format!("{flag} {v}: not a number"));
            match flag.as_str() {
                "--nproc-per-node" => l.nproc_per_node = num(value)?,
                "--nnodes" => l.nnodes = num(value)?,
                "--node-rank" => l.node_rank = num(value)?,
                "--master-addr" => l.master_addr = value.clone(),
                "--master-port" => l.master_port = value.parse().map_err(|_| format!("--master-port {value}: not a port"))?,
                other => return Err(format!("unknown option {other}\n{USAGE}")),
            }
        }
        if l.nproc_per_node == 0 || l.nnodes == 0 || l.node_rank >= l.nnodes {
            return Err(format!("needs --nproc-per-node >= 1 and --node-rank below --nnodes\n{USAGE}"));
        }
        Ok(l)
    }

    /// The environment of local rank `local`: `torchrun`'s variables, and NVLink multicast
    /// off in NCCL unless the caller chose otherwise (on shared hosts it can take the GPUs
    /// out of service).
    pub fn env_of(&self, local: usize) -> Vec<(String, String)> {
        let world = self.nproc_per_node * self.nnodes;
        let mut env = vec![
            ("RANK".to_string(), (self.node_rank * self.nproc_per_node + local).to_string()),
            ("LOCAL_RANK".to_string(), local.to_string()),
            ("WORLD_SIZE".to_string(), world.to_string()),
            ("LOCAL_WORLD_SIZE".to_string(), self.nproc_per_node.to_string()),
            ("MASTER_ADDR".to_string(), self.master_addr.clone()),
            ("MASTER_PORT".to_string(), self.master_port.to_string()),
        ];
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            env.push(("NCCL_NVLS_ENABLE".into(), "0".into()));
        }
        env
    }

    /// Starts every local rank and waits. Returns 0 when all succeed; else, once the first
    /// fails, stops the others and returns its exit code (1 if it had none).
    pub fn run(&self) -> i32 {
        let mut children: Vec<(usize, Child)> = Vec::new();
        let mut pumps = Vec::new();
        for local in 0..self.nproc_per_node {
            let rank = self.node_rank * self.nproc_per_node + local;
            let started =
                Command::new(&self.program).args(&self.args).envs(self.env_of(local)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
            let mut child = match started {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("kiln-run: cannot start {} for rank {rank}: {e}", self.program);
                    stop(&mut children);
                    return 1;
                }
            };
            let (out, err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
            pumps.push(std::thread::spawn(move || pump(out, rank, false)));
            pumps.push(std::thread::spawn(move || pump(err, rank, true)));
            children.push((rank, child));
        }
        let code = watch(&mut children);
        for p in pumps {
            let _ = p.join();
        }
        code
    }
}

/// Copies `from` line by line to the launcher's stdout (or stderr), each line after `[rank k] `.
fn pump(from: impl std::io::Read, rank: usize, to_err: bool) {
    for line in BufReader::new(from).lines() {
        let Ok(line) = line else { break };
        if to_err {
            let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {line}");
        } else {
            let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {line}");
        }
    }
}

fn describe(status: ExitStatus) -> String {
    match status.code() {
        Some(c) => format!("exit code {c}"),
        None => format!("{status} (killed by a signal)"),
    }
}

/// Waits for every child; at the first failure stops the rest.
fn watch(children: &mut [(usize, Child)]) -> i32 {
    let mut running: Vec<bool> = vec![true; children.len()];
    while running.iter().any(|&r| r) {
        for (k, (rank, child)) in children.iter_mut().enumerate() {
            if !running[k] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) if status.success() => running[k] = false,
                Ok(Some(status)) => {
                    eprintln!("kiln-run: rank {rank} failed ({}); stopping the other ranks", describe(status));
                    let code = status.code().filter(|&c| c != 0).unwrap_or(1);
                    stop(children);
                    return code;
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("kiln-run: waiting for rank {rank}: {e}; stopping the ranks");
                    stop(children);
                    return 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    0
}

fn stop(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
    }
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_torchrun_style_options_and_sets_each_rank_s_variables() {
        let l = Launch::parse(&args("--nproc-per-node 4 --nnodes 2 --node-rank 1 --master-port 1234 -- train --lr 3")).unwrap();
        assert_eq!((l.nproc_per_node, l.nnodes, l.node_rank, l.master_port), (4, 2, 1, 1234));
        assert_eq!((l.program.as_str(), l.args.clone()), ("train", args("--lr 3")));
        let env = l.env_of(2);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!((get("RANK"), get("LOCAL_RANK"), get("WORLD_SIZE")), (Some("6"), Some("2"), Some("8")));
        assert_eq!((get("MASTER_ADDR"), get("MASTER_PORT")), (Some("127.0.0.1"), Some("1234")));
    }

    #[test]
    fn bad_arguments_say_what_is_wrong() {
        assert!(Launch::parse(&args("--nproc-per-node 2 train")).unwrap_err().contains("--"));
        assert!(Launch::parse(&args("--nproc-per-node x -- train")).unwrap_err().contains("not a number"));
        assert!(Launch::parse(&args("--bogus 1 -- train")).unwrap_err().contains("unknown option --bogus"));
        assert!(Launch::parse(&args("--nnodes 2 --node-rank 2 -- t")).unwrap_err().contains("--node-rank"));
    }
}
