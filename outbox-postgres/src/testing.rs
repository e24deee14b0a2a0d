//! A PostgreSQL store under test (feature `testing`): a fresh schema in the
//! test database, dropped again when the fixture is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use outbox_api::testing::{
    ContainerSpec, InboxUnderTest, ServiceSpec, StoreUnderTest, service_url,
};
use std::time::Duration;

use outbox_api::{
    ClaimRequest, Clock, HandlerError, MessageId, MessageKind, NewMessage, OperatorStore, Result,
    Store, Timestamp,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

use crate::{PgInbox, PgStore, PgStoreBuilder};

/// The PostgreSQL server the tests use: `OUTBOX_PG_URL`, else the local
/// default `postgres://postgres@127.0.0.1:5432/test` if it answers.
pub const POSTGRES: ServiceSpec = ServiceSpec {
    name: "PostgreSQL",
    variable: "OUTBOX_PG_URL",
    local_url: "postgres://postgres@127.0.0.1:5432/test",
    local_addr: ([127, 0, 0, 1], 5432),
    setup: "database `test`, user `postgres` with trust authentication",
    container: ContainerSpec {
        image_variable: "OUTBOX_PG_IMAGE",
        image: "postgres:15",
        port: 5432,
        extra_ports: 0,
        env: &[
            ("POSTGRES_HOST_AUTH_METHOD", "trust"),
            ("POSTGRES_DB", "test"),
            ("PGPORT", "{port}"),
        ],
        cmd: &[],
        ready: "database system is ready to accept connections",
        url: "postgres://postgres@{host}:{port}/test",
    },
};

/// The test database's URL ([`POSTGRES`]); otherwise the test fails saying
/// how to provide one.
pub fn database_url() -> String {
    service_url(&POSTGRES)
}

/// A schema name no other fixture uses, in this process or another.
pub fn unique_schema(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}_{:04x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst),
        fastrand_u16()
    )
}

fn fastrand_u16() -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ (nanos >> 16)) as u16
}

/// A fresh outbox in its own schema of the test database (dropped with
/// the fixture), with a pool for the application's transactions.
pub struct PgUnderTest {
    url: String,
    schema: String,
    store: PgStore,
    pool: PgPool,
    inbox: PgInbox,
}

