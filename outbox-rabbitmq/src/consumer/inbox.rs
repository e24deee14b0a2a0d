//! The inbox behind a consumer: one small enum over the backends, so that
//! the consume loop, settling and the purge are written once. Each variant
//! runs its backend's own inbox transaction (`SqliteOutbox::receive_once`,
//! `PgOutbox::receive_once`) and purge statement.

use std::sync::Arc;
use std::time::Duration;

use outbox_api::{InboxOutcome, Result, Timestamp};
#[cfg(feature = "postgres-inbox")]
use outbox_postgres::{
    PgOutbox,
    sqlx::{PgConnection, PgPool},
};
#[cfg(feature = "sqlite-inbox")]
use outbox_sqlite::{
    SqliteOutbox,
    sqlx::{SqliteConnection, SqlitePool},
};

use super::{InboxHandler, Received};

/// Where a consumer records what it received, with the application's
/// handler on that backend's connection.
#[derive(Clone)]
pub(super) enum Inbox {
    /// SQLite (feature `sqlite-inbox`).
    #[cfg(feature = "sqlite-inbox")]
    Sqlite {
        outbox: SqliteOutbox,
        pool: SqlitePool,
        handler: Arc<dyn InboxHandler<SqliteConnection>>,
    },
    /// PostgreSQL (feature `postgres-inbox`).
    #[cfg(feature = "postgres-inbox")]
    Postgres {
        outbox: PgOutbox,
        pool: PgPool,
        handler: Arc<dyn InboxHandler<PgConnection>>,
    },
}

impl Inbox {
    /// The inbox table, for logs.
    pub(super) fn table(&self) -> String {
        match self {
            #[cfg(feature = "sqlite-inbox")]
            Inbox::Sqlite { outbox, .. } => outbox.inbox_table().to_owned(),
            #[cfg(feature = "postgres-inbox")]
            Inbox::Postgres { outbox, .. } => {
                format!("{}.{}", outbox.schema(), outbox.inbox_table())
            }
        }
    }

    /// The inbox transaction around the handler for `received`.
    pub(super) async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        handler_timeout: Duration,
    ) -> InboxOutcome {
        match self {
            #[cfg(feature = "sqlite-inbox")]
            Inbox::Sqlite {
                outbox,
                pool,
                handler,
            } => {
                outbox
                    .receive_once(pool, consumer, received.id, handler_timeout, async |tx| {
                        handler.handle(received, tx).await
                    })
                    .await
            }
            #[cfg(feature = "postgres-inbox")]
            Inbox::Postgres {
                outbox,
                pool,
                handler,
            } => {
                outbox
                    .receive_once(pool, consumer, received.id, handler_timeout, async |tx| {
                        handler.handle(received, tx).await
                    })
                    .await
            }
        }
    }

    /// Deletes at most `limit` entries received before `before`.
    pub(super) async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64> {
        match self {
            #[cfg(feature = "sqlite-inbox")]
            Inbox::Sqlite { outbox, pool, .. } => outbox.purge_inbox(pool, before, limit).await,
            #[cfg(feature = "postgres-inbox")]
            Inbox::Postgres { outbox, pool, .. } => {
                let mut conn = pool.acquire().await.map_err(|e| {
                    outbox_api::Error::unavailable(format!(
                        "purging the inbox `{}`: no connection: {e}",
                        self.table()
                    ))
                })?;
                outbox.purge_inbox(&mut conn, before, limit).await
            }
        }
    }
}
