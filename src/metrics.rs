//! The names and labels of the metrics the relay records.
//!
//! The relay records through the [`metrics`](https://docs.rs/metrics)
//! facade: install a recorder (for Prometheus,
//! `metrics-exporter-prometheus`) **before building relays**, and they
//! record into it; without one, recording is a no-op that costs a branch.
//! Handles are registered when a relay is built (its gauges) and when it
//! first meets a message type (its counters and histograms), so a recorder
//! installed later sees only the types met after it.
//!
//! Every metric carries [`OUTBOX`] (the relay's [`name`](crate::RelayConfig::name));
//! per-message metrics also carry [`MESSAGE_KIND`] (`domain` or
//! `integration`) and [`MESSAGE_TYPE`] (not with [`MetricLabels::Outbox`],
//! a fleet's default). No label holds a message id, a key
//! or an error text: label values are the application's own outbox names
//! and message types, a finite set fixed by its code.
//!
//! # How many series
//!
//! A relay registers 3 gauges (4 with a transport) and its claim-size
//! histogram, and for each message kind and type it meets 4 counters (5
//! for integration messages: `rejected`) and 2 histograms. With
//! [`MetricLabels::Outbox`] the per-message ones are registered once per
//! kind instead of once per type, so an outbox costs a fixed number
//! whatever its types: at most 4 gauges, 9 counters and 5 histograms. In
//! Prometheus a histogram is a series a bucket plus two ([`SECONDS_BUCKETS`]:
//! 22; [`CLAIM_SIZE_BUCKETS`]: 14), so that is at most 115 series an
//! outbox. A [`Fleet`](crate::Fleet) uses [`MetricLabels::Outbox`] by
//! default, so its series grow with its outboxes only: 115,000 for 1,000
//! tenants with both kinds. Size the recorder for that, or with
//! thousands of tenants use the fleet's health and the console for the
//! per-tenant view.
//!
//! Names follow the OpenTelemetry semantic conventions where one applies
//! (`messaging.process.duration`, `messaging.client.operation.duration`
//! with `messaging.operation.name` / `messaging.operation.type`); the
//! outbox's own concepts (outcomes, backlog, claims) are under `outbox.`.
//! Prometheus exporters turn the dots into underscores
//! (`outbox_messages_delivered_total`). See the README's Operations
//! section for the list and `docs/decisions.md` for the choices.

/// Which labels a relay's per-message metrics (counters, the lag and
/// duration histograms) carry. The backlog gauges, the transport gauge and
/// the claim-size histogram carry [`OUTBOX`] alone in every case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MetricLabels {
    /// [`OUTBOX`], [`MESSAGE_KIND`] and [`MESSAGE_TYPE`]: a relay's
    /// default. Series grow with outboxes × message types.
    #[default]
    OutboxAndType,
    /// [`OUTBOX`] and [`MESSAGE_KIND`], without [`MESSAGE_TYPE`]: every
    /// type of a kind counts in one series. Series grow with outboxes
    /// only; a [`Fleet`](crate::Fleet)'s default.
    Outbox,
}

/// Label: the relay's outbox name ([`RelayConfig::name`](crate::RelayConfig::name)).
pub const OUTBOX: &str = "outbox.name";
/// Label: `domain` or `integration`.
pub const MESSAGE_KIND: &str = "outbox.message.kind";
/// Label: the message type (e.g. `OrderPlaced`) — one of the application's own.
pub const MESSAGE_TYPE: &str = "outbox.message.type";
/// Label (OpenTelemetry): `process` (a domain handler) or `send` (a transport send).
pub const OPERATION_NAME: &str = "messaging.operation.name";
/// Label (OpenTelemetry): `process` or `send`.
pub const OPERATION_TYPE: &str = "messaging.operation.type";
/// Label of [`RELEASED`]: why the message was given back uncounted:
/// `outage` (the transport was unavailable) or `handler_unavailable` (the
/// handler said it is temporarily unavailable).
pub const RELEASE_REASON: &str = "outbox.release.reason";

/// Counter: messages delivered (handler returned `Ok`, or the broker confirmed).
pub const DELIVERED: &str = "outbox.messages.delivered";
/// Counter: counted failures — a handler error, panic or timeout, a message
/// type without a handler, a broker rejection. Includes the failure that
/// poisons a message (so [`POISONED`] ≤ `FAILED`).
pub const FAILED: &str = "outbox.messages.failed";
/// Counter: the broker rejected the message (nack, unroutable, too large);
/// these are also counted in [`FAILED`].
pub const REJECTED: &str = "outbox.messages.rejected";
/// Counter: messages poisoned by their last counted failure (they wait for
/// an operator).
pub const POISONED: &str = "outbox.messages.poisoned";
/// Counter: messages given back without counting an attempt, by
/// [`RELEASE_REASON`]: `outage` or `handler_unavailable`.
pub const RELEASED: &str = "outbox.messages.released";

/// Histogram (seconds): from the commit that enqueued a message
/// (`created_at`) to its delivery — the end-to-end lag, retries included.
pub const DELIVERY_LAG: &str = "outbox.delivery.lag";
/// Histogram (seconds, OpenTelemetry): how long a domain message's handlers
/// ran, whatever the outcome.
pub const PROCESS_DURATION: &str = "messaging.process.duration";
/// Histogram (seconds, OpenTelemetry): how long a transport send took,
/// whatever the outcome — one value per send (an operation that carries
/// several messages), labelled with each message type it carried.
pub const OPERATION_DURATION: &str = "messaging.client.operation.duration";
/// Histogram (messages): how many messages each claim returned (empty
/// claims included: a relay that keeps finding nothing shows zeros).
pub const CLAIM_SIZE: &str = "outbox.claim.size";

