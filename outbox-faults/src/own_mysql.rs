//! [`OwnMySql`]: a MariaDB (or MySQL) server of the test's own, that the
//! test may crash and start again: the locally installed server in a
//! temporary directory ([`LocalMariaDb`]), or a container of its own
//! ([`OwnContainer`]) — with `OUTBOX_TEST_SERVICES=containers`, or where no
//! server binaries are installed and a Docker engine answers.
//!
//! As with [`OwnPostgres`](crate::own_postgres::OwnPostgres), a test that
//! crashes a server never does it to the shared one (`OUTBOX_MYSQL_URL`, or
//! 127.0.0.1:3306). [`LocalMariaDb::new`] finds `mariadb-install-db` and
//! `mariadbd` ([`server_binaries`]), initialises a data directory in a
//! fresh temporary directory (`root` without a password, as the `mysql`
//! user when the test runs as root, since the server refuses root), and
//! starts the server on a free port of 127.0.0.1, ignoring every option
//! file (`--no-defaults`), with InnoDB's durable commits
//! (`innodb_flush_log_at_trx_commit=1`, the default, stated) and the
//! database [`DATABASE`]. [`crash`](OwnMySql::crash) is SIGKILL to the
//! server: the next [`start`](OwnMySql::start) recovers from InnoDB's redo
//! log. Dropping the guard kills the server and removes the directory, also
//! when the test panics.

use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_api::testing::containers::OwnContainer;
use outbox_api::testing::services::Mode;

use crate::own_postgres::{effective_uid_is_root, free_port, said};

/// The database every own server has, which [`OwnMySql::url`] names.
pub const DATABASE: &str = "test";

/// How long a start (or recovery) may take before it counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The server options of every own server besides its port and
/// directories: durable commits, room for many relays.
const SERVER_OPTIONS: &[&str] = &[
    "--innodb-flush-log-at-trx-commit=1",
    "--max-connections=300",
    "--skip-name-resolve",
];

/// A MariaDB/MySQL server of the test's own: local binaries or a container
/// (see the module's documentation). Dropping it stops and removes it.
#[derive(Debug)]
pub enum OwnMySql {
    /// The locally installed server, in a temporary directory.
    Local(LocalMariaDb),
    /// A container of the test's own.
    Container(Box<OwnContainer>),
}

impl OwnMySql {
    /// Starts a server of the test's own with the database [`DATABASE`]:
    /// a container when `OUTBOX_TEST_SERVICES=containers`, else the local
    /// binaries, else a container when a Docker engine answers. `Err`
    /// names what failed, or every way to provide one.
    pub fn new() -> Result<OwnMySql, String> {
        let container = || {
            OwnContainer::start_new(&outbox_mysql::testing::MYSQL, SERVER_OPTIONS)
                .map(|c| OwnMySql::Container(Box::new(c)))
        };
        if Mode::from_env()? == Mode::Containers {
            return container();
        }
        match server_binaries() {
            Ok(_) => LocalMariaDb::new().map(OwnMySql::Local),
            Err(no_binaries) => container().map_err(|no_container| {
                format!("{no_binaries}; or run a Docker engine for a container of its own ({no_container})")
            }),
        }
    }

    /// The URL of the database [`DATABASE`], as `root` without a password.
    pub fn url(&self) -> String {
        match self {
            OwnMySql::Local(s) => s.url(),
            OwnMySql::Container(c) => c.url().to_owned(),
        }
    }

    /// The server's whole log, every start.
    pub fn log_text(&self) -> String {
        match self {
            OwnMySql::Local(s) => std::fs::read_to_string(s.log()).unwrap_or_default(),
            OwnMySql::Container(c) => c.logs().unwrap_or_else(|e| format!("(no log: {e})")),
        }
    }

    /// The last `n` lines of the server's log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Crashes the server: SIGKILL, every connection ends at once and
    /// nothing is flushed on the way out.
    pub fn crash(&mut self) -> Result<(), String> {
        match self {
            OwnMySql::Local(s) => s.crash(),
            OwnMySql::Container(c) => c.crash(),
        }
    }

    /// Starts the server after a [`crash`](Self::crash) (InnoDB recovers
    /// from its redo log) and waits until it accepts connections.
    pub fn start(&mut self) -> Result<(), String> {
        match self {
            OwnMySql::Local(s) => s.start(),
            OwnMySql::Container(c) => c.start(),
        }
    }
}

/// `mariadb-install-db` and the server (`mariadbd`, else `mysqld`), from
/// `PATH`, `/usr/sbin` or `/usr/bin`. `Err` says how to install them.
pub fn server_binaries() -> Result<(PathBuf, PathBuf), String> {
    let find = |names: &[&str]| -> Option<PathBuf> {
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.extend(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from));
        names
            .iter()
            .flat_map(|n| dirs.iter().map(move |d| d.join(n)))
            .find(|p| p.is_file())
    };
    match (
        find(&["mariadb-install-db", "mysql_install_db"]),
        find(&["mariadbd", "mysqld"]),
    ) {
        (Some(install), Some(server)) => Ok((install, server)),
        _ => Err(
            "no MariaDB server binaries found: neither `mariadb-install-db` nor \
                  `mariadbd` is on PATH or in /usr/sbin. This test runs a server of its own: \
                  install one (on Debian or Ubuntu: `apt-get install mariadb-server`)"
                .to_owned(),
        ),
    }
}

