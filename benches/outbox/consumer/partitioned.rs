//! The partitioned topology: throughput by replicas, and redelivery after a consumer child process is SIGKILLed.

use super::*;

/// A partitioned topology of the run's own: a direct exchange and
/// [`PARTITIONS`] partition queues bound for `Bench`.
pub(super) struct PartitionedSetup {
    exchange: String,
    partitions: Partitions,
    transport: RabbitTransport,
}

impl PartitionedSetup {
    async fn new(url: &str, count: u16) -> PartitionedSetup {
        let exchange = outbox_rabbitmq::testing::unique_name("bench-px");
        let partitions =
            Partitions::new(outbox_rabbitmq::testing::unique_name("bench-part"), count).unwrap();
        let transport = RabbitTransport::builder(url)
            .default_exchange(exchange.as_str())
            .partitioned_exchange(exchange.as_str(), count)
            .build()
            .await
            .unwrap();
        transport
            .declare(
                &Topology::new()
                    .exchange(exchange.as_str(), ExchangeType::Direct)
                    .partitioned(&partitions)
                    .bind_partitioned(&partitions, exchange.as_str(), "Bench"),
            )
            .await
            .unwrap();
        PartitionedSetup {
            exchange,
            partitions,
            transport,
        }
    }

    /// Publishes `keys.len()` messages with these keys, as the relay would.
    async fn send(&self, keys: &[String]) {
        let messages: Vec<Message> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                NewMessage::new(MessageKind::Integration, "Bench", payload(i))
                    .key(k.as_str())
                    .into_message(Timestamp::now())
                    .unwrap()
            })
            .collect();
        for chunk in messages.chunks(500) {
            let outcomes = self.transport.send(chunk).await;
            assert!(outcomes.iter().all(|o| *o == Outcome::Delivered));
        }
    }

    async fn delete(&self, conn: &Connection) {
        let ch = conn.create_channel().await.unwrap();
        for q in self.partitions.queues() {
            let _ = ch
                .queue_delete(
                    format!("{q}.owner").as_str().into(),
                    QueueDeleteOptions::default(),
                )
                .await;
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = ch
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

/// `replicas` partitioned consumers (PostgreSQL inbox) drain `n` keyed
/// messages from [`PARTITIONS`] partitions: msg/s.
pub(super) async fn partitioned_run(url: &str, conn: &Connection, n: usize, replicas: u16) -> f64 {
    let db = Db::postgres().await;
    let setup = PartitionedSetup::new(url, PARTITIONS).await;
    let keys: Vec<String> = (0..n).map(|i| format!("key-{}", i % 600)).collect();
    setup.send(&keys).await;
    let tally = Arc::new(Tally::default());
    let spawns = (0..replicas).map(|i| {
        let builder = RabbitConsumer::partitioned(url, setup.partitions.clone())
            .replica(i, replicas)
            .takeover_check(Duration::from_secs(5));
        db.consumer(builder, Arc::clone(&tally))
    });
    let handles = futures_util::future::join_all(spawns).await;
    tally.wait_for(n as u64).await;
    for h in &handles {
        h.shutdown().await;
    }
    setup.delete(conn).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

/// The kill figure's child: replica 0 of 2 on the partitions, with a
/// handler that never returns (it holds its deliveries, unacknowledged,
/// until it is killed). Prints `consuming` once it consumes its own
/// partitions and `holding` once its handler runs.
pub fn victim_child(spec: &str) {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [amqp, pg, schema, prefix] = parts[..] else {
        panic!("{CHILD_ENV}: want `<amqp url> <pg url> <schema> <prefix>`, got `{spec}`");
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = outbox_postgres::PgStore::builder(pg)
            .schema(schema)
            .table("test_outbox")
            .inbox_table("test_inbox")
            .max_connections(2)
            .connect()
            .await
            .unwrap();
        let pool = store.pool().clone();
        let handler = handler_fn(
            move |_msg: &Received, _tx: &mut PgConnection| -> HandlerFuture<'_> {
                Box::pin(async move {
                    println!("holding");
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(())
                })
            },
        );
        let partitions = Partitions::new(prefix, 2).unwrap();
        let handle = RabbitConsumer::partitioned(amqp, partitions)
            .consumer_name("bench")
            .replica(0, 2)
            .prefetch(PREFETCH)
            .spawn(outbox_postgres::PgInbox::new(store.outbox(), pool), handler)
            .await
            .unwrap();
        while handle.consuming().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!("consuming");
        std::future::pending::<()>().await;
    });
}

/// One kill: the child (replica 0 of 2 partitions) holds `m` deliveries of
/// its partition; it is SIGKILLed; replica 1 (here, standing by with the
/// default takeover check) takes the partition over. Returns (seconds from
/// the kill to the first of them handled again, to the last).
pub(super) async fn kill_once(url: &str, conn: &Connection, m: usize) -> (f64, f64) {
    use std::io::BufRead;
    let db = Db::postgres().await;
    let Db::Postgres(f) = &db else { unreachable!() };
    let setup = PartitionedSetup::new(url, 2).await;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env(
            CHILD_ENV,
            format!(
                "{url} {} {} {}",
                f.url(),
                f.schema(),
                setup.partitions.prefix()
            ),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the consumer child");
    let (tx, lines) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let wait_line = |want: &str| {
        let line = lines.recv_timeout(DEADLINE).expect("the child's line");
        assert_eq!(line, want);
    };
    tokio::task::block_in_place(|| wait_line("consuming"));
    let tally = Arc::new(Tally::default());
    let builder = RabbitConsumer::partitioned(url, setup.partitions.clone()).replica(1, 2);
    let survivor = db.consumer(builder, Arc::clone(&tally)).await;
    let deadline = Instant::now() + DEADLINE;
    while survivor.consuming().is_empty() {
        assert!(Instant::now() < deadline, "the survivor never consumed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Keys of the child's partition (0) only.
    let keys: Vec<String> = (0..)
        .map(|i| format!("key-{i}"))
        .filter(|k| Partitions::of_key(k, 2) == 0)
        .take(m)
        .collect();
    setup.send(&keys).await;
    tokio::task::block_in_place(|| wait_line("holding"));
    let killed_at = Instant::now();
    child.kill().expect("SIGKILL the child");
    let _ = child.wait();
    tally.wait_for(m as u64).await;
    let first = tally.first.lock().unwrap().unwrap();
    let last = tally.last.lock().unwrap().unwrap();
    survivor.shutdown().await;
    setup.delete(conn).await;
    assert_eq!(db.effects().await, m as i64, "every effect once");
    (
        first.duration_since(killed_at).as_secs_f64(),
        last.duration_since(killed_at).as_secs_f64(),
    )
}
