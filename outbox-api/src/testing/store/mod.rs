//! Conformance of [`Store`](crate::Store) and [`OperatorStore`] implementations.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    ClaimRequest, ErrorKind, FailOutcome, Failure, ListQuery, Message, MessageId, MessageKind,
    MessageState, NewMessage, OperatorStore, Release, Timestamp,
};

mod operator;

pub use operator::{
    activity_counts_deliveries_failures_and_backlog, list_filters_by_trace,
    operator_list_get_retry_discard, purge_removes_old_processed_in_batches, stats_count_states,
};

/// A fresh, empty store plus the backend-specific way to enqueue into it.
#[async_trait]
pub trait StoreUnderTest: Send + Sync {
    /// The store (with operator functions).
    fn store(&self) -> Arc<dyn OperatorStore>;

    /// Enqueues `messages` in one application transaction and commits it;
    /// an error rolls the whole transaction back.
    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> crate::Result<Vec<MessageId>>;

    /// [`try_enqueue`](StoreUnderTest::try_enqueue), failing the test on error.
    async fn enqueue(&self, messages: Vec<NewMessage>) -> Vec<MessageId> {
        self.try_enqueue(messages)
            .await
            .expect("enqueue and commit")
    }

    /// Enqueues `messages` in one application transaction and rolls it back.
    async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>);
}

/// Expands to one `#[test]` per store contract clause; `$factory` is an
/// async fn (or closure) returning a fresh [`StoreUnderTest`].
#[macro_export]
macro_rules! store_conformance_tests {
    ($factory:expr) => {
        $crate::store_conformance_tests!(@each $factory;
            claims_in_commit_order, rolled_back_is_never_claimed, claim_respects_limit,
            leased_messages_are_not_claimed_twice, expired_lease_is_reclaimed,
            claim_honours_available_at, complete_marks_processed, fail_counts_and_reschedules,
            fail_poisons_at_max_attempts, fail_without_lease_changes_nothing,
            release_does_not_count, same_key_waits_for_predecessor, poison_parks_only_its_key,
            claim_filters_by_kind, stats_count_states, purge_removes_old_processed_in_batches,
            operator_list_get_retry_discard, list_filters_by_trace,
            activity_counts_deliveries_failures_and_backlog, commit_wakes_listener,
            concurrent_claims_never_overlap, message_fields_round_trip, duplicate_id_is_refused,
            complete_and_claim_completes_first);
    };
    (@each $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::testing::block_on(async {
                    let sut = ($factory)().await;
                    $crate::testing::store::$name(&sut).await;
                });
            }
        )*
    };
}

const LEASE: Duration = Duration::from_secs(30);

fn t0() -> Timestamp {
    Timestamp::now()
}

fn req(worker: &str, limit: usize, now: Timestamp) -> ClaimRequest {
    ClaimRequest {
        worker: worker.to_owned(),
        limit,
        lease: LEASE,
        now,
        kind: None,
    }
}

fn domain(n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Test", format!("{n}").into_bytes())
}

fn ids(messages: &[Message]) -> Vec<MessageId> {
    messages.iter().map(|m| m.id).collect()
}

fn failure(worker: &str, id: MessageId, now: Timestamp, max: u32) -> Failure {
    Failure {
        worker: worker.to_owned(),
        id,
        error: "handler said no".to_owned(),
        retry_at: now,
        max_attempts: max,
        now,
    }
}

async fn get(s: &dyn StoreUnderTest, id: MessageId) -> Message {
    s.store().get(id).await.unwrap().expect("message exists")
}

/// Committed messages are claimed oldest first, with a lease.
pub async fn claims_in_commit_order(s: &dyn StoreUnderTest) {
    let a = s.enqueue(vec![domain(1), domain(2)]).await;
    let b = s.enqueue(vec![domain(3)]).await;
    let now = t0().saturating_add(Duration::from_millis(1));
    let claimed = s.store().claim(&req("w1", 10, now)).await.unwrap();
    assert_eq!(ids(&claimed), [a, b].concat());
    for m in &claimed {
        assert_eq!(m.locked_by.as_deref(), Some("w1"));
        assert_eq!(m.locked_until, Some(now.saturating_add(LEASE)));
        assert_eq!(m.attempts, 0, "claiming does not count an attempt");
        assert_eq!(m.state, MessageState::Pending);
    }
}

