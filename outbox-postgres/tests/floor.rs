//! The claim's floor (src/floor.rs): under a long transaction claims do not
//! walk the index entries of completed messages, and the floor never rises
//! past a message that can still commit or become pending again.

use std::time::Duration;

use outbox_api::testing::wait_until;
use outbox_api::{FailOutcome, Failure, MessageKind, OperatorStore, Store, Timestamp};
use outbox_postgres::sqlx::{self, AssertSqlSafe, Connection, PgConnection, Row};
use outbox_postgres::testing::{PgUnderTest, claim_request as claim, test_message as msg};

const DEADLINE: Duration = Duration::from_secs(30);

/// A claim that takes nothing (every message is a domain message) but, like
/// every claim, gives the floor its step when one is due.
async fn tend(f: &PgUnderTest) {
    let none = claim(1).with_kind(Some(MessageKind::Integration));
    assert!(f.pg().claim(&none).await.unwrap().is_empty());
}

/// Tends the floor until it reaches at least `seq`.
async fn floor_reaches(f: &PgUnderTest, seq: i64) {
    wait_until(&format!("the floor reaches {seq}"), DEADLINE, || async {
        tend(f).await;
        f.pg().claim_floor().0 >= seq
    })
    .await;
}

/// The lowest pending `seq`, if any.
async fn lowest_pending(f: &PgUnderTest) -> Option<i64> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        r#"SELECT min(seq) FROM "{}".test_outbox WHERE state = 'pending'"#,
        f.schema()
    )))
    .fetch_one(f.pool())
    .await
    .unwrap()
}

async fn seq_of(f: &PgUnderTest, payload: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        r#"SELECT seq FROM "{}".test_outbox WHERE payload = $1"#,
        f.schema()
    )))
    .bind(payload.as_bytes())
    .fetch_one(f.pool())
    .await
    .unwrap()
}

/// Completes every message the claims give until `n` are done.
async fn complete(f: &PgUnderTest, n: usize) {
    let mut done = 0;
    while done < n {
        let batch = f.pg().claim(&claim(500.min(n - done))).await.unwrap();
        assert!(!batch.is_empty(), "{done} of {n} completed, then nothing");
        let ids: Vec<_> = batch.iter().map(|m| m.id).collect();
        f.pg().complete(&ids, Timestamp::now()).await.unwrap();
        done += ids.len();
    }
}

async fn enqueue(f: &PgUnderTest, from: usize, n: usize) {
    let mut tx = f.pool().begin().await.unwrap();
    f.pg()
        .outbox()
        .enqueue_many(
            &mut tx,
            (from..from + n)
                .map(|i| {
                    let m = msg(i);
                    if i % 3 == 0 {
                        m.key(format!("k{}", i % 20))
                    } else {
                        m
                    }
                })
                .collect(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// A REPEATABLE READ transaction that has taken its snapshot: vacuum may not
/// remove what completes after this, for as long as it stays open.
async fn pin_xmin(f: &PgUnderTest) -> PgConnection {
    let mut pin = PgConnection::connect(f.url()).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM "{}".test_outbox"#,
        f.schema()
    )))
    .execute(&mut pin)
    .await
    .unwrap();
    pin
}

#[tokio::test]
async fn under_a_long_transaction_claims_do_not_walk_completed_messages() {
    let f = PgUnderTest::fresh(None).await;
    enqueue(&f, 0, 14_000).await;
    let pin = pin_xmin(&f).await;
    complete(&f, 12_000).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"VACUUM "{}".test_outbox"#,
        f.schema()
    )))
    .execute(f.pool())
    .await
    .unwrap();
    floor_reaches(&f, lowest_pending(&f).await.unwrap()).await;

    let (from_start, plan_from_start) = f.claim_buffers((0, -1), 20).await;
    let (from_floor, plan) = f.claim_buffers(f.pg().claim_floor(), 20).await;
    println!("a claim of 20: {from_floor} buffers from the floor, {from_start} from the start");
    // The premise: vacuum kept the 12,000 completed messages' entries, and a
    // walk from the start steps over them.
    assert!(
        from_start > 4_000,
        "{from_start} buffers\n{plan_from_start}"
    );
    assert!(
        from_floor * 10 < from_start,
        "from the floor {from_floor} buffers, from the start {from_start}\n{plan}"
    );
    assert!(plan.contains("test_outbox_pending_idx"), "{plan}");
    drop(pin);
    // What is left is claimed, in order, from the floor.
    let rest = f.pg().claim(&claim(2_000)).await.unwrap();
    assert_eq!(rest.len(), 2_000);
}

