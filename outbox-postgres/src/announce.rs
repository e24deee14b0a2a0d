//! Announcing commits that enqueued: to this process's relays at once, to
//! other processes with a debounced `NOTIFY` sent *after* the commit, never
//! inside the application's transaction.
//!
//! An enqueue cannot see its transaction commit. It returns the
//! transaction's id (`pg_current_xact_id()`), and a small task per store
//! watches those ids until each has committed (announce) or rolled back
//! (forget). Each enqueuing transaction holds an advisory lock on its own
//! id until it ends (`own_lock::OWN_LOCK`): the watcher waits for that lock,
//! oldest transaction first, and looks at every watched one the moment it
//! is granted. A transaction still open after [`WAIT_AT_MOST`] is asked
//! after with `pg_xact_status` instead, more slowly the longer it stays
//! open.

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

use crate::own_lock::{WAIT_LOOK, own_lock_key};
use crate::schema::Sql;

/// How long after an enqueue its transaction is first looked at. The
/// application commits right after its last statement (one round trip, a
/// fraction of a millisecond on a local server): a look at once would
/// find it still open and only cost a query.
const FIRST_LOOK: Duration = Duration::from_micros(200);
/// Least time between the starts of two looks. Enqueues arriving
/// meanwhile wait for the next look, which takes them all in one query: a
/// look per enqueue, back to back, cost the writers' throughput on a small
/// machine (the bench figure *enqueue throughput, PostgreSQL, 8 writers,
/// wake-up on*).
const LOOK_GAP: Duration = Duration::from_millis(1);
/// How long the watcher waits for one transaction to end before it asks
/// after it with looks instead. The wait holds one of the pool's
/// connections; a transaction that outlasts it leaves one "canceling
/// statement due to lock timeout" error in the server's log.
const WAIT_AT_MOST: &str = "100ms";
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
    /// This announcer's `NOTIFY` payload, unique to it (a random UUID): its
    /// store's own listener skips its notifications, since every one
    /// follows a wake-up of the same relays in this process.
    token: String,
    debounce: Duration,
    /// Whether enqueues are watched and announced at all.
    enabled: bool,
    state: Mutex<State>,
    kick: Arc<Notify>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// The multi-thread runtime the store was built on, where its pool's
    /// connections live: the watcher runs there rather than on the runtime
    /// of whichever enqueue came first. An application's writers may run on
    /// a runtime of their own that ends right after its last commit; a
    /// watcher on it would end too, mid-look, and that commit would wait
    /// for the relays' poll (and the look's connection be lost to the pool).
    home: Option<tokio::runtime::Handle>,
}

#[derive(Default)]
struct State {
    /// Open transactions that enqueued, and when each was first seen.
    watching: HashMap<u64, Watched>,
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
                token: outbox_api::MessageId::new().to_string(),
                debounce,
                enabled,
                state: Mutex::new(State::default()),
                kick: Arc::new(Notify::new()),
                task: Mutex::new(None),
                home: tokio::runtime::Handle::try_current()
                    .ok()
                    .filter(|rt| rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread),
            }),
        }
    }

    /// The in-process signal.
    pub(crate) fn local(&self) -> &Wakeup {
        &self.inner.local
    }

    /// The payload of this announcer's notifications: a listener of the
    /// same store skips them (their relays were woken in-process first).
    pub(crate) fn token(&self) -> &str {
        &self.inner.token
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
            .or_insert_with(|| Watched {
                seen: Instant::now(),
                looked: false,
                waited: false,
            });
        self.kick();
    }

    /// Something committed that relays may claim: wakes this process's
    /// relays now and other processes' within the debounce interval.
    pub(crate) fn committed(&self) {
        self.inner.local.notify();
        lock(&self.inner.state).notify_due = true;
        self.kick();
    }

    /// Something committed that announced itself to other processes (a
    /// `NOTIFY` in its own transaction): wakes this process's relays now.
    pub(crate) fn committed_and_notified(&self) {
        self.inner.local.notify();
    }

    fn kick(&self) {
        self.inner.kick.notify_one();
        let mut task = lock(&self.inner.task);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        // On the store's runtime while it runs, else on the caller's;
        // outside a tokio runtime nothing can be watched and relays poll.
        // A task spawned on a runtime that has shut down is finished at
        // once.
        let spawn = |rt: &tokio::runtime::Handle| {
            rt.spawn(run(
                Arc::downgrade(&self.inner),
                Arc::clone(&self.inner.kick),
            ))
        };
        *task = (self.inner.home.as_ref().map(spawn))
            .filter(|t| !t.is_finished())
            .or_else(|| {
                tokio::runtime::Handle::try_current()
                    .ok()
                    .map(|rt| spawn(&rt))
            });
    }
}

