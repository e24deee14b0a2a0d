//! The outbox-api conformance suite on PostgreSQL, each test on a fresh
//! schema of the test database.

use outbox_postgres::testing::PgUnderTest;

async fn sut() -> PgUnderTest {
    let under_test = PgUnderTest::fresh(None).await;
    assert!(
        under_test.pg().claims_in_one_statement(),
        "a store on a pool of its own claims in one statement"
    );
    under_test
}

outbox_api::store_conformance_tests!(sut);

mod inbox {
    outbox_api::inbox_conformance_tests!(super::sut);
}

/// The suite again on a store on a pool of the application's, whose
/// connections keep their own settings: there a claim is `BEGIN` with the
/// claim's settings, the claim and `COMMIT` (a store on a pool of its own,
/// as above, claims in one statement, its own transaction).
mod on_the_applications_pool {
    use outbox_postgres::testing::PgUnderTest;

    async fn sut() -> PgUnderTest {
        let under_test = PgUnderTest::fresh_on_application_pool().await;
        assert!(
            !under_test.pg().claims_in_one_statement(),
            "the fixture's store claims in a transaction of three round trips"
        );
        under_test
    }

    outbox_api::store_conformance_tests!(sut);
}
