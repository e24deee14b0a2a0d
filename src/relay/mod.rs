//! The relay: claims messages from a [`Store`] and delivers them to a
//! [`Dispatcher`] (domain) or a [`Transport`] (integration).
//!
//! The rules it follows are in `docs/rules.md`. Its parts, one concern a
//! file:
//!
//! * `builder` — configuration and construction;
//! * `schedule` — continuous scheduling: slots, per-key chains, claims;
//! * `deliver` — one delivery (a guarded handler run or a transport send);
//! * `settle` — recording what deliveries ended in, in small groups;
//! * `gate` — the transport's state and its probe task;
//! * `upkeep` — retention purge, health and the backlog gauges;
//! * `meter` — the metrics' handles (names in `crate::metrics`);
//! * `handle` — the running relay's handle;
//! * `budget` — a fleet's delivery slots, shared by its members.

mod budget;
mod builder;
mod deliver;
mod gate;
mod handle;
mod lifecycle;
mod meter;
mod schedule;
mod settle;
#[cfg(test)]
mod tests;
mod unavailable;
mod upkeep;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::FutureExt;
use outbox_api::{
    Clock, Dispatcher, Result, Store, Timestamp, Transport, WorkListener, panic_message,
};
use tokio::sync::Notify;

use crate::config::RelayConfig;

pub(crate) use budget::{Budget, Member};
pub use builder::RelayBuilder;
pub use handle::RelayHandle;

use gate::Gate;
use lifecycle::Lifecycle;
use schedule::{Mode, Scheduler};
use unavailable::HandlerUnavailability;

/// What one [`Relay::drain`] (or [`Relay::run_batch`]) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Claims that returned messages.
    pub batches: u64,
    /// Messages delivered and marked processed.
    pub delivered: u64,
    /// Counted failures that will be retried.
    pub failed: u64,
    /// Counted failures that poisoned their message.
    pub poisoned: u64,
    /// Messages given back without counting (outage, shutdown, a key's
    /// earlier message failed, a lease too short to start on).
    pub released: u64,
    /// Messages whose handler said it was temporarily unavailable: given
    /// back uncounted, to be tried again after a backoff.
    pub deferred: u64,
}

impl DrainReport {
    pub(crate) fn add(&mut self, other: DrainReport) {
        self.batches += other.batches;
        self.delivered += other.delivered;
        self.failed += other.failed;
        self.poisoned += other.poisoned;
        self.released += other.released;
        self.deferred += other.deferred;
    }
}

/// Totals since the relay was built.
#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    delivered: AtomicU64,
    failed: AtomicU64,
    poisoned: AtomicU64,
    released: AtomicU64,
    deferred: AtomicU64,
}

impl Counters {
    fn add(&self, r: &DrainReport) {
        self.batches.fetch_add(r.batches, Ordering::Relaxed);
        self.delivered.fetch_add(r.delivered, Ordering::Relaxed);
        self.failed.fetch_add(r.failed, Ordering::Relaxed);
        self.poisoned.fetch_add(r.poisoned, Ordering::Relaxed);
        self.released.fetch_add(r.released, Ordering::Relaxed);
        self.deferred.fetch_add(r.deferred, Ordering::Relaxed);
    }

    fn snapshot(&self) -> DrainReport {
        DrainReport {
            batches: self.batches.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            poisoned: self.poisoned.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            deferred: self.deferred.load(Ordering::Relaxed),
        }
    }
}

struct Inner {
    store: Arc<dyn Store>,
    transport: Option<Arc<dyn Transport>>,
    dispatcher: Option<Arc<dyn Dispatcher>>,
    clock: Arc<dyn Clock>,
    config: RelayConfig,
    gate: Gate,
    lifecycle: Lifecycle,
    wake: Notify,
    last_store_error: Mutex<Option<String>>,
    /// Handlers that said "temporarily unavailable", by message type.
    unavailable: HandlerUnavailability,
    counters: Counters,
    meter: meter::Meter,
    /// In a fleet: the slots shared with the other members, taken on top
    /// of this relay's own `concurrency`, and its weight.
    fleet: Option<Member>,
    /// The earliest time a message this relay put off (a counted
    /// failure's retry, a deferral) comes due: the relay claims again
    /// then, not only at its next poll.
    due: Mutex<Option<Timestamp>>,
}

/// The relay engine. Usually [`spawn`](Relay::spawn)ed; tests may also call
/// [`drain`](Relay::drain) step by step.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("worker_id", &self.inner.config.worker_id)
            .field("store", &self.inner.store)
            .finish_non_exhaustive()
    }
}

