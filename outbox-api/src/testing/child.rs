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

/// For a test binary without the standard harness (`harness = false`):
/// whether its one test, `name`, is selected by the command line as the
/// standard harness reads it — name filters (substrings, or whole names
/// with `--exact`), `--skip NAME`, `--ignored` (this test is not ignored),
/// `--list`. When it is not to run, prints what the standard harness
/// prints (`name: test` for `--list`, else `running 0 tests` and a result
/// line), so that `cargo test FILTER` and `cargo test -- --list` treat it
/// like any other test binary.
pub fn selected(name: &str) -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let (mut exact, mut list, mut ignored_only) = (false, false, false);
    let mut words = args.iter();
    while let Some(word) = words.next() {
        match word.as_str() {
            "--list" => list = true,
            "--exact" => exact = true,
            "--ignored" => ignored_only = true,
            "--skip" => skips.extend(words.next().cloned()),
            // Flags that take a value.
            "--test-threads" | "--color" | "--format" | "--logfile" | "-Z" | "--shuffle-seed" => {
                words.next();
            }
            w if w.starts_with("--skip=") => skips.push(w["--skip=".len()..].to_owned()),
            w if w.starts_with('-') => {}
            w => filters.push(w.to_owned()),
        }
    }
    let hits = |pattern: &String| {
        if exact {
            name == pattern
        } else {
            name.contains(pattern.as_str())
        }
    };
    let chosen = (filters.is_empty() || filters.iter().any(hits))
        && !skips.iter().any(hits)
        && !ignored_only;
    if list {
        if chosen {
            println!("{name}: test");
        }
        return false;
    }
    if !chosen {
        println!(
            "\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out\n"
        );
    }
    chosen
}
