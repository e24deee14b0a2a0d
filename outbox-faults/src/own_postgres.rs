//! [`OwnPostgres`]: a PostgreSQL server of the test's own, that the test
//! may crash and start again: the locally installed server in a temporary
//! directory ([`LocalPostgres`]), or a container of its own
//! ([`OwnContainer`]) — with `OUTBOX_TEST_SERVICES=containers`, or where no
//! server binaries are installed and a Docker engine answers.
//!
//! A test that stops, restarts or crashes a server must never do it to a
//! server others use (the shared one of `OUTBOX_PG_URL`, other tests'
//! schemas on it): it starts its own. [`OwnPostgres::new`] finds the
//! server binaries ([`server_binaries`]), runs `initdb` in a fresh
//! temporary directory (as the `postgres` user when the test runs as root,
//! since `initdb` refuses root), starts the server on a free port of
//! 127.0.0.1 with `fsync=on`, and creates the database `test`.
//! [`crash`](OwnPostgres::crash) is `pg_ctl stop -m immediate` — every
//! server process quits at once, without a checkpoint, so the next
//! [`start`](OwnPostgres::start) recovers by replaying the WAL, as after a
//! power cut of the server alone (the operating system's page cache
//! survives). Dropping the guard stops the server the same way and removes
//! the directory, also when the test panics.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use outbox_api::testing::containers::OwnContainer;
use outbox_api::testing::services::Mode;

/// A PostgreSQL server of the test's own: local binaries or a container
/// (see the module's documentation). Dropping it stops and removes it.
#[derive(Debug)]
pub enum OwnPostgres {
    /// The locally installed server, in a temporary directory.
    Local(LocalPostgres),
    /// A container of the test's own.
    Container(Box<OwnContainer>),
}

/// The server options of every own server: `fsync` on (a crash must lose
/// only what was never flushed) and room for many relays.
const CONTAINER_OPTIONS: &[&str] = &["postgres", "-c", "fsync=on", "-c", "max_connections=200"];

impl OwnPostgres {
    /// Starts a server of the test's own with the database [`DATABASE`]:
    /// a container when `OUTBOX_TEST_SERVICES=containers`, else the local
    /// binaries, else a container when a Docker engine answers. `Err`
    /// names what failed, or every way to provide one.
    pub fn new() -> Result<OwnPostgres, String> {
        let container = || {
            OwnContainer::start_new(&outbox_postgres::testing::POSTGRES, CONTAINER_OPTIONS)
                .map(|c| OwnPostgres::Container(Box::new(c)))
        };
        if Mode::from_env()? == Mode::Containers {
            return container();
        }
        match server_binaries() {
            Ok(_) => LocalPostgres::new().map(OwnPostgres::Local),
            Err(no_binaries) => container().map_err(|no_container| {
                format!("{no_binaries}; or run a Docker engine for a container of its own ({no_container})")
            }),
        }
    }

    /// The URL of the database [`DATABASE`], as user `postgres`, no password.
    pub fn url(&self) -> String {
        match self {
            OwnPostgres::Local(s) => s.url(),
            OwnPostgres::Container(c) => c.url().to_owned(),
        }
    }

    /// The server's whole log, every start.
    pub fn log_text(&self) -> String {
        match self {
            OwnPostgres::Local(s) => s.log_text(),
            OwnPostgres::Container(c) => c.logs().unwrap_or_else(|e| format!("(no log: {e})")),
        }
    }

    /// The last `n` lines of the server's log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        match self {
            OwnPostgres::Local(s) => s.log_tail(n),
            OwnPostgres::Container(_) => {
                let text = self.log_text();
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(n)..].join("\n")
            }
        }
    }

    /// Crashes the server: every server process ends at once, without a
    /// checkpoint (`pg_ctl stop -m immediate`; SIGKILL to a container).
    pub fn crash(&mut self) -> Result<(), String> {
        match self {
            OwnPostgres::Local(s) => s.crash(),
            OwnPostgres::Container(c) => c.crash(),
        }
    }

    /// Starts the server after a [`crash`](Self::crash) (it recovers by
    /// replaying the WAL) and waits until it accepts connections.
    pub fn start(&mut self) -> Result<(), String> {
        match self {
            OwnPostgres::Local(s) => s.start(),
            OwnPostgres::Container(c) => c.start(),
        }
    }

    /// Restarts the server cleanly (a fast shutdown: sessions ended, a
    /// checkpoint written) and waits until it accepts connections again.
    pub fn restart(&mut self) -> Result<(), String> {
        match self {
            OwnPostgres::Local(s) => s.restart(),
            OwnPostgres::Container(c) => c.restart(),
        }
    }
}