/// A MariaDB server in a temporary directory, listening on 127.0.0.1 only,
/// `root` without a password.
///
/// Dropping it kills the server and removes its directory, so that a test
/// never leaves a server behind — also when it panics.
#[derive(Debug)]
pub struct LocalMariaDb {
    server: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    /// Whether the server runs as the `mysql` user (the test runs as root).
    as_mysql: bool,
    /// The running server, until it is crashed.
    child: Option<Child>,
}

impl LocalMariaDb {
    /// Initialises a data directory in a new temporary directory, starts
    /// the server on a free port of 127.0.0.1 and creates [`DATABASE`].
    ///
    /// `Err` names what failed: no server binaries (and how to install
    /// them), `mariadb-install-db`, or the start (with the end of the
    /// server's log).
    pub fn new() -> Result<LocalMariaDb, String> {
        let (install, server) = server_binaries()?;
        let as_mysql = effective_uid_is_root();
        // As root the server runs as `mysql`, which must reach the
        // directory: under /tmp, not under a TMPDIR that may be root's own.
        let base = if as_mysql {
            PathBuf::from("/tmp")
        } else {
            std::env::temp_dir()
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-own-mariadb-")
            .tempdir_in(&base)
            .map_err(|e| format!("creating a temporary directory in {}: {e}", base.display()))?;
        let mut db = LocalMariaDb {
            server,
            dir,
            port: free_port()?,
            as_mysql,
            child: None,
        };
        std::fs::write(
            db.dir.path().join("init.sql"),
            format!("CREATE DATABASE IF NOT EXISTS `{DATABASE}`;\n"),
        )
        .map_err(|e| format!("writing the server's init file: {e}"))?;
        if as_mysql {
            let out = Command::new("chown")
                .args(["-R", "mysql:"])
                .arg(db.dir.path())
                .output()
                .map_err(|e| format!("running chown: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "`chown -R mysql: {}` failed ({}): {} — running as root, the test runs \
                     the server as the user `mysql`, which must exist",
                    db.dir.path().display(),
                    out.status,
                    said(&out)
                ));
            }
        }
        let mut command = Command::new(&install);
        // --no-defaults must come first: no option file of the machine's.
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", db.data_dir().display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
        if as_mysql {
            command.arg("--user=mysql");
        }
        let out = command
            .current_dir(db.dir.path())
            .output()
            .map_err(|e| format!("running {}: {e}", install.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} failed ({}): {}",
                install.display(),
                out.status,
                said(&out)
            ));
        }
        db.start()?;
        Ok(db)
    }

    /// The URL of [`DATABASE`] on this server, as `root`, no password.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The server's error log, every start.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Starts the server (after [`new`](Self::new) did once, or after a
    /// [`crash`](Self::crash): then InnoDB first recovers) and waits until
    /// it has logged that it is ready and answers on its port, for up to
    /// two minutes. `Err` includes the end of the server's log.
    pub fn start(&mut self) -> Result<(), String> {
        let readies = |log: &Path| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .matches("ready for connections")
                .count()
        };
        let before = readies(&self.log());
        let dir = self.dir.path();
        let mut command = Command::new(&self.server);
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data_dir().display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("server.sock").display()))
            .arg(format!("--pid-file={}", dir.join("server.pid").display()))
            .arg(format!("--log-error={}", self.log().display()))
            .arg(format!("--init-file={}", dir.join("init.sql").display()))
            .args(SERVER_OPTIONS);
        if self.as_mysql {
            command.arg("--user=mysql");
        }
        let child = command
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("running {}: {e}", self.server.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!(
                    "the server exited ({status}) while starting; its log ends:\n{}",
                    crate::check::log_tail(&self.log(), 30)
                ));
            }
            if readies(&self.log()) > before && answers(self.port) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the server on port {} was not ready within {START_TIMEOUT:?}; its log \
                     ends:\n{}",
                    self.port,
                    crate::check::log_tail(&self.log(), 30)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Crashes the server: SIGKILL, and waits until it is gone.
    pub fn crash(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Err("the server is not running".into());
        };
        child
            .kill()
            .map_err(|e| format!("killing the server: {e}"))?;
        child
            .wait()
            .map(drop)
            .map_err(|e| format!("waiting for the killed server: {e}"))
    }
}

/// Whether a server answers on 127.0.0.1:`port` with its greeting (a
/// connection the server accepted sends one at once).
fn answers(port: u16) -> bool {
    let Ok(mut stream) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut greeting = [0u8; 5];
    stream.read_exact(&mut greeting).is_ok()
}

impl Drop for LocalMariaDb {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.crash();
        }
    }
}
