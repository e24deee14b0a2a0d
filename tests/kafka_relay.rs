//! The relay's rules over Kafka: a memory outbox, the relay, the Kafka
//! transport, and the test's own topic read back directly. The outage
//! tests run a `tansu` broker of their own (reached through a proxy that
//! cuts the connection, or SIGKILLed and restarted); the others use the
//! shared broker (`OUTBOX_KAFKA_URL`, else 127.0.0.1:9092). Fails (never
//! skips) when no broker can be had.

use std::collections::HashMap;
use std::time::Duration;

use outbox::{MessageId, MessageKind, MessageState, NewMessage, OperatorStore, Relay, RetryPolicy};
use outbox_api::testing::{TcpProxy, wait_until};
use outbox_kafka::KafkaTransport;
use outbox_kafka::testing::{
    OwnTansu, create_topic, free_port, kafka_url, read_topic, unique_topic,
};
use outbox_memory::MemoryStore;

mod outage;
use outage::{DEADLINE, enqueue, through_an_outage, wait_processed};

/// The test topics' partitions.
const PARTITIONS: i32 = 4;

fn relay_over(store: &MemoryStore, transport: KafkaTransport) -> outbox::RelayHandle {
    Relay::builder(store.clone())
        .transport(transport)
        .batch_size(50)
        .poll_interval(Duration::from_millis(20))
        .probe_initial(Duration::from_millis(20))
        .probe_max(Duration::from_millis(200))
        .spawn()
        .unwrap()
}

/// Every one of `ids` is processed with no attempt counted and reached
/// `topic` at least once (a send the outage left unanswered is sent
/// again, and the producer may have written it already: the consumer's
/// inbox makes that one effect); per key, messages first reached the
/// topic in enqueue order. Returns how many copies were written twice.
async fn assert_each_arrived_in_key_order_uncounted(
    store: &MemoryStore,
    bootstrap: &str,
    topic: &str,
    ids: &[MessageId],
) -> usize {
    for id in ids {
        let m = store.get(*id).await.unwrap().unwrap();
        assert_eq!((m.state, m.attempts), (MessageState::Processed, 0), "{m:?}");
    }
    let records = read_topic(bootstrap, topic, PARTITIONS, DEADLINE).await;
    let rank: HashMap<MessageId, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut seen: HashMap<MessageId, usize> = HashMap::new();
    let mut last: HashMap<Vec<u8>, usize> = HashMap::new();
    for r in &records {
        let id: MessageId = r.id().expect("an id header").parse().expect("an id");
        let first = seen.insert(id, 1).is_none();
        if !first {
            continue;
        }
        let key = r.key.clone().expect("keyed");
        let n = rank[&id];
        if let Some(prev) = last.insert(key.clone(), n) {
            assert!(
                prev < n,
                "key {}: message {n} reached the topic before {prev}",
                String::from_utf8_lossy(&key)
            );
        }
    }
    assert_eq!(seen.len(), ids.len(), "every message reached the topic");
    records.len() - ids.len()
}

/// A fresh topic of [`PARTITIONS`] on `bootstrap`, and a transport that
/// gives up on the broker after a second (so that an outage shows soon).
async fn topic_and_transport(bootstrap: &str, prefix: &str) -> (String, KafkaTransport) {
    let topic = unique_topic(prefix);
    create_topic(bootstrap, &topic, PARTITIONS).await;
    let transport = KafkaTransport::connect(
        KafkaTransport::builder(bootstrap)
            .delivery_timeout(Duration::from_secs(1))
            .metadata_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    (topic, transport)
}

fn keyed(topic: &str) -> impl Fn(usize) -> NewMessage + '_ {
    move |n: usize| {
        NewMessage::new(
            MessageKind::Integration,
            "OrderPlaced",
            format!("order {n}"),
        )
        .destination(topic, "")
        .key(format!("k{}", n % 7))
    }
}

