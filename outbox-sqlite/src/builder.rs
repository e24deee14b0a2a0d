//! [`SqliteStoreBuilder`]: configuring and opening a [`SqliteStore`], and
//! the connection settings every store connection shares.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use outbox_api::{Clock, Error, Result, SystemClock};
use rusqlite::{Connection, OpenFlags};

use crate::checkpoint::{Checkpointer, DEFAULT_CHECKPOINT_PAGES};
use crate::files::{Cell, SqliteFiles};
use crate::listener::Signals;
use crate::lock_wait;
use crate::outbox::SqliteOutbox;
use crate::schema::{self, Sql};
use crate::store::{Inner, SqliteStore};

/// How long a statement waits for another connection's write lock.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a listener checks `PRAGMA data_version` for commits by other
/// connections and processes.
pub const DEFAULT_CHANGE_POLL: Duration = Duration::from_millis(2);

/// Configures and opens a [`SqliteStore`]; see [`SqliteStore::builder`].
pub struct SqliteStoreBuilder {
    pub(crate) path: PathBuf,
    pub(crate) table: String,
    pub(crate) inbox_table: String,
    clock: Arc<dyn Clock>,
    busy_timeout: Duration,
    change_poll: Duration,
    checkpoint_pages: u32,
    files: Option<SqliteFiles>,
}

impl std::fmt::Debug for SqliteStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStoreBuilder")
            .field("path", &self.path)
            .field("table", &self.table)
            .field("inbox_table", &self.inbox_table)
            .field("busy_timeout", &self.busy_timeout)
            .field("change_poll", &self.change_poll)
            .field("checkpoint_pages", &self.checkpoint_pages)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl SqliteStoreBuilder {
    /// The outbox table's name (default `outbox`): one outbox per module or
    /// database. The same rules on every store
    /// ([`validate_table_name`](outbox_api::backend::validate_table_name)):
    /// lower-case letters, digits and `_`, at most 48 characters.
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

    /// How long the store's statements wait for a write lock held by another
    /// connection (default 5 s) before failing with an `Unavailable` error.
    /// They try again every 50 µs at first, the pause growing to 1 ms, not
    /// after SQLite's own 1, 2, 5, 10 … ms sleeps.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// How often listeners look for commits made by other connections and
    /// processes (default 2 ms; one cheap `PRAGMA data_version` each time).
    pub fn change_poll_interval(mut self, interval: Duration) -> Self {
        self.change_poll = interval;
        self
    }

    /// The WAL size, in pages, at which the store checkpoints the WAL on a
    /// background thread with a connection of its own (default 250, a
    /// quarter of SQLite's `wal_autocheckpoint`). The store's own commits
    /// then never checkpoint, so a relay never waits for one, and while the
    /// relay writes, the WAL is checkpointed before the application's
    /// commits reach their own threshold and checkpoint it inside a COMMIT
    /// (`docs/latency.md`). `0` leaves checkpoints to SQLite: the store's
    /// connection checkpoints on its commits like any other.
    pub fn checkpoint_pages(mut self, pages: u32) -> Self {
        self.checkpoint_pages = pages;
        self
    }

    /// Opens the store's connection only when a call needs it, within
    /// `files`' bound on open connections shared with other stores, and
    /// closes it when idle: for a fleet of outboxes in a file each (see
    /// [`SqliteFiles`] for what such a store gives up: its relay sees
    /// other processes' commits at its next poll, and SQLite checkpoints
    /// the WAL as it does for any connection).
    pub fn open_through(mut self, files: &SqliteFiles) -> Self {
        self.files = Some(files.clone());
        self
    }

    /// Validates the configuration and opens the database (creating the
    /// file if needed) in WAL mode. Does not create tables: call
    /// [`SqliteStore::migrate`].
    pub async fn connect(self) -> Result<SqliteStore> {
        let sql = Sql::new(&self.table, &self.inbox_table)?;
        if self.change_poll.is_zero() {
            return Err(Error::config(
                "change_poll_interval",
                "must be greater than zero",
            ));
        }
        let path = self.path.clone();
        let busy = self.busy_timeout;
        let files = self.files.clone();
        let (cell, checkpointer) = tokio::task::spawn_blocking(move || {
            let Some(files) = files else {
                let conn = store_connection(&path, busy)?;
                let checkpointer = (self.checkpoint_pages > 0)
                    .then(|| Checkpointer::new(&conn, &path, busy, self.checkpoint_pages));
                return Ok::<_, Error>((Cell::new(Some(conn)), checkpointer));
            };
            // Opened now (the file created, in WAL mode), and closed when
            // idle like any other of `files`'.
            let cell = Cell::new(None);
            let mut slot = cell.lock();
            files.admit(&cell, &mut slot, || store_connection(&path, busy))?;
            files.used(&mut slot);
            drop(slot);
            Ok((cell, None))
        })
        .await
        .map_err(|e| Error::backend(format!("opening the SQLite database: {e}")))??;
        let canonical = std::fs::canonicalize(&self.path).unwrap_or_else(|_| self.path.clone());
        let signals = shared_signals(&canonical, &sql.outbox);
        let sql = Arc::new(sql);
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                path: self.path,
                conn: cell,
                files: self.files,
                checkpointer,
                outbox: SqliteOutbox::new(Arc::clone(&sql), signals.clone(), self.clock),
                sql,
                signals,
                busy_timeout: self.busy_timeout,
                change_poll: self.change_poll,
            }),
        })
    }
}

