//! Health of a relay and its outbox.

use std::time::Duration;

/// Overall status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HealthStatus {
    /// Everything flows.
    Healthy,
    /// Working, but something needs attention (backlog age, poison, transport down).
    Degraded,
    /// The relay has stopped.
    Unhealthy,
}

impl HealthStatus {
    /// `"healthy"`, `"degraded"` or `"unhealthy"`.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthStatus::Healthy => "healthy",
            HealthStatus::Degraded => "degraded",
            HealthStatus::Unhealthy => "unhealthy",
        }
    }
}

/// State of the relay's transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportHealth {
    /// No transport configured.
    None,
    /// Sending works.
    Up,
    /// Paused after an outage; the reason of the last failure.
    Down(String),
}

/// A health report: the status and why.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct HealthReport {
    /// The overall status.
    pub status: HealthStatus,
    /// Human-readable reasons for anything but `Healthy`.
    pub reasons: Vec<String>,
    /// Pending messages.
    pub pending: u64,
    /// Poisoned messages.
    pub poisoned: u64,
    /// Age of the oldest pending message.
    pub oldest_pending_age: Option<Duration>,
    /// The transport's state.
    pub transport: TransportHealth,
    /// Whether the relay loop runs.
    pub relay_running: bool,
}

impl HealthReport {
    /// A report of `status` with no reasons, an empty backlog and no
    /// transport; fill it in with the `with_*` methods.
    pub fn new(status: HealthStatus, relay_running: bool) -> Self {
        HealthReport {
            status,
            reasons: Vec::new(),
            pending: 0,
            poisoned: 0,
            oldest_pending_age: None,
            transport: TransportHealth::None,
            relay_running,
        }
    }

    /// The reasons for anything but `Healthy`.
    pub fn with_reasons(mut self, reasons: Vec<String>) -> Self {
        self.reasons = reasons;
        self
    }

    /// The backlog: pending and poisoned counts, the oldest pending age.
    pub fn with_backlog(mut self, pending: u64, poisoned: u64, oldest: Option<Duration>) -> Self {
        self.pending = pending;
        self.poisoned = poisoned;
        self.oldest_pending_age = oldest;
        self
    }

    /// The transport's state.
    pub fn with_transport(mut self, transport: TransportHealth) -> Self {
        self.transport = transport;
        self
    }
}
