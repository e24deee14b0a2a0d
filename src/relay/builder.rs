//! Building a relay: `Relay::builder(store).dispatcher(..).transport(..).spawn()`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use outbox_api::{Clock, Dispatcher, Error, Result, Store, SystemClock, Transport};
use tokio::sync::Notify;

use super::gate::Gate;
use super::lifecycle::Lifecycle;
use super::meter::Meter;
use super::unavailable::HandlerUnavailability;
use super::{Budget, Member};
use super::{Counters, Inner, Relay, RelayHandle};
use crate::Fleet;
use crate::config::RelayConfig;

/// Builds a [`Relay`]: `Relay::builder(store).dispatcher(..).transport(..).spawn()`.
pub struct RelayBuilder {
    store: Arc<dyn Store>,
    transport: Option<Arc<dyn Transport>>,
    dispatcher: Option<Arc<dyn Dispatcher>>,
    clock: Arc<dyn Clock>,
    config: RelayConfig,
    budget: Option<Arc<Budget>>,
}

impl std::fmt::Debug for RelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("store", &self.store)
            .field("transport", &self.transport)
            .field("dispatcher", &self.dispatcher)
            .field("config", &self.config)
            .field("in_fleet", &self.budget.is_some())
            .finish()
    }
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.config.$name = value;
            self
        }
    };
}

impl RelayBuilder {
    pub(super) fn new(store: Arc<dyn Store>) -> Self {
        RelayBuilder {
            store,
            transport: None,
            dispatcher: None,
            clock: Arc::new(SystemClock),
            config: RelayConfig::default(),
            budget: None,
        }
    }

    /// Sends integration messages through `transport`.
    pub fn transport(self, transport: impl Transport) -> Self {
        self.transport_shared(Arc::new(transport))
    }

    /// Like [`transport`](Self::transport), for a shared transport.
    pub fn transport_shared(mut self, transport: Arc<dyn Transport>) -> Self {
        self.transport = Some(transport);
        self
    }

    /// Delivers domain messages to `dispatcher` (usually a [`Handlers`](outbox_api::Handlers)).
    pub fn dispatcher(self, dispatcher: impl Dispatcher) -> Self {
        self.dispatcher_shared(Arc::new(dispatcher))
    }

    /// Like [`dispatcher`](Self::dispatcher), for a shared dispatcher.
    pub fn dispatcher_shared(mut self, dispatcher: Arc<dyn Dispatcher>) -> Self {
        self.dispatcher = Some(dispatcher);
        self
    }

    /// Takes the time from `clock` (tests; production uses the wall clock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Takes this relay's delivery slots from `fleet`'s shared budget (its
    /// own `concurrency` stays its limit within it; rule "Fleets" in
    /// `docs/rules.md`). [`Fleet::add`] does this for the relays it runs;
    /// a relay built this way and driven by hand ([`Relay::drain`]) shares
    /// the fleet's slots without being listed in it.
    pub fn fleet(mut self, fleet: &Fleet) -> Self {
        self.budget = Some(fleet.budget());
        self
    }

    /// The configuration set so far.
    pub fn current_config(&self) -> &RelayConfig {
        &self.config
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    setter!(/// See [`RelayConfig::worker_id`].
        worker_id: String);
    setter!(/// See [`RelayConfig::poll_interval`].
        poll_interval: Duration);
    setter!(/// See [`RelayConfig::batch_size`].
        batch_size: usize);
    setter!(/// See [`RelayConfig::max_attempts`].
        max_attempts: u32);
    setter!(/// See [`RelayConfig::lease`].
        lease: Duration);
    setter!(/// See [`RelayConfig::handler_timeout`].
        handler_timeout: Duration);
    setter!(/// See [`RelayConfig::concurrency`].
        concurrency: usize);
    setter!(/// See [`RelayConfig::fleet_weight`].
        fleet_weight: u32);
    setter!(/// See [`RelayConfig::retry_policy`].
        retry_policy: outbox_api::RetryPolicy);
    setter!(/// See [`RelayConfig::retention`].
        retention: Option<Duration>);
    setter!(/// See [`RelayConfig::purge_interval`].
        purge_interval: Duration);
    setter!(/// See [`RelayConfig::purge_batch`].
        purge_batch: usize);
    setter!(/// See [`RelayConfig::backlog_age_alert`].
        backlog_age_alert: Duration);
    setter!(/// See [`RelayConfig::probe_initial`].
        probe_initial: Duration);
    setter!(/// See [`RelayConfig::probe_max`].
        probe_max: Duration);
    setter!(/// See [`RelayConfig::probe_timeout`].
        probe_timeout: Duration);
    setter!(/// See [`RelayConfig::unavailable_initial`].
        unavailable_initial: Duration);
    setter!(/// See [`RelayConfig::unavailable_max`].
        unavailable_max: Duration);
    setter!(/// See [`RelayConfig::metrics_interval`].
        metrics_interval: Option<Duration>);
    setter!(/// See [`RelayConfig::metric_labels`].
        metric_labels: crate::metrics::MetricLabels);

    /// See [`RelayConfig::name`].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = name.into();
        self
    }

    /// Checks the configuration and builds the relay (not yet running).
    pub fn build(self) -> Result<Relay> {
        self.config.validate()?;
        if self.transport.is_none() && self.dispatcher.is_none() {
            return Err(Error::config(
                "dispatcher",
                "a relay needs a dispatcher (domain messages), a transport (integration messages), or both",
            ));
        }
        let gate = Gate::new(self.transport.is_some());
        let meter = Meter::new(
            &self.config.name,
            self.config.metric_labels,
            self.transport.is_some(),
        );
        let unavailable = HandlerUnavailability::new(
            self.config.unavailable_initial,
            self.config.unavailable_max,
        );
        let fleet = self
            .budget
            .map(|b| Member::new(b, self.config.fleet_weight));
        Ok(Relay {
            inner: Arc::new(Inner {
                store: self.store,
                transport: self.transport,
                dispatcher: self.dispatcher,
                clock: self.clock,
                config: self.config,
                gate,
                lifecycle: Lifecycle::new(),
                wake: Notify::new(),
                last_store_error: Mutex::new(None),
                unavailable,
                counters: Counters::default(),
                meter,
                fleet,
                due: Mutex::new(None),
            }),
        })
    }

    /// Builds the relay and runs it on the current tokio runtime; see
    /// [`Relay::spawn`].
    pub fn spawn(self) -> Result<RelayHandle> {
        self.build()?.spawn()
    }
}

/// The worker ids of the relays running in this process.
pub(super) fn live_workers() -> &'static Mutex<HashSet<String>> {
    static LIVE: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// A worker id in [`live_workers`] for as long as this lives.
pub(super) struct LiveWorker(pub(super) String);

impl Drop for LiveWorker {
    fn drop(&mut self) {
        live_workers()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.0);
    }
}
