//! Model-based property test of the relay
//! (`docs/rules.md#how-the-rules-are-tested`): random sequences of enqueue
//! (with and without key), commit and rollback, relay rounds, handlers that
//! succeed, fail or panic, a transport that goes down or rejects, a relay
//! that crashes after handling but before marking, relay restarts, clock
//! jumps past leases and retries, and operator retries —
//! checked after every step against what the model says may happen.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::memory::{MemoryStore, MemoryTransport, MemoryTransportHandle};
use outbox::{
    ClaimRequest, Clock, Dispatcher, Fleet, Handlers, ListQuery, ManualClock, Message, MessageId,
    MessageKind, MessageState, NewMessage, Relay, Timestamp, Transport,
};
use outbox_api::testing::StoreUnderTest;
use proptest::prelude::*;

pub const MAX_ATTEMPTS: u32 = 3;

#[derive(Debug, Clone)]
pub enum Fate {
    /// Domain: fail (error) the first `n` calls, then succeed.
    Fail(u8),
    /// Domain: panic the first `n` calls, then succeed.
    Panic(u8),
    /// Domain: succeed after `n` ms, so deliveries overlap and end out of
    /// order.
    Slow(u8),
    /// Domain: say "temporarily unavailable" the first `n` calls (never
    /// counted), then succeed.
    Unavailable(u8),
    /// Integration: delivered when the transport is up.
    Out,
    /// Integration: always rejected by the broker.
    Refused,
}

#[derive(Debug, Clone)]
pub struct Spec {
    pub key: Option<u8>,
    pub fate: Fate,
}

#[derive(Debug, Clone)]
pub enum Op {
    Enqueue {
        messages: Vec<Spec>,
        commit: bool,
    },
    Drain,
    Batch,
    TransportDown,
    TransportUp,
    /// A relay claims one message, delivers it, and dies before marking it.
    CrashAfterHandling,
    /// A new relay instance (new worker id, transport state unknown).
    Restart,
    Advance(u64),
    RetryPoisoned,
}

fn spec() -> impl Strategy<Value = Spec> {
    let fate = prop_oneof![
        4 => (0u8..2).prop_map(Fate::Fail),
        1 => (2u8..5).prop_map(Fate::Fail),
        1 => (0u8..3).prop_map(Fate::Panic),
        1 => (1u8..4).prop_map(Fate::Slow),
        1 => (1u8..3).prop_map(Fate::Unavailable),
        3 => Just(Fate::Out),
        1 => Just(Fate::Refused),
    ];
    (proptest::option::of(0u8..3), fate).prop_map(|(key, fate)| Spec { key, fate })
}

pub fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (proptest::collection::vec(spec(), 1..4), proptest::bool::weighted(0.8))
            .prop_map(|(messages, commit)| Op::Enqueue { messages, commit }),
        4 => Just(Op::Drain),
        3 => Just(Op::Batch),
        1 => Just(Op::TransportDown),
        1 => Just(Op::TransportUp),
        1 => Just(Op::CrashAfterHandling),
        1 => Just(Op::Restart),
        2 => prop_oneof![Just(1u64), Just(2), Just(30), Just(61)].prop_map(Op::Advance),
        1 => Just(Op::RetryPoisoned),
    ];
    proptest::collection::vec(op, 1..40)
}

/// What the receiving side saw.
#[derive(Default)]
struct Sink {
    /// Handler calls per message (all attempts).
    calls: HashMap<MessageId, u32>,
    /// Effects that committed with their inbox entry, in order.
    effects: Vec<MessageId>,
    /// Inbox duplicates skipped.
    duplicates: u32,
}

struct World {
    fixture: Box<dyn StoreUnderTest>,
    clock: Arc<ManualClock>,
    transport: MemoryTransport,
    transport_handle: MemoryTransportHandle,
    dispatcher: Arc<Handlers>,
    sink: Arc<Mutex<Sink>>,
    relay: Relay,
    generation: u32,
    batch_size: usize,
    /// A fleet the relay takes its slots from, and its weight there.
    fleet: Option<(Fleet, u32)>,
    // The model.
    committed: Vec<(MessageId, Spec)>,
    poisoned: HashSet<MessageId>,
}

