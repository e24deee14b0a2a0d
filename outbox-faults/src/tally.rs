//! What a receiver counted, shared by the SQLite, PostgreSQL and MySQL
//! receivers, and how a receiver transaction's outcome becomes the
//! handler's answer.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use outbox_api::{HandlerError, MessageId, TemporarilyUnavailable};

/// Why a receiver transaction on a server database did not commit.
pub(crate) enum Failed {
    /// The database was out of reach (retried, not counted).
    Unavailable(String),
    /// Anything else (a counted failure).
    Other(String),
}

/// First deliveries, duplicates the inbox turned away, and failures.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    handled: AtomicU64,
    duplicates: AtomicU64,
    errors: Mutex<Vec<String>>,
}

impl Tally {
    pub(crate) fn handled(&self) -> u64 {
        self.handled.load(Ordering::Relaxed)
    }

    pub(crate) fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    pub(crate) fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Counts one receiver transaction: `Ok(true)` a first delivery,
    /// `Ok(false)` a duplicate, `Err` a failure — printed to stderr as a
    /// `HANDLER_ERROR` line naming `worker` and `message`, and returned.
    pub(crate) fn count(
        &self,
        worker: &str,
        message: MessageId,
        outcome: Result<bool, String>,
    ) -> Result<(), HandlerError> {
        match outcome {
            Ok(true) => {
                self.handled.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Ok(false) => {
                self.duplicates.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                let text = format!("HANDLER_ERROR worker={worker} message={message}: {e}");
                eprintln!("{text}");
                self.errors
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(text);
                Err(e.into())
            }
        }
    }

    /// The handler's answer to a receiver transaction on a server
    /// database: out of reach is [`TemporarilyUnavailable`] (printed as a
    /// `HANDLER_UNAVAILABLE` line; the relay retries it uncounted), any
    /// other outcome is [`count`](Self::count)ed.
    pub(crate) fn answer(
        &self,
        worker: &str,
        message: MessageId,
        outcome: Result<bool, Failed>,
    ) -> Result<(), HandlerError> {
        match outcome {
            Err(Failed::Unavailable(e)) => {
                eprintln!("HANDLER_UNAVAILABLE worker={worker} message={message}: {e}");
                Err(Box::new(TemporarilyUnavailable::new(e)))
            }
            Err(Failed::Other(e)) => self.count(worker, message, Err(e)),
            Ok(new) => self.count(worker, message, Ok(new)),
        }
    }
}
