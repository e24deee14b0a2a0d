//! The handle of a running relay: health, "until idle" for tests, shutdown.

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use outbox_api::{Error, ErrorKind, HealthReport, Result};

use super::{DrainReport, Relay, lock};

/// A running relay: health, "until idle" for tests, graceful shutdown.
#[derive(Debug)]
pub struct RelayHandle {
    relay: Relay,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl RelayHandle {
    pub(super) fn new(relay: Relay, task: tokio::task::JoinHandle<()>) -> Self {
        RelayHandle {
            relay,
            task: Mutex::new(Some(task)),
        }
    }

    /// The relay (e.g. for its configuration).
    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    /// The relay's health report.
    pub async fn health(&self) -> HealthReport {
        self.relay.health().await
    }

    /// Wakes the relay now instead of at its next poll.
    pub fn wake(&self) {
        self.relay.inner.wake.notify_one();
    }

    /// Waits until the relay has finished a drain that began after this
    /// call and found nothing left to claim. Messages waiting for a retry
    /// time, a lease or a paused transport are not claimable, so they do not
    /// keep the relay busy. Fails if the relay stops first, naming the
    /// panic if its task died.
    pub async fn until_idle(&self) -> Result<()> {
        let inner = &self.relay.inner;
        let target = inner.drains_started.load(Ordering::SeqCst) + 1;
        let mut idle = inner.idle.subscribe();
        self.wake();
        loop {
            if *idle.borrow_and_update() >= target {
                return Ok(());
            }
            if !inner.running.load(Ordering::SeqCst) || idle.changed().await.is_err() {
                return Err(self.stopped());
            }
        }
    }

    fn stopped(&self) -> Error {
        match lock(&self.relay.inner.crashed).clone() {
            Some(why) => Error::new(ErrorKind::Stopped, format!("the relay has stopped: {why}")),
            None => Error::new(ErrorKind::Stopped, "the relay has stopped"),
        }
    }

    /// Stops claiming, finishes the deliveries in flight, gives unstarted
    /// leases back, and waits for the relay to stop.
    pub async fn shutdown(&self) {
        self.relay.inner.shutdown.send_replace(true);
        let task = lock(&self.task).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "relay task ended abnormally");
            }
        }
        self.relay.inner.running.store(false, Ordering::SeqCst);
    }

    /// Whether the relay loop is running (false once it stopped or died).
    pub fn is_running(&self) -> bool {
        self.relay.inner.running.load(Ordering::SeqCst)
    }

    /// Totals since start.
    pub fn totals(&self) -> DrainReport {
        self.relay.inner.counters.snapshot()
    }
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        // Dropping the handle stops the relay (the task notices at its next
        // step); leases of work in flight expire as after a crash.
        self.relay.inner.shutdown.send_replace(true);
    }
}
