//! Starting and stopping the processes of a local stack (xtask, the benchmark) (replicas, indexer, Envoy).
//!
//! Every child runs in its own process group with its output in a log file, and is stopped with
//! SIGTERM then SIGKILL to the whole group: when the [`Supervisor`] is dropped, on Ctrl-C (see
//! [`install_ctrl_c`]), and, on Linux, when xtask itself dies (`PR_SET_PDEATHSIG`).

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::http;

pub use crate::ports::PortPool;

/// Process groups of every running child, for the Ctrl-C handler.
static GROUPS: Mutex<Vec<i32>> = Mutex::new(Vec::new());
/// Set once Ctrl-C was pressed.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// True after Ctrl-C; long loops poll it to stop early.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// On Ctrl-C (or SIGTERM): stop every child's process group and exit with status 130.
pub fn install_ctrl_c() -> Result<()> {
    ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            return;
        }
        eprintln!("\nxtask: interrupted, stopping everything it started ...");
        let groups = GROUPS.lock().map(|g| g.clone()).unwrap_or_default();
        terminate_groups(&groups, Duration::from_secs(3));
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")
}

/// A child process of the stack.
struct Managed {
    name: String,
    child: Child,
    log: PathBuf,
}

/// Owns the children it started and stops them all when dropped.
pub struct Supervisor {
    children: Vec<Managed>,
    die_with_parent: bool,
}

impl Supervisor {
    /// A supervisor; with `die_with_parent` its children get SIGTERM when xtask dies (set it
    /// unless the children must outlive xtask, as with `--keep`).
    pub fn new(die_with_parent: bool) -> Self {
        Self {
            children: Vec::new(),
            die_with_parent,
        }
    }

    /// Starts `cmd` as `name`, its stdout and stderr going to `log`; returns its pid (which is
    /// also its process group id).
    pub fn spawn(&mut self, name: &str, mut cmd: Command, log: &Path) -> Result<u32> {
        if interrupted() {
            bail!("interrupted");
        }
        if let Some(dir) = log.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let out = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        if self.die_with_parent {
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent; this runs
            // in the forked child before exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let line = crate::cmd::display(&cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: `{line}`"))?;
        let pid = child.id();
        if let Ok(mut groups) = GROUPS.lock() {
            groups.push(pid as i32);
        }
        self.children.push(Managed {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
        });
        Ok(pid)
    }

    /// Fails, naming the process and the end of its log, if any child has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        for managed in &mut self.children {
            if let Ok(Some(status)) = managed.child.try_wait() {
                bail!(
                    "{} exited ({status}); last lines of {}:\n{}",
                    managed.name,
                    managed.log.display(),
                    log_tail(&managed.log, 20)
                );
            }
        }
        Ok(())
    }

    /// Stops the children whose names start with `prefix` (all of them for "").
    pub fn stop_matching(&mut self, prefix: &str) {
        let (stop, keep): (Vec<Managed>, Vec<Managed>) = self
            .children
            .drain(..)
            .partition(|m| m.name.starts_with(prefix));
        self.children = keep;
        stop_children(stop);
    }

    /// Stops the child named exactly `name`, if it runs.
    pub fn stop_named(&mut self, name: &str) {
        let (stop, keep): (Vec<Managed>, Vec<Managed>) =
            self.children.drain(..).partition(|m| m.name == name);
        self.children = keep;
        stop_children(stop);
    }

    /// Pids (and process group ids) of the live children whose names start with `prefix`.
    pub fn pids_matching(&self, prefix: &str) -> Vec<u32> {
        self.children
            .iter()
            .filter(|m| m.name.starts_with(prefix))
            .map(|m| m.child.id())
            .collect()
    }

    /// Sends SIGINT (Ctrl-C) to the child named `name` and waits up to `timeout` for it to exit
    /// on its own (a tool that reports when interrupted, such as `kvroute-indexer assess`); it is
    /// stopped by force after that. Fails if it was not running, did not exit in time, or exited
    /// with an error.
    pub fn interrupt_and_wait(&mut self, name: &str, timeout: Duration) -> Result<()> {
        let Some(at) = self.children.iter().position(|m| m.name == name) else {
            bail!("{name} is not running");
        };
        let mut managed = self.children.remove(at);
        let pid = managed.child.id() as i32;
        // SAFETY: kill(2) on one process id; no memory is involved.
        unsafe {
            libc::kill(pid, libc::SIGINT);
        }
        let deadline = Instant::now() + timeout;
        let status = loop {
            match managed.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(50)),
                _ => break None,
            }
        };
        let log = managed.log.clone();
        stop_children(vec![managed]);
        match status {
            Some(s) if s.success() => Ok(()),
            Some(s) => bail!(
                "{name} exited ({s}); last lines of {}:\n{}",
                log.display(),
                log_tail(&log, 20)
            ),
            None => bail!(
                "{name} did not exit within {}s of SIGINT; see {}",
                timeout.as_secs(),
                log.display()
            ),
        }
    }

    /// Stops every child.
    pub fn stop_all(&mut self) {
        self.stop_matching("");
    }

    /// Forgets the children without stopping them (`--keep`); returns their pids and names.
    pub fn detach(&mut self) -> Vec<(u32, String)> {
        let detached: Vec<(u32, String)> = self
            .children
            .drain(..)
            .map(|m| (m.child.id(), m.name))
            .collect();
        if let Ok(mut groups) = GROUPS.lock() {
            groups.clear();
        }
        detached
    }

    /// Waits until `GET http://addr/path` answers 200, failing early if a child dies.
    pub fn wait_http_ok(
        &mut self,
        what: &str,
        addr: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            if interrupted() {
                bail!("interrupted");
            }
            self.check_alive()?;
            match http::get(addr, path, Duration::from_secs(2)) {
                Ok((200, _)) => return Ok(()),
                Ok((status, body)) => last = format!("HTTP {status}: {}", body.trim()),
                Err(e) => last = format!("{e:#}"),
            }
            thread::sleep(Duration::from_millis(100));
        }
        bail!(
            "{what} did not become ready on http://{addr}{path} within {}s (last: {last})",
            timeout.as_secs()
        )
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop_all();
    }
}

fn stop_children(children: Vec<Managed>) {
    if children.is_empty() {
        return;
    }
    let groups: Vec<i32> = children.iter().map(|m| m.child.id() as i32).collect();
    terminate_groups(&groups, Duration::from_secs(5));
    for mut managed in children {
        let _ = managed.child.kill();
        let _ = managed.child.wait();
    }
    if let Ok(mut registered) = GROUPS.lock() {
        registered.retain(|g| !groups.contains(g));
    }
}

/// SIGTERM to every group, then SIGKILL to the groups still alive after `grace`.
fn terminate_groups(groups: &[i32], grace: Duration) {
    for &group in groups {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
        unsafe {
            libc::kill(-group, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && groups.iter().any(|&g| group_alive(g)) {
        thread::sleep(Duration::from_millis(50));
    }
    for &group in groups {
        if group_alive(group) {
            // SAFETY: as above.
            unsafe {
                libc::kill(-group, libc::SIGKILL);
            }
        }
    }
}

fn group_alive(group: i32) -> bool {
    // SAFETY: signal 0 only checks that the group exists and may be signalled.
    unsafe { libc::kill(-group, 0) == 0 }
}

/// The last `lines` lines of a log file (for error messages).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
