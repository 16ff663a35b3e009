//! The rendezvous that starts a process group, as `torchrun`'s TCP store does it: rank 0
//! listens on `MASTER_PORT`, every other rank connects to `MASTER_ADDR:MASTER_PORT` and says
//! who it is, and once all have come rank 0 hands each the same bytes (NCCL's unique id).
//! Every wait has a deadline: a rank that never comes, a rank number given twice or a world
//! size that disagrees ends the rendezvous with an error naming it, on every rank.

use crate::env::DistEnv;
use kiln_tensor::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"KILN";
const OK: u8 = 0;
const REFUSED: u8 = 1;

fn msg(text: String) -> Error {
    Error::Msg(format!("rendezvous: {text}"))
}

/// Meets the other ranks of `env`; returns the bytes rank 0 made with `payload` (on rank 0,
/// after every other rank has been sent them). Fails after `timeout`.
pub fn rendezvous(env: &DistEnv, payload: impl FnOnce() -> Result<Vec<u8>>, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        let bytes = payload()?;
        serve(env, &bytes, deadline, timeout)?;
        Ok(bytes)
    } else {
        join(env, deadline, timeout)
    }
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Rank 0: waits for every other rank, then sends each the payload.
fn serve(env: &DistEnv, payload: &[u8], deadline: Instant, timeout: Duration) -> Result<()> {
    let port = env.master_port;
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| msg(format!("rank 0 cannot listen on port {port}: {e} (another run on it? set MASTER_PORT)")))?;
    listener.set_nonblocking(true).map_err(|e| msg(format!("port {port}: {e}")))?;
    let mut peers: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
    while peers.iter().skip(1).any(Option::is_none) {
        match listener.accept() {
            Ok((stream, _)) => hello(stream, env, deadline, &mut peers)?,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..env.world_size).filter(|&r| peers[r].is_none()).collect();
                    return Err(msg(format!("rank 0 waited {timeout:?} on port {port}; rank(s) {missing:?} never came")));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(msg(format!("rank 0 accepting on port {port}: {e}"))),
        }
    }
    for (rank, peer) in peers.iter_mut().enumerate().skip(1) {
        let stream = peer.as_mut().expect("every rank came");
        reply(stream, OK, payload).map_err(|e| msg(format!("sending rank {rank} its start: {e}")))?;
    }
    Ok(())
}

/// Reads one rank's greeting into `peers`, or refuses it (and fails) when it does not fit.
fn hello(mut stream: TcpStream, env: &DistEnv, deadline: Instant, peers: &mut [Option<TcpStream>]) -> Result<()> {
    let io = |e: std::io::Error| msg(format!("reading a rank's greeting: {e}"));
    stream.set_nonblocking(false).map_err(io)?;
    stream.set_read_timeout(Some(left(deadline))).map_err(io)?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).map_err(io)?;
    let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes")) as usize;
    let (rank, world) = (word(4), word(8));
    let problem = if &head[..4] != MAGIC {
        Some("a connection that is not a Kiln rank reached the rendezvous port".to_string())
    } else if world != env.world_size {
        Some(format!("rank {rank} was started with WORLD_SIZE={world}, rank 0 with WORLD_SIZE={}", env.world_size))
    } else if rank == 0 || rank >= world {
        Some(format!("a rank said it is rank {rank}, not one of 1..{world}"))
    } else if peers[rank].is_some() {
        Some(format!("rank {rank} came twice (two processes with RANK={rank})"))
    } else {
        None
    };
    if let Some(p) = problem {
        let _ = reply(&mut stream, REFUSED, p.as_bytes());
        return Err(msg(p));
    }
    peers[rank] = Some(stream);
    Ok(())
}

fn reply(stream: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    stream.write_all(&[status])?;
    stream.write_all(&(body.len() as u32).to_le_bytes())?;
    stream.write_all(body)?;
    stream.flush()
}

/// Any rank but 0: connects to rank 0 (retrying until the deadline), says who it is and
/// reads the payload.
fn join(env: &DistEnv, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let (rank, addr) = (env.rank, format!("{}:{}", env.master_addr, env.master_port));
    let mut stream = loop {
        let tried = addr
            .to_socket_addrs()
            .and_then(|mut a| a.next().ok_or_else(|| std::io::Error::new(ErrorKind::NotFound, "no address")))
            .and_then(|a| TcpStream::connect_timeout(&a, left(deadline)));
        match tried {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(msg(format!("rank {rank} could not reach rank 0 at {addr} within {timeout:?}: {e}")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let io = |e: std::io::Error| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            msg(format!("rank {rank}: rank 0 at {addr} did not start the group within {timeout:?} (not every rank came)"))
        } else {
            msg(format!("rank {rank}: the connection to rank 0 at {addr} failed: {e} (rank 0 stopped?)"))
        }
    };
    let mut head = MAGIC.to_vec();
    head.extend((rank as u32).to_le_bytes());
    head.extend((env.world_size as u32).to_le_bytes());
    stream.write_all(&head).map_err(io)?;
    stream.set_read_timeout(Some(left(deadline))).map_err(io)?;
    let mut status = [0u8; 5];
    stream.read_exact(&mut status).map_err(io)?;
    let mut body = vec![0u8; u32::from_le_bytes(status[1..].try_into().expect("4 bytes")) as usize];
    stream.read_exact(&mut body).map_err(io)?;
    match status[0] {
        OK => Ok(body),
        _ => Err(msg(format!("rank 0 refused rank {rank}: {}", String::from_utf8_lossy(&body)))),
    }
}
