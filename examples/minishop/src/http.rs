//! The HTTP API (without `--orders`): place orders, look at them, health.

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
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

/// The routes.
pub fn router(shop: Arc<Shop>) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(get_order))
        .route("/health", get(health))
        .with_state(shop)
}

async fn place_order(
    State(shop): State<Arc<Shop>>,
    body: Result<Json<NewOrder>, JsonRejection>,
) -> Response {
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
pub async fn serve(shop: Arc<Shop>, listen: &str) -> Result<(), Fail> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .context(format!("cannot listen on `{listen}`"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    println!("listening on http://{addr}");
    eprintln!(
        "try:\n  curl -si -X POST http://{addr}/orders -H 'content-type: application/json' \\\n       -d '{{\"customer\":\"ann\",\"sku\":\"teapot\",\"qty\":1}}'\n  curl -s http://{addr}/orders/<id>\n  curl -s http://{addr}/health\nCtrl-C stops the shop gracefully."
    );
    axum::serve(listener, router(shop))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving HTTP")
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
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
