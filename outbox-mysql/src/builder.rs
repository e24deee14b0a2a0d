//! [`MySqlStoreBuilder`]: the configuration of a [`MySqlStore`], connecting,
//! and the server check (a version with `SKIP LOCKED`).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use outbox_api::backend::redact_url;
use outbox_api::{Clock, Error, ErrorKind, Result, SystemClock};
use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

use crate::error::{connecting, password_of, scrub};
use crate::schema::{self, Names};
use crate::store::{MySqlStore, Tuning};

/// How many connections a store opens at most (relays, operators and the
/// commit watcher share them).
pub const DEFAULT_MAX_CONNECTIONS: u32 = 8;
/// How long connecting, or waiting for a free connection, may take.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The listener's poll interval right after it saw another process's
/// commit.
pub const DEFAULT_POLL_FAST: Duration = Duration::from_millis(5);
/// The listener's poll interval once nothing has changed for a while.
pub const DEFAULT_POLL_IDLE: Duration = Duration::from_millis(200);

/// Configures and connects a [`MySqlStore`]; see [`MySqlStore::builder`].
pub struct MySqlStoreBuilder {
    pub(crate) url: String,
    pub(crate) table: String,
    pub(crate) inbox_table: String,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) max_connections: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) poll_fast: Duration,
    pub(crate) poll_idle: Duration,
}

impl std::fmt::Debug for MySqlStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStoreBuilder")
            .field("url", &redact_url(&self.url))
            .field("table", &self.table)
            .field("inbox_table", &self.inbox_table)
            .field("max_connections", &self.max_connections)
            .field("poll_fast", &self.poll_fast)
            .field("poll_idle", &self.poll_idle)
            .finish_non_exhaustive()
    }
}

/// `mysql://user@host:port/database`, never with a password.
pub(crate) fn describe(o: &MySqlConnectOptions) -> String {
    format!(
        "mysql://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().unwrap_or("")
    )
}

/// The server family and version, from `SELECT VERSION()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerVersion {
    /// Whether the server is MariaDB (else MySQL or a compatible server).
    pub mariadb: bool,
    /// Major, minor and patch numbers.
    pub number: (u32, u32, u32),
    /// The text the server reported.
    pub text: String,
}

impl ServerVersion {
    /// Reads what `SELECT VERSION()` answered (`10.11.6-MariaDB-0+deb12u1`,
    /// `8.0.36`, MariaDB's `5.5.5-10.11.6-MariaDB` of old replication
    /// handshakes).
    pub fn parse(text: &str) -> Option<ServerVersion> {
        let mariadb = text.to_ascii_lowercase().contains("mariadb");
        let core = if mariadb {
            text.strip_prefix("5.5.5-").unwrap_or(text)
        } else {
            text
        };
        let mut parts = core
            .split(|c: char| !c.is_ascii_digit())
            .filter(|p| !p.is_empty())
            .map(|p| p.parse::<u32>().ok());
        let major = parts.next()??;
        let minor = parts.next().flatten().unwrap_or(0);
        let patch = parts.next().flatten().unwrap_or(0);
        Some(ServerVersion {
            mariadb,
            number: (major, minor, patch),
            text: text.to_owned(),
        })
    }

    /// The first version of the family with `FOR UPDATE SKIP LOCKED`:
    /// MariaDB 10.6, MySQL 8.0.
    pub fn skip_locked_since(&self) -> (u32, u32) {
        if self.mariadb { (10, 6) } else { (8, 0) }
    }

    /// Refuses a server older than [`skip_locked_since`](Self::skip_locked_since),
    /// naming its version.
    pub fn check(&self) -> Result<()> {
        let (major, minor) = self.skip_locked_since();
        if (self.number.0, self.number.1) < (major, minor) {
            let family = if self.mariadb { "MariaDB" } else { "MySQL" };
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "the server is {family} {} (`{}`); outbox-mysql needs {family} {major}.{minor} \
                     or newer (`SELECT … FOR UPDATE SKIP LOCKED`)",
                    format_args!("{}.{}.{}", self.number.0, self.number.1, self.number.2),
                    self.text
                ),
            ));
        }
        Ok(())
    }
}

impl MySqlStoreBuilder {
    /// The outbox table's name (default `outbox`), by the rules of every
    /// store ([`validate_table_name`](outbox_api::backend::validate_table_name)):
    /// lower-case letters, digits and `_`, at most 48 characters. The
    /// store also creates `<table>_keys`, its per-key lock table.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The inbox table's name (default `outbox_inbox`), validated like
    /// [`table`](Self::table).
    pub fn inbox_table(mut self, name: impl Into<String>) -> Self {
        self.inbox_table = name.into();
        self
    }

    /// Where enqueue timestamps come from (default: the wall clock). Give it
    /// the relay's clock in tests that move time.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How many connections the store opens at most (default 8).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long connecting, or waiting for a free connection, may take
    /// before an `Unavailable` error (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The listener's poll for other processes' commits: every `fast`
    /// after it saw one, doubling with each quiet read up to `idle`
    /// (defaults [`DEFAULT_POLL_FAST`], 5 ms, and [`DEFAULT_POLL_IDLE`],
    /// 200 ms). A commit in another process reaches a relay within `fast`
    /// (plus a claim) while messages flow and within `idle` after a quiet
    /// spell; in-process commits wake it at once either way.
    pub fn poll_interval(mut self, fast: Duration, idle: Duration) -> Self {
        self.poll_fast = fast;
        self.poll_idle = idle;
        self
    }

