//! Finding and opening the outbox table an operator names, without ever
//! creating or migrating anything.
//!
//! [`SqliteStore::open`](outbox_sqlite::SqliteStore) creates a missing file
//! and switches the database to WAL mode, so before it runs, [`open`]
//! checks read-only that the file exists, is a SQLite database, and holds
//! an outbox table of the given name.

use std::path::{Path, PathBuf};

use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite::{self, Connection, OpenFlags};

use crate::CliError;

/// The columns every outbox table has; a table lacking any is not one.
const OUTBOX_COLUMNS: &[&str] = &[
    "seq",
    "id",
    "kind",
    "message_type",
    "key",
    "exchange",
    "routing_key",
    "payload",
    "content_type",
    "headers",
    "trace_parent",
    "created_at",
    "available_at",
    "attempts",
    "last_error",
    "state",
    "locked_by",
    "locked_until",
    "processed_at",
];

/// Turns `sqlite:PATH` (also `sqlite://PATH`, `sqlite:///abs/path`) into the
/// file path.
pub fn parse_database_url(url: &str) -> Result<PathBuf, CliError> {
    let Some(rest) = url.strip_prefix("sqlite:") else {
        return Err(CliError::usage(format!(
            "database `{}` is not a `sqlite:PATH` URL (only SQLite is supported)",
            url.escape_debug()
        )));
    };
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

/// Checks that `name` is a table name the store accepts:
/// `[A-Za-z_][A-Za-z0-9_]*`, at most 63 characters (clap value parser).
pub fn parse_table_name(name: &str) -> Result<String, String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!(
            "table name `{}` is not an identifier (letters, digits and `_`, not starting with a digit)",
            name.escape_debug()
        ));
    }
    if name.len() > 63 {
        return Err(format!(
            "table name `{name}` is {} characters long; at most 63 are allowed",
            name.len()
        ));
    }
    Ok(name.to_owned())
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
    let missing: Vec<&str> = OUTBOX_COLUMNS
        .iter()
        .copied()
        .filter(|c| !columns.iter().any(|have| have.eq_ignore_ascii_case(c)))
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls() {
        assert_eq!(
            parse_database_url("sqlite:a.db").unwrap(),
            PathBuf::from("a.db")
        );
        assert_eq!(
            parse_database_url("sqlite://a.db").unwrap(),
            PathBuf::from("a.db")
        );
        assert_eq!(
            parse_database_url("sqlite:///x/a.db").unwrap(),
            PathBuf::from("/x/a.db")
        );
        for bad in ["a.db", "postgres://h/db", "sqlite:", "sqlite::memory:"] {
            assert!(parse_database_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn table_names() {
        assert!(parse_table_name("orders_outbox").is_ok());
        for bad in ["", "1x", "a-b", "x; DROP TABLE y", &"a".repeat(64)] {
            assert!(parse_table_name(bad).is_err(), "{bad}");
        }
    }
}
