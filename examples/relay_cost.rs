//! The relay engine's own cost per message, for a profiler: a drain of `N`
//! messages from the in-memory store to a no-op handler (or a no-op
//! transport), beside the same store's claim + complete calls with no relay
//! around them. The difference is what the engine spends per message
//! (docs/performance.md, "The engine's cost per message").
//!
//! ```text
//! cargo build --release --example relay_cost
//! valgrind --tool=callgrind --callgrind-out-file=relay.out \
//!     target/release/examples/relay_cost relay 20000 20
//! valgrind --tool=callgrind --callgrind-out-file=bare.out \
//!     target/release/examples/relay_cost bare 20000 20
//! ```
//!
//! Arguments: `relay|transport|bare|sqlite|sqlite-bare N BATCH`
//! (`transport`: integration messages to a transport that delivers at
//! once; `sqlite`: the relay on a SQLite file in a temporary directory,
//! `sqlite-bare` the store's own claim + complete calls on it). Prints the
//! messages delivered and the wall-clock rate.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox::memory::MemoryStore;
use outbox::{
    ClaimRequest, Handlers, Message, MessageId, MessageKind, NewMessage, Outcome, Relay, Store,
    Timestamp, Transport,
};

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// A transport that delivers every message at once.
#[derive(Debug)]
struct Delivering;

#[async_trait]
impl Transport for Delivering {
    async fn send(&self, messages: &[Message]) -> Vec<Outcome> {
        messages.iter().map(|_| Outcome::Delivered).collect()
    }

    async fn probe(&self) -> Result<(), outbox::Error> {
        Ok(())
    }
}

fn fill(store: &MemoryStore, n: usize, kind: MessageKind) -> Result<(), Failure> {
    let mut tx = store.begin();
    for i in 0..n {
        tx.enqueue(NewMessage::new(kind, "Cost", i.to_le_bytes().to_vec()))?;
    }
    tx.commit()?;
    Ok(())
}

/// A SQLite store in `dir` holding `n` domain messages, enqueued in
/// transactions of 10,000 on the application's own rusqlite connection.
async fn sqlite(dir: &std::path::Path, n: usize) -> Result<outbox_sqlite::SqliteStore, Failure> {
    let store = outbox_sqlite::SqliteStore::connect(dir.join("cost.db")).await?;
    store.migrate().await?;
    let mut conn = outbox_sqlite::rusqlite::Connection::open(store.path())?;
    let outbox = store.outbox();
    for start in (0..n).step_by(10_000) {
        let tx = conn.transaction()?;
        for i in start..(start + 10_000).min(n) {
            outbox.enqueue_rusqlite(
                &tx,
                NewMessage::new(MessageKind::Domain, "Cost", i.to_le_bytes().to_vec()),
            )?;
        }
        tx.commit()?;
    }
    Ok(store)
}

/// A relay with the no-op handler and the delivering transport.
fn relay<S: Store>(store: S, batch: usize) -> Result<Relay, Failure> {
    let handlers = Handlers::new().on_message("Cost", move |_m: &Message| async {
        Ok::<_, std::io::Error>(())
    });
    Ok(Relay::builder(store)
        .dispatcher(handlers)
        .transport(Delivering)
        .batch_size(batch)
        .build()?)
}

async fn bare(store: &dyn Store, batch: usize) -> Result<usize, Failure> {
    let mut done = 0;
    loop {
        let now = Timestamp::now();
        let claimed = store
            .claim(&ClaimRequest::new(
                "bare",
                batch,
                Duration::from_secs(60),
                now,
            ))
            .await?;
        if claimed.is_empty() {
            return Ok(done);
        }
        let ids: Vec<MessageId> = claimed.iter().map(|m| m.id).collect();
        store.complete(&ids, now).await?;
        done += ids.len();
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: relay_cost relay|transport|bare|sqlite|sqlite-bare N BATCH";
    let (mode, n, batch) = match args.as_slice() {
        [_, mode, n, batch] => (mode.as_str(), n.parse::<usize>()?, batch.parse::<usize>()?),
        _ => return Err(usage.into()),
    };
    let dir = std::env::temp_dir().join(format!("relay-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (store, sqlite): (MemoryStore, Option<outbox_sqlite::SqliteStore>) =
        if mode.starts_with("sqlite") {
            (MemoryStore::new(), Some(sqlite(&dir, n).await?))
        } else {
            let store = MemoryStore::new();
            let kind = if mode == "transport" {
                MessageKind::Integration
            } else {
                MessageKind::Domain
            };
            fill(&store, n, kind)?;
            (store, None)
        };
    let start = Instant::now();
    let delivered = match (mode, sqlite) {
        ("bare", _) => bare(&store, batch).await?,
        ("sqlite-bare", Some(sqlite)) => bare(&sqlite, batch).await?,
        ("relay" | "transport", _) => relay(store, batch)?.drain().await?.delivered as usize,
        ("sqlite", Some(sqlite)) => relay(sqlite, batch)?.drain().await?.delivered as usize,
        _ => return Err(usage.into()),
    };
    let secs = start.elapsed().as_secs_f64();
    if delivered != n {
        return Err(format!("delivered {delivered} of {n}").into());
    }
    println!("{mode}: {delivered} messages, {:.0} msg/s", n as f64 / secs);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
