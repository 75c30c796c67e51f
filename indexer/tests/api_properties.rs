//! Property tests of the indexer's HTTP API over real sockets: one in-process indexer (two
//! replicas with real ZeroMQ publishers, admin token "sekret") takes generated JSON bodies and
//! byte mutations of valid ones on `POST /v1/route`, `/v1/complete` and `/debug/lookup`,
//! `GET /debug/lookup` query strings, `POST /admin/replicas` and the per-replica admin routes
//! (with the token, a wrong one and none), and odd methods and paths. Proves: every request is
//! answered (a client timeout bounds each one: no hang, no dropped connection from a panicking
//! handler) with a 2xx or 4xx status, never 5xx (`GET /readyz` may say 503: not ready is its
//! documented answer); after each run `/healthz` still answers and a valid route request still
//! routes (to r0, r1 or a replica the run added).
//!
//! Admin requests with the right token only name loopback addresses and replicas whose names
//! start with `fz` (the run must not drain or remove the two real replicas, nor make the
//! indexer connect anywhere but 127.0.0.1). Assertions are on status classes only: the route
//! and completion contracts are still changing.
//!
//! Cases: `PROPTEST_CASES` (default per test below); failures are shrunk, printed and persisted
//! next to this file. See docs/fuzzing.md.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use common::*;
use kvroute_indexer::policies::Policy;
use kvroute_indexer::state::AppState;
use kvroute_testkit::mutate::{apply, byte_mutation, ByteMutation};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError};
use reqwest::Method;
use serde_json::{json, Map, Value};

fn config(default_cases: u32) -> ProptestConfig {
    kvroute_testkit::cases::config(default_cases, Some(512))
}

/// The server under test, shared by every property (they run in parallel against it).
struct Server {
    rt: tokio::runtime::Runtime,
    base: String,
    client: reqwest::Client,
    _state: Arc<AppState>,
    _publishers: (Publisher, Publisher),
}

static SERVER: LazyLock<Server> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (publishers, state, base) = rt.block_on(async {
        let p0 = Publisher::start(0, 0).await;
        let mut p1 = Publisher::start(0, 0).await;
        let cfg = config_text(
            &[
                ("r0", free_port(), p0.pub_port, p0.replay_port, false),
                ("r1", free_port(), p1.pub_port, p1.replay_port, false),
            ],
            "",
        );
        let state = start_indexer(&cfg, Policy::Kv);
        wait_connected(&state, "r0").await;
        wait_connected(&state, "r1").await;
        // Some content, so lookups and routes hit real index entries.
        let prompt: Vec<u32> = (1..=21).collect();
        p1.publish(vec![stored(&[1, 2, 3, 4, 5], None, &prompt[..20], 4)])
            .await;
        assert!(
            wait_until(Duration::from_secs(10), || held(&state, "r1", &prompt) == 5).await,
            "the index never took the test blocks"
        );
        let base = serve_http(state.clone()).await;
        ((p0, p1), state, base)
    });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    Server {
        rt,
        base,
        client,
        _state: state,
        _publishers: publishers,
    }
});

/// How a request authenticates on admin routes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Auth {
    None,
    Token,
    Wrong,
}

#[derive(Debug, Clone)]
struct Request {
    method: Method,
    path: String,
    body: Vec<u8>,
    auth: Auth,
    session: Option<String>,
}

/// Sends one request; the status, or a test failure when there is no answer.
fn send(req: &Request) -> Result<u16, TestCaseError> {
    let s = &*SERVER;
    let url = format!("{}{}", s.base, req.path);
    s.rt.block_on(async {
        let mut b = s
            .client
            .request(req.method.clone(), &url)
            .header("content-type", "application/json")
            .body(req.body.clone());
        match req.auth {
            Auth::None => {}
            Auth::Token => b = b.bearer_auth("sekret"),
            Auth::Wrong => b = b.bearer_auth("sekreT"),
        }
        if let Some(v) = &req.session {
            if let Ok(v) = reqwest::header::HeaderValue::from_str(v) {
                b = b.header("x-session-id", v);
            }
        }
        match b.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                // Read the whole answer: a handler must not fail mid-body either.
                resp.bytes().await.map_err(|e| {
                    TestCaseError::fail(format!("{status} answer body not readable: {e}"))
                })?;
                Ok(status)
            }
            Err(e) => Err(TestCaseError::fail(format!(
                "no answer to {} {} (hang or a panicking handler): {e}",
                req.method, req.path
            ))),
        }
    })
}

