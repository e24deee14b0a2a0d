//! `KafkaTransport` against a real Kafka-protocol broker
//! (`OUTBOX_KAFKA_URL`, else 127.0.0.1:9092): what reaches the topic, and
//! how refusals and outages are settled.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_api::testing::{TcpProxy, TransportUnderTest};
use outbox_api::{
    ErrorKind, Message, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport,
};
use outbox_kafka::testing::{
    OwnTansu, create_topic, free_port, kafka_url, read_topic, unique_topic,
};
use outbox_kafka::{KafkaTransport, TRACEPARENT_HEADER, TYPE_HEADER};

fn stored(m: NewMessage) -> Message {
    m.into_message(Timestamp::now())
        .expect("valid test message")
}

fn to(topic: &str, n: usize) -> NewMessage {
    NewMessage::new(
        MessageKind::Integration,
        "TestMessage",
        format!("payload {n}"),
    )
    .destination(topic, "")
}

async fn connect(bootstrap: &str) -> KafkaTransport {
    KafkaTransport::connect(
        KafkaTransport::builder(bootstrap).delivery_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("connect the transport")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_pick_one_partition_in_order_and_headers_carry_the_message() {
    let bootstrap = kafka_url();
    let topic = unique_topic("headers");
    create_topic(&bootstrap, &topic, 4).await;
    let transport = connect(&bootstrap).await;
    let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let sent: Vec<Message> = (0..40)
        .map(|n| {
            let m = to(&topic, n).header("tenant", "acme");
            let m = if n % 5 == 4 {
                m
            } else {
                m.key(format!("key-{}", n % 5))
            };
            stored(if n == 0 { m.trace_parent(trace) } else { m })
        })
        .collect();
    // Batches as the relay forms them: at most one message of a key each.
    for chunk in sent.chunks(5) {
        let outcomes = transport.send(chunk).await;
        assert!(
            outcomes.iter().all(|o| *o == Outcome::Delivered),
            "{outcomes:?}"
        );
    }
    let records = read_topic(&bootstrap, &topic, 4, Duration::from_secs(30)).await;
    assert_eq!(records.len(), sent.len(), "each message once: {records:?}");
    let by_id: HashMap<String, &Message> = sent.iter().map(|m| (m.id.to_string(), m)).collect();
    let mut partition_of_key: HashMap<String, i32> = HashMap::new();
    let mut last_of_key: HashMap<String, (i32, i64, usize)> = HashMap::new();
    for r in &records {
        let m = by_id
            .get(r.id().expect("the id header"))
            .expect("a message that was sent");
        assert_eq!(r.payload, m.payload);
        assert_eq!(r.key.as_deref(), m.key.as_deref().map(str::as_bytes));
        assert_eq!(r.headers[TYPE_HEADER], "TestMessage");
        assert_eq!(r.headers["tenant"], "acme");
        assert_eq!(
            r.headers.get(TRACEPARENT_HEADER).map(String::as_str),
            m.trace_parent.as_deref()
        );
        if let Some(key) = &m.key {
            let p = *partition_of_key.entry(key.clone()).or_insert(r.partition);
            assert_eq!(p, r.partition, "key {key} in one partition");
            let n: usize = String::from_utf8_lossy(&m.payload)
                .trim_start_matches("payload ")
                .parse()
                .unwrap();
            if let Some((_, offset, before)) = last_of_key.insert(key.clone(), (p, r.offset, n)) {
                assert!(
                    offset < r.offset && before < n,
                    "key {key}: message {n} after {before} in the partition"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_belong_to_their_message_and_spare_the_others() {
    let bootstrap = kafka_url();
    let topic = unique_topic("refusals");
    create_topic(&bootstrap, &topic, 1).await;
    let transport = KafkaTransport::connect(
        KafkaTransport::builder(&bootstrap)
            // The producer's own limit: a larger message is refused before
            // it is sent.
            .set("message.max.bytes", "10000"),
    )
    .await
    .unwrap();
    let missing = unique_topic("never-created");
    let batch = vec![
        stored(to(&topic, 0)),
        stored(to(&missing, 1)),
        stored(to("not a topic", 2)),
        stored(
            NewMessage::new(MessageKind::Integration, "Big", vec![7u8; 20_000])
                .destination(&topic, ""),
        ),
        stored(to(&topic, 4)),
    ];
    let started = Instant::now();
    let outcomes = transport.send(&batch).await;
    let took = started.elapsed();
    assert_eq!(outcomes[0], Outcome::Delivered, "{outcomes:?}");
    assert_eq!(outcomes[4], Outcome::Delivered, "{outcomes:?}");
    let words = |o: &Outcome| match o {
        Outcome::Rejected(w) => w.clone(),
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert!(words(&outcomes[1]).contains(&missing), "{outcomes:?}");
    assert!(
        words(&outcomes[1]).contains("does not exist"),
        "{outcomes:?}"
    );
    assert!(words(&outcomes[2]).contains("not a topic"), "{outcomes:?}");
    assert!(
        words(&outcomes[3]).to_lowercase().contains("size")
            || words(&outcomes[3]).to_lowercase().contains("large"),
        "{outcomes:?}"
    );
    // A missing topic is known at once, not after the delivery timeout.
    assert!(took < Duration::from_secs(5), "the batch took {took:?}");
    let records = read_topic(&bootstrap, &topic, 1, Duration::from_secs(30)).await;
    let ids: Vec<&str> = records.iter().filter_map(|r| r.id()).collect();
    assert_eq!(
        ids,
        vec![batch[0].id.to_string(), batch[4].id.to_string()],
        "the two good messages arrive, in order"
    );
}

#[tokio::test]
async fn unreachable_brokers_and_bad_settings_are_clear_errors_without_secrets() {
    let e = KafkaTransport::connect(
        KafkaTransport::builder("127.0.0.1:1")
            .metadata_timeout(Duration::from_secs(2))
            .set("sasl.password", "s3cret-pw"),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let text = format!("{e} {e:?}");
    assert!(text.contains("127.0.0.1:1"), "{text}");
    assert!(!text.contains("s3cret-pw"), "{text}");
    let e = KafkaTransport::connect(KafkaTransport::builder("127.0.0.1:9092").set("acks", "0"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("acks"), "{e}");
    let e = KafkaTransport::connect(
        KafkaTransport::builder("127.0.0.1:9092").set("no.such.property", "1"),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("no.such.property"), "{e}");
}

// ------------------------------------------------------------ conformance

/// A broker of the test's own reached through a proxy it advertises, so
/// that cutting the proxy cuts every connection of the client.
struct UnderTest {
    _dir: tempfile::TempDir,
    _broker: OwnTansu,
    proxy: TcpProxy,
    topic: String,
    transport: Arc<KafkaTransport>,
}

async fn under_test() -> UnderTest {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let proxy = TcpProxy::start(([127, 0, 0, 1], port).into()).await;
    let broker = OwnTansu::start_advertising(dir.path(), port, proxy.addr());
    let topic = unique_topic("conformance");
    create_topic(&broker.bootstrap(), &topic, 1).await;
    let transport = KafkaTransport::connect(
        KafkaTransport::builder(broker.bootstrap())
            .delivery_timeout(Duration::from_secs(2))
            .metadata_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap();
    UnderTest {
        _dir: dir,
        _broker: broker,
        proxy,
        topic,
        transport: Arc::new(transport),
    }
}

#[async_trait::async_trait]
impl TransportUnderTest for UnderTest {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    fn deliverable(&self, n: usize) -> Message {
        stored(to(&self.topic, n))
    }
    fn rejectable(&self) -> Message {
        stored(to(&unique_topic("missing"), 0))
    }
    async fn break_connection(&self) {
        self.proxy.cut();
    }
    async fn heal_connection(&self) {
        self.proxy.heal();
    }
    async fn received(&self) -> Vec<MessageId> {
        read_topic(
            &self.proxy.addr().to_string(),
            &self.topic,
            1,
            Duration::from_secs(10),
        )
        .await
        .iter()
        .filter_map(|r| r.id()?.parse().ok())
        .collect()
    }
}

mod conformance {
    use super::*;
    outbox_api::transport_conformance_tests!(under_test);
}

/// `create_topic` creates a topic once (then says it was there), and
/// refuses a name Kafka does not take before asking the brokers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_topic_creates_once_and_refuses_bad_names() {
    let bootstrap = kafka_url();
    let transport = connect(&bootstrap).await;
    let topic = unique_topic("created");
    assert!(transport.create_topic(&topic, 2, 1).await.expect("created"));
    assert!(
        !transport
            .create_topic(&topic, 2, 1)
            .await
            .expect("already there")
    );
    let outcomes = transport.send(&[stored(to(&topic, 0))]).await;
    assert_eq!(outcomes, vec![Outcome::Delivered]);
    let e = transport.create_topic("no spaces", 1, 1).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("no spaces"), "{e}");
    let e = transport
        .create_topic(&unique_topic("none"), 0, 1)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
}
