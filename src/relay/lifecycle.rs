//! The relay's lifecycle: running or not, why its task died, shutdown
//! requested, and the drains that ended idle — what `RelayHandle` reports
//! and waits on, kept in one place.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use outbox_api::{Error, ErrorKind, Result};
use tokio::sync::watch;

use super::lock;

/// Running, crashed or stopped; shutdown requested; drains ended idle.
#[derive(Debug)]
pub(super) struct Lifecycle {
    shutdown: watch::Sender<bool>,
    running: AtomicBool,
    /// Why the relay task died, if it did.
    crashed: Mutex<Option<String>>,
    drains_started: AtomicU64,
    /// The highest drain number that ended with nothing left to claim.
    idle: watch::Sender<u64>,
}

impl Lifecycle {
    pub(super) fn new() -> Self {
        Lifecycle {
            shutdown: watch::channel(false).0,
            running: AtomicBool::new(false),
            crashed: Mutex::new(None),
            drains_started: AtomicU64::new(0),
            idle: watch::channel(0).0,
        }
    }

    /// The relay task starts.
    pub(super) fn started(&self) {
        self.running.store(true, Ordering::SeqCst);
    }

    /// The relay task ended (after a shutdown): waiters learn it.
    pub(super) fn ended(&self) {
        self.running.store(false, Ordering::SeqCst);
        self.idle.send_modify(|_| {});
    }

    /// The relay task died (`why`): waiters learn it, and why.
    pub(super) fn crashed(&self, why: String) {
        *lock(&self.crashed) = Some(why);
        self.ended();
    }

    /// Why the relay task died, if it did.
    pub(super) fn crash_reason(&self) -> Option<String> {
        lock(&self.crashed).clone()
    }

    /// Whether the relay task runs.
    pub(super) fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Asks the relay to stop.
    pub(super) fn request_stop(&self) {
        self.shutdown.send_replace(true);
    }

    /// Whether a stop was asked for.
    pub(super) fn stop_requested(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Notices a stop request (for `select!`).
    pub(super) fn stop_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// A drain begins; its number.
    pub(super) fn drain_started(&self) -> u64 {
        self.drains_started.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Drain `number` ended with nothing left to claim.
    pub(super) fn drain_idle(&self, number: u64) {
        self.idle.send_modify(|v| *v = (*v).max(number));
    }

    /// Waits until a drain that begins after this call ends idle (`wake`
    /// asks the relay to drain now); fails, `ErrorKind::Stopped` naming the
    /// panic if there was one, when the relay stops first.
    pub(super) async fn until_idle(&self, wake: impl FnOnce()) -> Result<()> {
        let target = self.drains_started.load(Ordering::SeqCst) + 1;
        let mut idle = self.idle.subscribe();
        wake();
        loop {
            if *idle.borrow_and_update() >= target {
                return Ok(());
            }
            if !self.is_running() || idle.changed().await.is_err() {
                return Err(self.stopped());
            }
        }
    }

    fn stopped(&self) -> Error {
        match self.crash_reason() {
            Some(why) => Error::new(ErrorKind::Stopped, format!("the relay has stopped: {why}")),
            None => Error::new(ErrorKind::Stopped, "the relay has stopped"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn idle_means_a_drain_that_began_after_the_call_and_a_stop_is_an_error() {
        let life = Arc::new(Lifecycle::new());
        life.started();
        // A drain that began before the call does not count.
        let early = life.drain_started();
        let waiter = tokio::spawn({
            let life = Arc::clone(&life);
            async move { life.until_idle(|| {}).await }
        });
        tokio::task::yield_now().await;
        life.drain_idle(early);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "an earlier drain ended idle");
        let next = life.drain_started();
        life.drain_idle(next);
        waiter.await.unwrap().unwrap();

        life.request_stop();
        assert!(life.stop_requested());
        life.ended();
        let e = life.until_idle(|| {}).await.unwrap_err();
        assert_eq!(
            (e.kind(), e.message()),
            (ErrorKind::Stopped, "the relay has stopped")
        );

        let crashed = Lifecycle::new();
        crashed.started();
        crashed.crashed("relay task panicked: boom".into());
        assert!(!crashed.is_running());
        let e = crashed.until_idle(|| {}).await.unwrap_err();
        assert!(e.to_string().contains("boom"), "{e}");
    }
}
