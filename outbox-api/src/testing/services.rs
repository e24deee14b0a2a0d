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
//! 3. else a container, when a Docker engine answers (feature
//!    `containers`: [`containers`](super::containers));
//! 4. else an error naming all three ways.
//!
//! `OUTBOX_TEST_SERVICES=containers` skips the first two: every service
//! comes from a container (CI runs a test target so, to prove that path).

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
    /// How to run it in a container.
    pub container: ContainerSpec,
}

/// How to run a service in a container, for the container step. Templates
/// may hold `{port}` (the server's port), `{port1}` … (more free ports, as
/// many as [`extra_ports`](Self::extra_ports)) and, in `url`, `{host}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContainerSpec {
    /// The variable naming the image (`OUTBOX_PG_IMAGE`).
    pub image_variable: &'static str,
    /// The image when the variable is unset: the official one (`postgres:15`).
    pub image: &'static str,
    /// The server's port on a network of the container's own.
    pub port: u16,
    /// How many more free ports the server needs on a host network (where
    /// every port it opens must be one no one else uses).
    pub extra_ports: usize,
    /// Environment of the container.
    pub env: &'static [(&'static str, &'static str)],
    /// Arguments to the image's entry point; empty: the image's own.
    pub cmd: &'static [&'static str],
    /// The line (on either output stream) that says the server is up.
    pub ready: &'static str,
    /// The URL a test uses.
    pub url: &'static str,
}

/// Where the services come from: `OUTBOX_TEST_SERVICES` unset or empty
/// (each in the order of the module's documentation) or `containers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The variable, the local default, a container.
    Any,
    /// A container, whatever else there is.
    Containers,
}

impl Mode {
    /// The mode `OUTBOX_TEST_SERVICES` asks for; `Err` names what it holds.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("OUTBOX_TEST_SERVICES")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            None | Some("") => Ok(Self::Any),
            Some("containers") => Ok(Self::Containers),
            Some(other) => Err(format!(
                "OUTBOX_TEST_SERVICES={other}: expected `containers` or nothing"
            )),
        }
    }
}

impl ServiceSpec {
    fn addr(&self) -> SocketAddr {
        SocketAddr::from(self.local_addr)
    }
}

/// What the container step gave, for [`choose`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerStep {
    /// The URL of a container's server.
    Url(String),
    /// No Docker engine answered (or the step is not built): why.
    NoEngine(String),
    /// An engine answered but the container did not come up: why.
    Failed(String),
}

/// The choice among the places a service may be, given what was found.
/// `variable`: the variable's value, if set (an empty value counts as
/// unset); `local_answers`: whether the local default port accepts a
/// connection; `container`: the container step, run only if needed.
pub fn choose(
    spec: &ServiceSpec,
    mode: Mode,
    variable: Option<String>,
    local_answers: bool,
    container: impl FnOnce() -> ContainerStep,
) -> Result<String, String> {
    if mode == Mode::Any {
        if let Some(url) = variable.filter(|u| !u.trim().is_empty()) {
            return Ok(url);
        }
        if local_answers {
            return Ok(spec.local_url.to_owned());
        }
    }
    let engine = match container() {
        ContainerStep::Url(url) => return Ok(url),
        ContainerStep::Failed(why) => {
            return Err(format!(
                "this test needs {name}: a Docker engine answered but the container did not come up: {why}",
                name = spec.name
            ));
        }
        ContainerStep::NoEngine(why) => why,
    };
    let setup = if spec.setup.is_empty() {
        String::new()
    } else {
        format!(" ({})", spec.setup)
    };
    let forced = if mode == Mode::Containers {
        " (OUTBOX_TEST_SERVICES=containers asks for a container only)"
    } else {
        ""
    };
    Err(format!(
        "this test needs {name}{forced}: set {var} (e.g. {var}={url}), or run {name} on {addr}{setup}, \
         or run a Docker engine (DOCKER_HOST or the default socket; `bash scripts/docker-engine start` \
         prints one) for a container of {image} ({image_var} names another image) — {engine}",
        name = spec.name,
        var = spec.variable,
        url = spec.local_url,
        addr = spec.addr(),
        image = spec.container.image,
        image_var = spec.container.image_variable,
    ))
}

