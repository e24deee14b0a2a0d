//! The inbox transaction on MySQL: record a received message and run its
//! handler in one transaction, so that at-least-once delivery gives
//! exactly-once effects: [`MySqlOutbox::receive_once`] for a closure, and
//! [`MySqlInbox`], the [`Inbox`] contract receivers are written against.

use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{
    Error, ErrorKind, HandlerError, Inbox, InboxOutcome, InboxWork, MessageId, Result, Timestamp,
    run_inbox_handler,
};
use sqlx::{MySqlConnection, MySqlPool};

use crate::MySqlOutbox;
use crate::error::error_kind;

/// The inbox of a MySQL outbox, on the application's pool: the [`Inbox`]
/// contract, each message in one transaction of `pool`
/// ([`MySqlOutbox::receive_once`]). One connection per message in flight,
/// one more while a purge runs.
#[derive(Debug, Clone)]
pub struct MySqlInbox {
    outbox: MySqlOutbox,
    pool: MySqlPool,
}

impl MySqlInbox {
    /// The inbox of `outbox`, whose transactions run on `pool` (the
    /// application's sqlx pool on the same database; the handler's effects
    /// and replies go through it).
    pub fn new(outbox: MySqlOutbox, pool: MySqlPool) -> Self {
        MySqlInbox { outbox, pool }
    }

    /// The outbox the handler enqueues replies with.
    pub fn outbox(&self) -> &MySqlOutbox {
        &self.outbox
    }

    /// The pool the inbox transactions run on.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }
}

#[async_trait]
impl Inbox for MySqlInbox {
    type Conn = MySqlConnection;

    fn name(&self) -> String {
        self.outbox.inbox_table().to_owned()
    }

    async fn receive_once(
        &self,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        work: &dyn InboxWork<MySqlConnection>,
    ) -> InboxOutcome {
        self.outbox
            .receive_once(
                &self.pool,
                consumer,
                message_id,
                handler_timeout,
                async |tx| work.run(tx).await,
            )
            .await
    }

    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64> {
        let mut conn = self.pool.acquire().await.map_err(|e| {
            Error::new(
                error_kind(&e),
                format!("purging the inbox `{}`: no connection", self.name()),
            )
            .with_source(e)
        })?;
        self.outbox.purge_inbox(&mut conn, before, limit).await
    }
}

impl MySqlOutbox {
    /// Receives `message_id` for `consumer` exactly once, in one transaction
    /// on `pool` (a pool on this outbox's database):
    ///
    /// 1. `START TRANSACTION`;
    /// 2. record `(consumer, message_id)` in the inbox with
    ///    [`try_receive`](Self::try_receive) — recorded before: roll back,
    ///    [`InboxOutcome::Duplicate`], the handler does not run (while
    ///    another transaction holds the same pair uncommitted, this one
    ///    waits for it, then is a duplicate if it committed);
    /// 3. run `handler` with the open transaction, guarded by
    ///    [`run_inbox_handler`] (time limit `handler_timeout`, panics caught);
    /// 4. when it succeeded, check that the transaction still holds the
    ///    inbox entry (a deadlock the handler swallowed rolled the whole
    ///    transaction back, and later statements ran outside it), then
    ///    commit ([`InboxOutcome::Committed`]); roll back otherwise.
    ///
    /// A handler error caused by the database being unreachable or busy —
    /// a `sqlx::Error` or an `outbox_api::Error` in its source chain that
    /// [`error_kind`](crate::error_kind) calls `Unavailable` (connection
    /// lost, pool timed out, deadlock 1213, lock wait timeout 1205) — is
    /// [`InboxOutcome::HandlerUnavailable`]: retried without counting an
    /// attempt. Begin, inbox insert or commit failing is
    /// [`InboxOutcome::StoreFailed`], uncounted too.
    pub async fn receive_once<F>(
        &self,
        pool: &MySqlPool,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        handler: F,
    ) -> InboxOutcome
    where
        F: AsyncFnOnce(&mut MySqlConnection) -> Result<(), HandlerError>,
    {
        let inbox = self.inbox_table().to_owned();
        let mut tx = match pool.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                return InboxOutcome::StoreFailed(format!(
                    "beginning the inbox transaction on `{inbox}`: {e}"
                ));
            }
        };
        match self.try_receive(&mut tx, consumer, message_id).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = tx.rollback().await;
                return InboxOutcome::Duplicate;
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return InboxOutcome::StoreFailed(outbox_api::error_chain(&e));
            }
        }
        let run = handler(&mut tx);
        if let Some(outcome) = run_inbox_handler(handler_timeout, run, driver_unavailable).await {
            let _ = tx.rollback().await;
            return outcome;
        }
        match self.holds_entry(&mut tx, consumer, message_id).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = tx.rollback().await;
                return InboxOutcome::HandlerFailed(
                    "the handler returned Ok, but its transaction had been rolled back \
                     (a deadlock or an SQL error it did not return?)"
                        .to_owned(),
                );
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return if error_kind(&e) == ErrorKind::Unavailable {
                    InboxOutcome::StoreFailed(format!(
                        "checking the inbox transaction on `{inbox}`: {e}"
                    ))
                } else {
                    InboxOutcome::HandlerFailed(format!(
                        "the handler returned Ok, but its transaction had failed: {e}"
                    ))
                };
            }
        }
        match tx.commit().await {
            Ok(()) => InboxOutcome::Committed,
            Err(e) => InboxOutcome::StoreFailed(format!(
                "committing the inbox transaction on `{inbox}`: {e}"
            )),
        }
    }
}

/// Whether a driver error says the database is unavailable or busy: the
/// MySQL half of [`outbox_api::classify_handler_error`].
fn driver_unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    error
        .downcast_ref::<sqlx::Error>()
        .is_some_and(|e| error_kind(e) == ErrorKind::Unavailable)
}
