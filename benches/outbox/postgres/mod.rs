//! Figures on the PostgreSQL backend (group `postgres`), each beside a
//! baseline from the same run: enqueue overhead against a raw INSERT of the
//! same row (sqlx and tokio-postgres, 1 and 8 writers), bulk against single
//! enqueue, writers with and without the commit announcement, drain by 1, 2
//! and 4 relays against a bare SQL loop running the store's own statements,
//! scheduled → handled at 1k msg/s (the timing of `sqlite_latency`, the
//! transactions started by an application of 8 writers), failover after a relay is killed holding work, and
//! drain while a REPEATABLE READ transaction pins the xmin, and a fleet over 1,000 tenant schemas (`tenants`). Each figure works in a fresh schema of the test database
//! (`OUTBOX_PG_URL`, else the local default), dropped afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::{Handlers, Message, MessageId, NewMessage, Relay, Timestamp};
use outbox_api::testing::services::find;
use outbox_postgres::sqlx::{self, AssertSqlSafe, PgPool, Row};
use outbox_postgres::testing::PgUnderTest;
use outbox_postgres::tokio_postgres::{self, NoTls};
use outbox_postgres::{PgOutbox, PgStore, PgStoreBuilder};

use crate::common::{Figure, counting_handlers, latency_rows, not_measured};
use crate::sqlite::bench_message;
use crate::sqlite_latency::{Run, Times, beside};

/// A fresh schema with the outbox migrated and an `orders` table, the
/// application's business table.
async fn fixture(adjust: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder) -> PgUnderTest {
    let f = PgUnderTest::fresh_with(None, adjust).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"CREATE TABLE "{}".orders (id bigint PRIMARY KEY, customer text NOT NULL, total bigint NOT NULL)"#,
        f.schema()
    )))
    .execute(f.pool())
    .await
    .unwrap();
    f
}

mod drain;
mod enqueue;
mod failover;
mod latency;
mod tenants;

/// Enqueues `n` bench messages in transactions of 1,000 (`enqueue_many`).
async fn fill(f: &PgUnderTest, n: usize) {
    enqueue_bench_messages(f.pool(), &f.pg().outbox(), n).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"VACUUM ANALYZE "{}"."{}""#,
        f.schema(),
        f.pg().table()
    )))
    .execute(f.pool())
    .await
    .unwrap();
}

/// Enqueues `n` bench messages through `outbox` on `pool`, in transactions
/// of 1,000.
async fn enqueue_bench_messages(pool: &PgPool, outbox: &PgOutbox, n: usize) {
    for start in (0..n).step_by(1000) {
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue_many(
                &mut tx,
                (start..(start + 1000).min(n)).map(bench_message).collect(),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}

/// A store on the fixture's table, as a relay in a process of its own
/// would open it.
async fn relay_store(f: &PgUnderTest, url: &str, connections: u32) -> PgStore {
    relay_store_with(f, url, connections, |b| b).await
}

/// [`relay_store`], its builder adjusted by `adjust` first.
async fn relay_store_with(
    f: &PgUnderTest,
    url: &str,
    connections: u32,
    adjust: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
) -> PgStore {
    adjust(
        PgStore::builder(url)
            .schema(f.schema())
            .table(f.pg().table())
            .inbox_table(f.pg().inbox_table())
            .max_connections(connections),
    )
    .connect()
    .await
    .unwrap()
}

/// The group's parts, each runnable alone: `cargo bench --bench outbox --
/// postgres-xmin` runs only that one; `postgres` runs them all.
pub const PARTS: &[&str] = &[
    "postgres-enqueue",
    "postgres-bulk",
    "postgres-wakeup",
    "postgres-drain",
    "postgres-wal",
    "postgres-latency",
    "postgres-failover",
    "postgres-xmin",
    "postgres-tenants",
];

/// The figures of the parts `wanted` names.
pub async fn figures(quick: bool, wanted: impl Fn(&str) -> bool) -> Vec<Figure> {
    let url = match find(&outbox_postgres::testing::POSTGRES) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("every PostgreSQL figure", &how)],
    };
    let mut out = Vec::new();
    if wanted("postgres-enqueue") {
        out.extend(enqueue::enqueue_overhead(quick).await);
    }
    if wanted("postgres-bulk") {
        out.push(enqueue::bulk(quick).await);
    }
    if wanted("postgres-wakeup") {
        out.extend(enqueue::wake_up_cost(quick).await);
    }
    if wanted("postgres-drain") {
        out.extend(drain::drains(quick).await);
    }
    if wanted("postgres-wal") {
        out.extend(drain::wal_flushes(quick).await);
    }
    if wanted("postgres-latency") {
        out.extend(latency::latency(quick, &url).await);
    }
    if wanted("postgres-failover") {
        out.extend(failover::failover(quick).await);
    }
    if wanted("postgres-xmin") {
        out.extend(drain::pinned_xmin(quick).await);
    }
    if wanted("postgres-tenants") {
        out.extend(tenants::tenants(quick, &url).await);
    }
    out
}
