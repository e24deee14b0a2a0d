//! The conformance suite (feature `testing`): plain async functions, one per
//! contract clause, that every [`Store`](crate::Store),
//! [`Inbox`](crate::Inbox) and [`Transport`](crate::Transport) runs.
//!
//! A backend implements [`StoreUnderTest`] (or [`InboxUnderTest`],
//! [`TransportUnderTest`]) and calls
//! [`store_conformance_tests!`](crate::store_conformance_tests) (or
//! [`inbox_conformance_tests!`](crate::inbox_conformance_tests),
//! [`transport_conformance_tests!`](crate::transport_conformance_tests)) in
//! its tests, which expands to one `#[test]` per clause.

pub mod child;
pub mod consumer;
#[cfg(feature = "containers")]
pub mod containers;
pub mod inbox;
pub mod logs;
pub mod metrics;
pub mod proxy;
pub mod services;
pub mod store;
pub mod transport;

pub use child::{ChildProcess, selected, until_stdin_closes};
pub use consumer::{ConsumerSettings, ConsumerUnderTest};
pub use inbox::InboxUnderTest;
pub use logs::LogBuffer;
pub use metrics::TestRecorder;
pub use proxy::{TcpProxy, percent_encode};
pub use services::{ContainerSpec, ServiceSpec, service_url};
pub use store::StoreUnderTest;
pub use transport::TransportUnderTest;

use std::future::Future;
use std::time::Duration;

/// Runs a future to completion on a fresh tokio runtime (used by the
/// conformance macros, so backends need no test attribute of their own).
pub fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a tokio runtime for a conformance test")
        .block_on(future)
}

/// Polls `condition` every few milliseconds until it holds, failing the test
/// with `what` after `deadline`. Tests wait on conditions, never on sleeps.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    loop {
        if condition().await {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The prefix that marks a panic message as deliberate, for
/// [`quiet_deliberate_panics`]: `panic!("{DELIBERATE}handler blew up")`.
pub const DELIBERATE: &str = "on purpose: ";

/// Keeps deliberate panics (whose message starts with [`DELIBERATE`]) out of
/// the test output; every other panic still reports through the default hook
/// — including a test failure whose message quotes a deliberate panic.
pub fn quiet_deliberate_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !crate::panic_message(info.payload()).starts_with(DELIBERATE) {
                default(info);
            }
        }));
    });
}
