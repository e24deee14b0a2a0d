//! Enqueue through tokio-postgres (feature `tokio-postgres`, enabled by this
//! crate's dev-dependency on itself): the conformance suite with every
//! enqueue in a `tokio_postgres::Transaction`, and the specifics — commit,
//! rollback, batches, bad input refused with the kinds the sqlx path gives,
//! the post-commit announcement. Each test on a fresh schema.

use std::time::Duration;

use async_trait::async_trait;
use outbox_api::testing::StoreUnderTest;
use outbox_api::{ErrorKind, MessageId, MessageKind, NewMessage, OperatorStore, Result, Store};
use outbox_postgres::PreparedEnqueue;
use outbox_postgres::sqlx::postgres::PgListener;
use outbox_postgres::testing::{PgUnderTest, claim_request as claim, test_message as msg};
use outbox_postgres::tokio_postgres::{self, Client, NoTls};

/// A fresh schema, and the application's tokio-postgres connection (with
/// the enqueue statements prepared on it, for the suite that uses them).
struct TokioPgUnderTest {
    pg: PgUnderTest,
    client: tokio::sync::Mutex<Client>,
    prepared: Option<PreparedEnqueue>,
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .expect("tokio-postgres connects");
    tokio::spawn(connection);
    client
}

async fn sut() -> TokioPgUnderTest {
    let pg = PgUnderTest::fresh(None).await;
    let client = connect(pg.url()).await;
    TokioPgUnderTest {
        pg,
        client: tokio::sync::Mutex::new(client),
        prepared: None,
    }
}

/// The same, enqueueing through statements prepared once on the connection.
async fn sut_prepared() -> TokioPgUnderTest {
    let mut sut = sut().await;
    let client = sut.client.lock().await;
    let prepared = sut
        .pg
        .pg()
        .outbox()
        .prepare_tokio_postgres(&*client)
        .await
        .expect("prepare");
    drop(client);
    sut.prepared = Some(prepared);
    sut
}

impl TokioPgUnderTest {
    async fn enqueue_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        message: NewMessage,
    ) -> Result<MessageId> {
        let outbox = self.pg.pg().outbox();
        match &self.prepared {
            Some(prepared) => outbox.enqueue_prepared(tx, prepared, message).await,
            None => outbox.enqueue_tokio_postgres(tx, message).await,
        }
    }
}

#[async_trait]
impl StoreUnderTest for TokioPgUnderTest {
    fn store(&self) -> std::sync::Arc<dyn OperatorStore> {
        std::sync::Arc::new(self.pg.pg().clone())
    }

    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> Result<Vec<MessageId>> {
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.expect("begin");
        let mut ids = Vec::new();
        for m in messages {
            ids.push(self.enqueue_in(&tx, m).await?);
        }
        tx.commit().await.expect("commit");
        Ok(ids)
    }

    async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>) {
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.expect("begin");
        for m in messages {
            self.enqueue_in(&tx, m).await.expect("enqueue");
        }
        tx.rollback().await.expect("rollback");
    }
}

mod conformance {
    outbox_api::store_conformance_tests!(super::sut);
}

mod conformance_prepared {
    outbox_api::store_conformance_tests!(super::sut_prepared);
}

#[tokio::test]
async fn statements_prepared_for_another_outbox_are_refused_before_writing() {
    let sut = sut_prepared().await;
    let other = PgUnderTest::fresh(None).await;
    let mut client = sut.client.lock().await;
    let prepared = sut.prepared.clone().unwrap();
    let tx = client.transaction().await.unwrap();
    let err = other
        .pg()
        .outbox()
        .enqueue_prepared(&tx, &prepared, msg(1))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(
        err.to_string().contains("prepared for outbox table"),
        "{err}"
    );
    // Nothing was sent: the transaction is still usable.
    sut.pg
        .pg()
        .outbox()
        .enqueue_prepared(&tx, &prepared, msg(2))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(sut.pg.pg().stats().await.unwrap().pending, 1);
}

