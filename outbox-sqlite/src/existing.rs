//! [`SqliteStoreBuilder::connect_existing`]: opening an outbox table that must
//! already exist, without ever creating or migrating anything — for
//! operators' tools (the `outbox` CLI), which must not leave a new file or
//! table behind a typo.
//!
//! [`SqliteStoreBuilder::connect`] creates a missing file and switches the
//! database to WAL mode, so before it runs, the file, the database and the
//! table are checked read-only.

use std::path::{Path, PathBuf};

use outbox_api::backend::{MIGRATIONS_TABLE, missing_outbox_columns};
use outbox_api::{Error, ErrorKind, Result};
use rusqlite::{Connection, OpenFlags};

use crate::{SqliteStore, SqliteStoreBuilder, schema};

impl SqliteStoreBuilder {
    /// Opens the outbox table of an **existing** database, creating and
    /// migrating nothing: the file must exist and be a SQLite database
    /// holding a table of this name with every outbox column. The errors
    /// say which is wrong: `ErrorKind::NotFound` (no such file, no such
    /// table — naming the outbox tables the database has —, a table that is
    /// not an outbox), `ErrorKind::Corrupt` (not a SQLite database),
    /// `ErrorKind::Config` (a name the stores refuse). The inbox table is
    /// not needed and not checked.
    pub async fn connect_existing(mut self) -> Result<SqliteStore> {
        schema::validate_table_name("table", &self.table)?;
        let path = check_file(&self.path)?;
        let (checked, table) = (path.clone(), self.table.clone());
        tokio::task::spawn_blocking(move || check_outbox_table(&checked, &table))
            .await
            .map_err(|e| Error::backend(format!("checking the database failed: {e}")))??;
        self.path = path;
        if self.inbox_table == self.table {
            self.inbox_table = outbox_api::backend::unused_inbox_table(&self.table).to_owned();
        }
        self.connect().await
    }
}

/// The file exists and is a regular file; returns its canonical path (which
/// also keeps SQLite from reading a relative `file:` path as a URI).
fn check_file(path: &Path) -> Result<PathBuf> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::new(
            ErrorKind::NotFound,
            format!("database file `{shown}` does not exist (opening an existing outbox never creates one)"),
        ),
        _ => Error::unavailable(format!("cannot access database file `{shown}`")).with_source(e),
    })?;
    if !meta.is_file() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("database path `{shown}` is not a file"),
        ));
    }
    std::fs::canonicalize(path).map_err(|e| {
        Error::unavailable(format!("cannot resolve database path `{shown}`")).with_source(e)
    })
}

/// Read-only: the file is a SQLite database with an outbox table `table`.
fn check_outbox_table(path: &Path, table: &str) -> Result<()> {
    let shown = path.display();
    let unreadable = |e: rusqlite::Error| {
        let not_db = matches!(&e, rusqlite::Error::SqliteFailure(f, _)
            if f.code == rusqlite::ErrorCode::NotADatabase);
        if not_db {
            Error::new(
                ErrorKind::Corrupt,
                format!("`{shown}` is not a SQLite database"),
            )
        } else {
            Error::new(
                crate::error::rusqlite_kind(&e),
                format!("cannot read SQLite database `{shown}`"),
            )
            .with_source(e)
        }
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(unreadable)?;
    let columns: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info(?1)")
        .and_then(|mut stmt| {
            stmt.query_map([table], |r| r.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(unreadable)?;
    if columns.is_empty() {
        let others = outbox_tables(&conn).unwrap_or_default();
        let hint = if others.is_empty() {
            "it has no outbox tables at all; is this the application's database?".to_owned()
        } else {
            format!("its outbox tables: {}", others.join(", "))
        };
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("database `{shown}` has no outbox table `{table}`; {hint}"),
        ));
    }
    let missing = missing_outbox_columns(&columns);
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "table `{table}` in `{shown}` is not an outbox table (it lacks the columns {})",
                missing.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The outbox tables the migrations recorded, if any.
fn outbox_tables(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let exists: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
        [MIGRATIONS_TABLE],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(&format!(
        "SELECT table_name FROM {MIGRATIONS_TABLE} WHERE table_kind = 'outbox' ORDER BY table_name"
    ))?;
    stmt.query_map([], |r| r.get(0))?.collect()
}