/// A rolled-back enqueue is never visible.
pub async fn rolled_back_is_never_claimed(s: &dyn StoreUnderTest) {
    s.enqueue_rolled_back(vec![domain(1)]).await;
    let kept = s.enqueue(vec![domain(2)]).await;
    let claimed = s
        .store()
        .claim(&req("w", 10, t0().saturating_add(Duration::from_secs(1))))
        .await
        .unwrap();
    assert_eq!(ids(&claimed), kept);
    assert_eq!(s.store().stats().await.unwrap().pending, 1);
}

/// At most `limit` messages per claim.
pub async fn claim_respects_limit(s: &dyn StoreUnderTest) {
    let all = s.enqueue((0..5).map(domain).collect()).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    let first = s.store().claim(&req("w", 2, now)).await.unwrap();
    assert_eq!(ids(&first), all[..2]);
    let second = s.store().claim(&req("w", 2, now)).await.unwrap();
    assert_eq!(ids(&second), all[2..4]);
}

/// A leased message is not claimed again while its lease holds.
pub async fn leased_messages_are_not_claimed_twice(s: &dyn StoreUnderTest) {
    s.enqueue(vec![domain(1)]).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    assert_eq!(s.store().claim(&req("w1", 10, now)).await.unwrap().len(), 1);
    let later = now.saturating_add(LEASE - Duration::from_secs(1));
    assert!(
        s.store()
            .claim(&req("w2", 10, later))
            .await
            .unwrap()
            .is_empty()
    );
}

/// Once a lease expires another worker takes the message over.
pub async fn expired_lease_is_reclaimed(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1)]).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w1", 10, now)).await.unwrap();
    let after = now.saturating_add(LEASE + Duration::from_secs(1));
    let taken = s.store().claim(&req("w2", 10, after)).await.unwrap();
    assert_eq!(ids(&taken), id);
    assert_eq!(taken[0].locked_by.as_deref(), Some("w2"));
    // The first worker's late failure report must not clobber w2's lease.
    let outcome = s
        .store()
        .fail(&failure("w1", id[0], after, 5))
        .await
        .unwrap();
    assert_eq!(outcome, FailOutcome::LeaseLost);
    assert_eq!(get(s, id[0]).await.attempts, 0);
}

/// A delayed message is not claimable before `available_at`.
pub async fn claim_honours_available_at(s: &dyn StoreUnderTest) {
    let id = s
        .enqueue(vec![domain(1).delay(Duration::from_secs(60))])
        .await;
    let m = get(s, id[0]).await;
    assert!(
        s.store()
            .claim(&req(
                "w",
                10,
                m.available_at.saturating_sub(Duration::from_millis(1))
            ))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        ids(&s
            .store()
            .claim(&req("w", 10, m.available_at))
            .await
            .unwrap()),
        id
    );
}

/// Completing marks processed, is idempotent, and processed is never claimed.
pub async fn complete_marks_processed(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1), domain(2)]).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 10, now)).await.unwrap();
    s.store().complete(&id, now).await.unwrap();
    s.store().complete(&id, now).await.unwrap();
    for id in &id {
        let m = get(s, *id).await;
        assert_eq!(m.state, MessageState::Processed);
        assert_eq!(m.processed_at, Some(now));
        assert_eq!(m.locked_by, None);
    }
    let later = now.saturating_add(LEASE * 2);
    assert!(
        s.store()
            .claim(&req("w", 10, later))
            .await
            .unwrap()
            .is_empty()
    );
}

