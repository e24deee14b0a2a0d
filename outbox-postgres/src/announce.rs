//! Announcing commits that enqueued: to this process's relays at once, to
//! other processes with a debounced `NOTIFY` sent *after* the commit, never
//! inside the application's transaction.
//!
//! An enqueue cannot see its transaction commit. It returns the
//! transaction's id (`pg_current_xact_id()`), and a small task, the commit
//! watcher, watches those ids until each has committed (announce) or
//! rolled back (forget). A store has a watcher of its own, on its pool;
//! the stores that listen through one [`PgSharedListener`] (a fleet's
//! tenants) share one, on a connection of its own, which looks at all
//! their transactions in one statement.
//!
//! Each enqueuing transaction holds an advisory lock on its own id until
//! it ends (`own_lock::OWN_LOCK`): the watcher waits for that lock, oldest
//! transaction first, and looks at every watched one the moment it is
//! granted. A transaction still open after [`WAIT_AT_MOST`] is asked after
//! with `pg_xact_status` instead, more slowly the longer it stays open.
//!
//! [`PgSharedListener`]: crate::PgSharedListener

use std::collections::{HashMap, HashSet};
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
/// How often an idle watcher checks whether its stores are gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// The end of [`LOOK`] and of [`WAIT_LOOK`], after their statuses `s`
/// (`x`, `ch`, `tok`, `status`): each committed table's channel notified
/// once, and the rows.
macro_rules! notify_committed {
    () => {
        "
     n AS MATERIALIZED (
       SELECT pg_notify(ch, tok) FROM (
         SELECT DISTINCT ch, tok FROM s WHERE ch <> '' AND status = 'committed') AS d)
     SELECT x, status, (SELECT count(*) FROM n) FROM s"
    };
}
pub(crate) use notify_committed;

/// The watcher's look at every watched transaction: `$1` their ids
/// (text), `$2` and `$3` for each the channel to `NOTIFY` and the payload
/// (the announcer's token) if it has committed, the channel empty when
/// its outbox's debounce holds the notification back. A transaction
/// counts as committed once a fresh snapshot sees it
/// (`pg_visible_in_snapshot`): the commit log says "committed" a moment
/// before the transaction leaves the list of running ones, and a relay
/// woken in that moment would claim without seeing its messages. Rows:
/// id, status, how many notifications were sent (the same in every row).
/// The notifications go out as the look's own transaction commits, right
/// after it; one channel and payload is notified once however many of its
/// transactions committed.
pub(crate) const LOOK: &str = concat!(
    "WITH s AS MATERIALIZED (
       SELECT x, ch, tok, CASE
         WHEN st = 'committed'
          AND NOT pg_visible_in_snapshot(x::xid8, pg_current_snapshot())
         THEN 'in progress' ELSE st END AS status
       FROM unnest($1::text[], $2::text[], $3::text[]) AS u(x, ch, tok),
            LATERAL pg_xact_status(x::xid8) AS st),",
    notify_committed!()
);

/// `pg_notify` for each channel `$1` with its payload `$2`, in one
/// statement, its own transaction.
const NOTIFY: &str =
    "SELECT count(pg_notify(ch, tok)) FROM unnest($1::text[], $2::text[]) AS u(ch, tok)";

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

/// Announces commits of one outbox table through a [`Watcher`]; cloning
/// shares it.
#[derive(Clone)]
pub(crate) struct Announcer {
    target: Arc<Target>,
    watcher: Arc<Watcher>,
    /// Whether enqueues are watched and announced at all.
    enabled: bool,
}

impl std::fmt::Debug for Announcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcer")
            .field("channel", &self.target.channel)
            .finish_non_exhaustive()
    }
}

/// Where one outbox table's commits are announced.
struct Target {
    /// Its relays in this process.
    local: Wakeup,
    /// Its channel, for other processes' relays.
    channel: String,
    /// This announcer's `NOTIFY` payload, unique to it (a random UUID): its
    /// store's own listener skips its notifications, since every one
    /// follows a wake-up of the same relays in this process.
    token: String,
    /// The least time between two of its notifications.
    debounce: Duration,
    notify: Mutex<Debounce>,
}

