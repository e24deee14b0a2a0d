//! [`SqliteListener`]: wakes a relay on in-process commits at once and on
//! other connections' commits within a few milliseconds.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::WorkListener;
use outbox_api::backend::{Wakeup, WakeupListener};
use rusqlite::Connection;
use tokio::time::Instant;

/// After a hint, how long to watch closely for the commit to become visible
/// before falling back to the regular poll.
const HINT_WINDOW: Duration = Duration::from_millis(10);
/// The pause between two looks while watching after a hint.
const HINT_STEP: Duration = Duration::from_micros(30);

/// The in-process signals of one (database file, outbox table).
#[derive(Debug, Clone, Default)]
pub(crate) struct Signals {
    /// Something committed that may be claimable now: wake at once.
    pub definite: Wakeup,
    /// An enqueue happened or a transaction that enqueued is committing: the
    /// rows become visible within microseconds, unless the transaction is
    /// still open (or rolls back).
    pub hint: Wakeup,
}

/// A [`WorkListener`] for a SQLite outbox, returned by
/// [`SqliteStore::listen`](outbox_api::Store::listen).
///
/// It wakes when new rows were committed to its outbox table, by any
/// connection of any process, and when an operator retried or discarded a
/// message through a store of this process:
/// * on an in-process hint (an enqueue through [`SqliteOutbox`](crate::SqliteOutbox),
///   or the commit of a connection [attached](crate::SqliteOutbox::attach))
///   it watches closely, on a blocking thread, until the commit is visible:
///   a relay wakes within tens of microseconds of the commit;
/// * otherwise it checks `PRAGMA data_version` on its own connection every
///   `change_poll_interval` (2 ms by default) and, when that moved, whether
///   the table's highest `seq` did — so commits to other tables do not wake
///   the relay.
pub struct SqliteListener {
    definite: WakeupListener,
    hint: WakeupListener,
    watch: Option<Arc<Mutex<ChangeWatch>>>,
    poll: Duration,
    hinted: bool,
    /// Without a connection: when to look again after a hint, whose
    /// transaction may not have committed when it woke the relay.
    recheck: Option<(Instant, u32)>,
}

impl std::fmt::Debug for SqliteListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteListener")
            .field("poll", &self.poll)
            .field("has_connection", &self.watch.is_some())
            .finish_non_exhaustive()
    }
}

/// The listener's own connection and what it saw last.
struct ChangeWatch {
    conn: Connection,
    max_seq_sql: String,
    version: Option<i64>,
    max_seq: Option<i64>,
    /// A change was seen but not yet reported by `wait` (e.g. the waiting
    /// future was dropped while a watcher thread saw it).
    unreported: bool,
}

impl ChangeWatch {
    fn read(&self) -> rusqlite::Result<(i64, Option<i64>)> {
        let version = self
            .conn
            .prepare_cached("PRAGMA data_version")?
            .query_row([], |r| r.get::<_, i64>(0))?;
        if Some(version) == self.version {
            return Ok((version, self.max_seq));
        }
        let max = self
            .conn
            .prepare_cached(&self.max_seq_sql)?
            .query_row([], |r| r.get::<_, Option<i64>>(0))?;
        Ok((version, max))
    }

    /// Looks for new rows; remembers a change until it is taken.
    fn look(&mut self) {
        match self.read() {
            Ok((version, max)) => {
                self.version = Some(version);
                if max != self.max_seq {
                    self.max_seq = max;
                    self.unreported = true;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "outbox listener could not look for changes");
            }
        }
    }

    /// Whether new rows were committed since the last change was taken.
    fn take_change(&mut self) -> bool {
        self.look();
        std::mem::take(&mut self.unreported)
    }
}

