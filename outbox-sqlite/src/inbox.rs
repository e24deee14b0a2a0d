//! The inbox transaction: record a received message and run its handler in
//! one SQLite transaction, so that at-least-once delivery gives
//! exactly-once effects: [`SqliteOutbox::receive_once`] for a closure, and
//! [`SqliteInbox`], the [`Inbox`] contract that receivers (the RabbitMQ
//! consumer) are written against, on top of it.

use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{
    HandlerError, Inbox, InboxOutcome, InboxWork, MessageId, Result, Timestamp, run_inbox_handler,
};
use sqlx::{SqliteConnection, SqlitePool};

use crate::SqliteOutbox;
use crate::error::driver_unavailable;

/// The inbox of a SQLite outbox, on the application's pool: the [`Inbox`]
/// contract, each message in one `BEGIN IMMEDIATE` transaction of `pool`
/// ([`SqliteOutbox::receive_once`]).
#[derive(Debug, Clone)]
pub struct SqliteInbox {
    outbox: SqliteOutbox,
    pool: SqlitePool,
}

impl SqliteInbox {
    /// The inbox of `outbox`, whose transactions run on `pool` (the
    /// application's sqlx pool on the same database file; the handler's
    /// effects and replies go through it).
    pub fn new(outbox: SqliteOutbox, pool: SqlitePool) -> Self {
        SqliteInbox { outbox, pool }
    }

    /// The outbox the handler enqueues replies with.
    pub fn outbox(&self) -> &SqliteOutbox {
        &self.outbox
    }

    /// The pool the inbox transactions run on.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

#[async_trait]
impl Inbox for SqliteInbox {
    type Conn = SqliteConnection;

    fn name(&self) -> String {
        self.outbox.inbox_table().to_owned()
    }

    async fn receive_once(
        &self,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        work: &dyn InboxWork<SqliteConnection>,
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
        self.outbox.purge_inbox(&self.pool, before, limit).await
    }
}

impl SqliteOutbox {
    /// Receives `message_id` for `consumer` exactly once, in one transaction
    /// on `pool` (a pool on this outbox's database file):
    ///
    /// 1. `BEGIN IMMEDIATE`;
    /// 2. record `(consumer, message_id)` in the inbox with
    ///    [`try_receive`](Self::try_receive) — recorded before: roll back,
    ///    [`InboxOutcome::Duplicate`], the handler does not run;
    /// 3. run `handler` with the open transaction, guarded by
    ///    [`run_inbox_handler`] (time limit `handler_timeout`, panics
    ///    caught; an error meaning the database is busy or unavailable is
    ///    [`InboxOutcome::HandlerUnavailable`], retried uncounted, as on
    ///    every store);
    /// 4. commit when it succeeded ([`InboxOutcome::Committed`]), roll back
    ///    otherwise.
    ///
    /// The handler does the message's effects with the connection it is
    /// given, and enqueues replies with [`enqueue`](Self::enqueue)`(&mut
    /// *tx, …)`: they commit together with the inbox entry, or not at all.
    /// It must not commit or roll back itself. Acknowledge the message only
    /// after `Committed` or `Duplicate`.
    ///
    /// ```no_run
    /// # async fn demo(outbox: outbox_sqlite::SqliteOutbox, pool: outbox_sqlite::sqlx::SqlitePool, id: outbox_api::MessageId) {
    /// use std::time::Duration;
    /// use outbox_sqlite::{InboxOutcome, sqlx};
    ///
    /// let outcome = outbox
    ///     .receive_once(&pool, "billing", id, Duration::from_secs(30), async |tx| {
    ///         sqlx::query("INSERT INTO invoices (order_id) VALUES (?)")
    ///             .bind(id.to_string())
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
        pool: &SqlitePool,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        handler: F,
    ) -> InboxOutcome
    where
        F: AsyncFnOnce(&mut SqliteConnection) -> Result<(), HandlerError>,
    {
        let mut tx = match pool.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => tx,
            Err(e) => {
                return InboxOutcome::StoreFailed(format!(
                    "beginning the inbox transaction on `{}`: {e}",
                    self.inbox_table()
                ));
            }
        };
        match self.try_receive(&mut *tx, consumer, message_id).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = tx.rollback().await;
                return InboxOutcome::Duplicate;
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return InboxOutcome::StoreFailed(e.to_string());
            }
        }
        let run = handler(&mut tx);
        if let Some(outcome) = run_inbox_handler(handler_timeout, run, driver_unavailable).await {
            let _ = tx.rollback().await;
            return outcome;
        }
        match tx.commit().await {
            Ok(()) => InboxOutcome::Committed,
            Err(e) => InboxOutcome::StoreFailed(format!(
                "committing the inbox transaction on `{}`: {e}",
                self.inbox_table()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    //! What every inbox promises is checked by the inbox conformance suite
    //! (`tests/conformance.rs`); this is SQLite's own part.

    use super::*;
    use crate::testing::SqlxUnderTest;

    #[tokio::test]
    async fn a_database_failure_is_a_store_failure() {
        let db = SqlxUnderTest::fresh(None).await;
        db.pool().close().await;
        let outcome = db
            .sqlite()
            .outbox()
            .receive_once(
                db.pool(),
                "billing",
                MessageId::new(),
                Duration::from_secs(10),
                async |_| Ok(()),
            )
            .await;
        assert!(
            matches!(&outcome, InboxOutcome::StoreFailed(e) if e.contains("beginning")),
            "{outcome:?}"
        );
    }
}
