//! Relay behaviour beyond the per-backend rules: tracing spans, integration
//! ordering under rejection, backoff policy.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::memory::{MemoryStore, MemoryTransport};
use outbox::{
    Handlers, ManualClock, MessageKind, MessageState, NewMessage, OperatorStore, Relay,
    RetryPolicy, Timestamp,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanRecord>>>);

/// A span's name and the fields recorded on it.
type SpanRecord = (String, Vec<(String, String)>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let mut fields = Vec::new();
        attrs.record(&mut Fields(&mut fields));
        self.0
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_owned(), fields));
    }
    fn on_record(&self, _id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut fields = Vec::new();
        values.record(&mut Fields(&mut fields));
        if let Some(last) = self.0.lock().unwrap().last_mut() {
            last.1.extend(fields);
        }
    }
}

#[tokio::test]
async fn one_span_per_delivery_carrying_the_traceparent() {
    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let store = MemoryStore::new();
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let mut tx = store.begin();
    let id = tx
        .enqueue(NewMessage::new(MessageKind::Domain, "Ok", b"1".to_vec()).trace_parent(tp))
        .unwrap();
    tx.commit().unwrap();
    let relay = Relay::builder(store.clone())
        .dispatcher(
            Handlers::new().on_message("Ok", |_m: &outbox::Message| async {
                Ok::<_, std::io::Error>(())
            }),
        )
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    let spans = spans.0.lock().unwrap();
    let deliveries: Vec<_> = spans
        .iter()
        .filter(|(name, _)| name == "outbox.deliver")
        .collect();
    assert_eq!(deliveries.len(), 1, "{spans:?}");
    let fields = &deliveries[0].1;
    let get = |k: &str| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get("trace_parent").as_deref(), Some(tp));
    assert_eq!(get("message.id"), Some(id.to_string()));
    assert_eq!(get("outcome").as_deref(), Some("delivered"));
}

#[tokio::test]
async fn integration_messages_of_a_key_stay_in_order_when_one_is_rejected() {
    let clock = Arc::new(ManualClock::new(Timestamp::now()));
    let store = MemoryStore::with_clock(clock.clone());
    let (t, h) = MemoryTransport::new();
    let mut tx = store.begin();
    let ids: Vec<_> = (0..6)
        .map(|n| {
            let key = if n % 2 == 0 { "even" } else { "odd" };
            let ty = if n == 2 { "Refused" } else { "Out" };
            tx.enqueue(NewMessage::new(MessageKind::Integration, ty, vec![n]).key(key))
                .unwrap()
        })
        .collect();
    tx.commit().unwrap();
    h.reject_type("Refused");
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .transport(t)
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    // "odd" flows; "even" stops at the rejected message, in order.
    assert_eq!(h.delivered_ids(), [ids[0], ids[1], ids[3], ids[5]]);
    assert_eq!(
        store.get(ids[4]).await.unwrap().unwrap().attempts,
        0,
        "held back, not attempted"
    );
    h.accept_all();
    clock.advance(Duration::from_secs(2));
    relay.drain().await.unwrap();
    assert_eq!(h.delivered_ids()[4..], [ids[2], ids[4]]);
    assert_eq!(store.get(ids[2]).await.unwrap().unwrap().attempts, 1);
    // Each transport batch held at most one message per key, in order.
    assert!(h.sends() >= 3);
}

#[tokio::test]
async fn exponential_backoff_spaces_out_retries() {
    let clock = Arc::new(ManualClock::new(Timestamp::now()));
    let store = MemoryStore::with_clock(clock.clone());
    let mut tx = store.begin();
    let id = tx
        .enqueue(NewMessage::new(MessageKind::Domain, "Fail", b"x".to_vec()))
        .unwrap();
    tx.commit().unwrap();
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(
            Handlers::new().on_message("Fail", |_m: &outbox::Message| async {
                Err::<(), _>(std::io::Error::other("no"))
            }),
        )
        .retry_policy(RetryPolicy::Exponential {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            multiplier: 3.0,
            jitter: 0.0,
        })
        .build()
        .unwrap();
    let mut waits = Vec::new();
    for _ in 0..3 {
        relay.drain().await.unwrap();
        let m = store.get(id).await.unwrap().unwrap();
        waits.push(m.available_at.since(Clock::now(&*clock)));
        clock.advance(*waits.last().unwrap());
    }
    assert_eq!(
        waits,
        [
            Duration::from_secs(10),
            Duration::from_secs(30),
            Duration::from_secs(60)
        ]
    );
    assert_eq!(
        store.get(id).await.unwrap().unwrap().state,
        MessageState::Pending
    );
}

use outbox::Clock;

/// A transport whose first send never answers (a broker that accepted the
/// connection and then went silent); later sends deliver.
#[derive(Debug, Default)]
struct SilentOnce {
    sends: std::sync::atomic::AtomicUsize,
    delivered: Mutex<Vec<outbox::MessageId>>,
}

