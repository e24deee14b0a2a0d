//! Relay configuration.

use std::time::Duration;

use outbox_api::{Error, Result, RetryPolicy};

/// The default [`RelayConfig::concurrency`].
pub(crate) const DEFAULT_CONCURRENCY: usize = 64;

/// Everything a relay can be told; every default is the one stated in
/// `docs/rules.md` (those of the system outbox-rs replaces, see
/// `docs/decisions.md#defaults-of-the-original-system`), and every field is
/// checked at `build()`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// The relay's identity, stored as `locked_by` (default: `relay-<pid>-<random>`).
    ///
    /// Give a relay a **stable** id (say, the host or pod name) and, when it
    /// restarts after a crash, it takes back the leases its previous process
    /// held at once instead of waiting for them to expire. A stable id must
    /// belong to one live relay at a time: a second live relay with the same
    /// id in the same process is refused at spawn; across processes that
    /// is the deployment's duty (a twin would take the live relay's leases
    /// at its start, causing duplicate deliveries — never a loss).
    pub worker_id: String,
    /// Longest sleep between claims when nothing wakes the relay (2 s).
    pub poll_interval: Duration,
    /// Messages claimed at once (20).
    pub batch_size: usize,
    /// Counted failures before a message is poisoned (5).
    pub max_attempts: u32,
    /// How long a claim holds (60 s); must exceed `handler_timeout`. A wave
    /// of a batch starts only if it can finish, within `handler_timeout`,
    /// before the lease ends; the rest of the batch goes back untouched and
    /// is claimed again under a fresh lease.
    pub lease: Duration,
    /// Longest one delivery may take (30 s): a domain handler that runs
    /// longer counts as failed; a transport send that gets no answer counts
    /// as an outage (not an attempt) and is sent again later.
    pub handler_timeout: Duration,
    /// Domain handlers run at once within a batch (64).
    pub concurrency: usize,
    /// When a failed message is tried again (`NextRound`: one poll interval later).
    pub retry_policy: RetryPolicy,
    /// Processed messages are purged after this long (7 days); `None` keeps them.
    pub retention: Option<Duration>,
    /// How often the purge runs (1 min). It runs in its own task beside
    /// the deliveries, so a long purge never delays them.
    pub purge_interval: Duration,
    /// Rows deleted per purge statement (500), so writers never wait long;
    /// between statements the purge rests four times as long as the last
    /// one took, so waiting writers get the database.
    pub purge_batch: usize,
    /// Health turns Degraded when a pending message is older than this (5 min).
    pub backlog_age_alert: Duration,
    /// First wait before probing a transport that went down (100 ms).
    pub probe_initial: Duration,
    /// Longest wait between probes (5 s).
    pub probe_max: Duration,
    /// Longest one probe may take (10 s); a probe that does not answer in
    /// time counts as "still down". Probes run in their own task, so they
    /// never delay domain deliveries.
    pub probe_timeout: Duration,
    /// First wait before retrying a message whose handler said it is
    /// temporarily unavailable (1 s); doubles with each such answer of the
    /// same message type in a row. Such retries never count an attempt.
    pub unavailable_initial: Duration,
    /// Longest wait before retrying a temporarily unavailable handler (60 s).
    pub unavailable_max: Duration,
    /// Wait after a store error before trying again (1 s).
    pub store_error_backoff: Duration,
    /// The outbox's name in metrics, the `outbox.name` label (`outbox`).
    /// Give each relay of a process its own (e.g. the module or table), so
    /// that their metrics stay apart; see [`crate::metrics`].
    pub name: String,
    /// How often the backlog gauges (`outbox.pending`, `outbox.poisoned`,
    /// `outbox.oldest_pending.age`) are read from the store (15 s), in a
    /// task of their own; `None` reads them only when
    /// [`health`](crate::Relay::health) is asked. The other metrics are
    /// recorded as things happen.
    pub metrics_interval: Option<Duration>,
    /// Which labels the per-message metrics carry (by outbox and message
    /// type; a [`Fleet`](crate::Fleet) sets its own, by default by outbox
    /// alone). See [`crate::metrics::MetricLabels`] for the choices and
    /// [`crate::metrics`] for how many series each makes.
    pub metric_labels: crate::metrics::MetricLabels,
    /// In a [`Fleet`](crate::Fleet): the slots this outbox takes per turn
    /// while the fleet's slots are scarce (1). An outbox of weight 3 gets
    /// three deliveries for every one of an outbox of weight 1 when both
    /// have backlogs, and a quiet outbox's fresh message waits for one turn
    /// per other busy outbox, so it waits for their weights added up. A
    /// weight above the fleet's `concurrency` counts as that. Its limit
    /// stays [`concurrency`](Self::concurrency). Changed while it runs by
    /// [`Fleet::set_weight`](crate::Fleet::set_weight).
    pub fleet_weight: u32,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            worker_id: format!("relay-{}-{:08x}", std::process::id(), fastrand::u32(..)),
            poll_interval: Duration::from_secs(2),
            batch_size: 20,
            max_attempts: 5,
            lease: Duration::from_secs(60),
            handler_timeout: Duration::from_secs(30),
            concurrency: DEFAULT_CONCURRENCY,
            retry_policy: RetryPolicy::NextRound,
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            purge_interval: Duration::from_secs(60),
            purge_batch: 500,
            backlog_age_alert: Duration::from_secs(300),
            probe_initial: Duration::from_millis(100),
            probe_max: Duration::from_secs(5),
            probe_timeout: Duration::from_secs(10),
            unavailable_initial: Duration::from_secs(1),
            unavailable_max: Duration::from_secs(60),
            store_error_backoff: Duration::from_secs(1),
            name: "outbox".to_owned(),
            metrics_interval: Some(Duration::from_secs(15)),
            metric_labels: crate::metrics::MetricLabels::OutboxAndType,
            fleet_weight: 1,
        }
    }
}