/// `/v1/route` answers by class during the run: (2xx, 4xx).
static ROUTE_2XX: AtomicUsize = AtomicUsize::new(0);
static ROUTE_4XX: AtomicUsize = AtomicUsize::new(0);

/// The property every request has to hold.
fn answered_without_5xx(req: &Request) -> Result<(), TestCaseError> {
    let status = send(req)?;
    if req.path == "/v1/route" {
        let counter = if status < 300 { &ROUTE_2XX } else { &ROUTE_4XX };
        counter.fetch_add(1, Ordering::Relaxed);
    }
    let readyz = req.method == Method::GET && req.path.starts_with("/readyz");
    prop_assert!(
        (200..300).contains(&status) || (400..500).contains(&status) || (readyz && status == 503),
        "{} {} answered {}",
        req.method,
        req.path,
        status
    );
    Ok(())
}

/// After a run: the server is alive and still routes.
fn still_serves() {
    let s = &*SERVER;
    s.rt.block_on(async {
        let h = s
            .client
            .get(format!("{}/healthz", s.base))
            .send()
            .await
            .expect("/healthz answers after the run");
        assert_eq!(h.status(), 200);
        let r = s
            .client
            .post(format!("{}/v1/route", s.base))
            .json(&json!({"model": "m", "token_ids": (1..=21).collect::<Vec<u32>>()}))
            .send()
            .await
            .expect("/v1/route answers after the run");
        assert_eq!(r.status(), 200, "a valid route request no longer routes");
        let v: Value = r.json().await.expect("route answer is JSON");
        // r0 or r1, or one the admin run added (with scraping off an added replica counts as
        // healthy, and the run's undone decisions load r0 and r1).
        let replica = v["replica"].as_str().unwrap_or_default();
        assert!(
            replica == "r0" || replica == "r1" || replica.starts_with("fz"),
            "{v}"
        );
    });
}

// ---------------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------------

/// Any JSON value, with the test fleet's names among its strings.
fn junk() -> impl Strategy<Value = Value> {
    let words = prop_oneof![
        1 => any::<String>(),
        1 => prop::sample::select(vec!["m", "r0", "r1", "", "kv-events"]).prop_map(str::to_owned),
    ];
    let keys = "[a-z_]{0,10}".prop_map(|k: String| k);
    let shape = kvroute_testkit::json::Shape {
        depth: 3,
        size: 24,
        width: 5,
    };
    kvroute_testkit::json::value(words, keys, shape)
}

/// `Some(value)` with probability `p`: a typical value, or junk.
fn field<S: Strategy<Value = Value> + 'static>(
    p: f64,
    typical: S,
) -> impl Strategy<Value = Option<Value>> {
    prop::option::weighted(p, prop_oneof![8 => typical, 1 => junk()])
}

fn big_u64() -> impl Strategy<Value = Value> {
    prop_oneof![
        0u64..100,
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(1u64 << 32),
        any::<u64>(),
    ]
    .prop_map(Value::from)
}

fn token_ids() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => prop::collection::vec(1u32..30, 0..40).prop_map(|v| json!(v)),
        1 => prop::collection::vec(any::<u32>(), 0..8).prop_map(|v| json!(v)),
        1 => (1usize..20_000).prop_map(|n| json!((0..n as u32).collect::<Vec<_>>())),
        1 => Just(json!([-1, 2])),
    ]
}

