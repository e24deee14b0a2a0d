//! The relay rules of `docs/rules.md`, one test body per rule, run against
//! every backend by `semantics_tests!`. Time that matters to a rule (leases,
//! retries, backlog age) comes from a `ManualClock`; waits on a running
//! relay use generous deadlines on conditions, never fixed sleeps.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::memory::{MemoryTransport, MemoryTransportHandle};
use outbox::{
    ClaimRequest, Fleet, Handlers, HealthStatus, ManualClock, Message, MessageId, MessageKind,
    MessageState, NewMessage, Relay, RelayBuilder, Timestamp, TransportHealth,
};
use outbox_api::testing::StoreUnderTest;

pub type Fixture = Box<dyn StoreUnderTest>;

/// A fixture maker: a fresh store whose enqueue times come from `clock`.
pub trait Backend {
    fn fresh(clock: Arc<ManualClock>) -> impl std::future::Future<Output = Fixture>;
}

pub const DEADLINE: Duration = Duration::from_secs(20);

pub fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(Timestamp::now()))
}

pub fn dmsg(t: &str, n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, t, n.to_string().into_bytes())
}

pub fn imsg(t: &str, n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Integration, t, n.to_string().into_bytes())
}

/// Records every delivery: (message_type, payload text) in order.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<(String, String, MessageId)>>>);

impl Log {
    pub fn push(&self, m: &Message) {
        self.0.lock().unwrap().push((
            m.message_type.clone(),
            String::from_utf8_lossy(&m.payload).into_owned(),
            m.id,
        ));
    }
    pub fn payloads(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|e| e.1.clone()).collect()
    }
    pub fn ids(&self) -> Vec<MessageId> {
        self.0.lock().unwrap().iter().map(|e| e.2).collect()
    }
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Handlers: "Ok" succeeds, "Fail" errors, "Panic" panics, "Slow" sleeps
/// past any test timeout; every call is logged first.
pub fn handlers(log: &Log) -> Handlers {
    let (a, b, c, d) = (log.clone(), log.clone(), log.clone(), log.clone());
    Handlers::new()
        .on_message("Ok", move |m: &Message| {
            a.push(m);
            async { Ok::<_, std::io::Error>(()) }
        })
        .on_message("Fail", move |m: &Message| {
            b.push(m);
            async { Err(std::io::Error::other("the handler refused it")) }
        })
        .on_message("Panic", move |m: &Message| {
            c.push(m);
            async {
                if true {
                    panic!("{}handler blew up", outbox_api::testing::DELIBERATE);
                }
                Ok::<_, std::io::Error>(())
            }
        })
        .on_message("Slow", move |m: &Message| {
            d.push(m);
            async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<_, std::io::Error>(())
            }
        })
}

/// A worker id no other test of this process uses (a live id is refused).
pub fn worker_id(name: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("{name}-{}", NEXT.fetch_add(1, Ordering::SeqCst))
}

tokio::task_local! {
    /// The fleet every relay of a rule joins, when the rule runs in one
    /// (`semantics_tests!(Backend, in_a_fleet)`).
    static FLEET: Fleet;
}

/// A relay over the fixture's store; in a fleet when the rule runs in one.
pub fn builder(f: &Fixture) -> RelayBuilder {
    let builder = Relay::builder_shared(f.store());
    match FLEET.try_with(Fleet::clone) {
        Ok(fleet) => builder.fleet(&fleet),
        Err(_) => builder,
    }
}

/// Runs a rule as it is written: its relays alone.
pub async fn alone<F: std::future::Future>(rule: F) -> F::Output {
    rule.await
}

/// Runs a rule with its relays in a fleet of 4 slots whose other outbox
/// has a deep backlog of slow deliveries (20 ms each, up to 2 at a time):
/// every rule holds for an outbox that shares its slots.
pub async fn in_a_fleet<F: std::future::Future>(rule: F) -> F::Output {
    let fleet = Fleet::builder()
        .concurrency(4)
        .worker_id(worker_id("fleet"))
        .build()
        .unwrap();
    let neighbour = outbox::memory::MemoryStore::new();
    let mut tx = neighbour.begin();
    for n in 0..10_000 {
        tx.enqueue(dmsg("Busy", n)).unwrap();
    }
    tx.commit().unwrap();
    let delivered = Arc::new(AtomicUsize::new(0));
    let counted = delivered.clone();
    let busy = Handlers::new().on_message("Busy", move |_: &Message| {
        counted.fetch_add(1, Ordering::Relaxed);
        async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, std::io::Error>(())
        }
    });
    fleet
        .add(
            "neighbour",
            Relay::builder(neighbour).dispatcher(busy).concurrency(2),
        )
        .unwrap();
    wait_until("the neighbouring outbox delivers", || {
        let d = delivered.load(Ordering::Relaxed);
        async move { d > 0 }
    })
    .await;
    let out = FLEET.scope(fleet.clone(), rule).await;
    fleet.shutdown().await;
    out
}