#[async_trait::async_trait]
impl outbox::Transport for SilentOnce {
    async fn send(&self, batch: &[outbox::Message]) -> Vec<outbox::Outcome> {
        if self.sends.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            std::future::pending::<()>().await;
        }
        let mut delivered = self.delivered.lock().unwrap();
        delivered.extend(batch.iter().map(|m| m.id));
        vec![outbox::Outcome::Delivered; batch.len()]
    }
    async fn probe(&self) -> outbox::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_send_that_never_answers_times_out_uncounted_and_is_sent_again() {
    let store = MemoryStore::new();
    let mut tx = store.begin();
    let id = tx
        .enqueue(NewMessage::new(
            MessageKind::Integration,
            "Out",
            b"x".to_vec(),
        ))
        .unwrap();
    tx.commit().unwrap();
    let transport = Arc::new(SilentOnce::default());
    let handle = Relay::builder(store.clone())
        .transport_shared(transport.clone())
        .handler_timeout(Duration::from_millis(200))
        .lease(Duration::from_secs(5))
        .probe_initial(Duration::from_millis(1))
        .poll_interval(Duration::from_millis(50))
        .spawn()
        .unwrap();
    outbox_api::testing::wait_until("the message is processed", Duration::from_secs(20), || {
        let store = store.clone();
        async move { store.get(id).await.unwrap().unwrap().state == MessageState::Processed }
    })
    .await;
    let m = store.get(id).await.unwrap().unwrap();
    assert_eq!(
        m.attempts, 0,
        "a timed-out send is an outage, not an attempt"
    );
    assert!(
        m.last_error.as_deref().unwrap_or("").contains("timed out"),
        "{m:?}"
    );
    assert_eq!(*transport.delivered.lock().unwrap(), [id]);
    assert_eq!(transport.sends.load(std::sync::atomic::Ordering::SeqCst), 2);
    handle.shutdown().await;
}

/// A memory store whose purge waits for a gate: a purge that takes long.
#[derive(Debug, Clone)]
struct GatedPurge {
    inner: MemoryStore,
    gate: Arc<tokio::sync::Semaphore>,
    purges_started: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait::async_trait]
impl outbox::Store for GatedPurge {
    async fn claim(&self, r: &outbox::ClaimRequest) -> outbox::Result<Vec<outbox::Message>> {
        self.inner.claim(r).await
    }
    async fn complete(&self, ids: &[outbox::MessageId], now: Timestamp) -> outbox::Result<()> {
        self.inner.complete(ids, now).await
    }
    async fn fail(&self, f: &outbox::Failure) -> outbox::Result<outbox::FailOutcome> {
        self.inner.fail(f).await
    }
    async fn release(&self, r: &outbox::Release) -> outbox::Result<()> {
        self.inner.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.inner.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<outbox::Stats> {
        self.inner.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.purges_started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _permit = self.gate.acquire().await.unwrap();
        self.inner.purge_processed(before, limit).await
    }
    fn listen(&self) -> Box<dyn outbox::WorkListener> {
        self.inner.listen()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_purge_never_delays_deliveries() {
    let store = GatedPurge {
        inner: MemoryStore::new(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
        purges_started: Default::default(),
    };
    let delivered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let d = delivered.clone();
    let handle = Relay::builder(store.clone())
        .dispatcher(
            Handlers::new().on_message("Ok", move |_m: &outbox::Message| {
                d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<_, std::io::Error>(()) }
            }),
        )
        .retention(Some(Duration::from_millis(1)))
        .spawn()
        .unwrap();
    let started = store.purges_started.clone();
    outbox_api::testing::wait_until("the purge is running", Duration::from_secs(20), || {
        let n = started.load(std::sync::atomic::Ordering::SeqCst);
        async move { n >= 1 }
    })
    .await;
    let mut tx = store.inner.begin();
    tx.enqueue(NewMessage::new(MessageKind::Domain, "Ok", b"x".to_vec()))
        .unwrap();
    tx.commit().unwrap();
    outbox_api::testing::wait_until(
        "the message is delivered while the purge still runs",
        Duration::from_secs(20),
        || {
            let n = delivered.load(std::sync::atomic::Ordering::SeqCst);
            async move { n == 1 }
        },
    )
    .await;
    assert_eq!(
        store.gate.available_permits(),
        0,
        "the purge was still held"
    );
    store.gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(20), handle.shutdown())
        .await
        .expect("shutdown waits for the purge to finish its batch");
}

/// A memory store whose combined complete-and-claim always fails (say, the
/// claim hits a lock), while a plain completion works.
#[derive(Debug, Clone)]
struct FusedClaimFails(MemoryStore);

#[async_trait::async_trait]
impl outbox::Store for FusedClaimFails {
    async fn claim(&self, r: &outbox::ClaimRequest) -> outbox::Result<Vec<outbox::Message>> {
        self.0.claim(r).await
    }
    async fn complete(&self, ids: &[outbox::MessageId], now: Timestamp) -> outbox::Result<()> {
        self.0.complete(ids, now).await
    }
    async fn complete_and_claim(
        &self,
        _done: &[outbox::MessageId],
        _now: Timestamp,
        _next: &outbox::ClaimRequest,
    ) -> outbox::Result<Vec<outbox::Message>> {
        Err(outbox::Error::backend("the claim could not take the lock"))
    }
    async fn fail(&self, f: &outbox::Failure) -> outbox::Result<outbox::FailOutcome> {
        self.0.fail(f).await
    }
    async fn release(&self, r: &outbox::Release) -> outbox::Result<()> {
        self.0.release(r).await
    }
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.0.release_worker(worker).await
    }
    async fn stats(&self) -> outbox::Result<outbox::Stats> {
        self.0.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.0.purge_processed(before, limit).await
    }
}

#[tokio::test]
async fn delivered_messages_are_completed_even_when_the_next_claim_fails() {
    let store = MemoryStore::new();
    let mut tx = store.begin();
    let ids: Vec<_> = (0..3)
        .map(|n| {
            tx.enqueue(NewMessage::new(MessageKind::Domain, "Ok", vec![n]))
                .unwrap()
        })
        .collect();
    tx.commit().unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = calls.clone();
    let relay = Relay::builder(FusedClaimFails(store.clone()))
        .dispatcher(
            Handlers::new().on_message("Ok", move |_m: &outbox::Message| {
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<_, std::io::Error>(()) }
            }),
        )
        .build()
        .unwrap();
    let report = relay.drain().await.expect("the drain goes on");
    assert_eq!(report.delivered, 3);
    for id in ids {
        let m = store.get(id).await.unwrap().unwrap();
        assert_eq!((m.state, m.attempts), (MessageState::Processed, 0));
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "each handled once"
    );
}

