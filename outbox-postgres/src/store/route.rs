//! Where and how a store's claims and completions run: on its own pool,
//! through that pool's queue when it has one (`PgTenantPools`;
//! src/queue.rs), or on the bulk pool while it drains a backlog.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use outbox_api::{ClaimRequest, Message, MessageId, Result, Timestamp};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use super::{BULK_ROWS, PgStore};
use crate::queue::StatementQueue;
use crate::schema::Sql;

impl PgStore {
    /// The pool of a claim or completion over `rows` messages: the bulk
    /// pool, when there is one, while this store drains a backlog (its
    /// last claim came back full, so the next is likely as large) or when
    /// they are [`BULK_ROWS`] or more; else the store's.
    fn pool_for(&self, rows: usize) -> &PgPool {
        match &self.inner.bulk {
            Some(bulk) if self.is_bulk(rows) => bulk,
            _ => &self.inner.pool,
        }
    }

    /// Whether a claim or completion over `rows` messages is large (see
    /// [`pool_for`](Self::pool_for)).
    fn is_bulk(&self, rows: usize) -> bool {
        rows >= BULK_ROWS || self.inner.draining.load(Ordering::Relaxed)
    }

    /// The queue of a claim or completion over `rows` messages, when it
    /// runs on this store's own pool and that pool has one.
    fn queue_for(&self, rows: usize) -> Option<&Arc<StatementQueue>> {
        let on_bulk = self.inner.bulk.is_some() && self.is_bulk(rows);
        self.inner.queue.as_ref().filter(|_| !on_bulk)
    }

    /// The pool of the next claim, and of the backlog's counts (a
    /// draining store's pending messages are many).
    pub(super) fn claim_pool(&self) -> &PgPool {
        self.pool_for(0)
    }

    /// The pool of statements whose cost grows with the completed
    /// messages kept (the stats' count of them, the purge): the bulk pool
    /// when there is one, so that they hold up none of the stores pinned
    /// with this one.
    pub(super) fn scan_pool(&self) -> &PgPool {
        self.inner.bulk.as_ref().unwrap_or(&self.inner.pool)
    }

    /// The claim of `request` (`request.limit` > 0), where it runs.
    pub(super) async fn run_claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        let what = "claiming messages";
        // One round trip when the connections have the claim's settings
        // (and then queued with the claims of the stores pinned to the same
        // pool, if it has a queue). A corrupt row's poisoning, if any,
        // follows as statements of their own: the row stays leased
        // meanwhile.
        let claimed = match (self.queue_for(0), self.inner.claims_in_session) {
            (Some(queue), true) => {
                let (store, request) = (self.clone(), request.clone());
                queue
                    .run(move |conn| Box::pin(async move { store.claim_in(conn, &request).await }))
                    .await
                    .map_err(|e| self.fail(e, what))?
            }
            (None, true) => {
                let mut conn = self
                    .claim_pool()
                    .acquire()
                    .await
                    .map_err(|e| self.fail(e, what))?;
                self.claim_in(&mut conn, request)
                    .await
                    .map_err(|e| self.fail(e, what))?
            }
            (_, false) => {
                let mut tx = self.begin_claim(what).await?;
                let result = self.claim_in(&mut tx, request).await;
                self.finish(tx, result, what).await?
            }
        };
        Ok(claimed)
    }

    /// The completion of `ids` (not empty) at `now`, where it runs.
    pub(super) async fn run_complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        let what = "completing messages";
        let rows = ids.len();
        let ids: Vec<uuid::Uuid> = ids.iter().map(MessageId::as_uuid).collect();
        let sql = Arc::clone(&self.inner.sql);
        match self.queue_for(rows) {
            Some(queue) => {
                queue
                    .run(move |conn| {
                        Box::pin(async move { complete_in(conn, &sql, now, ids).await })
                    })
                    .await
            }
            None => {
                let mut conn = self
                    .pool_for(rows)
                    .acquire()
                    .await
                    .map_err(|e| self.fail(e, what))?;
                complete_in(&mut conn, &sql, now, ids).await
            }
        }
        .map_err(|e| self.fail(e, what))?;
        Ok(())
    }
}

/// The completion of `ids` at `now` (one statement) on `conn`.
async fn complete_in(
    conn: &mut PgConnection,
    sql: &Sql,
    now: Timestamp,
    ids: Vec<uuid::Uuid>,
) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(sql.complete.as_str()))
        .bind(now.as_millis())
        .bind(ids)
        .execute(conn)
        .await
        .map(|_| ())
}
