//! `GET /health`: both relays' health (and the consumers', with RabbitMQ)
//! combined, worst wins.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use outbox::{HealthReport, HealthStatus, TransportHealth};
use serde::Serialize;

/// The JSON body of `GET /health`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ShopHealth {
    /// `healthy`, `degraded` or `unhealthy`: the worst of the parts.
    pub state: &'static str,
    /// Pending messages in both outboxes.
    pub pending: u64,
    /// Poisoned messages in both outboxes.
    pub poisoned: u64,
    /// Age of the oldest pending message of either outbox.
    pub oldest_pending_age_ms: Option<u64>,
    /// `up`, `down: <reason>` or `none`: the worst of both relays' transports.
    pub transport: String,
    /// `embedded` or `rabbitmq`.
    pub bus: &'static str,
    /// Why it is not healthy, each prefixed with the part it is about.
    pub reasons: Vec<String>,
    /// Each relay's own figures.
    pub modules: BTreeMap<&'static str, ModuleHealth>,
    #[serde(skip)]
    status: HealthStatus,
}

/// One relay's figures.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ModuleHealth {
    /// `healthy`, `degraded` or `unhealthy`.
    pub state: &'static str,
    /// Pending messages.
    pub pending: u64,
    /// Poisoned messages.
    pub poisoned: u64,
    /// Age of the oldest pending message.
    pub oldest_pending_age_ms: Option<u64>,
    /// The relay's transport.
    pub transport: String,
}

fn transport_text(t: &TransportHealth) -> String {
    match t {
        TransportHealth::None => "none".into(),
        TransportHealth::Up => "up".into(),
        TransportHealth::Down(reason) => format!("down: {reason}"),
    }
}

fn transport_rank(t: &TransportHealth) -> u8 {
    match t {
        TransportHealth::None => 0,
        TransportHealth::Up => 1,
        TransportHealth::Down(_) => 2,
    }
}

/// Combines the relays' reports and further findings (e.g. a consumer that
/// lost its connection) into one: the worst status wins, counts add up, the
/// oldest age is the largest.
pub fn combine(
    bus: &'static str,
    relays: Vec<(&'static str, HealthReport)>,
    findings: Vec<(HealthStatus, String)>,
) -> ShopHealth {
    let mut status = HealthStatus::Healthy;
    let mut reasons = Vec::new();
    let mut modules = BTreeMap::new();
    let (mut pending, mut poisoned, mut oldest) = (0, 0, None::<u64>);
    let mut transport = TransportHealth::None;
    for (name, r) in relays {
        status = status.max(r.status);
        pending += r.pending;
        poisoned += r.poisoned;
        let age = r
            .oldest_pending_age
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        oldest = oldest.max(age);
        reasons.extend(r.reasons.iter().map(|why| format!("{name}: {why}")));
        if transport_rank(&r.transport) > transport_rank(&transport) {
            transport = r.transport.clone();
        }
        modules.insert(
            name,
            ModuleHealth {
                state: r.status.as_str(),
                pending: r.pending,
                poisoned: r.poisoned,
                oldest_pending_age_ms: age,
                transport: transport_text(&r.transport),
            },
        );
    }
    for (s, why) in findings {
        status = status.max(s);
        reasons.push(why);
    }
    ShopHealth {
        state: status.as_str(),
        pending,
        poisoned,
        oldest_pending_age_ms: oldest,
        transport: transport_text(&transport),
        bus,
        reasons,
        modules,
        status,
    }
}

impl ShopHealth {
    /// The combined status.
    pub fn status(&self) -> HealthStatus {
        self.status
    }
}

/// The HTTP status of a health state: load balancers keep sending traffic
/// to a degraded shop (it still works), not to an unhealthy one.
pub fn status_code(status: HealthStatus) -> StatusCode {
    match status {
        HealthStatus::Healthy | HealthStatus::Degraded => StatusCode::OK,
        HealthStatus::Unhealthy => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn report(
        status: HealthStatus,
        pending: u64,
        age_ms: Option<u64>,
        t: TransportHealth,
    ) -> HealthReport {
        let reasons = if status == HealthStatus::Healthy {
            vec![]
        } else {
            vec!["something".into()]
        };
        HealthReport::new(status, status != HealthStatus::Unhealthy)
            .with_reasons(reasons)
            .with_backlog(pending, 0, age_ms.map(Duration::from_millis))
            .with_transport(t)
    }

    #[test]
    fn status_codes() {
        assert_eq!(status_code(HealthStatus::Healthy), StatusCode::OK);
        assert_eq!(status_code(HealthStatus::Degraded), StatusCode::OK);
        assert_eq!(
            status_code(HealthStatus::Unhealthy),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[test]
    fn worst_wins_and_counts_add_up() {
        let h = combine(
            "embedded",
            vec![
                (
                    "ordering",
                    report(HealthStatus::Healthy, 2, Some(10), TransportHealth::Up),
                ),
                (
                    "warehouse",
                    report(
                        HealthStatus::Degraded,
                        3,
                        Some(50),
                        TransportHealth::Down("gone".into()),
                    ),
                ),
            ],
            vec![],
        );
        assert_eq!(h.state, "degraded");
        assert_eq!(status_code(h.status()), StatusCode::OK);
        assert_eq!((h.pending, h.oldest_pending_age_ms), (5, Some(50)));
        assert_eq!(h.transport, "down: gone");
        assert_eq!(h.reasons, vec!["warehouse: something".to_owned()]);

        let h = combine(
            "rabbitmq",
            vec![(
                "ordering",
                report(HealthStatus::Healthy, 0, None, TransportHealth::Up),
            )],
            vec![(HealthStatus::Unhealthy, "consumer stopped".into())],
        );
        assert_eq!(h.state, "unhealthy");
        assert_eq!(status_code(h.status()), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.oldest_pending_age_ms, None);
        let json = serde_json::to_value(&h).unwrap();
        for field in [
            "state",
            "pending",
            "poisoned",
            "oldest_pending_age_ms",
            "transport",
        ] {
            assert!(json.get(field).is_some(), "{field} missing in {json}");
        }
    }
}
