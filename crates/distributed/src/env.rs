//! The launcher's environment, as `torchrun` sets it: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`.

use kiln_tensor::{Error, Result};

/// Where this process stands in a distributed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The rank among the processes of this machine: the GPU it takes.
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the variables through `var` (`std::env::var` in `from_env`). `None` when
    /// `WORLD_SIZE` is not set (a plain single-process run); an error naming the variable
    /// when one is missing or malformed.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let Some(world) = var("WORLD_SIZE") else { return Ok(None) };
        let num = |name: &str, text: Option<String>| -> Result<usize> {
            let text = text.ok_or_else(|| Error::Msg(format!("distributed: WORLD_SIZE is set but {name} is not")))?;
            text.trim().parse().map_err(|_| Error::Msg(format!("distributed: {name}={text:?} is not a number")))
        };
        let world_size = num("WORLD_SIZE", Some(world))?;
        let rank = num("RANK", var("RANK"))?;
        let local_rank = match var("LOCAL_RANK") {
            Some(t) => num("LOCAL_RANK", Some(t))?,
            None => rank,
        };
        if world_size == 0 || rank >= world_size {
            return Err(Error::Msg(format!("distributed: RANK={rank} is not in a world of WORLD_SIZE={world_size}")));
        }
        let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = num("MASTER_PORT", Some(var("MASTER_PORT").unwrap_or_else(|| "29500".into())))?;
        let master_port = u16::try_from(port).map_err(|_| Error::Msg(format!("distributed: MASTER_PORT={port} is not a port")))?;
        Ok(Some(DistEnv { rank, world_size, local_rank, master_addr, master_port }))
    }

    /// `from_vars` over the process environment.
    pub fn from_env() -> Result<Option<DistEnv>> {
        DistEnv::from_vars(|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(pairs: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn reads_torchrun_variables_with_their_defaults() {
        assert_eq!(read(&[]).unwrap(), None);
        let e = read(&[("WORLD_SIZE", "4"), ("RANK", "2"), ("MASTER_PORT", "1234")]).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.master_addr.as_str(), e.master_port), (2, 4, 2, "127.0.0.1", 1234));
        let e = read(&[("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node0")]).unwrap().unwrap();
        assert_eq!((e.local_rank, e.master_addr.as_str(), e.master_port), (1, "node0", 29500));
    }

    #[test]
    fn names_the_variable_that_is_wrong() {
        let e = read(&[("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("RANK"), "{e}");
        let e = read(&[("WORLD_SIZE", "2"), ("RANK", "x")]).unwrap_err().to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = read(&[("WORLD_SIZE", "2"), ("RANK", "2")]).unwrap_err().to_string();
        assert!(e.contains("RANK=2") && e.contains("WORLD_SIZE=2"), "{e}");
        let e = read(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")]).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT=70000"), "{e}");
    }
}
