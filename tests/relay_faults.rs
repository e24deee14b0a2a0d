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
    Timestamp, Transport, TransportHealth, WorkListener,
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
    async fn probe(&self) -> outbox::Result<()> {
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

/// A memory store with one fault: `fail` errors, or (once armed) `claim`
/// panics.
#[derive(Debug, Clone)]
struct Faulty {
    inner: MemoryStore,
    fail_errors: bool,
    claim_panics: Arc<AtomicBool>,
}

impl Faulty {
    fn fail_errors(inner: MemoryStore) -> Self {
        Faulty {
            inner,
            fail_errors: true,
            claim_panics: Arc::default(),
        }
    }

    fn claim_panics(inner: MemoryStore, armed: Arc<AtomicBool>) -> Self {
        Faulty {
            inner,
            fail_errors: false,
            claim_panics: armed,
        }
    }
}

#[async_trait]
impl Store for Faulty {
    async fn claim(&self, r: &ClaimRequest) -> outbox::Result<Vec<Message>> {
        if self.claim_panics.load(Ordering::SeqCst) {
            panic!("{}claim blew up", outbox_api::testing::DELIBERATE);
        }
        self.inner.claim(r).await
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox::Result<()> {
        self.inner.complete(ids, now).await
    }
    async fn fail(&self, f: &Failure) -> outbox::Result<FailOutcome> {
        if self.fail_errors {
            return Err(outbox::Error::new(ErrorKind::Unavailable, "disk I/O error"));
        }
        self.inner.fail(f).await
    }
    async fn release(&self, r: &Release) -> outbox::Result<()> {
        self.inner.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.inner.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<Stats> {
        self.inner.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.inner.purge_processed(before, limit).await
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
    let relay = Relay::builder(Faulty::fail_errors(store.clone()))
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

/// A relay task that dies is visible: health Unhealthy naming the panic,
/// `is_running` false, `until_idle` an error instead of a hang.
#[tokio::test]
async fn a_dead_relay_task_is_reported() {
    outbox_api::testing::quiet_deliberate_panics();
    let store = MemoryStore::new();
    let armed = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicUsize::new(0));
    let handle = Relay::builder(Faulty::claim_panics(store.clone(), armed.clone()))
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

/// A memory store whose claims, once `armed`, take their snapshot and then
/// wait for `gate` before answering; its listener reports each wake-up it
/// hands out in `announced`.
#[derive(Debug, Clone)]
struct SlowClaims {
    inner: MemoryStore,
    armed: Arc<AtomicBool>,
    waiting: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Notify>,
    announced: Arc<AtomicUsize>,
    /// Claims asked for (alone or riding with completions).
    claims: Arc<AtomicUsize>,
}

/// A relay over `store` that only a commit wakes (its poll is an hour),
/// once it has found nothing to claim.
async fn idle_relay(store: &SlowClaims, handlers: Handlers) -> outbox::RelayHandle {
    let handle = Relay::builder(store.clone())
        .dispatcher(handlers)
        .poll_interval(Duration::from_secs(3600))
        .spawn()
        .unwrap();
    handle.until_idle().await.unwrap();
    handle
}

impl SlowClaims {
    /// Over `inner`, unarmed, nothing counted yet.
    fn over(inner: &MemoryStore) -> Self {
        SlowClaims {
            inner: inner.clone(),
            armed: Arc::default(),
            waiting: Arc::default(),
            gate: Arc::default(),
            announced: Arc::default(),
            claims: Arc::default(),
        }
    }

    async fn answer(&self, claimed: Vec<Message>) -> Vec<Message> {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.waiting.notify_one();
            self.gate.notified().await;
        }
        claimed
    }
}

struct CountingListener(Box<dyn WorkListener>, Arc<AtomicUsize>);

#[async_trait]
impl WorkListener for CountingListener {
    async fn wait(&mut self, timeout: Duration) -> bool {
        let changed = self.0.wait(timeout).await;
        if changed {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
        changed
    }
}

#[async_trait]
impl Store for SlowClaims {
    async fn claim(&self, r: &ClaimRequest) -> outbox::Result<Vec<Message>> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        let claimed = self.inner.claim(r).await?;
        Ok(self.answer(claimed).await)
    }
    async fn complete_and_claim(
        &self,
        done: &[MessageId],
        now: Timestamp,
        next: &ClaimRequest,
    ) -> outbox::Result<Vec<Message>> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        let claimed = self.inner.complete_and_claim(done, now, next).await?;
        Ok(self.answer(claimed).await)
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox::Result<()> {
        self.inner.complete(ids, now).await
    }
    async fn fail(&self, f: &Failure) -> outbox::Result<FailOutcome> {
        self.inner.fail(f).await
    }
    async fn release(&self, r: &Release) -> outbox::Result<()> {
        self.inner.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.inner.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<Stats> {
        self.inner.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.inner.purge_processed(before, limit).await
    }
    fn listen(&self) -> Box<dyn WorkListener> {
        Box::new(CountingListener(
            self.inner.listen(),
            self.announced.clone(),
        ))
    }
}

/// A commit announced while a claim is on its way (the claim took its
/// snapshot before the commit) is not lost: the relay claims again instead
/// of sleeping until its next poll. (And an unkeyed completion is not
/// followed by a claim of its own:
/// `an_unkeyed_completion_after_a_short_claim_waits_for_a_commit`.)
#[tokio::test]
async fn a_commit_announced_during_a_claim_is_not_lost() {
    let inner = MemoryStore::new();
    let store = SlowClaims::over(&inner);
    let count = Arc::new(AtomicUsize::new(0));
    // The claim that follows the first delivery is slow: the handler arms it.
    let (c, armed) = (count.clone(), store.armed.clone());
    let handlers = Handlers::new().on_message("Ok", move |_m: &Message| {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            armed.store(true, Ordering::SeqCst);
        }
        async { Ok::<_, std::io::Error>(()) }
    });
    let handle = idle_relay(&store, handlers).await;
    // Keyed: its completion may free the key's next message, so a claim
    // rides with it (an unkeyed completion is not followed by a claim).
    enqueue(&inner, vec![msg(MessageKind::Domain, "Ok", 1).key("k")]);
    tokio::time::timeout(DEADLINE, store.waiting.notified())
        .await
        .expect("the claim after the first delivery starts");
    let before = store.announced.load(Ordering::SeqCst);
    enqueue(&inner, vec![msg(MessageKind::Domain, "Ok", 2)]);
    outbox_api::testing::wait_until("the relay hears of the commit", DEADLINE, || async {
        store.announced.load(Ordering::SeqCst) > before
    })
    .await;
    store.gate.notify_one();
    outbox_api::testing::wait_until(
        "the second message is delivered without waiting for the poll",
        DEADLINE,
        || async { count.load(Ordering::SeqCst) == 2 },
    )
    .await;
    handle.shutdown().await;
}

/// After a claim that found less than it asked for, an unkeyed message's
/// completion is recorded alone: it can free no other message, so no claim
/// rides with it and the relay waits for the next commit. A keyed one's
/// can free the key's next message, so a claim rides with it. (A quiet
/// outbox's message costs one claim, not two.)
#[tokio::test]
async fn an_unkeyed_completion_after_a_short_claim_waits_for_a_commit() {
    let inner = MemoryStore::new();
    let store = SlowClaims::over(&inner);
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let handlers = Handlers::new().on_message("Ok", move |_m: &Message| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, std::io::Error>(()) }
    });
    let handle = idle_relay(&store, handlers).await;
    let mut claims_for = Vec::new();
    for (n, key) in [(1, None), (2, Some("k")), (3, None)] {
        let before = store.claims.load(Ordering::SeqCst);
        let mut m = msg(MessageKind::Domain, "Ok", n);
        if let Some(k) = key {
            m = m.key(k);
        }
        enqueue(&inner, vec![m]);
        outbox_api::testing::wait_until(
            "the message is delivered and completed",
            DEADLINE,
            || async {
                count.load(Ordering::SeqCst) == n && inner.stats().await.unwrap().pending == 0
            },
        )
        .await;
        // A claim riding with the completion is asked for before the
        // completion shows.
        claims_for.push(store.claims.load(Ordering::SeqCst) - before);
    }
    assert_eq!(
        claims_for,
        [1, 2, 1],
        "claims per message: unkeyed, keyed, unkeyed"
    );
    handle.shutdown().await;
}

/// A retry that comes due while a slow handler runs is claimed at the next
/// poll, not when the slow handler ends: nothing but a commit or a
/// completion would wake the relay otherwise.
#[tokio::test]
async fn a_retry_comes_due_while_a_slow_handler_runs() {
    let store = MemoryStore::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let tries = Arc::new(AtomicUsize::new(0));
    let (g, t) = (gate.clone(), tries.clone());
    let handlers = Handlers::new()
        .on_message("Stuck", move |_m: &Message| {
            let g = g.clone();
            async move {
                let _permit = g.acquire().await.unwrap();
                Ok::<_, std::io::Error>(())
            }
        })
        .on_message("FailOnce", move |_m: &Message| {
            let first = t.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err(std::io::Error::other("not yet"));
                }
                Ok(())
            }
        });
    let handle = Relay::builder(store.clone())
        .dispatcher(handlers)
        .poll_interval(Duration::from_millis(50))
        .retry_policy(outbox::RetryPolicy::Fixed(Duration::from_millis(100)))
        .spawn()
        .unwrap();
    let ids = enqueue(
        &store,
        vec![
            msg(MessageKind::Domain, "Stuck", 0),
            msg(MessageKind::Domain, "FailOnce", 1),
        ],
    );
    outbox_api::testing::wait_until(
        "the retry is delivered while the slow handler still runs",
        DEADLINE,
        || async { store.get(ids[1]).await.unwrap().unwrap().state == MessageState::Processed },
    )
    .await;
    assert_eq!(tries.load(Ordering::SeqCst), 2);
    assert_eq!(
        store.get(ids[0]).await.unwrap().unwrap().state,
        MessageState::Pending
    );
    gate.add_permits(1);
    handle.shutdown().await;
}
