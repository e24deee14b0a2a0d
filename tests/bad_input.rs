//! Property test of user input (`docs/rules.md#bad-input-and-errors`):
//! arbitrary message types, keys, header names and values, and payloads
//! (empty, non-UTF-8, large). Each message is either refused at enqueue with
//! an error naming what was wrong — and nothing is written — or accepted and
//! delivered intact. The relay never panics and never gets stuck. Runs on
//! memory, SQLite and PostgreSQL; and what SQLite refuses, PostgreSQL
//! refuses with the same error kind (and accepts what it accepts).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use outbox::memory::MemoryStore;
use outbox::{Handlers, Message, MessageKind, NewMessage, Relay};
use outbox_api::testing::StoreUnderTest;
use outbox_postgres::testing::PgUnderTest;
use outbox_sqlite::testing::SqlxUnderTest;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Input {
    message_type: String,
    key: Option<String>,
    headers: Vec<(String, String)>,
    payload: Vec<u8>,
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[A-Za-z][A-Za-z0-9_.-]{0,20}",
        1 => Just(String::new()),
        1 => Just("   ".to_owned()),
        1 => "\\PC{0,300}",
        1 => any::<String>(),
        1 => "[a-z]{250,260}",
    ]
}

fn input() -> impl Strategy<Value = Input> {
    let payload = prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => (0usize..2).prop_map(|n| vec![0xffu8; n * 1_000_000 + 1]),
    ];
    (
        text(),
        proptest::option::of(text()),
        proptest::collection::vec((text(), any::<String>()), 0..3),
        payload,
    )
        .prop_map(|(message_type, key, headers, payload)| Input {
            message_type,
            key,
            headers,
            payload,
        })
}

fn build(i: &Input) -> NewMessage {
    let mut m = NewMessage::new(
        MessageKind::Domain,
        i.message_type.clone(),
        i.payload.clone(),
    );
    if let Some(k) = &i.key {
        m = m.key(k.clone());
    }
    for (n, v) in &i.headers {
        m = m.header(n.clone(), v.clone());
    }
    m
}

/// What the rules (`docs/rules.md#bad-input-and-errors`) say is wrong with
/// `i` first, as the words its error must hold; `None` when nothing is.
/// Written from the rules, not from the code that checks them: fields in
/// the order message type, key, headers (by name); a text field must not
/// be blank, longer than its limit or hold a control character; a header
/// name no whitespace; a header value no NUL.
fn first_fault(i: &Input) -> Option<String> {
    use outbox_api::limits;
    let bad_text = |v: &str, max: usize| {
        v.trim().is_empty() || v.len() > max || v.chars().any(char::is_control)
    };
    if bad_text(&i.message_type, limits::MAX_TYPE_LEN) {
        return Some("message_type".into());
    }
    if let Some(key) = &i.key {
        if bad_text(key, limits::MAX_KEY_LEN) {
            return Some("key".into());
        }
    }
    // The message keeps the last value of a repeated name, in name order.
    let headers: BTreeMap<&String, &String> = i.headers.iter().map(|(n, v)| (n, v)).collect();
    for (name, value) in headers {
        if bad_text(name, limits::MAX_HEADER_NAME_LEN) || name.chars().any(char::is_whitespace) {
            return Some("header name".into());
        }
        if value.contains('\0') {
            return Some(format!("header `{name}`"));
        }
    }
    None
}

async fn check(sut: Box<dyn StoreUnderTest>, inputs: Vec<Input>) {
    let delivered: Arc<Mutex<Vec<Message>>> = Default::default();
    let mut handlers = Handlers::new();
    for i in &inputs {
        let d = delivered.clone();
        handlers = handlers.on_message(i.message_type.clone(), move |m: &Message| {
            d.lock().unwrap().push(m.clone());
            async { Ok::<_, std::io::Error>(()) }
        });
    }
    let relay = Relay::builder_shared(sut.store())
        .dispatcher(handlers)
        .batch_size(7)
        .build()
        .unwrap();
    let mut accepted = Vec::new();
    for i in &inputs {
        let message = build(i);
        let fault = first_fault(i);
        match sut.try_enqueue(vec![message]).await {
            Ok(ids) => {
                assert_eq!(fault, None, "accepted a message the rules refuse: {i:?}");
                accepted.push((ids[0], i.clone()));
            }
            Err(e) => {
                let text = e.to_string();
                // Nothing wrong by the rules: only a store's own limit on
                // the payload may refuse it.
                let named = fault.unwrap_or_else(|| "payload".into());
                assert!(
                    text.contains(&named),
                    "the error names what was wrong ({named}): {text}"
                );
            }
        }
    }
    let stats = sut.store().stats().await.unwrap();
    assert_eq!(
        stats.pending as usize,
        accepted.len(),
        "a refused message wrote nothing"
    );
    let report = tokio::time::timeout(std::time::Duration::from_secs(60), relay.drain())
        .await
        .expect("the relay is not stuck")
        .unwrap();
    assert_eq!(report.delivered as usize, accepted.len(), "{report:?}");
    let delivered = delivered.lock().unwrap();
    for (id, i) in accepted {
        let m = delivered.iter().find(|m| m.id == id).expect("delivered");
        assert_eq!(m.payload, i.payload, "payload intact");
        assert_eq!(m.message_type, i.message_type);
        assert_eq!(m.key, i.key);
        let headers: BTreeMap<String, String> = i.headers.iter().cloned().collect();
        assert_eq!(m.headers, headers, "headers intact");
    }
}

/// Each input alone on SQLite and on PostgreSQL: both accept it, or both
/// refuse it with the same error kind.
async fn same_answers(inputs: Vec<Input>) {
    let sqlite = SqlxUnderTest::fresh(None).await;
    let pg = PgUnderTest::fresh(None).await;
    for i in &inputs {
        let a = sqlite.try_enqueue(vec![build(i)]).await.map(|_| ());
        let b = pg.try_enqueue(vec![build(i)]).await.map(|_| ());
        match (&a, &b) {
            (Ok(()), Ok(())) => {}
            (Err(x), Err(y)) => assert_eq!(
                x.kind(),
                y.kind(),
                "SQLite: {x}; PostgreSQL: {y}; input {i:?}"
            ),
            _ => panic!("SQLite: {a:?}; PostgreSQL: {b:?}; input {i:?}"),
        }
    }
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(32);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_input_is_refused_clearly_or_delivered_intact_memory(inputs in proptest::collection::vec(input(), 1..6)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(check(Box::new(MemoryStore::new()), inputs));
    }

    #[test]
    fn any_input_is_refused_clearly_or_delivered_intact_sqlite(inputs in proptest::collection::vec(input(), 1..6)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async { check(Box::new(SqlxUnderTest::fresh(None).await), inputs).await });
    }

    #[test]
    fn any_input_is_refused_clearly_or_delivered_intact_postgres(inputs in proptest::collection::vec(input(), 1..6)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async { check(Box::new(PgUnderTest::fresh(None).await), inputs).await });
    }

    #[test]
    fn postgres_refuses_what_sqlite_refuses_with_the_same_kind(inputs in proptest::collection::vec(input(), 1..6)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(same_answers(inputs));
    }
}
