//! A fleet: one process relaying many outboxes (a schema or a database
//! file per tenant) with one delivery budget shared fairly between them
//! (rule "Fleets" in `docs/rules.md`).
//!
//! ```no_run
//! # async fn example(stores: Vec<(String, outbox::memory::MemoryStore)>) -> outbox::Result<()> {
//! use outbox::{Fleet, Handlers, Relay};
//!
//! let fleet = Fleet::builder().concurrency(128).worker_id("orders-7f9c").build()?;
//! for (tenant, store) in stores {
//!     fleet.add(tenant, Relay::builder(store).dispatcher(Handlers::new()))?;
//! }
//! // A tenant created while the fleet runs joins it; a deleted one leaves.
//! fleet.remove("tenant-42").await?;
//! # Ok(()) }
//! ```
//!
//! A fleet can also follow a register of tenants the application keeps
//! ([`Fleet::discover`] with a [`Catalogue`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use outbox_api::{Error, ErrorKind, HealthReport, HealthStatus, Result};

use crate::metrics::MetricLabels;
use crate::relay::{Budget, lock};
use crate::{DrainReport, RelayBuilder, RelayHandle};

mod discover;
pub use discover::{Catalogue, Discovery, DiscoveryReport};

/// One relay process for many outboxes: each outbox added is relayed by a
/// relay of its own, with every rule of a single relay, and all of them
/// take their delivery slots from one budget of the fleet's, handed round
/// the outboxes that have work a turn at a time (one delivery, or the
/// outbox's [weight](Self::set_weight)), so that a deep backlog in one
/// outbox delays a fresh message of another by a few deliveries at most.
/// Outboxes are added and removed while it runs.
///
/// Cloning gives another handle to the same fleet; when the last is
/// dropped, its relays stop (see [`RelayHandle`]'s drop).
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<Inner>,
}

struct Inner {
    budget: Arc<Budget>,
    worker_id: String,
    sweep: Duration,
    labels: MetricLabels,
    members: Mutex<BTreeMap<String, Arc<RelayHandle>>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("worker_id", &self.inner.worker_id)
            .field("concurrency", &self.inner.budget.total())
            .field("outboxes", &self.len())
            .finish()
    }
}

/// The default [`FleetBuilder::sweep_interval`].
pub const DEFAULT_SWEEP: Duration = Duration::from_secs(30);

/// The default [`FleetBuilder::concurrency`]: four times an outbox's own
/// default limit ([`RelayConfig::concurrency`](crate::RelayConfig::concurrency),
/// 64), so that one outbox draining a backlog at its limit leaves three
/// quarters of the slots to the others (rule "Fleets" in `docs/rules.md`).
pub const DEFAULT_FLEET_CONCURRENCY: usize = 4 * crate::config::DEFAULT_CONCURRENCY;

/// Builds a [`Fleet`].
#[derive(Debug, Clone)]
pub struct FleetBuilder {
    concurrency: usize,
    worker_id: String,
    sweep: Duration,
    labels: MetricLabels,
}

impl Default for FleetBuilder {
    fn default() -> Self {
        FleetBuilder {
            concurrency: DEFAULT_FLEET_CONCURRENCY,
            worker_id: format!("fleet-{}-{:08x}", std::process::id(), fastrand::u32(..)),
            sweep: DEFAULT_SWEEP,
            labels: MetricLabels::Outbox,
        }
    }
}

impl FleetBuilder {
    /// Deliveries in flight at once across all the fleet's outboxes
    /// ([`DEFAULT_FLEET_CONCURRENCY`], 256). Each outbox's own
    /// [`RelayConfig::concurrency`](crate::RelayConfig::concurrency) stays
    /// its limit within it; keep that below the fleet's, or one outbox with
    /// a backlog takes every slot and the others' messages wait for their
    /// turn in the slots' queue behind it.
    pub fn concurrency(mut self, slots: usize) -> Self {
        self.concurrency = slots;
        self
    }

