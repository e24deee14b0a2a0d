//! [`SqliteFiles`]: store connections opened on demand, closed when idle,
//! with a bound on how many are open at once — for a fleet of outboxes in
//! a SQLite file each (a file per tenant).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use outbox_api::{Error, Result};
use rusqlite::Connection;

/// A bound on the store connections open at once, shared by the
/// [`SqliteStore`](crate::SqliteStore)s built with
/// [`open_through`](crate::SqliteStoreBuilder::open_through) it, and how
/// long one may stay open unused.
///
/// Such a store opens its file when a call needs it (a claim, a completion,
/// an operator's read) and keeps it open while it is used. When the bound
/// is reached, the store that needs a file closes the one used least
/// recently among those not in use; when every open one is in use, it
/// waits for one to be free. A background thread closes the files unused
/// for longer than the idle time. So a fleet over 10,000 tenant files
/// holds at most the bound open, and an idle fleet none.
///
/// Such a store has no connection of its own to watch the file for commits
/// from other processes: its relay is woken by commits made in this
/// process — at once by the commit of a connection
/// [attached](crate::SqliteOutbox::attach) or by
/// [`notify`](crate::SqliteOutbox::notify), and by an enqueue's hint,
/// looked at again 10 ms and 100 ms later for a transaction still open —
/// and finds other processes' commits (and a transaction that commits
/// later than that without an attached connection) at its next poll (a
/// fleet's sweep). And
/// it leaves WAL checkpoints to SQLite (its commits checkpoint as any
/// connection's do; see
/// [`checkpoint_pages`](crate::SqliteStoreBuilder::checkpoint_pages)).
///
/// Cloning shares the bound.
#[derive(Clone)]
pub struct SqliteFiles {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SqliteFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteFiles")
            .field("max_open", &self.shared.max_open)
            .field("idle", &self.shared.idle)
            .field("open", &self.open())
            .finish()
    }
}

struct Shared {
    max_open: usize,
    idle: Duration,
    /// The cells whose connection is open (or being opened).
    open: Mutex<Vec<Weak<Cell>>>,
    /// Signalled when a call leaves a connection free.
    freed: Condvar,
}

/// One store's connection: open or not, and when it was last used.
pub(crate) struct Cell {
    conn: Mutex<Slot>,
}

pub(crate) struct Slot {
    pub(crate) conn: Option<Connection>,
    used: Instant,
}

impl Cell {
    pub(crate) fn new(conn: Option<Connection>) -> Arc<Cell> {
        Arc::new(Cell {
            conn: Mutex::new(Slot {
                conn,
                used: Instant::now(),
            }),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Slot> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SqliteFiles {
    /// At most `max_open` store connections open at once (each is a file
    /// descriptor or three, with the WAL and its index, and SQLite's page
    /// cache), each closed after `idle` unused. Fails on a zero bound or a
    /// zero idle time.
    pub fn new(max_open: usize, idle: Duration) -> Result<SqliteFiles> {
        if max_open == 0 {
            return Err(Error::config("max_open", "must be at least 1"));
        }
        if idle.is_zero() {
            return Err(Error::config("idle", "must be greater than zero"));
        }
        let shared = Arc::new(Shared {
            max_open,
            idle,
            open: Mutex::new(Vec::new()),
            freed: Condvar::new(),
        });
        let weak = Arc::downgrade(&shared);
        let every = (idle / 2).max(Duration::from_millis(10));
        let started = std::thread::Builder::new()
            .name("outbox-sqlite-files".into())
            .spawn(move || {
                // Ends with the last handle (the stores hold one each).
                while let Some(shared) = weak.upgrade() {
                    shared.close_idle();
                    drop(shared);
                    std::thread::sleep(every);
                }
            });
        if let Err(e) = started {
            return Err(Error::backend(format!(
                "cannot start the thread that closes idle SQLite files: {e}"
            )));
        }
        Ok(SqliteFiles { shared })
    }

    /// How many store connections are open now.
    pub fn open(&self) -> usize {
        let mut open = lock(&self.shared.open);
        open.retain(|w| w.strong_count() > 0);
        open.len()
    }

    /// The bound.
    pub fn max_open(&self) -> usize {
        self.shared.max_open
    }

    /// Gives `slot` (of `cell`, locked by the caller, closed) an open
    /// connection from `open`, within the bound: closes the least recently
    /// used free one if the bound is reached, or waits for one to be free.
    pub(crate) fn admit(
        &self,
        cell: &Arc<Cell>,
        slot: &mut Slot,
        open_connection: impl FnOnce() -> Result<Connection>,
    ) -> Result<()> {
        self.shared.make_room(cell);
        match open_connection() {
            Ok(conn) => {
                slot.conn = Some(conn);
                Ok(())
            }
            Err(e) => {
                self.shared.forget(cell);
                Err(e)
            }
        }
    }

    /// A call on `slot` ended: it is free to be closed from now on.
    pub(crate) fn used(&self, slot: &mut Slot) {
        slot.used = Instant::now();
        self.shared.freed.notify_one();
    }
}

impl Shared {
    fn make_room(&self, cell: &Arc<Cell>) {
        let mut open = lock(&self.open);
        loop {
            open.retain(|w| w.strong_count() > 0);
            if open.len() < self.max_open {
                open.push(Arc::downgrade(cell));
                return;
            }
            // The least recently used connection nobody is using now. A
            // cell being used is locked: `try_lock` skips it without
            // waiting, so this never waits for a call while holding `open`.
            let mut victim: Option<(usize, Instant)> = None;
            for (i, w) in open.iter().enumerate() {
                let Some(other) = w.upgrade() else { continue };
                if let Ok(slot) = other.conn.try_lock()
                    && slot.conn.is_some()
                    && victim.is_none_or(|(_, t)| slot.used < t)
                {
                    victim = Some((i, slot.used));
                }
            }
            if let Some((i, _)) = victim {
                // Taken again: it may have been taken up since it was seen
                // free, and then it stays (and is looked for again).
                if let Some(other) = open[i].upgrade()
                    && let Ok(mut slot) = other.conn.try_lock()
                {
                    slot.conn = None;
                    drop(slot);
                    open.swap_remove(i);
                }
                continue;
            }
            // Every open one is in use: wait for a call to end (and look
            // again now and then, for stores dropped meanwhile).
            open = self
                .freed
                .wait_timeout(open, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn forget(&self, cell: &Arc<Cell>) {
        let mut open = lock(&self.open);
        let me = Arc::downgrade(cell);
        open.retain(|w| !w.ptr_eq(&me) && w.strong_count() > 0);
        self.freed.notify_one();
    }

    /// Closes the connections unused for longer than the idle time.
    fn close_idle(&self) {
        let mut open = lock(&self.open);
        open.retain(|w| {
            let Some(cell) = w.upgrade() else {
                return false;
            };
            let Ok(mut slot) = cell.conn.try_lock() else {
                return true;
            };
            if slot.conn.is_some() && slot.used.elapsed() >= self.idle {
                slot.conn = None;
            }
            slot.conn.is_some()
        });
        drop(open);
        self.freed.notify_all();
    }
}
