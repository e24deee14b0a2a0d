//! One throughput run: a queue filled before the consumers start, drained by RabbitConsumers into the inbox or by bare lapin consumers.

use super::*;

/// A quorum queue of the run's own, filled with `n` persistent messages
/// (message id, type, as the relay publishes them).
pub(super) async fn filled_queue(conn: &Connection, n: usize) -> String {
    let queue = outbox_rabbitmq::testing::unique_name("bench-consume");
    let ch = conn.create_channel().await.unwrap();
    Topology::new()
        .queue(queue.as_str())
        .declare_on(&ch)
        .await
        .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for start in (0..n).step_by(1000) {
        let mut confirms = Vec::new();
        for i in start..(start + 1000).min(n) {
            let props = BasicProperties::default()
                .with_message_id(MessageId::new().to_string().into())
                .with_type("Bench".into())
                .with_content_type("application/octet-stream".into())
                .with_delivery_mode(2);
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
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
    }
    queue
}

pub(super) async fn delete_queue(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
}

/// `consumers` RabbitConsumers drain `n` messages into the inbox: msg/s.
pub(super) async fn inbox_run(
    url: &str,
    conn: &Connection,
    db: &Db,
    n: usize,
    consumers: usize,
) -> f64 {
    let queue = filled_queue(conn, n).await;
    let tally = Arc::new(Tally::default());
    let mut handles = Vec::new();
    for _ in 0..consumers {
        let builder = RabbitConsumer::builder(url, queue.as_str());
        handles.push(db.consumer(builder, Arc::clone(&tally)).await);
    }
    tally.wait_for(n as u64).await;
    for h in &handles {
        h.shutdown().await;
    }
    delete_queue(conn, &queue).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

/// `consumers` bare lapin consumers (a connection each, same prefetch)
/// drain `n` messages, running the same handler work (with `inbox`, after
/// the inbox's own statement), then acking: msg/s.
pub(super) async fn bare_run(
    url: &str,
    conn: &Connection,
    db: Arc<Db>,
    n: usize,
    consumers: usize,
    inbox: bool,
) -> f64 {
    let queue = filled_queue(conn, n).await;
    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for c in 0..consumers {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .unwrap();
        let mut deliveries = ch
            .basic_consume(
                queue.as_str().into(),
                format!("bare-{c}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let (db, tally) = (Arc::clone(&db), Arc::clone(&tally));
        let total = n as u64;
        tasks.push(tokio::spawn(async move {
            while tally.n.load(Ordering::SeqCst) < total {
                let next = tokio::time::timeout(Duration::from_millis(50), deliveries.next());
                let Ok(Some(delivery)) = next.await else {
                    continue;
                };
                let delivery = delivery.unwrap();
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap();
                db.bare_handle(&id, delivery.data.len(), &tally, inbox)
                    .await;
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .unwrap();
            }
            let _ = conn.close(200, "bench done".into()).await;
        }));
    }
    tally.wait_for(n as u64).await;
    for t in tasks {
        t.await.unwrap();
    }
    delete_queue(conn, &queue).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}