/// Through cut connections every message reaches the topic, each key's
/// messages first arrive in commit order, and the outage counts no
/// attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_arrives_in_key_order_through_an_outage_with_no_attempt_counted() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let proxy = TcpProxy::start(([127, 0, 0, 1], port).into()).await;
    let _broker = OwnTansu::start_advertising(dir.path(), port, proxy.addr());
    let bootstrap = proxy.addr().to_string();
    let (topic, transport) = topic_and_transport(&bootstrap, "relay").await;
    let store = MemoryStore::new();
    let relay = relay_over(&store, transport);
    let ids = through_an_outage(&store, &relay, keyed(&topic), |healed| {
        if healed { proxy.heal() } else { proxy.cut() }
    })
    .await;
    relay.shutdown().await;
    let twice = assert_each_arrived_in_key_order_uncounted(&store, &bootstrap, &topic, &ids).await;
    eprintln!(
        "kafka outage: {} messages, {twice} written twice",
        ids.len()
    );
}

/// A broker of the test's own (its topics in a SQLite file) SIGKILLed
/// mid-run and restarted on the same file: every message reaches the
/// topic, none is counted as an attempt, and the relay reports the
/// transport down, then up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_and_restarted_mid_run_loses_nothing_and_counts_no_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = OwnTansu::start(dir.path());
    let bootstrap = broker.bootstrap();
    let (topic, transport) = topic_and_transport(&bootstrap, "crash").await;
    let store = MemoryStore::new();
    let relay = relay_over(&store, transport);
    let ids = through_an_outage(&store, &relay, keyed(&topic), |healed| {
        if healed {
            broker.restart()
        } else {
            broker.kill()
        }
    })
    .await;
    assert_eq!(relay.health().await.transport, outbox::TransportHealth::Up);
    relay.shutdown().await;
    let twice = assert_each_arrived_in_key_order_uncounted(&store, &bootstrap, &topic, &ids).await;
    eprintln!(
        "kafka broker killed: {} messages, {twice} written twice",
        ids.len()
    );
}

/// A topic that does not exist is that message's failure: counted,
/// retried, poisoned at `max_attempts`; the others flow and the transport
/// is never reported down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_counted_and_poisoned_while_others_flow() {
    let bootstrap = kafka_url();
    let topic = unique_topic("relay");
    create_topic(&bootstrap, &topic, 1).await;
    let transport = KafkaTransport::connect(KafkaTransport::builder(&bootstrap))
        .await
        .unwrap();
    let store = MemoryStore::new();
    let relay = Relay::builder(store.clone())
        .transport(transport)
        .max_attempts(3)
        .poll_interval(Duration::from_millis(20))
        .retry_policy(RetryPolicy::Fixed(Duration::from_millis(30)))
        .spawn()
        .unwrap();
    let missing = unique_topic("missing");
    let bad = enqueue(
        &store,
        vec![
            NewMessage::new(MessageKind::Integration, "OrderPlaced", "lost?")
                .destination(&missing, ""),
        ],
    )[0];
    let good = enqueue(
        &store,
        (0..20)
            .map(|n| {
                NewMessage::new(MessageKind::Integration, "OrderPlaced", format!("{n}"))
                    .destination(&topic, "")
            })
            .collect(),
    );
    wait_until("the message to a missing topic is poisoned", DEADLINE, || {
        let store = store.clone();
        async move { store.get(bad).await.unwrap().map(|m| m.state) == Some(MessageState::Poisoned) }
    })
    .await;
    let m = store.get(bad).await.unwrap().unwrap();
    assert_eq!(m.attempts, 3, "{m:?}");
    let error = m.last_error.unwrap_or_default();
    assert!(
        error.contains(&missing) && error.contains("does not exist"),
        "{error}"
    );
    wait_processed("the good messages processed", &store, &good).await;
    assert_eq!(read_topic(&bootstrap, &topic, 1, DEADLINE).await.len(), 20);
    assert_eq!(relay.health().await.transport, outbox::TransportHealth::Up);
    relay.shutdown().await;
}