fn payloads(messages: &[outbox_api::Message]) -> Vec<String> {
    messages
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_enqueue_is_claimed_and_a_rolled_back_one_never() {
    let s = sut().await;
    let store = s.pg.pg();
    let outbox = store.outbox();
    let mut client = s.client.lock().await;
    let mut listener = store.listen();
    while listener.wait(Duration::from_millis(1)).await {}

    let tx = client.transaction().await.unwrap();
    tx.execute(
        &format!(
            r#"CREATE TABLE "{}".orders (id bigint PRIMARY KEY)"#,
            s.pg.schema()
        ),
        &[],
    )
    .await
    .unwrap();
    tx.execute(
        &format!(r#"INSERT INTO "{}".orders VALUES (1)"#, s.pg.schema()),
        &[],
    )
    .await
    .unwrap();
    let id = outbox
        .enqueue_tokio_postgres(&tx, msg(1).key("order-1"))
        .await
        .unwrap();
    assert!(store.claim(&claim(10)).await.unwrap().is_empty());
    tx.commit().await.unwrap();
    assert!(
        listener.wait(Duration::from_secs(10)).await,
        "the commit wakes this process's relays"
    );
    let claimed = store.claim(&claim(10)).await.unwrap();
    assert_eq!(claimed.iter().map(|m| m.id).collect::<Vec<_>>(), [id]);
    assert_eq!(claimed[0].key.as_deref(), Some("order-1"));

    let tx = client.transaction().await.unwrap();
    outbox.enqueue_tokio_postgres(&tx, msg(2)).await.unwrap();
    outbox
        .enqueue_many_tokio_postgres(&tx, vec![msg(3), msg(4)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(store.claim(&claim(10)).await.unwrap().is_empty());
    assert_eq!(store.stats().await.unwrap().pending, 1);

    // Any GenericClient: the client itself, each statement its own transaction.
    outbox
        .enqueue_tokio_postgres(&*client, msg(5))
        .await
        .unwrap();
    assert_eq!(payloads(&store.claim(&claim(10)).await.unwrap()), ["5"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_many_writes_a_batch_in_order_and_refuses_it_whole() {
    let s = sut().await;
    let store = s.pg.pg();
    let outbox = store.outbox();
    let mut client = s.client.lock().await;
    let tx = client.transaction().await.unwrap();
    let ids = outbox
        .enqueue_many_tokio_postgres(
            &tx,
            vec![
                msg(1).key("b"),
                msg(2).key("a"),
                msg(3),
                msg(4).key("b"),
                NewMessage::new(MessageKind::Integration, "Out", b"5".to_vec())
                    .destination("shop", "out")
                    .header("x-h", "v"),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 5);
    let claimed = store.claim(&claim(10)).await.unwrap();
    assert_eq!(payloads(&claimed), ["1", "2", "3", "4", "5"]);
    assert_eq!(claimed.iter().map(|m| m.id).collect::<Vec<_>>(), ids);
    assert_eq!(claimed[4].headers.get("x-h").map(String::as_str), Some("v"));
    assert_eq!(claimed[4].destination.as_ref().unwrap().exchange, "shop");
    assert_eq!(claimed[4].kind, MessageKind::Integration);

    // One invalid message refuses the batch, naming it; nothing is written.
    let tx = client.transaction().await.unwrap();
    let err = outbox
        .enqueue_many_tokio_postgres(&tx, vec![msg(6), msg(7).key(" ")])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("message 1 of the batch"), "{err}");
    assert!(
        outbox
            .enqueue_many_tokio_postgres(&tx, vec![])
            .await
            .unwrap()
            .is_empty()
    );
    tx.commit().await.unwrap();
    assert_eq!(store.stats().await.unwrap().pending, 5);

    // An id that exists already is a conflict naming it.
    let tx = client.transaction().await.unwrap();
    let err = outbox
        .enqueue_many_tokio_postgres(&tx, vec![msg(8), msg(9).with_id(ids[0])])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.to_string().contains(&ids[0].to_string()), "{err}");
}

/// What the sqlx path refuses, the tokio-postgres path refuses with the
/// same kind; what it accepts, this accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_the_kinds_of_the_sqlx_path() {
    let s = sut().await;
    let store = s.pg.pg();
    let outbox = store.outbox();
    let existing = s.enqueue(vec![msg(0)]).await[0];
    let cases: Vec<(&str, NewMessage)> = vec![
        (
            "empty type",
            NewMessage::new(MessageKind::Domain, "", b"x".to_vec()),
        ),
        ("blank key", msg(1).key("   ")),
        ("blank header name", msg(2).header(" ", "v")),
        (
            "NUL in the type",
            NewMessage::new(MessageKind::Domain, "a\0b", b"x".to_vec()),
        ),
        ("NUL in the key", msg(3).key("a\0b")),
        ("an id that exists", msg(4).with_id(existing)),
        ("a fine message", msg(5).key("k")),
    ];
    let mut client = s.client.lock().await;
    for (what, m) in cases {
        let by_sqlx = {
            let mut tx = s.pg.pool().begin().await.unwrap();
            let r = outbox.enqueue(&mut tx, m.clone()).await;
            tx.rollback().await.unwrap();
            r.map(drop).map_err(|e| e.kind())
        };
        let by_tokio = {
            let tx = client.transaction().await.unwrap();
            let r = outbox.enqueue_tokio_postgres(&tx, m.clone()).await;
            tx.rollback().await.unwrap();
            r.map(drop)
        };
        assert_eq!(
            by_tokio.as_ref().map(|_| ()).map_err(|e| e.kind()),
            by_sqlx,
            "{what}: {by_tokio:?}"
        );
        let tx = client.transaction().await.unwrap();
        let many = outbox
            .enqueue_many_tokio_postgres(&tx, vec![msg(6), m])
            .await;
        tx.rollback().await.unwrap();
        assert_eq!(
            many.map(drop).map_err(|e| e.kind()),
            by_sqlx,
            "{what}, in a batch"
        );
    }
    assert_eq!(store.stats().await.unwrap().pending, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_processes_hear_of_the_commit_after_it() {
    let s = sut().await;
    let mut raw = PgListener::connect(s.pg.url()).await.unwrap();
    raw.listen(&s.pg.pg().channel()).await.unwrap();
    let mut client = s.client.lock().await;
    let tx = client.transaction().await.unwrap();
    s.pg.pg()
        .outbox()
        .enqueue_tokio_postgres(&tx, msg(1))
        .await
        .unwrap();
    assert!(
        !heard(&mut raw, Duration::from_millis(300)).await,
        "nothing is announced before the commit"
    );
    tx.commit().await.unwrap();
    assert!(
        heard(&mut raw, Duration::from_secs(5)).await,
        "the commit is announced"
    );
}

async fn heard(raw: &mut PgListener, within: Duration) -> bool {
    tokio::time::timeout(within, raw.recv()).await.is_ok()
}

#[tokio::test]
async fn an_unmigrated_table_says_to_migrate() {
    let s = sut().await;
    let store = outbox_postgres::PgStore::builder(s.pg.url())
        .schema(s.pg.schema())
        .table("never_migrated")
        .connect()
        .await
        .unwrap();
    let client = s.client.lock().await;
    let err = store
        .outbox()
        .enqueue_tokio_postgres(&*client, msg(1))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    assert!(err.to_string().contains("migrate"), "{err}");
}