fn lock(p: &Mutex<ChangeWatch>) -> MutexGuard<'_, ChangeWatch> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl SqliteListener {
    pub(crate) fn new(
        path: &Path,
        table: &str,
        busy: Duration,
        poll: Duration,
        signals: &Signals,
    ) -> Self {
        let definite = signals.definite.listener();
        let hint = signals.hint.listener();
        let watch = match crate::builder::open_connection(path, busy, false) {
            Ok(conn) => {
                let mut p = ChangeWatch {
                    conn,
                    max_seq_sql: format!("SELECT MAX(seq) FROM {table}"),
                    version: None,
                    max_seq: None,
                    unreported: false,
                };
                p.look();
                p.unreported = false;
                Some(Arc::new(Mutex::new(p)))
            }
            Err(e) => {
                tracing::warn!(error = %e, "outbox listener cannot open its own connection; \
                    it will see in-process signals only");
                None
            }
        };
        SqliteListener {
            definite,
            hint,
            watch,
            poll,
            hinted: false,
            recheck: None,
        }
    }

    /// A listener woken by in-process signals only, with no connection of
    /// its own (a store opened through [`SqliteFiles`](crate::SqliteFiles)).
    pub(crate) fn signals_only(signals: &Signals) -> Self {
        SqliteListener {
            definite: signals.definite.listener(),
            hint: signals.hint.listener(),
            watch: None,
            poll: crate::builder::DEFAULT_CHANGE_POLL,
            hinted: false,
            recheck: None,
        }
    }

    /// Watches closely, on a blocking thread, for the hinted commit. A
    /// change seen there stays recorded in the watch even if this future is
    /// dropped, so the next `wait` reports it.
    async fn watch_hint(&self, watch: &Arc<Mutex<ChangeWatch>>) -> bool {
        let watcher = Arc::clone(watch);
        let looking = tokio::task::spawn_blocking(move || {
            let mut p = lock(&watcher);
            let until = std::time::Instant::now() + HINT_WINDOW;
            loop {
                p.look();
                if p.unreported || std::time::Instant::now() >= until {
                    return;
                }
                std::thread::sleep(HINT_STEP);
            }
        });
        let _ = looking.await;
        std::mem::take(&mut lock(watch).unreported)
    }
}

#[async_trait]
impl WorkListener for SqliteListener {
    async fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.definite.take_change() {
                return true;
            }
            let Some(watch) = self.watch.clone() else {
                // No connection to see commits with: trust the signals. A
                // hint comes at the enqueue, before its commit: wake now,
                // and again HINT_WINDOW and 10 × HINT_WINDOW later, for a
                // transaction that was still open.
                if self.hint.take_change() || self.hinted {
                    self.hinted = false;
                    self.recheck = Some((Instant::now() + HINT_WINDOW, 1));
                    return true;
                }
                let until = match self.recheck {
                    Some((at, _)) => at.min(deadline),
                    None => deadline,
                };
                tokio::select! {
                    _ = self.definite.changed() => return true,
                    _ = self.hint.changed() => self.hinted = true,
                    _ = tokio::time::sleep_until(until) => match self.recheck.take() {
                        Some((at, n)) if at <= Instant::now() => {
                            if n < 2 {
                                self.recheck = Some((Instant::now() + HINT_WINDOW * 9, n + 1));
                            }
                            return true;
                        }
                        other => {
                            self.recheck = other;
                            if Instant::now() >= deadline {
                                return false;
                            }
                        }
                    },
                }
                continue;
            };
            if lock(&watch).take_change() {
                self.hint.take_change();
                return true;
            }
            if self.hint.take_change() || self.hinted {
                self.hinted = false;
                if self.watch_hint(&watch).await {
                    self.hint.take_change();
                    return true;
                }
                // Not visible yet: a longer transaction, or a rollback. The
                // regular poll sees a later commit.
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let nap = self.poll.min(deadline - now);
            tokio::select! {
                _ = self.definite.changed() => return true,
                _ = self.hint.changed() => self.hinted = true,
                _ = tokio::time::sleep(nap) => {}
            }
        }
    }
}