/// A failure counts one attempt, stores the error and reschedules.
pub async fn fail_counts_and_reschedules(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1)]).await[0];
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 10, now)).await.unwrap();
    let mut f = failure("w", id, now, 5);
    f.retry_at = now.saturating_add(Duration::from_secs(10));
    assert_eq!(
        s.store().fail(&f).await.unwrap(),
        FailOutcome::Retrying { attempts: 1 }
    );
    let m = get(s, id).await;
    assert_eq!((m.attempts, m.state), (1, MessageState::Pending));
    assert_eq!(m.last_error.as_deref(), Some("handler said no"));
    assert_eq!(m.locked_by, None, "the lease is released");
    assert!(
        s.store()
            .claim(&req("w", 10, now.saturating_add(Duration::from_secs(9))))
            .await
            .unwrap()
            .is_empty()
    );
    let again = s
        .store()
        .claim(&req("w", 10, now.saturating_add(Duration::from_secs(10))))
        .await
        .unwrap();
    assert_eq!(again[0].attempts, 1);
}

/// The failure that reaches `max_attempts` poisons; poison is never claimed.
pub async fn fail_poisons_at_max_attempts(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1)]).await[0];
    let mut now = t0().saturating_add(Duration::from_secs(1));
    for attempt in 1..=3u32 {
        assert_eq!(s.store().claim(&req("w", 10, now)).await.unwrap().len(), 1);
        let outcome = s.store().fail(&failure("w", id, now, 3)).await.unwrap();
        if attempt < 3 {
            assert_eq!(outcome, FailOutcome::Retrying { attempts: attempt });
        } else {
            assert_eq!(outcome, FailOutcome::Poisoned { attempts: 3 });
        }
        now = now.saturating_add(Duration::from_millis(1));
    }
    let m = get(s, id).await;
    assert_eq!((m.state, m.attempts), (MessageState::Poisoned, 3));
    assert_eq!(m.last_error.as_deref(), Some("handler said no"));
    assert!(
        s.store()
            .claim(&req("w", 10, now.saturating_add(LEASE * 10)))
            .await
            .unwrap()
            .is_empty()
    );
}

/// Failing or releasing a message the worker does not hold changes nothing.
pub async fn fail_without_lease_changes_nothing(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1)]).await[0];
    let now = t0().saturating_add(Duration::from_secs(1));
    assert_eq!(
        s.store().fail(&failure("w", id, now, 5)).await.unwrap(),
        FailOutcome::LeaseLost
    );
    s.store().claim(&req("w1", 10, now)).await.unwrap();
    s.store()
        .release(&Release {
            worker: "w2".into(),
            ids: vec![id],
            error: Some("x".into()),
            available_at: now,
        })
        .await
        .unwrap();
    let m = get(s, id).await;
    assert_eq!(
        (m.attempts, m.locked_by.as_deref(), m.last_error),
        (0, Some("w1"), None)
    );
    s.store().complete(&[id], now).await.unwrap();
    assert_eq!(
        s.store().fail(&failure("w1", id, now, 5)).await.unwrap(),
        FailOutcome::LeaseLost
    );
    assert_eq!(get(s, id).await.state, MessageState::Processed);
}

/// Releasing keeps attempts, records the outage error, and reschedules.
pub async fn release_does_not_count(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1)]).await[0];
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 10, now)).await.unwrap();
    let later = now.saturating_add(Duration::from_secs(5));
    s.store()
        .release(&Release {
            worker: "w".into(),
            ids: vec![id],
            error: Some("broker down".into()),
            available_at: later,
        })
        .await
        .unwrap();
    let m = get(s, id).await;
    assert_eq!(m.attempts, 0, "an outage never counts");
    assert_eq!(m.last_error.as_deref(), Some("broker down"));
    assert_eq!((m.locked_by, m.available_at), (None, later));
    assert!(
        s.store()
            .claim(&req("w", 10, now))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        s.store().claim(&req("w", 10, later)).await.unwrap().len(),
        1
    );
}

