//! The error of the binary: one line for the user, never a panic.

use std::fmt;

/// A failure to report as `error: …` (one line, secrets redacted).
#[derive(Debug)]
pub struct Fail(pub String);

impl fmt::Display for Fail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Fail {}

/// `result.context("opening X")?` → `Fail("opening X: <cause>")`.
pub trait Context<T> {
    /// Wraps the error with what was being done.
    fn context(self, what: impl fmt::Display) -> Result<T, Fail>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: impl fmt::Display) -> Result<T, Fail> {
        self.map_err(|e| Fail(format!("{what}: {e}")))
    }
}
