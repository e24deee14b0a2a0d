//! A store that keeps nothing it completed
//! (`PgStoreBuilder::keep_processed(false)`): a completion deletes the
//! message, and every rule that reads "processed" reads a deleted message
//! the same way — its key's next message is claimable, a poisoned message
//! stays for an operator, the backlog moves on (docs/rules.md,
//! "Completion"; the floor: `floor.rs`).

use outbox_api::testing::StoreUnderTest;
use outbox_api::{FailOutcome, Failure, MessageState, OperatorStore, Store, Timestamp};
use outbox_postgres::testing::{
    PgUnderTest, claim_request as claim, payloads, test_message as msg,
};

#[tokio::test]
async fn a_completion_deletes_and_a_deleted_message_counts_as_processed() {
    let f = PgUnderTest::fresh_with(None, |b| b.keep_processed(false)).await;
    let ids = f
        .try_enqueue(vec![
            msg(1).key("k"),
            msg(2).key("k"),
            msg(3).key("k"),
            msg(4),
        ])
        .await
        .unwrap();

    // The key's first message leased: its later ones wait behind it.
    let first = f.pg().claim(&claim(1)).await.unwrap();
    assert_eq!(payloads(&first), ["1"]);
    assert_eq!(payloads(&f.pg().claim(&claim(10)).await.unwrap()), ["4"]);

    f.pg()
        .complete(&[ids[0], ids[3]], Timestamp::now())
        .await
        .unwrap();
    assert_eq!(
        f.outbox_rows().await,
        2,
        "the completed messages are deleted"
    );
    assert!(f.pg().get(ids[0]).await.unwrap().is_none());
    let stats = f.pg().stats().await.unwrap();
    assert_eq!((stats.pending, stats.processed), (2, 0));
    // Completing again (a relay whose lease expired) changes nothing.
    f.pg().complete(&[ids[0]], Timestamp::now()).await.unwrap();

    // Deleted, the first message no longer stands in its key's way.
    let second = f.pg().claim(&claim(1)).await.unwrap();
    assert_eq!(payloads(&second), ["2"]);

    // A failure is recorded as ever; a poisoned message stays, and parks
    // its key's later messages.
    let poisoned = f
        .pg()
        .fail(&Failure::new(
            "w",
            ids[1],
            "broken",
            Timestamp::now(),
            1,
            Timestamp::now(),
        ))
        .await
        .unwrap();
    assert_eq!(poisoned, FailOutcome::Poisoned { attempts: 1 });
    let kept = f
        .pg()
        .get(ids[1])
        .await
        .unwrap()
        .expect("a poisoned message is kept");
    assert_eq!(kept.state, MessageState::Poisoned);
    assert!(f.pg().claim(&claim(10)).await.unwrap().is_empty());
    assert_eq!(f.outbox_rows().await, 2);
}
