//! Opening an outbox table in a SQLite file, without ever creating or
//! migrating anything.
//!
//! [`SqliteStore::open`](outbox_sqlite::SqliteStore) creates a missing file
//! and switches the database to WAL mode, so before it runs, [`open`]
//! checks read-only that the file exists, is a SQLite database, and holds
//! an outbox table of the given name.

use std::path::{Path, PathBuf};

use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite::{self, Connection, OpenFlags};

use super::missing_columns;
use crate::CliError;

/// Turns what follows `sqlite:` (`PATH`, `//PATH`, `///abs/path`) into the
/// file path; `url` is the whole value, for errors.
pub fn parse_path(url: &str, rest: &str) -> Result<PathBuf, CliError> {
    let path = rest.strip_prefix("//").unwrap_or(rest);
    if path.is_empty() {
        return Err(CliError::usage(format!(
            "database `{url}` names no file: write `sqlite:PATH`"
        )));
    }
    if path.starts_with(":memory:") || path.contains("mode=memory") {
        return Err(CliError::usage(format!(
            "database `{url}` is an in-memory database, which has no outbox: give a file path"
        )));
    }
    Ok(PathBuf::from(path))
}

/// Opens the outbox table `table` of the existing database at `path`.
pub async fn open(path: &Path, table: &str) -> Result<SqliteStore, CliError> {
    let path = check_file(path)?;
    let precheck_path = path.clone();
    let precheck_table = table.to_owned();
    tokio::task::spawn_blocking(move || check_outbox_table(&precheck_path, &precheck_table))
        .await
        .map_err(|e| CliError::failed(format!("checking the database failed: {e}")))??;
    SqliteStore::builder(&path)
        .table(table)
        .open()
        .await
        .map_err(CliError::from)
}

/// The file exists and is a regular file; returns its canonical path (which
/// also keeps SQLite from reading a relative `file:` path as a URI).
fn check_file(path: &Path) -> Result<PathBuf, CliError> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CliError::failed(format!(
            "database file `{shown}` does not exist (the outbox CLI never creates one)"
        )),
        _ => CliError::failed(format!("cannot access database file `{shown}`: {e}")),
    })?;
    if !meta.is_file() {
        return Err(CliError::failed(format!(
            "database path `{shown}` is not a file"
        )));
    }
    std::fs::canonicalize(path)
        .map_err(|e| CliError::failed(format!("cannot resolve database path `{shown}`: {e}")))
}

/// Read-only: the file is a SQLite database with an outbox table `table`.
fn check_outbox_table(path: &Path, table: &str) -> Result<(), CliError> {
    let shown = path.display();
    let unreadable = |e: rusqlite::Error| {
        let not_db = matches!(&e, rusqlite::Error::SqliteFailure(f, _)
            if f.code == rusqlite::ErrorCode::NotADatabase);
        if not_db {
            CliError::failed(format!("`{shown}` is not a SQLite database"))
        } else {
            CliError::failed(format!("cannot read SQLite database `{shown}`: {e}"))
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
            format!(
                "its outbox tables: {} (choose with --table)",
                others.join(", ")
            )
        };
        return Err(CliError::failed(format!(
            "database `{shown}` has no outbox table `{table}`; {hint}"
        )));
    }
    let missing = missing_columns(&columns);
    if !missing.is_empty() {
        return Err(CliError::failed(format!(
            "table `{table}` in `{shown}` is not an outbox table (it lacks the columns {})",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// The outbox tables the migrations recorded, if any.
fn outbox_tables(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let exists: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'outbox_schema_versions')",
        [],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(
        "SELECT table_name FROM outbox_schema_versions WHERE table_kind = 'outbox' ORDER BY table_name",
    )?;
    stmt.query_map([], |r| r.get(0))?.collect()
}
