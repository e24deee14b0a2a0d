//! The outbox-api conformance suites on MySQL/MariaDB, each test on fresh
//! tables of the test database.

use outbox_mysql::testing::MySqlUnderTest;

async fn sut() -> MySqlUnderTest {
    MySqlUnderTest::fresh(None).await
}

outbox_api::store_conformance_tests!(sut);

mod inbox {
    outbox_api::inbox_conformance_tests!(super::sut);
}
