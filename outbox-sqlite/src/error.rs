//! Turning driver errors into [`outbox_api::Error`]s that name what failed.

use outbox_api::{Error, ErrorKind, MessageId};

/// Maps a rusqlite error met while doing `what` on `table`.
pub(crate) fn from_rusqlite(e: rusqlite::Error, what: &str, table: &str) -> Error {
    use rusqlite::ErrorCode;
    let text = e.to_string();
    let kind = match &e {
        rusqlite::Error::SqliteFailure(f, _) => match f.code {
            ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => ErrorKind::Unavailable,
            ErrorCode::CannotOpen | ErrorCode::SystemIoFailure | ErrorCode::DiskFull => {
                ErrorKind::Unavailable
            }
            ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => ErrorKind::Corrupt,
            ErrorCode::ConstraintViolation => ErrorKind::Conflict,
            _ => ErrorKind::Backend,
        },
        _ => ErrorKind::Backend,
    };
    if text.contains("no such table") {
        return Error::new(
            ErrorKind::Backend,
            format!("{what}: table `{table}` does not exist; run `SqliteStore::migrate()` first"),
        )
        .with_source(e);
    }
    Error::new(kind, format!("{what} (table `{table}`)")).with_source(e)
}

/// Maps an sqlx error met while doing `what` on `table`.
pub(crate) fn from_sqlx(e: sqlx::Error, what: &str, table: &str) -> Error {
    let text = e.to_string();
    if text.contains("no such table") {
        return Error::new(
            ErrorKind::Backend,
            format!("{what}: table `{table}` does not exist; run `SqliteStore::migrate()` first"),
        )
        .with_source(e);
    }
    let kind = match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            // Primary result codes SQLITE_BUSY (5) and SQLITE_LOCKED (6), possibly extended.
            let primary = code.parse::<i32>().map(|c| c & 0xff).unwrap_or(-1);
            if primary == 5 || primary == 6 {
                ErrorKind::Unavailable
            } else if db.is_unique_violation() || db.is_check_violation() {
                ErrorKind::Conflict
            } else {
                ErrorKind::Backend
            }
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            ErrorKind::Unavailable
        }
        _ => ErrorKind::Backend,
    };
    Error::new(kind, format!("{what} (table `{table}`)")).with_source(e)
}

/// The error for enqueuing an id that exists already.
pub(crate) fn duplicate_id(
    id: MessageId,
    table: &str,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    Error::new(
        ErrorKind::Conflict,
        format!("message id {id} exists already in outbox table `{table}`"),
    )
    .with_source(source)
}

/// Whether a rusqlite error is a UNIQUE/PRIMARY KEY violation.
pub(crate) fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
            || f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY)
}
