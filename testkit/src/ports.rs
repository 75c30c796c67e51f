//! Free TCP ports on 127.0.0.1 (bound and released: good enough on a test machine).
//!
//! Ports are drawn at random below Linux's ephemeral range (32768-60999): a port handed out there
//! can be taken, before the process it was meant for binds it, by the local end of any outgoing
//! connection or another `bind(":0")`, which is what made a simulator fail to start now and then
//! ("Address already in use"). Below the range only another test's pick can collide: a port this
//! process handed out is never handed out again, and every pick is claimed for [`CLAIM_TTL`] by a
//! file in `$TMPDIR/kvroute-test-ports/` created exclusively, so test processes running side by
//! side (nextest runs each test in its own) never pick the same port either.

use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvroute_core::rng::SplitMix64;

/// The ports drawn from: below the kernel's ephemeral range, above the well-known services.
const LOW: u16 = 20_000;
const HIGH: u16 = 32_768;

/// How long a pick stays claimed for other processes: long enough for its process to bind it,
/// and to bind it again after a restart within the test.
pub const CLAIM_TTL: Duration = Duration::from_secs(600);

/// Ports this process handed out.
static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
static DRAWS: AtomicU64 = AtomicU64::new(0);

/// A random port in `LOW..HIGH` that binds now and was not handed out by this process before;
/// `None` after many tries.
fn draw() -> Option<u16> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let seed =
        nanos ^ (u64::from(std::process::id()) << 32) ^ DRAWS.fetch_add(1, Ordering::Relaxed);
    let mut rng = SplitMix64::new(seed);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        let port = LOW + rng.below(usize::from(HIGH - LOW)) as u16;
        if given.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() && claim(port) {
            given.insert(port);
            return Some(port);
        }
    }
    None
}

fn claims_dir() -> PathBuf {
    std::env::temp_dir().join("kvroute-test-ports")
}

/// Claims `port` against other processes; false if another claimed it within [`CLAIM_TTL`].
/// Where no claim can be written (no temporary directory), every port counts as unclaimed.
fn claim(port: u16) -> bool {
    let dir = claims_dir();
    if fs::create_dir_all(&dir).is_err() {
        return true;
    }
    let path = dir.join(port.to_string());
    let me = std::process::id().to_string();
    match OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(_) => fs::write(&path, me).is_ok(),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let expired = fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > CLAIM_TTL);
            // Writing renews the claim's time.
            expired && fs::write(&path, me).is_ok()
        }
        Err(_) => true,
    }
}

/// A port that was free a moment ago (see the module's docs for how it is chosen).
pub fn free_port() -> u16 {
    draw().unwrap_or_else(|| {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind an ephemeral port")
    })
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
            let port = match draw() {
                Some(port) => port,
                None => TcpListener::bind("127.0.0.1:0")
                    .context("finding a free port on 127.0.0.1")?
                    .local_addr()?
                    .port(),
            };
            if !self.given.contains(&port) {
                self.given.push(port);
                return Ok(port);
            }
        }
        bail!("could not find a free port on 127.0.0.1")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
        assert!(ports.iter().all(|p| (LOW..HIGH).contains(p)), "{ports:?}");
        assert!(ports
            .iter()
            .all(|&p| TcpListener::bind(("127.0.0.1", p)).is_ok()));
        let mut pool = PortPool::default();
        let a = pool.take().expect("a port");
        assert!(!ports.contains(&a));
    }

    #[test]
    fn a_port_claimed_by_another_process_is_not_handed_out() {
        let port = free_port();
        // Claimed by this process a moment ago: another process's claim would fail, and does.
        assert!(!claim(port));
        let path = claims_dir().join(port.to_string());
        assert_eq!(
            fs::read_to_string(&path).ok(),
            Some(std::process::id().to_string())
        );
        // An expired claim is taken over.
        let old = SystemTime::now() - CLAIM_TTL - Duration::from_secs(1);
        let f = OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("claim file");
        f.set_modified(old).expect("set the claim's time");
        drop(f);
        assert!(claim(port));
        assert!(!claim(port));
    }
}
