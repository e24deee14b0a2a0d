//! Figures against a real RabbitMQ (`OUTBOX_AMQP_URL`, else the local
//! default if it answers): relay drain beside
//! bare lapin publishing with confirms at the same window (publish a window,
//! await it all), bare lapin with a continuous window beside that, and
//! commit → broker-confirm latency at 1k msg/s offered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use outbox::memory::MemoryStore;
use outbox::{MessageId, MessageKind, NewMessage, Relay};
use outbox_rabbitmq::RabbitTransport;
use outbox_rabbitmq::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use outbox_rabbitmq::lapin::types::FieldTable;
use outbox_rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};

use crate::common::{Figure, commit_to_ack_latency, drain_rate, latency_rows, not_measured};
use crate::sqlite::open;

const PAYLOAD: usize = 200;

fn payload(i: usize) -> Vec<u8> {
    let mut p = vec![b'x'; PAYLOAD];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

struct Broker {
    url: String,
    connection: Connection,
    queue: String,
}

impl Broker {
    async fn connect(url: &str) -> Result<Broker, String> {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let queue = format!("outbox-bench-{}", MessageId::new());
        let ch = connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok(Broker {
            url: url.to_owned(),
            connection,
            queue,
        })
    }

    async fn purge(&self) {
        let ch = self.connection.create_channel().await.unwrap();
        ch.queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await
            .unwrap();
    }

    async fn delete(&self) {
        let ch = self.connection.create_channel().await.unwrap();
        let _ = ch
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }

    async fn transport(&self) -> RabbitTransport {
        RabbitTransport::builder(self.url.clone())
            .routing_key(self.queue.clone())
            .build()
            .await
            .unwrap()
    }
}

/// Bare lapin: persistent, mandatory, confirms; publish `window`, await all, repeat.
async fn bare_lapin(b: &Broker, n: usize, window: usize) -> f64 {
    let ch = b.connection.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let start = Instant::now();
    let mut sent = 0;
    while sent < n {
        let end = (sent + window).min(n);
        let mut confirms = Vec::with_capacity(end - sent);
        for i in sent..end {
            let props = BasicProperties::default()
                .with_message_id(MessageId::new().to_string().into())
                .with_type("Bench".into())
                .with_content_type("application/octet-stream".into())
                .with_delivery_mode(2);
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    b.queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &payload(i),
                    props,
                )
                .await
                .unwrap(),
            );
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
        sent = end;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Bare lapin: persistent, mandatory, confirms; keep `window` publishes
/// unconfirmed, publishing a new one as each confirm comes back (the
/// confirms that came back together are replaced together, their publishes
/// queued at once and awaited together).
async fn bare_lapin_continuous(b: &Broker, n: usize, window: usize) -> f64 {
    let ch = b.connection.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let publish = |i: usize| {
        let props = BasicProperties::default()
            .with_message_id(MessageId::new().to_string().into())
            .with_type("Bench".into())
            .with_content_type("application/octet-stream".into())
            .with_delivery_mode(2);
        let (ch, queue, body) = (ch.clone(), b.queue.clone(), payload(i));
        async move {
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &body,
                props,
            )
            .await
        }
    };
    let start = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let (mut sent, mut confirmed) = (0, 0);
    while confirmed < n {
        let free = (window - in_flight.len()).min(n - sent);
        let published = join_all((sent..sent + free).map(publish)).await;
        in_flight.extend(published.into_iter().map(Result::unwrap));
        sent += free;
        let confirm = in_flight.next().await.expect("a publish in flight");
        assert!(confirm.unwrap().is_ack());
        confirmed += 1;
        while let Some(Some(confirm)) = in_flight.next().now_or_never() {
            assert!(confirm.unwrap().is_ack());
            confirmed += 1;
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn integration(i: usize) -> NewMessage {
    NewMessage::new(MessageKind::Integration, "Bench", payload(i))
}

async fn relay_memory(b: &Broker, n: usize, window: usize) -> f64 {
    let store = MemoryStore::new();
    crate::memory::fill_with(&store, n, integration);
    let relay = Relay::builder(store)
        .transport(b.transport().await)
        .concurrency(window)
        .batch_size(window);
    drain_rate(relay, n).await
}

async fn relay_sqlite(b: &Broker, n: usize, window: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    crate::sqlite::fill_with(&store, n, integration);
    let relay = Relay::builder(store)
        .transport(b.transport().await)
        .concurrency(window)
        .batch_size(window);
    drain_rate(relay, n).await
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    let url = match outbox_api::testing::services::find(&outbox_rabbitmq::testing::RABBITMQ) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("RabbitMQ figures", &how)],
    };
    let b = match Broker::connect(&url).await {
        Ok(b) => b,
        Err(e) => return vec![not_measured("RabbitMQ figures", &e)],
    };
    let n = if quick { 5_000 } else { 30_000 };
    let rounds = if quick { 1 } else { 3 };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut out = Vec::new();
    for window in [100, 500] {
        // The broker's own rate drifts within a run (its disk, its queues):
        // bare lapin (both ways) and the two relays take turns, `rounds`
        // times, and each figure is the median of its runs.
        let (mut bares, mut conts, mut mems, mut sqls) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            b.purge().await;
            bares.push(bare_lapin(&b, n, window).await);
            b.purge().await;
            conts.push(bare_lapin_continuous(&b, n, window).await);
            b.purge().await;
            mems.push(relay_memory(&b, n, window).await);
            b.purge().await;
            sqls.push(relay_sqlite(&b, n, window).await);
        }
        b.purge().await;
        let (bare, cont, mem, sql) = (median(bares), median(conts), median(mems), median(sqls));
        out.push(
            Figure::new(
                format!(
                    "bare lapin to RabbitMQ (persistent, confirms), continuous window {window} (a publish per confirm), {n} messages, median of {rounds}"
                ),
                cont,
                "msg/s",
                "—",
            )
            .beside(format!("bare lapin, confirms, window {window}"), bare),
        );
        out.push(
            Figure::new(
                format!(
                    "drain {n} to RabbitMQ (persistent, confirms), memory store, window {window}, median of {rounds}"
                ),
                mem,
                "msg/s",
                "≥ 0.9 × bare lapin",
            )
            .beside(format!("bare lapin, confirms, continuous window {window}"), cont),
        );
        out.push(
            Figure::new(
                format!(
                    "drain {n} to RabbitMQ (persistent, confirms), SQLite store, window {window}, median of {rounds}"
                ),
                sql,
                "msg/s",
                "≥ 0.9 × bare lapin",
            )
            .beside(format!("bare lapin, confirms, continuous window {window}"), cont),
        );
    }
    let hist = commit_to_ack_latency(
        Arc::new(b.transport().await),
        integration,
        1000,
        Duration::from_secs(if quick { 2 } else { 10 }),
    )
    .await;
    out.extend(latency_rows(
        "commit → broker confirm, SQLite, 1k msg/s offered",
        &hist,
        "≤ 5 ms",
        "≤ 20 ms",
    ));
    b.delete().await;
    out
}
