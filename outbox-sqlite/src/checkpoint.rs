//! WAL checkpoints off the commit path.
//!
//! SQLite checkpoints a WAL database from inside a commit: the connection
//! whose commit takes the WAL to `wal_autocheckpoint` pages (1000 by
//! default) copies the WAL into the database file and syncs both before
//! its COMMIT returns — a few milliseconds on a real disk, during which
//! that connection does nothing else. With a relay beside an application,
//! that commit was the application's or the relay's, and when other
//! connections kept writing meanwhile the checkpoint could not finish, so
//! the next commits checkpointed again (`docs/latency.md`).
//!
//! So the store's own connection never checkpoints on its commits (a WAL
//! hook replaces SQLite's automatic one there): it only notes how large the
//! WAL is, and once it holds `checkpoint_pages` pages a thread of the store
//! runs a passive checkpoint on a connection of its own, which waits for
//! no one and makes no one wait. Kept below the application connections'
//! own threshold, the WAL is checkpointed and restarted before those
//! connections' commits would checkpoint it.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use rusqlite::Connection;
use rusqlite::hooks::Wal;

/// The WAL size at which the store checkpoints in the background, in
/// pages: a quarter of SQLite's own `wal_autocheckpoint` default (1000), so
/// that the WAL is checkpointed and restarted long before an application
/// connection's commit would do it.
pub const DEFAULT_CHECKPOINT_PAGES: u32 = 250;

/// Passes of one checkpoint run: a pass copies what was in the WAL when it
/// began, so writes during it leave a little for the next.
const MAX_PASSES: usize = 8;

thread_local! {
    /// The WAL's size in pages after the last commit on this thread's
    /// store connection (0: no commit since it was taken).
    static WAL_PAGES: Cell<u32> = const { Cell::new(0) };
}

/// The store connection's WAL hook: notes the WAL's size. It replaces
/// SQLite's automatic checkpoint on that connection.
fn note_wal_pages(_wal: &Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(u32::try_from(pages).unwrap_or(0));
    Ok(())
}

/// Checkpoints the WAL of one database file in the background.
pub(crate) struct Checkpointer {
    path: PathBuf,
    busy: Duration,
    pages: u32,
    /// Wakes the checkpoint thread; it is started by the first wake-up
    /// and ends when the store is dropped.
    wake: OnceLock<Mutex<SyncSender<()>>>,
}

impl Checkpointer {
    /// Takes over checkpointing from `conn`, the store's own connection:
    /// from now on its commits only note the WAL's size.
    pub(crate) fn new(conn: &Connection, path: &Path, busy: Duration, pages: u32) -> Self {
        conn.wal_hook(Some(note_wal_pages));
        Checkpointer {
            path: path.to_owned(),
            busy,
            pages,
            wake: OnceLock::new(),
        }
    }

    /// After a call on the store's connection, on the thread that made it:
    /// starts a background checkpoint if the call's commits left the WAL at
    /// `pages` or more.
    pub(crate) fn after_call(&self) {
        if WAL_PAGES.replace(0) >= self.pages {
            self.wake();
        }
    }

    fn wake(&self) {
        let wake = self.wake.get_or_init(|| {
            let (tx, rx) = sync_channel(1);
            let (path, busy, pages) = (self.path.clone(), self.busy, self.pages);
            let started = std::thread::Builder::new()
                .name("outbox-checkpoint".into())
                .spawn(move || checkpoint_thread(&path, busy, pages, &rx));
            if let Err(e) = started {
                tracing::warn!(error = %e, "cannot start the WAL checkpoint thread");
            }
            Mutex::new(tx)
        });
        let wake = wake.lock().unwrap_or_else(|p| p.into_inner());
        match wake.try_send(()) {
            // Full: a checkpoint is already asked for.
            Ok(()) | Err(TrySendError::Full(())) => {}
            Err(TrySendError::Disconnected(())) => {
                tracing::debug!("the WAL checkpoint thread has ended");
            }
        }
    }
}

/// Runs a checkpoint each time it is woken, until the store is dropped.
fn checkpoint_thread(path: &Path, busy: Duration, pages: u32, wake: &Receiver<()>) {
    let conn = match crate::builder::open_connection(path, busy, false) {
        Ok(conn) => conn,
        Err(e) => {
            tracing::warn!(error = %e, "the WAL checkpoint thread cannot open its connection; \
                connections checkpoint on their own commits");
            return;
        }
    };
    while wake.recv().is_ok() {
        if let Err(e) = checkpoint(&conn, pages) {
            tracing::debug!(error = %e, "background WAL checkpoint failed; tried again at the next wake-up");
        }
    }
}

/// Passive checkpoints until the WAL is all copied, is small again, or a
/// pass makes no progress (a reader still needs the rest).
fn checkpoint(conn: &Connection, pages: u32) -> rusqlite::Result<()> {
    let mut copied_before = -1;
    for _ in 0..MAX_PASSES {
        let (_busy, log, copied): (i64, i64, i64) =
            conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?;
        if copied >= log || log < i64::from(pages) || copied == copied_before {
            break;
        }
        copied_before = copied;
    }
    Ok(())
}
