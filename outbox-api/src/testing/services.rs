//! Where a test finds a server it needs, so that `cargo test --workspace`
//! needs no variable on a machine that runs the servers locally — and
//! fails, never skips, saying how to provide one where none answers. The
//! mechanism only: each backend crate's `testing` module describes its own
//! server ([`ServiceSpec`]: `outbox_postgres::testing::POSTGRES`,
//! `outbox_rabbitmq::testing::RABBITMQ`).
//!
//! In this order:
//! 1. the URL in the service's variable if it is set (and not blank);
//! 2. else the local default URL if its port answers;
//! 3. else an error that says how to provide one.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A server some tests need, as its backend crate describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceSpec {
    /// Its name in messages (`PostgreSQL`).
    pub name: &'static str,
    /// The variable that gives its URL (`OUTBOX_PG_URL`).
    pub variable: &'static str,
    /// Its URL on a machine that runs it locally with the stock setup.
    pub local_url: &'static str,
    /// Where that local server listens.
    pub local_addr: ([u8; 4], u16),
    /// What a local server needs beyond listening (a database, a user), for
    /// the failure message; empty if nothing.
    pub setup: &'static str,
}

impl ServiceSpec {
    fn addr(&self) -> SocketAddr {
        SocketAddr::from(self.local_addr)
    }
}

/// The choice among the places a service may be, given what was found.
/// `variable`: the variable's value, if set (an empty value counts as
/// unset); `local_answers`: whether the local default port accepts a
/// connection.
pub fn choose(
    spec: &ServiceSpec,
    variable: Option<String>,
    local_answers: bool,
) -> Result<String, String> {
    if let Some(url) = variable.filter(|u| !u.trim().is_empty()) {
        return Ok(url);
    }
    if local_answers {
        return Ok(spec.local_url.to_owned());
    }
    let setup = if spec.setup.is_empty() {
        String::new()
    } else {
        format!(" ({})", spec.setup)
    };
    Err(format!(
        "this test needs {name}: set {var} (e.g. {var}={url}) or run {name} on {addr}{setup}",
        name = spec.name,
        var = spec.variable,
        url = spec.local_url,
        addr = spec.addr(),
    ))
}

/// Looks for the service; `Err` says how to provide one.
pub fn find(spec: &ServiceSpec) -> Result<String, String> {
    let variable = std::env::var(spec.variable).ok();
    let local_answers = variable.is_none()
        && TcpStream::connect_timeout(&spec.addr(), Duration::from_millis(500)).is_ok();
    choose(spec, variable, local_answers)
}

/// The URL of the service for a test.
///
/// # Panics
/// When no service can be found, with a message saying how to provide one
/// (tests fail, never skip).
pub fn service_url(spec: &ServiceSpec) -> String {
    find(spec).unwrap_or_else(|how| panic!("{how}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BROKER: ServiceSpec = ServiceSpec {
        name: "Broker",
        variable: "TEST_BROKER_URL",
        local_url: "amqp://guest:guest@127.0.0.1:5672/%2f",
        local_addr: ([127, 0, 0, 1], 5672),
        setup: "",
    };

    #[test]
    fn the_variable_wins_then_the_local_default_then_a_clear_failure() {
        let set = Some("amqp://u:p@broker:5672/%2f".to_owned());
        assert_eq!(
            choose(&BROKER, set.clone(), true).unwrap(),
            "amqp://u:p@broker:5672/%2f"
        );
        assert_eq!(
            choose(&BROKER, None, true).unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            choose(&BROKER, Some("  ".into()), true).unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "an empty variable counts as unset"
        );
        let how = choose(&BROKER, None, false).unwrap_err();
        assert!(how.contains("TEST_BROKER_URL"), "{how}");
        assert!(how.contains("127.0.0.1:5672"), "{how}");
        let with_setup = ServiceSpec {
            setup: "database `test`",
            ..BROKER
        };
        let how = choose(&with_setup, None, false).unwrap_err();
        assert!(how.ends_with("(database `test`)"), "{how}");
    }
}