#[tokio::test]
async fn the_floor_waits_for_a_transaction_that_drew_a_lower_seq() {
    let f = PgUnderTest::fresh(None).await;
    enqueue(&f, 0, 10).await;
    complete(&f, 10).await;
    // Nothing is pending: the floor rises past every seq drawn.
    assert_eq!(lowest_pending(&f).await, None);
    floor_reaches(&f, 11).await;

    // An application transaction enqueues and stays open …
    let mut open = f.pool().begin().await.unwrap();
    f.pg()
        .outbox()
        .enqueue(&mut open, msg(1_000))
        .await
        .unwrap();
    let held = seq_of_uncommitted(&mut open, &f).await;
    // … while later messages commit and complete, and the floor is tended.
    for round in 0..20 {
        enqueue(&f, 2_000 + round * 10, 10).await;
        complete(&f, 10).await;
        tend(&f).await;
        assert!(
            f.pg().claim_floor().0 <= held,
            "the floor {:?} passed seq {held} of an open transaction",
            f.pg().claim_floor()
        );
    }
    open.commit().await.unwrap();
    let claimed = f.pg().claim(&claim(10)).await.unwrap();
    assert_eq!(
        claimed
            .iter()
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect::<Vec<_>>(),
        vec!["1000"]
    );
}

async fn seq_of_uncommitted(conn: &mut PgConnection, f: &PgUnderTest) -> i64 {
    sqlx::query(AssertSqlSafe(format!(
        r#"SELECT seq FROM "{}".test_outbox WHERE payload = $1"#,
        f.schema()
    )))
    .bind(b"1000".as_slice())
    .fetch_one(conn)
    .await
    .unwrap()
    .get(0)
}

#[tokio::test]
async fn a_retried_message_below_the_floor_is_claimed() {
    let f = PgUnderTest::fresh(None).await;
    enqueue(&f, 0, 1).await;
    let poison = f.pg().claim(&claim(1)).await.unwrap().remove(0);
    let failed = f
        .pg()
        .fail(&Failure::new(
            "w",
            poison.id,
            "broken",
            Timestamp::now(),
            1,
            Timestamp::now(),
        ))
        .await
        .unwrap();
    assert!(matches!(failed, FailOutcome::Poisoned { .. }), "{failed:?}");
    let poisoned_seq = seq_of(&f, "0").await;
    enqueue(&f, 1, 50).await;
    complete(&f, 50).await;
    floor_reaches(&f, poisoned_seq + 1).await;

    f.pg()
        .retry(poison.id, "test", Timestamp::now())
        .await
        .unwrap();
    // The floor the relay holds is above it; the retry's generation makes
    // the claim look from the start.
    assert!(f.pg().claim_floor().0 > poisoned_seq);
    let claimed = f.pg().claim(&claim(10)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].id, poison.id);
}

/// With a store that deletes what it completes
/// (`PgStoreBuilder::keep_processed(false)`), the floor rises past the
/// deleted messages as past processed ones.
#[tokio::test]
async fn the_floor_rises_past_deleted_messages() {
    let f = PgUnderTest::fresh_with(None, |b| b.keep_processed(false)).await;
    enqueue(&f, 0, 20).await;
    complete(&f, 15).await;
    assert_eq!(
        f.outbox_rows().await,
        5,
        "the completed messages are deleted"
    );
    floor_reaches(&f, lowest_pending(&f).await.unwrap()).await;
    let rest = f.pg().claim(&claim(10)).await.unwrap();
    assert_eq!(
        rest.len(),
        5,
        "the messages left are claimed from the floor"
    );
}
