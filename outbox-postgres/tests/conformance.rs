//! The outbox-api conformance suite on PostgreSQL, each test on a fresh
//! schema of the test database.

use outbox_postgres::testing::PgUnderTest;

async fn sut() -> PgUnderTest {
    PgUnderTest::fresh(None).await
}

outbox_api::store_conformance_tests!(sut);

mod inbox {
    outbox_api::inbox_conformance_tests!(super::sut);
}
