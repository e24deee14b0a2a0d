//! The inbox transaction on PostgreSQL: record a received message and run
//! its handler in one transaction, so that at-least-once delivery gives
//! exactly-once effects. The RabbitMQ consumer (feature `postgres-inbox` of
//! outbox-rabbitmq) and applications' own receivers use this one helper,
//! the mirror of `SqliteOutbox::receive_once`.

use std::time::Duration;

use outbox_api::{
    ErrorKind, HandlerError, InboxOutcome, MessageId, TemporarilyUnavailable, run_guarded,
};
use sqlx::{PgConnection, PgPool};

use crate::PgOutbox;
use crate::error::error_kind;

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
    ///    [`run_guarded`] (time limit `handler_timeout`, panics caught);
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
        let run = async {
            handler(&mut tx).await.map_err(|e| {
                if database_unavailable(&*e) {
                    TemporarilyUnavailable::caused_by(e).into()
                } else {
                    e
                }
            })
        };
        let outcome = run_guarded(handler_timeout, run).await;
        if let Some(outcome) = InboxOutcome::unless_succeeded(outcome) {
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

/// Whether `error`'s source chain holds a database error that says "try
/// again later".
fn database_unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
            if error_kind(sqlx) == ErrorKind::Unavailable {
                return true;
            }
        }
        if let Some(ours) = e.downcast_ref::<outbox_api::Error>() {
            if ours.kind() == ErrorKind::Unavailable {
                return true;
            }
        }
        next = e.source();
    }
    false
}
