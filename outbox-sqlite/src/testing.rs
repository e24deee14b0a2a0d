//! A SQLite store under test (feature `testing`): a file database in a fresh
//! temporary directory, enqueued into through a sqlx pool.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::testing::{InboxUnderTest, StoreUnderTest};
use outbox_api::{Clock, HandlerError, MessageId, NewMessage, OperatorStore, Result, Store};
use sqlx::SqliteConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

use crate::{SqliteInbox, SqliteStore};

/// A fresh SQLite outbox in its own temporary directory (deleted on drop),
/// with a sqlx pool for the application's transactions.
#[derive(Debug)]
pub struct SqlxUnderTest {
    dir: tempfile::TempDir,
    store: SqliteStore,
    pool: SqlitePool,
    inbox: SqliteInbox,
}

impl SqlxUnderTest {
    /// Creates and migrates the database; enqueue times come from `clock`
    /// (the wall clock if `None`).
    pub async fn fresh(clock: Option<Arc<dyn Clock>>) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut builder = SqliteStore::builder(dir.path().join("outbox.db"))
            .table("test_outbox")
            .inbox_table("test_inbox");
        if let Some(clock) = clock {
            builder = builder.clock(clock);
        }
        let store = builder.connect().await.expect("open");
        store.migrate().await.expect("migrate");
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(SqliteConnectOptions::new().filename(store.path()))
            .await
            .expect("sqlx pool");
        let inbox = SqliteInbox::new(store.outbox(), pool.clone());
        SqlxUnderTest {
            dir,
            store,
            pool,
            inbox,
        }
    }

    /// The store.
    pub fn sqlite(&self) -> &SqliteStore {
        &self.store
    }

    /// The application's pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The temporary directory holding the database.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

#[async_trait]
impl StoreUnderTest for SqlxUnderTest {
    fn store(&self) -> Arc<dyn OperatorStore> {
        Arc::new(self.store.clone())
    }

    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> Result<Vec<MessageId>> {
        let outbox = self.store.outbox();
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .expect("begin");
        let mut ids = Vec::new();
        for m in messages {
            ids.push(outbox.enqueue(&mut *tx, m).await?);
        }
        tx.commit().await.expect("commit");
        Ok(ids)
    }

    async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>) {
        let outbox = self.store.outbox();
        let mut tx = self.pool.begin().await.expect("begin");
        for m in messages {
            outbox.enqueue(&mut *tx, m).await.expect("enqueue");
        }
        tx.rollback().await.expect("rollback");
    }
}

#[async_trait]
impl InboxUnderTest for SqlxUnderTest {
    type Inbox = SqliteInbox;

    fn inbox(&self) -> &SqliteInbox {
        &self.inbox
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn enqueue_in(
        &self,
        conn: &mut SqliteConnection,
        message: NewMessage,
    ) -> std::result::Result<(), HandlerError> {
        self.inbox.outbox().enqueue(&mut *conn, message).await?;
        Ok(())
    }

    fn driver_unavailable_error(&self) -> HandlerError {
        sqlx::Error::PoolTimedOut.into()
    }
}
