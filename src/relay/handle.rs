//! The handle of a running relay: health, "until idle" for tests, shutdown.

use std::sync::Mutex;

use outbox_api::{HealthReport, Result};

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
        self.relay.inner.lifecycle.until_idle(|| self.wake()).await
    }

    /// Stops claiming, finishes the deliveries in flight, gives unstarted
    /// leases back, and waits for the relay to stop.
    pub async fn shutdown(&self) {
        self.relay.inner.lifecycle.request_stop();
        let task = lock(&self.task).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "relay task ended abnormally");
            }
        }
        // The task is gone (or never ran to its end): not running.
        self.relay.inner.lifecycle.ended();
    }

    /// Whether the relay loop is running (false once it stopped or died).
    pub fn is_running(&self) -> bool {
        self.relay.inner.lifecycle.is_running()
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
        self.relay.inner.lifecycle.request_stop();
    }
}
