//! [`SqliteStore`]: the relay's view of one outbox table, on rusqlite.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{
    Backlog, ClaimRequest, Error, FailOutcome, Failure, Message, MessageId, Release, Result, Stats,
    Store, Timestamp, WorkListener,
};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::builder::store_connection;
use crate::checkpoint::Checkpointer;
use crate::error::from_rusqlite;
use crate::files::{Cell, SqliteFiles};
use crate::listener::{Signals, SqliteListener};
use crate::lock_wait;
use crate::outbox::SqliteOutbox;
use crate::row::{Decoded, decode};
#[cfg(test)]
use crate::schema::claim_sql;
use crate::schema::{self, Sql, TableKind};

/// An outbox table (and its inbox) in a SQLite database file: the relay's
/// [`Store`] and the operators' [`OperatorStore`](outbox_api::OperatorStore).
///
/// The relay's calls (claim, complete, fail, release) run on a dedicated
/// rusqlite connection inside `spawn_blocking`, one blocking hop per call
/// rather than one per statement. Cloning shares the connection.
/// Applications enqueue through [`outbox`](SqliteStore::outbox).
#[derive(Clone)]
pub struct SqliteStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) path: PathBuf,
    /// The store's connection: always open, or (with
    /// [`SqliteFiles`](crate::SqliteFiles)) opened when a call needs it.
    pub(crate) conn: Arc<Cell>,
    pub(crate) files: Option<SqliteFiles>,
    /// Checkpoints the WAL off the store's commit path, unless turned off.
    pub(crate) checkpointer: Option<Checkpointer>,
    pub(crate) sql: Arc<Sql>,
    pub(crate) outbox: SqliteOutbox,
    pub(crate) signals: Signals,
    pub(crate) busy_timeout: Duration,
    pub(crate) change_poll: Duration,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("table", &self.inner.sql.outbox)
            .field("inbox_table", &self.inner.sql.inbox)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Creates or upgrades the outbox and inbox tables. Versioned (in the
    /// table `outbox_schema_versions`) and idempotent: safe to call at every
    /// start, from several processes at once.
    pub async fn migrate(&self) -> Result<()> {
        self.run("migrating", |conn, sql| {
            let now = Timestamp::now().as_millis();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let a = schema::migrate_table(&tx, TableKind::Outbox, &sql.outbox, now)?;
            let b = schema::migrate_table(&tx, TableKind::Inbox, &sql.inbox, now)?;
            tx.commit()?;
            if a + b > 0 {
                tracing::info!(outbox = %sql.outbox, inbox = %sql.inbox, applied = a + b, "outbox schema migrated");
            }
            Ok(())
        })
        .await
    }

    /// The handle applications enqueue with (in their own sqlx or rusqlite
    /// transaction) and record inbox entries with.
    pub fn outbox(&self) -> SqliteOutbox {
        self.inner.outbox.clone()
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Wakes this process's listeners: something changed that may be
    /// claimable now (an operator's retry or discard).
    pub(crate) fn announce_change(&self) {
        self.inner.signals.definite.notify();
    }

    /// The outbox table's name.
    pub fn table(&self) -> &str {
        &self.inner.sql.outbox
    }

    /// The inbox table's name.
    pub fn inbox_table(&self) -> &str {
        &self.inner.sql.inbox
    }

    #[doc(hidden)]
    /// The exact claim statement this store runs for batches of `limit`
    /// (parameters: `?1` worker, `?2` locked_until, `?3` now, `?4` kind or
    /// NULL), for inspection (`EXPLAIN QUERY PLAN`) and same-SQL baselines.
    pub fn claim_statement(&self, limit: usize) -> String {
        self.inner.sql.claim(limit)
    }

    #[doc(hidden)]
    /// The exact statement that marks one message processed (`?1`
    /// processed_at, `?2` id), run once per id inside one transaction.
    pub fn complete_statement(&self) -> &str {
        &self.inner.sql.complete
    }

    /// Runs `f` on the store's connection on the blocking pool, then starts
    /// a background checkpoint if its commits grew the WAL enough.
    pub(crate) async fn run<T, F>(&self, what: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, &Sql) -> rusqlite::Result<T> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            let mut slot = inner.conn.lock();
            if slot.conn.is_none()
                && let Some(files) = &inner.files
            {
                files.admit(&inner.conn, &mut slot, || {
                    store_connection(&inner.path, inner.busy_timeout)
                })?;
            }
            let Some(conn) = slot.conn.as_mut() else {
                return Err(Error::backend(format!(
                    "{what}: the store's connection is closed"
                )));
            };
            let out = lock_wait::with_timeout(inner.busy_timeout, || f(conn, &inner.sql))
                .map_err(|e| from_rusqlite(e, what, &inner.sql.outbox));
            if let Some(files) = &inner.files {
                files.used(&mut slot);
            }
            drop(slot);
            if let Some(checkpointer) = &inner.checkpointer {
                checkpointer.after_call();
            }
            out
        })
        .await
        .map_err(|e| Error::backend(format!("{what}: the blocking task failed: {e}")))?
    }
}