/// Looks for the service; `Err` says how to provide one.
pub fn find(spec: &ServiceSpec) -> Result<String, String> {
    let mode = Mode::from_env()?;
    let variable = std::env::var(spec.variable).ok();
    let local_answers = mode == Mode::Any
        && variable.as_deref().is_none_or(|v| v.trim().is_empty())
        && TcpStream::connect_timeout(&spec.addr(), Duration::from_millis(500)).is_ok();
    choose(spec, mode, variable, local_answers, || container_step(spec))
}

#[cfg(feature = "containers")]
fn container_step(spec: &ServiceSpec) -> ContainerStep {
    use std::collections::HashMap;
    use std::sync::Mutex;
    // One answer per service and process: tests that run side by side wait
    // for the first one's container instead of starting their own.
    static FOUND: Mutex<Option<HashMap<&'static str, ContainerStep>>> = Mutex::new(None);
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    let found = found.get_or_insert_with(HashMap::new);
    if let Some(step) = found.get(spec.name) {
        return step.clone();
    }
    let step = match super::containers::url(spec) {
        Ok(url) => ContainerStep::Url(url),
        Err(super::containers::Unavailable::NoEngine(why)) => ContainerStep::NoEngine(why),
        Err(super::containers::Unavailable::Failed(why)) => ContainerStep::Failed(why),
    };
    found.insert(spec.name, step.clone());
    step
}

#[cfg(not(feature = "containers"))]
fn container_step(_: &ServiceSpec) -> ContainerStep {
    ContainerStep::NoEngine(
        "the container step is not built (feature `containers` of outbox-api)".into(),
    )
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
        container: ContainerSpec {
            image_variable: "TEST_BROKER_IMAGE",
            image: "broker:1",
            port: 5672,
            extra_ports: 0,
            env: &[],
            cmd: &[],
            ready: "up",
            url: "amqp://guest:guest@{host}:{port}/%2f",
        },
    };

    fn no_engine() -> ContainerStep {
        ContainerStep::NoEngine("no engine here".into())
    }

    fn unreachable() -> ContainerStep {
        panic!("the container step ran although an earlier step had a server")
    }

    #[test]
    fn the_variable_wins_then_the_local_default_then_a_container_then_a_clear_failure() {
        let any = Mode::Any;
        let set = Some("amqp://u:p@broker:5672/%2f".to_owned());
        assert_eq!(
            choose(&BROKER, any, set.clone(), true, unreachable).unwrap(),
            "amqp://u:p@broker:5672/%2f"
        );
        assert_eq!(
            choose(&BROKER, any, None, true, unreachable).unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            choose(&BROKER, any, Some("  ".into()), true, unreachable).unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "an empty variable counts as unset"
        );
        let container = || ContainerStep::Url("amqp://guest:guest@127.0.0.1:40000/%2f".into());
        assert_eq!(
            choose(&BROKER, any, None, false, container).unwrap(),
            "amqp://guest:guest@127.0.0.1:40000/%2f",
            "with neither a variable nor a local server, the container"
        );
        assert_eq!(
            choose(&BROKER, Mode::Containers, set, true, container).unwrap(),
            "amqp://guest:guest@127.0.0.1:40000/%2f",
            "OUTBOX_TEST_SERVICES=containers passes over the variable and the local server"
        );
        let how = choose(&BROKER, any, None, false, no_engine).unwrap_err();
        for way in [
            "TEST_BROKER_URL",
            "127.0.0.1:5672",
            "Docker engine",
            "broker:1",
            "TEST_BROKER_IMAGE",
            "no engine here",
        ] {
            assert!(how.contains(way), "the failure names {way:?}: {how}");
        }
        let failed = || ContainerStep::Failed("image broker:1 not found".into());
        let how = choose(&BROKER, any, None, false, failed).unwrap_err();
        assert!(
            how.contains("did not come up: image broker:1 not found"),
            "{how}"
        );
        let with_setup = ServiceSpec {
            setup: "database `test`",
            ..BROKER
        };
        let how = choose(&with_setup, any, None, false, no_engine).unwrap_err();
        assert!(how.contains("127.0.0.1:5672 (database `test`)"), "{how}");
    }
}