/// A later message of a key is not claimable while an earlier one is
/// leased elsewhere, delayed or failed-and-waiting; in one claim both come in order.
pub async fn same_key_waits_for_predecessor(s: &dyn StoreUnderTest) {
    let k = s
        .enqueue(vec![
            domain(1).key("k"),
            domain(2).key("k"),
            domain(3).key("other"),
        ])
        .await;
    let now = t0().saturating_add(Duration::from_secs(1));
    // One claim may take both, in order.
    let both = s.store().claim(&req("w1", 10, now)).await.unwrap();
    assert_eq!(ids(&both), k);
    s.store()
        .release(&Release {
            worker: "w1".into(),
            ids: k.clone(),
            error: None,
            available_at: now,
        })
        .await
        .unwrap();
    // Claiming only the first leaves the second blocked for other workers.
    assert_eq!(
        ids(&s.store().claim(&req("w1", 1, now)).await.unwrap()),
        k[..1]
    );
    let other = s.store().claim(&req("w2", 10, now)).await.unwrap();
    assert_eq!(
        ids(&other),
        k[2..],
        "k's second message waits behind its leased first"
    );
    // A failed first message (waiting for retry) still blocks its key.
    let mut f = failure("w1", k[0], now, 5);
    f.retry_at = now.saturating_add(Duration::from_secs(5));
    s.store().fail(&f).await.unwrap();
    assert!(
        s.store()
            .claim(&req("w2", 10, now))
            .await
            .unwrap()
            .is_empty()
    );
    let later = now.saturating_add(Duration::from_secs(5));
    let next = s.store().claim(&req("w2", 1, later)).await.unwrap();
    assert_eq!(ids(&next), k[..1]);
    s.store().complete(&k[..1], later).await.unwrap();
    assert_eq!(
        ids(&s.store().claim(&req("w2", 10, later)).await.unwrap()),
        k[1..2]
    );
}

/// A poisoned message parks the rest of its key only; discard unblocks it.
pub async fn poison_parks_only_its_key(s: &dyn StoreUnderTest) {
    let k = s
        .enqueue(vec![
            domain(1).key("bad"),
            domain(2).key("bad"),
            domain(3).key("good"),
            domain(4),
        ])
        .await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 1, now)).await.unwrap();
    assert_eq!(
        s.store().fail(&failure("w", k[0], now, 1)).await.unwrap(),
        FailOutcome::Poisoned { attempts: 1 }
    );
    let rest = s.store().claim(&req("w", 10, now)).await.unwrap();
    assert_eq!(ids(&rest), [k[2], k[3]], "only the poisoned key is parked");
    s.store().complete(&ids(&rest), now).await.unwrap();
    s.store().discard(k[0], "tester", now).await.unwrap();
    assert_eq!(
        ids(&s.store().claim(&req("w", 10, now)).await.unwrap()),
        [k[1]]
    );
}

/// A claim for one kind takes only that kind, and never skips a key's earlier message of the other kind.
pub async fn claim_filters_by_kind(s: &dyn StoreUnderTest) {
    let integ = NewMessage::new(MessageKind::Integration, "Out", b"{}".to_vec());
    let k = s
        .enqueue(vec![
            integ.clone(),
            domain(1),
            integ.key("k"),
            domain(2).key("k"),
        ])
        .await;
    let now = t0().saturating_add(Duration::from_secs(1));
    let mut r = req("w", 10, now);
    r.kind = Some(MessageKind::Domain);
    let claimed = s.store().claim(&r).await.unwrap();
    assert_eq!(
        ids(&claimed),
        [k[1]],
        "k's domain message waits behind its integration message"
    );
    r.kind = Some(MessageKind::Integration);
    assert_eq!(ids(&s.store().claim(&r).await.unwrap()), [k[0], k[2]]);
}

/// A commit wakes a listener at once (not after a poll interval).
pub async fn commit_wakes_listener(s: &dyn StoreUnderTest) {
    let mut listener = s.store().listen();
    // Drain anything already signalled.
    while listener.wait(Duration::from_millis(1)).await {}
    s.enqueue(vec![domain(1)]).await;
    assert!(
        listener.wait(Duration::from_secs(10)).await,
        "a commit must wake the relay"
    );
}