impl std::fmt::Debug for PgUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgUnderTest")
            .field("schema", &self.schema)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl PgUnderTest {
    /// Creates a schema and migrates a store in it; enqueue times come from
    /// `clock` (the wall clock if `None`).
    pub async fn fresh(clock: Option<Arc<dyn Clock>>) -> Self {
        Self::fresh_with(clock, |b| b).await
    }

    /// [`fresh`](Self::fresh), with the store's builder adjusted by `adjust`
    /// (the schema and table names are set before).
    pub async fn fresh_with(
        clock: Option<Arc<dyn Clock>>,
        adjust: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
    ) -> Self {
        Self::fresh_from(clock, |tagged, _| PgStore::builder(tagged), adjust).await
    }

    /// [`fresh`](Self::fresh), the store on a pool of the application's
    /// (`PgStore::builder_with_pool`), whose connections keep their own
    /// settings: its claims are `BEGIN` with the claim's settings, the
    /// claim and `COMMIT`. (A store that opens its own pool, as `fresh`'s
    /// does, claims in one statement.)
    pub async fn fresh_on_application_pool() -> Self {
        Self::fresh_on_application_pool_with(None, |b| b).await
    }

    /// [`fresh_on_application_pool`](Self::fresh_on_application_pool)
    /// with a clock and the builder adjusted, as
    /// [`fresh_with`](Self::fresh_with).
    pub async fn fresh_on_application_pool_with(
        clock: Option<Arc<dyn Clock>>,
        adjust: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
    ) -> Self {
        Self::fresh_from(
            clock,
            |tagged, _| {
                let pool = PgPoolOptions::new()
                    .max_connections(4)
                    .connect_lazy(tagged)
                    .expect("the test database's URL");
                PgStore::builder_with_pool(pool)
            },
            adjust,
        )
        .await
    }

    /// [`fresh`](Self::fresh), the store made by
    /// [`PgTenantPools::builder`](crate::PgTenantPools::builder) over one
    /// pinned pool of 4 connections and a bulk pool of 2: a fleet's store,
    /// its claims one statement each, its large statements on the bulk
    /// pool (a claim after a full one, say). The builder is adjusted as
    /// in [`fresh_with`](Self::fresh_with).
    pub async fn fresh_on_tenant_pools(
        clock: Option<Arc<dyn Clock>>,
        adjust: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
    ) -> Self {
        Self::fresh_from(
            clock,
            |tagged, schema| {
                let options: sqlx::postgres::PgConnectOptions =
                    tagged.parse().expect("the test database's URL");
                crate::PgTenantPools::connect_lazy(options, 1, 4)
                    .and_then(|pools| pools.with_bulk_pool(2))
                    .expect("tenant pools")
                    .builder(schema)
            },
            adjust,
        )
        .await
    }

    /// The fixture, its store's builder made by `make` from the URL tagged
    /// with the schema's name and the schema.
    async fn fresh_from(
        clock: Option<Arc<dyn Clock>>,
        make: impl FnOnce(&str, &str) -> PgStoreBuilder,
        adjust: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
    ) -> Self {
        let url = database_url();
        let schema = unique_schema("outbox_test");
        // Every connection of the fixture carries the schema's name, so
        // that its drop can end any of them still open.
        let separator = if url.contains('?') { '&' } else { '?' };
        let tagged = format!("{url}{separator}application_name={schema}");
        let mut builder = make(&tagged, &schema)
            .schema(schema.clone())
            .table("test_outbox")
            .inbox_table("test_inbox");
        if let Some(clock) = clock {
            builder = builder.clock(clock);
        }
        let store = adjust(builder)
            .connect()
            .await
            .expect("connect to PostgreSQL");
        store.migrate().await.expect("migrate");
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&tagged)
            .await
            .expect("application pool");
        let inbox = PgInbox::new(store.outbox(), pool.clone());
        PgUnderTest {
            url,
            schema,
            store,
            pool,
            inbox,
        }
    }

    /// The store.
    pub fn pg(&self) -> &PgStore {
        &self.store
    }

    /// The application's pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The fixture's schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// How many rows the outbox table holds, whatever their state.
    pub async fn outbox_rows(&self) -> u64 {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            r#"SELECT count(*) FROM "{}"."{}""#,
            self.schema,
            self.store.table()
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count the outbox rows");
        n as u64
    }

    /// The test database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Another store on the fixture's tables, with a pool of `connections`
    /// of its own: none of the fixture's store's in-process signals reach
    /// it, as with a store in another process.
    pub async fn second_store(&self, connections: u32) -> PgStore {
        PgStore::builder(&self.url)
            .schema(&self.schema)
            .table("test_outbox")
            .inbox_table("test_inbox")
            .max_connections(connections)
            .connect()
            .await
            .expect("a second store on the same table")
    }

    /// Shared buffers one claim of `limit` touches walking from `floor`
    /// (`(seq, retry generation)`, as [`PgStore::claim_floor`] gives it;
    /// `(0, -1)` walks from the start), run as the relay runs it under
    /// `EXPLAIN (ANALYZE, BUFFERS)` and rolled back; with the plan.
    pub async fn claim_buffers(&self, floor: (i64, i64), limit: i64) -> (u64, String) {
        let mut conn = self.pool.acquire().await.expect("connection");
        sqlx::raw_sql(sqlx::AssertSqlSafe(self.store.begin_claim_statement()))
            .execute(&mut *conn)
            .await
            .expect("begin the claim");
        let now = Timestamp::now().as_millis();
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, BUFFERS) {}",
            self.store.claim_statement()
        )))
        .bind("explain")
        .bind(now + 30_000)
        .bind(now)
        .bind(None::<&str>)
        .bind(limit)
        .bind(floor.0)
        .bind(floor.1)
        .fetch_all(&mut *conn)
        .await
        .expect("explain the claim");
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut *conn)
            .await
            .expect("rollback");
        let plan = plan.join("\n");
        (plan_buffers(&plan), plan)
    }
}

