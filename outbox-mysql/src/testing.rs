//! A MySQL/MariaDB store under test (feature `testing`): fresh tables with
//! unique names in the test database, dropped again with the fixture.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use outbox_api::testing::{
    ContainerSpec, InboxUnderTest, ServiceSpec, StoreUnderTest, service_url,
};
use outbox_api::{Clock, HandlerError, MessageId, NewMessage, OperatorStore, Result, Store};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySqlConnection, MySqlPool};

use crate::{MySqlInbox, MySqlStore, MySqlStoreBuilder};

/// The MySQL or MariaDB server the tests use: `OUTBOX_MYSQL_URL`, else the
/// local default `mysql://root@127.0.0.1:3306/test` if it answers.
pub const MYSQL: ServiceSpec = ServiceSpec {
    name: "MySQL/MariaDB",
    variable: "OUTBOX_MYSQL_URL",
    local_url: "mysql://root@127.0.0.1:3306/test",
    local_addr: ([127, 0, 0, 1], 3306),
    setup: "database `test`, user `root` without a password over TCP \
            (`mariadb -e \"CREATE DATABASE IF NOT EXISTS test\"`)",
    container: ContainerSpec {
        image_variable: "OUTBOX_MYSQL_IMAGE",
        image: "mariadb:10.11",
        port: 3306,
        extra_ports: 0,
        env: &[
            ("MARIADB_ALLOW_EMPTY_ROOT_PASSWORD", "1"),
            ("MARIADB_DATABASE", "test"),
            ("MARIADB_ROOT_HOST", "%"),
        ],
        cmd: &["--port={port}"],
        ready: "ready for connections",
        url: "mysql://root@{host}:{port}/test",
    },
};

/// The test database's URL ([`MYSQL`]); otherwise the test fails saying
/// how to provide one.
pub fn database_url() -> String {
    service_url(&MYSQL)
}

/// A table-name prefix no other fixture uses, in this process or another.
pub fn unique_prefix(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{:04x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst),
        (nanos ^ (nanos >> 16)) as u16
    )
}

/// A fresh outbox (`<prefix>_outbox`, its `_keys` table and
/// `<prefix>_inbox`) in the test database, dropped with the fixture, with
/// a pool for the application's transactions.
pub struct MySqlUnderTest {
    url: String,
    prefix: String,
    store: MySqlStore,
    pool: MySqlPool,
    inbox: MySqlInbox,
}

impl std::fmt::Debug for MySqlUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlUnderTest")
            .field("prefix", &self.prefix)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl MySqlUnderTest {
    /// Fresh tables and a migrated store on them; enqueue times come from
    /// `clock` (the wall clock if `None`).
    pub async fn fresh(clock: Option<Arc<dyn Clock>>) -> Self {
        Self::fresh_with(clock, |b| b).await
    }

    /// [`fresh`](Self::fresh), with the store's builder adjusted by `adjust`
    /// (the table names are set before).
    pub async fn fresh_with(
        clock: Option<Arc<dyn Clock>>,
        adjust: impl FnOnce(MySqlStoreBuilder) -> MySqlStoreBuilder,
    ) -> Self {
        let url = database_url();
        let prefix = unique_prefix("t");
        let mut builder = MySqlStore::builder(&url)
            .table(format!("{prefix}_outbox"))
            .inbox_table(format!("{prefix}_inbox"));
        if let Some(clock) = clock {
            builder = builder.clock(clock);
        }
        let store = adjust(builder)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to MySQL/MariaDB at {}: {e}", MYSQL.variable));
        store.migrate().await.expect("migrate");
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("application pool");
        let inbox = MySqlInbox::new(store.outbox(), pool.clone());
        MySqlUnderTest {
            url,
            prefix,
            store,
            pool,
            inbox,
        }
    }

    /// The store.
    pub fn mysql(&self) -> &MySqlStore {
        &self.store
    }

    /// The application's pool (REPEATABLE READ, the server's default).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The inbox on the application's pool.
    pub fn mysql_inbox(&self) -> &MySqlInbox {
        &self.inbox
    }

    /// The test database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The prefix of the fixture's table names.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Another store on the fixture's tables, with a pool of `connections`
    /// of its own: none of the fixture's store's in-process signals reach
    /// it, as with a store in another process.
    pub async fn second_store(&self, connections: u32) -> MySqlStore {
        MySqlStore::builder(&self.url)
            .table(self.store.table())
            .inbox_table(self.store.inbox_table())
            .max_connections(connections)
            .connect()
            .await
            .expect("a second store on the same table")
    }

    /// How many rows the outbox table holds, whatever their state.
    pub async fn outbox_rows(&self) -> u64 {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}`",
            self.store.table()
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count the outbox rows");
        n as u64
    }
}

impl Drop for MySqlUnderTest {
    /// Drops the fixture's tables, on a connection of its own from a thread
    /// of its own (a `Drop` cannot await and may run inside a runtime).
    fn drop(&mut self) {
        let url = self.url.clone();
        let tables = [
            self.store.table().to_owned(),
            format!("{}_keys", self.store.table()),
            self.store.inbox_table().to_owned(),
        ];
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                use sqlx::Connection;
                let mut conn = MySqlConnection::connect(&url).await?;
                for t in &tables {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
                        .execute(&mut conn)
                        .await?;
                }
                sqlx::query("DELETE FROM outbox_schema_versions WHERE table_name IN (?, ?)")
                    .bind(&tables[0])
                    .bind(&tables[2])
                    .execute(&mut conn)
                    .await?;
                conn.close().await
            })
        })
        .join();
        if !matches!(done, Ok(Ok(()))) {
            eprintln!("could not drop the test tables {}_*", self.prefix);
        }
    }
}

#[async_trait]
impl StoreUnderTest for MySqlUnderTest {
    fn store(&self) -> Arc<dyn OperatorStore> {
        Arc::new(self.store.clone())
    }

    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> Result<Vec<MessageId>> {
        let outbox = self.store.outbox();
        let mut tx = self.pool.begin().await.expect("begin");
        let mut ids = Vec::new();
        for m in messages {
            ids.push(outbox.enqueue(&mut tx, m).await?);
        }
        tx.commit().await.expect("commit");
        Ok(ids)
    }

    async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>) {
        let outbox = self.store.outbox();
        let mut tx = self.pool.begin().await.expect("begin");
        for m in messages {
            outbox.enqueue(&mut tx, m).await.expect("enqueue");
        }
        tx.rollback().await.expect("rollback");
    }
}

#[async_trait]
impl InboxUnderTest for MySqlUnderTest {
    type Inbox = MySqlInbox;

    fn inbox(&self) -> &MySqlInbox {
        &self.inbox
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn enqueue_in(
        &self,
        conn: &mut MySqlConnection,
        message: NewMessage,
    ) -> std::result::Result<(), HandlerError> {
        self.inbox.outbox().enqueue(conn, message).await?;
        Ok(())
    }

    fn driver_unavailable_error(&self) -> HandlerError {
        sqlx::Error::PoolTimedOut.into()
    }
}