pub fn relay(f: &Fixture, clock: &Arc<ManualClock>, log: &Log) -> RelayBuilder {
    builder(f)
        .clock(clock.clone())
        .dispatcher(handlers(log))
        .worker_id(worker_id("relay-a"))
}

pub fn relay_with_transport(
    f: &Fixture,
    clock: &Arc<ManualClock>,
    log: &Log,
) -> (RelayBuilder, MemoryTransportHandle) {
    let (t, h) = MemoryTransport::new();
    (relay(f, clock, log).transport(t), h)
}

pub async fn get(f: &Fixture, id: MessageId) -> Message {
    f.store().get(id).await.unwrap().expect("message exists")
}

pub async fn wait_until<Fut: std::future::Future<Output = bool>>(
    what: &str,
    cond: impl FnMut() -> Fut,
) {
    outbox_api::testing::wait_until(what, DEADLINE, cond).await;
}

// ---------------------------------------------------------------- rules

/// The defaults are the original system's: 2 s poll, batch 20, 5 attempts,
/// retry at the next round. A failing message is tried once per round and
/// poisoned at the fifth failure; nothing retries within a round.
pub async fn original_configuration(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let relay = relay(&f, &clock, &log).build().unwrap();
    let cfg = relay.config();
    assert_eq!(
        (cfg.poll_interval, cfg.batch_size, cfg.max_attempts),
        (Duration::from_secs(2), 20, 5)
    );
    assert_eq!(cfg.retry_policy, outbox::RetryPolicy::NextRound);
    let id = f.enqueue(vec![dmsg("Fail", 1)]).await[0];
    for attempt in 1..=5u32 {
        let r = relay.drain().await.unwrap();
        assert_eq!(log.len(), attempt as usize, "exactly one try per round");
        let m = get(&f, id).await;
        assert_eq!(m.attempts, attempt);
        if attempt < 5 {
            assert_eq!((r.failed, m.state), (1, MessageState::Pending));
            assert_eq!(
                relay.drain().await.unwrap().batches,
                0,
                "not retried within the round"
            );
            clock.advance(Duration::from_millis(1999));
            assert_eq!(
                relay.drain().await.unwrap().batches,
                0,
                "not before the next round"
            );
            clock.advance(Duration::from_millis(1));
        } else {
            assert_eq!((r.poisoned, m.state), (1, MessageState::Poisoned));
        }
    }
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        relay.drain().await.unwrap().batches,
        0,
        "poison waits for a human"
    );
    assert_eq!(log.len(), 5);
}

/// Batches are bounded, oldest first, and a drain goes on until nothing is left.
pub async fn batches_drain_until_empty(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let relay = relay(&f, &clock, &log).batch_size(20).build().unwrap();
    f.enqueue((0..45).map(|n| dmsg("Ok", n)).collect()).await;
    let r = relay.drain().await.unwrap();
    assert_eq!((r.batches, r.delivered), (3, 45));
    let mut got: Vec<usize> = log.payloads().iter().map(|p| p.parse().unwrap()).collect();
    got.sort();
    assert_eq!(got, (0..45).collect::<Vec<_>>());
    assert_eq!(f.store().stats().await.unwrap().processed, 45);
}

/// Each message has its own scope: failures, panics, timeouts and unknown
/// types count against their own message only.
pub async fn each_message_in_its_own_scope(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let relay = relay(&f, &clock, &log)
        .handler_timeout(Duration::from_millis(200))
        .lease(Duration::from_secs(5))
        .build()
        .unwrap();
    let ids = f
        .enqueue(vec![
            dmsg("Ok", 1),
            dmsg("Fail", 2),
            dmsg("Panic", 3),
            dmsg("Slow", 4),
            dmsg("Nobody", 5),
            dmsg("Ok", 6),
        ])
        .await;
    let r = relay.drain().await.unwrap();
    assert_eq!((r.delivered, r.failed), (2, 4));
    let states: Vec<(MessageState, u32)> = {
        let mut v = Vec::new();
        for id in &ids {
            let m = get(&f, *id).await;
            v.push((m.state, m.attempts));
        }
        v
    };
    assert_eq!(
        states,
        [
            (MessageState::Processed, 0),
            (MessageState::Pending, 1),
            (MessageState::Pending, 1),
            (MessageState::Pending, 1),
            (MessageState::Pending, 1),
            (MessageState::Processed, 0)
        ]
    );
    let (f, ids) = (&f, &ids);
    let err = |i: usize| async move { get(f, ids[i]).await.last_error.unwrap() };
    assert!(err(1).await.contains("the handler refused it"));
    assert!(
        err(2)
            .await
            .contains("panicked: on purpose: handler blew up")
    );
    assert!(err(3).await.contains("timed out"));
    assert!(
        err(4)
            .await
            .contains("no handler registered for message type `Nobody`")
    );
}