/// The shared buffers a plan of `EXPLAIN (ANALYZE, BUFFERS)` touched in
/// all: its first `Buffers:` line, the whole statement's (0 if none).
pub fn plan_buffers(plan: &str) -> u64 {
    plan.lines()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .map_or(0, |line| {
            line.split_whitespace()
                .filter_map(|w| w.split_once('=').and_then(|(_, n)| n.parse::<u64>().ok()))
                .sum()
        })
}

/// Enqueues one message (`T`, payload `x`) on `store`'s own pool and
/// commits it.
pub async fn commit_one(store: &PgStore) {
    let mut tx = store.pool().begin().await.expect("begin");
    store
        .outbox()
        .enqueue(
            &mut tx,
            NewMessage::new(MessageKind::Domain, "T", b"x".to_vec()),
        )
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
}

/// The messages' payloads as text, in order.
pub fn payloads(messages: &[outbox_api::Message]) -> Vec<String> {
    messages
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

/// A domain message of type `Test` whose payload is `n` in decimal.
pub fn test_message(n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Test", n.to_string().into_bytes())
}

/// A claim of at most `limit` messages by worker `w`, leased for 30 s, at
/// a `now` one second ahead (so that messages enqueued just before are
/// available whatever the clock's resolution).
pub fn claim_request(limit: usize) -> ClaimRequest {
    ClaimRequest::new(
        "w",
        limit,
        Duration::from_secs(30),
        Timestamp::now().saturating_add(Duration::from_secs(1)),
    )
}

/// Runs `cleanup` on a connection of its own to `url`, from a thread of
/// its own with a runtime of its own — for a test fixture's `Drop`, which
/// cannot await and may run inside a runtime. Returns whether it
/// succeeded.
pub fn clean_up_now<F>(url: &str, cleanup: F) -> bool
where
    F: for<'c> FnOnce(
            &'c mut PgConnection,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'c>,
        > + Send
        + 'static,
{
    let url = url.to_owned();
    let done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            use sqlx::Connection;
            let mut conn = PgConnection::connect(&url).await?;
            cleanup(&mut conn).await?;
            conn.close().await
        })
    })
    .join();
    matches!(done, Ok(Ok(())))
}

impl Drop for PgUnderTest {
    /// Drops the schema (after ending the sessions of its stores, named by
    /// it) with [`clean_up_now`].
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let dropped = clean_up_now(&self.url, move |conn| {
            Box::pin(async move {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&schema)
                .execute(&mut *conn)
                .await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE"#
                )))
                .execute(&mut *conn)
                .await?;
                Ok(())
            })
        });
        if !dropped {
            eprintln!("could not drop test schema {}", self.schema);
        }
    }
}

#[async_trait]
impl StoreUnderTest for PgUnderTest {
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
impl InboxUnderTest for PgUnderTest {
    type Inbox = PgInbox;

    fn inbox(&self) -> &PgInbox {
        &self.inbox
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn enqueue_in(
        &self,
        conn: &mut PgConnection,
        message: NewMessage,
    ) -> std::result::Result<(), HandlerError> {
        self.inbox.outbox().enqueue(conn, message).await?;
        Ok(())
    }

    fn driver_unavailable_error(&self) -> HandlerError {
        sqlx::Error::PoolTimedOut.into()
    }
}

/// Waits (20 s at most, then panics) until the connections named
/// `application_name` hold one `LISTEN`: a store's listener listens.
pub async fn listens(pool: &PgPool, application_name: &str) {
    outbox_api::testing::wait_until("the listener listens", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(application_name)
        .fetch_one(pool)
        .await
        .unwrap()
            == 1
    })
    .await;
}
