//! The inbox transaction on PostgreSQL: record a received message and run
//! its handler in one transaction, so that at-least-once delivery gives
//! exactly-once effects: [`PgOutbox::receive_once`] for a closure, and
//! [`PgInbox`], the [`Inbox`] contract that receivers (the RabbitMQ
//! consumer) are written against, on top of it — the mirror of
//! `SqliteOutbox::receive_once` and `SqliteInbox`.

use std::time::Duration;

use async_trait::async_trait;
#[cfg(doc)]
use outbox_api::TemporarilyUnavailable;
use outbox_api::{
    Error, ErrorKind, HandlerError, Inbox, InboxOutcome, InboxWork, MessageId, Result, Timestamp,
    run_inbox_handler,
};
use sqlx::{PgConnection, PgPool};

use crate::PgOutbox;
use crate::error::error_kind;

/// The inbox of a PostgreSQL outbox, on the application's pool: the
/// [`Inbox`] contract, each message in one transaction of `pool`
/// ([`PgOutbox::receive_once`]). One connection per message in flight, one
/// more while a purge runs.
#[derive(Debug, Clone)]
pub struct PgInbox {
    outbox: PgOutbox,
    pool: PgPool,
}

impl PgInbox {
    /// The inbox of `outbox`, whose transactions run on `pool` (the
    /// application's sqlx pool on the same database; the handler's effects
    /// and replies go through it).
    pub fn new(outbox: PgOutbox, pool: PgPool) -> Self {
        PgInbox { outbox, pool }
    }

    /// The outbox the handler enqueues replies with.
    pub fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    /// The pool the inbox transactions run on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

#[async_trait]
impl Inbox for PgInbox {
    type Conn = PgConnection;

    fn name(&self) -> String {
        self.outbox.inbox_display()
    }

    async fn receive_once(
        &self,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        work: &dyn InboxWork<PgConnection>,
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

impl PgOutbox {
    /// Receives `message_id` for `consumer` exactly once, in one transaction
    /// on `pool` (a pool on this outbox's database):
    ///
    /// 1. `BEGIN`;
    /// 2. record `(consumer, message_id)` in the inbox with
    ///    [`try_receive`](Self::try_receive) — recorded before: roll back,
    ///    [`InboxOutcome::Duplicate`], the handler does not run (while
    ///    another transaction holds the same pair uncommitted, this one
    ///    waits for it, then is a duplicate if it committed);
    /// 3. run `handler` with the open transaction, guarded by
    ///    [`run_inbox_handler`] (time limit `handler_timeout`, panics caught);
    /// 4. when it succeeded, check that the transaction is still usable (a
    ///    handler that swallowed an SQL error leaves it aborted, and
    ///    PostgreSQL would answer the `COMMIT` with a silent rollback), then
    ///    commit ([`InboxOutcome::Committed`]); roll back otherwise.
    ///
    /// A handler error caused by the database being unreachable or busy —
    /// a `sqlx::Error` or an `outbox_api::Error` in its source chain that
    /// [`error_kind`](crate::error_kind) calls `Unavailable` (connection
    /// lost, pool timed out, deadlock, serialization failure, server
    /// shutting down) — is [`InboxOutcome::HandlerUnavailable`]: an outage,
    /// retried without counting an attempt, as if the handler had returned
    /// [`TemporarilyUnavailable`]. Begin, inbox insert or commit failing is
    /// [`InboxOutcome::StoreFailed`], uncounted too.
    ///
    /// The handler does the message's effects with the connection it is
    /// given, and enqueues replies with [`enqueue`](Self::enqueue)`(tx, …)`:
    /// they commit together with the inbox entry, or not at all. It must
    /// not commit or roll back itself. Acknowledge the message only after
    /// `Committed` or `Duplicate`.
    ///
    /// ```no_run
    /// # async fn demo(outbox: outbox_postgres::PgOutbox, pool: outbox_postgres::sqlx::PgPool, id: outbox_api::MessageId) {
    /// use std::time::Duration;
    /// use outbox_api::InboxOutcome;
    /// use outbox_postgres::sqlx;
    ///
    /// let outcome = outbox
    ///     .receive_once(&pool, "billing", id, Duration::from_secs(30), async |tx| {
    ///         sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
    ///             .bind(id.as_uuid())
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok(())
    ///     })
    ///     .await;
    /// assert!(matches!(outcome, InboxOutcome::Committed | InboxOutcome::Duplicate));
    /// # }
    /// ```
    pub async fn receive_once<F>(
        &self,
        pool: &PgPool,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        handler: F,
    ) -> InboxOutcome
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<(), HandlerError>,
    {
        let inbox = self.inbox_display();
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
        // An aborted transaction answers every statement with 25P02.
        if let Err(e) = sqlx::query("SELECT 1").execute(&mut *tx).await {
            let _ = tx.rollback().await;
            return if error_kind(&e) == ErrorKind::Unavailable {
                InboxOutcome::StoreFailed(format!(
                    "checking the inbox transaction on `{inbox}`: {e}"
                ))
            } else {
                InboxOutcome::HandlerFailed(format!(
                    "the handler returned Ok, but its transaction had failed \
                     (an SQL error it did not return?): {e}"
                ))
            };
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
/// PostgreSQL half of [`outbox_api::classify_handler_error`].
fn driver_unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    error
        .downcast_ref::<sqlx::Error>()
        .is_some_and(|e| error_kind(e) == ErrorKind::Unavailable)
}