/// Marked processed only after the handler returned Ok / the broker confirmed.
pub async fn processed_only_after_success(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let gate = Arc::new(tokio::sync::Notify::new());
    let seen = Arc::new(tokio::sync::Notify::new());
    let store = f.store();
    let (g, s) = (gate.clone(), seen.clone());
    let handlers = Handlers::new().on_message("Gated", move |_m: &Message| {
        let (g, s) = (g.clone(), s.clone());
        async move {
            s.notify_one();
            g.notified().await;
            Ok::<_, std::io::Error>(())
        }
    });
    let relay = Relay::builder_shared(store.clone())
        .clock(clock.clone())
        .dispatcher(handlers)
        .build()
        .unwrap();
    let id = f.enqueue(vec![dmsg("Gated", 1)]).await[0];
    let drain = tokio::spawn({
        let relay = relay.clone();
        async move { relay.drain().await }
    });
    seen.notified().await;
    assert_eq!(
        get(&f, id).await.state,
        MessageState::Pending,
        "not processed while the handler runs"
    );
    gate.notify_one();
    drain.await.unwrap().unwrap();
    assert_eq!(get(&f, id).await.state, MessageState::Processed);

    let (t, h) = MemoryTransport::new();
    let relay = relay_with_transport_only(&f, &clock, t);
    h.reject_type("Out");
    let id = f.enqueue(vec![imsg("Out", 1)]).await[0];
    relay.drain().await.unwrap();
    let m = get(&f, id).await;
    assert_eq!(
        (m.state, m.attempts),
        (MessageState::Pending, 1),
        "a rejected message is not processed"
    );
    assert!(m.last_error.unwrap().contains("rejected by the broker"));
    drop(log);
}

fn relay_with_transport_only(f: &Fixture, clock: &Arc<ManualClock>, t: MemoryTransport) -> Relay {
    builder(f)
        .clock(clock.clone())
        .transport(t)
        .build()
        .unwrap()
}

/// A broker outage never counts an attempt: the transport is paused and
/// probed, domain messages keep flowing, and everything is delivered once
/// the broker is back.
pub async fn outage_does_not_count(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let (b, h) = relay_with_transport(&f, &clock, &log);
    let relay = b
        .probe_initial(Duration::from_millis(1))
        .probe_max(Duration::from_millis(5))
        .build()
        .unwrap();
    h.go_down_after(3);
    let ids = f.enqueue((0..10).map(|n| imsg("Out", n)).collect()).await;
    let r = relay.drain().await.unwrap();
    assert_eq!((r.delivered, r.failed, r.released), (3, 0, 7));
    for id in &ids[3..] {
        let m = get(&f, *id).await;
        assert_eq!(
            (m.attempts, m.state),
            (0, MessageState::Pending),
            "outages never count"
        );
        // Those sent when it went down say why; those not yet sent (in a
        // fleet, sends are as large as the free slots) were given back
        // untouched.
        let said = m.last_error.as_deref().unwrap_or("transport unavailable");
        assert!(said.contains("transport unavailable"), "{said}");
    }
    let first_refused = get(&f, ids[3]).await.last_error.unwrap_or_default();
    assert!(
        first_refused.contains("transport unavailable"),
        "{first_refused}"
    );
    let health = relay.health().await;
    assert!(
        matches!(health.transport, TransportHealth::Down(_)),
        "{health:?}"
    );
    // Domain messages still flow while the transport is paused.
    f.enqueue(vec![dmsg("Ok", 99)]).await;
    wait_until("the paused transport is probed", || async {
        relay.drain().await.unwrap();
        h.probes() >= 2
    })
    .await;
    assert_eq!(log.payloads(), ["99"]);
    assert_eq!(h.delivered_count(), 3, "nothing sent while down");
    for id in &ids[3..] {
        assert_eq!(get(&f, *id).await.attempts, 0);
    }
    h.set_up();
    wait_until("the probe succeeds and the rest is delivered", || async {
        relay.drain().await.unwrap();
        h.delivered_count() == 10
    })
    .await;
    assert_eq!(h.delivered_ids(), ids);
    assert_eq!(relay.health().await.transport, TransportHealth::Up);
    assert_eq!(f.store().stats().await.unwrap().processed, 11);
}

/// A message delivered but never marked (a crashed relay) goes again once
/// its lease expires; a live lease keeps other relays away.
pub async fn crash_redelivers_after_lease(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let id = f.enqueue(vec![dmsg("Ok", 1)]).await[0];
    // The "crashed" relay claimed it and vanished.
    let lease = Duration::from_secs(60);
    let claimed = f
        .store()
        .claim(&ClaimRequest::new("crashed", 10, lease, clock.now_ts()))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let relay = relay(&f, &clock, &log).build().unwrap();
    assert_eq!(
        relay.drain().await.unwrap().batches,
        0,
        "a live lease is respected"
    );
    clock.advance(lease);
    assert_eq!(relay.drain().await.unwrap().delivered, 1);
    assert_eq!(log.ids(), [id]);
}

