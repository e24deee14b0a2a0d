//! How the store's connection waits for another connection's write lock.
//!
//! SQLite's own busy handler (`busy_timeout`) sleeps 1, 2, 5, 10, 15 … ms
//! between tries. An application transaction holds the write lock for a
//! few hundred microseconds (more through sqlx, whose statements each hop
//! to a worker thread), so a relay whose `BEGIN IMMEDIATE` met one slept
//! a whole millisecond, and when the application's next transaction had
//! the lock again at the next try, 2 ms more, then 5: a relay round of 8 ms
//! while the lock was free most of that time (`docs/latency.md`). The store
//! tries again in steps of 50 µs, growing by 50 µs a try up to 1 ms, for
//! as long as its busy timeout.

use std::cell::Cell;
use std::time::{Duration, Instant};

use rusqlite::Connection;

/// The first pause, and how much each try adds to the next.
const STEP: Duration = Duration::from_micros(50);
/// The longest pause between two tries.
const MAX_PAUSE: Duration = Duration::from_millis(1);

thread_local! {
    /// How long a statement on this thread may wait for a lock.
    static TIMEOUT: Cell<Duration> = const { Cell::new(crate::builder::DEFAULT_BUSY_TIMEOUT) };
    /// When the current statement first found the database locked.
    static SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Makes `conn` wait for locks in short steps; [`with_timeout`] sets how
/// long, for statements run on the calling thread.
pub(crate) fn install(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_handler(Some(wait_for_lock))
}

/// Runs `f` with statements on this thread waiting up to `timeout` for a
/// lock.
pub(crate) fn with_timeout<T>(timeout: Duration, f: impl FnOnce() -> T) -> T {
    let before = TIMEOUT.replace(timeout);
    let out = f();
    TIMEOUT.set(before);
    out
}

/// SQLite's busy handler: `tries` is how many times it was called before
/// for this lock; `false` gives up (`SQLITE_BUSY`).
fn wait_for_lock(tries: i32) -> bool {
    wait(tries, TIMEOUT.get())
}

/// Makes an application's connection (`db`, from sqlx or rusqlite) wait
/// for locks in the same short steps, up to `timeout_ms` — its own
/// `PRAGMA busy_timeout`, which this handler replaces (SQLite keeps one
/// busy handler per connection).
///
/// # Safety
/// `db` must be an open connection that no other thread uses during the
/// call, and it must not be closed before the call returns.
#[allow(unsafe_code)]
pub(crate) unsafe fn install_on(
    db: *mut rusqlite::ffi::sqlite3,
    timeout_ms: i64,
) -> rusqlite::Result<()> {
    use std::ffi::{c_int, c_void};
    /// The handler SQLite calls: its argument is the timeout in
    /// milliseconds, carried in the pointer's value (nothing to free).
    extern "C" fn on_busy(timeout_ms: *mut c_void, tries: c_int) -> c_int {
        let timeout = Duration::from_millis(timeout_ms as usize as u64);
        c_int::from(wait(tries, timeout))
    }
    let ms = usize::try_from(timeout_ms).unwrap_or(0);
    // SAFETY: the caller vouches for `db`; the handler reads its argument
    // as an integer, never as a pointer, so it needs no lifetime.
    let rc = unsafe { rusqlite::ffi::sqlite3_busy_handler(db, Some(on_busy), ms as *mut c_void) };
    if rc == rusqlite::ffi::SQLITE_OK {
        Ok(())
    } else {
        Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rc),
            None,
        ))
    }
}

/// Pauses before the next try of a lock, unless `timeout` has passed since
/// the first try (then `false`: give up).
fn wait(tries: i32, timeout: Duration) -> bool {
    let now = Instant::now();
    let since = match SINCE.get() {
        Some(since) if tries > 0 => since,
        _ => {
            SINCE.set(Some(now));
            now
        }
    };
    let left = timeout.saturating_sub(now.duration_since(since));
    if left.is_zero() {
        return false;
    }
    let tries = u32::try_from(tries).unwrap_or(u32::MAX);
    let pause = STEP
        .saturating_mul(tries.saturating_add(1))
        .min(MAX_PAUSE)
        .min(left);
    std::thread::sleep(pause);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::TransactionBehavior;

    fn pair() -> (tempfile::TempDir, Connection, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock.db");
        let a = Connection::open(&path).unwrap();
        a.execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (x INTEGER);")
            .unwrap();
        let b = Connection::open(&path).unwrap();
        install(&b).unwrap();
        (dir, a, b)
    }

    /// A lock held for 3.5 ms is taken about half a millisecond after its
    /// release (the median under 6 ms, with room for a loaded machine);
    /// SQLite's own handler sleeps 1, 2 then 5 ms, so it takes it after
    /// 8 ms at the soonest.
    #[test]
    fn a_short_lock_is_taken_soon_after_its_release() {
        let (_dir, mut a, mut b) = pair();
        let (locked_tx, locked) = std::sync::mpsc::channel();
        let (next_tx, next) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            while next.recv().is_ok() {
                let held = a
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .unwrap();
                locked_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_micros(3_500));
                held.commit().unwrap();
            }
        });
        let mut waits = Vec::new();
        for _ in 0..20 {
            next_tx.send(()).unwrap();
            locked.recv().unwrap();
            let start = Instant::now();
            let tx = with_timeout(Duration::from_secs(5), || {
                b.transaction_with_behavior(TransactionBehavior::Immediate)
            })
            .unwrap();
            waits.push(start.elapsed());
            tx.commit().unwrap();
        }
        drop(next_tx);
        holder.join().unwrap();
        waits.sort();
        let median = waits[waits.len() / 2];
        assert!(
            median < Duration::from_millis(6),
            "median wait for a lock held 3.5 ms: {median:?} (all: {waits:?})"
        );
    }

    /// The timeout still holds: a lock that is never released is given up
    /// on after it, with `SQLITE_BUSY`.
    #[test]
    fn gives_up_after_the_timeout() {
        let (_dir, mut a, mut b) = pair();
        let _held = a
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let start = Instant::now();
        let err = with_timeout(Duration::from_millis(30), || {
            b.transaction_with_behavior(TransactionBehavior::Immediate)
                .map(|_| ())
        })
        .unwrap_err();
        let waited = start.elapsed();
        assert_eq!(
            err.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseBusy),
            "{err}"
        );
        assert!(
            waited >= Duration::from_millis(30) && waited < Duration::from_millis(500),
            "{waited:?}"
        );
    }
}
