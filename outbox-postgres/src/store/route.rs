//! Where and how a store's claims and completions run: on its own pool,
//! through that pool's queue when it has one (`PgTenantPools`;
//! src/queue.rs), or on the bulk pool while it drains a backlog.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use outbox_api::{ClaimRequest, Message, MessageId, Result, Timestamp};
use sqlx::{AssertSqlSafe, PgPool};

use super::{BULK_ROWS, PgStore};
use crate::queue::{OnConnection, StatementQueue};

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

    /// Runs `f` on a connection for a statement over `rows` messages:
    /// through the pool's queue when it has one, else on a connection of
    /// [`pool_for`](Self::pool_for).
    async fn on_connection<T: Send + 'static>(
        &self,
        rows: usize,
        f: impl OnConnection<T>,
    ) -> std::result::Result<T, sqlx::Error> {
        match self.queue_for(rows) {
            Some(queue) => queue.run(f).await,
            None => f(&mut *self.pool_for(rows).acquire().await?).await,
        }
    }

    /// The claim of `request` (`request.limit` > 0), where it runs.
    pub(super) async fn run_claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        let what = "claiming messages";
        if !self.inner.claims_in_session {
            let mut tx = self.begin_claim(what).await?;
            let result = self.claim_in(&mut tx, request).await;
            return self.finish(tx, result, what).await;
        }
        // One round trip: the connections have the claim's settings. A
        // corrupt row's poisoning, if any, follows as statements of their
        // own: the row stays leased meanwhile.
        let (store, request) = (self.clone(), request.clone());
        self.on_connection(0, move |conn| {
            Box::pin(async move { store.claim_in(conn, &request).await })
        })
        .await
        .map_err(|e| self.fail(e, what))
    }

    /// The completion of `ids` (not empty) at `now` (one statement), where
    /// it runs.
    pub(super) async fn run_complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        let rows = ids.len();
        let ids: Vec<uuid::Uuid> = ids.iter().map(MessageId::as_uuid).collect();
        let sql = Arc::clone(&self.inner.sql);
        self.on_connection(rows, move |conn| {
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(sql.complete.as_str()))
                    .bind(now.as_millis())
                    .bind(ids)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .await
        .map_err(|e| self.fail(e, "completing messages"))
    }
}