/// Several relays on one table deliver every message exactly once while
/// leases hold.
pub async fn many_relays_deliver_each_once(f: Fixture, clock: Arc<ManualClock>) {
    let counts: Arc<Mutex<HashMap<MessageId, usize>>> = Default::default();
    let mut handles = Vec::new();
    for w in 0..4 {
        let c = counts.clone();
        let handlers = Handlers::new().on_message("Ok", move |m: &Message| {
            *c.lock().unwrap().entry(m.id).or_default() += 1;
            async { Ok::<_, std::io::Error>(()) }
        });
        handles.push(
            builder(&f)
                .clock(clock.clone())
                .dispatcher(handlers)
                .worker_id(worker_id(&format!("relay-{w}")))
                .batch_size(7)
                .poll_interval(Duration::from_millis(20))
                .spawn()
                .unwrap(),
        );
    }
    let mut ids = Vec::new();
    for chunk in 0..20 {
        ids.extend(
            f.enqueue((0..25).map(|n| dmsg("Ok", chunk * 25 + n)).collect())
                .await,
        );
    }
    wait_until("every message is processed", || async {
        f.store().stats().await.unwrap().processed == 500
    })
    .await;
    for h in &handles {
        h.shutdown().await;
    }
    let counts = counts.lock().unwrap();
    assert_eq!(counts.len(), 500);
    assert!(
        counts.values().all(|&n| n == 1),
        "a message was delivered twice while its lease held"
    );
    assert!(ids.iter().all(|id| counts.contains_key(id)));
}

/// Same key ⇒ commit order; a failing message holds back only its key.
pub async fn per_key_order(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let relay = relay(&f, &clock, &log).build().unwrap();
    let mut batch = Vec::new();
    for n in 0..30 {
        let key = format!("k{}", n % 3);
        batch.push(dmsg(if n == 4 { "Fail" } else { "Ok" }, n).key(key));
    }
    f.enqueue(batch).await;
    relay.drain().await.unwrap();
    let per_key = |log: &Log| {
        let mut m: HashMap<usize, Vec<usize>> = HashMap::new();
        for p in log.payloads() {
            let n: usize = p.parse().unwrap();
            m.entry(n % 3).or_default().push(n);
        }
        m
    };
    let first = per_key(&log);
    assert_eq!(
        first[&0],
        (0..30).step_by(3).collect::<Vec<_>>(),
        "key k0 in commit order"
    );
    assert_eq!(
        first[&2],
        (2..30).step_by(3).collect::<Vec<_>>(),
        "key k2 in commit order"
    );
    assert_eq!(first[&1], [1, 4], "k1 stops at its failing message");
    // Fix the cause: the failed message is retried next round, then the rest of k1 in order.
    clock.advance(Duration::from_secs(2));
    let store = f.store();
    let failing = log.ids()[log.payloads().iter().position(|p| p == "4").unwrap()];
    assert_eq!(get(&f, failing).await.attempts, 1);
    store
        .discard(failing, "test", clock.now_ts())
        .await
        .unwrap();
    relay.drain().await.unwrap();
    let after = per_key(&log);
    assert_eq!(
        after[&1],
        [vec![1, 4], (7..30).step_by(3).collect::<Vec<_>>()].concat()
    );
}

/// A poisoned message parks only its own key until a human retries it.
pub async fn poison_parks_only_its_key(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let relay = relay(&f, &clock, &log).max_attempts(1).build().unwrap();
    let ids = f
        .enqueue(vec![
            dmsg("Fail", 0).key("bad"),
            dmsg("Ok", 1).key("bad"),
            dmsg("Ok", 2).key("good"),
            dmsg("Ok", 3),
        ])
        .await;
    let r = relay.drain().await.unwrap();
    assert_eq!((r.poisoned, r.delivered), (1, 2));
    assert_eq!(get(&f, ids[0]).await.state, MessageState::Poisoned);
    assert_eq!(
        get(&f, ids[1]).await.state,
        MessageState::Pending,
        "parked behind the poison"
    );
    clock.advance(Duration::from_secs(3600));
    relay.drain().await.unwrap();
    assert_eq!(
        get(&f, ids[1]).await.state,
        MessageState::Pending,
        "still parked: only a human unblocks it"
    );
    f.store()
        .retry(ids[0], "ops", clock.now_ts())
        .await
        .unwrap();
    relay.drain().await.unwrap();
    let m = get(&f, ids[0]).await;
    assert_eq!(
        (m.state, m.attempts),
        (MessageState::Poisoned, 1),
        "retried once more and failed again"
    );
    f.store()
        .discard(ids[0], "ops", clock.now_ts())
        .await
        .unwrap();
    relay.drain().await.unwrap();
    assert_eq!(get(&f, ids[1]).await.state, MessageState::Processed);
}

