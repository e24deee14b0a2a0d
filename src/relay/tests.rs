//! Unit tests of the scheduler's decisions (`schedule.rs`) against a store
//! that records every call the relay makes (the memory store underneath):
//! which claims it makes, what it gives back untouched, what it completes
//! and fails. The end-to-end rules run on every backend in `tests/`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{
    ClaimRequest, FailOutcome, Failure, Handlers, ManualClock, Message, MessageId, MessageKind,
    NewMessage, Release, Result, RetryPolicy, Stats, Store, Timestamp, WorkListener,
};
use outbox_memory::MemoryStore;
use tokio::sync::Semaphore;

use super::Relay;
use super::schedule::send_group_size;

/// One call the relay made to the store.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Claim {
        limit: usize,
        kind: Option<MessageKind>,
        got: usize,
    },
    Complete(Vec<MessageId>),
    Fail(MessageId),
    Release {
        ids: Vec<MessageId>,
        counted_error: bool,
    },
}

/// What runs before a claim returns (to move the clock, say).
type ClaimHook = Arc<Mutex<Option<Box<dyn FnMut() + Send>>>>;

/// The memory store, recording each call; `on_claim` runs before a claim
/// returns; a completion waits for a permit of `completions` if set.
#[derive(Clone)]
struct Recording {
    store: MemoryStore,
    calls: Arc<Mutex<Vec<Call>>>,
    on_claim: ClaimHook,
    completions: Option<Arc<Semaphore>>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recording")
    }
}

impl Recording {
    fn new(clock: &Arc<ManualClock>) -> Self {
        Recording {
            store: MemoryStore::with_clock(clock.clone()),
            calls: Arc::default(),
            on_claim: Arc::default(),
            completions: None,
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }

    async fn enqueue(&self, messages: Vec<NewMessage>) -> Vec<MessageId> {
        outbox_api::testing::StoreUnderTest::enqueue(&self.store, messages).await
    }

    /// Every id the relay gave back untouched, in order.
    fn released(&self) -> Vec<MessageId> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Release { ids, .. } => Some(ids),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn completed(&self) -> Vec<MessageId> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Complete(ids) => Some(ids),
                _ => None,
            })
            .flatten()
            .collect()
    }
}

#[async_trait]
impl Store for Recording {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        if let Some(hook) = self.on_claim.lock().unwrap().as_mut() {
            hook();
        }
        let got = self.store.claim(request).await?;
        self.record(Call::Claim {
            limit: request.limit,
            kind: request.kind,
            got: got.len(),
        });
        Ok(got)
    }

    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        self.record(Call::Complete(ids.to_vec()));
        if let Some(permits) = &self.completions {
            permits.acquire().await.unwrap().forget();
        }
        self.store.complete(ids, now).await
    }

    async fn fail(&self, failure: &Failure) -> Result<FailOutcome> {
        self.record(Call::Fail(failure.id));
        self.store.fail(failure).await
    }

    async fn release(&self, release: &Release) -> Result<()> {
        self.record(Call::Release {
            ids: release.ids.clone(),
            counted_error: release.error.is_some(),
        });
        self.store.release(release).await
    }

    async fn release_worker(&self, worker: &str) -> Result<u64> {
        self.store.release_worker(worker).await
    }

    async fn stats(&self) -> Result<Stats> {
        self.store.stats().await
    }

    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64> {
        self.store.purge_processed(before, limit).await
    }

    fn listen(&self) -> Box<dyn WorkListener> {
        self.store.listen()
    }
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(Timestamp::now()))
}

fn domain(message_type: &str, key: Option<&str>) -> NewMessage {
    let m = NewMessage::new(MessageKind::Domain, message_type, b"{}".to_vec());
    match key {
        Some(k) => m.key(k),
        None => m,
    }
}

/// A drain of `relay` in a task of its own.
fn spawn_drain(relay: &Relay) -> tokio::task::JoinHandle<Result<super::DrainReport>> {
    let relay = relay.clone();
    tokio::spawn(async move { relay.drain().await })
}

