//! [`RelayChild`]: a `relay-child` process that dies with its guard.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::ChildArgs;
use crate::args::{MYSQL_URL_VARIABLE, PG_URL_VARIABLE};

/// A running `relay-child` process. Dropping it kills the process
/// (SIGKILL) and reaps it, so a failing test never leaves relays behind.
///
/// The child's stdout and stderr are appended to a log file; closing its
/// stdin ([`stop`](Self::stop)) asks it to shut down gracefully.
#[derive(Debug)]
pub struct RelayChild {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    worker: String,
    log: PathBuf,
}

impl RelayChild {
    /// Starts `exe` (the `relay-child` binary) with `args`, appending its
    /// output to `log`.
    pub fn spawn(exe: &Path, args: &ChildArgs, log: &Path) -> io::Result<RelayChild> {
        Self::start(exe, args, None, log)
    }

    /// Starts `exe` on PostgreSQL at `url` (`args.pg_schema` names the
    /// schema); the URL reaches the child through [`PG_URL_VARIABLE`], never
    /// its command line.
    pub fn spawn_postgres(
        exe: &Path,
        args: &ChildArgs,
        url: &str,
        log: &Path,
    ) -> io::Result<RelayChild> {
        if args.pg_schema.is_none() {
            return Err(io::Error::other("spawn_postgres needs args.pg_schema"));
        }
        Self::start(exe, args, Some((PG_URL_VARIABLE, url)), log)
    }

    /// Starts `exe` on MySQL/MariaDB at `url` (`args.mysql_prefix` names
    /// the tables); the URL reaches the child through
    /// [`MYSQL_URL_VARIABLE`], never its command line.
    pub fn spawn_mysql(
        exe: &Path,
        args: &ChildArgs,
        url: &str,
        log: &Path,
    ) -> io::Result<RelayChild> {
        if args.mysql_prefix.is_none() {
            return Err(io::Error::other("spawn_mysql needs args.mysql_prefix"));
        }
        Self::start(exe, args, Some((MYSQL_URL_VARIABLE, url)), log)
    }

    /// Starts `exe` with `args`, and `url` in the variable named with it.
    fn start(
        exe: &Path,
        args: &ChildArgs,
        url: Option<(&str, &str)>,
        log: &Path,
    ) -> io::Result<RelayChild> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let err = out.try_clone()?;
        let mut command = Command::new(exe);
        if let Some((variable, url)) = url {
            command.env(variable, url);
        }
        let mut child = command
            .args(args.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()?;
        let stdin = child.stdin.take();
        Ok(RelayChild {
            child: Some(child),
            stdin,
            worker: args.worker.clone(),
            log: log.to_owned(),
        })
    }

    /// The child's worker id.
    pub fn worker(&self) -> &str {
        &self.worker
    }

    /// The child's process id.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The log file its output goes to.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Kills the process with SIGKILL (no chance to release leases or
    /// finish a transaction) and reaps it.
    pub fn kill(&mut self) -> io::Result<ExitStatus> {
        self.stdin.take();
        let mut child = self
            .child
            .take()
            .ok_or_else(|| io::Error::other("the child was already stopped"))?;
        // `Child::kill` sends SIGKILL on Unix.
        let _ = child.kill();
        child.wait()
    }

    /// Closes the child's stdin, which makes it shut its relay down
    /// gracefully and exit; waits up to `timeout`, then kills it and fails.
    pub fn stop(&mut self, timeout: Duration) -> io::Result<ExitStatus> {
        self.stdin.take();
        let deadline = Instant::now() + timeout;
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| io::Error::other("the child was already stopped"))?;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() >= deadline {
                let _ = self.kill();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "relay child {} did not exit within {timeout:?} of its stdin closing; killed",
                        self.worker
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Panics, naming `context` and showing the end of its log, if any of
/// `children` has exited by itself.
pub fn assert_all_running(children: &mut [RelayChild], context: &str) {
    for c in children {
        assert!(
            c.is_running(),
            "{context}: relay {} exited by itself; its log ends:\n{}",
            c.worker(),
            crate::check::log_tail(c.log(), 20)
        );
    }
}

/// Checks that every one of `children` is still running (see
/// [`assert_all_running`]), then stops each gracefully, waiting up to
/// `timeout` apiece.
pub fn stop_all(children: &mut [RelayChild], timeout: Duration, context: &str) {
    assert_all_running(children, context);
    for c in children {
        c.stop(timeout)
            .unwrap_or_else(|e| panic!("{context}: stopping relay {}: {e}", c.worker()));
    }
}

impl Drop for RelayChild {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.kill();
        }
    }
}
