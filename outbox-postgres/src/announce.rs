//! Announcing commits that enqueued: to this process's relays at once, to
//! other processes with a debounced `NOTIFY` sent *after* the commit, never
//! inside the application's transaction.
//!
//! An enqueue cannot see its transaction commit. It returns the
//! transaction's id (`pg_current_xact_id()`), and a small task per store
//! watches those ids with `pg_xact_status` — quickly at first, then more
//! slowly for long transactions — until each has committed (announce) or
//! rolled back (forget).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use outbox_api::backend::Wakeup;
use sqlx::PgPool;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::schema::Sql;

/// Least time between the starts of two looks. Enqueues arriving
/// meanwhile wait for the next look, which takes them all in one query: a
/// look per enqueue, back to back, cost the writers' throughput on a small
/// machine (the bench figure *enqueue throughput, PostgreSQL, 8 writers,
/// wake-up on*).
const LOOK_GAP: Duration = Duration::from_millis(1);
/// Most time between two looks at a transaction that is still open.
const SLOWEST_LOOK: Duration = Duration::from_millis(100);
/// A transaction still open after this long is no longer watched (a
/// prepared transaction, say); relays find its messages by polling.
const GIVE_UP_AFTER: Duration = Duration::from_secs(3600);
/// How often an idle watcher checks whether its store is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// The in-process signal of one outbox table, shared by every store and
/// outbox opened on it in this process (by server, database, schema, table).
pub(crate) fn shared_wakeup(identity: &str) -> Wakeup {
    static WAKEUPS: OnceLock<Mutex<HashMap<String, Wakeup>>> = OnceLock::new();
    let mut map = WAKEUPS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    map.entry(identity.to_owned()).or_default().clone()
}

/// Announces commits of one outbox table; cloning shares it.
#[derive(Clone)]
pub(crate) struct Announcer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Announcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcer")
            .field("channel", &self.inner.channel)
            .finish_non_exhaustive()
    }
}

struct Inner {
    pool: PgPool,
    sql: Arc<Sql>,
    channel: String,
    local: Wakeup,
    debounce: Duration,
    /// Whether enqueues are watched and announced at all.
    enabled: bool,
    state: Mutex<State>,
    kick: Arc<Notify>,
    task: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct State {
    /// Open transactions that enqueued, and when each was first seen.
    watching: HashMap<u64, Instant>,
    /// A commit was announced locally; other processes are still to hear.
    notify_due: bool,
}

impl Announcer {
    pub(crate) fn new(
        pool: PgPool,
        sql: Arc<Sql>,
        local: Wakeup,
        debounce: Duration,
        enabled: bool,
    ) -> Self {
        Announcer {
            inner: Arc::new(Inner {
                pool,
                channel: sql.names.channel(),
                sql,
                local,
                debounce,
                enabled,
                state: Mutex::new(State::default()),
                kick: Arc::new(Notify::new()),
                task: Mutex::new(None),
            }),
        }
    }

    /// The in-process signal.
    pub(crate) fn local(&self) -> &Wakeup {
        &self.inner.local
    }

    /// Watches transaction `xid` (as `pg_current_xact_id()` printed it)
    /// until it ends; announces it if it committed.
    pub(crate) fn watch(&self, xid: &str) {
        if !self.inner.enabled {
            return;
        }
        let Ok(xid) = xid.parse::<u64>() else {
            tracing::debug!(xid, "unexpected transaction id; announcing at once");
            return self.committed();
        };
        lock(&self.inner.state)
            .watching
            .entry(xid)
            .or_insert_with(Instant::now);
        self.kick();
    }

    /// Something committed that relays may claim: wakes this process's
    /// relays now and other processes' within the debounce interval.
    pub(crate) fn committed(&self) {
        self.inner.local.notify();
        lock(&self.inner.state).notify_due = true;
        self.kick();
    }