/// A `/v1/route` (and `/debug/lookup`) body: `RouteRequest`'s fields, typical or junk.
fn route_body() -> impl Strategy<Value = Value> {
    (
        (
            field(
                0.95,
                prop::sample::select(vec!["m", "m", "m", "nope", ""]).prop_map(Value::from),
            ),
            field(0.6, token_ids()),
            field(
                0.3,
                prop::collection::vec(any::<u64>(), 0..30).prop_map(|v| json!(v)),
            ),
            field(0.3, big_u64()),
            field(
                0.3,
                prop_oneof![0u32..64, Just(4u32), Just(u32::MAX)].prop_map(Value::from),
            ),
        ),
        (
            field(0.2, "[a-z-]{0,12}".prop_map(Value::from)),
            field(0.2, "[a-z0-9]{0,12}".prop_map(Value::from)),
            field(0.3, any::<String>().prop_map(Value::from)),
            field(
                0.3,
                prop_oneof!["[a-z0-9-]{0,40}", "x{100,300}"].prop_map(Value::from),
            ),
            field(0.3, big_u64()),
            field(0.2, any::<String>().prop_map(Value::from)),
            prop::option::weighted(0.05, ("[a-z_]{1,10}", junk())),
        ),
    )
        .prop_map(
            |(
                (model, tokens, keys, num_tokens, block_size),
                (lora, salt, request_id, callout_id, max_tokens, session, extra),
            )| {
                let mut m = Map::new();
                for (k, v) in [
                    ("model", model),
                    ("token_ids", tokens),
                    ("router_keys", keys),
                    ("num_tokens", num_tokens),
                    ("block_size", block_size),
                    ("lora", lora),
                    ("cache_salt", salt),
                    ("request_id", request_id),
                    ("callout_id", callout_id),
                    ("max_tokens", max_tokens),
                    ("session", session),
                ] {
                    if let Some(v) = v {
                        m.insert(k.into(), v);
                    }
                }
                if let Some((k, v)) = extra {
                    m.insert(k, v);
                }
                Value::Object(m)
            },
        )
}

fn complete_body() -> impl Strategy<Value = Value> {
    (
        field(
            0.7,
            prop_oneof!["[a-z0-9-]{0,40}", any::<String>()].prop_map(Value::from),
        ),
        field(0.3, "[a-z0-9-]{0,40}".prop_map(Value::from)),
        field(0.3, any::<bool>().prop_map(Value::from)),
        field(0.3, big_u64()),
        field(0.2, any::<String>().prop_map(Value::from)),
        field(0.2, "127.0.0.1:[0-9]{1,5}".prop_map(Value::from)),
        prop::option::weighted(0.05, ("[a-z_]{1,10}", junk())),
    )
        .prop_map(
            |(decision, callout, abandoned, cached, request_id, endpoint, extra)| {
                let mut m = Map::new();
                for (k, v) in [
                    ("decision_id", decision),
                    ("callout_id", callout),
                    ("abandoned", abandoned),
                    ("cached_tokens", cached),
                    ("request_id", request_id),
                    ("endpoint", endpoint),
                ] {
                    if let Some(v) = v {
                        m.insert(k.into(), v);
                    }
                }
                if let Some((k, v)) = extra {
                    m.insert(k, v);
                }
                Value::Object(m)
            },
        )
}

/// Loopback ports this test holds open for the whole run: the only ones admin-added replicas
/// name, so their HTTP discovery and event connections reach these listeners (which never
/// answer) and their binds fail, instead of touching ports other tests on the machine use.
static RESERVED: LazyLock<Vec<std::net::TcpListener>> = LazyLock::new(|| {
    (0..4)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("reserve a port"))
        .collect()
});

fn reserved_port() -> impl Strategy<Value = u16> {
    (0usize..4).prop_map(|i| RESERVED[i].local_addr().expect("reserved").port())
}

/// A loopback-only address string (or something that is not an address at all).
fn loopback_addr() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => reserved_port().prop_map(|p| format!("127.0.0.1:{p}")),
        1 => prop::sample::select(vec!["", "127.0.0.1", "127.0.0.1:", "not-an-address", ":80"])
            .prop_map(str::to_owned),
    ]
}

fn zmq_endpoint() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => reserved_port().prop_map(|p| format!("tcp://127.0.0.1:{p}")),
        1 => prop::sample::select(vec!["", "tcp://", "tcp://:1", "udp://127.0.0.1:1",
            "tcp://127.0.0.1:99999", "tcp://127.0.0.1"])
            .prop_map(str::to_owned),
    ]
}