#[derive(Default)]
struct Debounce {
    /// When its last notification was sent.
    last: Option<Instant>,
    /// A commit was announced locally; other processes are still to hear
    /// (it is then in the watcher's `due`).
    due: bool,
}

impl Debounce {
    /// When its table's next notification may go out, `now` at the
    /// earliest.
    fn allowed(&self, debounce: Duration, now: Instant) -> Instant {
        self.last.map_or(now, |t| (t + debounce).max(now))
    }
}

impl Target {
    /// Whether its debounce lets a notification go out at `now`.
    fn may_notify(&self, now: Instant) -> bool {
        lock(&self.notify).allowed(self.debounce, now) <= now
    }
}

/// Watches enqueuing transactions of one database for the announcers of
/// one or many outbox tables.
pub(crate) struct Watcher {
    pool: PgPool,
    state: Mutex<State>,
    kick: Arc<Notify>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// The multi-thread runtime the watcher was made on, where its pool's
    /// connections live: it runs there rather than on the runtime of
    /// whichever enqueue came first. An application's writers may run on
    /// a runtime of their own that ends right after its last commit; a
    /// watcher on it would end too, mid-look, and that commit would wait
    /// for the relays' poll (and the look's connection be lost to the pool).
    home: Option<tokio::runtime::Handle>,
}

#[derive(Default)]
struct State {
    /// Open transactions that enqueued, and when each was first seen.
    watching: HashMap<u64, Watched>,
    /// Targets owed a notification.
    due: Vec<Arc<Target>>,
}

impl Watcher {
    /// A watcher that looks through `pool` (waiting for a transaction only
    /// on a connection that leaves the pool another).
    pub(crate) fn new(pool: PgPool) -> Arc<Watcher> {
        Arc::new(Watcher {
            pool,
            state: Mutex::new(State::default()),
            kick: Arc::new(Notify::new()),
            task: Mutex::new(None),
            home: tokio::runtime::Handle::try_current()
                .ok()
                .filter(|rt| rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread),
        })
    }

    fn kick(self: &Arc<Self>) {
        self.kick.notify_one();
        let mut task = lock(&self.task);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        // On the watcher's runtime while it runs, else on the caller's;
        // outside a tokio runtime nothing can be watched and relays poll.
        // A task spawned on a runtime that has shut down is finished at
        // once.
        let spawn = |rt: &tokio::runtime::Handle| {
            rt.spawn(run(Arc::downgrade(self), Arc::clone(&self.kick)))
        };
        *task = (self.home.as_ref().map(spawn))
            .filter(|t| !t.is_finished())
            .or_else(|| {
                tokio::runtime::Handle::try_current()
                    .ok()
                    .map(|rt| spawn(&rt))
            });
    }

    /// `target` is owed a notification.
    fn owe(&self, state: &mut State, target: &Arc<Target>) {
        let mut debounce = lock(&target.notify);
        if !debounce.due {
            debounce.due = true;
            state.due.push(Arc::clone(target));
        }
    }
}

impl Announcer {
    /// The announcer of the table whose relays `local` wakes and whose
    /// channel is `channel`, watching through `watcher`; `enabled` false
    /// announces nothing.
    pub(crate) fn new(
        watcher: Arc<Watcher>,
        channel: String,
        local: Wakeup,
        debounce: Duration,
        enabled: bool,
    ) -> Self {
        Announcer {
            target: Arc::new(Target {
                local,
                channel,
                token: outbox_api::MessageId::new().to_string(),
                debounce,
                notify: Mutex::default(),
            }),
            watcher,
            enabled,
        }
    }

    /// The in-process signal.
    pub(crate) fn local(&self) -> &Wakeup {
        &self.target.local
    }

    /// The payload of this announcer's notifications: a listener of the
    /// same store skips them (their relays were woken in-process first).
    pub(crate) fn token(&self) -> &str {
        &self.target.token
    }