/// Handlers that record the order they ran in; type `Fail` always fails.
fn handlers(ran: &Arc<Mutex<Vec<MessageId>>>) -> Handlers {
    let (ok, failing) = (Arc::clone(ran), Arc::clone(ran));
    Handlers::new()
        .on_message("Ok", move |m: &Message| {
            ok.lock().unwrap().push(m.id);
            async { Ok::<(), std::io::Error>(()) }
        })
        .on_message("Fail", move |m: &Message| {
            failing.lock().unwrap().push(m.id);
            async { Err(std::io::Error::other("refused")) }
        })
}

#[tokio::test]
async fn a_failure_hands_back_the_rest_of_its_key_untouched_and_other_keys_go_on() {
    let clock = clock();
    let store = Recording::new(&clock);
    let ids = store
        .enqueue(vec![
            domain("Fail", Some("a")),
            domain("Ok", Some("a")),
            domain("Ok", Some("b")),
        ])
        .await;
    let ran = Arc::default();
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers(&ran))
        .retry_policy(RetryPolicy::Fixed(Duration::from_secs(3600)))
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();

    assert_eq!(
        *ran.lock().unwrap(),
        vec![ids[0], ids[2]],
        "a's second never ran"
    );
    assert!(store.calls().contains(&Call::Fail(ids[0])));
    assert_eq!(store.released(), vec![ids[1]], "given back, not failed");
    assert!(
        store.calls().iter().all(|c| !matches!(
            c,
            Call::Release {
                counted_error: true,
                ..
            }
        )),
        "a hand-back records no error: {:?}",
        store.calls()
    );
    assert_eq!(store.completed(), vec![ids[2]]);
    assert_eq!(
        (report.delivered, report.failed, report.released),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn a_delivery_that_cannot_end_before_its_lease_does_is_given_back_then_claimed_again() {
    let clock = clock();
    let store = Recording::new(&clock);
    let id = store.enqueue(vec![domain("Ok", None)]).await[0];
    let (lease, timeout) = (Duration::from_secs(60), Duration::from_secs(30));
    // The first claim takes so long that less than `handler_timeout` of
    // its lease is left when it returns.
    let (c, first) = (clock.clone(), Arc::new(AtomicUsize::new(0)));
    *store.on_claim.lock().unwrap() = Some(Box::new(move || {
        if first.fetch_add(1, Ordering::SeqCst) == 0 {
            c.advance(lease - timeout + Duration::from_secs(1));
        }
    }));
    let ran = Arc::default();
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers(&ran))
        .lease(lease)
        .handler_timeout(timeout)
        .build()
        .unwrap();
    relay.drain().await.unwrap();

    assert_eq!(
        *ran.lock().unwrap(),
        vec![id],
        "run once, on the second lease"
    );
    let calls = store.calls();
    let released = calls
        .iter()
        .position(|c| matches!(c, Call::Release { ids, counted_error: false } if ids == &vec![id]));
    let completed = calls.iter().position(|c| c == &Call::Complete(vec![id]));
    assert!(
        released.is_some() && released < completed,
        "given back untouched before it ran: {calls:?}"
    );
    assert!(
        !calls.iter().any(|c| matches!(c, Call::Fail(_))),
        "{calls:?}"
    );
}

#[tokio::test]
async fn claims_stop_once_a_batch_waits_beyond_the_deliveries_in_flight() {
    let clock = clock();
    let store = Recording::new(&clock);
    store
        .enqueue((0..20).map(|_| domain("Slow", None)).collect())
        .await;
    let gate = Arc::new(Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let (g, s) = (Arc::clone(&gate), Arc::clone(&started));
    let handlers = Handlers::new().on_message("Slow", move |_m: &Message| {
        let (g, s) = (Arc::clone(&g), Arc::clone(&s));
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            g.acquire().await.unwrap().forget();
            Ok::<(), std::io::Error>(())
        }
    });
    let (concurrency, batch) = (2, 3);
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers)
        .concurrency(concurrency)
        .batch_size(batch)
        .build()
        .unwrap();
    let drain = spawn_drain(&relay);
    outbox_api::testing::wait_until("both slots busy", Duration::from_secs(10), || {
        let n = started.load(Ordering::SeqCst);
        async move { n == concurrency }
    })
    .await;
    // Let any claim the scheduler wants to make go out.
    tokio::task::yield_now().await;
    let claimed = |store: &Recording| -> usize {
        store
            .calls()
            .iter()
            .map(|c| match c {
                Call::Claim { got, .. } => *got,
                _ => 0,
            })
            .sum()
    };
    outbox_api::testing::wait_until(
        "the scheduler has claimed what it wants while blocked",
        Duration::from_secs(10),
        || {
            let n = claimed(&store);
            async move { n > concurrency }
        },
    )
    .await;
    // A claim goes out only while fewer than a batch wait for a slot, so
    // at most `batch - 1` waited when the last one went out.
    let held = claimed(&store);
    assert!(
        held <= concurrency + (batch - 1) + batch,
        "{held} claimed with {concurrency} in flight and batches of {batch}"
    );
    assert!(
        store
            .calls()
            .iter()
            .all(|c| !matches!(c, Call::Claim { limit, .. } if *limit != batch))
    );
    gate.add_permits(20);
    let report = drain.await.unwrap().unwrap();
    assert_eq!(report.delivered, 20);
}