/// A `POST /admin/replicas` body that the token may send: loopback addresses, `fz` names.
fn admin_body() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(vec!["m", "m", "nope", ""]),
        prop_oneof![4 => "fz[a-z0-9._-]{0,10}", 1 => Just(String::new()), 1 => Just("fz bad".to_owned())],
        loopback_addr(),
        prop::option::weighted(0.2, loopback_addr()),
        prop::collection::vec(zmq_endpoint(), 0..3),
        prop::collection::vec(zmq_endpoint(), 0..3),
        prop::option::weighted(0.3, prop_oneof![0u32..4, Just(2000u32)]),
        prop::option::weighted(0.2, any::<bool>()),
        prop::option::weighted(0.05, "[a-z_]{1,10}"),
    )
        .prop_map(
            |(model, name, http, endpoint, events, replay, dp, bind, unknown)| {
                let mut m = json!({"model": model, "name": name, "http": http,
                    "events": events, "replay": replay, "topic": "kv-events"});
                if let Some(e) = endpoint {
                    m["endpoint"] = json!(e);
                }
                if let Some(dp) = dp {
                    m["data_parallel_size"] = json!(dp);
                }
                if let Some(b) = bind {
                    m["bind"] = json!(b);
                }
                if let Some(k) = unknown {
                    m[k] = json!(1);
                }
                m
            },
        )
}

/// Syntax pieces the byte edits insert (besides random bytes).
const API_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    "\"",
    ",",
    ":",
    "null",
    "-1",
    "1e999",
    "18446744073709551616",
    "\\ud800",
    "[[[[[[[[[[",
    "\"model\":\"m\",",
];

fn mutate(mut bytes: Vec<u8>, edits: &[ByteMutation]) -> Vec<u8> {
    for m in edits {
        apply(&mut bytes, m);
    }
    bytes
}

fn json_endpoint() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["/v1/route", "/debug/lookup"])
}

fn auth() -> impl Strategy<Value = Auth> {
    prop::sample::select(vec![Auth::None, Auth::Wrong])
}

fn session() -> impl Strategy<Value = Option<String>> {
    prop::option::weighted(0.2, prop_oneof!["[a-z0-9]{0,16}", any::<String>()])
}

fn post(path: &str, body: Vec<u8>) -> Request {
    Request {
        method: Method::POST,
        path: path.to_owned(),
        body,
        auth: Auth::None,
        session: None,
    }
}

/// A percent-encoded path segment (any bytes).
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "r0", "r1", "m", "fz1", "", "..", "%00", "%2F", "a%20b"
        ])
        .prop_map(str::to_owned),
        prop::collection::vec(any::<u8>(), 0..12)
            .prop_map(|b| { b.iter().map(|c| format!("%{c:02X}")).collect::<String>() }),
        "[a-zA-Z0-9._~-]{0,20}",
        "x{200,2000}",
    ]
}