    /// Watches transaction `xid` (as `pg_current_xact_id()` printed it)
    /// until it ends; announces it if it committed.
    pub(crate) fn watch(&self, xid: &str) {
        if !self.enabled {
            return;
        }
        let Ok(xid) = xid.parse::<u64>() else {
            tracing::debug!(xid, "unexpected transaction id; announcing at once");
            return self.committed();
        };
        {
            let mut state = lock(&self.watcher.state);
            let watched = state.watching.entry(xid).or_insert_with(|| Watched {
                seen: Instant::now(),
                looked: false,
                waited: false,
                targets: Vec::with_capacity(1),
            });
            // One transaction may enqueue into several tables.
            if !watched.targets.iter().any(|t| Arc::ptr_eq(t, &self.target)) {
                watched.targets.push(Arc::clone(&self.target));
            }
        }
        self.watcher.kick();
    }

    /// Something committed that relays may claim: wakes this process's
    /// relays now and other processes' within the debounce interval.
    pub(crate) fn committed(&self) {
        self.target.local.notify();
        self.watcher
            .owe(&mut lock(&self.watcher.state), &self.target);
        self.watcher.kick();
    }

    /// Something committed that announced itself to other processes (a
    /// `NOTIFY` in its own transaction): wakes this process's relays now.
    pub(crate) fn committed_and_notified(&self) {
        self.target.local.notify();
    }
}

