//! The receiving side over NATS JetStream: `NatsConsumer` draining a stream
//! into the inbox (SQLite, PostgreSQL) beside a bare async-nats pull
//! consumer that runs the same handler work in its own transaction, then
//! acknowledges — same stream, same number of unacknowledged messages.

use outbox_nats::async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull};
use outbox_nats::async_nats::{self, HeaderMap};
use outbox_nats::{NatsConfig, NatsConsumer};

use super::*;

/// The run's own stream (`{name}.>`, file storage) filled with `n`
/// messages as the relay publishes them, and a dead-letter stream.
async fn filled_stream(js: &jetstream::Context, n: usize) -> String {
    let name = outbox_nats::testing::unique_name("bench_consume");
    for (stream, subjects) in [
        (name.clone(), format!("{name}.>")),
        (format!("{name}_DEAD"), format!("{name}-dead.>")),
    ] {
        js.create_stream(jetstream::stream::Config {
            name: stream,
            subjects: vec![subjects],
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let subject = format!("{name}.Bench");
    for start in (0..n).step_by(1000) {
        let mut acks = Vec::new();
        for i in start..(start + 1000).min(n) {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", MessageId::new().to_string().as_str());
            headers.insert("Outbox-Type", "Bench");
            acks.push(
                js.publish_with_headers(subject.clone(), headers, payload(i).into())
                    .await
                    .unwrap(),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    name
}

async fn delete_streams(js: &jetstream::Context, name: &str) {
    let _ = js.delete_stream(name).await;
    let _ = js.delete_stream(format!("{name}_DEAD")).await;
}

/// `NatsConsumer` drains `n` messages into the inbox: msg/s.
async fn inbox_run(url: &str, js: &jetstream::Context, db: &Db, n: usize) -> f64 {
    let name = filled_stream(js, n).await;
    let tally = Arc::new(Tally::default());
    let builder = NatsConsumer::builder(NatsConfig::new(url), name.as_str(), "bench")
        .dead_letter_subject(format!("{name}-dead.bench"))
        .max_ack_pending(usize::from(PREFETCH));
    let handle = match db.inbox(Arc::clone(&tally)) {
        BenchInbox::Sqlite(inbox, handler) => builder.spawn(inbox, handler).await.unwrap(),
        BenchInbox::Postgres(inbox, handler) => builder.spawn(inbox, handler).await.unwrap(),
    };
    tally.wait_for(n as u64).await;
    handle.shutdown().await;
    delete_streams(js, &name).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

/// A bare async-nats pull consumer (same `max_ack_pending`) drains `n`
/// messages, running the same handler work in its own transaction, then
/// acknowledging: msg/s.
async fn bare_run(js: &jetstream::Context, db: &Db, n: usize) -> f64 {
    let name = filled_stream(js, n).await;
    let tally = Tally::default();
    let stream = js.get_stream(&name).await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("bare".into()),
            ack_policy: AckPolicy::Explicit,
            max_ack_pending: i64::from(PREFETCH),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let id_header: async_nats::HeaderName = "Nats-Msg-Id".parse().unwrap();
    while tally.n.load(Ordering::SeqCst) < n as u64 {
        let m = messages.next().await.expect("a message").unwrap();
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(id_header.clone()))
            .map(|v| v.as_str().to_owned())
            .unwrap();
        db.bare_handle(&id, m.payload.len(), &tally, false).await;
        m.ack().await.unwrap();
    }
    delete_streams(js, &name).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    use outbox_api::testing::services::find;
    let url = match find(&outbox_nats::testing::NATS) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("NATS consumer figures", &how)],
    };
    let pg = find(&outbox_postgres::testing::POSTGRES);
    let js = match async_nats::connect(url.as_str()).await {
        Ok(client) => jetstream::new(client),
        Err(e) => return vec![not_measured("NATS consumer figures", &e.to_string())],
    };
    let n = if quick { 500 } else { 10_000 };
    let rounds = if quick { 1 } else { 3 };
    let mut out = Vec::new();
    for postgres in [false, true] {
        if let (true, Err(how)) = (postgres, &pg) {
            out.push(not_measured("NATS consumer figures on PostgreSQL", how));
            continue;
        }
        let fresh = async || {
            if postgres {
                Db::postgres().await
            } else {
                Db::sqlite().await
            }
        };
        // Bare and inbox take turns, `rounds` times, on fresh databases and
        // streams; each figure is the median of its runs.
        let (mut bares, mut inboxes) = (Vec::new(), Vec::new());
        let mut name = "";
        for _ in 0..rounds {
            let db = fresh().await;
            name = db.name();
            bares.push(bare_run(&js, &db, n).await);
            inboxes.push(inbox_run(&url, &js, &fresh().await, n).await);
        }
        out.push(
            Figure::new(
                format!(
                    "NatsConsumer, {name} inbox, drain {n} (file stream, max_ack_pending {PREFETCH}, handler: insert one row), 1 consumer, median of {rounds}"
                ),
                median(inboxes),
                "msg/s",
                "≥ 0.8 × bare async-nats",
            )
            .beside(
                "bare async-nats pull consumer: same handler in its own transaction, then ack",
                median(bares),
            ),
        );
    }
    out
}
