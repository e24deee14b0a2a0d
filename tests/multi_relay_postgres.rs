//! Several relays on one PostgreSQL table while several producers write
//! (`docs/rules.md#several-relays`, `docs/rules.md#ordering`): each message
//! is delivered once while leases hold, a key's messages are delivered in
//! the order their transactions committed, and the work is spread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::{Handlers, Message, MessageKind, NewMessage, Relay, Store};
use outbox_postgres::testing::PgUnderTest;
use outbox_postgres::{PgStore, sqlx};

const RELAYS: usize = 4;
const PRODUCERS: usize = 4;
const MESSAGES: usize = 2_000;
const KEYS: usize = 24;

/// What the test records, under one lock each.
#[derive(Default)]
struct Record {
    /// Per key, message payloads in the order their transactions committed.
    committed: tokio::sync::Mutex<HashMap<String, Vec<String>>>,
    /// Per key, payloads in the order a handler started on them.
    delivered: Mutex<HashMap<String, Vec<String>>>,
    /// Deliveries per payload, and per relay.
    count: Mutex<HashMap<String, usize>>,
    per_relay: Mutex<Vec<usize>>,
    /// Keys in an open producer transaction, and how often a producer
    /// began writing a key another producer's open transaction had written.
    open: Mutex<HashMap<String, usize>>,
    contested: Mutex<usize>,
}

fn handlers(record: Arc<Record>, relay: usize) -> Handlers {
    Handlers::new().on_message("Keyed", move |m: &Message| {
        let payload = String::from_utf8_lossy(&m.payload).into_owned();
        let key = m.key.clone().expect("every message has a key");
        record
            .delivered
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .push(payload.clone());
        *record.count.lock().unwrap().entry(payload).or_default() += 1;
        record.per_relay.lock().unwrap()[relay] += 1;
        async { Ok::<_, std::io::Error>(()) }
    })
}

/// One producer: transactions of one to four messages on random keys,
/// written one by one or in one statement, held open for a moment before
/// the commit so that transactions overlap.
async fn produce(fixture: Arc<PgUnderTest>, store: PgStore, record: Arc<Record>, p: usize) {
    let outbox = store.outbox();
    let mut rng = fastrand::Rng::with_seed(p as u64 + 7);
    let mut n = 0;
    while n < MESSAGES / PRODUCERS {
        let size = rng.usize(1..=4).min(MESSAGES / PRODUCERS - n);
        let mut keys: Vec<String> = (0..size)
            .map(|_| format!("k{:02}", rng.usize(0..KEYS)))
            .collect();
        // A transaction enqueues its keys in byte order, as the crate docs
        // ask, so that the per-key locks never deadlock.
        keys.sort();
        let batch: Vec<(String, String)> = keys
            .into_iter()
            .enumerate()
            .map(|(i, key)| (key, format!("p{p}-{}", n + i)))
            .collect();
        n += size;
        {
            let mut open = record.open.lock().unwrap();
            for (key, _) in &batch {
                let writers = open.entry(key.clone()).or_default();
                if *writers > 0 {
                    *record.contested.lock().unwrap() += 1;
                }
                *writers += 1;
            }
        }
        let messages = || {
            batch.iter().map(|(key, payload)| {
                NewMessage::new(MessageKind::Domain, "Keyed", payload.clone().into_bytes())
                    .key(key.clone())
            })
        };
        let mut tx = fixture.pool().begin().await.unwrap();
        if rng.bool() {
            outbox
                .enqueue_many(&mut tx, messages().collect())
                .await
                .unwrap();
        } else {
            for m in messages() {
                outbox.enqueue(&mut tx, m).await.unwrap();
            }
        }
        // The rest of the business transaction.
        sqlx::query("SELECT pg_sleep($1)")
            .bind(rng.f64() * 0.003)
            .execute(&mut *tx)
            .await
            .unwrap();
        {
            // The commit and its record under one lock: the recorded order
            // is the commit order.
            let mut committed = record.committed.lock().await;
            tx.commit().await.unwrap();
            for (key, payload) in &batch {
                committed
                    .entry(key.clone())
                    .or_default()
                    .push(payload.clone());
            }
        }
        let mut open = record.open.lock().unwrap();
        for (key, _) in &batch {
            *open.get_mut(key).unwrap() -= 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_deliver_each_message_once_in_commit_order_per_key() {
    four_relays(true).await;
}

/// The same with stores that delete what they complete
/// (`PgStoreBuilder::keep_processed(false)`): a deleted message counts as
/// processed for its key's order, and nothing is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_that_delete_what_they_complete_keep_the_same_rules() {
    four_relays(false).await;
}

async fn four_relays(keep_processed: bool) {
    let fixture = Arc::new(PgUnderTest::fresh(None).await);
    // One store per relay, as if each ran in a process of its own.
    let mut stores = Vec::new();
    for _ in 0..RELAYS {
        stores.push(
            PgStore::builder(fixture.url())
                .schema(fixture.schema())
                .table(fixture.pg().table())
                .inbox_table(fixture.pg().inbox_table())
                .max_connections(4)
                .keep_processed(keep_processed)
                .connect()
                .await
                .unwrap(),
        );
    }
    let record = Arc::new(Record {
        per_relay: Mutex::new(vec![0; RELAYS]),
        ..Record::default()
    });
    let relays: Vec<_> = stores
        .iter()
        .enumerate()
        .map(|(r, store)| {
            Relay::builder(store.clone())
                .dispatcher(handlers(record.clone(), r))
                .worker_id(format!("multi-relay-{r}-keep-{keep_processed}"))
                .batch_size(10)
                .spawn()
                .unwrap()
        })
        .collect();
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            tokio::spawn(produce(
                fixture.clone(),
                stores[p % RELAYS].clone(),
                record.clone(),
                p,
            ))
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }
    let kept = if keep_processed { MESSAGES as u64 } else { 0 };
    outbox_api::testing::wait_until(
        "every message is processed",
        Duration::from_secs(60),
        || async {
            let stats = fixture.pg().stats().await.unwrap();
            stats.pending == 0 && stats.processed == kept
        },
    )
    .await;
    for relay in &relays {
        relay.shutdown().await;
    }
    assert_eq!(fixture.outbox_rows().await, kept, "rows left in the table");

    let committed = record.committed.lock().await;
    let count = record.count.lock().unwrap();
    assert_eq!(count.len(), MESSAGES, "every message was delivered");
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "delivered more than once while leases held: {twice:?}"
    );
    let delivered = record.delivered.lock().unwrap();
    assert_eq!(committed.len(), delivered.len());
    for (key, order) in committed.iter() {
        assert_eq!(
            delivered.get(key),
            Some(order),
            "key {key}: delivered in another order than committed"
        );
    }
    let contested = *record.contested.lock().unwrap();
    assert!(
        contested > 0,
        "no producer wrote a key while another one's transaction held it"
    );
    let per_relay = record.per_relay.lock().unwrap();
    assert!(
        per_relay.iter().all(|&n| n > 0),
        "every relay took part: {per_relay:?}"
    );
    println!("deliveries per relay: {per_relay:?}; contested key writes: {contested}");
}