/// Whether `method path`, with the path as the client normalises it (`..`, `.`, `%2E`), still
/// matches an admin route (`POST /admin/replicas`, `DELETE /admin/replicas/{name}`,
/// `POST /admin/replicas/{name}/drain|undrain`, with a non-empty name).
fn admin_route(method: &Method, path: &str) -> bool {
    let Ok(url) = reqwest::Url::parse(&format!("http://x{path}")) else {
        return false;
    };
    let segs: Vec<&str> = url
        .path_segments()
        .map(Iterator::collect)
        .unwrap_or_default();
    match segs.as_slice() {
        ["admin", "replicas"] => method == Method::POST,
        ["admin", "replicas", name] => method == Method::DELETE && !name.is_empty(),
        ["admin", "replicas", name, "drain" | "undrain"] => {
            method == Method::POST && !name.is_empty()
        }
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(512))]

    fn route_and_lookup_bodies(
        path in json_endpoint(),
        body in route_body(),
        session in session(),
    ) {
        let mut req = post(path, serde_json::to_vec(&body).expect("json"));
        req.session = session;
        answered_without_5xx(&req)?;
    }

    fn complete_bodies(body in complete_body()) {
        answered_without_5xx(&post("/v1/complete", serde_json::to_vec(&body).expect("json")))?;
    }

    fn mutated_bodies(
        which in 0usize..3,
        route in route_body(),
        complete in complete_body(),
        edits in prop::collection::vec(byte_mutation(API_TOKENS), 1..6),
    ) {
        let (path, body) = match which {
            0 => ("/v1/route", route),
            1 => ("/debug/lookup", route),
            _ => ("/v1/complete", complete),
        };
        let bytes = mutate(serde_json::to_vec(&body).expect("json"), &edits);
        answered_without_5xx(&post(path, bytes))?;
    }

    fn lookup_queries(
        model in prop_oneof![Just("m".to_owned()), segment()],
        keys in prop_oneof![
            prop::collection::vec(any::<u64>(), 0..40)
                .prop_map(|k| k.iter().map(u64::to_string).collect::<Vec<_>>().join(",")),
            segment(),
        ],
        drop_model in prop::bool::weighted(0.1),
        drop_keys in prop::bool::weighted(0.1),
    ) {
        let mut q = Vec::new();
        if !drop_model {
            q.push(format!("model={model}"));
        }
        if !drop_keys {
            q.push(format!("keys={keys}"));
        }
        let req = Request {
            method: Method::GET,
            path: format!("/debug/lookup?{}", q.join("&")),
            body: Vec::new(),
            auth: Auth::None,
            session: None,
        };
        answered_without_5xx(&req)?;
    }

    fn admin_requests(
        body in admin_body(),
        edits in prop::collection::vec(byte_mutation(API_TOKENS), 0..4),
        unauth in auth(),
        action in 0usize..5,
        name in prop_oneof!["fz[a-z0-9]{0,6}", segment()],
    ) {
        // With the token: generated loopback bodies and only `fz` replicas; mutations and
        // any name only without it (refused before anything is parsed or done).
        let (auth, body_bytes) = if edits.is_empty() {
            (Auth::Token, serde_json::to_vec(&body).expect("json"))
        } else {
            (unauth, mutate(serde_json::to_vec(&body).expect("json"), &edits))
        };
        let name = if auth == Auth::Token && !name.starts_with("fz") {
            format!("fz{name}")
        } else {
            name
        };
        let (method, path) = match action {
            0 | 1 => (Method::POST, "/admin/replicas".to_owned()),
            2 => (Method::DELETE, format!("/admin/replicas/{name}")),
            3 => (Method::POST, format!("/admin/replicas/{name}/drain")),
            _ => (Method::POST, format!("/admin/replicas/{name}/undrain")),
        };
        let req = Request { method, path, body: body_bytes, auth, session: None };
        let status = send(&req)?;
        prop_assert!((200..300).contains(&status) || (400..500).contains(&status),
            "{} {} answered {}", req.method, req.path, status);
        if auth != Auth::Token && admin_route(&req.method, &req.path) {
            // 401; or 400 from the path extractor, before the handler, for a name that does not
            // percent-decode to UTF-8.
            prop_assert!(status == 401 || status == 400,
                "an admin request without the token answered {}", status);
        }
    }

    fn odd_methods_and_paths(
        method in prop::sample::select(vec![
            Method::GET, Method::POST, Method::PUT, Method::DELETE, Method::PATCH,
            Method::HEAD, Method::OPTIONS,
        ]),
        base in prop::sample::select(vec![
            "/", "/v1/route", "/v1/complete", "/v1/models", "/v1/models/m/tokenizer",
            "/v1/models/nope/tokenizer", "/metrics", "/healthz", "/readyz", "/debug/replicas",
            "/debug/lookup", "/admin/replicas", "/v1", "/v1/route/", "//v1/route",
            "/v1/models/", "/admin",
        ]),
        extra in prop::option::weighted(0.4, segment()),
        query in prop::option::weighted(0.2, segment()),
        body in prop::collection::vec(any::<u8>(), 0..64),
        auth in auth(),
    ) {
        let mut path = base.to_owned();
        if let Some(e) = extra {
            if !path.ends_with('/') {
                path.push('/');
            }
            path.push_str(&e);
        }
        if let Some(q) = query {
            path.push('?');
            path.push_str(&q);
        }
        answered_without_5xx(&Request { method, path, body, auth, session: None })?;
    }
}

/// The route-side properties in turn, then the server still serves.
#[test]
fn route_complete_and_lookup() {
    route_and_lookup_bodies();
    complete_bodies();
    mutated_bodies();
    lookup_queries();
    still_serves();
    // Not vacuous: generated route requests were both routed and refused.
    let (ok, refused) = (
        ROUTE_2XX.load(Ordering::Relaxed),
        ROUTE_4XX.load(Ordering::Relaxed),
    );
    assert!(
        ok >= 10 && refused >= 10,
        "/v1/route: {ok} routed, {refused} refused"
    );
}

/// The admin and odd-request properties in turn, then the server still serves.
#[test]
fn admin_and_odd_requests() {
    admin_requests();
    odd_methods_and_paths();
    still_serves();
}