/// One in-process signal per (database file, outbox table), shared by every
/// store and outbox handle opened on it in this process.
fn shared_signals(path: &Path, table: &str) -> Signals {
    static WAKEUPS: OnceLock<Mutex<HashMap<(PathBuf, String), Signals>>> = OnceLock::new();
    let mut map = WAKEUPS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    map.entry((path.to_owned(), table.to_owned()))
        .or_default()
        .clone()
}

/// Opens a store's own connection: [`open_connection`] as a writer, with
/// lock waits in short steps (`lock_wait`) up to `busy`.
pub(crate) fn store_connection(path: &Path, busy: Duration) -> Result<Connection> {
    let conn = open_connection(path, busy, true)?;
    lock_wait::install(&conn).map_err(|e| {
        Error::unavailable(format!(
            "cannot configure SQLite database `{}`",
            path.display()
        ))
        .with_source(e)
    })?;
    Ok(conn)
}

/// Opens a connection with the settings every store connection uses.
pub(crate) fn open_connection(path: &Path, busy: Duration, writer: bool) -> Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let fail = |e: rusqlite::Error| {
        Error::unavailable(format!("cannot open SQLite database `{}`", path.display()))
            .with_source(e)
    };
    let conn = Connection::open_with_flags(path, flags).map_err(fail)?;
    conn.busy_timeout(busy).map_err(fail)?;
    if writer {
        // WAL lets the relay claim while the application writes; it is a
        // property of the file, so the application's connections get it too.
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(fail)?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(path = %path.display(), mode, "SQLite database is not in WAL mode");
        }
        conn.execute_batch("PRAGMA synchronous = NORMAL")
            .map_err(fail)?;
    }
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

impl SqliteStore {
    /// Opens the database at `path` with the default table names.
    pub async fn connect(path: impl AsRef<Path>) -> Result<SqliteStore> {
        Self::builder(path).connect().await
    }

    /// A builder for the database at `path`: table names, clock, timeouts.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_owned(),
            table: schema::DEFAULT_OUTBOX_TABLE.to_owned(),
            inbox_table: schema::DEFAULT_INBOX_TABLE.to_owned(),
            clock: Arc::new(SystemClock),
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            change_poll: DEFAULT_CHANGE_POLL,
            checkpoint_pages: DEFAULT_CHECKPOINT_PAGES,
            files: None,
        }
    }
}
