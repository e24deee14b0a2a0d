//! Turning sqlx errors into [`outbox_api::Error`]s that name what failed:
//! the one mapping of MySQL and MariaDB error numbers ([`error_kind`]).

pub(crate) use outbox_api::backend::password_of;
use outbox_api::{Error, ErrorKind, MessageId};
use sqlx::mysql::MySqlDatabaseError;

/// What a server error number means for the caller (MySQL and MariaDB
/// share these numbers).
fn kind_of_number(number: u16) -> ErrorKind {
    match number {
        // ER_DUP_ENTRY, ER_DUP_KEY, ER_DUP_UNIQUE, ER_DUP_ENTRY_WITH_KEY_NAME
        1062 | 1022 | 1169 | 1586 => ErrorKind::Conflict,
        // ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, ER_CON_COUNT_ERROR (too many
        // connections), ER_SERVER_SHUTDOWN, ER_QUERY_INTERRUPTED,
        // ER_LOCK_TABLE_FULL, ER_OUT_OF_RESOURCES, ER_TOO_MANY_USER_CONNECTIONS,
        // MariaDB's ER_CONNECTION_KILLED and ER_STATEMENT_TIMEOUT, MySQL's
        // ER_QUERY_TIMEOUT (max_execution_time) and
        // ER_CLIENT_INTERACTION_TIMEOUT, the client's "server has gone away"
        // and "lost connection": retrying later may succeed.
        1213 | 1205 | 1040 | 1053 | 1317 | 1206 | 1041 | 1203 | 1927 | 1969 | 3024 | 4031
        | 2006 | 2013 => ErrorKind::Unavailable,
        // ER_DBACCESS_DENIED_ERROR, ER_ACCESS_DENIED_ERROR, ER_BAD_DB_ERROR:
        // the configuration.
        1044 | 1045 | 1049 => ErrorKind::Config,
        _ => ErrorKind::Backend,
    }
}

/// ER_NO_SUCH_TABLE.
const NO_SUCH_TABLE: u16 = 1146;

/// The server's error number of a database error, if it is one.
pub(crate) fn number_of(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// What a sqlx error means for the caller, by the server's error number
/// (or the driver error when there is none), as the store itself
/// classifies its errors.
///
/// [`ErrorKind::Unavailable`] means that trying again later may succeed:
/// the connection was lost or refused, the server is shutting down or out
/// of connections, a deadlock (1213) or a lock wait timeout (1205). A
/// handler whose own MySQL work fails so can return
/// [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable), which
/// the relay retries without counting an attempt; the inbox
/// ([`MySqlInbox`](crate::MySqlInbox)) does so by itself.
pub fn error_kind(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Database(_) => number_of(e).map_or(ErrorKind::Backend, kind_of_number),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => ErrorKind::Unavailable,
        sqlx::Error::Configuration(_) => ErrorKind::Config,
        _ => ErrorKind::Backend,
    }
}

/// Whether the error is a duplicate key.
pub(crate) fn is_duplicate(e: &sqlx::Error) -> bool {
    number_of(e).is_some_and(|n| kind_of_number(n) == ErrorKind::Conflict)
}

/// The one conversion of sqlx errors: an error met while doing `what` on
/// `table`, with a kind and the driver's error as source.
pub(crate) fn from_sqlx(e: sqlx::Error, what: &str, table: &str) -> Error {
    if number_of(&e) == Some(NO_SUCH_TABLE) {
        return Error::new(
            ErrorKind::Backend,
            format!("{what}: table `{table}` does not exist; run `MySqlStore::migrate()` first"),
        )
        .with_source(e);
    }
    Error::new(error_kind(&e), format!("{what} (table `{table}`)")).with_source(e)
}

/// An error met while connecting to `redacted_url`: the driver's text with
/// `password` scrubbed out (a URL-parsing error may quote it), never the
/// driver's error itself.
pub(crate) fn connecting(e: sqlx::Error, redacted_url: &str, password: Option<&str>) -> Error {
    let kind = match error_kind(&e) {
        ErrorKind::Backend => ErrorKind::Unavailable,
        k => k,
    };
    Error::new(
        kind,
        format!("cannot connect to MySQL/MariaDB at `{redacted_url}`"),
    )
    .with_source(std::io::Error::other(scrub(&e.to_string(), password)))
}

/// `text` with `password` replaced by `***`.
pub(crate) fn scrub(text: &str, password: Option<&str>) -> String {
    match password.filter(|p| !p.is_empty()) {
        Some(p) => text.replace(p, "***"),
        None => text.to_owned(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlocks_and_lock_timeouts_are_outages_duplicates_conflicts() {
        assert_eq!(kind_of_number(1213), ErrorKind::Unavailable);
        assert_eq!(kind_of_number(1205), ErrorKind::Unavailable);
        assert_eq!(kind_of_number(1062), ErrorKind::Conflict);
        assert_eq!(kind_of_number(1045), ErrorKind::Config);
        assert_eq!(kind_of_number(1064), ErrorKind::Backend, "a syntax error");
        assert_eq!(
            error_kind(&sqlx::Error::PoolTimedOut),
            ErrorKind::Unavailable
        );
    }

    #[test]
    fn finds_the_password_to_scrub() {
        assert_eq!(password_of("mysql://u:s3cret@h:3306/db"), Some("s3cret"));
        assert_eq!(password_of("mysql://u@h/db"), None);
        assert_eq!(password_of("not a url"), None);
        assert_eq!(password_of("mariadb://u:a@b@h/db"), Some("a@b"));
        assert_eq!(scrub("bad s3cret here", Some("s3cret")), "bad *** here");
    }
}
