//! The HTTP API (without `--orders`): place orders, look at them, health;
//! beside it the outbox console at `/outbox` and the metrics at `/metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::json;
use tracing::Instrument;
use uuid::Uuid;

use crate::fail::{Context, Fail};
use crate::health::status_code;
use crate::ordering::PlaceError;
use crate::shop::Shop;

/// `POST /orders` body.
#[derive(Debug, Deserialize)]
pub struct NewOrder {
    /// Who orders.
    pub customer: String,
    /// What (see the catalogue).
    pub sku: String,
    /// How many.
    pub qty: u32,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// The routes: the shop's API, `GET /metrics` and the console under `/outbox`.
pub fn router(shop: Arc<Shop>, metrics: PrometheusHandle) -> Result<Router, Fail> {
    let console = console(&shop)?;
    Ok(Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(get_order))
        .route("/health", get(health))
        .with_state(shop)
        .route(
            "/metrics",
            get(move || std::future::ready(render_metrics(&metrics))),
        )
        .merge(outbox_console::router(console)))
}

/// The outbox console over the modules' outboxes, each with its relay's
/// own health. Loopback only, unless `OUTBOX_CONSOLE_TOKEN` is set.
fn console(shop: &Shop) -> Result<outbox_console::Console, Fail> {
    let health = |relay: &outbox::RelayHandle| {
        let relay = relay.relay().clone();
        move || {
            let relay = relay.clone();
            async move { relay.health().await }
        }
    };
    outbox_console::Console::new()
        .outbox_with_health(
            "ordering",
            shop.ordering.database().operator_store(),
            health(&shop.ordering_relay),
        )
        .and_then(|c| match &shop.warehouse {
            Some((warehouse, relay)) => c.outbox_with_health(
                "warehouse",
                warehouse.database().operator_store(),
                health(relay),
            ),
            None => Ok(c),
        })
        .and_then(|c| c.token_from_env())
        .and_then(|c| c.path_prefix("/outbox"))
        .context("setting up the outbox console")
}

/// Installs the Prometheus recorder (no listener of its own: `GET
/// /metrics` renders it) before the relays start, so they record into it:
/// the library's, with Prometheus naming and histograms (the names the
/// dashboard and alert rules in `ops/` use); keeps it trimmed.
pub fn install_metrics() -> Result<PrometheusHandle, Fail> {
    let handle = outbox::metrics::install_prometheus_recorder()
        .context("installing the Prometheus metrics recorder")?;
    outbox_rabbitmq::metrics::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

fn render_metrics(metrics: &PrometheusHandle) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.render(),
    )
        .into_response()
}

/// The span of one `POST /orders`: a child of the request's W3C
/// `traceparent` when it carries a valid one, else the root of a new trace.
/// Every message of the order's saga carries its trace (the outbox stores
/// the enqueuing span's context and continues it in each delivery).
fn request_span(headers: &HeaderMap) -> tracing::Span {
    let span = tracing::info_span!(
        "POST /orders",
        http.request.method = "POST",
        http.route = "/orders",
        otel.kind = "server",
    );
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok());
    outbox::trace::continue_trace(&span, traceparent);
    span
}

async fn place_order(
    State(shop): State<Arc<Shop>>,
    headers: HeaderMap,
    body: Result<Json<NewOrder>, JsonRejection>,
) -> Response {
    let span = request_span(&headers);
    place_order_in(shop, body).instrument(span).await
}

async fn place_order_in(shop: Arc<Shop>, body: Result<Json<NewOrder>, JsonRejection>) -> Response {
    let Json(order) = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    match shop
        .ordering
        .place_order(&order.customer, &order.sku, order.qty, false)
        .await
    {
        Ok((id, _)) => {
            let location = format!("/orders/{id}");
            (
                StatusCode::CREATED,
                [(header::LOCATION, location.clone())],
                Json(json!({ "id": id, "status": "pending", "href": location })),
            )
                .into_response()
        }
        Err(PlaceError::Invalid(e)) => error(StatusCode::UNPROCESSABLE_ENTITY, e.0),
        Err(PlaceError::Store(e)) => {
            tracing::error!(error = %e, "placing an order failed");
            error(StatusCode::SERVICE_UNAVAILABLE, e)
        }
    }
}

async fn get_order(
    State(shop): State<Arc<Shop>>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Response {
    let Path(id) = match id {
        Ok(id) => id,
        Err(_) => return error(StatusCode::NOT_FOUND, "no such order (ids are UUIDs)"),
    };
    match shop.ordering.get_order(id).await {
        Ok(Some(order)) => Json(order).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no order {id}")),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
    }
}

async fn health(State(shop): State<Arc<Shop>>) -> Response {
    let h = shop.health().await;
    (status_code(h.status()), Json(h)).into_response()
}

/// Serves until Ctrl-C (or SIGTERM). Prints `listening on http://ADDR` on
/// stdout once bound (`--listen 127.0.0.1:0` picks a free port).
pub async fn serve(shop: Arc<Shop>, listen: &str, metrics: PrometheusHandle) -> Result<(), Fail> {
    let app = router(Arc::clone(&shop), metrics)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .context(format!("cannot listen on `{listen}`"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    println!("listening on http://{addr}");
    eprintln!(
        "try:\n  curl -si -X POST http://{addr}/orders -H 'content-type: application/json' \\\n       -d '{{\"customer\":\"ann\",\"sku\":\"teapot\",\"qty\":1}}'\n  curl -s http://{addr}/orders/<id>\n  curl -s http://{addr}/health\n  curl -s http://{addr}/metrics\n  open http://{addr}/outbox (the outbox console)\nCtrl-C stops the shop gracefully."
    );
    drop(shop);
    // The console learns the peer's address from ConnectInfo (loopback
    // only without a token).
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await
    .context("serving HTTP")
}

/// Ctrl-C, or SIGTERM on Unix.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("shutting down: finishing in-flight messages…");
}
