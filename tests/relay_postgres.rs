//! The relay rules of `docs/rules.md` on the PostgreSQL backend (the same
//! test bodies as on memory), each test on a fresh schema.

mod semantics;

use std::sync::Arc;

use outbox::ManualClock;
use outbox_postgres::testing::PgUnderTest;

struct Postgres;

impl semantics::Backend for Postgres {
    async fn fresh(clock: Arc<ManualClock>) -> semantics::Fixture {
        Box::new(PgUnderTest::fresh(Some(clock)).await)
    }
}

semantics_tests!(Postgres);
semantics_tests!(Postgres, in_a_fleet);
