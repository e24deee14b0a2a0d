//! Recording the relay's metrics (names in `crate::metrics`).
//!
//! Handles are registered once — the gauges when the relay is built, the
//! per-type counters and histograms when the relay first meets a message
//! type — so that recording a delivery is a map lookup and a few atomic
//! operations, not a registry lookup per metric.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, SharedString, counter, gauge, histogram};
use outbox_api::{Backlog, Message, MessageKind, Timestamp};

use super::lock;
use crate::metrics as m;

/// One message type's handles.
pub(super) struct TypeMeter {
    kind: MessageKind,
    message_type: String,
    /// Whether [`m::MESSAGE_TYPE`] is a label (else one meter serves every
    /// type of the kind).
    by_type: bool,
    pub delivered: Counter,
    pub failed: Counter,
    pub rejected: Counter,
    pub poisoned: Counter,
    pub released_outage: Counter,
    pub released_unavailable: Counter,
    pub lag: Histogram,
    /// `messaging.process.duration` (domain) or
    /// `messaging.client.operation.duration` (integration).
    pub duration: Histogram,
}

impl TypeMeter {
    /// Whether these are the handles of `message`'s kind and type (of its
    /// kind alone when the type is not a label).
    pub(super) fn is(&self, message: &Message) -> bool {
        self.kind == message.kind && (!self.by_type || self.message_type == message.message_type)
    }
}

/// The relay's handles.
pub(super) struct Meter {
    outbox: SharedString,
    labels: m::MetricLabels,
    /// By message type: domain, integration.
    types: [Mutex<HashMap<String, Arc<TypeMeter>>>; 2],
    claim_size: Histogram,
    pending: Gauge,
    poisoned: Gauge,
    oldest_age: Gauge,
    transport_up: Option<Gauge>,
}

impl std::fmt::Debug for Meter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meter")
            .field("outbox", &self.outbox)
            .finish_non_exhaustive()
    }
}

impl Meter {
    /// Registers the relay's gauges with the recorder in force.
    pub(super) fn new(outbox: &str, labels: m::MetricLabels, has_transport: bool) -> Self {
        let outbox = SharedString::from(outbox.to_owned());
        let transport_up = has_transport.then(|| {
            let g = gauge!(m::TRANSPORT_UP, m::OUTBOX => outbox.clone());
            g.set(1.0);
            g
        });
        Meter {
            claim_size: histogram!(m::CLAIM_SIZE, m::OUTBOX => outbox.clone()),
            pending: gauge!(m::PENDING, m::OUTBOX => outbox.clone()),
            poisoned: gauge!(m::POISONED_NOW, m::OUTBOX => outbox.clone()),
            oldest_age: gauge!(m::OLDEST_PENDING_AGE, m::OUTBOX => outbox.clone()),
            transport_up,
            types: Default::default(),
            labels,
            outbox,
        }
    }

    /// The handles of `message`'s type (registered on first use).
    pub(super) fn of(&self, message: &Message) -> Arc<TypeMeter> {
        let (slot, kind) = match message.kind {
            MessageKind::Domain => (0, "domain"),
            MessageKind::Integration => (1, "integration"),
        };
        let by_type = self.labels == m::MetricLabels::OutboxAndType;
        let key = if by_type {
            message.message_type.as_str()
        } else {
            ""
        };
        let mut map = lock(&self.types[slot]);
        if let Some(t) = map.get(key) {
            return t.clone();
        }
        let t = Arc::new(self.register(message.kind, kind, &message.message_type, by_type));
        map.insert(key.to_owned(), t.clone());
        t
    }

    fn register(
        &self,
        k: MessageKind,
        kind: &'static str,
        message_type: &str,
        by_type: bool,
    ) -> TypeMeter {
        let outbox = self.outbox.clone();
        let ty = SharedString::from(message_type.to_owned());
        let labels = || {
            let mut l = vec![
                (m::OUTBOX, outbox.clone()),
                (m::MESSAGE_KIND, SharedString::const_str(kind)),
            ];
            if by_type {
                l.push((m::MESSAGE_TYPE, ty.clone()));
            }
            l
        };
        let counter_of = |name: &'static str| counter!(name, &labels());
        let released = |reason: &'static str| {
            let mut l = labels();
            l.push((m::RELEASE_REASON, SharedString::const_str(reason)));
            counter!(m::RELEASED, &l)
        };
        let domain = kind == "domain";
        let (op, duration_name) = if domain {
            ("process", m::PROCESS_DURATION)
        } else {
            ("send", m::OPERATION_DURATION)
        };
        let mut duration_labels = labels();
        duration_labels.push((m::OPERATION_NAME, SharedString::const_str(op)));
        duration_labels.push((m::OPERATION_TYPE, SharedString::const_str(op)));
        // Only what can happen to the kind is registered (a domain message
        // is never rejected by a broker, nor held back by an outage; an
        // integration message has no handler to be unavailable).
        TypeMeter {
            kind: k,
            message_type: message_type.to_owned(),
            by_type,
            delivered: counter_of(m::DELIVERED),
            failed: counter_of(m::FAILED),
            rejected: if domain {
                Counter::noop()
            } else {
                counter_of(m::REJECTED)
            },
            poisoned: counter_of(m::POISONED),
            released_outage: if domain {
                Counter::noop()
            } else {
                released("outage")
            },
            released_unavailable: if domain {
                released("handler_unavailable")
            } else {
                Counter::noop()
            },
            lag: histogram!(m::DELIVERY_LAG, &labels()),
            duration: histogram!(duration_name, &duration_labels),
        }
    }

    /// A claim returned `n` messages.
    pub(super) fn claimed(&self, n: usize) {
        self.claim_size.record(n as f64);
    }

    /// The backlog as last read.
    pub(super) fn backlog(&self, b: &Backlog, now: Timestamp) {
        self.pending.set(b.pending as f64);
        self.poisoned.set(b.poisoned as f64);
        let age = b
            .oldest_pending_created_at
            .map_or(Duration::ZERO, |t| now.since(t));
        self.oldest_age.set(age.as_secs_f64());
    }

    /// The transport went down (`false`) or came back (`true`).
    pub(super) fn transport(&self, up: bool) {
        if let Some(g) = &self.transport_up {
            g.set(if up { 1.0 } else { 0.0 });
        }
    }
}