fn payload(spec: &Spec) -> (MessageKind, &'static str, Vec<u8>) {
    match spec.fate {
        Fate::Fail(n) => (MessageKind::Domain, "M", format!("fail:{n}").into_bytes()),
        Fate::Panic(n) => (MessageKind::Domain, "M", format!("panic:{n}").into_bytes()),
        Fate::Slow(n) => (MessageKind::Domain, "M", format!("slow:{n}").into_bytes()),
        Fate::Unavailable(n) => (
            MessageKind::Domain,
            "M",
            format!("unavailable:{n}").into_bytes(),
        ),
        Fate::Out => (MessageKind::Integration, "Out", Vec::new()),
        Fate::Refused => (MessageKind::Integration, "Refused", Vec::new()),
    }
}

fn new_message(spec: &Spec) -> NewMessage {
    let (kind, ty, body) = payload(spec);
    let m = NewMessage::new(kind, ty, body);
    // Keys are per kind so that each sink's own order can be checked.
    let _ = kind;
    match model_key(spec) {
        Some(k) => m.key(k),
        None => m,
    }
}

/// Handlers whose effects go through an inbox in a receiver database, so
/// re-deliveries have one effect.
fn dispatcher(sink: Arc<Mutex<Sink>>) -> Handlers {
    let receiver = MemoryStore::new();
    Handlers::new().on_message("M", move |m: &Message| {
        let text = String::from_utf8_lossy(&m.payload).into_owned();
        let (how, n) = text.split_once(':').expect("fate");
        let n: u32 = n.parse().expect("count");
        let mut sink = sink.lock().unwrap();
        let calls = sink.calls.entry(m.id).or_default();
        *calls += 1;
        let mut pause = Duration::ZERO;
        let result: Result<(), outbox::HandlerError> = if how == "slow" {
            pause = Duration::from_millis(n.into());
            record(&receiver, &mut sink, m.id);
            Ok(())
        } else if *calls <= n {
            match how {
                "panic" => {
                    drop(sink);
                    panic!("{}handler panicked", outbox_api::testing::DELIBERATE);
                }
                "unavailable" => {
                    Err(outbox::TemporarilyUnavailable::new("downstream down (model)").into())
                }
                _ => Err("handler failed on purpose".into()),
            }
        } else {
            record(&receiver, &mut sink, m.id);
            Ok(())
        };
        async move {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            result
        }
    })
}

/// The handler's effect, through the receiver's inbox.
fn record(receiver: &MemoryStore, sink: &mut Sink, id: MessageId) {
    let mut tx = receiver.begin();
    if tx.try_receive("model", id) {
        tx.commit().expect("receiver commit");
        sink.effects.push(id);
    } else {
        sink.duplicates += 1;
    }
}

impl World {
    fn new_relay(&mut self) -> Relay {
        self.generation += 1;
        let builder = Relay::builder_shared(self.fixture.store());
        let builder = match &self.fleet {
            Some((fleet, weight)) => builder.fleet(fleet).fleet_weight(*weight),
            None => builder,
        };
        builder
            .clock(self.clock.clone())
            .dispatcher_shared(self.dispatcher.clone())
            .transport(self.transport.clone())
            .worker_id(format!("relay-{}", self.generation))
            .batch_size(self.batch_size)
            .max_attempts(MAX_ATTEMPTS)
            .probe_initial(Duration::from_millis(1))
            .probe_max(Duration::from_millis(1))
            .build()
            .expect("valid relay")
    }

