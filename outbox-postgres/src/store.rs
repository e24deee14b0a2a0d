//! [`PgStore`]: the relay's view of one outbox table in PostgreSQL, safe for
//! any number of relays in any processes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{
    Backlog, ClaimRequest, Clock, Error, FailOutcome, Failure, Message, MessageId, Release, Result,
    Stats, Store, Timestamp, WorkListener,
};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row, Transaction};

use crate::announce::{Announcer, Watcher, shared_wakeup};
use crate::error::{from_sqlx, storable};
use crate::floor::ClaimFloor;
use crate::listener::{PgWorkListener, WakeUp};
use crate::outbox::PgOutbox;
use crate::queue::StatementQueue;
use crate::row::decode;
use crate::schema::{Names, Sql};
use crate::shared_listener::PgSharedListener;

mod route;

/// An outbox table (and its inbox) in PostgreSQL: the relay's [`Store`] and
/// the operators' [`OperatorStore`](outbox_api::OperatorStore).
///
/// Any number of relays, in any processes, may share one table. Each claim,
/// completion or failure is one short transaction on a pooled connection;
/// nothing is held across a handler or a send. Claims of one table run side
/// by side, each leasing what it takes, so a message is never claimed
/// twice while its lease holds and a key's messages go out in commit order
/// (see the crate docs). Cloning shares
/// the pool. Applications enqueue through [`outbox`](PgStore::outbox).
#[derive(Clone)]
pub struct PgStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    display: String,
    pub(crate) pool: PgPool,
    pub(crate) sql: Arc<Sql>,
    claim: String,
    /// Whether the pool's connections have the claim's settings for their
    /// whole session (`claim_sql::claims_in_session`, as [`PgTenantPools`]'
    /// do): a claim is then one statement, its own transaction.
    ///
    /// [`PgTenantPools`]: crate::PgTenantPools
    claims_in_session: bool,
    outbox: PgOutbox,
    pub(crate) announcer: Announcer,
    wake_up: WakeUp,
    shared_listener: Option<PgSharedListener>,
    poll: Duration,
    floor: ClaimFloor,
    /// The pool of this store's large statements, if any
    /// ([`PgTenantPools::with_bulk_pool`](crate::PgTenantPools::with_bulk_pool)).
    bulk: Option<PgPool>,
    /// The queue that runs this store's claims and completions on its own
    /// pool (not those on the bulk pool) back to back with those of the
    /// other stores pinned to that pool (`PgTenantPools`; src/queue.rs).
    queue: Option<Arc<StatementQueue>>,
    /// Whether the last claim came back full (as many messages as it
    /// asked for, or [`BULK_ROWS`] or more): the store is draining a
    /// backlog, and its claims, completions and backlog counts run on the
    /// bulk pool.
    draining: AtomicBool,
}

/// A completion of this many messages or more is large, and a store whose
/// last claim returned that many (or as many as it asked for) is draining
/// a backlog: what runs on the bulk pool of
/// [`PgTenantPools::with_bulk_pool`](crate::PgTenantPools::with_bulk_pool).
pub const BULK_ROWS: usize = 64;

/// How a [`PgStore`] wakes relays and tends its claim floor (from its
/// builder).
pub(crate) struct Tuning {
    pub wake_up: WakeUp,
    /// The `LISTEN` connection shared with other stores, if any.
    pub shared_listener: Option<PgSharedListener>,
    /// How often a listener that cannot `LISTEN` reports a change.
    pub poll: Duration,
    /// The `NOTIFY` debounce when enqueues announce their commits, `None`
    /// when not.
    pub announce: Option<Duration>,
    /// The least time between two steps of the claim floor.
    pub floor_step: Duration,
    /// Whether the relay's bookkeeping commits wait for a WAL flush.
    pub durable_bookkeeping: bool,
    /// Whether a completion keeps the message as `processed` (else it
    /// deletes it).
    pub keep_processed: bool,
    /// The pool of the store's large statements, if any.
    pub bulk: Option<PgPool>,
    /// The queue of the claims and completions on `pool`, if any.
    pub queue: Option<Arc<StatementQueue>>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("database", &self.inner.display)
            .field("table", &self.inner.sql.names.outbox_display())
            .field("inbox_table", &self.inner.sql.names.inbox_display())
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// The store over `pool` (described as `display`, never with a
    /// password) for the tables `names`, tuned by `tuning`.
    pub(crate) fn assemble(
        pool: PgPool,
        display: String,
        names: Names,
        clock: Arc<dyn Clock>,
        tuning: Tuning,
    ) -> PgStore {
        let Tuning {
            wake_up,
            shared_listener,
            poll,
            announce,
            floor_step,
            durable_bookkeeping,
            keep_processed,
            bulk,
            queue,
        } = tuning;
        let options = pool.connect_options();
        let identity = format!(
            "{}:{}/{}/{}.{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(""),
            names.schema,
            names.outbox
        );
        let sql = Arc::new(Sql::new(
            names,
            durable_bookkeeping,
            keep_processed,
            announce.is_some(),
        ));
        // The stores that listen through one shared listener (a fleet's
        // tenants) also share its commit watcher.
        let watcher = match &shared_listener {
            Some(shared) => shared.watcher(),
            None => Watcher::new(pool.clone()),
        };
        let announcer = Announcer::new(
            watcher,
            sql.names.channel(),
            shared_wakeup(&identity),
            announce.unwrap_or_default(),
            announce.is_some(),
        );
        PgStore {
            inner: Arc::new(Inner {
                display,
                claim: sql.claim(),
                claims_in_session: crate::claim_sql::claims_in_session(&options),
                outbox: PgOutbox::new(Arc::clone(&sql), announcer.clone(), clock),
                sql,
                pool,
                announcer,
                wake_up,
                shared_listener,
                poll,
                floor: ClaimFloor::new(floor_step),
                bulk,
                queue,
                draining: AtomicBool::new(false),
            }),
        }
    }

