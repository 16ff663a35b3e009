//! The rendezvous and the launcher with real processes: this test binary starts itself
//! through `kiln-run` as the ranks (`KILN_TEST_WORKER` says what a rank does).

use kiln_distributed::{rendezvous, DistEnv};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `kiln-run --nproc-per-node n` over this binary's test `worker`, as worker `role`; fails the
/// test (instead of hanging) if the run takes longer than a minute.
fn launch(n: usize, role: &str) -> (Output, Duration) {
    let me = std::env::current_exe().unwrap();
    let port = free_port().to_string();
    let n = n.to_string();
    let args = ["--nproc-per-node", &n, "--master-port", &port, "--", me.to_str().unwrap(), "worker", "--exact", "--nocapture"];
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .env("KILN_TEST_WORKER", role)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("kiln-run did not finish within a minute");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().unwrap(), start.elapsed())
}

/// What a rank does when this binary runs as one (a no-op in a plain test run).
#[test]
fn worker() {
    let Ok(role) = std::env::var("KILN_TEST_WORKER") else { return };
    let env = DistEnv::from_env().unwrap().expect("kiln-run sets WORLD_SIZE");
    match role.as_str() {
        "rendezvous" => {
            let payload = rendezvous(&env, || Ok(format!("start {}", std::process::id()).into_bytes()), Duration::from_secs(30));
            println!("rank {} of {} got <{}>", env.rank, env.world_size, String::from_utf8(payload.unwrap()).unwrap());
        }
        "fail" if env.rank == 2 => {
            eprintln!("rank 2 gives up");
            std::process::exit(3);
        }
        "fail" => {
            // The others wait at the rendezvous far longer than the test allows.
            let _ = rendezvous(&env, || Ok(b"id".to_vec()), Duration::from_secs(600));
            std::thread::sleep(Duration::from_secs(600));
        }
        other => panic!("unknown worker role {other}"),
    }
}

#[test]
fn ranks_meet_and_all_get_rank_0_s_bytes() {
    let (out, _) = launch(3, "rendezvous");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let got: Vec<&str> = (0..3)
        .map(|r| {
            let line = stdout.lines().find(|l| l.starts_with(&format!("[rank {r}] rank {r} of 3 got <"))).expect("each rank reports");
            line.split('<').nth(1).unwrap()
        })
        .collect();
    assert!(got[0].starts_with("start "));
    assert!(got.iter().all(|g| *g == got[0]), "every rank got rank 0's bytes: {got:?}");
}

#[test]
fn a_failed_rank_stops_the_others_with_its_exit_code() {
    let (out, took) = launch(3, "fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("[rank 2] rank 2 gives up"), "{stderr}");
    assert!(stderr.contains("kiln-run: rank 2 failed (exit code 3); stopping the other ranks"), "{stderr}");
    // The others were waiting for ten minutes; they were stopped instead.
    assert!(took < Duration::from_secs(60));
}

fn env(rank: usize, world: usize, port: u16) -> DistEnv {
    DistEnv { rank, world_size: world, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port }
}

#[test]
fn a_rank_that_never_comes_is_named_after_the_timeout() {
    let port = free_port();
    let short = Duration::from_millis(300);
    let e = rendezvous(&env(0, 3, port), || Ok(vec![1]), short).unwrap_err().to_string();
    assert!(e.contains("rank(s) [1, 2] never came"), "{e}");
    let e = rendezvous(&env(1, 2, free_port()), || Ok(vec![1]), short).unwrap_err().to_string();
    assert!(e.contains("rank 1 could not reach rank 0 at 127.0.0.1:"), "{e}");
}

#[test]
fn ranks_that_disagree_on_the_world_are_refused() {
    let port = free_port();
    let long = Duration::from_secs(20);
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| rendezvous(&env(0, 2, port), || Ok(vec![7]), long));
        let one = s.spawn(|| rendezvous(&env(1, 3, port), || Ok(vec![]), long));
        (zero.join().unwrap(), one.join().unwrap())
    });
    let (zero, one) = (zero.unwrap_err().to_string(), one.unwrap_err().to_string());
    assert!(zero.contains("rank 1 was started with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2"), "{zero}");
    assert!(one.contains("rank 0 refused rank 1") && one.contains("WORLD_SIZE=3"), "{one}");
}
