//! Turning sqlx errors into [`outbox_api::Error`]s that name what failed.

pub(crate) use outbox_api::backend::password_of;
use outbox_api::{Error, ErrorKind, MessageId};

/// What a SQLSTATE means for the caller (every driver's errors go through
/// this one table).
fn kind_of_code(code: &str) -> ErrorKind {
    match code {
        // unique_violation
        "23505" => ErrorKind::Conflict,
        // serialization_failure, deadlock_detected, lock_not_available,
        // query_canceled (a statement timeout), the server shutting down
        // or out of resources: retrying later may succeed.
        "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03" => {
            ErrorKind::Unavailable
        }
        c if c.starts_with("08") || c.starts_with("53") => ErrorKind::Unavailable,
        // invalid authorisation, unknown database: the configuration.
        c if c.starts_with("28") || c == "3D000" => ErrorKind::Config,
        _ => ErrorKind::Backend,
    }
}

/// Whether a SQLSTATE says the table (or its schema) does not exist.
fn is_missing_table_code(code: &str) -> bool {
    matches!(code, "42P01" | "3F000")
}

/// What a sqlx error means for the caller, by its SQLSTATE (or the driver
/// error when there is none), as the store itself classifies its errors.
///
/// [`ErrorKind::Unavailable`] means that trying again later may succeed:
/// the connection was lost or refused, the server is shutting down or
/// starting, out of resources, a serialization failure or deadlock. A
/// handler whose own PostgreSQL work fails so can return
/// [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable), which the
/// relay retries without counting an attempt.
pub fn error_kind(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Database(db) => kind_of_code(db.code().unwrap_or_default().as_ref()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => ErrorKind::Unavailable,
        sqlx::Error::Configuration(_) => ErrorKind::Config,
        _ => ErrorKind::Backend,
    }
}

/// Whether the error says the table (or its schema) does not exist.
fn is_missing_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.code().is_some_and(|c| is_missing_table_code(&c)))
}

/// The error for `what` on `table` whose table is missing: say to migrate.
fn missing_table(what: &str, table: &str) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("{what}: table `{table}` does not exist; run `PgStore::migrate()` first"),
    )
}

/// Whether the error is a unique violation.
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

/// The one conversion of sqlx errors: an error met while doing `what` on
/// `table` (`schema.table`), with a kind and the driver's error as source.
pub(crate) fn from_sqlx(e: sqlx::Error, what: &str, table: &str) -> Error {
    if is_missing_table(&e) {
        return missing_table(what, table).with_source(e);
    }
    Error::new(error_kind(&e), format!("{what} (table `{table}`)")).with_source(e)
}

/// The same conversion for tokio-postgres errors: the same kinds for the
/// same SQLSTATEs; a closed connection or an I/O error is `Unavailable`.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn from_tokio_postgres(e: tokio_postgres::Error, what: &str, table: &str) -> Error {
    let code = e.code().map(|c| c.code().to_owned());
    if code.as_deref().is_some_and(is_missing_table_code) {
        return missing_table(what, table).with_source(e);
    }
    let kind = match code.as_deref() {
        Some(code) => kind_of_code(code),
        None if e.is_closed()
            || std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>()) =>
        {
            ErrorKind::Unavailable
        }
        None => ErrorKind::Backend,
    };
    Error::new(kind, format!("{what} (table `{table}`)")).with_source(e)
}

/// An error met while connecting to `redacted_url`: the driver's text with
/// `password` scrubbed out (a URL-parsing error may quote it), never the
/// driver's error itself.
pub(crate) fn connecting(e: sqlx::Error, redacted_url: &str, password: Option<&str>) -> Error {
    let kind = match error_kind(&e) {
        ErrorKind::Backend => ErrorKind::Unavailable,
        k => k,
    };
    let mut text = e.to_string();
    if let Some(p) = password.filter(|p| !p.is_empty()) {
        text = text.replace(p, "***");
    }
    Error::new(
        kind,
        format!("cannot connect to PostgreSQL at `{redacted_url}`"),
    )
    .with_source(std::io::Error::other(text))
}

/// The error for enqueuing an id that exists already.
pub(crate) fn duplicate_id(
    id: MessageId,
    table: &str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::new(
        ErrorKind::Conflict,
        format!("message id {id} exists already in outbox table `{table}`"),
    )
    .with_source(source)
}

/// Text safe to store in PostgreSQL's `text` (which refuses NUL).
pub(crate) fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_password_to_scrub() {
        assert_eq!(password_of("postgres://u:s3cret@h:5432/db"), Some("s3cret"));
        assert_eq!(password_of("postgres://u@h/db"), None);
        assert_eq!(password_of("postgres://h/db"), None);
        assert_eq!(password_of("not a url"), None);
        assert_eq!(password_of("postgres://u:a@b@h/db"), Some("a@b"));
    }

    #[test]
    fn nul_is_never_stored() {
        assert_eq!(storable("a\0b"), "a\u{FFFD}b");
    }
}
