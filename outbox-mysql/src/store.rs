//! [`MySqlStore`]: the relay's view of one outbox table in MySQL or
//! MariaDB, safe for any number of relays in any processes.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{
    Backlog, ClaimRequest, Clock, Error, FailOutcome, Failure, Message, MessageId, Release, Result,
    Stats, Store, Timestamp, WorkListener,
};
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool, Row};

use crate::builder::ServerVersion;
use crate::error::from_sqlx;
use crate::listener::{MySqlWorkListener, Signals};
use crate::outbox::MySqlOutbox;
use crate::schema::{Names, Sql, padded_len, placeholders};

/// An outbox table (and its inbox) in MySQL 8.0+ or MariaDB 10.6+: the
/// relay's [`Store`] and the operators'
/// [`OperatorStore`](outbox_api::OperatorStore).
///
/// Any number of relays, in any processes, may share one table. Each claim
/// is one short transaction at READ COMMITTED (`SELECT … FOR UPDATE SKIP
/// LOCKED`, then the lease `UPDATE`, then `COMMIT`); completions, failures
/// and releases are single statements. Nothing is held across a handler or
/// a send. A message is never claimed twice while its lease holds, and a
/// key's messages go out in commit order (see the crate docs). Cloning
/// shares the pool. Applications enqueue through
/// [`outbox`](MySqlStore::outbox).
#[derive(Clone)]
pub struct MySqlStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    display: String,
    pub(crate) pool: MySqlPool,
    pub(crate) sql: Arc<Sql>,
    outbox: MySqlOutbox,
    pub(crate) signals: Signals,
    server: ServerVersion,
    tuning: Tuning,
}

/// How a [`MySqlStore`]'s listeners poll (from its builder).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    pub poll_fast: Duration,
    pub poll_idle: Duration,
}

impl std::fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStore")
            .field("database", &self.inner.display)
            .field("table", &self.inner.sql.names.outbox)
            .field("inbox_table", &self.inner.sql.names.inbox)
            .field("server", &self.inner.server.text)
            .finish_non_exhaustive()
    }
}

impl MySqlStore {
    pub(crate) fn assemble(
        pool: MySqlPool,
        display: String,
        names: Names,
        clock: Arc<dyn Clock>,
        server: ServerVersion,
        tuning: Tuning,
    ) -> MySqlStore {
        let sql = Arc::new(Sql::new(names));
        let signals = Signals::new(pool.clone(), Arc::clone(&sql));
        MySqlStore {
            inner: Arc::new(Inner {
                display,
                outbox: MySqlOutbox::new(Arc::clone(&sql), signals.clone(), clock),
                sql,
                pool,
                signals,
                server,
                tuning,
            }),
        }
    }

    /// The handle applications enqueue with (in their own sqlx transaction)
    /// and record inbox entries with.
    pub fn outbox(&self) -> MySqlOutbox {
        self.inner.outbox.clone()
    }

    /// The store's connection pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The outbox table's name.
    pub fn table(&self) -> &str {
        &self.inner.sql.names.outbox
    }

    /// The inbox table's name.
    pub fn inbox_table(&self) -> &str {
        &self.inner.sql.names.inbox
    }

    /// The server the store is connected to, as checked at
    /// [`connect`](crate::MySqlStoreBuilder::connect).
    pub fn server(&self) -> &ServerVersion {
        &self.inner.server
    }

    pub(crate) fn fail(&self, e: sqlx::Error, what: &str) -> Error {
        from_sqlx(e, what, &self.inner.sql.names.outbox)
    }

    /// Counts the messages in `state` (through the `(state, seq)` index).
    pub(crate) async fn count_state(
        &self,
        conn: &mut MySqlConnection,
        state: &str,
    ) -> std::result::Result<u64, sqlx::Error> {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.inner.sql.count_state.as_str()))
            .bind(state)
            .fetch_one(conn)
            .await?;
        Ok(n.max(0) as u64)
    }

    async fn backlog_in(
        &self,
        conn: &mut MySqlConnection,
    ) -> std::result::Result<Backlog, sqlx::Error> {
        let oldest: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(self.inner.sql.oldest_pending.as_str()))
                .fetch_optional(&mut *conn)
                .await?;
        Ok(Backlog::new(
            self.count_state(conn, "pending").await?,
            self.count_state(conn, "poisoned").await?,
            oldest.map(Timestamp::from_millis),
        ))
    }

    /// Runs `head` + `(?, …)` over `ids` in lists padded to a power of two
    /// (at most 512 ids a statement), binding `before` first; returns the
    /// rows changed.
    pub(crate) async fn by_ids(
        &self,
        head: &str,
        ids: &[MessageId],
        before: impl Fn(
            sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
        ) -> sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
        what: &str,
    ) -> Result<u64> {
        let mut changed = 0;
        for chunk in ids.chunks(512) {
            let n = padded_len(chunk.len());
            let text = format!("{head}{}", placeholders(n));
            let mut q = before(sqlx::query(AssertSqlSafe(text)));
            for i in 0..n {
                q = q.bind(chunk[i.min(chunk.len() - 1)].as_uuid());
            }
            let done = q
                .execute(&self.inner.pool)
                .await
                .map_err(|e| self.fail(e, what))?;
            changed += done.rows_affected();
        }
        Ok(changed)
    }

    /// A connection of the pool, for `what`.
    pub(crate) async fn conn(&self, what: &str) -> Result<sqlx::pool::PoolConnection<sqlx::MySql>> {
        self.inner
            .pool
            .acquire()
            .await
            .map_err(|e| self.fail(e, what))
    }
}