    async fn step(&mut self, op: &Op) {
        match op {
            Op::Enqueue { messages, commit } => {
                let new: Vec<NewMessage> = messages.iter().map(new_message).collect();
                if *commit {
                    let ids = self.fixture.enqueue(new).await;
                    self.committed
                        .extend(ids.into_iter().zip(messages.iter().cloned()));
                } else {
                    // Ids of rolled-back messages are unknown to the store;
                    // the model checks that nothing outside `committed` arrives.
                    self.fixture.enqueue_rolled_back(new).await;
                }
            }
            Op::Drain => {
                self.relay.drain().await.expect("drain");
            }
            Op::Batch => {
                self.relay.run_batch().await.expect("batch");
            }
            Op::TransportDown => self.transport_handle.set_down("broker down (model)"),
            Op::TransportUp => self.transport_handle.set_up(),
            Op::CrashAfterHandling => {
                let claimed = self
                    .fixture
                    .store()
                    .claim(&ClaimRequest::new(
                        "crashing",
                        1,
                        Duration::from_secs(60),
                        self.clock.now(),
                    ))
                    .await
                    .expect("claim");
                for m in &claimed {
                    match m.kind {
                        MessageKind::Domain => {
                            let d = self.dispatcher.clone();
                            let m = m.clone();
                            // The handler may panic on purpose; a crashing relay dies anyway.
                            let _ = tokio::spawn(async move { d.dispatch(&m).await.is_ok() }).await;
                        }
                        MessageKind::Integration => {
                            self.transport.send(std::slice::from_ref(m)).await;
                        }
                    }
                }
            }
            Op::Restart => self.relay = self.new_relay(),
            Op::Advance(secs) => self.clock.advance(Duration::from_secs(*secs)),
            Op::RetryPoisoned => {
                let store = self.fixture.store();
                let poisoned = store
                    .list(&ListQuery::new().state(MessageState::Poisoned).limit(1000))
                    .await
                    .expect("list");
                for m in poisoned {
                    store
                        .retry(m.id, "model", self.clock.now())
                        .await
                        .expect("retry");
                    self.poisoned.remove(&m.id);
                }
            }
        }
    }

    fn index(&self) -> HashMap<MessageId, (usize, &Spec)> {
        self.committed
            .iter()
            .enumerate()
            .map(|(i, (id, s))| (*id, (i, s)))
            .collect()
    }

    async fn rows(&self) -> Vec<Message> {
        self.fixture
            .store()
            .list(&ListQuery::new().limit(100_000))
            .await
            .expect("list")
    }

    /// Invariants that hold after every step.
    async fn check(&mut self) {
        let index = self.index();
        let rows = self.rows().await;
        assert_eq!(
            rows.len(),
            self.committed.len(),
            "every committed message is stored, nothing else"
        );
        let mut newly_poisoned = Vec::new();
        for m in &rows {
            let (_, spec) = index.get(&m.id).expect("only committed messages exist");
            assert!(
                m.attempts <= MAX_ATTEMPTS,
                "attempts {} exceed the max",
                m.attempts
            );
            if matches!(spec.fate, Fate::Out | Fate::Slow(_) | Fate::Unavailable(_)) {
                assert_eq!(
                    m.attempts, 0,
                    "outages and unavailable handlers never count (message {})",
                    m.id
                );
            }
            if self.poisoned.contains(&m.id) {
                assert_eq!(
                    m.state,
                    MessageState::Poisoned,
                    "poison stays until retried"
                );
            }
            if m.state == MessageState::Poisoned {
                newly_poisoned.push(m.id);
            }
        }
        let sink = self.sink.lock().unwrap();
        let delivered = self.transport_handle.delivered_ids();
        for id in sink.calls.keys().chain(&delivered) {
            assert!(
                index.contains_key(id),
                "a message that was never committed was delivered"
            );
        }
        let mut once = HashSet::new();
        for id in &sink.effects {
            assert!(once.insert(*id), "the inbox let an effect happen twice");
        }
        // Per-key order of first deliveries.
        check_order("domain effects", &sink.effects, &index);
        check_order("broker deliveries", &delivered, &index);
        drop(sink);
        self.poisoned.extend(newly_poisoned);
    }

    /// Heals everything, runs the relay to the end and checks that nothing
    /// committed was lost.
    ///
    /// A failed message is retried one round later and a key's successors
    /// wait for it, so one key's chain needs up to `MAX_ATTEMPTS` rounds per
    /// message. Every round makes at least one counted attempt on each
    /// chain's head, so `committed × MAX_ATTEMPTS` rounds always suffice; the
    /// loop stops as soon as every message is settled.
    async fn finish(&mut self) {
        self.transport_handle.set_up();
        // A handler that says "unavailable" adds up to 2 uncounted rounds.
        let budget = self.committed.len() * (MAX_ATTEMPTS as usize + 2) + 2;
        for _ in 0..budget {
            if self.unsettled(&self.rows().await).is_none() {
                break;
            }
            self.clock.advance(Duration::from_secs(61));
            // Let the probe back-off pass on the real clock.
            tokio::time::sleep(Duration::from_millis(2)).await;
            self.relay.drain().await.expect("drain");
            self.relay.drain().await.expect("drain");
        }
        self.check().await;
        let rows = self.rows().await;
        if let Some(problem) = self.unsettled(&rows) {
            panic!("after {budget} rounds: {problem}");
        }
        let sink = self.sink.lock().unwrap();
        let delivered: HashSet<MessageId> =
            self.transport_handle.delivered_ids().into_iter().collect();
        for m in &rows {
            let spec = &self.index()[&m.id].1;
            match m.state {
                MessageState::Processed => match spec.fate {
                    Fate::Out => assert!(delivered.contains(&m.id), "processed but never sent"),
                    Fate::Refused => panic!("a refused message cannot be processed"),
                    _ => assert!(
                        sink.effects.contains(&m.id),
                        "processed but its effect never happened"
                    ),
                },
                MessageState::Poisoned => assert!(
                    !matches!(spec.fate, Fate::Out | Fate::Slow(_) | Fate::Unavailable(_)),
                    "a deliverable message was poisoned"
                ),
                MessageState::Pending => {}
            }
        }
    }

