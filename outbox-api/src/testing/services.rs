//! Where the tests find the services they need (RabbitMQ, PostgreSQL), so
//! that `cargo test --workspace` needs no variable on a machine that runs
//! them locally — and fails, never skips, saying how to provide one where
//! none answers.
//!
//! In this order:
//! 1. the URL in the service's variable (`OUTBOX_AMQP_URL`, `OUTBOX_PG_URL`)
//!    if it is set;
//! 2. else the local default (`amqp://guest:guest@127.0.0.1:5672/%2f`,
//!    `postgres://postgres@127.0.0.1:5432/test`) if its port answers;
//! 3. else an error that says how to provide one.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A service some tests need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// RabbitMQ.
    RabbitMq,
    /// PostgreSQL.
    Postgres,
}

impl Service {
    /// The variable that names it.
    pub fn variable(self) -> &'static str {
        match self {
            Service::RabbitMq => "OUTBOX_AMQP_URL",
            Service::Postgres => "OUTBOX_PG_URL",
        }
    }

    /// Its URL on this machine with the stock setup.
    pub fn local_url(self) -> &'static str {
        match self {
            Service::RabbitMq => "amqp://guest:guest@127.0.0.1:5672/%2f",
            Service::Postgres => "postgres://postgres@127.0.0.1:5432/test",
        }
    }

    fn local_addr(self) -> SocketAddr {
        match self {
            Service::RabbitMq => SocketAddr::from(([127, 0, 0, 1], 5672)),
            Service::Postgres => SocketAddr::from(([127, 0, 0, 1], 5432)),
        }
    }

    fn how_to(self) -> &'static str {
        match self {
            Service::RabbitMq => {
                "Debian: `apt-get install rabbitmq-server && rabbitmq-server -detached`"
            }
            Service::Postgres => {
                "Debian: `apt-get install postgresql && pg_ctlcluster --skip-systemctl-redirect 15 main start`, database `test`, user `postgres` with trust auth"
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            Service::RabbitMq => "RabbitMQ",
            Service::Postgres => "PostgreSQL",
        }
    }
}

/// The choice among the places a service may be, given what was found.
/// `variable`: the variable's value, if set (an empty value counts as
/// unset); `local_answers`: whether the local default port accepts a
/// connection.
pub fn choose(
    service: Service,
    variable: Option<String>,
    local_answers: bool,
) -> Result<String, String> {
    if let Some(url) = variable.filter(|u| !u.trim().is_empty()) {
        return Ok(url);
    }
    if local_answers {
        return Ok(service.local_url().to_owned());
    }
    Err(format!(
        "this test needs {name}: set {var} (e.g. {var}={url}) or run {name} on {addr}. {how}",
        name = service.name(),
        var = service.variable(),
        url = service.local_url(),
        addr = service.local_addr(),
        how = service.how_to(),
    ))
}

/// Looks for `service`; `Err` says how to provide one.
pub fn find(service: Service) -> Result<String, String> {
    let variable = std::env::var(service.variable()).ok();
    let local_answers = variable.is_none()
        && TcpStream::connect_timeout(&service.local_addr(), Duration::from_millis(500)).is_ok();
    choose(service, variable, local_answers)
}

/// The URL of `service` for a test.
///
/// # Panics
/// When no service can be found, with a message saying how to provide one
/// (tests fail, never skip).
pub fn service_url(service: Service) -> String {
    find(service).unwrap_or_else(|how| panic!("{how}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_wins_then_the_local_default_then_a_clear_failure() {
        let set = Some("amqp://u:p@broker:5672/%2f".to_owned());
        assert_eq!(
            choose(Service::RabbitMq, set.clone(), true).unwrap(),
            "amqp://u:p@broker:5672/%2f"
        );
        assert_eq!(
            choose(Service::RabbitMq, None, true).unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            choose(Service::Postgres, Some("  ".into()), true).unwrap(),
            "postgres://postgres@127.0.0.1:5432/test",
            "an empty variable counts as unset"
        );
        let how = choose(Service::RabbitMq, None, false).unwrap_err();
        assert!(how.contains("OUTBOX_AMQP_URL"), "{how}");
        assert!(how.contains("127.0.0.1:5672"), "{how}");
        assert!(how.contains("rabbitmq-server -detached"), "{how}");
        let how = choose(Service::Postgres, None, false).unwrap_err();
        assert!(
            how.contains("OUTBOX_PG_URL") && how.contains("pg_ctlcluster"),
            "{how}"
        );
    }
}