/// Gauge: pending messages (delivered or not yet, including those waiting
/// for a retry time or a lease).
pub const PENDING: &str = "outbox.pending";
/// Gauge: poisoned messages waiting for an operator.
pub const POISONED_NOW: &str = "outbox.poisoned";
/// Gauge (seconds): age of the oldest pending message; 0 when none is pending.
pub const OLDEST_PENDING_AGE: &str = "outbox.oldest_pending.age";
/// Gauge: 1 while the transport is up, 0 while it is down and probed
/// (recorded only by relays with a transport).
pub const TRANSPORT_UP: &str = "outbox.transport.up";

/// Describes every metric above (help text and unit) to the installed
/// recorder, so that e.g. a Prometheus scrape shows `# HELP` lines. Call it
/// once after installing the recorder; recording works without it.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        DELIVERED,
        Unit::Count,
        "Messages delivered: handler returned Ok, or the broker confirmed"
    );
    describe_counter!(
        FAILED,
        Unit::Count,
        "Counted delivery failures (handler error, panic, timeout, no handler, broker rejection), the poisoning one included"
    );
    describe_counter!(
        REJECTED,
        Unit::Count,
        "Integration messages rejected by the broker (also counted as failed)"
    );
    describe_counter!(
        POISONED,
        Unit::Count,
        "Messages poisoned by their last counted failure"
    );
    describe_counter!(
        RELEASED,
        Unit::Count,
        "Messages given back without counting an attempt (transport outage, handler temporarily unavailable)"
    );
    describe_histogram!(
        DELIVERY_LAG,
        Unit::Seconds,
        "From the commit that enqueued a message to its delivery"
    );
    describe_histogram!(
        PROCESS_DURATION,
        Unit::Seconds,
        "Duration of a domain message's handler run"
    );
    describe_histogram!(
        OPERATION_DURATION,
        Unit::Seconds,
        "Duration of the transport send that carried an integration message"
    );
    describe_histogram!(CLAIM_SIZE, Unit::Count, "Messages returned by one claim");
    describe_gauge!(PENDING, Unit::Count, "Pending messages");
    describe_gauge!(POISONED_NOW, Unit::Count, "Poisoned messages");
    describe_gauge!(
        OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest pending message (0 when none)"
    );
    describe_gauge!(
        TRANSPORT_UP,
        "1 while the relay's transport is up, 0 while it is down and probed"
    );
}

/// Bucket bounds (seconds) of the duration histograms ([`DELIVERY_LAG`],
/// [`PROCESS_DURATION`], [`OPERATION_DURATION`]) in
/// `prometheus_recorder` (feature `prometheus`): half a millisecond to an
/// hour, so that the milliseconds of a healthy relay and the minutes of an
/// outage both land in a bucket of their own.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0, 900.0, 3600.0,
];

/// Bucket bounds of [`CLAIM_SIZE`] in `prometheus_recorder` (feature
/// `prometheus`; messages).
pub const CLAIM_SIZE_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
];

/// A Prometheus exporter's builder set up by the conventions of its
/// ecosystem (feature `prometheus`): names as Prometheus recommends them
/// (`_total` on counters, the unit on durations: `outbox_messages_delivered_total`,
/// `outbox_delivery_lag_seconds`), and every histogram a true histogram
/// with buckets ([`SECONDS_BUCKETS`], [`CLAIM_SIZE_BUCKETS`]) — never a
/// summary, whose quantiles cannot be added up across the relays of many
/// machines. The dashboard and alert rules in the repository's `ops/` use
/// these names. Install it (or its recorder) **before building relays**,
/// then call [`describe`] for the help texts and units.
#[cfg(feature = "prometheus")]
pub fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let bucketed = |b: PrometheusBuilder, name: &str, buckets: &[f64]| {
        b.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
            .expect("the buckets are not empty")
    };
    let mut b = PrometheusBuilder::new()
        .with_recommended_naming(true)
        // Any other histogram (a consumer's, the application's own): seconds.
        .set_buckets(SECONDS_BUCKETS)
        .expect("the buckets are not empty");
    for name in [DELIVERY_LAG, PROCESS_DURATION, OPERATION_DURATION] {
        b = bucketed(b, name, SECONDS_BUCKETS);
    }
    bucketed(b, CLAIM_SIZE, CLAIM_SIZE_BUCKETS)
}

/// The recorder of [`prometheus_builder`], not installed (for
/// `metrics::with_local_recorder`, or to install yourself); its
/// `handle().render()` is the scrape.
#[cfg(feature = "prometheus")]
pub fn prometheus_recorder() -> metrics_exporter_prometheus::PrometheusRecorder {
    prometheus_builder().build_recorder()
}

/// Installs [`prometheus_builder`]'s recorder as the global one and
/// [`describe`]s every metric; serve `handle.render()` on your `/metrics`
/// route, and call `handle.run_upkeep()` now and then (every few seconds).
///
/// # Errors
/// When a global recorder is installed already.
#[cfg(feature = "prometheus")]
pub fn install_prometheus_recorder()
-> Result<metrics_exporter_prometheus::PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    let handle = prometheus_builder().install_recorder()?;
    describe();
    Ok(handle)
}
