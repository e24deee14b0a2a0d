//! The inbox contract: [`Inbox`] (receive a message id once, run the
//! handler inside the inbox transaction, commit), [`InboxWork`] (what runs
//! inside it) and [`InboxOutcome`] (how it ended), so that every receiver —
//! the RabbitMQ consumer, a NATS consumer, an application's in-process bus
//! — is written once against every store.

use std::time::Duration;

use async_trait::async_trait;

use crate::dispatch::HandlerError;
use crate::guard::{HandlerOutcome, TemporarilyUnavailable, run_guarded};
use crate::{Error, ErrorKind, MessageId, Result, Timestamp};

/// Where a receiver records what it received, so that at-least-once
/// delivery gives exactly-once effects: implemented by every store
/// (`MemoryInbox`, `SqliteInbox`, `PgInbox`) and used by every consumer
/// (`RabbitConsumer`).
///
/// # Contract
///
/// [`receive_once`](Self::receive_once) runs **one transaction** of the
/// store:
///
/// 1. begin (on SQLite `BEGIN IMMEDIATE`, so that it never fails half-way
///    for a lock another writer took first);
/// 2. record `(consumer, message_id)` in the inbox. Recorded before (and
///    committed): roll back and answer [`InboxOutcome::Duplicate`] — `work`
///    does **not** run;
/// 3. run `work` with the open transaction's connection
///    ([`Conn`](Self::Conn)), guarded by [`run_guarded`] (time limit
///    `handler_timeout`, panics caught), its error classified by
///    [`classify_handler_error`] (the same on every store);
/// 4. commit when it succeeded ([`InboxOutcome::Committed`]); otherwise roll
///    back, so that neither the inbox entry nor any effect of `work` (rows,
///    replies enqueued with the store's outbox) remains.
///
/// A failure of the store itself (begin, inbox insert, commit) is
/// [`InboxOutcome::StoreFailed`] and leaves nothing either. The caller
/// acknowledges the message to its broker only after `Committed` or
/// `Duplicate`, so a message is never lost: at worst it is received again,
/// and then it is a `Duplicate`.
///
/// [`purge`](Self::purge) deletes at most `limit` entries received before
/// `before`; a purged message received again runs its handler again, so
/// entries must outlive every redelivery of their message.
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// The connection `work` runs on, inside the inbox transaction:
    /// `SqliteConnection`, `PgConnection`, `MemoryTransaction`.
    type Conn: ?Sized + Send + 'static;

    /// The inbox table as the store names it, for logs (`inbox`,
    /// `shop.inbox`).
    fn name(&self) -> String;

    /// Receives `message_id` for `consumer` exactly once, running `work` in
    /// the inbox transaction (see the trait's contract).
    async fn receive_once(
        &self,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        work: &dyn InboxWork<Self::Conn>,
    ) -> InboxOutcome;

    /// Deletes at most `limit` entries received before `before`; returns
    /// how many.
    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64>;
}

/// What runs inside an inbox transaction: a receiver's handler applied to
/// one received message. Implemented by receivers (the RabbitMQ consumer
/// binds its `InboxHandler` and the delivery).
#[async_trait]
pub trait InboxWork<Conn: ?Sized + Send>: Send + Sync {
    /// The message's effects, done with `conn` (the open inbox
    /// transaction). Do not commit or roll back; return every database
    /// error met (a failed statement may have aborted the transaction).
    async fn run(&self, conn: &mut Conn) -> std::result::Result<(), HandlerError>;
}

/// The one classification of a handler's error, on every store: an error
/// whose source chain holds an [`Error`] of kind
/// [`Unavailable`](ErrorKind::Unavailable), or a driver error that
/// `driver_unavailable` says means "the database is unavailable or busy,
/// try later" (connection lost, pool timed out, lock busy, deadlock,
/// serialization failure), becomes [`TemporarilyUnavailable`]: retried
/// later **without** counting an attempt, since an outage of the database
/// is not the message's fault. Anything else is returned as it is.
pub fn classify_handler_error(
    error: HandlerError,
    driver_unavailable: impl Fn(&(dyn std::error::Error + 'static)) -> bool,
) -> HandlerError {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&*error);
    let mut unavailable = false;
    while let Some(e) = next {
        if e.downcast_ref::<TemporarilyUnavailable>().is_some() {
            return error;
        }
        if driver_unavailable(e)
            || e.downcast_ref::<Error>()
                .is_some_and(|ours| ours.kind() == ErrorKind::Unavailable)
        {
            unavailable = true;
        }
        next = e.source();
    }
    if unavailable {
        TemporarilyUnavailable::caused_by(error).into()
    } else {
        error
    }
}

/// Runs a handler inside an inbox transaction: guarded by [`run_guarded`]
/// (`timeout`, panics caught), its error classified by
/// [`classify_handler_error`]. `None` when it succeeded (commit); the
/// outcome to answer after rolling back otherwise. Every store's
/// `receive_once` runs its handler through this.
pub async fn run_inbox_handler<F>(
    timeout: Duration,
    handler: F,
    driver_unavailable: impl Fn(&(dyn std::error::Error + 'static)) -> bool,
) -> Option<InboxOutcome>
where
    F: std::future::Future<Output = std::result::Result<(), HandlerError>>,
{
    let run = async {
        handler
            .await
            .map_err(|e| classify_handler_error(e, &driver_unavailable))
    };
    InboxOutcome::unless_succeeded(run_guarded(timeout, run).await)
}

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