/// Locks `m`, taking the data of a poisoned lock as it is (its holders
/// leave it consistent at every step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A transaction that enqueued and has not been seen to end.
#[derive(Debug, Clone, Copy)]
struct Watched {
    /// When its first enqueue was reported.
    seen: Instant,
    /// Whether a look has found it still open.
    looked: bool,
    /// Whether the watcher has waited for it to end (whether or not it
    /// did, or could not spare a connection for it): it is waited for
    /// once, then looked at.
    waited: bool,
}

impl Watched {
    /// When this transaction is next worth a look, the last look having
    /// started at `last_look`: at once until it has been waited for, then
    /// [`FIRST_LOOK`] after its enqueue at first, then more slowly as it
    /// stays open (a quarter of its age, between [`LOOK_GAP`] and
    /// [`SLOWEST_LOOK`]).
    fn next_look(&self, last_look: Option<Instant>) -> Instant {
        if !self.waited {
            return self.seen;
        }
        match (self.looked, last_look) {
            (true, Some(last)) => last + ((last - self.seen) / 4).clamp(LOOK_GAP, SLOWEST_LOOK),
            _ => self.seen + FIRST_LOOK,
        }
    }
}

/// The watcher: looks at the watched transactions, announces commits (the
/// `NOTIFY` rides with the look that found them, when the debounce allows,
/// else it follows on its own); ends when its store is gone.
async fn run(weak: Weak<Inner>, kick: Arc<Notify>) {
    let mut last_notify: Option<Instant> = None;
    let mut last_look: Option<Instant> = None;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let now = Instant::now();
        let notify_allowed = |now: Instant| last_notify.map_or(now, |t| t + inner.debounce);
        // The soonest a look is due, never sooner than LOOK_GAP after the
        // last one.
        let look_at = {
            let state = lock(&inner.state);
            state
                .watching
                .values()
                .map(|w| w.next_look(last_look))
                .min()
                .map(|at| last_look.map_or(at, |last| at.max(last + LOOK_GAP)))
        };
        if look_at.is_some_and(|at| at <= now) {
            last_look = Some(now);
            let notify = notify_allowed(now) <= now;
            if look(&inner, notify, to_wait_for(&inner)).await {
                last_notify = Some(now);
            }
            continue;
        }
        let mut next = look_at;
        if lock(&inner.state).notify_due {
            let allowed = notify_allowed(now);
            if allowed <= now {
                lock(&inner.state).notify_due = false;
                last_notify = Some(now);
                send_notify(&inner).await;
                continue;
            }
            next = Some(next.map_or(allowed, |n| n.min(allowed)));
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

/// The oldest watched transaction not yet waited for, marked as waited for.
fn to_wait_for(inner: &Inner) -> Option<u64> {
    let mut state = lock(&inner.state);
    let (&xid, watched) = state
        .watching
        .iter_mut()
        .filter(|(_, w)| !w.waited)
        .min_by_key(|(_, w)| w.seen)?;
    watched.waited = true;
    Some(xid)
}

/// An idle connection of `pool` for a wait, if taking it leaves the pool
/// another one idle or room to open one.
fn spare_connection(pool: &PgPool) -> Option<sqlx::pool::PoolConnection<sqlx::Postgres>> {
    let conn = pool.try_acquire()?;
    let room = pool.size() < pool.options().get_max_connections();
    (pool.num_idle() > 0 || room).then_some(conn)
}

/// One look at every watched transaction's status, in one statement that
/// also sends the `NOTIFY` when `notify` and any has committed (the
/// notification goes out as the look's own transaction commits, right
/// after the look). A transaction counts as committed once a fresh
/// snapshot sees it (`pg_visible_in_snapshot`): the commit log says
/// "committed" a moment before the transaction leaves the list of running
/// ones, and a relay woken in that moment would claim without seeing its
/// messages. With `wait_for`, the statement first waits (at most
/// [`WAIT_AT_MOST`]) for that transaction to end. Returns whether the
/// `NOTIFY` was sent.
async fn look(inner: &Inner, notify: bool, wait_for: Option<u64>) -> bool {
    let watching: Vec<u64> = lock(&inner.state).watching.keys().copied().collect();
    if watching.is_empty() {
        return false;
    }
    let ids: Vec<String> = watching.iter().map(u64::to_string).collect();
    // The wait holds a connection until the transaction ends: never the
    // pool's last one (a pool of one connection, a fleet's pinned pool,
    // serves the relays' claims; it only looks).
    let waiting = wait_for.and_then(|xid| Some((xid, spare_connection(&inner.pool)?)));
    let statement = match waiting {
        Some(_) => WAIT_LOOK,
        None => inner.sql.look.as_str(),
    };
    let mut query = sqlx::query(AssertSqlSafe(statement))
        .bind(&ids)
        .bind(notify)
        .bind(&inner.channel)
        .bind(&inner.token);
    let result = match waiting {
        Some((xid, mut conn)) => {
            query = query
                .bind(own_lock_key(xid))
                .bind(WAIT_AT_MOST)
                .bind(xid.to_string());
            query.fetch_all(&mut *conn).await
        }
        None => query.fetch_all(&inner.pool).await,
    };
    let rows: Vec<PgRow> = match result {
        Ok(rows) => rows,
        // Still open after the wait: it is looked at from now on.
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03") => {
            return false;
        }
        Err(e) => {
            // Cannot tell: announce them as if committed (a wake-up too
            // many costs one empty claim) and stop watching them; a
            // commit that comes later is found by the relays' polling.
            tracing::debug!(error = %e, table = %inner.sql.names.outbox_display(),
                "could not look at enqueuing transactions; announcing them");
            {
                let mut state = lock(&inner.state);
                for xid in &watching {
                    state.watching.remove(xid);
                }
                state.notify_due = true;
            }
            inner.local.notify();
            return false;
        }
    };
    let mut any_committed = false;
    let mut notified = false;
    {
        let mut state = lock(&inner.state);
        for row in rows {
            let xid: String = row.try_get(0).unwrap_or_default();
            let status: Option<String> = row.try_get(1).unwrap_or(None);
            notified |= row.try_get::<bool, _>(2).unwrap_or(false);
            let Ok(xid) = xid.parse::<u64>() else {
                continue;
            };
            match status.as_deref() {
                Some("in progress") => {
                    if let Some(w) = state.watching.get_mut(&xid) {
                        w.looked = true;
                    }
                }
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
        if any_committed && !notified {
            state.notify_due = true;
        }
    }
    if any_committed {
        inner.local.notify();
    }
    forget_old(inner);
    notified
}

fn forget_old(inner: &Inner) {
    lock(&inner.state)
        .watching
        .retain(|_, w| w.seen.elapsed() < GIVE_UP_AFTER);
}

/// `pg_notify` on its own connection, in its own transaction (one
/// statement, one round trip): the database-wide lock NOTIFY takes at
/// commit is held for this tiny statement only, at most once per debounce
/// interval. (It writes no commit record that waits for a flush: 300 such
/// transactions did one WAL sync between them, `pg_stat_wal.wal_sync`.)
async fn send_notify(inner: &Inner) {
    if let Err(e) = sqlx::query(AssertSqlSafe(inner.sql.notify.as_str()))
        .bind(&inner.channel)
        .bind(&inner.token)
        .execute(&inner.pool)
        .await
    {
        tracing::debug!(error = %e, channel = %inner.channel,
            "could not notify other processes; their relays will poll");
    }
}