    /// The fleet's identity (default `fleet-<pid>-<random>`): the relay of
    /// outbox `o` works as `<worker_id>/<o>`. Give it a **stable** value (the
    /// host or pod name) and a restarted fleet takes back the leases its
    /// previous process held at once, as a single relay does (see
    /// [`RelayConfig::worker_id`](crate::RelayConfig::worker_id)).
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = id.into();
        self
    }

    /// How often each outbox is claimed from when nothing wakes it (30 s;
    /// each outbox's time is drawn between ¾ and 1¼ of it, so that the
    /// outboxes' sweeps spread out). An outbox's relay is woken by its
    /// commits (in-process at once, from other processes through
    /// `LISTEN`), and claims again when a message it put off comes due; the
    /// sweep is a safety net (an expired lease of a crashed relay, a
    /// notification lost), so it can be slow: it is an idle fleet's whole
    /// cost.
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep = every;
        self
    }

    /// Which labels its outboxes' per-message metrics carry
    /// ([`MetricLabels::Outbox`]: the outbox and the message kind, not the
    /// type, so that the series grow with the outboxes only; see
    /// [`crate::metrics`] for the count). Set for every outbox added.
    pub fn metric_labels(mut self, labels: MetricLabels) -> Self {
        self.labels = labels;
        self
    }

    /// Checks the configuration and builds the fleet, with no outbox yet.
    pub fn build(self) -> Result<Fleet> {
        if self.concurrency == 0 {
            return Err(Error::config("concurrency", "must be at least 1"));
        }
        if self.worker_id.trim().is_empty() {
            return Err(Error::config("worker_id", "must not be empty"));
        }
        if self.sweep.is_zero() {
            return Err(Error::config("sweep_interval", "must be greater than zero"));
        }
        Ok(Fleet {
            inner: Arc::new(Inner {
                budget: Arc::new(Budget::new(self.concurrency)),
                worker_id: self.worker_id,
                sweep: self.sweep,
                labels: self.labels,
                members: Mutex::new(BTreeMap::new()),
            }),
        })
    }
}

/// The health of a fleet: each outbox's report, and the worst of them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct FleetHealth {
    /// The worst status of the outboxes (`Healthy` with none).
    pub status: HealthStatus,
    /// Each outbox's report, by name.
    pub outboxes: BTreeMap<String, HealthReport>,
}

impl FleetHealth {
    /// The outboxes that are not healthy, by name: the ones to look at.
    pub fn not_healthy(&self) -> Vec<&str> {
        self.outboxes
            .iter()
            .filter(|(_, r)| r.status != HealthStatus::Healthy)
            .map(|(name, _)| name.as_str())
            .collect()
    }
}

impl Fleet {
    /// Starts building a fleet.
    pub fn builder() -> FleetBuilder {
        FleetBuilder::default()
    }

    pub(crate) fn budget(&self) -> Arc<Budget> {
        Arc::clone(&self.inner.budget)
    }