/// Processed messages are purged after the retention, in small batches;
/// pending and poisoned ones never.
pub async fn retention_purges_in_batches(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let day = Duration::from_secs(86_400);
    let relay = relay(&f, &clock, &log)
        .max_attempts(1)
        .purge_batch(4)
        .build()
        .unwrap();
    assert_eq!(
        relay.config().retention,
        Some(7 * day),
        "default retention is 7 days"
    );
    f.enqueue((0..10).map(|n| dmsg("Ok", n)).collect()).await;
    f.enqueue(vec![dmsg("Fail", 10)]).await;
    relay.drain().await.unwrap();
    clock.advance(6 * day);
    f.enqueue(vec![dmsg("Ok", 11), dmsg("Nope", 12).delay(30 * day)])
        .await;
    relay.drain().await.unwrap();
    assert_eq!(
        relay.purge().await.unwrap(),
        0,
        "nothing is older than 7 days yet"
    );
    clock.advance(day + Duration::from_secs(1));
    assert_eq!(
        relay.purge().await.unwrap(),
        10,
        "purged in batches of 4 until done"
    );
    let s = f.store().stats().await.unwrap();
    assert_eq!((s.processed, s.poisoned, s.pending), (1, 1, 1));
}

/// A wave starts only if it can finish within the lease: when earlier waves
/// used up the lease, the rest of the batch goes back untouched and comes
/// again under a fresh lease, still in key order — so no other relay can
/// take a message while a handler runs on it.
pub async fn a_keys_later_messages_never_outlive_their_lease(f: Fixture, clock: Arc<ManualClock>) {
    // Per handler call: payload, when it started, and its row's lease end.
    type Call = (String, Timestamp, Option<Timestamp>);
    let calls: Arc<Mutex<Vec<Call>>> = Default::default();
    let (c, store, k) = (calls.clone(), f.store(), clock.clone());
    let handlers = Handlers::new().on_message("Timed", move |m: &Message| {
        let (c, store, k, m) = (c.clone(), store.clone(), k.clone(), m.clone());
        async move {
            let row = store.get(m.id).await.unwrap().expect("claimed row");
            let text = String::from_utf8_lossy(&m.payload).into_owned();
            c.lock()
                .unwrap()
                .push((text.clone(), k.now_ts(), row.locked_until));
            if text == "0" {
                // The first handler is slow: 31 s of the 60 s lease are gone.
                k.advance(Duration::from_secs(31));
            }
            Ok::<_, std::io::Error>(())
        }
    });
    let ids = f
        .enqueue((0..3).map(|n| dmsg("Timed", n).key("k")).collect())
        .await;
    let relay = builder(&f)
        .clock(clock.clone())
        .dispatcher(handlers)
        .lease(Duration::from_secs(60))
        .handler_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    let order: Vec<&str> = calls.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(order, ["0", "1", "2"], "each once, in key order");
    for (text, started, until) in &calls {
        let until = until.expect("a handler runs on a leased message");
        assert!(
            started.saturating_add(Duration::from_secs(30)) <= until,
            "message {text} started at {started:?} on a lease ending {until:?}: it could be taken mid-delivery"
        );
    }
    assert_eq!(
        report.released, 2,
        "the two later waves went back: {report:?}"
    );
    for id in ids {
        let m = get(&f, id).await;
        assert_eq!((m.state, m.attempts), (MessageState::Processed, 0));
    }
}

/// No batch barrier: a slow handler holds one slot, never the relay. While
/// one message's handler is stuck, every other key's messages — claimed in
/// the same batch and in later ones — are delivered.
pub async fn a_slow_handler_holds_one_slot(f: Fixture, clock: Arc<ManualClock>) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let log = Log::default();
    let (g, l) = (gate.clone(), log.clone());
    let handlers = handlers(&log).on_message("Stuck", move |m: &Message| {
        let (g, l, m) = (g.clone(), l.clone(), m.clone());
        async move {
            let _permit = g.acquire().await.unwrap();
            l.push(&m);
            Ok::<_, std::io::Error>(())
        }
    });
    let mut batch = vec![dmsg("Stuck", 0).key("slow")];
    batch.extend((1..60).map(|n| dmsg("Ok", n).key(format!("k{n}"))));
    let ids = f.enqueue(batch).await;
    let relay = builder(&f)
        .clock(clock.clone())
        .dispatcher(handlers)
        .batch_size(10)
        .concurrency(4)
        .build()
        .unwrap();
    let drain = tokio::spawn({
        let relay = relay.clone();
        async move { relay.drain().await }
    });
    wait_until(
        "every other key is delivered while one handler is stuck",
        || async { log.len() == 59 },
    )
    .await;
    assert!(
        !log.ids().contains(&ids[0]),
        "the stuck one is still running"
    );
    assert_eq!(get(&f, ids[0]).await.state, MessageState::Pending);
    gate.add_permits(1);
    let report = tokio::time::timeout(DEADLINE, drain)
        .await
        .expect("the drain ends once the stuck handler returns")
        .unwrap()
        .unwrap();
    assert_eq!(report.delivered, 60, "{report:?}");
    assert_eq!(f.store().stats().await.unwrap().processed, 60);
}

