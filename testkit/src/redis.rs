//! A throwaway Redis server for tests and the benchmark: Debian's `redis-server` (installed by
//! `cargo xtask setup`; `KVROUTE_REDIS_SERVER` overrides the path) on 127.0.0.1, a free port, a
//! random password, no persistence, its own temp dir; killed on drop.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::paths::{env_or, TempDir};
use crate::ports::free_port;
use crate::process::Proc;

/// Path of `redis-server` (`KVROUTE_REDIS_SERVER`, else Debian's).
pub fn redis_server_bin() -> PathBuf {
    env_or(
        "KVROUTE_REDIS_SERVER",
        PathBuf::from("/usr/bin/redis-server"),
    )
}

/// A running Redis server.
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its `requirepass`.
    pub password: String,
    proc: Option<Proc>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts one on a free port (retrying a port taken meanwhile).
    pub fn start(tag: &str) -> Result<RedisServer> {
        let bin = redis_server_bin();
        if !bin.exists() {
            bail!(
                "{} not found: run `cargo xtask setup` (installs Debian's redis-server)",
                bin.display()
            );
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut server = RedisServer {
            port: 0,
            password: format!("kvroute-test-{nanos:x}"),
            proc: None,
            dir: TempDir::new(&format!("redis-{tag}")),
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.launch().is_ok() {
                return Ok(server);
            }
        }
        server.launch()?;
        Ok(server)
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the server (the port stays reserved for [`RedisServer::restart`]).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Starts it again on the same port after [`RedisServer::stop`].
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let mut last = None;
        for _ in 0..20 {
            match self.launch() {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("redis did not restart")))
    }

    fn launch(&mut self) -> Result<()> {
        let mut cmd = Command::new(redis_server_bin());
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--requirepass", &self.password])
            .arg("--dir")
            .arg(&self.dir.0)
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .args(["--logfile", ""]);
        let log = self.dir.0.join(format!("redis-{}.log", self.port));
        let mut p = Proc::spawn_piped("redis-server", cmd, log, false);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            match p.try_line(Duration::from_millis(100)) {
                Some(l) if l.contains("Ready to accept connections") => {
                    self.proc = Some(p);
                    return Ok(());
                }
                Some(_) => {}
                None if p.exited() => break,
                None => {}
            }
        }
        let tail = p.log_tail();
        p.kill();
        bail!("redis-server on port {} did not start: {tail}", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