pub(crate) fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[async_trait]
impl Store for MySqlStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        if request.limit == 0 {
            return Ok(Vec::new());
        }
        self.run_claim(request).await
    }

    /// One statement per 512 ids (`UPDATE … WHERE state = 'pending' AND id
    /// IN (…)`): idempotent, and it applies whoever holds the lease.
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let head = self.inner.sql.complete_head.clone();
        self.by_ids(
            &head,
            ids,
            |q| q.bind(now.as_millis()),
            "completing messages",
        )
        .await?;
        Ok(())
    }

    /// One short transaction: the counted update (only while `worker`
    /// holds the lease), then the new attempt count and state read back
    /// under the row's lock (MySQL has no `UPDATE … RETURNING`).
    async fn fail(&self, f: &Failure) -> Result<FailOutcome> {
        let what = "recording a failure";
        let sql = &self.inner.sql;
        let max = i64::from(f.max_attempts);
        let mut tx = self
            .inner
            .pool
            .begin()
            .await
            .map_err(|e| self.fail(e, what))?;
        let done = sqlx::query(AssertSqlSafe(sql.fail.as_str()))
            .bind(max)
            .bind(max)
            .bind(f.retry_at.as_millis())
            .bind(&f.error)
            .bind(f.now.as_millis())
            .bind(f.id.as_uuid())
            .bind(&f.worker)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.fail(e, what))?;
        if done.rows_affected() == 0 {
            let _ = tx.rollback().await;
            return Ok(FailOutcome::LeaseLost);
        }
        let row = sqlx::query(AssertSqlSafe(sql.fail_read.as_str()))
            .bind(f.id.as_uuid())
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| self.fail(e, what))?;
        let attempts: i32 = row.try_get(0).map_err(|e| self.fail(e, what))?;
        let state: String = row.try_get(1).map_err(|e| self.fail(e, what))?;
        tx.commit().await.map_err(|e| self.fail(e, what))?;
        let attempts = u32::try_from(attempts).unwrap_or(0);
        Ok(if state == "poisoned" {
            FailOutcome::Poisoned { attempts }
        } else {
            FailOutcome::Retrying { attempts }
        })
    }

    async fn release(&self, r: &Release) -> Result<()> {
        if r.ids.is_empty() {
            return Ok(());
        }
        let head = self.inner.sql.release_head.clone();
        let changed = self
            .by_ids(
                &head,
                &r.ids,
                |q| {
                    q.bind(r.available_at.as_millis())
                        .bind(r.error.clone())
                        .bind(r.worker.clone())
                },
                "releasing leases",
            )
            .await?;
        if changed > 0 {
            self.inner.signals.wakeup.notify();
        }
        Ok(())
    }

    async fn release_worker(&self, worker: &str) -> Result<u64> {
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.release_worker.as_str()))
            .bind(worker)
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, "releasing a worker's leases"))?;
        if done.rows_affected() > 0 {
            self.inner.signals.wakeup.notify();
        }
        Ok(done.rows_affected())
    }

    async fn stats(&self) -> Result<Stats> {
        let what = "reading stats";
        let mut tx = self.begin_snapshot(what).await?;
        let backlog = self
            .backlog_in(&mut tx)
            .await
            .map_err(|e| self.fail(e, what))?;
        let processed = self
            .count_state(&mut tx, "processed")
            .await
            .map_err(|e| self.fail(e, what))?;
        tx.commit().await.map_err(|e| self.fail(e, what))?;
        Ok(Stats::new(
            backlog.pending,
            backlog.poisoned,
            processed,
            backlog.oldest_pending_created_at,
        ))
    }

    async fn backlog(&self) -> Result<Backlog> {
        let what = "reading the backlog";
        let mut tx = self.begin_snapshot(what).await?;
        let backlog = self
            .backlog_in(&mut tx)
            .await
            .map_err(|e| self.fail(e, what))?;
        tx.commit().await.map_err(|e| self.fail(e, what))?;
        Ok(backlog)
    }

    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.purge.as_str()))
            .bind(before.as_millis())
            .bind(to_i64(limit))
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, "purging processed messages"))?;
        Ok(done.rows_affected())
    }

    fn listen(&self) -> Box<dyn WorkListener> {
        Box::new(MySqlWorkListener::new(
            &self.inner.signals,
            self.inner.tuning.poll_fast,
            self.inner.tuning.poll_idle,
        ))
    }
}

impl MySqlStore {
    /// A read-only transaction whose reads share one snapshot (REPEATABLE
    /// READ with a consistent snapshot: plain reads take no locks).
    pub(crate) async fn begin_snapshot(
        &self,
        what: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::MySql>> {
        self.inner
            .pool
            .begin_with(
                "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; \
                 START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY",
            )
            .await
            .map_err(|e| self.fail(e, what))
    }
}
