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

/// The suite again on a store whose connections have the claim's settings
/// for their session (as `PgTenantPools`' do), where a claim is one
/// statement, its own transaction.
mod claims_in_session {
    use outbox_postgres::testing::PgUnderTest;

    async fn sut() -> PgUnderTest {
        let under_test = PgUnderTest::fresh_claiming_in_session().await;
        assert!(
            under_test.pg().claims_in_one_statement(),
            "the fixture's store claims in one statement"
        );
        under_test
    }

    outbox_api::store_conformance_tests!(sut);
}
