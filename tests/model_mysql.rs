//! The model-based property test on the MySQL/MariaDB backend, each case on
//! fresh tables of the test database.

mod model;

use outbox_mysql::testing::MySqlUnderTest;
use proptest::prelude::*;

proptest! {
    #![proptest_config(model::config())]
    #[test]
    fn relay_keeps_its_guarantees_on_mysql(batch_size in 1usize..6, ops in model::ops()) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let sut = MySqlUnderTest::fresh(Some(clock.clone())).await;
            model::run_case(Box::new(sut), clock, batch_size, ops).await;
        });
    }
}
