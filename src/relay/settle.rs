//! Settling: recording in the store what deliveries ended in.
//!
//! Whatever finished since the last store call is recorded together
//! (rule "Scheduling" in `docs/rules.md`): deliveries first, so nothing
//! delivered is delivered again because later bookkeeping failed; then
//! counted failures, deferrals and releases. An error on one record does
//! not abandon the others; the first error is returned after all were
//! tried.

use outbox_api::{
    ClaimRequest, Error, FailOutcome, Failure, Message, MessageId, Release, Result, Timestamp,
};

use super::{DrainReport, Relay};

/// What finished since the last store call and is not yet recorded.
#[derive(Debug, Default)]
pub(super) struct Settlement {
    /// Delivered: mark processed.
    pub done: Vec<MessageId>,
    /// A keyed message is among `done`: its completion may let the key's
    /// next message be claimed.
    pub keyed_done: bool,
    /// Counted failures, with their error.
    pub failed: Vec<(Message, String)>,
    /// Handler temporarily unavailable: give back until the given time.
    pub deferred: Vec<(MessageId, String, Timestamp)>,
    /// The transport was unavailable: give back with the outage noted.
    pub outage: Vec<MessageId>,
    /// The latest outage's reason.
    pub outage_reason: Option<String>,
    /// Claimed but not attempted (a key's earlier message did not get
    /// through, the lease was too short, shutdown): give back as they were.
    pub untouched: Vec<MessageId>,
}

impl Settlement {
    pub(super) fn is_empty(&self) -> bool {
        self.done.is_empty()
            && self.failed.is_empty()
            && self.deferred.is_empty()
            && self.outage.is_empty()
            && self.untouched.is_empty()
    }

    /// Whether recording it may make a message claimable: anything but
    /// unkeyed completions (a released or failed message, a keyed one's
    /// successor); nothing, when there is nothing to record.
    pub(super) fn frees(&self) -> bool {
        !self.is_empty() && (!self.only_done() || self.keyed_done)
    }

    /// Whether only deliveries are waiting (a claim may then ride along).
    fn only_done(&self) -> bool {
        !self.done.is_empty()
            && self.failed.is_empty()
            && self.deferred.is_empty()
            && self.outage.is_empty()
            && self.untouched.is_empty()
    }
}

/// What one store round did.
pub(super) struct Round {
    pub report: DrainReport,
    /// The claim's messages, if a claim was asked for and succeeded.
    pub claimed: Option<Vec<Message>>,
    /// The first error of the round.
    pub error: Option<Error>,
}

/// Logs a store error of a settle step and keeps the first.
fn note(first: &mut Option<Error>, e: Error, what: &str) {
    tracing::error!(error = %e, "{what}");
    first.get_or_insert(e);
}

impl Relay {
    /// Records `s`, then claims with `claim` if given: one store round. When
    /// only deliveries are waiting, the claim rides with their completion
    /// ([`Store::complete_and_claim`](outbox_api::Store::complete_and_claim)).
    pub(super) async fn settle_and_claim(
        &self,
        s: Settlement,
        claim: Option<ClaimRequest>,
    ) -> Round {
        let store = &self.inner.store;
        let mut report = DrainReport::default();
        let mut first_error: Option<Error> = None;
        let now = self.now();
        let mut claimed = None;
        let mut claim = claim;
        if s.only_done() && claim.is_some() {
            let request = claim.take().expect("checked");
            match store.complete_and_claim(&s.done, now, &request).await {
                Ok(messages) => {
                    report.delivered += s.done.len() as u64;
                    claimed = Some(messages);
                }
                // The claim may have taken the completion down with it (one
                // transaction): complete alone below, then claim alone.
                Err(e) => {
                    tracing::warn!(error = %e, "completing with the next claim failed; completing alone");
                    claim = Some(request);
                }
            }
        }
        if claimed.is_none() && !s.done.is_empty() {
            match store.complete(&s.done, now).await {
                Ok(()) => report.delivered += s.done.len() as u64,
                Err(e) => note(
                    &mut first_error,
                    e,
                    "could not mark delivered messages processed; they are delivered again after their lease",
                ),
            }
        }
        for (m, error) in &s.failed {
            if let Err(e) = self.record_failure(m, error, &mut report).await {
                note(
                    &mut first_error,
                    e,
                    "could not record a failed delivery; it is tried again after its lease",
                );
            }
        }
        for (id, error, until) in &s.deferred {
            let release = self.release_of(vec![*id], Some(error.clone()), *until);
            match store.release(&release).await {
                Ok(()) => {
                    report.deferred += 1;
                    self.put_off_until(*until);
                }
                Err(e) => note(
                    &mut first_error,
                    e,
                    "could not defer a message; it is tried again after its lease",
                ),
            }
        }
        if !s.outage.is_empty() {
            let error = s
                .outage_reason
                .as_ref()
                .map(|r| format!("transport unavailable: {r}"));
            let release = self.release_of(s.outage.clone(), error, now);
            match store.release(&release).await {
                Ok(()) => report.released += s.outage.len() as u64,
                Err(e) => note(
                    &mut first_error,
                    e,
                    "could not release messages after an outage; they wait for their lease",
                ),
            }
        }
        if !s.untouched.is_empty() {
            let release = self.release_of(s.untouched.clone(), None, now);
            match store.release(&release).await {
                Ok(()) => report.released += s.untouched.len() as u64,
                Err(e) => note(
                    &mut first_error,
                    e,
                    "could not release unattempted messages; they wait for their lease",
                ),
            }
        }
        if let Some(request) = claim.filter(|_| first_error.is_none()) {
            match store.claim(&request).await {
                Ok(messages) => claimed = Some(messages),
                Err(e) => note(&mut first_error, e, "could not claim"),
            }
        }
        // A claim that returned messages, by either path above.
        if claimed.as_ref().is_some_and(|m| !m.is_empty()) {
            report.batches += 1;
        }
        self.inner.counters.add(&report);
        Round {
            report,
            claimed,
            error: first_error,
        }
    }

    fn release_of(&self, ids: Vec<MessageId>, error: Option<String>, at: Timestamp) -> Release {
        Release::new(self.inner.config.worker_id.clone(), ids, at).with_error(error)
    }

    async fn record_failure(
        &self,
        m: &Message,
        error: &str,
        report: &mut DrainReport,
    ) -> Result<()> {
        let cfg = &self.inner.config;
        let now = self.now();
        let retry_at =
            now.saturating_add(cfg.retry_policy.delay(m.attempts + 1, cfg.poll_interval));
        let outcome = self
            .inner
            .store
            .fail(&Failure::new(
                cfg.worker_id.clone(),
                m.id,
                error.to_owned(),
                retry_at,
                cfg.max_attempts,
                now,
            ))
            .await?;
        match outcome {
            FailOutcome::Retrying { attempts } => {
                report.failed += 1;
                self.put_off_until(retry_at);
                tracing::warn!(message.id = %m.id, message.type = %m.message_type, attempts, %error, "delivery failed; will retry");
            }
            FailOutcome::Poisoned { attempts } => {
                report.poisoned += 1;
                self.inner.meter.of(m).poisoned.increment(1);
                tracing::error!(message.id = %m.id, message.type = %m.message_type, attempts, %error, "message poisoned after its last attempt; it waits for an operator");
            }
            FailOutcome::LeaseLost => {
                tracing::warn!(message.id = %m.id, "lease lost before the failure was recorded; another relay owns the message");
            }
        }
        Ok(())
    }
}
