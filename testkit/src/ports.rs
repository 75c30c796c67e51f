//! Free TCP ports on 127.0.0.1 (bound and released: good enough on a test machine).

use std::net::TcpListener;

use anyhow::{bail, Context, Result};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// The first of `n` consecutive free ports (data-parallel `+rank` endpoints).
pub fn free_port_run(n: u16) -> u16 {
    for _ in 0..200 {
        let base = free_port();
        if base > 65000 {
            continue;
        }
        let all_free = (0..n).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no run of {n} free ports");
}

/// Hands out distinct free TCP ports on 127.0.0.1.
#[derive(Default)]
pub struct PortPool {
    given: Vec<u16>,
}

impl PortPool {
    /// A port nobody listens on right now and that this pool has not handed out before.
    pub fn take(&mut self) -> Result<u16> {
        for _ in 0..100 {
            let listener =
                TcpListener::bind("127.0.0.1:0").context("finding a free port on 127.0.0.1")?;
            let port = listener.local_addr()?.port();
            if !self.given.contains(&port) {
                self.given.push(port);
                return Ok(port);
            }
        }
        bail!("could not find a free port on 127.0.0.1")
    }
}
