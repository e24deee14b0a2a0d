//! Faults inside the relay's own parts: a probe that never answers, a
//! store that fails one record of a round, a relay task that dies.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::memory::MemoryStore;
use outbox::{
    ClaimRequest, ErrorKind, FailOutcome, Failure, Handlers, HealthStatus, Message, MessageId,
    MessageKind, MessageState, NewMessage, OperatorStore, Outcome, Relay, Release, Stats, Store,
    Timestamp, Transport, TransportHealth,
};

const DEADLINE: Duration = Duration::from_secs(20);

fn msg(kind: MessageKind, t: &str, n: usize) -> NewMessage {
    NewMessage::new(kind, t, n.to_string().into_bytes())
}

fn enqueue(store: &MemoryStore, messages: Vec<NewMessage>) -> Vec<MessageId> {
    let mut tx = store.begin();
    let ids = messages
        .into_iter()
        .map(|m| tx.enqueue(m).unwrap())
        .collect();
    tx.commit().unwrap();
    ids
}

fn ok_handlers(count: Arc<AtomicUsize>) -> Handlers {
    Handlers::new().on_message("Ok", move |_m: &Message| {
        count.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, std::io::Error>(()) }
    })
}

/// A broker whose sends fail and whose probe never returns.
#[derive(Debug, Default)]
struct Blackhole {
    probes: AtomicUsize,
}

#[async_trait]
impl Transport for Blackhole {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        vec![Outcome::Unavailable("connection refused".into()); batch.len()]
    }
    async fn probe(&self) -> Result<(), String> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

/// Domain deliveries never wait on a probe: with a transport whose probe
/// never returns, domain messages still flow, drains still end, and the
/// probe is cut off by its timeout and tried again.
#[tokio::test]
async fn a_probe_that_never_returns_holds_up_no_domain_message() {
    let store = MemoryStore::new();
    let transport = Arc::new(Blackhole::default());
    let count = Arc::new(AtomicUsize::new(0));
    let relay = Relay::builder(store.clone())
        .dispatcher(ok_handlers(count.clone()))
        .transport_shared(transport.clone())
        .probe_initial(Duration::from_millis(1))
        .probe_max(Duration::from_millis(5))
        .probe_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let out = enqueue(&store, vec![msg(MessageKind::Integration, "Out", 0)])[0];
    tokio::time::timeout(DEADLINE, relay.drain())
        .await
        .expect("the drain ends")
        .unwrap();
    assert!(matches!(
        relay.health().await.transport,
        TransportHealth::Down(_)
    ));
    for round in 0..5 {
        enqueue(&store, vec![msg(MessageKind::Domain, "Ok", round)]);
        tokio::time::timeout(DEADLINE, relay.drain())
            .await
            .expect("a drain never waits for the probe")
            .unwrap();
    }
    assert_eq!(count.load(Ordering::SeqCst), 5);
    outbox_api::testing::wait_until(
        "the hung probe is cut off and tried again",
        DEADLINE,
        || async { transport.probes.load(Ordering::SeqCst) >= 2 },
    )
    .await;
    let health = relay.health().await;
    assert!(
        health
            .reasons
            .iter()
            .any(|r| r.contains("probe did not answer")),
        "{health:?}"
    );
    let m = store.get(out).await.unwrap().unwrap();
    assert_eq!((m.state, m.attempts), (MessageState::Pending, 0));
}

/// A store whose `fail` errors while everything else works.
#[derive(Debug, Clone)]
struct FailCannotBeRecorded(MemoryStore);