    /// The handle applications enqueue with (in their own sqlx transaction)
    /// and record inbox entries with.
    pub fn outbox(&self) -> PgOutbox {
        self.inner.outbox.clone()
    }

    #[doc(hidden)]
    /// Whether this store's claims run as one statement, their own
    /// transaction: its pool's connections have the claim's settings for
    /// their whole session, as [`PgTenantPools`](crate::PgTenantPools)'
    /// do. Otherwise a claim is `BEGIN` with the settings, the claim and
    /// `COMMIT`.
    pub fn claims_in_one_statement(&self) -> bool {
        self.inner.claims_in_session
    }

    /// The store's connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The schema's name.
    pub fn schema(&self) -> &str {
        &self.inner.sql.names.schema
    }

    /// The outbox table's name.
    pub fn table(&self) -> &str {
        &self.inner.sql.names.outbox
    }

    /// The inbox table's name.
    pub fn inbox_table(&self) -> &str {
        &self.inner.sql.names.inbox
    }

    /// The channel relays `LISTEN` on and announcers `NOTIFY`.
    pub fn channel(&self) -> String {
        self.inner.sql.names.channel()
    }

    #[doc(hidden)]
    /// The exact claim statement this store runs (parameters: `$1` worker,
    /// `$2` locked_until, `$3` now, `$4` kind or NULL, `$5` limit, `$6` and
    /// `$7` the [`claim_floor`](Self::claim_floor)), for inspection
    /// (`EXPLAIN`) and same-SQL baselines. It runs in a transaction opened
    /// by [`begin_claim_statement`](Self::begin_claim_statement).
    pub fn claim_statement(&self) -> &str {
        &self.inner.claim
    }

    #[doc(hidden)]
    /// The statement that counts the messages in one state (`$1`:
    /// `pending`, `poisoned` or `processed`), for inspection (`EXPLAIN`).
    pub fn count_statement(&self) -> &str {
        &self.inner.sql.count_state
    }

    #[doc(hidden)]
    /// The claim's floor as the claim statement binds it now: the `seq`
    /// its walk of the pending index starts at, and the retry generation
    /// under which that holds (`(0, -1)` before the floor was first set).
    /// It rises as messages complete and the transactions that could still
    /// commit below it end; see the crate docs ("a long transaction").
    pub fn claim_floor(&self) -> (i64, i64) {
        let floor = self.inner.floor.current();
        (floor.seq, floor.generation)
    }

    /// The plan PostgreSQL chooses now for the claim statement (at most
    /// `limit` messages), run as the relay runs it — in a transaction
    /// with the same settings — and rolled back.
    /// Plain `EXPLAIN`: nothing is claimed. For an operator who wonders
    /// why claims are slow.
    pub async fn explain_claim(&self, limit: usize) -> Result<String> {
        let what = "explaining the claim";
        let mut tx = self.begin_claim(what).await?;
        let now = outbox_api::Timestamp::now();
        let floor = self.inner.floor.current();
        let result =
            sqlx::query_scalar::<_, String>(AssertSqlSafe(format!("EXPLAIN {}", self.inner.claim)))
                .bind("explain")
                .bind(now.as_millis())
                .bind(now.as_millis())
                .bind(None::<&str>)
                .bind(to_i64(limit))
                .bind(floor.seq)
                .bind(floor.generation)
                .fetch_all(&mut *tx)
                .await;
        if let Err(e) = tx.rollback().await {
            tracing::debug!(error = %e, "rollback after EXPLAIN failed");
        }
        result
            .map(|lines| lines.join("\n"))
            .map_err(|e| self.fail(e, what))
    }

