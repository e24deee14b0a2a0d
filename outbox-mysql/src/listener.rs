//! Waking relays: in-process after an enqueuing transaction commits (the
//! commit watcher), and across processes by an adaptive poll
//! ([`MySqlWorkListener`]). MySQL has no `LISTEN`/`NOTIFY`.
//!
//! * **Commit watcher.** An enqueue through [`MySqlOutbox`](crate::MySqlOutbox)
//!   cannot see the application's `COMMIT`, so it hands the id of the first
//!   message it wrote to the store's watcher. The watcher asks, on a
//!   connection of its own, which watched ids are visible (committed: a
//!   plain read at READ COMMITTED never sees another transaction's
//!   uncommitted rows) — back to back during the first 2 ms after a hint,
//!   every millisecond up to 50 ms, then less and less often — and wakes
//!   this process's relays as soon as one is. A hint that never becomes
//!   visible (rolled back) is dropped after [`HINT_WINDOW`].
//! * **Poll.** Commits of other processes show as a higher `MAX(seq)`,
//!   read with one index lookup: every `fast` interval after a change,
//!   doubling with each quiet read up to `idle`.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::backend::{Wakeup, WakeupListener};
use outbox_api::{MessageId, WorkListener};
use sqlx::{AssertSqlSafe, MySqlPool};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::schema::{Sql, placeholders};

/// How long a watched enqueue may stay invisible (its transaction open)
/// before the watcher stops looking; the relays' poll finds it after that.
pub const HINT_WINDOW: Duration = Duration::from_secs(60);

/// The in-process signals of one store (shared with its outbox handle).
#[derive(Debug, Clone)]
pub(crate) struct Signals {
    /// Something committed that may be claimable now: wake at once.
    pub wakeup: Wakeup,
    watcher: Arc<WatchState>,
    pool: MySqlPool,
    sql: Arc<Sql>,
}

#[derive(Debug, Default)]
struct WatchState {
    /// Watched ids and when they were handed over.
    hints: Mutex<Vec<(MessageId, Instant)>>,
    /// A new hint arrived.
    arrived: Notify,
    /// Whether the watcher task runs.
    running: Mutex<bool>,
}

impl Signals {
    pub(crate) fn new(pool: MySqlPool, sql: Arc<Sql>) -> Self {
        Signals {
            wakeup: Wakeup::new(),
            watcher: Arc::new(WatchState::default()),
            pool,
            sql,
        }
    }

    /// An enqueue wrote `id` in a transaction not yet committed: wake this
    /// process's relays once it is.
    pub(crate) fn watch(&self, id: MessageId) {
        self.watcher
            .hints
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((id, Instant::now()));
        self.watcher.arrived.notify_one();
        let mut running = self
            .watcher
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !*running {
            *running = true;
            let state = Arc::downgrade(&self.watcher);
            tokio::spawn(watch_commits(
                state,
                self.pool.clone(),
                Arc::clone(&self.sql),
                self.wakeup.clone(),
            ));
        }
    }
}