impl RelayConfig {
    /// Checks every field, naming the first that is wrong.
    pub fn validate(&self) -> Result<()> {
        let positive = |field: &str, d: Duration| {
            if d.is_zero() {
                Err(Error::config(field, "must be greater than zero"))
            } else {
                Ok(())
            }
        };
        if self.worker_id.trim().is_empty() {
            return Err(Error::config("worker_id", "must not be empty"));
        }
        if self.name.trim().is_empty() {
            return Err(Error::config("name", "must not be empty"));
        }
        if let Some(i) = self.metrics_interval {
            positive("metrics_interval", i)?;
        }
        positive("poll_interval", self.poll_interval)?;
        positive("lease", self.lease)?;
        positive("handler_timeout", self.handler_timeout)?;
        positive("purge_interval", self.purge_interval)?;
        positive("probe_initial", self.probe_initial)?;
        positive("probe_timeout", self.probe_timeout)?;
        positive("unavailable_initial", self.unavailable_initial)?;
        positive("store_error_backoff", self.store_error_backoff)?;
        if self.batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        if self.max_attempts == 0 {
            return Err(Error::config("max_attempts", "must be at least 1"));
        }
        if self.concurrency == 0 {
            return Err(Error::config("concurrency", "must be at least 1"));
        }
        if self.fleet_weight == 0 {
            return Err(Error::config("fleet_weight", "must be at least 1"));
        }
        if self.purge_batch == 0 {
            return Err(Error::config("purge_batch", "must be at least 1"));
        }
        if self.lease <= self.handler_timeout {
            return Err(Error::config(
                "lease",
                format!(
                    "({:?}) must be longer than `handler_timeout` ({:?}), or a slow handler's message could be taken by another relay while it runs",
                    self.lease, self.handler_timeout
                ),
            ));
        }
        if self.probe_max < self.probe_initial {
            return Err(Error::config(
                "probe_max",
                "must not be shorter than `probe_initial`",
            ));
        }
        if self.unavailable_max < self.unavailable_initial {
            return Err(Error::config(
                "unavailable_max",
                "must not be shorter than `unavailable_initial`",
            ));
        }
        if let Some(r) = self.retention {
            positive("retention", r)?;
        }
        self.retry_policy.validate()
    }
}