/// A relay whose runtime is dropped (its task never ends: as a process
/// killed mid-run looks to this one) frees its worker id, so that a relay
/// started again under the same id in this process is not refused as a
/// twin.
#[test]
fn a_relay_dropped_with_its_runtime_frees_its_worker_id() {
    let store = MemoryStore::new();
    let id = format!("dropped-with-runtime-{}", std::process::id());
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let handle = first.block_on(async {
        Relay::builder(store.clone())
            .dispatcher(Handlers::new())
            .worker_id(id.clone())
            .spawn()
            .unwrap()
    });
    // Neither shut down nor dropped first: the runtime goes with the task.
    std::mem::forget(handle);
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let again = Relay::builder(store.clone())
            .dispatcher(Handlers::new())
            .worker_id(id.clone())
            .spawn()
            .expect("the id of a relay gone with its runtime is free again");
        let twin = Relay::builder(store)
            .dispatcher(Handlers::new())
            .worker_id(id)
            .spawn();
        assert!(twin.is_err(), "a live relay's id is still refused");
        again.shutdown().await;
    });
}

/// A relay that put a message off (a counted failure's retry, a deferral)
/// claims again when it comes due, not at its next poll: with a poll of an
/// hour, both come back within the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_put_off_is_claimed_when_it_comes_due_not_at_the_next_poll() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let (fail, defer) = (calls.clone(), calls.clone());
    let handlers = Handlers::new()
        .on_message("FailsOnce", move |_: &outbox::Message| {
            let first = fail.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err(std::io::Error::other("not yet"));
                }
                Ok(())
            }
        })
        .on_message("DefersOnce", move |_: &outbox::Message| {
            // The third call, the first of this type.
            let first = defer.fetch_add(1, Ordering::SeqCst) == 2;
            async move {
                if first {
                    return Err(outbox::TemporarilyUnavailable::new("back in a moment")
                        .retry_after(Duration::from_millis(50)));
                }
                Ok(())
            }
        });
    let handle = Relay::builder(store.clone())
        .dispatcher(handlers)
        .worker_id("put-off-and-due".into())
        .poll_interval(Duration::from_secs(3600))
        .retry_policy(RetryPolicy::Fixed(Duration::from_millis(50)))
        .spawn()
        .unwrap();
    for (n, t) in [(1, "FailsOnce"), (2, "DefersOnce")] {
        let mut tx = store.begin();
        tx.enqueue(NewMessage::new(MessageKind::Domain, t, b"x".to_vec()))
            .unwrap();
        tx.commit().unwrap();
        outbox_api::testing::wait_until(
            "the message put off is delivered when it comes due",
            Duration::from_secs(20),
            || async { handle.totals().delivered == n },
        )
        .await;
    }
    assert_eq!(handle.totals().delivered, 2);
    assert_eq!(calls.load(Ordering::SeqCst), 4, "each tried twice");
    handle.shutdown().await;
}