/// With more messages than slots, a delivery still starts only if it can
/// end within `handler_timeout` before its own lease does: waiting for a
/// slot eats into the lease, and what waited too long goes back and is
/// claimed again under a fresh lease.
pub async fn deliveries_waiting_for_a_slot_never_outlive_their_lease(
    f: Fixture,
    clock: Arc<ManualClock>,
) {
    type Call = (String, Timestamp, Option<Timestamp>);
    let calls: Arc<Mutex<Vec<Call>>> = Default::default();
    let (c, store, k) = (calls.clone(), f.store(), clock.clone());
    let handlers = Handlers::new().on_message("Timed", move |m: &Message| {
        let (c, store, k, m) = (c.clone(), store.clone(), k.clone(), m.clone());
        async move {
            let row = store.get(m.id).await.unwrap().expect("claimed row");
            c.lock().unwrap().push((
                String::from_utf8_lossy(&m.payload).into_owned(),
                k.now_ts(),
                row.locked_until,
            ));
            // Each handler takes 20 s of the 60 s lease.
            k.advance(Duration::from_secs(20));
            Ok::<_, std::io::Error>(())
        }
    });
    // Keyless: nothing orders them but the single slot.
    let ids = f.enqueue((0..4).map(|n| dmsg("Timed", n)).collect()).await;
    let relay = builder(&f)
        .clock(clock.clone())
        .dispatcher(handlers)
        .concurrency(1)
        .lease(Duration::from_secs(60))
        .handler_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4, "each once: {calls:?}");
    for (text, started, until) in &calls {
        let until = until.expect("a handler runs on a leased message");
        assert!(
            started.saturating_add(Duration::from_secs(30)) <= until,
            "message {text} started at {started:?} on a lease ending {until:?}"
        );
    }
    assert!(report.released >= 2, "waiting ones went back: {report:?}");
    for id in ids {
        let m = get(&f, id).await;
        assert_eq!((m.state, m.attempts), (MessageState::Processed, 0));
    }
}

/// A handler that says "temporarily unavailable" is retried with backoff
/// and never counted: more unavailable answers than `max_attempts` poison
/// nothing, health names the handler meanwhile, and once it answers again
/// the message is delivered and health is back.
pub async fn an_unavailable_handler_is_retried_uncounted(f: Fixture, clock: Arc<ManualClock>) {
    let refusals = Arc::new(AtomicUsize::new(8));
    let r = refusals.clone();
    let log = Log::default();
    let l = log.clone();
    let handlers = handlers(&log).on_message("Flaky", move |m: &Message| {
        let (r, l, m) = (r.clone(), l.clone(), m.clone());
        async move {
            if r.load(Ordering::SeqCst) > 0 {
                r.fetch_sub(1, Ordering::SeqCst);
                return Err(
                    outbox::TemporarilyUnavailable::new("the warehouse answers 503").into(),
                );
            }
            l.push(&m);
            Ok::<_, outbox::HandlerError>(())
        }
    });
    let ids = f
        .enqueue(vec![dmsg("Flaky", 1).key("k"), dmsg("Ok", 2).key("k")])
        .await;
    let handle = builder(&f)
        .clock(clock.clone())
        .dispatcher(handlers)
        .max_attempts(3)
        .unavailable_initial(Duration::from_secs(1))
        .unavailable_max(Duration::from_secs(4))
        .poll_interval(Duration::from_millis(10))
        .spawn()
        .unwrap();
    wait_until("the first refusal is recorded", || async {
        refusals.load(Ordering::SeqCst) < 8
    })
    .await;
    handle.until_idle().await.unwrap();
    let m = get(&f, ids[0]).await;
    assert_eq!((m.state, m.attempts), (MessageState::Pending, 0), "{m:?}");
    assert!(
        m.last_error.unwrap().contains("temporarily unavailable"),
        "the reason is kept for operators"
    );
    assert!(m.available_at > clock.now_ts(), "retried after a backoff");
    let health = handle.health().await;
    assert_eq!(health.status, HealthStatus::Degraded, "{health:?}");
    assert!(
        health
            .reasons
            .iter()
            .any(|r| r.contains("`Flaky`") && r.contains("503")),
        "{health:?}"
    );
    while refusals.load(Ordering::SeqCst) > 0 {
        clock.advance(Duration::from_secs(5));
        handle.until_idle().await.unwrap();
    }
    clock.advance(Duration::from_secs(5));
    wait_until("delivered once the handler answers", || async {
        get(&f, ids[1]).await.state == MessageState::Processed
    })
    .await;
    let m = get(&f, ids[0]).await;
    assert_eq!((m.state, m.attempts), (MessageState::Processed, 0));
    assert_eq!(log.ids(), ids, "once each, in key order");
    wait_until("health is back", || async {
        handle.health().await.status == HealthStatus::Healthy
    })
    .await;
    handle.shutdown().await;
}

