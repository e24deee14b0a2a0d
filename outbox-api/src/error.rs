//! The error type shared by the outbox-rs crate family.

use std::fmt;

/// `Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in a form code can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A configuration value is invalid (names the field). Not retryable.
    Config,
    /// Input supplied by the caller is invalid (a message, an identifier). Not retryable.
    InvalidInput,
    /// The requested message or row does not exist.
    NotFound,
    /// The operation does not apply to the current state (e.g. retrying a
    /// message that is not poisoned).
    Conflict,
    /// A backend (database, broker) could not be reached or is busy; retrying may help.
    Unavailable,
    /// The backend failed in a way that retrying is unlikely to fix.
    Backend,
    /// Stored data could not be decoded.
    Corrupt,
    /// The component asked has stopped (a relay shut down, or its task
    /// died): nothing will happen until it is started again.
    Stopped,
}

impl ErrorKind {
    fn label(self) -> &'static str {
        match self {
            ErrorKind::Config => "invalid configuration",
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::NotFound => "not found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Backend => "backend error",
            ErrorKind::Corrupt => "corrupt data",
            ErrorKind::Stopped => "stopped",
        }
    }
}

/// The error of every outbox-rs operation: a [`ErrorKind`], a message that
/// names what was wrong, and optionally the underlying cause.
///
/// Messages never contain credentials; backends redact URLs before building
/// one.
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// A new error of `kind` with a message naming what was wrong.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying cause.
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// An invalid configuration value; `field` names it.
    pub fn config(field: &str, problem: impl fmt::Display) -> Self {
        Error::new(ErrorKind::Config, format!("`{field}`: {problem}"))
    }

    /// Invalid caller input.
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidInput, message)
    }

    /// A backend that cannot be reached or is busy.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unavailable, message)
    }

    /// A backend failure that retrying will not fix.
    pub fn backend(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Backend, message)
    }

    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without the kind prefix or the cause.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether retrying the same operation later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, ErrorKind::Unavailable)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.label(), self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind).field("message", &self.message);
        if let Some(source) = &self.source {
            d.field("source", &source.to_string());
        }
        d.finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Removes the password from a URL such as `amqp://user:secret@host/vhost`,
/// for use in `Debug`, logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let user = userinfo.split(':').next().unwrap_or("");
    let redacted = if userinfo.contains(':') {
        format!("{user}:***")
    } else {
        user.to_owned()
    };
    format!("{}://{}{}", &url[..scheme_end], redacted, &rest[at..])
}

/// The password of a URL such as `amqp://user:secret@host/vhost` (the same
/// rules as [`redact_url`]), to scrub it from a driver's error texts;
/// `None` when the URL has none.
pub fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    userinfo.split_once(':').map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_password_redact_url_hides() {
        assert_eq!(password_of("amqp://u:p@h/v"), Some("p"));
        assert_eq!(password_of("postgres://u:a@b@h/db"), Some("a@b"));
        assert_eq!(password_of("mysql://u@h/db"), None);
        assert_eq!(password_of("not a url"), None);
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@localhost:5672/%2f"),
            "amqp://guest:***@localhost:5672/%2f"
        );
        assert_eq!(redact_url("amqp://localhost"), "amqp://localhost");
        assert_eq!(redact_url("amqp://u@h/v"), "amqp://u@h/v");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(redact_url("amqp://a:b@c@host/x"), "amqp://a:***@host/x");
    }

    #[test]
    fn display_names_kind_and_cause() {
        let e = Error::config("batch_size", "must be at least 1")
            .with_source(std::io::Error::other("inner"));
        assert_eq!(
            e.to_string(),
            "invalid configuration: `batch_size`: must be at least 1: inner"
        );
        assert!(!e.is_retryable());
        assert!(Error::unavailable("down").is_retryable());
    }
}
