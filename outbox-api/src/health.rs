//! Health of a relay and its outbox.

use std::time::Duration;

use crate::{Backlog, Timestamp};

/// What the outbox table alone says needs attention: poisoned messages
/// waiting for an operator, and a pending message older than `alert`.
/// Empty: healthy as far as the table goes; otherwise each is a reason to
/// be [`HealthStatus::Degraded`]. The one definition behind the relay's
/// health, the console's overview and `outbox health`.
pub fn backlog_reasons(backlog: &Backlog, alert: Duration, now: Timestamp) -> Vec<String> {
    let mut reasons = Vec::new();
    if backlog.poisoned > 0 {
        reasons.push(format!(
            "{} poisoned message(s) wait for an operator",
            backlog.poisoned
        ));
    }
    if let Some(oldest) = backlog.oldest_pending_created_at {
        let age = now.since(oldest);
        if age > alert {
            reasons.push(format!(
                "the oldest pending message is {} old (alert after {})",
                format_age(age),
                format_age(alert)
            ));
        }
    }
    reasons
}

/// An age as people read it, its two largest units: `850ms`, `42s`,
/// `3m 20s`, `5h`, `2d 3h`.
pub fn format_age(age: Duration) -> String {
    let secs = age.as_secs();
    if secs == 0 {
        return format!("{}ms", age.as_millis());
    }
    let parts = [
        (secs / 86_400, "d"),
        (secs % 86_400 / 3_600, "h"),
        (secs % 3_600 / 60, "m"),
        (secs % 60, "s"),
    ];
    let first = parts.iter().position(|(n, _)| *n > 0).unwrap_or(3);
    let mut out = format!("{}{}", parts[first].0, parts[first].1);
    if let Some((n, unit)) = parts.get(first + 1) {
        if *n > 0 {
            out.push_str(&format!(" {n}{unit}"));
        }
    }
    out
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_ages() {
        assert_eq!(format_age(Duration::from_millis(850)), "850ms");
        assert_eq!(format_age(Duration::from_secs(45)), "45s");
        assert_eq!(format_age(Duration::from_secs(312)), "5m 12s");
        assert_eq!(format_age(Duration::from_secs(3_600)), "1h");
        assert_eq!(
            format_age(Duration::from_secs(2 * 86_400 + 3 * 3_600)),
            "2d 3h"
        );
    }
}