    /// The first committed message that is still pending although it is not
    /// parked behind a poisoned message of its key, if any.
    fn unsettled(&self, rows: &[Message]) -> Option<String> {
        let by_id: HashMap<MessageId, &Message> = rows.iter().map(|m| (m.id, m)).collect();
        self.committed
            .iter()
            .enumerate()
            .find_map(|(i, (id, spec))| {
                let m = by_id[id];
                let parked = model_key(spec).is_some()
                    && self.committed[..i].iter().any(|(e, s)| {
                        model_key(s) == model_key(spec) && by_id[e].state == MessageState::Poisoned
                    });
                (m.state == MessageState::Pending && !parked).then(|| {
                    format!("message {id} ({spec:?}) was neither delivered nor parked: {m:?}")
                })
            })
    }
}

/// The ordering key a spec is enqueued with (keys are per kind).
fn model_key(spec: &Spec) -> Option<String> {
    spec.key.map(|k| format!("{}{k}", payload(spec).0.as_str()))
}

fn check_order(what: &str, seen: &[MessageId], index: &HashMap<MessageId, (usize, &Spec)>) {
    let mut last: HashMap<String, usize> = HashMap::new();
    let mut first = HashSet::new();
    for id in seen {
        if !first.insert(*id) {
            continue;
        }
        let (i, spec) = index[id];
        if let Some(key) = model_key(spec) {
            if let Some(prev) = last.insert(key.clone(), i) {
                assert!(prev < i, "{what}: key {key} out of commit order");
            }
        }
    }
}

/// Runs one generated case against a fresh store of a backend.
pub async fn run_case(
    fixture: Box<dyn StoreUnderTest>,
    clock: Arc<ManualClock>,
    batch_size: usize,
    ops: Vec<Op>,
) {
    run_case_in(fixture, clock, batch_size, ops, None).await
}

/// [`run_case`], the relay taking its delivery slots from a fleet of
/// `fleet.0` slots with weight `fleet.1` when given: slots scarcer than
/// the relay's own limit, handed over in turns.
pub async fn run_case_in(
    fixture: Box<dyn StoreUnderTest>,
    clock: Arc<ManualClock>,
    batch_size: usize,
    ops: Vec<Op>,
    fleet: Option<(usize, u32)>,
) {
    let fleet = fleet.map(|(slots, weight)| {
        let fleet = Fleet::builder()
            .concurrency(slots)
            .worker_id("model-fleet")
            .build()
            .expect("valid fleet");
        (fleet, weight)
    });
    let (transport, transport_handle) = MemoryTransport::new();
    transport_handle.reject_type("Refused");
    let sink = Arc::new(Mutex::new(Sink::default()));
    let dispatcher = Arc::new(dispatcher(sink.clone()));
    let relay = Relay::builder(MemoryStore::new())
        .dispatcher(Handlers::new())
        .build()
        .unwrap();
    let mut world = World {
        fixture,
        clock,
        transport,
        transport_handle,
        dispatcher,
        sink,
        relay,
        generation: 0,
        batch_size,
        fleet,
        committed: Vec::new(),
        poisoned: HashSet::new(),
    };
    world.relay = world.new_relay();
    for op in &ops {
        world.step(op).await;
        world.check().await;
    }
    world.finish().await;
}

/// 64 cases per backend by default; `PROPTEST_CASES` for long runs.
pub fn config() -> ProptestConfig {
    outbox_api::testing::quiet_deliberate_panics();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(64);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

pub fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(Timestamp::now()))
}
