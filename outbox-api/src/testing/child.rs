//! Child processes for tests that SIGKILL a consumer: the test binary runs
//! itself again (with a variable telling it to be the child), talks to it
//! through its stdout lines, and stops it by closing its stdin — or kills
//! it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// A running child process (this test binary again), and its stdout lines.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    lines: Receiver<String>,
    deadline: Duration,
}

impl ChildProcess {
    /// Runs this test binary again with `envs`, and waits for its line
    /// `ready`. Every wait on it lasts at most `deadline`.
    ///
    /// # Panics
    /// When it cannot be started or does not say `ready` in time.
    pub fn start(envs: &[(&str, &str)], ready: &str, deadline: Duration) -> ChildProcess {
        let mut command = Command::new(std::env::current_exe().expect("this test binary"));
        for (name, value) in envs {
            command.env(name, value);
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a child process");
        let stdout = child.stdout.take().expect("its stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let process = ChildProcess {
            child,
            lines,
            deadline,
        };
        process.wait_line(|line| line.trim() == ready);
        process
    }

    /// Waits (blocking) for a line `wanted` accepts, and returns it.
    ///
    /// # Panics
    /// When none comes within the deadline.
    pub fn wait_line(&self, wanted: impl Fn(&str) -> bool) -> String {
        let until = Instant::now() + self.deadline;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if wanted(&line) => return line,
                Ok(_) => {}
                Err(e) => panic!(
                    "child process: not the line waited for within {:?} ({e})",
                    self.deadline
                ),
            }
        }
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn sigkill(mut self) {
        self.child.kill().expect("SIGKILL");
        let _ = self.child.wait();
    }

    /// Closes its stdin (a graceful stop) and waits until it exited with
    /// success.
    ///
    /// # Panics
    /// When it fails or does not exit within the deadline.
    pub fn stop(mut self) {
        drop(self.child.stdin.take());
        let until = Instant::now() + self.deadline;
        loop {
            if let Some(status) = self.child.try_wait().expect("its status") {
                assert!(status.success(), "child process ended with {status}");
                return;
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                panic!("child process did not stop within {:?}", self.deadline);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Closes its stdin, then waits for a line `wanted` accepts (what it
    /// says as it stops) and for it to exit with success.
    ///
    /// # Panics
    /// As [`wait_line`](Self::wait_line) and [`stop`](Self::stop).
    pub fn stop_saying(mut self, wanted: impl Fn(&str) -> bool) -> String {
        drop(self.child.stdin.take());
        let line = self.wait_line(wanted);
        self.stop();
        line
    }
}

/// The child's side: returns once the parent closed this process's stdin
/// (a graceful stop).
///
/// # Panics
/// Outside a tokio runtime.
pub async fn until_stdin_closes() {
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin()
            .read_line(&mut line)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            line.clear();
        }
    })
    .await
    .expect("reading stdin");
}