#[async_trait]
impl Store for FailCannotBeRecorded {
    async fn claim(&self, r: &ClaimRequest) -> outbox::Result<Vec<Message>> {
        self.0.claim(r).await
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox::Result<()> {
        self.0.complete(ids, now).await
    }
    async fn fail(&self, _f: &Failure) -> outbox::Result<FailOutcome> {
        Err(outbox::Error::new(ErrorKind::Unavailable, "disk I/O error"))
    }
    async fn release(&self, r: &Release) -> outbox::Result<()> {
        self.0.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.0.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<Stats> {
        self.0.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.0.purge_processed(before, limit).await
    }
}

/// One settle step records everything it can: a failure that cannot be
/// recorded does not keep delivered messages from being marked processed
/// (they would be delivered again) nor the rest of its key from being
/// given back; the drain reports the error at the end.
#[tokio::test]
async fn a_record_that_fails_abandons_no_other() {
    let store = MemoryStore::new();
    let count = Arc::new(AtomicUsize::new(0));
    let handlers = ok_handlers(count.clone()).on_message("Fail", |_m: &Message| async {
        Err::<(), _>(std::io::Error::other("refused"))
    });
    let ids = enqueue(
        &store,
        vec![
            msg(MessageKind::Domain, "Ok", 0),
            msg(MessageKind::Domain, "Fail", 1).key("k"),
            msg(MessageKind::Domain, "Ok", 2).key("k"),
            msg(MessageKind::Domain, "Ok", 3),
        ],
    );
    let relay = Relay::builder(FailCannotBeRecorded(store.clone()))
        .dispatcher(handlers)
        .worker_id("settler".into())
        .build()
        .unwrap();
    let err = relay.drain().await.unwrap_err();
    assert!(err.to_string().contains("disk I/O error"), "{err}");
    let state = |i: usize| {
        let store = store.clone();
        let id = ids[i];
        async move { store.get(id).await.unwrap().unwrap() }
    };
    assert_eq!(state(0).await.state, MessageState::Processed);
    assert_eq!(state(3).await.state, MessageState::Processed);
    let later = state(2).await;
    assert_eq!(
        (later.state, later.attempts, later.locked_by),
        (MessageState::Pending, 0, None),
        "the key's later message was given back"
    );
    assert_eq!(count.load(Ordering::SeqCst), 2, "nothing delivered twice");
}

/// A store that panics on every claim once `armed`.
#[derive(Debug, Clone)]
struct PanicsOnClaim(MemoryStore, Arc<AtomicBool>);

#[async_trait]
impl Store for PanicsOnClaim {
    async fn claim(&self, r: &ClaimRequest) -> outbox::Result<Vec<Message>> {
        if self.1.load(Ordering::SeqCst) {
            panic!("{}claim blew up", outbox_api::testing::DELIBERATE);
        }
        self.0.claim(r).await
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox::Result<()> {
        self.0.complete(ids, now).await
    }
    async fn fail(&self, f: &Failure) -> outbox::Result<FailOutcome> {
        self.0.fail(f).await
    }
    async fn release(&self, r: &Release) -> outbox::Result<()> {
        self.0.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.0.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<Stats> {
        self.0.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.0.purge_processed(before, limit).await
    }
}

/// A relay task that dies is visible: health Unhealthy naming the panic,
/// `is_running` false, `until_idle` an error instead of a hang.
#[tokio::test]
async fn a_dead_relay_task_is_reported() {
    outbox_api::testing::quiet_deliberate_panics();
    let store = MemoryStore::new();
    let armed = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicUsize::new(0));
    let handle = Relay::builder(PanicsOnClaim(store.clone(), armed.clone()))
        .dispatcher(ok_handlers(count.clone()))
        .spawn()
        .unwrap();
    handle.until_idle().await.unwrap();
    assert_eq!(handle.health().await.status, HealthStatus::Healthy);
    armed.store(true, Ordering::SeqCst);
    enqueue(&store, vec![msg(MessageKind::Domain, "Ok", 0)]);
    let err = tokio::time::timeout(DEADLINE, handle.until_idle())
        .await
        .expect("until_idle does not hang on a dead relay")
        .unwrap_err();
    assert!(err.to_string().contains("claim blew up"), "{err}");
    assert!(!handle.is_running());
    let health = handle.health().await;
    assert_eq!(health.status, HealthStatus::Unhealthy);
    assert!(
        health.reasons[0].contains("panicked") && health.reasons[0].contains("claim blew up"),
        "{health:?}"
    );
}

/// A store whose claim riding with a completion, once `armed`, looks before
/// a commit that lands (and is announced) while the claim's round is still
/// on its way back — as a SQLite claim does whose snapshot predates the
/// commit.
#[derive(Debug, Clone)]
struct ClaimRacesACommit(MemoryStore, Arc<AtomicBool>);

impl ClaimRacesACommit {
    /// The claim, then (once) a commit announced before the round returns.
    async fn claim_then_commit(&self, claimed: Vec<Message>) -> outbox::Result<Vec<Message>> {
        if self.1.swap(false, Ordering::SeqCst) {
            enqueue(&self.0, vec![msg(MessageKind::Domain, "Ok", 1)]);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(claimed)
    }
}

#[async_trait]
impl Store for ClaimRacesACommit {
    async fn claim(&self, r: &ClaimRequest) -> outbox::Result<Vec<Message>> {
        self.0.claim(r).await
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox::Result<()> {
        self.0.complete(ids, now).await
    }
    /// Armed here only: the round that records a delivery and claims again
    /// is the one the relay listens for commits during.
    async fn complete_and_claim(
        &self,
        done: &[MessageId],
        now: Timestamp,
        next: &ClaimRequest,
    ) -> outbox::Result<Vec<Message>> {
        let claimed = self.0.complete_and_claim(done, now, next).await?;
        self.claim_then_commit(claimed).await
    }
    async fn fail(&self, f: &Failure) -> outbox::Result<FailOutcome> {
        self.0.fail(f).await
    }
    async fn release(&self, r: &Release) -> outbox::Result<()> {
        self.0.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.0.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<Stats> {
        self.0.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.0.purge_processed(before, limit).await
    }
    fn listen(&self) -> Box<dyn outbox::WorkListener> {
        self.0.listen()
    }
}

/// A commit announced while a claim is on its way back is not lost when
/// that claim comes back short: the relay claims again instead of sleeping
/// for `poll_interval` (rule "Wake-up" in `docs/rules.md`).
#[tokio::test]
async fn a_commit_announced_during_a_claim_is_not_lost() {
    let store = MemoryStore::new();
    let armed = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicUsize::new(0));
    let handle = Relay::builder(ClaimRacesACommit(store.clone(), armed.clone()))
        .dispatcher(ok_handlers(count.clone()))
        .poll_interval(Duration::from_secs(600))
        .spawn()
        .unwrap();
    handle.until_idle().await.unwrap();
    // The relay claims message 0, delivers it, and records it in a round
    // that claims again: that claim finds nothing, and message 1 commits
    // before the round is back.
    armed.store(true, Ordering::SeqCst);
    enqueue(&store, vec![msg(MessageKind::Domain, "Ok", 0)]);
    let start = std::time::Instant::now();
    while count.load(Ordering::SeqCst) < 2 && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        count.load(Ordering::SeqCst),
        2,
        "message 1 waited for the poll interval"
    );
    handle.shutdown().await;
}