/// A relay restarted with the same stable `worker_id` takes back the leases
/// its previous process held at once, instead of waiting for them to expire.
pub async fn a_restarted_relay_takes_back_its_own_leases(f: Fixture, clock: Arc<ManualClock>) {
    let id = worker_id("orders-relay");
    let ids = f
        .enqueue((0..3).map(|n| dmsg("Ok", n).key("k")).collect())
        .await;
    // The previous process claimed them under a 60 s lease and died.
    let claimed = f
        .store()
        .claim(&ClaimRequest::new(
            id.clone(),
            10,
            Duration::from_secs(60),
            clock.now_ts(),
        ))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    let log = Log::default();
    let stranger = relay(&f, &clock, &log)
        .worker_id("someone-else".into())
        .build()
        .unwrap();
    assert_eq!(
        stranger.drain().await.unwrap().batches,
        0,
        "another id waits for the lease"
    );
    let handle = relay(&f, &clock, &log)
        .worker_id(id.clone())
        .spawn()
        .unwrap();
    wait_until(
        "the restarted relay delivers without waiting out the lease",
        || async { log.len() == 3 },
    )
    .await;
    assert_eq!(log.ids(), ids, "in key order");
    let twin = relay(&f, &clock, &log).worker_id(id.clone()).spawn();
    assert!(
        twin.unwrap_err().to_string().contains("already used"),
        "a second live relay with the same id over the same store is refused"
    );
    handle.shutdown().await;
}

/// Shutdown stops claiming, finishes in-flight work and gives unfinished
/// leases back; afterwards health is Unhealthy.
pub async fn shutdown_finishes_and_releases(f: Fixture, clock: Arc<ManualClock>) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let (g, s) = (gate.clone(), started.clone());
    let handlers = Handlers::new().on_message("Gated", move |_m: &Message| {
        let (g, s) = (g.clone(), s.clone());
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            let _permit = g.acquire().await.unwrap();
            Ok::<_, std::io::Error>(())
        }
    });
    // Key "k": three messages in one batch = three waves.
    let ids = f
        .enqueue((0..3).map(|n| dmsg("Gated", n).key("k")).collect())
        .await;
    let handle = builder(&f)
        .clock(clock.clone())
        .dispatcher(handlers)
        .worker_id(worker_id("stopping"))
        .spawn()
        .unwrap();
    wait_until("the first message is in flight", || async {
        started.load(Ordering::SeqCst) == 1
    })
    .await;
    let mut stop = Box::pin(async move {
        handle.shutdown().await;
        handle
    });
    // The first poll of `shutdown` requests the stop; only then may the
    // in-flight handler finish.
    std::future::poll_fn(|cx| {
        assert!(
            stop.as_mut().poll(cx).is_pending(),
            "shutdown waits for the in-flight handler"
        );
        std::task::Poll::Ready(())
    })
    .await;
    gate.add_permits(10);
    let handle = tokio::time::timeout(DEADLINE, stop)
        .await
        .expect("shutdown finishes");
    assert!(!handle.is_running());
    assert_eq!(
        get(&f, ids[0]).await.state,
        MessageState::Processed,
        "in-flight work finished"
    );
    let rest = [get(&f, ids[1]).await, get(&f, ids[2]).await];
    for m in &rest {
        assert_eq!(
            (m.state, m.attempts, m.locked_by.as_deref()),
            (MessageState::Pending, 0, None),
            "lease given back"
        );
    }
    assert_eq!(started.load(Ordering::SeqCst), 1, "nothing new was started");
    let health = handle.health().await;
    assert_eq!(health.status, HealthStatus::Unhealthy);
    assert!(!health.relay_running);
}

/// Health: Healthy; Degraded on backlog age, poison or transport down;
/// Unhealthy once stopped.
pub async fn health_reports(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let (b, h) = relay_with_transport(&f, &clock, &log);
    let handle = b
        .max_attempts(1)
        .poll_interval(Duration::from_millis(20))
        .spawn()
        .unwrap();
    assert_eq!(handle.health().await.status, HealthStatus::Healthy);

    f.enqueue(vec![dmsg("Ok", 1).delay(Duration::from_secs(3600))])
        .await;
    clock.advance(Duration::from_secs(301));
    let r = handle.health().await;
    assert_eq!(r.status, HealthStatus::Degraded);
    assert!(
        r.reasons.iter().any(|s| s.contains("oldest pending")),
        "{r:?}"
    );
    assert!(r.oldest_pending_age.unwrap() > Duration::from_secs(300));
    let (id,) = (f.store().list(&Default::default()).await.unwrap()[0].id,);
    f.store().discard(id, "test", clock.now_ts()).await.unwrap();
    assert_eq!(handle.health().await.status, HealthStatus::Healthy);

    f.enqueue(vec![dmsg("Fail", 2)]).await;
    wait_until("the message is poisoned", || async {
        f.store().stats().await.unwrap().poisoned == 1
    })
    .await;
    let r = handle.health().await;
    assert_eq!((r.status, r.poisoned), (HealthStatus::Degraded, 1));
    let poisoned = f
        .store()
        .list(&outbox::ListQuery::new().state(MessageState::Poisoned))
        .await
        .unwrap();
    f.store()
        .discard(poisoned[0].id, "test", clock.now_ts())
        .await
        .unwrap();

    h.set_down("broker unreachable");
    f.enqueue(vec![imsg("Out", 3)]).await;
    wait_until("the transport is reported down", || async {
        matches!(handle.health().await.transport, TransportHealth::Down(_))
    })
    .await;
    let r = handle.health().await;
    assert_eq!(r.status, HealthStatus::Degraded);
    assert!(
        r.reasons.iter().any(|s| s.contains("broker unreachable")),
        "{r:?}"
    );
    h.set_up();
    wait_until("the message is delivered after the outage", || async {
        h.delivered_count() == 1
    })
    .await;
    wait_until("health is back", || async {
        handle.health().await.status == HealthStatus::Healthy
    })
    .await;

    handle.shutdown().await;
    assert_eq!(handle.health().await.status, HealthStatus::Unhealthy);
}