/// The database [`OwnPostgres::new`] creates, which [`OwnPostgres::url`]
/// names.
pub const DATABASE: &str = "test";

/// How long starting (or recovering) may take before it counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The directory holding the PostgreSQL server binaries (`initdb`,
/// `pg_ctl`, `postgres`): `pg_config --bindir` if it has `initdb`, else the
/// highest version's `/usr/lib/postgresql/<version>/bin`. `Err` says how to
/// provide one.
pub fn server_binaries() -> Result<PathBuf, String> {
    let has_server = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        if out.status.success() {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if has_server(&dir) {
                return Ok(dir);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_server(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        "no PostgreSQL server binaries found: neither `pg_config --bindir` nor \
         /usr/lib/postgresql/<version>/bin holds `initdb` and `pg_ctl`. This test runs a \
         server of its own: install one (on Debian or Ubuntu: `apt-get install postgresql`), \
         or put the `pg_config` of an installation that has its server binaries on PATH"
            .to_owned()
    })
}

/// Whether this process runs with effective user id 0 (root): from
/// `/proc/self/status`, else from `id -u`.
pub(crate) fn effective_uid_is_root() -> bool {
    let from_proc = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            // "Uid:\t<real>\t<effective>\t<saved>\t<filesystem>"
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            line.split_whitespace().nth(2)?.parse::<u32>().ok()
        });
    let uid = from_proc.or_else(|| {
        let out = Command::new("id").arg("-u").output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    });
    uid == Some(0)
}

/// A free TCP port on 127.0.0.1 (bound and released at once; the server
/// binds it a moment later).
pub(crate) fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| format!("finding a free port on 127.0.0.1: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port on 127.0.0.1: {e}"))
}

/// What a finished command said, for error messages.
pub(crate) fn said(out: &Output) -> String {
    let mut text = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !stdout.trim().is_empty() {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(stdout.trim());
    }
    text
}

/// A PostgreSQL server in a temporary directory, listening on 127.0.0.1
/// only, trusting every local connection (user `postgres`, no password).
///
/// Dropping it stops the server (`pg_ctl stop -m immediate`) and removes
/// its directory, so that a test never leaves a server behind — also when
/// it panics.
#[derive(Debug)]
pub struct LocalPostgres {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    /// Whether the server's commands run as the `postgres` user (the test
    /// runs as root).
    as_postgres: bool,
    /// Whether the server was started and not crashed since.
    running: bool,
}

