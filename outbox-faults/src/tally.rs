//! What a receiver counted, shared by the SQLite and PostgreSQL receivers.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use outbox_api::{HandlerError, MessageId};

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
}