/// A commit wakes the relay at once: with a one-hour poll, delivery still
/// happens within the test deadline, and `until_idle` lets a test wait.
pub async fn commit_wakes_relay(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let handle = relay(&f, &clock, &log)
        .poll_interval(Duration::from_secs(3600))
        .spawn()
        .unwrap();
    handle.until_idle().await.unwrap();
    f.enqueue(vec![dmsg("Ok", 1)]).await;
    wait_until(
        "the committed message is handled without waiting for the poll",
        || async { log.len() == 1 },
    )
    .await;
    f.enqueue_rolled_back(vec![dmsg("Ok", 2)]).await;
    f.enqueue(vec![dmsg("Ok", 3)]).await;
    tokio::time::timeout(DEADLINE, handle.until_idle())
        .await
        .unwrap()
        .unwrap();
    wait_until("the second commit is handled", || async { log.len() == 2 }).await;
    assert_eq!(
        log.payloads(),
        ["1", "3"],
        "the rolled-back message is never delivered"
    );
    handle.shutdown().await;
}

/// Bad configuration is refused at build() with an error naming the field.
pub async fn bad_configuration_is_refused(f: Fixture, clock: Arc<ManualClock>) {
    let log = Log::default();
    let err = |b: RelayBuilder| b.build().unwrap_err().to_string();
    assert!(err(relay(&f, &clock, &log).batch_size(0)).contains("`batch_size`"));
    assert!(err(relay(&f, &clock, &log).max_attempts(0)).contains("`max_attempts`"));
    assert!(err(relay(&f, &clock, &log).lease(Duration::ZERO)).contains("`lease`"));
    assert!(err(relay(&f, &clock, &log).poll_interval(Duration::ZERO)).contains("`poll_interval`"));
    assert!(err(relay(&f, &clock, &log).lease(Duration::from_secs(1))).contains("handler_timeout"));
    assert!(err(builder(&f)).contains("needs a dispatcher"));
}

pub trait ClockExt {
    fn now_ts(&self) -> Timestamp;
}

impl ClockExt for Arc<ManualClock> {
    fn now_ts(&self) -> Timestamp {
        outbox::Clock::now(&**self)
    }
}

/// Expands to one test per rule for a backend type implementing `Backend`.
#[macro_export]
macro_rules! semantics_tests {
    ($backend:ty) => {
        $crate::semantics_tests!(@rules $backend; alone);
    };
    // Every rule again, for an outbox in a fleet whose other outbox keeps
    // its slots busy.
    ($backend:ty, in_a_fleet) => {
        mod in_a_fleet {
            use super::*;
            $crate::semantics_tests!(@rules $backend; in_a_fleet);
        }
    };
    (@rules $backend:ty; $how:ident) => {
        $crate::semantics_tests!(@each $backend; $how;
            original_configuration, batches_drain_until_empty, each_message_in_its_own_scope,
            processed_only_after_success, outage_does_not_count, crash_redelivers_after_lease,
            many_relays_deliver_each_once, per_key_order, poison_parks_only_its_key,
            retention_purges_in_batches, a_keys_later_messages_never_outlive_their_lease,
            shutdown_finishes_and_releases, health_reports,
            commit_wakes_relay, bad_configuration_is_refused, a_slow_handler_holds_one_slot,
            deliveries_waiting_for_a_slot_never_outlive_their_lease,
            an_unavailable_handler_is_retried_uncounted,
            a_restarted_relay_takes_back_its_own_leases);
    };
    (@each $backend:ty; $how:ident; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                outbox_api::testing::quiet_deliberate_panics();
                let clock = semantics::clock();
                let fixture = <$backend as semantics::Backend>::fresh(clock.clone()).await;
                semantics::$how(semantics::$name(fixture, clock)).await;
            }
        )*
    };
}
