//! Figures against a real NATS server with JetStream (`OUTBOX_NATS_URL`,
//! else the local default if it answers): the relay draining to a stream
//! beside a bare async-nats publisher with the same continuous window of
//! awaited acknowledgements, and commit → acknowledgement latency at 1k
//! msg/s offered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use outbox::memory::MemoryStore;
use outbox::{MessageId, MessageKind, NewMessage, Relay, Timestamp};
use outbox_nats::async_nats::jetstream::{self, message::PublishMessage};
use outbox_nats::async_nats::{self, HeaderMap};
use outbox_nats::{NatsTransport, StreamSpec};

use crate::common::{Figure, commit_to_ack_latency, drain_rate, latency_rows, not_measured};

const PAYLOAD: usize = 200;

fn payload(i: usize) -> Vec<u8> {
    let mut p = vec![b'x'; PAYLOAD];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

/// The bench's own stream (file storage) on subject `{name}.bench`.
struct Server {
    url: String,
    name: String,
    js: jetstream::Context,
}

impl Server {
    async fn connect(url: &str) -> Result<Server, String> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let name = format!("BENCH_{}", MessageId::new().to_string().replace('-', ""));
        let js = jetstream::new(client);
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot create a stream: {e}"))?;
        Ok(Server {
            url: url.to_owned(),
            name,
            js,
        })
    }

    async fn purge(&self) {
        self.js
            .get_stream(&self.name)
            .await
            .unwrap()
            .purge()
            .await
            .unwrap();
    }

    async fn delete(&self) {
        let _ = self.js.delete_stream(&self.name).await;
    }

    async fn transport(&self, window: usize) -> NatsTransport {
        let transport = NatsTransport::connect(
            NatsTransport::builder(self.url.clone())
                .window(window)
                .subject_prefix(self.name.clone()),
        )
        .await
        .unwrap();
        transport
            .declare(&StreamSpec::new(
                self.name.as_str(),
                [format!("{}.>", self.name)],
            ))
            .await
            .unwrap();
        transport
    }
}

/// Bare async-nats: publish with the relay's headers, at most `window`
/// acknowledgements awaited at once, a publish going out as each
/// acknowledgement comes back (acks read on the same task: at most
/// `window` are held, so the client's window always has a permit free).
async fn bare_async_nats(s: &Server, n: usize, window: usize) -> f64 {
    let client = async_nats::connect(s.url.as_str()).await.unwrap();
    let js = jetstream::ContextBuilder::new()
        .max_ack_inflight(window)
        .backpressure_on_inflight(true)
        .build(client);
    let subject = format!("{}.Bench", s.name);
    let start = Instant::now();
    let mut acks = FuturesUnordered::new();
    let mut sent = 0;
    while sent < n || !acks.is_empty() {
        if sent < n && acks.len() < window {
            // The headers the relay's messages carry, so that both send
            // the same bytes.
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", MessageId::new().to_string().as_str());
            headers.insert("Outbox-Type", "Bench");
            headers.insert("Content-Type", "application/octet-stream");
            headers.insert(
                "Outbox-Created-At",
                Timestamp::now().as_millis().to_string().as_str(),
            );
            let publish = PublishMessage::build()
                .payload(payload(sent).into())
                .headers(headers);
            let ack = js.send_publish(subject.clone(), publish).await.unwrap();
            acks.push(ack.into_future());
            sent += 1;
            while let Some(Some(ack)) = acks.next().now_or_never() {
                ack.unwrap();
            }
        } else if let Some(ack) = acks.next().await {
            ack.unwrap();
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// `NatsTransport` alone, driven as the relay drives it (sends of a
/// quarter of the window, four in flight, the next as one ends): where the
/// relay's difference to bare async-nats goes.
async fn transport_alone(s: &Server, n: usize, window: usize) -> f64 {
    use outbox::Transport;
    let transport = s.transport(window).await;
    let messages: Vec<outbox::Message> = (0..n)
        .map(|i| integration(i).into_message(Timestamp::now()).unwrap())
        .collect();
    let group = window.div_ceil(4).max(1);
    let start = Instant::now();
    let mut chunks = messages.chunks(group);
    let mut sends = FuturesUnordered::new();
    for chunk in chunks.by_ref().take(4) {
        sends.push(transport.send(chunk));
    }
    while let Some(outcomes) = sends.next().await {
        assert!(outcomes.iter().all(|o| *o == outbox::Outcome::Delivered));
        if let Some(chunk) = chunks.next() {
            sends.push(transport.send(chunk));
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn integration(i: usize) -> NewMessage {
    NewMessage::new(MessageKind::Integration, "Bench", payload(i))
}

async fn relay_memory(s: &Server, n: usize, window: usize) -> f64 {
    let store = MemoryStore::new();
    crate::memory::fill_with(&store, n, integration);
    let relay = Relay::builder(store)
        .transport(s.transport(window).await)
        .concurrency(window)
        .batch_size(window);
    drain_rate(relay, n).await
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    let url = match outbox_api::testing::services::find(&outbox_nats::testing::NATS) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("NATS figures", &how)],
    };
    let s = match Server::connect(&url).await {
        Ok(s) => s,
        Err(e) => return vec![not_measured("NATS figures", &e)],
    };
    let n = if quick { 5_000 } else { 30_000 };
    let rounds = if quick { 1 } else { 3 };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut out = Vec::new();
    for window in [100, 500] {
        // The server's rate drifts within a run: bare and relay take
        // turns, `rounds` times; each figure is the median of its runs.
        let (mut bares, mut relays, mut alone) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            s.purge().await;
            bares.push(bare_async_nats(&s, n, window).await);
            s.purge().await;
            relays.push(relay_memory(&s, n, window).await);
            s.purge().await;
            alone.push(transport_alone(&s, n, window).await);
        }
        let bare = median(bares.clone());
        out.push(
            Figure::new(
                format!(
                    "drain {n} to NATS JetStream (file storage, acks, Nats-Msg-Id), memory store, window {window}, median of {rounds}"
                ),
                median(relays),
                "msg/s",
                "≥ 0.9 × bare async-nats",
            )
            .beside(
                format!("bare async-nats, acks, continuous window {window}"),
                bare,
            ),
        );
        out.push(
            Figure::new(
                format!(
                    "… NatsTransport alone, sends of {} (a quarter of window {window}), four in flight, median of {rounds}",
                    window.div_ceil(4)
                ),
                median(alone),
                "msg/s",
                "— (where the difference goes)",
            )
            .beside(
                format!("bare async-nats, acks, continuous window {window}"),
                bare,
            ),
        );
    }
    s.purge().await;
    let hist = commit_to_ack_latency(
        Arc::new(s.transport(100).await),
        integration,
        1000,
        Duration::from_secs(if quick { 2 } else { 10 }),
    )
    .await;
    out.extend(latency_rows(
        "commit → JetStream ack, SQLite, 1k msg/s offered",
        &hist,
        "≤ 5 ms",
        "≤ 20 ms",
    ));
    s.delete().await;
    out.extend(crate::consumer::nats::figures(quick).await);
    out
}