/// The watcher task: runs while its store (the state's owner) lives.
async fn watch_commits(state: Weak<WatchState>, pool: MySqlPool, sql: Arc<Sql>, wakeup: Wakeup) {
    let mut conn = None;
    loop {
        let Some(s) = state.upgrade() else { return };
        let (ids, youngest) = {
            let mut hints = s.hints.lock().unwrap_or_else(|p| p.into_inner());
            hints.retain(|(_, at)| at.elapsed() < HINT_WINDOW);
            let youngest = hints.iter().map(|(_, at)| *at).max();
            (
                hints.iter().take(64).map(|(id, _)| *id).collect::<Vec<_>>(),
                youngest,
            )
        };
        let Some(youngest) = youngest else {
            // Nothing to watch: give the connection back and wait.
            conn = None;
            let _ = tokio::time::timeout(Duration::from_secs(1), s.arrived.notified()).await;
            continue;
        };
        if conn.is_none() {
            conn = pool.acquire().await.ok();
        }
        let visible = match conn.as_mut() {
            Some(c) => {
                let text = format!("{}{}", sql.visible_head, placeholders(ids.len()));
                let mut q = sqlx::query_scalar::<_, uuid::Uuid>(AssertSqlSafe(text));
                for id in &ids {
                    q = q.bind(id.as_uuid());
                }
                match q.fetch_all(&mut **c).await {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::debug!(error = %e, "the commit watcher's read failed");
                        conn = None;
                        Vec::new()
                    }
                }
            }
            None => Vec::new(),
        };
        if !visible.is_empty() {
            s.hints
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|(id, _)| !visible.contains(&id.as_uuid()));
            wakeup.notify();
        }
        drop(s);
        let age = youngest.elapsed();
        if age < Duration::from_millis(2) {
            tokio::task::yield_now().await;
        } else if age < Duration::from_millis(50) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        } else {
            tokio::time::sleep((age / 20).min(Duration::from_millis(100))).await;
        }
    }
}

/// A [`WorkListener`] for a MySQL outbox, returned by
/// [`MySqlStore::listen`](outbox_api::Store::listen): wakes at once on an
/// in-process commit (see the module docs) and polls `MAX(seq)` for other
/// processes' commits, every `fast` interval while they come, backing off
/// to `idle` while nothing does.
///
/// A message committed with a lower `seq` than one already seen (two
/// transactions committing out of `AUTO_INCREMENT` order in another
/// process) does not move `MAX(seq)`: the relay's own `poll_interval`
/// finds it.
pub struct MySqlWorkListener {
    local: WakeupListener,
    pool: MySqlPool,
    sql: Arc<Sql>,
    fast: Duration,
    idle: Duration,
    interval: Duration,
    last_seen: Option<i64>,
    next_poll: Instant,
}

impl std::fmt::Debug for MySqlWorkListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlWorkListener")
            .field("table", &self.sql.names.outbox)
            .field("fast", &self.fast)
            .field("idle", &self.idle)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl MySqlWorkListener {
    pub(crate) fn new(signals: &Signals, fast: Duration, idle: Duration) -> Self {
        MySqlWorkListener {
            local: signals.wakeup.listener(),
            pool: signals.pool.clone(),
            sql: Arc::clone(&signals.sql),
            fast,
            idle,
            interval: fast,
            last_seen: None,
            next_poll: Instant::now(),
        }
    }

    /// The poll's interval now (between `fast` and `idle`).
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// One read of `MAX(seq)`: whether it moved since the last read (the
    /// first read counts as a change). A failed read is no change.
    async fn poll(&mut self) -> bool {
        let read = sqlx::query_scalar::<_, i64>(AssertSqlSafe(self.sql.max_seq.as_str()))
            .fetch_one(&self.pool)
            .await;
        let changed = match read {
            Ok(seq) => {
                let changed = self.last_seen != Some(seq);
                self.last_seen = Some(seq);
                changed
            }
            Err(e) => {
                tracing::debug!(error = %e, table = %self.sql.names.outbox,
                    "the listener's poll failed");
                false
            }
        };
        self.interval = if changed {
            self.fast
        } else {
            (self.interval * 2).min(self.idle)
        };
        self.next_poll = Instant::now() + self.interval;
        changed
    }
}

#[async_trait]
impl WorkListener for MySqlWorkListener {
    async fn wait(&mut self, timeout: Duration) -> bool {
        if self.local.take_change() {
            return true;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let until = self.next_poll.min(deadline);
            tokio::select! {
                _ = self.local.changed() => return true,
                _ = tokio::time::sleep_until(until) => {}
            }
            if Instant::now() >= self.next_poll && self.poll().await {
                return true;
            }
            if Instant::now() >= deadline {
                return self.local.take_change();
            }
        }
    }
}
