//! The relay rules of `docs/rules.md` on the MySQL/MariaDB backend (the
//! same test bodies as on memory), each test on fresh tables.

mod semantics;

use std::sync::Arc;

use outbox::ManualClock;
use outbox_mysql::testing::MySqlUnderTest;

struct MySql;

impl semantics::Backend for MySql {
    async fn fresh(clock: Arc<ManualClock>) -> semantics::Fixture {
        Box::new(MySqlUnderTest::fresh(Some(clock)).await)
    }
}

semantics_tests!(MySql);
semantics_tests!(MySql, in_a_fleet);
