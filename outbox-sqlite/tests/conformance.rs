//! The outbox-api conformance suite, once per enqueue driver.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use outbox_api::testing::StoreUnderTest;
use outbox_api::{MessageId, NewMessage, OperatorStore};
use outbox_sqlite::SqliteStore;

async fn fresh_store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::builder(dir.path().join("outbox.db"))
        .table("test_outbox")
        .inbox_table("test_inbox")
        .connect()
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    (dir, store)
}

mod sqlx_driver {
    use outbox_sqlite::testing::SqlxUnderTest;

    async fn sut() -> SqlxUnderTest {
        SqlxUnderTest::fresh(None).await
    }

    outbox_api::store_conformance_tests!(sut);

    mod inbox {
        outbox_api::inbox_conformance_tests!(super::sut);
    }
}

mod rusqlite_driver {
    use super::*;

    pub struct Sut {
        _dir: tempfile::TempDir,
        store: SqliteStore,
        conn: Mutex<rusqlite::Connection>,
    }

    pub async fn sut() -> Sut {
        let (dir, store) = fresh_store().await;
        let conn = rusqlite::Connection::open(store.path()).expect("rusqlite connection");
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .unwrap();
        Sut {
            _dir: dir,
            store,
            conn: Mutex::new(conn),
        }
    }

    #[async_trait]
    impl StoreUnderTest for Sut {
        fn store(&self) -> Arc<dyn OperatorStore> {
            Arc::new(self.store.clone())
        }

        async fn try_enqueue(
            &self,
            messages: Vec<NewMessage>,
        ) -> outbox_api::Result<Vec<MessageId>> {
            let outbox = self.store.outbox();
            let mut conn = self.conn.lock().unwrap();
            let tx = conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .expect("begin");
            let mut ids = Vec::new();
            for m in messages {
                ids.push(outbox.enqueue_rusqlite(&tx, m)?);
            }
            tx.commit().expect("commit");
            Ok(ids)
        }

        async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>) {
            let outbox = self.store.outbox();
            let mut conn = self.conn.lock().unwrap();
            let tx = conn.transaction().expect("begin");
            for m in messages {
                outbox.enqueue_rusqlite(&tx, m).expect("enqueue");
            }
            tx.rollback().expect("rollback");
        }
    }

    outbox_api::store_conformance_tests!(sut);
}