pub(crate) fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Rows in `state`, counted over that state's partial index.
pub(crate) fn count_state(conn: &Connection, t: &str, state: &str) -> rusqlite::Result<u64> {
    let n: i64 = conn
        .prepare_cached(&format!("SELECT COUNT(*) FROM {t} WHERE state = '{state}'"))?
        .query_row([], |r| r.get(0))?;
    Ok(n as u64)
}

/// Pending and poisoned counts (their partial indexes) and the oldest
/// pending message: the first in commit (`seq`) order, one index step —
/// not a scan of every pending row's `created_at`.
fn backlog_of(conn: &Connection, t: &str) -> rusqlite::Result<Backlog> {
    let oldest: Option<i64> = conn
        .prepare_cached(&format!(
            "SELECT created_at FROM {t} WHERE state = 'pending' ORDER BY seq LIMIT 1"
        ))?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(Backlog::new(
        count_state(conn, t, "pending")?,
        count_state(conn, t, "poisoned")?,
        oldest.map(Timestamp::from_millis),
    ))
}

fn claim_blocking(
    conn: &mut Connection,
    sql: &Sql,
    r: &ClaimRequest,
) -> rusqlite::Result<Vec<Message>> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let out = claim_in(&tx, sql, r)?;
    tx.commit()?;
    Ok(out)
}

/// Marks `ids` processed (inside `tx`).
fn complete_in(tx: &Connection, sql: &Sql, ids: &[String], now: Timestamp) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(&sql.complete)?;
    for id in ids {
        stmt.execute(params![now.as_millis(), id])?;
    }
    Ok(())
}

