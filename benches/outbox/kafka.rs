//! Figures against a Kafka-protocol broker (`OUTBOX_KAFKA_URL`, else the
//! local default if it answers; `scripts/services` starts tansu there): the
//! relay draining to a topic beside a bare rdkafka producer loop with the
//! same settings (idempotent, `acks=all`, the same headers and keys) and the
//! same number of messages awaited at once, and commit → broker
//! acknowledgement at 1k msg/s offered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use outbox::memory::MemoryStore;
use outbox::{MessageId, MessageKind, NewMessage, Relay, Timestamp};
use outbox_kafka::rdkafka::ClientConfig;
use outbox_kafka::rdkafka::message::{Header, OwnedHeaders};
use outbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use outbox_kafka::testing::{create_topic, unique_topic};
use outbox_kafka::{
    CONTENT_TYPE_HEADER, CREATED_AT_HEADER, ID_HEADER, KEY_HEADER, KafkaTransport, TYPE_HEADER,
};

use crate::common::{Figure, commit_to_ack_latency, drain_rate, latency_rows, not_measured};

const PAYLOAD: usize = 200;
/// Ordering keys of the bench's messages: a key's messages go to one
/// partition, several keys keep the partitions busy.
const KEYS: usize = 64;
const PARTITIONS: i32 = 4;

fn payload(i: usize) -> Vec<u8> {
    let mut p = vec![b'x'; PAYLOAD];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

/// Keyless (`keys` 0) or with one of `keys` ordering keys.
fn message(i: usize, keys: usize) -> NewMessage {
    let m = NewMessage::new(MessageKind::Integration, "Bench", payload(i));
    if keys == 0 {
        m
    } else {
        m.key(format!("k{}", i % keys))
    }
}

fn integration(i: usize) -> NewMessage {
    message(i, 0)
}

/// Bare rdkafka: the transport's producer settings and headers, at most
/// `window` deliveries awaited at once, the next record handed over as one
/// comes back (its key, if `keys` > 0, the one the relay's message has).
async fn bare_rdkafka(bootstrap: &str, topic: &str, n: usize, window: usize, keys: usize) -> f64 {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set("message.timeout.ms", "0")
        .create()
        .unwrap();
    // Warm, as the relay's transport is once connected: the topic's
    // metadata and the producer id fetched before the clock starts.
    producer
        .send(
            FutureRecord::to(topic).payload("warm-up").key("warm-up"),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let start = Instant::now();
    let mut pending = FuturesUnordered::new();
    let mut sent = 0;
    while sent < n || !pending.is_empty() {
        if sent < n && pending.len() < window {
            let (id, created) = (
                MessageId::new().to_string(),
                Timestamp::now().as_millis().to_string(),
            );
            let key = (keys > 0).then(|| format!("k{}", sent % keys));
            let mut own = vec![
                (ID_HEADER, id.as_str()),
                (TYPE_HEADER, "Bench"),
                (CONTENT_TYPE_HEADER, "application/octet-stream"),
                (CREATED_AT_HEADER, created.as_str()),
            ];
            if let Some(key) = &key {
                own.push((KEY_HEADER, key.as_str()));
            }
            let headers = own
                .into_iter()
                .fold(OwnedHeaders::new_with_capacity(5), |h, (k, v)| {
                    h.insert(Header {
                        key: k,
                        value: Some(v.as_bytes()),
                    })
                });
            let body = payload(sent);
            let mut record = FutureRecord::to(topic).payload(&body).headers(headers);
            if let Some(key) = &key {
                record = record.key(key.as_bytes());
            }
            let delivery = producer.send_result(record).map_err(|(e, _)| e).unwrap();
            pending.push(delivery);
            sent += 1;
        } else if let Some(done) = pending.next().await {
            done.unwrap().unwrap();
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn transport(bootstrap: &str, topic: &str) -> KafkaTransport {
    let topic = topic.to_owned();
    KafkaTransport::connect(KafkaTransport::builder(bootstrap).topic_with(move |_| topic.clone()))
        .await
        .unwrap()
}

async fn relay_memory(bootstrap: &str, topic: &str, n: usize, window: usize, keys: usize) -> f64 {
    let store = MemoryStore::new();
    crate::memory::fill_with(&store, n, |i| message(i, keys));
    let relay = Relay::builder(store)
        .transport(transport(bootstrap, topic).await)
        .concurrency(window)
        .batch_size(window);
    drain_rate(relay, n).await
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    let bootstrap = match outbox_api::testing::services::find(&outbox_kafka::testing::KAFKA) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("Kafka figures", &how)],
    };
    let n = if quick { 3_000 } else { 20_000 };
    let rounds = if quick { 1 } else { 3 };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut out = Vec::new();
    // Keyless, then with 64 keys: the relay hands a key's next message
    // over only once the previous one is acknowledged (a key's order holds
    // through refusals and retries), so at most 64 are in flight, where
    // the bare producer pipelines a key's messages (its idempotence keeps
    // a partition's order, but nothing stops a later message after a
    // refused one).
    for (window, keys) in [(100, 0), (500, 0), (500, KEYS)] {
        // Bare and relay take turns, `rounds` times, each on a fresh topic;
        // each figure is the median of its runs.
        let (mut bares, mut relays) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let topic = unique_topic("bench");
            create_topic(&bootstrap, &topic, PARTITIONS).await;
            bares.push(bare_rdkafka(&bootstrap, &topic, n, window, keys).await);
            let topic = unique_topic("bench");
            create_topic(&bootstrap, &topic, PARTITIONS).await;
            relays.push(relay_memory(&bootstrap, &topic, n, window, keys).await);
        }
        let keyed = if keys == 0 {
            "keyless".to_owned()
        } else {
            format!("{keys} keys")
        };
        out.push(
            Figure::new(
                format!(
                    "drain {n} to Kafka (tansu, idempotent, acks=all, {PARTITIONS} partitions, {keyed}), memory store, window {window}, median of {rounds}"
                ),
                median(relays),
                "msg/s",
                if keys == 0 { "≥ 0.8 × bare rdkafka" } else { "—" },
            )
            .beside(
                format!("bare rdkafka, same settings, {window} awaited at once"),
                median(bares),
            ),
        );
    }
    let topic = unique_topic("latency");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let hist = commit_to_ack_latency(
        Arc::new(transport(&bootstrap, &topic).await),
        integration,
        1000,
        Duration::from_secs(if quick { 2 } else { 10 }),
    )
    .await;
    out.extend(latency_rows(
        "commit → Kafka ack (acks=all), SQLite, 1k msg/s offered",
        &hist,
        "—",
        "—",
    ));
    out
}