impl LocalPostgres {
    /// Initialises a cluster in a new temporary directory, starts it on a
    /// free port of 127.0.0.1 and creates the database [`DATABASE`].
    ///
    /// `Err` names what failed: no server binaries (and how to install
    /// them), `initdb`, the start (with the end of the server's log), or
    /// creating the database.
    pub fn new() -> Result<LocalPostgres, String> {
        let bin = server_binaries()?;
        let as_postgres = effective_uid_is_root();
        // As root the server runs as `postgres`, which must reach the
        // directory: under /tmp, not under a TMPDIR that may be root's own.
        let base = if as_postgres {
            PathBuf::from("/tmp")
        } else {
            std::env::temp_dir()
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-own-pg-")
            .tempdir_in(&base)
            .map_err(|e| format!("creating a temporary directory in {}: {e}", base.display()))?;
        let mut server = LocalPostgres {
            bin,
            dir,
            port: free_port()?,
            as_postgres,
            running: false,
        };
        if as_postgres {
            let out = Command::new("chown")
                .arg("postgres:")
                .arg(server.dir.path())
                .output()
                .map_err(|e| format!("running chown: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "`chown postgres: {}` failed ({}): {} — running as root, the test runs \
                     the server as the user `postgres`, which must exist",
                    server.dir.path().display(),
                    out.status,
                    said(&out)
                ));
            }
        }
        let data = server.data_dir();
        server.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "--auth=trust".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
            ],
        )?;
        server.start()?;
        let port = server.port.to_string();
        server
            .run(
                "createdb",
                &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", DATABASE]
                    .map(std::ffi::OsStr::new),
            )
            .map_err(|e| format!("{e}\nserver log ends:\n{}", server.log_tail(30)))?;
        Ok(server)
    }

    /// The URL of the database [`DATABASE`] on this server, as user
    /// `postgres` (no password: the server trusts local connections).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// The server's TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The server's log file.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// The server's whole log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    /// The last `n` lines of the server's log, for failure messages (the
    /// directory is gone once the guard is dropped).
    pub fn log_tail(&self, n: usize) -> String {
        crate::check::log_tail(&self.log(), n)
    }

    /// Starts the server (after [`new`](Self::new) did once, or after a
    /// [`crash`](Self::crash): then it first recovers by replaying the
    /// WAL) and waits until it accepts connections on its port, for up to
    /// two minutes. `Err` includes the end of the server's log.
    pub fn start(&mut self) -> Result<(), String> {
        let started = self.pg_ctl_up(&["start"]);
        // Running or not, a server may be up from here on: the guard stops it.
        self.running = true;
        started.map_err(|e| format!("{e}\nserver log ends:\n{}", self.log_tail(30)))?;
        self.wait_until_ready()
            .map_err(|e| format!("{e}\nserver log ends:\n{}", self.log_tail(30)))
    }

    /// Crashes the server: `pg_ctl stop -m immediate`. Every server process
    /// quits at once, without a checkpoint; what was committed but not yet
    /// flushed to the WAL on disk (asynchronous commits of the last few
    /// hundred milliseconds) is lost, and the next [`start`](Self::start)
    /// replays the WAL.
    pub fn crash(&mut self) -> Result<(), String> {
        let data = self.data_dir();
        let stopped = self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                "immediate".as_ref(),
                "-w".as_ref(),
                "stop".as_ref(),
            ],
        );
        if stopped.is_ok() {
            self.running = false;
        }
        stopped
            .map(drop)
            .map_err(|e| format!("crashing the server: {e}"))
    }

    /// Restarts the server cleanly (`pg_ctl restart -m fast`: sessions are
    /// ended, a checkpoint is written) and waits until it accepts
    /// connections again. `Err` includes the end of the server's log.
    pub fn restart(&mut self) -> Result<(), String> {
        self.pg_ctl_up(&["-m", "fast", "restart"])
            .and_then(|_| self.wait_until_ready())
            .map_err(|e| {
                format!(
                    "restarting the server: {e}\nserver log ends:\n{}",
                    self.log_tail(30)
                )
            })
    }

    /// `pg_ctl` bringing the server up (`start`, or `-m fast restart`, the
    /// words given last), with its data directory, log, options and a
    /// two-minute limit, waiting for the server to answer.
    fn pg_ctl_up(&self, action: &[&str]) -> Result<Output, String> {
        let (data, log) = (self.data_dir(), self.log());
        let options = self.options();
        let timeout = START_TIMEOUT.as_secs().to_string();
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "-D".as_ref(),
            data.as_os_str(),
            "-l".as_ref(),
            log.as_os_str(),
            "-o".as_ref(),
            options.as_ref(),
            "-t".as_ref(),
            timeout.as_ref(),
            "-w".as_ref(),
        ];
        args.extend(action.iter().map(std::ffi::OsStr::new));
        self.run("pg_ctl", &args)
    }

    /// The server's options: its port, socket directory, loopback only,
    /// `fsync` on.
    fn options(&self) -> String {
        format!(
            "-p {} -k '{}' -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=200",
            self.port,
            self.dir.path().display()
        )
    }

    /// Polls `pg_isready` on the server's TCP port until it says the server
    /// accepts connections.
    fn wait_until_ready(&self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let port = self.port.to_string();
        loop {
            let out = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres", "-d"])
                .arg("postgres")
                .output()
                .map_err(|e| format!("running pg_isready: {e}"))?;
            if out.status.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the server on port {port} did not accept connections within {:?} of its \
                     start: pg_isready says {}",
                    START_TIMEOUT,
                    said(&out)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs the server binary `program` with `args` — as the `postgres`
    /// user when the test runs as root — and fails, naming it and quoting
    /// its output, unless it exits with success.
    fn run(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<Output, String> {
        let exe = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        // The server binaries are in their own directory; a `cd` into the
        // cluster keeps `pg_ctl` away from a working directory that the
        // `postgres` user cannot read.
        command.args(args).current_dir(self.dir.path());
        let out = command
            .output()
            .map_err(|e| format!("running {}: {e}", exe.display()))?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(format!(
                "{program} failed ({}){}: {}",
                out.status,
                if self.as_postgres {
                    " as the user postgres"
                } else {
                    ""
                },
                said(&out)
            ))
        }
    }
}

impl Drop for LocalPostgres {
    fn drop(&mut self) {
        if !self.running {
            return;
        }
        if self.crash().is_ok() {
            return;
        }
        // pg_ctl could not stop it: SIGQUIT to the postmaster (an immediate
        // shutdown) by the pid in its lock file, so that no server outlives
        // its directory.
        let pid_file = self.data_dir().join("postmaster.pid");
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
        {
            let _ = Command::new("kill")
                .args(["-QUIT", &pid.to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while pid_file.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}