/// Locks `m`, taking the data of a poisoned lock as it is.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Relay {
    /// Starts building a relay over `store`.
    pub fn builder(store: impl Store) -> RelayBuilder {
        Self::builder_shared(Arc::new(store))
    }

    /// Like [`builder`](Self::builder), for a shared store.
    pub fn builder_shared(store: Arc<dyn Store>) -> RelayBuilder {
        RelayBuilder::new(store)
    }

    /// Its place in a fleet, if it takes its slots from one.
    pub(crate) fn fleet_member(&self) -> Option<&Member> {
        self.inner.fleet.as_ref()
    }

    /// The configuration in force.
    pub fn config(&self) -> &RelayConfig {
        &self.inner.config
    }

    /// Runs the relay loop on the current tokio runtime. If the loop dies
    /// (a panic in a store or transport), the relay reports Unhealthy and
    /// [`RelayHandle::until_idle`] fails, naming the panic.
    ///
    /// Refuses a `worker_id` that a relay running in this process already
    /// uses: a relay takes back at start the leases held under its id (see
    /// [`RelayConfig::worker_id`]), which would take them from the live one.
    pub fn spawn(self) -> Result<RelayHandle> {
        let id = self.inner.config.worker_id.clone();
        if !lock(builder::live_workers()).insert(id.clone()) {
            return Err(outbox_api::Error::config(
                "worker_id",
                format!(
                    "`{id}` is already used by a relay running in this process; each live relay needs its own"
                ),
            ));
        }
        // Held by the task: its id is free again when the task ends — or is
        // dropped with its runtime, never having ended.
        let live = builder::LiveWorker(id);
        self.inner.lifecycle.started();
        let relay = self.clone();
        let task = tokio::spawn(async move {
            let outcome = AssertUnwindSafe(relay.clone().run()).catch_unwind().await;
            drop(live);
            if let Err(panic) = outcome {
                let text = format!("relay task panicked: {}", panic_message(&*panic));
                tracing::error!(worker = %relay.inner.config.worker_id, "{text}");
                relay.inner.lifecycle.crashed(text);
            }
        });
        Ok(RelayHandle::new(self, task))
    }

    fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// A message this relay put off comes due at `at`.
    fn put_off_until(&self, at: Timestamp) {
        let mut due = lock(&self.inner.due);
        *due = Some(due.map_or(at, |d| d.min(at)));
    }

    /// How long to sleep after a drain that began at `began`: the poll
    /// interval, or less when a message put off comes due sooner. A message
    /// due before the drain began was claimable by it, and is forgotten.
    fn until_next_claim(&self, began: Timestamp, poll: std::time::Duration) -> std::time::Duration {
        let mut due = lock(&self.inner.due);
        match *due {
            Some(at) if at <= began => {
                *due = None;
                poll
            }
            Some(at) => poll.min(at.since(self.now())),
            None => poll,
        }
    }

    fn stopping(&self) -> bool {
        self.inner.lifecycle.stop_requested()
    }

    /// Claims and delivers until nothing is claimable and everything
    /// claimed is settled (or shutdown was requested): up to `concurrency`
    /// deliveries in flight, claimed as slots free up.
    pub async fn drain(&self) -> Result<DrainReport> {
        self.drain_with(None).await
    }

    async fn drain_with(
        &self,
        listener: Option<&mut Box<dyn WorkListener>>,
    ) -> Result<DrainReport> {
        let number = self.inner.lifecycle.drain_started();
        let result = Scheduler::new(self, Mode::Drain, listener).run().await;
        if result.is_ok() {
            self.inner.lifecycle.drain_idle(number);
        }
        result
    }

    /// Claims one batch and delivers it, claiming nothing more; returns what
    /// happened and how many messages were claimed.
    pub async fn run_batch(&self) -> Result<(DrainReport, usize)> {
        let mut scheduler = Scheduler::new(self, Mode::OneBatch, None);
        let report = scheduler.run().await?;
        Ok((report, scheduler.claimed()))
    }

    async fn run(self) {
        let cfg = self.inner.config.clone();
        tracing::info!(worker = %cfg.worker_id, "relay started");
        // A restarted relay with a stable worker id takes back the leases
        // its previous process held, instead of waiting for them to expire.
        match self.inner.store.release_worker(&cfg.worker_id).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(worker = %cfg.worker_id, released = n, "took back leases held under this worker id by an earlier run")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not take back earlier leases; they expire by themselves")
            }
        }
        let mut listener = self.inner.store.listen();
        let mut shutdown = self.inner.lifecycle.stop_signal();
        let purger = cfg
            .retention
            .is_some()
            .then(|| tokio::spawn(self.clone().purge_loop()));
        let gauges = cfg
            .metrics_interval
            .map(|every| tokio::spawn(self.clone().gauge_loop(every)));
        while !*shutdown.borrow() {
            let began = self.now();
            let wait = match self.drain_with(Some(&mut listener)).await {
                Ok(_) => {
                    *lock(&self.inner.last_store_error) = None;
                    self.until_next_claim(began, cfg.poll_interval)
                }
                Err(e) => {
                    tracing::error!(error = %e, "relay could not use the store; retrying");
                    *lock(&self.inner.last_store_error) = Some(e.to_string());
                    cfg.store_error_backoff
                }
            };
            tokio::select! {
                _ = listener.wait(wait) => {}
                _ = self.inner.wake.notified() => {}
                _ = shutdown.changed() => {}
            }
        }
        if let Some(gauges) = gauges {
            if let Err(e) = gauges.await {
                tracing::error!(error = %e, "metrics task ended abnormally");
            }
        }
        if let Some(purger) = purger {
            // It stops at the shutdown signal, after the batch in progress.
            if let Err(e) = purger.await {
                tracing::error!(error = %e, "purge task ended abnormally");
            }
        }
        self.inner.lifecycle.ended();
        tracing::info!(worker = %cfg.worker_id, "relay stopped");
    }
}