    #[doc(hidden)]
    /// The exact completion statement this store runs (parameters: `$1`
    /// processed_at, `$2` the ids, `uuid[]`), for same-SQL baselines.
    pub fn complete_statement(&self) -> &str {
        &self.inner.sql.complete
    }

    #[doc(hidden)]
    /// The statement that opens every claim transaction: `BEGIN` and the
    /// claim's settings (timeouts, plan, no flush at commit), in one round
    /// trip.
    pub fn begin_claim_statement(&self) -> &str {
        &self.inner.sql.begin_claim
    }

    /// A transaction with the claim's settings (one round trip).
    async fn begin_claim(&self, what: &str) -> Result<Transaction<'static, Postgres>> {
        self.claim_pool()
            .begin_with(AssertSqlSafe(self.inner.sql.begin_claim.as_str()))
            .await
            .map_err(|e| self.fail(e, what))
    }

    /// Commits `tx` when `result` is Ok, rolls it back (explicitly, so that
    /// its locks are released now, not when the pool next tests the
    /// connection) when it is not.
    pub(crate) async fn finish<T>(
        &self,
        tx: Transaction<'static, Postgres>,
        result: std::result::Result<T, sqlx::Error>,
        what: &str,
    ) -> Result<T> {
        match result {
            Ok(value) => {
                tx.commit().await.map_err(|e| self.fail(e, what))?;
                Ok(value)
            }
            Err(e) => {
                if let Err(rollback) = tx.rollback().await {
                    tracing::debug!(error = %rollback, "rollback after an error failed");
                }
                Err(self.fail(e, what))
            }
        }
    }

    pub(crate) fn fail(&self, e: sqlx::Error, what: &str) -> Error {
        from_sqlx(e, what, &self.inner.sql.names.outbox_display())
    }

    /// The claim, inside a transaction of its own: one
    /// statement, then corrupt rows are poisoned and their keys' later
    /// messages given back.
    async fn claim_in(
        &self,
        conn: &mut PgConnection,
        r: &ClaimRequest,
    ) -> std::result::Result<Vec<Message>, sqlx::Error> {
        let sql = &self.inner.sql;
        let now = r.now.as_millis();
        let until = r.now.saturating_add(r.lease).as_millis();
        let kind = r.kind.map(|k| k.as_str());
        let floor = self.inner.floor.current();
        let rows = sqlx::query(AssertSqlSafe(self.inner.claim.as_str()))
            .bind(&r.worker)
            .bind(until)
            .bind(now)
            .bind(kind)
            .bind(to_i64(r.limit))
            .bind(floor.seq)
            .bind(floor.generation)
            .fetch_all(&mut *conn)
            .await?;
        let mut decoded = rows.iter().map(decode).collect::<Result<Vec<_>, _>>()?;
        decoded.sort_by_key(|d| d.seq);
        let mut out = Vec::with_capacity(decoded.len());
        // Keys whose earlier message turned out corrupt: their later messages wait.
        let mut parked: Vec<String> = Vec::new();
        for d in decoded {
            let key = d.message.key.clone();
            let key_parked = key.as_ref().is_some_and(|k| parked.contains(k));
            if !d.problems.is_empty() {
                let problem = format!("corrupt row: {}", d.problems.join("; "));
                tracing::error!(table = %sql.names.outbox_display(), seq = d.seq, %problem,
                    "poisoning an undecodable outbox row");
                sqlx::query(AssertSqlSafe(sql.rare().poison_seq.as_str()))
                    .bind(storable(&problem))
                    .bind(d.seq)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                parked.extend(key);
            } else if key_parked {
                sqlx::query(AssertSqlSafe(sql.rare().unlock_seq.as_str()))
                    .bind(d.seq)
                    .execute(&mut *conn)
                    .await?;
            } else {
                out.push(d.message);
            }
        }
        Ok(out)
    }

    pub(crate) async fn count_state(
        &self,
        conn: &mut PgConnection,
        state: &str,
    ) -> std::result::Result<u64, sqlx::Error> {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.inner.sql.count_state.as_str()))
            .bind(state)
            .fetch_one(conn)
            .await?;
        Ok(n.max(0) as u64)
    }

    /// Pending and poisoned counts (their partial indexes) and the oldest
    /// pending message: the first in `seq` order from the claim's floor.
    async fn backlog_in(
        &self,
        conn: &mut PgConnection,
    ) -> std::result::Result<Backlog, sqlx::Error> {
        let floor = self.inner.floor.current();
        let oldest: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(self.inner.sql.oldest_pending.as_str()))
                .bind(floor.seq)
                .bind(floor.generation)
                .fetch_optional(&mut *conn)
                .await?;
        Ok(Backlog::new(
            self.count_state(conn, "pending").await?,
            self.count_state(conn, "poisoned").await?,
            oldest.map(Timestamp::from_millis),
        ))
    }
}