    /// Adds the outbox `name` and starts relaying it with `relay` (a
    /// [`Relay::builder`](crate::Relay::builder) over its store, with its
    /// dispatcher, transport and settings). The fleet sets: the relay's
    /// [`name`](crate::RelayConfig::name) to `name` (its metrics label and
    /// its entry in [`health`](Self::health)); its worker id to the fleet's
    /// followed by `/name`; its delivery slots to come from the fleet's
    /// budget; its `poll_interval` to the fleet's
    /// [sweep](FleetBuilder::sweep_interval) (so a `NextRound` retry waits
    /// for the sweep: give a fleet's outboxes a retry policy with delays);
    /// its `metrics_interval` and `purge_interval` to at least the sweep;
    /// and its [`metric_labels`](FleetBuilder::metric_labels) to the
    /// fleet's. Its [`fleet_weight`](crate::RelayConfig::fleet_weight) and
    /// its `concurrency` are the outbox's share and limit of the fleet's
    /// slots.
    ///
    /// Fails, adding nothing, on a name that is empty, has whitespace or
    /// control characters, or is in the fleet already, and on a relay
    /// configuration [`RelayBuilder::build`] refuses.
    pub fn add(&self, name: impl Into<String>, relay: RelayBuilder) -> Result<Arc<RelayHandle>> {
        let name = name.into();
        if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(Error::invalid_input(format!(
                "outbox name {name:?}: must be non-empty, without whitespace or control characters"
            )));
        }
        let mut members = lock(&self.inner.members);
        if members.contains_key(&name) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!("outbox `{name}` is in this fleet already"),
            ));
        }
        let sweep = self.inner.sweep.mul_f64(0.75 + fastrand::f64() / 2.0);
        let config = relay.current_config();
        let metrics = config.metrics_interval.map(|i| i.max(self.inner.sweep));
        let purge = config.purge_interval.max(self.inner.sweep);
        let handle = relay
            .poll_interval(sweep)
            .metrics_interval(metrics)
            .purge_interval(purge)
            .metric_labels(self.inner.labels)
            .worker_id(format!("{}/{name}", self.inner.worker_id))
            .name(name.clone())
            .fleet(self)
            .spawn()?;
        let handle = Arc::new(handle);
        members.insert(name, Arc::clone(&handle));
        Ok(handle)
    }

    /// Removes the outbox `name`: its relay stops claiming, finishes the
    /// deliveries in flight and gives back what it had not started, as
    /// [`RelayHandle::shutdown`] does. Its messages stay in its store.
    /// Fails (`NotFound`) if the fleet has no such outbox.
    pub async fn remove(&self, name: &str) -> Result<()> {
        let handle = lock(&self.inner.members)
            .remove(name)
            .ok_or_else(|| not_in_fleet(name))?;
        handle.shutdown().await;
        Ok(())
    }

    /// The relay of outbox `name`, if the fleet has it.
    pub fn get(&self, name: &str) -> Option<Arc<RelayHandle>> {
        lock(&self.inner.members).get(name).cloned()
    }

    /// The outboxes' names, in order.
    pub fn outboxes(&self) -> Vec<String> {
        lock(&self.inner.members).keys().cloned().collect()
    }

    /// Sets the weight of outbox `name` — the slots it takes per turn while
    /// the fleet's are scarce (see
    /// [`RelayConfig::fleet_weight`](crate::RelayConfig::fleet_weight),
    /// which gave it its first) — from its next turn on: a tenant moved to
    /// a larger plan, one whose backlog should drain first. Fails, changing
    /// nothing, on a weight of 0 (`InvalidInput`) and if the fleet has no
    /// such outbox (`NotFound`).
    pub fn set_weight(&self, name: &str, weight: u32) -> Result<()> {
        if weight == 0 {
            return Err(Error::invalid_input(format!(
                "weight of outbox `{name}`: must be at least 1"
            )));
        }
        let handle = self.get(name).ok_or_else(|| not_in_fleet(name))?;
        member(&handle).set_weight(weight);
        Ok(())
    }

    /// The weight of outbox `name` now, if the fleet has it.
    pub fn weight(&self, name: &str) -> Option<u32> {
        self.get(name).map(|h| member(&h).weight())
    }

    /// How many outboxes the fleet relays.
    pub fn len(&self) -> usize {
        lock(&self.inner.members).len()
    }

    /// Whether the fleet relays no outbox.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Deliveries holding one of the fleet's slots now.
    pub fn in_flight(&self) -> usize {
        self.inner.budget.in_use()
    }

    fn members(&self) -> Vec<(String, Arc<RelayHandle>)> {
        lock(&self.inner.members)
            .iter()
            .map(|(n, h)| (n.clone(), Arc::clone(h)))
            .collect()
    }

    /// Every outbox's health (read at once), and the worst status.
    pub async fn health(&self) -> FleetHealth {
        let members = self.members();
        let reports = join_all(members.iter().map(|(_, h)| h.health())).await;
        let outboxes: BTreeMap<String, HealthReport> =
            members.into_iter().map(|(n, _)| n).zip(reports).collect();
        // `HealthStatus` is ordered from healthy to unhealthy.
        let status = outboxes
            .values()
            .map(|r| r.status)
            .max()
            .unwrap_or(HealthStatus::Healthy);
        FleetHealth { status, outboxes }
    }

    /// Totals of every outbox in the fleet now, since each was added.
    pub fn totals(&self) -> DrainReport {
        let mut sum = DrainReport::default();
        for (_, h) in self.members() {
            sum.add(h.totals());
        }
        sum
    }

    /// Waits until every outbox in the fleet now has finished a drain that
    /// began after this call and found nothing to claim (see
    /// [`RelayHandle::until_idle`]); fails if one of their relays stops.
    pub async fn until_idle(&self) -> Result<()> {
        let members = self.members();
        for result in join_all(members.iter().map(|(_, h)| h.until_idle())).await {
            result?;
        }
        Ok(())
    }

    /// Stops every outbox's relay gracefully (see [`RelayHandle::shutdown`])
    /// and removes them all.
    pub async fn shutdown(&self) {
        let members = std::mem::take(&mut *lock(&self.inner.members));
        join_all(members.values().map(|h| h.shutdown())).await;
    }
}

fn not_in_fleet(name: &str) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("outbox `{name}` is not in this fleet"),
    )
}

/// The fleet's share of a relay it runs.
fn member(handle: &RelayHandle) -> &crate::relay::Member {
    handle
        .relay()
        .fleet_member()
        .expect("a fleet's relays take their slots from it")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_one_outbox_at_its_own_limit_leaves_most_of_the_fleets_slots_to_the_others() {
        let fleet = FleetBuilder::default().build().unwrap();
        let own = crate::RelayConfig::default().concurrency;
        assert_eq!(fleet.inner.budget.total(), DEFAULT_FLEET_CONCURRENCY);
        assert!(
            own * 4 <= DEFAULT_FLEET_CONCURRENCY,
            "an outbox's default limit ({own}) takes at most a quarter of the fleet's slots ({DEFAULT_FLEET_CONCURRENCY})"
        );
    }
}
