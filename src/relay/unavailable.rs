//! Handlers that said "temporarily unavailable" (rule "Temporarily
//! unavailable" in `docs/rules.md`): per message type, since when, why and
//! how many uncounted retries in a row — which sets the backoff before the
//! next try and the reasons health gives.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use outbox_api::Timestamp;

use super::lock;

/// One message type whose handler said it is temporarily unavailable.
#[derive(Debug, Clone)]
struct Entry {
    since: Timestamp,
    reason: String,
    /// Uncounted retries in a row, for the backoff.
    streak: u32,
}

/// The message types whose handlers are temporarily unavailable.
#[derive(Debug)]
pub(super) struct HandlerUnavailability {
    by_type: Mutex<HashMap<String, Entry>>,
    initial: Duration,
    max: Duration,
}

impl HandlerUnavailability {
    /// A backoff from `initial`, doubling per answer in a row, capped at `max`.
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        HandlerUnavailability {
            by_type: Mutex::new(HashMap::new()),
            initial,
            max,
        }
    }

    /// The handler of `message_type` said it is unavailable (`reason`) at
    /// `now`: when its message is tried again — the handler's own delay if
    /// it gave one, else the backoff (up to a quarter less, so that many
    /// deferred messages spread out).
    pub(super) fn defer(
        &self,
        message_type: &str,
        reason: &str,
        requested: Option<Duration>,
        now: Timestamp,
    ) -> Timestamp {
        let mut map = lock(&self.by_type);
        let entry = map.entry(message_type.to_owned()).or_insert_with(|| Entry {
            since: now,
            reason: String::new(),
            streak: 0,
        });
        entry.reason = reason.to_owned();
        entry.streak = entry.streak.saturating_add(1);
        let delay = requested.unwrap_or_else(|| {
            let doubled = self
                .initial
                .saturating_mul(1u32 << (entry.streak - 1).min(16));
            doubled.min(self.max).mul_f64(1.0 - fastrand::f64() * 0.25)
        });
        now.saturating_add(delay)
    }

    /// A handler of `message_type` succeeded: it is available again.
    /// Returns whether it had been unavailable.
    pub(super) fn available(&self, message_type: &str) -> bool {
        let mut map = lock(&self.by_type);
        !map.is_empty() && map.remove(message_type).is_some()
    }

    /// The health reasons, one per unavailable type, sorted by type.
    pub(super) fn reasons(&self, now: Timestamp) -> Vec<String> {
        let map = lock(&self.by_type);
        let mut types: Vec<_> = map.iter().collect();
        types.sort_by(|a, b| a.0.cmp(b.0));
        types
            .into_iter()
            .map(|(message_type, u)| {
                format!(
                    "handler of `{message_type}` temporarily unavailable for {}s ({} uncounted retries): {}",
                    now.since(u.since).as_secs(),
                    u.streak,
                    u.reason
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_backoff_doubles_per_answer_in_a_row_with_jitter_and_is_capped() {
        let u = HandlerUnavailability::new(S, 8 * S);
        let t0 = Timestamp::from_millis(1_000_000);
        for (answer, full) in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 8), (9, 8)] {
            while lock(&u.by_type).get("Pay").map_or(0, |e| e.streak) + 1 < answer {
                u.defer("Pay", "503", None, t0);
            }
            let delay = u.defer("Pay", "503", None, t0).since(t0);
            let full = full * S;
            assert!(
                delay <= full && delay >= full.mul_f64(0.75),
                "answer {answer}: {delay:?} for {full:?}"
            );
        }
    }

    #[test]
    fn a_requested_delay_wins_and_success_clears_the_type_only() {
        let u = HandlerUnavailability::new(S, 60 * S);
        let t0 = Timestamp::from_millis(1_000_000);
        let until = u.defer("Pay", "503", Some(Duration::from_secs(7)), t0);
        assert_eq!(until, t0 + Duration::from_secs(7));
        u.defer("Ship", "down", None, t0);
        let reasons = u.reasons(t0 + Duration::from_secs(3));
        assert_eq!(reasons.len(), 2);
        assert!(
            reasons[0].starts_with(
                "handler of `Pay` temporarily unavailable for 3s (1 uncounted retries): 503"
            ),
            "{reasons:?}"
        );
        assert!(u.available("Pay"));
        assert!(!u.available("Pay"), "already available");
        assert_eq!(u.reasons(t0).len(), 1, "Ship is still unavailable");
        // A new outage of Pay starts its backoff over.
        let delay = u.defer("Pay", "503", None, t0).since(t0);
        assert!(delay <= S, "{delay:?}");
    }
}
