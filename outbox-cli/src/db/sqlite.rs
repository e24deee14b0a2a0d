//! Opening an outbox table in a SQLite file, without ever creating or
//! migrating anything (the store's `connect_existing`), and reading the
//! `sqlite:` URL.

use std::path::{Path, PathBuf};

use outbox_sqlite::SqliteStore;

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

/// Opens the outbox table `table` of the existing database at `path`
/// ([`SqliteStoreBuilder::connect_existing`](outbox_sqlite::SqliteStoreBuilder::connect_existing):
/// read-only checks first, nothing created).
pub async fn open(path: &Path, table: &str) -> Result<SqliteStore, CliError> {
    SqliteStore::builder(path)
        .table(table)
        .connect_existing()
        .await
        .map_err(CliError::from)
}
