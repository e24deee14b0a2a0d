//! [`InboxOutcome`]: how one inbox transaction ended — the answer of every
//! backend's `receive_once` (`SqliteOutbox::receive_once`,
//! `PgOutbox::receive_once`), so that receivers (the RabbitMQ consumer, an
//! application's in-process bus) settle a delivery the same way on each.

use std::time::Duration;

use crate::guard::HandlerOutcome;

/// How one inbox transaction (record the message in the inbox, run its
/// handler, commit) ended.
///
/// Acknowledge the message after [`Committed`](Self::Committed) or
/// [`Duplicate`](Self::Duplicate) only; after
/// [`HandlerFailed`](Self::HandlerFailed) count an attempt; after
/// [`HandlerUnavailable`](Self::HandlerUnavailable) or
/// [`StoreFailed`](Self::StoreFailed) try again later without counting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InboxOutcome {
    /// The handler succeeded; its effects and the inbox entry are committed.
    /// Acknowledge the message.
    Committed,
    /// The inbox had the message already: it was handled before, the
    /// handler did **not** run. Acknowledge the message.
    Duplicate,
    /// The handler returned an error, panicked or timed out: rolled back
    /// (no effects, no inbox entry, so a retry runs it again). A counted
    /// failure; holds the error text.
    HandlerFailed(String),
    /// The handler said
    /// [`TemporarilyUnavailable`](crate::TemporarilyUnavailable): rolled
    /// back; retry later without counting an attempt.
    HandlerUnavailable {
        /// Why (the error text).
        reason: String,
        /// The delay the handler asked for, if any.
        retry_after: Option<Duration>,
    },
    /// The database failed (begin, inbox insert or commit): rolled back, the
    /// handler's effects are not kept. An outage, not the message's fault:
    /// retry later without counting an attempt. Holds the error text.
    StoreFailed(String),
}

impl InboxOutcome {
    /// A short name for logs and spans.
    pub fn name(&self) -> &'static str {
        match self {
            InboxOutcome::Committed => "committed",
            InboxOutcome::Duplicate => "duplicate",
            InboxOutcome::HandlerFailed(_) => "handler-failed",
            InboxOutcome::HandlerUnavailable { .. } => "handler-unavailable",
            InboxOutcome::StoreFailed(_) => "store-failed",
        }
    }

    /// The outcome of a guarded handler run that is not a success (the
    /// transaction must then be rolled back); `None` for
    /// [`HandlerOutcome::Succeeded`] (commit).
    pub fn unless_succeeded(outcome: HandlerOutcome) -> Option<InboxOutcome> {
        match outcome {
            HandlerOutcome::Succeeded => None,
            HandlerOutcome::Failed(error) => Some(InboxOutcome::HandlerFailed(error)),
            HandlerOutcome::Unavailable {
                reason,
                retry_after,
            } => Some(InboxOutcome::HandlerUnavailable {
                reason,
                retry_after,
            }),
        }
    }
}
