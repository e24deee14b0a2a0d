//! Upkeep beside the deliveries: the retention purge and health.

use outbox_api::{HealthReport, HealthStatus, Result, TransportHealth, backlog_reasons};

use super::{Relay, lock};

impl Relay {
    /// Deletes processed messages older than the retention, in small batches.
    pub async fn purge(&self) -> Result<u64> {
        let Some(retention) = self.inner.config.retention else {
            return Ok(0);
        };
        let before = self.now().saturating_sub(retention);
        let store = &self.inner.store;
        // Batches with rests between them: see `outbox_api::backend::purge_in_batches`.
        outbox_api::backend::purge_in_batches(
            self.inner.config.purge_batch,
            || self.stopping(),
            |limit| store.purge_processed(before, limit),
        )
        .await
    }

    /// Purges past retention every `purge_interval` until shutdown; runs
    /// beside the delivery loop, so a long purge never delays deliveries.
    pub(super) async fn purge_loop(self) {
        let mut shutdown = self.inner.lifecycle.stop_signal();
        while !*shutdown.borrow() {
            match self.purge().await {
                Ok(n) if n > 0 => {
                    tracing::info!(purged = n, "purged processed messages past retention")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "purge failed; will retry"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.inner.config.purge_interval) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Reads the backlog every `every` and records it in the gauges, until
    /// shutdown; in its own task, so a slow count never delays deliveries.
    pub(super) async fn gauge_loop(self, every: std::time::Duration) {
        let mut shutdown = self.inner.lifecycle.stop_signal();
        while !*shutdown.borrow() {
            match self.inner.store.backlog().await {
                Ok(b) => self.inner.meter.backlog(&b, self.now()),
                Err(e) => tracing::debug!(error = %e, "could not read the backlog for metrics"),
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// The relay's health (rule "Health" in `docs/rules.md`), also recorded
    /// in the backlog gauges (see [`crate::metrics`]): Unhealthy
    /// when the relay is not running (stopped, or its task died); Degraded
    /// on an old backlog, poison, a transport that is down, a handler that
    /// says it is temporarily unavailable, or a store error; else Healthy.
    pub async fn health(&self) -> HealthReport {
        let cfg = &self.inner.config;
        let mut reasons = Vec::new();
        let running = self.inner.lifecycle.is_running();
        let transport = self.inner.gate.health();
        let now = self.now();
        let (pending, poisoned, oldest) = match self.inner.store.backlog().await {
            Ok(s) => {
                self.inner.meter.backlog(&s, now);
                reasons.extend(backlog_reasons(&s, cfg.backlog_age_alert, now));
                (
                    s.pending,
                    s.poisoned,
                    s.oldest_pending_created_at.map(|t| now.since(t)),
                )
            }
            Err(e) => {
                reasons.push(format!("cannot read the outbox: {e}"));
                (0, 0, None)
            }
        };
        if let Some(e) = lock(&self.inner.last_store_error).clone() {
            reasons.push(format!("last store error: {e}"));
        }
        if let TransportHealth::Down(r) = &transport {
            reasons.push(format!("transport down: {r}"));
        }
        reasons.extend(self.inner.unavailable.reasons(now));
        let status = if !running {
            match self.inner.lifecycle.crash_reason() {
                Some(why) => reasons.insert(0, format!("relay is not running: {why}")),
                None => reasons.insert(0, "relay is not running".into()),
            }
            HealthStatus::Unhealthy
        } else if reasons.is_empty() {
            HealthStatus::Healthy
        } else {
            HealthStatus::Degraded
        };
        HealthReport::new(status, running)
            .with_reasons(reasons)
            .with_backlog(pending, poisoned, oldest)
            .with_transport(transport)
    }
}
