//! Test helpers (feature `testing`): the broker URL from the environment
//! and a TCP proxy that cuts, stalls and heals the broker connection.
//!
//! ```no_run
//! # async fn run() {
//! use outbox_rabbitmq::testing::{TcpProxy, amqp_url, broker_addr, url_via};
//! let url = amqp_url();
//! let proxy = TcpProxy::start(broker_addr(&url).await).await;
//! let through_proxy = url_via(&url, proxy.addr());
//! // … connect a transport or consumer to `through_proxy` …
//! proxy.cut(); // every live connection dies, new ones are refused
//! proxy.heal(); // new connections work again
//! # let _ = through_proxy; }
//! ```

use std::net::SocketAddr;

pub use outbox_api::testing::{TcpProxy, percent_encode};

/// The RabbitMQ broker the tests use: `OUTBOX_AMQP_URL`, else the local
/// default `amqp://guest:guest@127.0.0.1:5672/%2f` if it answers.
pub const RABBITMQ: outbox_api::testing::ServiceSpec = outbox_api::testing::ServiceSpec {
    name: "RabbitMQ",
    variable: "OUTBOX_AMQP_URL",
    local_url: "amqp://guest:guest@127.0.0.1:5672/%2f",
    local_addr: ([127, 0, 0, 1], 5672),
    setup: "",
    // On a host network every port the broker opens must be its own: the
    // AMQP port, its node name, Erlang distribution and epmd, and the
    // management and Prometheus listeners of the official image.
    container: outbox_api::testing::ContainerSpec {
        image_variable: "OUTBOX_RABBITMQ_IMAGE",
        image: "rabbitmq:3-management",
        port: 5672,
        extra_ports: 4,
        env: &[
            ("RABBITMQ_NODE_PORT", "{port}"),
            ("RABBITMQ_NODENAME", "outbox{port}@localhost"),
            ("RABBITMQ_DIST_PORT", "{port1}"),
            ("ERL_EPMD_PORT", "{port2}"),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-rabbitmq_management tcp_config [{port,{port3}}] -rabbitmq_prometheus tcp_config [{port,{port4}}]",
            ),
        ],
        cmd: &[],
        ready: "Server startup complete",
        url: "amqp://guest:guest@{host}:{port}/%2f",
    },
};

/// The broker for a test ([`RABBITMQ`]).
///
/// # Panics
/// When there is none (tests that need a broker fail, never skip), with a
/// message saying how to provide one.
pub fn amqp_url() -> String {
    outbox_api::testing::service_url(&RABBITMQ)
}

/// Declares on `channel` a direct exchange (auto-deleted) and an exclusive
/// queue bound to it with `routing_key`: a test's own destination.
///
/// # Panics
/// When the broker refuses a declaration.
pub async fn declare_bound_queue(
    channel: &lapin::Channel,
    exchange: &str,
    queue: &str,
    routing_key: &str,
) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare test exchange");
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare test queue");
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind test queue");
}

/// A name no other test uses: `outbox-test-{prefix}-{uuid v7}`.
pub fn unique_name(prefix: &str) -> String {
    format!("outbox-test-{prefix}-{}", outbox_api::MessageId::new())
}

/// The socket address of the broker in `url` (resolved).
///
/// # Panics
/// When the URL does not parse or the host does not resolve.
pub async fn broker_addr(url: &str) -> SocketAddr {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker URL parses");
    tokio::net::lookup_host((uri.authority.host.as_str(), uri.authority.port))
        .await
        .expect("resolving the broker host")
        .next()
        .expect("the broker host has an address")
}

/// `url` with its host and port replaced by `addr` (e.g. a [`TcpProxy`]'s),
/// keeping user, password and vhost.
///
/// # Panics
/// When the URL does not parse.
pub fn url_via(url: &str, addr: SocketAddr) -> String {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker URL parses");
    format!(
        "amqp://{}:{}@{}/{}",
        percent_encode(&uri.authority.userinfo.username),
        percent_encode(&uri.authority.userinfo.password),
        addr,
        percent_encode(&uri.vhost)
    )
}

/// `url` with its password replaced by `password` (to test refused
/// credentials).
///
/// # Panics
/// When the URL does not parse.
pub fn url_with_password(url: &str, password: &str) -> String {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker URL parses");
    format!(
        "amqp://{}:{}@{}:{}/{}",
        percent_encode(&uri.authority.userinfo.username),
        percent_encode(password),
        uri.authority.host,
        uri.authority.port,
        percent_encode(&uri.vhost)
    )
}
