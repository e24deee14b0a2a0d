//! The transport gate: whether integration messages may go out now, and
//! the probe task that reopens it after an outage.
//!
//! The probe runs in its own task, each probe bounded by `probe_timeout`,
//! so neither a slow connect nor a probe that never returns delays a
//! domain delivery or a claim (rule "Outage" in `docs/rules.md`).

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, Weak};

use futures_util::FutureExt;
use outbox_api::{TransportHealth, panic_message};

use super::{Inner, Relay, lock};

#[derive(Debug)]
struct GateState {
    health: TransportHealth,
    /// Whether a probe task is running.
    probing: bool,
}

/// The transport's state as the relay sees it.
#[derive(Debug)]
pub(super) struct Gate {
    state: Mutex<GateState>,
}

impl Gate {
    pub(super) fn new(has_transport: bool) -> Self {
        Gate {
            state: Mutex::new(GateState {
                health: if has_transport {
                    TransportHealth::Up
                } else {
                    TransportHealth::None
                },
                probing: false,
            }),
        }
    }

    /// Whether integration messages may be sent now.
    pub(super) fn is_up(&self) -> bool {
        matches!(lock(&self.state).health, TransportHealth::Up)
    }

    /// The transport's health for reports.
    pub(super) fn health(&self) -> TransportHealth {
        lock(&self.state).health.clone()
    }

    /// A send met an outage: closed with `reason`. Returns whether a probe
    /// task must start (none runs yet).
    fn went_down(&self, reason: String) -> bool {
        let mut st = lock(&self.state);
        if matches!(st.health, TransportHealth::Up) {
            tracing::warn!(%reason, "transport unavailable; integration messages wait while it is probed");
        }
        st.health = TransportHealth::Down(reason);
        !std::mem::replace(&mut st.probing, true)
    }

    /// A probe failed with `reason`: still closed, still probing.
    fn probe_failed(&self, reason: String) {
        lock(&self.state).health = TransportHealth::Down(reason);
    }

    /// A probe succeeded: open again, the probe task ends.
    fn reopened(&self) {
        let mut st = lock(&self.state);
        tracing::info!("transport is back; integration messages flow again");
        st.health = TransportHealth::Up;
        st.probing = false;
    }

    /// The probe task ends without reopening (shutdown).
    fn stopped_probing(&self) {
        lock(&self.state).probing = false;
    }
}

impl Relay {
    /// Pauses the transport after an outage and starts probing it (once).
    pub(super) fn transport_went_down(&self, reason: String) {
        let start_probe = self.inner.gate.went_down(reason);
        self.inner.meter.transport(false);
        if start_probe {
            tokio::spawn(probe_loop(Arc::downgrade(&self.inner)));
        }
    }
}

/// Probes a paused transport with growing pauses until it is back (then
/// wakes the relay), the relay is dropped, or shutdown is requested.
async fn probe_loop(relay: Weak<Inner>) {
    let Some(first) = relay.upgrade().map(|r| r.config.probe_initial) else {
        return;
    };
    let mut pause = first;
    loop {
        tokio::time::sleep(pause).await;
        let Some(inner) = relay.upgrade() else { return };
        let Some(transport) = inner.transport.clone() else {
            return;
        };
        if inner.lifecycle.stop_requested() {
            inner.gate.stopped_probing();
            return;
        }
        let limit = inner.config.probe_timeout;
        let result =
            tokio::time::timeout(limit, AssertUnwindSafe(transport.probe()).catch_unwind()).await;
        let down = match result {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(e))) => Some(e.message().to_owned()),
            Ok(Err(panic)) => Some(format!("probe panicked: {}", panic_message(&*panic))),
            Err(_) => Some(format!("probe did not answer within {limit:?}")),
        };
        match down {
            None => {
                inner.gate.reopened();
                inner.meter.transport(true);
                inner.wake.notify_one();
                return;
            }
            Some(reason) => {
                inner.gate.probe_failed(reason);
                pause = (pause * 2).min(inner.config.probe_max);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_closes_the_gate_and_starts_one_probe_until_it_reopens() {
        let gate = Gate::new(true);
        assert!(gate.is_up());
        assert!(
            gate.went_down("connection reset".into()),
            "the first outage starts a probe"
        );
        assert!(!gate.is_up());
        assert!(!gate.went_down("again".into()), "one probe at a time");
        gate.probe_failed("refused".into());
        assert_eq!(gate.health(), TransportHealth::Down("refused".into()));
        gate.reopened();
        assert!(gate.is_up());
        assert!(
            gate.went_down("later".into()),
            "after reopening, a new outage probes again"
        );
        gate.stopped_probing();
        assert!(gate.went_down("after shutdown".into()));
        assert_eq!(Gate::new(false).health(), TransportHealth::None);
    }
}
