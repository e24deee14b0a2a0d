//! The claim's floor: a `seq` below which no message is pending or ever
//! will be, so that a claim starts its walk of the pending index there.
//!
//! Why: a completed message leaves the pending index only when vacuum
//! removes its old row version, and vacuum may not while any transaction
//! older than it is open (a pinned xmin: a report, a `pg_dump`, a session
//! idle in transaction). Until then every claim that walks the index from
//! its first entry steps over every message completed since — 40k buffers
//! a claim after 25k messages. With the floor a claim steps over only those
//! completed since the floor last rose.
//!
//! How it stays safe (docs/decisions.md, "the claim's floor"): a message's
//! `seq` is drawn before its transaction commits, so a transaction still
//! open may yet commit a `seq` lower than messages already completed. The
//! floor therefore rises in two steps:
//!
//! 1. **Candidate.** One statement reads the retry generation `g` (the
//!    table's `_retries` sequence), the last `seq` drawn `S`, and only then
//!    takes a fresh transaction id `xb`. Every enqueue takes its transaction
//!    id before it draws a `seq` (the insert statements call
//!    `pg_current_xact_id()` first), so every transaction that drew a
//!    `seq` ≤ `S` has an id below `xb`.
//! 2. **Check.** A later statement whose snapshot's xmin is past `xb` —
//!    every such transaction has ended, committed or not — sets the floor
//!    to the lowest pending `seq` it sees (at most `S + 1`). Messages
//!    enqueued later draw higher `seq`s.
//!
//! The one other way a message becomes pending is an operator's retry of a
//! poisoned one; the retry statement advances the `_retries` sequence
//! (non-transactionally, after it has its transaction id). A claim uses the
//! floor only while that generation still reads `g` — the comparison is in
//! the claim statement itself — and otherwise walks from the start, until a
//! new floor is set under the new generation. A read-only transaction has
//! no id and never holds the floor back; a long transaction that writes
//! does (the floor waits for it, as it must: it may be enqueueing).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, PgPool, Row};

use crate::schema::Sql;

/// Default least time between two steps of the claim's floor
/// ([`PgStoreBuilder::claim_floor_step`](crate::PgStoreBuilder::claim_floor_step)).
/// Each candidate takes one transaction id, so this also bounds the ids a
/// store consumes for it: at most 40 a second.
pub const DEFAULT_FLOOR_STEP: Duration = Duration::from_millis(25);

/// The floor of one store, shared by the relays that claim through it.
#[derive(Debug, Default)]
pub(crate) struct ClaimFloor {
    step: Duration,
    state: Mutex<State>,
    /// One relay tends the floor at a time; the others go on claiming.
    tending: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct State {
    /// The floor and the retry generation it holds under.
    set: Option<Floor>,
    /// A candidate waiting for the transactions before it to end.
    candidate: Option<Candidate>,
    next_step: Option<Instant>,
    /// The `seq` sequence caches values per session (its `CACHE` is not 1),
    /// so `seq`s are not drawn in order across sessions: no floor is safe.
    disabled: bool,
}

impl State {
    fn step_due(&self, now: Instant) -> bool {
        !self.disabled && self.next_step.is_none_or(|at| now >= at)
    }
}

/// A floor and the retry generation under which it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Floor {
    /// Claims start their walk at this `seq`.
    pub seq: i64,
    /// The `_retries` generation the floor was set under.
    pub generation: i64,
}

#[derive(Debug, Clone)]
struct Candidate {
    generation: i64,
    last_seq: i64,
    xid: String,
}

impl ClaimFloor {
    /// A floor not yet set, stepping at most every `step`.
    pub(crate) fn new(step: Duration) -> ClaimFloor {
        ClaimFloor {
            step,
            ..ClaimFloor::default()
        }
    }

    /// The floor claims bind now: `seq` 0 (walk from the start) until one
    /// is set.
    pub(crate) fn current(&self) -> Floor {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.set.unwrap_or(Floor {
            seq: 0,
            generation: -1,
        })
    }

    /// Whether a step is due now (and none is being taken): a cheap test,
    /// so that a claim spawns a step only when there is one to take.
    pub(crate) fn due(&self) -> bool {
        if self.tending.try_lock().is_err() {
            return false;
        }
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.step_due(Instant::now())
    }

    /// One step, if one is due and no other relay is taking it: checks the
    /// waiting candidate (and raises the floor when its transactions have
    /// ended), then takes the next candidate. A failed step changes
    /// nothing: the floor only ever moves to a value a check proved.
    pub(crate) async fn tend(&self, pool: &PgPool, sql: &Sql) {
        let Ok(_turn) = self.tending.try_lock() else {
            return;
        };
        let (candidate, lower) = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            if !state.step_due(now) {
                return;
            }
            state.next_step = Some(now + self.step);
            let lower = match (&state.candidate, state.set) {
                (Some(c), Some(f)) if f.generation == c.generation => f.seq,
                _ => 0,
            };
            (state.candidate.clone(), lower)
        };
        if let Err(e) = self.step(pool, sql, candidate, lower).await {
            tracing::debug!(error = %e, table = %sql.names.outbox_display(),
                "the claim floor did not move this time");
        }
    }

    async fn step(
        &self,
        pool: &PgPool,
        sql: &Sql,
        candidate: Option<Candidate>,
        lower: i64,
    ) -> Result<(), sqlx::Error> {
        // Only an idle connection: a floor step never waits for the pool
        // (the claims and handlers it serves come first). Without one it
        // is the next claim's turn.
        let Some(mut conn) = pool.try_acquire() else {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.next_step = None;
            return Ok(());
        };
        if let Some(c) = candidate {
            let row = sqlx::query(AssertSqlSafe(sql.floor_check.as_str()))
                .bind(&c.xid)
                .bind(lower)
                .fetch_one(&mut *conn)
                .await?;
            let ready: bool = row.try_get(0)?;
            if ready {
                let lowest: Option<i64> = row.try_get(1)?;
                let seq = lowest.map_or(c.last_seq + 1, |s| s.min(c.last_seq + 1));
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                state.set = Some(Floor {
                    seq,
                    generation: c.generation,
                });
                state.candidate = None;
            } else {
                // A transaction older than the candidate is still open:
                // keep waiting for it.
                return Ok(());
            }
        }
        let row = sqlx::query(AssertSqlSafe(sql.floor_candidate.as_str()))
            .fetch_one(&mut *conn)
            .await?;
        let cache: i64 = row.try_get(3)?;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if cache != 1 {
            tracing::warn!(table = %sql.names.outbox_display(), cache,
                "the outbox's seq sequence caches values per session, so seqs are not drawn in \
                 order; claims walk the pending index from its start (set its CACHE back to 1)");
            state.disabled = true;
            state.set = None;
            return Ok(());
        }
        state.candidate = Some(Candidate {
            generation: row.try_get(0)?,
            last_seq: row.try_get(1)?,
            xid: row.try_get(2)?,
        });
        Ok(())
    }
}
