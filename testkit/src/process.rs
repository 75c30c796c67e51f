//! One child process of a test, killed (and reaped) on drop. Its output goes to a log file, or
//! its stdout arrives line by line on a channel ([`Proc::spawn_piped`]) for tests that wait for
//! what a process prints. Every wait is bounded and a failure shows the end of the log.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Keeps a child's error from scrolling out of the log tail a failure shows: with
/// `RUST_BACKTRACE=1` (as CI sets it) an `anyhow` error returned from `main` prints a backtrace
/// of some 60 lines after the message. Panics keep their backtraces; a caller that sets
/// `RUST_LIB_BACKTRACE` itself wins.
fn quiet_error_backtraces(cmd: &mut Command) {
    if !cmd.get_envs().any(|(k, _)| k == "RUST_LIB_BACKTRACE") {
        cmd.env("RUST_LIB_BACKTRACE", "0");
    }
}

/// A child process killed (and reaped) on drop.
pub struct Proc {
    /// The name used in messages and for the log file.
    pub name: String,
    child: Option<Child>,
    /// Where its output (or, when piped, its stderr) goes.
    pub log: PathBuf,
    lines: Option<Receiver<String>>,
    stdin: Option<ChildStdin>,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr in `<dir>/<name>.log`.
    pub fn spawn(name: &str, cmd: &mut Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("create log");
        let err = out.try_clone().expect("clone log handle");
        quiet_error_backtraces(cmd);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Proc {
            name: name.to_string(),
            child: Some(child),
            log,
            lines: None,
            stdin: None,
        }
    }

    /// Starts `cmd` with stdout lines on a channel ([`Proc::wait_line`]) and stderr in `log`;
    /// with `keep_stdin`, [`Proc::send_line`] writes to its stdin.
    pub fn spawn_piped(name: &str, mut cmd: Command, log: PathBuf, keep_stdin: bool) -> Proc {
        let err = std::fs::File::create(&log).expect("create log");
        quiet_error_backtraces(&mut cmd);
        cmd.stdout(Stdio::piped()).stderr(err);
        cmd.stdin(if keep_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            name: name.to_string(),
            child: Some(child),
            log,
            lines: Some(rx),
            stdin,
        }
    }

    /// The last 40 lines of the log.
    pub fn log_tail(&self) -> String {
        crate::supervisor::log_tail(&self.log, 40)
    }

    /// The whole log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the log tail if the process has exited.
    pub fn assert_running(&mut self) {
        if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
            panic!(
                "{} exited ({status}); log tail:\n{}",
                self.name,
                self.log_tail()
            );
        }
    }

    /// Whether the process has exited (or was killed).
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// The next stdout line that satisfies `f`, within `timeout`; panics with the log otherwise
    /// (piped processes only).
    pub fn wait_line(&mut self, timeout: Duration, mut f: impl FnMut(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines().recv_timeout(left) {
                Ok(l) if f(&l) => return l,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{}: no expected stdout line within {timeout:?}; log:\n{}",
                    self.name,
                    self.log_tail()
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "{}: exited before the expected line; log:\n{}",
                    self.name,
                    self.log_tail()
                ),
            }
        }
    }

    /// The next stdout line within `timeout`, if any (piped processes only).
    pub fn try_line(&mut self, timeout: Duration) -> Option<String> {
        self.lines().recv_timeout(timeout).ok()
    }

    fn lines(&self) -> &Receiver<String> {
        self.lines
            .as_ref()
            .unwrap_or_else(|| panic!("{}: stdout is not piped", self.name))
    }

    /// Writes one line to the child's stdin (started with `keep_stdin`).
    pub fn send_line(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin kept");
        writeln!(s, "{line}").expect("write to child stdin");
        s.flush().expect("flush child stdin");
    }

    /// The process id (0 once killed).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Resident set size in bytes (0 when unreadable).
    pub fn rss_bytes(&self) -> u64 {
        proc_status_bytes(self.pid(), "VmRSS").unwrap_or(0)
    }

    /// Sends SIGTERM and waits up to `timeout` for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stdin = None;
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A field of `/proc/<pid>/status` given in kB (`VmRSS`, `VmHWM`), in bytes; `None` off Linux or
/// once the process is gone.
pub fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(&format!("{field}:")))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Calls `f` every 50 ms until it returns true; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// Lowers the calling thread's scheduling priority to the nice value `nice` (on Linux the nice
/// value is per thread; threads and processes it creates inherit it). For threads that stand for
/// other machines (a test's simulated replicas) on a CPU shared with the process measured.
pub fn lower_this_threads_priority(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid has no arguments and cannot fail; setpriority reads only its arguments.
    let rc = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn this_threads_nice() -> i32 {
        // SAFETY: as in `lower_this_threads_priority`; -1 is a valid nice value, so errno is
        // cleared first to tell it from an error.
        unsafe {
            *libc::__errno_location() = 0;
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::getpriority(libc::PRIO_PROCESS, tid)
        }
    }

    #[test]
    fn only_the_calling_thread_and_its_children_are_lowered() {
        let before = this_threads_nice();
        let (own, child) = std::thread::spawn(move || {
            lower_this_threads_priority(before + 5).expect("lower");
            let child = std::thread::spawn(this_threads_nice).join().expect("child");
            (this_threads_nice(), child)
        })
        .join()
        .expect("thread");
        assert_eq!((own, child), (before + 5, before + 5));
        assert_eq!(this_threads_nice(), before);
    }
}