/// The claim (inside `tx`): one statement, then corrupt rows are poisoned
/// and their keys' later messages given back.
fn claim_in(tx: &Connection, sql: &Sql, r: &ClaimRequest) -> rusqlite::Result<Vec<Message>> {
    let t = &sql.outbox;
    let now = r.now.as_millis();
    let until = r.now.saturating_add(r.lease).as_millis();
    let kind = r.kind.map(|k| k.as_str());
    let mut rows: Vec<Decoded> = {
        let mut stmt = tx.prepare_cached(&sql.claim(r.limit))?;
        let mapped = stmt.query_map(params![r.worker, until, now, kind], decode)?;
        mapped.collect::<rusqlite::Result<_>>()?
    };
    rows.sort_by_key(|d| d.seq);
    let mut out = Vec::with_capacity(rows.len());
    // Keys whose earlier message turned out corrupt: their later messages wait.
    let mut parked: Vec<rusqlite::types::Value> = Vec::new();
    for d in rows {
        let key_parked = d.raw_key != rusqlite::types::Value::Null && parked.contains(&d.raw_key);
        if !d.problems.is_empty() {
            let problem = format!("corrupt row: {}", d.problems.join("; "));
            tracing::error!(table = %t, seq = d.seq, %problem, "poisoning an undecodable outbox row");
            tx.prepare_cached(&sql.poison_seq)?
                .execute(params![problem, d.seq, now])?;
            if d.raw_key != rusqlite::types::Value::Null {
                parked.push(d.raw_key);
            }
        } else if key_parked {
            tx.prepare_cached(&sql.unlock_seq)?.execute([d.seq])?;
        } else {
            out.push(d.message);
        }
    }
    Ok(out)
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        if request.limit == 0 {
            return Ok(Vec::new());
        }
        let r = request.clone();
        self.run("claiming messages", move |conn, sql| {
            claim_blocking(conn, sql, &r)
        })
        .await
    }

    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
        self.run("completing messages", move |conn, sql| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            complete_in(&tx, sql, &ids, now)?;
            tx.commit()
        })
        .await
    }

    /// One blocking call and one transaction for both: between batches of
    /// quick deliveries the hop to the blocking pool and the commit are a
    /// large part of the relay's cost per batch (bench figure "drain N to an
    /// in-process handler, SQLite, batch 20";
    /// `docs/decisions.md#complete_and_claim`).
    async fn complete_and_claim(
        &self,
        done: &[MessageId],
        now: Timestamp,
        next: &ClaimRequest,
    ) -> Result<Vec<Message>> {
        if next.limit == 0 {
            self.complete(done, now).await?;
            return Ok(Vec::new());
        }
        let ids: Vec<String> = done.iter().map(|id| id.to_string()).collect();
        let r = next.clone();
        self.run("completing messages and claiming", move |conn, sql| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            complete_in(&tx, sql, &ids, now)?;
            let out = claim_in(&tx, sql, &r)?;
            tx.commit()?;
            Ok(out)
        })
        .await
    }

    async fn fail(&self, f: &Failure) -> Result<FailOutcome> {
        let f = f.clone();
        self.run("recording a failure", move |conn, sql| {
            let mut stmt = conn.prepare_cached(&sql.fail)?;
            let mut rows = stmt.query(params![
                f.error,
                i64::from(f.max_attempts),
                f.retry_at.as_millis(),
                f.id.to_string(),
                f.worker,
                f.now.as_millis()
            ])?;
            let Some(row) = rows.next()? else {
                return Ok(FailOutcome::LeaseLost);
            };
            let attempts: i64 = row.get(0)?;
            let state: String = row.get(1)?;
            let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
            Ok(if state == "poisoned" {
                FailOutcome::Poisoned { attempts }
            } else {
                FailOutcome::Retrying { attempts }
            })
        })
        .await
    }

    async fn release(&self, r: &Release) -> Result<()> {
        if r.ids.is_empty() {
            return Ok(());
        }
        let r = r.clone();
        self.run("releasing leases", move |conn, sql| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            {
                let mut stmt = tx.prepare_cached(&sql.release)?;
                for id in &r.ids {
                    stmt.execute(params![
                        r.available_at.as_millis(),
                        r.error,
                        id.to_string(),
                        r.worker
                    ])?;
                }
            }
            tx.commit()
        })
        .await
    }

    async fn release_worker(&self, worker: &str) -> Result<u64> {
        let worker = worker.to_owned();
        self.run("releasing a worker's leases", move |conn, sql| {
            let n = conn.execute(&sql.release_worker, params![worker])?;
            Ok(n as u64)
        })
        .await
    }

    async fn stats(&self) -> Result<Stats> {
        self.run("reading stats", |conn, sql| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let backlog = backlog_of(&tx, &sql.outbox)?;
            let processed = count_state(&tx, &sql.outbox, "processed")?;
            tx.commit()?;
            Ok(Stats::new(
                backlog.pending,
                backlog.poisoned,
                processed,
                backlog.oldest_pending_created_at,
            ))
        })
        .await
    }

    async fn backlog(&self) -> Result<Backlog> {
        self.run("reading the backlog", |conn, sql| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let backlog = backlog_of(&tx, &sql.outbox)?;
            tx.commit()?;
            Ok(backlog)
        })
        .await
    }

    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let limit = to_i64(limit);
        self.run("purging processed messages", move |conn, sql| {
            let t = &sql.outbox;
            let n = conn
                .prepare_cached(&format!(
                    "DELETE FROM {t} WHERE seq IN (
                       SELECT seq FROM {t} WHERE state = 'processed' AND processed_at < ?1
                       ORDER BY processed_at LIMIT ?2)"
                ))?
                .execute(params![before.as_millis(), limit])?;
            Ok(n as u64)
        })
        .await
    }

    fn listen(&self) -> Box<dyn WorkListener> {
        if self.inner.files.is_some() {
            // No connection held to watch the file with (`SqliteFiles`).
            return Box::new(SqliteListener::signals_only(&self.inner.signals));
        }
        Box::new(SqliteListener::new(
            &self.inner.path,
            &self.inner.sql.outbox,
            self.inner.busy_timeout,
            self.inner.change_poll,
            &self.inner.signals,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite keeps the compiled claim between calls: a bound LIMIT in the
    /// `IN (SELECT …)` made it re-prepare on every execution.
    #[test]
    fn claim_statement_is_not_reprepared_per_call() {
        let mut conn = Connection::open_in_memory().unwrap();
        let tx = conn.transaction().unwrap();
        schema::migrate_table(&tx, TableKind::Outbox, "ob", 0).unwrap();
        tx.commit().unwrap();
        let mut stmt = conn.prepare(&claim_sql("ob", 20)).unwrap();
        for now in 0..5i64 {
            let n = stmt
                .query_map(
                    params!["w", now + 60_000, now, Option::<&str>::None],
                    |_| Ok(()),
                )
                .unwrap()
                .count();
            assert_eq!(n, 0);
        }
        assert_eq!(
            stmt.get_status(rusqlite::StatementStatus::RePrepare),
            0,
            "the claim statement was compiled again on a call"
        );
    }

    /// The claim walks the pending index in seq order and checks a key's
    /// earlier messages through the key index: work proportional to the batch.
    #[test]
    fn claim_plan_uses_the_partial_indexes() {
        let mut conn = Connection::open_in_memory().unwrap();
        let tx = conn.transaction().unwrap();
        schema::migrate_table(&tx, TableKind::Outbox, "ob", 0).unwrap();
        tx.commit().unwrap();
        let mut stmt = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {}", claim_sql("ob", 10)))
            .unwrap();
        let plan: Vec<String> = stmt
            .query_map(params!["w", 1, 1, Option::<&str>::None], |r| r.get(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("ob_pending_idx"), "{plan}");
        assert!(plan.contains("ob_key_idx"), "{plan}");
        assert!(
            !plan.contains("SCAN ob\n") && !plan.ends_with("SCAN ob"),
            "{plan}"
        );
        let purge = "EXPLAIN QUERY PLAN DELETE FROM ob WHERE seq IN (SELECT seq FROM ob \
            WHERE state = 'processed' AND processed_at < 1 ORDER BY processed_at LIMIT 5)";
        let plan: Vec<String> = conn
            .prepare(purge)
            .unwrap()
            .query_map([], |r| r.get(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert!(plan.join("\n").contains("ob_processed_idx"), "{plan:?}");
    }
}