/// Claims racing from many tasks never return the same message twice.
pub async fn concurrent_claims_never_overlap(s: &dyn StoreUnderTest) {
    s.enqueue((0..200).map(domain).collect()).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let store = s.store();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let batch = store.claim(&req(&format!("w{w}"), 7, now)).await.unwrap();
                if batch.is_empty() {
                    return got;
                }
                got.extend(ids(&batch));
            }
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        for id in t.await.unwrap() {
            assert!(seen.insert(id), "message {id} claimed twice");
        }
    }
    assert_eq!(seen.len(), 200);
}

/// Every field of a message survives storage unchanged.
pub async fn message_fields_round_trip(s: &dyn StoreUnderTest) {
    let payload: Vec<u8> = (0..=255u8).collect();
    let m = NewMessage::new(MessageKind::Integration, "Shipped", payload.clone())
        .key("order-7")
        .destination("shop.events", "order.shipped")
        .header("x-tenant", "acme")
        .header("x-ünïcode", "välue ✓")
        .content_type("application/x-bytes")
        .trace_parent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    let id = s.enqueue(vec![m]).await[0];
    let got = get(s, id).await;
    assert_eq!(got.payload, payload);
    assert_eq!(got.kind, MessageKind::Integration);
    assert_eq!(got.message_type, "Shipped");
    assert_eq!(got.key.as_deref(), Some("order-7"));
    let dest = got.destination.unwrap();
    assert_eq!(
        (dest.exchange.as_str(), dest.routing_key.as_str()),
        ("shop.events", "order.shipped")
    );
    assert_eq!(
        got.headers.get("x-ünïcode").map(String::as_str),
        Some("välue ✓")
    );
    assert_eq!(got.headers.len(), 2);
    assert_eq!(got.content_type, "application/x-bytes");
    assert_eq!(
        got.trace_parent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(
        (got.state, got.attempts, got.last_error),
        (MessageState::Pending, 0, None)
    );
    assert!(got.created_at <= Timestamp::now());
}

/// Enqueuing an id that exists already fails and loses nothing.
pub async fn duplicate_id_is_refused(s: &dyn StoreUnderTest) {
    let id = s.enqueue(vec![domain(1)]).await[0];
    let err = s
        .try_enqueue(vec![domain(3), domain(2).with_id(id)])
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&id.to_string()),
        "the error names the id: {err}"
    );
    assert_eq!(
        s.store().stats().await.unwrap().pending,
        1,
        "the failed transaction wrote nothing"
    );
    assert_eq!(get(s, id).await.payload, b"1");
}

/// `complete_and_claim` completes, then claims: the claim sees the
/// completions (a completed message's key successor is claimable), leases
/// what it returns, and leaves the completed messages processed.
pub async fn complete_and_claim_completes_first(s: &dyn StoreUnderTest) {
    let k = s
        .enqueue(vec![
            domain(1).key("k"),
            domain(2).key("k"),
            domain(3).key("k"),
            domain(4),
        ])
        .await;
    let now = t0().saturating_add(Duration::from_secs(1));
    let first = s.store().claim(&req("w", 1, now)).await.unwrap();
    assert_eq!(ids(&first), k[..1]);
    let next = s
        .store()
        .complete_and_claim(&k[..1], now, &req("w", 2, now))
        .await
        .unwrap();
    assert_eq!(ids(&next), k[1..3], "the key's successors, in order");
    assert_eq!(get(s, k[0]).await.state, MessageState::Processed);
    for m in &next {
        let stored = get(s, m.id).await;
        assert_eq!(
            stored.locked_by.as_deref(),
            Some("w"),
            "leased by the claim"
        );
    }
    let rest = s
        .store()
        .complete_and_claim(&k[1..3], now, &req("other", 10, now))
        .await
        .unwrap();
    assert_eq!(ids(&rest), k[3..], "only what is left");
}