impl PgStore {
    /// Moves the claim's floor one step when one is due (src/floor.rs),
    /// after a claim's transaction has ended — in a task of its own, so that
    /// the claim's messages never wait for the floor's two statements.
    fn tend_floor(&self) {
        if self.inner.floor.due() {
            let store = self.clone();
            tokio::spawn(async move {
                store
                    .inner
                    .floor
                    .tend(&store.inner.pool, &store.inner.sql)
                    .await;
            });
        }
    }
}

pub(crate) fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[async_trait]
impl Store for PgStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        if request.limit == 0 {
            return Ok(Vec::new());
        }
        let claimed = self.run_claim(request).await?;
        let full = claimed.len() >= request.limit.min(BULK_ROWS);
        self.inner.draining.store(full, Ordering::Relaxed);
        self.tend_floor();
        Ok(claimed)
    }

    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        self.run_complete(ids, now).await
    }

    // `complete_and_claim` is the trait's default: the completion on its
    // own (one statement), then the claim in a transaction of its own. Both
    // commit without waiting for a flush, and the round trips are those of
    // one transaction holding both (`BEGIN`, completion, claim, `COMMIT`).

    /// One statement: the message is leased by this worker, so no claim
    /// takes it meanwhile, and a claim beside it takes none of its key's
    /// later messages whichever version of it it sees (see `claim_sql`).
    async fn fail(&self, f: &Failure) -> Result<FailOutcome> {
        let what = "recording a failure";
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.fail.as_str()))
            .bind(storable(&f.error))
            .bind(i32::try_from(f.max_attempts).unwrap_or(i32::MAX))
            .bind(f.retry_at.as_millis())
            .bind(f.id.as_uuid())
            .bind(&f.worker)
            .bind(f.now.as_millis())
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, what))?;
        let Some(row) = row else {
            return Ok(FailOutcome::LeaseLost);
        };
        let attempts: i32 = row.try_get(0).map_err(|e| self.fail(e, what))?;
        let state: String = row.try_get(1).map_err(|e| self.fail(e, what))?;
        let attempts = u32::try_from(attempts).unwrap_or(0);
        Ok(if state == "poisoned" {
            FailOutcome::Poisoned { attempts }
        } else {
            FailOutcome::Retrying { attempts }
        })
    }

    /// One statement, like [`fail`](Store::fail).
    async fn release(&self, r: &Release) -> Result<()> {
        if r.ids.is_empty() {
            return Ok(());
        }
        let what = "releasing leases";
        let ids: Vec<uuid::Uuid> = r.ids.iter().map(MessageId::as_uuid).collect();
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.release.as_str()))
            .bind(r.available_at.as_millis())
            .bind(r.error.as_deref().map(storable))
            .bind(ids)
            .bind(&r.worker)
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, what))?;
        if done.rows_affected() > 0 {
            self.inner.announcer.committed();
        }
        Ok(())
    }

    /// One statement, like [`fail`](Store::fail).
    async fn release_worker(&self, worker: &str) -> Result<u64> {
        let what = "releasing a worker's leases";
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.release_worker.as_str()))
            .bind(worker)
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, what))?;
        if done.rows_affected() > 0 {
            self.inner.announcer.committed();
        }
        Ok(done.rows_affected())
    }

    async fn stats(&self) -> Result<Stats> {
        let what = "reading stats";
        let mut tx = self
            .scan_pool()
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .map_err(|e| self.fail(e, what))?;
        let result = match self.backlog_in(&mut tx).await {
            Ok(backlog) => self
                .count_state(&mut tx, "processed")
                .await
                .map(|processed| (backlog, processed)),
            Err(e) => Err(e),
        };
        let (backlog, processed) = self.finish(tx, result, what).await?;
        Ok(Stats::new(
            backlog.pending,
            backlog.poisoned,
            processed,
            backlog.oldest_pending_created_at,
        ))
    }

    async fn backlog(&self) -> Result<Backlog> {
        let what = "reading the backlog";
        let mut tx = self
            .claim_pool()
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .map_err(|e| self.fail(e, what))?;
        let result = self.backlog_in(&mut tx).await;
        self.finish(tx, result, what).await
    }

    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let what = "purging processed messages";
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.purge.as_str()))
            .bind(before.as_millis())
            .bind(to_i64(limit))
            .execute(self.scan_pool())
            .await
            .map_err(|e| self.fail(e, what))?;
        Ok(done.rows_affected())
    }

    fn listen(&self) -> Box<dyn WorkListener> {
        Box::new(PgWorkListener::new(
            self.inner.announcer.local(),
            self.inner.wake_up,
            &self.inner.pool.connect_options(),
            self.inner.shared_listener.as_ref(),
            &self.inner.sql.names.channel(),
            self.inner.announcer.token(),
            self.inner.poll,
        ))
    }
}