    /// Validates the configuration, connects and checks the server (MariaDB
    /// 10.6+ or MySQL 8.0+). Does not create tables: call
    /// [`MySqlStore::migrate`].
    pub async fn connect(self) -> Result<MySqlStore> {
        let names = Names::new(&self.table, &self.inbox_table)?;
        for (field, value) in [
            ("poll_interval", self.poll_fast),
            ("connect_timeout", self.connect_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::config(field, "must be greater than zero"));
            }
        }
        if self.poll_idle < self.poll_fast {
            return Err(Error::config(
                "poll_interval",
                "the idle interval must not be shorter than the fast one",
            ));
        }
        if self.max_connections == 0 {
            return Err(Error::config("max_connections", "must be at least 1"));
        }
        let display = redact_url(&self.url);
        let password = password_of(&self.url);
        let scheme = self.url.split_once("://").map(|(s, _)| s);
        if !matches!(scheme, Some("mysql" | "mariadb")) {
            return Err(Error::config(
                "url",
                format!("`{display}` is not a MySQL URL (expected mysql://… or mariadb://…)"),
            ));
        }
        let options = MySqlConnectOptions::from_str(&self.url).map_err(|e| {
            Error::config(
                "url",
                format!(
                    "`{display}` is not a valid MySQL URL: {}",
                    scrub(&e.to_string(), password)
                ),
            )
        })?;
        let display = describe(&options);
        let pool = MySqlPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.connect_timeout)
            // A broken connection surfaces as an error on use, and the
            // relay retries: no ping before every statement.
            .test_before_acquire(false)
            // Every statement of the store runs at READ COMMITTED: no gap
            // or next-key locks on the ranges it reads, so that claims,
            // completions and purges never block the application's
            // inserts (the claim sets it for its transaction too).
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .map_err(|e| connecting(e, &display, password))?;
        let text: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&pool)
            .await
            .map_err(|e| connecting(e, &display, password))?;
        let server = ServerVersion::parse(&text).ok_or_else(|| {
            Error::backend(format!(
                "the server at `{display}` reported a version `{text}` this crate cannot read"
            ))
        })?;
        server.check()?;
        Ok(MySqlStore::assemble(
            pool,
            display,
            names,
            self.clock,
            server,
            Tuning {
                poll_fast: self.poll_fast,
                poll_idle: self.poll_idle,
            },
        ))
    }
}

impl MySqlStore {
    /// A builder for the database at `url`
    /// (`mysql://user:password@host:port/database` or `mariadb://…`): table
    /// names, clock, pool size, poll. The store opens a pool of its own.
    pub fn builder(url: impl Into<String>) -> MySqlStoreBuilder {
        MySqlStoreBuilder {
            url: url.into(),
            table: schema::DEFAULT_OUTBOX_TABLE.to_owned(),
            inbox_table: schema::DEFAULT_INBOX_TABLE.to_owned(),
            clock: Arc::new(SystemClock),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            poll_fast: DEFAULT_POLL_FAST,
            poll_idle: DEFAULT_POLL_IDLE,
        }
    }

    /// Connects to the database at `url` with the default table names.
    pub async fn connect(url: &str) -> Result<MySqlStore> {
        Self::builder(url).connect().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_versions_are_read_and_old_ones_refused_by_name() {
        let maria = ServerVersion::parse("10.11.19-MariaDB-0+deb12u1").unwrap();
        assert!(maria.mariadb);
        assert_eq!(maria.number, (10, 11, 19));
        maria.check().unwrap();
        let old = ServerVersion::parse("5.5.5-10.5.23-MariaDB").unwrap();
        assert_eq!(old.number, (10, 5, 23));
        let e = old.check().unwrap_err();
        assert!(e.to_string().contains("MariaDB 10.5.23"), "{e}");
        assert!(e.to_string().contains("10.6 or newer"), "{e}");
        ServerVersion::parse("8.0.36").unwrap().check().unwrap();
        let mysql57 = ServerVersion::parse("5.7.44-log").unwrap();
        assert!(!mysql57.mariadb);
        let e = mysql57.check().unwrap_err();
        assert!(e.to_string().contains("MySQL 5.7.44"), "{e}");
        assert!(e.to_string().contains("8.0 or newer"), "{e}");
        assert_eq!(ServerVersion::parse("garbage"), None);
    }

    #[tokio::test]
    async fn urls_of_other_databases_and_bad_names_are_refused_before_connecting() {
        for (url, table, needle) in [
            ("postgres://u:secretpw@h/db", "outbox", "is not a MySQL URL"),
            (
                "mysql://u:secretpw@h/db",
                "Bad Name",
                "not a valid identifier",
            ),
            ("mysql://u:secretpw@h/db", "pg_x", "reserved"),
        ] {
            let e = MySqlStore::builder(url)
                .table(table)
                .connect()
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{e}");
            assert!(e.to_string().contains(needle), "{needle}: {e}");
            assert!(!e.to_string().contains("secretpw"), "{e}");
            assert!(!format!("{e:?}").contains("secretpw"), "{e:?}");
        }
        let b = MySqlStore::builder("mysql://u:secretpw@h/db");
        assert!(!format!("{b:?}").contains("secretpw"));
    }
}