#[tokio::test]
async fn the_next_batch_is_claimed_and_delivered_while_a_round_records_completions() {
    let clock = clock();
    let completions = Arc::new(Semaphore::new(0));
    let store = Recording {
        completions: Some(Arc::clone(&completions)),
        ..Recording::new(&clock)
    };
    let batch = 3;
    store
        .enqueue((0..3 * batch).map(|_| domain("Ok", None)).collect())
        .await;
    let ran = Arc::new(Mutex::new(Vec::new()));
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers(&ran))
        .batch_size(batch)
        .build()
        .unwrap();
    let drain = spawn_drain(&relay);
    // Completions are held: the round recording the first batch's stays in
    // flight, and the next batch is claimed and delivered beside it.
    outbox_api::testing::wait_until(
        "the second batch delivered while the first one's completion is held",
        Duration::from_secs(10),
        || {
            let n = ran.lock().unwrap().len();
            async move { n >= 2 * batch }
        },
    )
    .await;
    completions.add_permits(100);
    let report = drain.await.unwrap().unwrap();
    assert_eq!(report.delivered, 3 * batch as u64);
    let mut completed = store.completed();
    completed.sort();
    let mut delivered = ran.lock().unwrap().clone();
    delivered.sort();
    assert_eq!(completed, delivered, "each delivery completed once");
}

#[tokio::test]
async fn without_a_transport_only_domain_messages_are_claimed() {
    let clock = clock();
    let store = Recording::new(&clock);
    store
        .enqueue(vec![
            domain("Ok", None),
            NewMessage::new(MessageKind::Integration, "Out", b"{}".to_vec()),
        ])
        .await;
    let ran = Arc::default();
    let relay = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers(&ran))
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.delivered, 1);
    let calls = store.calls();
    assert!(
        calls
            .iter()
            .filter(|c| matches!(c, Call::Claim { .. }))
            .all(|c| matches!(
                c,
                Call::Claim {
                    kind: Some(MessageKind::Domain),
                    ..
                }
            )),
        "{calls:?}"
    );
    assert_eq!(
        store.stats().await.unwrap().pending,
        1,
        "the integration message waits"
    );
}

#[test]
fn sends_carry_a_quarter_of_the_window() {
    assert_eq!(send_group_size(1), 1);
    assert_eq!(send_group_size(4), 1);
    assert_eq!(send_group_size(5), 2);
    assert_eq!(send_group_size(64), 16);
}

#[tokio::test]
async fn a_running_relay_counts_its_batches_and_a_stopped_one_says_so() {
    let clock = clock();
    let store = Recording::new(&clock);
    store
        .enqueue(vec![domain("Ok", None), domain("Ok", None)])
        .await;
    let ran = Arc::default();
    let handle = Relay::builder(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers(&ran))
        .spawn()
        .unwrap();
    handle.until_idle().await.unwrap();
    let totals = handle.totals();
    assert_eq!(totals.delivered, 2);
    assert!(totals.batches >= 1, "{totals:?}");
    handle.shutdown().await;
    let e = handle.until_idle().await.unwrap_err();
    assert_eq!(e.kind(), outbox_api::ErrorKind::Stopped, "{e}");
}