    fn kick(&self) {
        self.inner.kick.notify_one();
        let mut task = lock(&self.inner.task);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        // Outside a tokio runtime nothing can be watched; relays poll.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&self.inner);
            let kick = Arc::clone(&self.inner.kick);
            *task = Some(rt.spawn(run(weak, kick)));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The watcher: looks at the watched transactions, announces commits, sends
/// the debounced `NOTIFY`; ends when its store is gone.
async fn run(weak: Weak<Inner>, kick: Arc<Notify>) {
    let mut last_notify: Option<Instant> = None;
    let mut last_look: Option<Instant> = None;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let watching: Vec<(u64, Instant)> = lock(&inner.state)
            .watching
            .iter()
            .map(|(x, t)| (*x, *t))
            .collect();
        let look_at = last_look.map(|t| t + LOOK_GAP);
        let may_look = look_at.is_none_or(|at| at <= Instant::now());
        if !watching.is_empty() && may_look {
            last_look = Some(Instant::now());
            look(&inner, &watching).await;
        }
        let now = Instant::now();
        let (youngest, due) = {
            let state = lock(&inner.state);
            (state.watching.values().max().copied(), state.notify_due)
        };
        let mut next: Option<Instant> = youngest.map(|seen| {
            // Look again soon after a recent enqueue (its commit usually
            // follows at once), more slowly as the transaction stays open.
            let at = now + ((now - seen) / 4).clamp(Duration::from_millis(1), SLOWEST_LOOK);
            look_at.map_or(at, |gap| at.max(gap))
        });
        if due {
            let allowed = last_notify.map_or(now, |t| t + inner.debounce);
            if allowed <= now {
                lock(&inner.state).notify_due = false;
                last_notify = Some(now);
                send_notify(&inner).await;
            } else {
                next = Some(next.map_or(allowed, |n| n.min(allowed)));
            }
        }
        drop(inner);
        let sleep = match next {
            Some(at) => tokio::time::sleep_until(at),
            None => tokio::time::sleep(IDLE_CHECK),
        };
        tokio::select! {
            _ = kick.notified() => {}
            _ = sleep => {}
        }
    }
}

/// One look at the watched transactions' status.
async fn look(inner: &Inner, watching: &[(u64, Instant)]) {
    let ids: Vec<String> = watching.iter().map(|(x, _)| x.to_string()).collect();
    let rows: Vec<PgRow> =
        match sqlx::query("SELECT x, pg_xact_status(x::xid8) FROM unnest($1::text[]) AS x")
            .bind(&ids)
            .fetch_all(&inner.pool)
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                // Cannot tell: announce them as if committed (a wake-up too
                // many costs one empty claim) and stop watching them; a
                // commit that comes later is found by the relays' polling.
                tracing::debug!(error = %e, table = %inner.sql.names.outbox_display(),
                    "could not look at enqueuing transactions; announcing them");
                {
                    let mut state = lock(&inner.state);
                    for (xid, _) in watching {
                        state.watching.remove(xid);
                    }
                    state.notify_due = true;
                }
                inner.local.notify();
                return;
            }
        };
    let mut any_committed = false;
    {
        let mut state = lock(&inner.state);
        for row in rows {
            let xid: String = row.try_get(0).unwrap_or_default();
            let status: Option<String> = row.try_get(1).unwrap_or(None);
            let Ok(xid) = xid.parse::<u64>() else {
                continue;
            };
            match status.as_deref() {
                Some("in progress") => {}
                Some("committed") => {
                    any_committed = true;
                    state.watching.remove(&xid);
                }
                // Aborted, or too old for the commit log to tell.
                _ => {
                    state.watching.remove(&xid);
                }
            }
        }
        if any_committed {
            state.notify_due = true;
        }
    }
    if any_committed {
        inner.local.notify();
    }
    forget_old(inner);
}

fn forget_old(inner: &Inner) {
    lock(&inner.state)
        .watching
        .retain(|_, seen| seen.elapsed() < GIVE_UP_AFTER);
}

/// `pg_notify` on its own connection, in its own transaction (one
/// statement, one round trip): the database-wide lock NOTIFY takes at
/// commit is held for this tiny statement only, at most once per debounce
/// interval. (It writes no commit record that waits for a flush: 300 such
/// transactions did one WAL sync between them, `pg_stat_wal.wal_sync`.)
async fn send_notify(inner: &Inner) {
    if let Err(e) = sqlx::query(AssertSqlSafe(inner.sql.notify.as_str()))
        .bind(&inner.channel)
        .execute(&inner.pool)
        .await
    {
        tracing::debug!(error = %e, channel = %inner.channel,
            "could not notify other processes; their relays will poll");
    }
}