/// Locks `m`, taking the data of a poisoned lock as it is (its holders
/// leave it consistent at every step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A transaction that enqueued and has not been seen to end.
struct Watched {
    /// When its first enqueue was reported.
    seen: Instant,
    /// Whether a look has found it still open.
    looked: bool,
    /// Whether the watcher has waited for it to end (whether or not it
    /// did, or could not spare a connection for it): it is waited for
    /// once, then looked at.
    waited: bool,
    /// The tables it enqueued into.
    targets: Vec<Arc<Target>>,
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

/// The watcher's task: looks at the watched transactions, announces
/// commits (the `NOTIFY` rides with the look that found them, where the
/// debounce allows, else it follows on its own); ends when every
/// announcer of the watcher is gone.
async fn run(weak: Weak<Watcher>, kick: Arc<Notify>) {
    let mut last_look: Option<Instant> = None;
    loop {
        let Some(watcher) = weak.upgrade() else {
            return;
        };
        let now = Instant::now();
        // The soonest a look is due, never sooner than LOOK_GAP after the
        // last one.
        let look_at = {
            let state = lock(&watcher.state);
            state
                .watching
                .values()
                .map(|w| w.next_look(last_look))
                .min()
                .map(|at| last_look.map_or(at, |last| at.max(last + LOOK_GAP)))
        };
        if look_at.is_some_and(|at| at <= now) {
            last_look = Some(now);
            let wait_for = to_wait_for(&watcher);
            look(&watcher, now, wait_for).await;
            continue;
        }
        let (send, later) = due_notifications(&watcher, now);
        if !send.is_empty() {
            send_notify(&watcher, &send).await;
            continue;
        }
        let next = match (look_at, later) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        drop(watcher);
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

/// The targets owed a notification whose debounce allows it `now` (taken
/// off the list, their notification counted as sent now), and the soonest
/// another's allows it.
fn due_notifications(watcher: &Watcher, now: Instant) -> (Vec<Arc<Target>>, Option<Instant>) {
    let mut state = lock(&watcher.state);
    let mut send = Vec::new();
    let mut later: Option<Instant> = None;
    state.due.retain(|target| {
        let mut debounce = lock(&target.notify);
        let allowed = debounce.allowed(target.debounce, now);
        if allowed <= now {
            debounce.due = false;
            debounce.last = Some(now);
            send.push(Arc::clone(target));
            false
        } else {
            later = Some(later.map_or(allowed, |l| l.min(allowed)));
            true
        }
    });
    (send, later)
}

/// The oldest watched transaction not yet waited for, marked as waited for.
fn to_wait_for(watcher: &Watcher) -> Option<u64> {
    let mut state = lock(&watcher.state);
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

/// One look ([`LOOK`]) at every watched transaction's status, started at
/// `now`, notifying the channels of those that committed where their
/// debounce allows. With `wait_for`, the statement first waits (at most
/// [`WAIT_AT_MOST`]) for that transaction to end ([`WAIT_LOOK`]).
async fn look(watcher: &Watcher, now: Instant, wait_for: Option<u64>) {
    // One row per transaction and table; the channel empty where the
    // table's notification must wait.
    let (mut xids, mut ids, mut channels, mut tokens) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The tables whose channel the look notifies if they committed.
    let mut offered: HashSet<usize> = HashSet::new();
    {
        let state = lock(&watcher.state);
        for (&xid, watched) in &state.watching {
            xids.push(xid);
            for target in &watched.targets {
                ids.push(xid.to_string());
                let allowed = target.may_notify(now);
                channels.push(if allowed {
                    target.channel.clone()
                } else {
                    String::new()
                });
                tokens.push(target.token.clone());
                if allowed {
                    offered.insert(key(target));
                }
            }
        }
    }
    if ids.is_empty() {
        return;
    }
    // The wait holds a connection until the transaction ends: never the
    // pool's last one (a pool of one connection, a fleet's pinned pool,
    // serves the relays' claims; it only looks).
    let waiting = wait_for.and_then(|xid| Some((xid, spare_connection(&watcher.pool)?)));
    let statement = match waiting {
        Some(_) => WAIT_LOOK,
        None => LOOK,
    };
    let mut query = sqlx::query(AssertSqlSafe(statement))
        .bind(&ids)
        .bind(&channels)
        .bind(&tokens);
    let result = match waiting {
        Some((xid, mut conn)) => {
            query = query
                .bind(own_lock_key(xid))
                .bind(WAIT_AT_MOST)
                .bind(xid.to_string());
            query.fetch_all(&mut *conn).await
        }
        None => query.fetch_all(&watcher.pool).await,
    };
    let rows: Vec<PgRow> = match result {
        Ok(rows) => rows,
        // Still open after the wait: it is looked at from now on.
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03") => {
            return;
        }
        Err(e) => {
            // Cannot tell: announce them as if committed (a wake-up too
            // many costs one empty claim) and stop watching them; a
            // commit that comes later is found by the relays' polling.
            tracing::debug!(error = %e, transactions = xids.len(),
                "could not look at enqueuing transactions; announcing them");
            let mut state = lock(&watcher.state);
            for xid in xids {
                let Some(w) = state.watching.remove(&xid) else {
                    continue;
                };
                for target in &w.targets {
                    target.local.notify();
                    watcher.owe(&mut state, target);
                }
            }
            return;
        }
    };
    let mut state = lock(&watcher.state);
    let mut committed: HashMap<usize, Arc<Target>> = HashMap::new();
    let mut sent = false;
    for row in rows {
        let xid: String = row.try_get(0).unwrap_or_default();
        let status: Option<String> = row.try_get(1).unwrap_or(None);
        sent |= row.try_get::<i64, _>(2).unwrap_or(0) > 0;
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
                if let Some(w) = state.watching.remove(&xid) {
                    for target in w.targets {
                        committed.insert(key(&target), target);
                    }
                }
            }
            // Aborted, or too old for the commit log to tell.
            _ => {
                state.watching.remove(&xid);
            }
        }
    }
    for target in committed.values() {
        target.local.notify();
        let notified = sent && offered.contains(&key(target));
        if notified {
            lock(&target.notify).last = Some(now);
        } else {
            watcher.owe(&mut state, target);
        }
    }
    state
        .watching
        .retain(|_, w| w.seen.elapsed() < GIVE_UP_AFTER);
}

/// A target's identity while it lives (its address).
fn key(target: &Arc<Target>) -> usize {
    Arc::as_ptr(target) as usize
}

/// `pg_notify` for each of `targets` on the watcher's pool, in one
/// statement, its own transaction: the database-wide lock NOTIFY takes at
/// commit is held for this tiny statement only, at most once per debounce
/// interval for each table. (It writes no commit record that waits for a
/// flush: 300 such transactions did one WAL sync between them,
/// `pg_stat_wal.wal_sync`.)
async fn send_notify(watcher: &Watcher, targets: &[Arc<Target>]) {
    let channels: Vec<&str> = targets.iter().map(|t| t.channel.as_str()).collect();
    let tokens: Vec<&str> = targets.iter().map(|t| t.token.as_str()).collect();
    if let Err(e) = sqlx::query(AssertSqlSafe(NOTIFY))
        .bind(&channels)
        .bind(&tokens)
        .execute(&watcher.pool)
        .await
    {
        tracing::debug!(error = %e, channels = ?channels,
            "could not notify other processes; their relays will poll");
    }
}
