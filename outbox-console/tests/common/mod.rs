//! Shared by the console tests: stores with poisoned messages, requests.
#![allow(dead_code, missing_docs)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode, header};
use http_body_util::BodyExt;
use outbox_api::testing::StoreUnderTest;
use outbox_api::{
    ClaimRequest, Failure, MessageId, MessageKind, NewMessage, OperatorStore, Release, Timestamp,
};
use tower::ServiceExt;

/// A backend under test and its store.
pub struct Backend {
    pub name: &'static str,
    sut: Box<dyn StoreUnderTest>,
}

impl Backend {
    pub async fn memory() -> Backend {
        Backend {
            name: "memory",
            sut: Box::new(outbox_memory::MemoryStore::new()),
        }
    }

    pub async fn sqlite() -> Backend {
        Backend {
            name: "sqlite",
            sut: Box::new(outbox_sqlite::testing::SqlxUnderTest::fresh(None).await),
        }
    }

    pub fn store(&self) -> Arc<dyn OperatorStore> {
        self.sut.store()
    }

    pub async fn enqueue(&self, messages: Vec<NewMessage>) -> Vec<MessageId> {
        self.sut.enqueue(messages).await
    }

    /// Enqueues `messages` and poisons them all (one failure, max 1).
    pub async fn poisoned(&self, messages: Vec<NewMessage>, error: &str) -> Vec<MessageId> {
        let ids = self.enqueue(messages).await;
        poison(self.store().as_ref(), &ids, error).await;
        ids
    }
}

/// Claims everything claimable, fails `ids` once with max_attempts 1 (so
/// they are poisoned) and releases the rest uncounted.
pub async fn poison(store: &dyn OperatorStore, ids: &[MessageId], error: &str) {
    let now = Timestamp::now();
    let claimed = store
        .claim(&ClaimRequest::new(
            "console-test",
            10_000,
            Duration::from_secs(60),
            now,
        ))
        .await
        .unwrap();
    let mut others = Vec::new();
    for m in claimed {
        if ids.contains(&m.id) {
            store
                .fail(&Failure::new("console-test", m.id, error, now, 1, now))
                .await
                .unwrap();
        } else {
            others.push(m.id);
        }
    }
    store
        .release(&Release::new("console-test", others, now))
        .await
        .unwrap();
    for id in ids {
        let m = store.get(*id).await.unwrap().unwrap();
        assert_eq!(
            m.state,
            outbox_api::MessageState::Poisoned,
            "{id} was not claimable"
        );
    }
}

pub fn domain(ty: &str, payload: &str) -> NewMessage {
    NewMessage::new(MessageKind::Domain, ty, payload.as_bytes().to_vec())
        .content_type("application/json")
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn location(&self) -> &str {
        self.headers
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// The value of the first hidden `csrf` input.
    pub fn csrf(&self) -> String {
        let start = self
            .body
            .find(r#"name="csrf" value=""#)
            .unwrap_or_else(|| panic!("no csrf input in {}", self.body))
            + r#"name="csrf" value=""#.len();
        let end = self.body[start..].find('"').unwrap() + start;
        self.body[start..end].to_owned()
    }

    /// A page of the console (HTML), whatever the status.
    pub fn assert_page(&self) {
        let ct = self
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        assert!(ct.starts_with("text/html"), "not HTML ({ct}): {self:?}");
        assert!(self.body.starts_with("<!DOCTYPE html>"), "{}", self.body);
    }
}

pub fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 50_000))
}

/// A request as a browser on this machine sends it.
pub fn request(method: &str, uri: &str) -> axum::http::request::Builder {
    Request::builder()
        .method(method)
        .uri(uri)
        .header(header::HOST, "127.0.0.1:8080")
        .extension(ConnectInfo(loopback()))
}

pub async fn send(app: &Router, req: Request<Body>) -> Reply {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

pub async fn get(app: &Router, uri: &str) -> Reply {
    send(app, request("GET", uri).body(Body::empty()).unwrap()).await
}

pub fn form_body(fields: &[(&str, &str)]) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    for (k, v) in fields {
        s.append_pair(k, v);
    }
    s.finish()
}

/// A same-origin form POST.
pub async fn post(app: &Router, uri: &str, fields: &[(&str, &str)]) -> Reply {
    send(
        app,
        request("POST", uri)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ORIGIN, "http://127.0.0.1:8080")
            .header("sec-fetch-site", "same-origin")
            .body(Body::from(form_body(fields)))
            .unwrap(),
    )
    .await
}
