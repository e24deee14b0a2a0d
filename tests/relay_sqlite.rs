//! The relay rules of `docs/rules.md` on the SQLite backend (the same test
//! bodies as on memory).

mod semantics;

use std::sync::Arc;

use outbox::ManualClock;
use outbox_sqlite::testing::SqlxUnderTest;

struct Sqlite;

impl semantics::Backend for Sqlite {
    async fn fresh(clock: Arc<ManualClock>) -> semantics::Fixture {
        Box::new(SqlxUnderTest::fresh(Some(clock)).await)
    }
}

semantics_tests!(Sqlite);
semantics_tests!(Sqlite, in_a_fleet);
