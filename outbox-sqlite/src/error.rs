//! Turning driver errors into [`outbox_api::Error`]s that name what failed.

use outbox_api::{Error, ErrorKind, MessageId};

/// What an SQLite result code means, from its primary code (the low
/// byte): the one classification behind both drivers.
fn code_kind(code: i32) -> ErrorKind {
    use rusqlite::ffi;
    match code & 0xff {
        // Busy or locked by another connection; cannot open, I/O failure,
        // disk full: the database is unavailable for now, try later.
        ffi::SQLITE_BUSY
        | ffi::SQLITE_LOCKED
        | ffi::SQLITE_CANTOPEN
        | ffi::SQLITE_IOERR
        | ffi::SQLITE_FULL => ErrorKind::Unavailable,
        ffi::SQLITE_CORRUPT | ffi::SQLITE_NOTADB => ErrorKind::Corrupt,
        ffi::SQLITE_CONSTRAINT => ErrorKind::Conflict,
        _ => ErrorKind::Backend,
    }
}

/// What a rusqlite error means.
pub(crate) fn rusqlite_kind(e: &rusqlite::Error) -> ErrorKind {
    match e {
        rusqlite::Error::SqliteFailure(f, _) => code_kind(f.extended_code),
        _ => ErrorKind::Backend,
    }
}

/// What an sqlx error on SQLite means.
#[cfg(feature = "sqlx")]
pub(crate) fn sqlx_kind(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Database(db) => match db.code().and_then(|c| c.parse::<i32>().ok()) {
            Some(code) => code_kind(code),
            None => ErrorKind::Backend,
        },
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            ErrorKind::Unavailable
        }
        _ => ErrorKind::Backend,
    }
}

/// Whether a driver error (sqlx or rusqlite) says the database is
/// unavailable or busy: the SQLite half of
/// [`outbox_api::classify_handler_error`].
#[cfg(feature = "sqlx")]
pub(crate) fn driver_unavailable(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .is_some_and(|e| sqlx_kind(e) == ErrorKind::Unavailable)
        || e.downcast_ref::<rusqlite::Error>()
            .is_some_and(|e| rusqlite_kind(e) == ErrorKind::Unavailable)
}

/// The error for a table that does not exist.
fn no_table(
    what: &str,
    table: &str,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("{what}: table `{table}` does not exist; run `SqliteStore::migrate()` first"),
    )
    .with_source(source)
}

/// Maps a rusqlite error met while doing `what` on `table`.
pub(crate) fn from_rusqlite(e: rusqlite::Error, what: &str, table: &str) -> Error {
    if e.to_string().contains("no such table") {
        return no_table(what, table, e);
    }
    Error::new(rusqlite_kind(&e), format!("{what} (table `{table}`)")).with_source(e)
}

/// Maps an sqlx error met while doing `what` on `table`.
#[cfg(feature = "sqlx")]
pub(crate) fn from_sqlx(e: sqlx::Error, what: &str, table: &str) -> Error {
    if e.to_string().contains("no such table") {
        return no_table(what, table, e);
    }
    Error::new(sqlx_kind(&e), format!("{what} (table `{table}`)")).with_source(e)
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
#[cfg(feature = "rusqlite")]
pub(crate) fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
            || f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_drivers_classify_a_result_code_alike() {
        use rusqlite::ffi;
        for (code, kind) in [
            (ffi::SQLITE_BUSY, ErrorKind::Unavailable),
            (ffi::SQLITE_LOCKED_SHAREDCACHE, ErrorKind::Unavailable),
            (ffi::SQLITE_IOERR_WRITE, ErrorKind::Unavailable),
            (ffi::SQLITE_FULL, ErrorKind::Unavailable),
            (ffi::SQLITE_CANTOPEN, ErrorKind::Unavailable),
            (ffi::SQLITE_CORRUPT, ErrorKind::Corrupt),
            (ffi::SQLITE_CONSTRAINT_UNIQUE, ErrorKind::Conflict),
            (ffi::SQLITE_ERROR, ErrorKind::Backend),
        ] {
            let r = rusqlite::Error::SqliteFailure(ffi::Error::new(code), None);
            assert_eq!(rusqlite_kind(&r), kind, "rusqlite, code {code}");
            assert_eq!(code_kind(code), kind, "code {code}");
        }
        assert_eq!(
            sqlx_kind(&sqlx::Error::PoolTimedOut),
            ErrorKind::Unavailable
        );
        assert!(driver_unavailable(&sqlx::Error::PoolTimedOut));
        let busy = rusqlite::Error::SqliteFailure(ffi::Error::new(ffi::SQLITE_BUSY), None);
        assert!(driver_unavailable(&busy));
        assert!(!driver_unavailable(&std::io::Error::other(
            "not a driver error"
        )));
    }
}
