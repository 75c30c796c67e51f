//! The filter's logic (`plugin` + `stream`) against a fake host, natively, with the real Qwen3
//! tokenizer: the same code the proxy-wasm build runs, without Envoy. The e2e tests check the
//! adapters in the real Envoy.
//!
//! Tests that read a request's completion report configure `"complete_hold_ms": 0` (each report
//! sent by itself, at once); holding reports for a route call has its own tests at the end.

mod fake_host;

use std::sync::{Arc, Mutex};

use fake_host::*;
use kvroute_core::request::{Endpoint, RequestBody};
use kvroute_filter::models::Lookup;
use kvroute_filter::plugin::Plugin;
use kvroute_filter::protocol::FailOpen;
use kvroute_filter::seam::{CallReply, Flow, Host, HostError};
use kvroute_filter::stream::{Stream, DESTINATIONS_HEADER, DST_HEADER};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

fn chat_body(system: &str) -> Vec<u8> {
    json!({"model": "qwen3", "max_tokens": 32, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is KV cache aware routing?"}]})
    .to_string()
    .into_bytes()
}

fn long_system() -> String {
    "You are a helpful assistant who answers in full sentences. ".repeat(30)
}

/// Headers and body through the stream; returns the flow of the last body callback.
/// The router keys of a route call's body (sent packed, `kvroute_core::packed_keys`).
fn router_keys(call: &Value) -> Vec<u64> {
    let packed = call["router_keys"].as_str().expect("router_keys, packed");
    kvroute_core::packed_keys::decode(packed).expect("packed router keys")
}

fn send_request(stream: &mut Stream, host: &mut FakeHost) -> Flow {
    assert_eq!(stream.on_request_headers(host, false), Flow::Pause);
    let size = host.request_body.len();
    assert_eq!(stream.on_request_body(host, size / 2, false), Flow::Pause);
    stream.on_request_body(host, size, true)
}

fn route_answer(endpoint: &str) -> CallReply {
    CallReply {
        status: Some(200),
        contract: Some(kvroute_core::api::CONTRACT_VERSION_STR.to_string()),
        body: json!({"endpoint": endpoint, "replica": "r1", "reason": "prefix_hit",
                     "matched_tokens": {"gpu": 48, "cpu": 0, "storage": 0},
                     "decision_id": "d-1"})
        .to_string()
        .into_bytes(),
    }
}

/// Streams a response of `chunks` through the stream as Envoy does: a chunk held
/// ([`Flow::Pause`]) stays buffered and the next callback sees everything buffered. Returns what
/// the client receives.
fn respond(
    stream: &mut Stream,
    host: &mut FakeHost,
    content_type: &str,
    chunks: &[&[u8]],
) -> Vec<u8> {
    host.response_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), content_type.into()),
    ];
    assert_eq!(stream.on_response_headers(host, false), Flow::Continue);
    let mut held = Vec::new();
    let mut sent = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        host.advance_ms(5);
        held.extend_from_slice(c);
        host.response_chunk = held.clone();
        let last = i + 1 == chunks.len();
        match stream.on_response_body(host, held.len(), last) {
            Flow::Continue => {
                sent.append(&mut host.response_chunk);
                held.clear();
            }
            Flow::Pause => assert!(!last, "the last chunk is never held"),
        }
    }
    sent
}

const SSE_USAGE: &[u8] =
    b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":300,\"prompt_tokens_details\":{\"cached_tokens\":288}}}\n\n";

#[test]
fn the_plugin_is_shareable_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Plugin>();
}

#[test]
fn a_client_destination_header_is_stripped_on_every_path() {
    let plugin = default_plugin();
    for (method, path) in [
        ("POST", CHAT),
        ("GET", "/healthz"),
        ("POST", "/v1/embeddings"),
    ] {
        let mut host = FakeHost::post(path, &[(DST_HEADER, "10.9.9.9:1")], b"{}");
        host.request_headers[0].1 = method.into();
        let mut stream = Stream::new(1, Some(Arc::clone(&plugin)));
        stream.on_request_headers(&mut host, false);
        assert_eq!(host.request_header(DST_HEADER), None, "{method} {path}");
        assert_eq!(host.count("kvroute.spoofed_header_removed"), 1);
    }
    // Before any configuration, the header is stripped all the same.
    let mut host = FakeHost::post(CHAT, &[(DST_HEADER, "10.9.9.9:1")], b"{}");
    let mut stream = Stream::new(2, None);
    assert_eq!(stream.on_request_headers(&mut host, false), Flow::Continue);
    assert_eq!(host.request_header(DST_HEADER), None);
}

#[test]
fn a_client_destination_list_is_stripped_too() {
    let plugin = default_plugin();
    let mut host = FakeHost::post(
        CHAT,
        &[(DESTINATIONS_HEADER, "10.9.9.9:1,10.9.9.8:1")],
        b"{}",
    );
    let mut stream = Stream::new(1, Some(plugin));
    stream.on_request_headers(&mut host, false);
    assert_eq!(host.request_header(DESTINATIONS_HEADER), None);
    assert_eq!(host.count("kvroute.spoofed_header_removed"), 1);
}

#[test]
fn the_destination_list_names_the_choice_then_its_valid_alternates() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}}));
    let body = chat_body(&long_system());
    for (alternates, expected) in [
        (json!([]), "10.0.0.7:8000"),
        (
            json!([
                "10.0.0.8:8000",
                "not-an-address",
                "10.0.0.7:8000",
                "10.0.0.8:8000"
            ]),
            "10.0.0.7:8000,10.0.0.8:8000",
        ),
    ] {
        let mut host = FakeHost::post(CHAT, &[], &body);
        let mut stream = Stream::new(1, Some(Arc::clone(&plugin)));
        assert_eq!(send_request(&mut stream, &mut host), Flow::Pause);
        let route = host.last_call().clone();
        let mut answer = route_answer("10.0.0.7:8000");
        let mut answer_body: Value = serde_json::from_slice(&answer.body).expect("json");
        answer_body["alternates"] = alternates;
        answer.body = answer_body.to_string().into_bytes();
        stream.on_call_reply(&mut host, route.id, &answer);
        assert_eq!(host.request_header(DST_HEADER), Some("10.0.0.7:8000"));
        assert_eq!(host.request_header(DESTINATIONS_HEADER), Some(expected));
    }
}

#[test]
fn a_header_that_cannot_be_stripped_refuses_the_request() {
    let plugin = default_plugin();
    let mut host = FakeHost::post(CHAT, &[(DST_HEADER, "10.9.9.9:1")], &chat_body("x"));
    host.fail_remove = true;
    let mut stream = Stream::new(1, Some(plugin));
    assert_eq!(stream.on_request_headers(&mut host, false), Flow::Pause);
    let reply = host.local_reply.clone().expect("a local reply");
    assert_eq!(reply.status, 503);
    assert_eq!(reply.details, "kvroute_header_strip_failed");
    assert_eq!(host.count("kvroute.strip_failed_rejected"), 1);
    assert!(host.calls.is_empty());
    assert_eq!(
        stream.on_request_body(&mut host, 10, true),
        Flow::Pause,
        "a refused request is never forwarded"
    );
}

#[test]
fn a_routed_request_gets_the_header_and_its_completion_is_reported() {
    let plugin = plugin_with_qwen3(
        json!({"models": {"qwen3": {}}, "debug_headers": true, "complete_hold_ms": 0}),
    );
    let body = chat_body(&long_system());
    let mut host = FakeHost::post(
        CHAT,
        &[("x-request-id", "req-7"), ("x-session-id", "user-42")],
        &body,
    );
    let mut stream = Stream::new(1, Some(plugin));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Pause);

    let route = host.last_call().clone();
    assert!(!route.detached);
    assert_eq!(route.cluster, "kvroute_indexer");
    assert_eq!(route.header(":path"), Some("/v1/route"));
    assert_eq!(route.timeout_ms, 100);
    let r = route.json();
    assert_eq!(r["model"], "qwen3");
    assert_eq!(r["request_id"], "req-7");
    assert_eq!(r["session"], "user-42");
    assert_eq!(r["max_tokens"], 32);
    assert_eq!(r["block_size"], 16);
    let tokens = r["num_tokens"].as_u64().expect("num_tokens");
    let keys = router_keys(&r);
    assert!(tokens > 300, "{tokens}");
    assert_eq!(keys.len() as u64, tokens / 16, "one key per full block");
    let callout_id = r["callout_id"].as_str().expect("callout_id").to_string();
    assert_eq!(
        host.request_header(DST_HEADER),
        None,
        "not before the answer"
    );

    host.advance_ms(3);
    stream.on_call_reply(&mut host, route.id, &route_answer("10.0.0.7:8000"));
    assert_eq!(host.request_header(DST_HEADER), Some("10.0.0.7:8000"));
    assert_eq!(host.request_header("x-kvroute-replica"), Some("r1"));
    assert_eq!(host.request_header("x-kvroute-matched-tokens"), Some("48"));
    assert_eq!(host.resumed, 1);
    assert_eq!(host.count("kvroute.routed"), 1);
    assert_eq!(host.count("kvroute.requests"), 1);
    assert!(host.fail_opens().is_empty(), "{:?}", host.fail_opens());

    respond(
        &mut stream,
        &mut host,
        "text/event-stream",
        &[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"KV\"}}]}\n\n",
            SSE_USAGE,
            b"data: [DONE]\n\n",
        ],
    );
    assert_eq!(host.response_header("x-kvroute-reason"), Some("prefix_hit"));
    stream.on_stream_end(&mut host);
    stream.on_stream_end(&mut host);
    let reports = host.detached_calls();
    assert_eq!(reports.len(), 1, "reported once");
    assert_eq!(reports[0].header(":path"), Some("/v1/complete"));
    let c = reports[0].json();
    assert_eq!(c["decision_id"], "d-1");
    assert_eq!(c["endpoint"], "10.0.0.7:8000");
    assert_eq!(c["cached_tokens"], 288);
    // `abandoned: false` is left out: every indexer that reads decision ids defaults it.
    assert_eq!(c.get("abandoned"), None);
    assert_eq!(
        c["ttft_us"], 5_000,
        "first chunk 5 ms after the request left"
    );
    assert_ne!(c["request_id"], json!(callout_id));
    assert_eq!(host.count("kvroute.complete_sent"), 1);
}

#[test]
fn shadow_mode_asks_but_never_sets_the_destination_and_reports_the_real_upstream() {
    let plugin = plugin_with_qwen3(
        json!({"models": {"qwen3": {}}, "mode": "shadow", "debug_headers": true,
               "complete_hold_ms": 0}),
    );
    let body = chat_body(&long_system());
    let mut host = FakeHost::post(
        CHAT,
        &[(DST_HEADER, "10.9.9.9:1"), ("x-session-id", "user-42")],
        &body,
    );
    let mut stream = Stream::new(1, Some(plugin));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Pause);
    assert_eq!(
        host.request_header(DST_HEADER),
        None,
        "the client's is stripped"
    );
    assert_eq!(host.count("kvroute.spoofed_header_removed"), 1);
    let route = host.last_call().clone();
    let r = route.json();
    assert_eq!(r["shadow"], true);
    assert_eq!(r["session"], "user-42");
    assert!(!router_keys(&r).is_empty());

    stream.on_call_reply(&mut host, route.id, &route_answer("10.0.0.7:8000"));
    assert_eq!(
        host.request_header(DST_HEADER),
        None,
        "never set in shadow mode"
    );
    // Debug headers name kvroute's choice as the would-be one, never as where it went.
    assert_eq!(host.request_header("x-kvroute-replica"), None);
    assert_eq!(host.request_header("x-kvroute-matched-tokens"), None);
    assert_eq!(host.request_header("x-kvroute-shadow-replica"), Some("r1"));
    assert_eq!(
        host.request_header("x-kvroute-shadow-matched-tokens"),
        Some("48")
    );
    assert_eq!(host.request_header("x-kvroute-reason"), Some("prefix_hit"));
    assert_eq!(host.resumed, 1);
    assert_eq!(host.count("kvroute.shadowed"), 1);
    assert_eq!(host.count("kvroute.routed"), 0);
    assert!(host.fail_opens().is_empty(), "{:?}", host.fail_opens());

    // Envoy's balancer sent it elsewhere.
    host.upstream = Some("10.0.0.8:8000".into());
    respond(
        &mut stream,
        &mut host,
        "text/event-stream",
        &[SSE_USAGE, b"data: [DONE]\n\n"],
    );
    assert_eq!(host.response_header("x-kvroute-replica"), None);
    assert_eq!(host.response_header("x-kvroute-shadow-replica"), Some("r1"));
    stream.on_stream_end(&mut host);
    let reports = host.detached_calls();
    assert_eq!(reports.len(), 1);
    let c = reports[0].json();
    assert_eq!(c["decision_id"], "d-1");
    assert_eq!(
        c["endpoint"], "10.0.0.7:8000",
        "what kvroute would have chosen"
    );
    assert_eq!(c["upstream"], "10.0.0.8:8000", "where it really went");
    assert_eq!(c["cached_tokens"], 288);
}

#[test]
fn routing_mode_reports_no_upstream_field() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "complete_hold_ms": 0}));
    let mut host = FakeHost::post(CHAT, &[], &chat_body(&long_system()));
    host.upstream = Some("10.0.0.8:8000".into());
    let mut stream = Stream::new(1, Some(plugin));
    send_request(&mut stream, &mut host);
    let route = host.last_call().clone();
    assert!(
        route.json().get("shadow").is_none(),
        "routing requests are unchanged"
    );
    stream.on_call_reply(&mut host, route.id, &route_answer("10.0.0.7:8000"));
    assert_eq!(host.request_header(DST_HEADER), Some("10.0.0.7:8000"));
    respond(&mut stream, &mut host, "text/event-stream", &[SSE_USAGE]);
    stream.on_stream_end(&mut host);
    assert!(host.detached_calls()[0].json().get("upstream").is_none());
}

#[test]
fn a_json_response_reports_its_cached_tokens() {
    let plugin = default_plugin();
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(1, Some(plugin));
    send_request(&mut stream, &mut host);
    let id = host.last_call().id;
    stream.on_call_reply(&mut host, id, &route_answer("10.0.0.1:8000"));
    let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":30,"prompt_tokens_details":{"cached_tokens":16}}}"#;
    let (a, b) = body.split_at(40);
    respond(&mut stream, &mut host, "application/json", &[a, b]);
    stream.on_stream_end(&mut host);
    let c = host.detached_calls()[0].json();
    assert_eq!(c["cached_tokens"], 16);
    assert_eq!(
        c["ttft_us"],
        Value::Null,
        "a JSON body says nothing of the first token"
    );
}

#[test]
fn a_response_that_did_not_end_is_reported_abandoned() {
    let plugin = default_plugin();
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(1, Some(plugin));
    send_request(&mut stream, &mut host);
    let id = host.last_call().id;
    stream.on_call_reply(&mut host, id, &route_answer("10.0.0.1:8000"));
    host.response_headers = vec![("content-type".into(), "text/event-stream".into())];
    stream.on_response_headers(&mut host, false);
    host.response_chunk = SSE_USAGE.to_vec();
    stream.on_response_body(&mut host, SSE_USAGE.len(), false);
    stream.on_stream_end(&mut host);
    let c = host.detached_calls()[0].json();
    assert_eq!(c["abandoned"], true);
    assert_eq!(
        c["cached_tokens"],
        Value::Null,
        "only a finished response counts"
    );
    assert_eq!(host.count("kvroute.abandoned"), 1);
}

#[test]
fn a_client_that_leaves_during_the_route_call_abandons_it() {
    let plugin = default_plugin();
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(1, Some(plugin));
    send_request(&mut stream, &mut host);
    let callout = host.last_call().json()["callout_id"].clone();
    stream.on_stream_end(&mut host);
    let reports = host.detached_calls();
    assert_eq!(reports.len(), 1);
    assert_eq!(
        reports[0].json(),
        json!({"callout_id": callout, "request_id": reports[0].json()["request_id"], "abandoned": true})
    );
    assert_eq!(host.count("kvroute.abandoned"), 1);
    assert_eq!(host.resumed, 0);
}

/// Runs one routed request whose route call gets `reply` (after `wait_ms`); returns the host.
fn route_call_fails(plugin: &Arc<Plugin>, reply: CallReply, wait_ms: u64) -> (FakeHost, Stream) {
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(1, Some(Arc::clone(plugin)));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Pause);
    let id = host.last_call().id;
    host.advance_ms(wait_ms);
    stream.on_call_reply(&mut host, id, &reply);
    assert_eq!(host.resumed, 1, "resumed whatever the answer");
    assert_eq!(host.request_header(DST_HEADER), None, "fails open");
    (host, stream)
}

#[test]
fn every_indexer_failure_fails_open_with_its_reason() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "route_timeout_ms": 100,
                                          "complete_hold_ms": 0}));
    let status = |s: u16, body: &str| CallReply {
        status: Some(s),
        contract: None,
        body: body.as_bytes().to_vec(),
    };
    let cases: Vec<(&str, CallReply, u64, FailOpen, bool)> = vec![
        (
            "reset",
            CallReply::default(),
            2,
            FailOpen::IndexerUnavailable,
            true,
        ),
        (
            "no answer in time",
            CallReply::default(),
            100,
            FailOpen::IndexerTimeout,
            true,
        ),
        (
            "Envoy's timeout",
            status(504, ""),
            100,
            FailOpen::IndexerTimeout,
            true,
        ),
        (
            "down",
            status(503, "no healthy upstream"),
            1,
            FailOpen::IndexerUnavailable,
            false,
        ),
        ("error", status(500, ""), 1, FailOpen::IndexerError, false),
        (
            "unknown model",
            status(404, ""),
            1,
            FailOpen::UnknownModel,
            false,
        ),
        (
            "garbage",
            status(200, "garbage"),
            1,
            FailOpen::BadAnswer,
            true,
        ),
        (
            "a name, not an IP",
            status(200, r#"{"endpoint":"replica-0:8000"}"#),
            1,
            FailOpen::BadAnswer,
            true,
        ),
        (
            "another contract",
            CallReply {
                contract: Some("999".into()),
                ..route_answer("10.0.0.1:1")
            },
            1,
            FailOpen::ContractMismatch,
            true,
        ),
        (
            "another contract, refused",
            status(409, ""),
            1,
            FailOpen::ContractMismatch,
            false,
        ),
    ];
    for (what, reply, wait, reason, abandoned) in cases {
        let (mut host, mut stream) = route_call_fails(&plugin, reply, wait);
        assert_eq!(
            host.fail_opens(),
            vec![(kvroute_filter::metrics::Metric::from(reason).name(), 1)],
            "{what}"
        );
        assert_eq!(stream.fail_open_reason(), Some(reason), "{what}");
        assert_eq!(host.count("kvroute.routed"), 0, "{what}");
        stream.on_stream_end(&mut host);
        assert_eq!(
            host.detached_calls().len(),
            usize::from(abandoned),
            "{what}: abandoned only when the indexer may have counted it"
        );
    }
}

#[test]
fn an_unreachable_indexer_cluster_fails_open() {
    let plugin = default_plugin();
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    host.fail_dispatch = Some(HostError::UnknownCluster);
    let mut stream = Stream::new(1, Some(Arc::clone(&plugin)));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Continue);
    assert_eq!(host.fail_open_count(FailOpen::IndexerUnavailable), 1);
    let mut stream2 = Stream::new(2, Some(plugin));
    let mut host2 = FakeHost::post(CHAT, &[], &chat_body("short"));
    host2.fail_dispatch = Some(HostError::Failed("internal".into()));
    assert_eq!(send_request(&mut stream2, &mut host2), Flow::Continue);
    assert_eq!(host2.fail_open_count(FailOpen::HostcallError), 1);
}

#[test]
fn bad_bodies_fail_open_without_a_route_call() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "discover_models": false}));
    let cases: Vec<(&[u8], FailOpen)> = vec![
        (b"{not json", FailOpen::NotJson),
        (b"[1,2]", FailOpen::NotJson),
        (br#"{"messages":[]}"#, FailOpen::NoModel),
        (
            br#"{"model":"other","prompt":"hi"}"#,
            FailOpen::UnknownModel,
        ),
        (
            br#"{"model":"qwen3","messages":"not a list"}"#,
            FailOpen::TokenizeError,
        ),
    ];
    for (body, reason) in cases {
        let mut host = FakeHost::post(CHAT, &[], body);
        let mut stream = Stream::new(1, Some(Arc::clone(&plugin)));
        assert_eq!(send_request(&mut stream, &mut host), Flow::Continue);
        assert_eq!(
            stream.fail_open_reason(),
            Some(reason),
            "{}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(host.fail_open_count(reason), 1);
        assert!(host.calls.is_empty(), "no route call");
        assert_eq!(host.request_header(DST_HEADER), None);
    }
}

#[test]
fn a_model_the_indexer_does_not_know_fails_open_and_is_remembered() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}}));
    let body = br#"{"model":"mystery","prompt":"hi"}"#;
    let mut host = FakeHost::post("/v1/completions", &[], body);
    let mut stream = Stream::new(1, Some(Arc::clone(&plugin)));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Continue);
    assert_eq!(
        stream.fail_open_reason(),
        Some(FailOpen::TokenizerNotReady),
        "first sight: asked about"
    );
    let mut root = FakeHost::new();
    plugin.on_tick(&mut root);
    let fetch = root.last_call().clone();
    assert_eq!(
        fetch.header(":path"),
        Some("/v1/models/mystery/tokenizer?form=compact")
    );
    assert!(plugin.on_call_reply(
        &mut root,
        fetch.id,
        &CallReply {
            status: Some(404),
            ..CallReply::default()
        }
    ));
    let mut host = FakeHost::post("/v1/completions", &[], body);
    let mut stream = Stream::new(2, Some(Arc::clone(&plugin)));
    stream.on_request_headers(&mut host, false);
    stream.on_request_body(&mut host, body.len(), true);
    assert_eq!(stream.fail_open_reason(), Some(FailOpen::UnknownModel));
    root.calls.clear();
    plugin.on_tick(&mut root);
    assert!(
        root.calls.is_empty(),
        "a negative answer is not asked again at once"
    );
}

#[test]
fn oversized_bodies_fail_open_or_are_refused() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "max_body_bytes": 1024,
                                         "upstream_max_body_bytes": 4096}));
    let big = chat_body(&"x".repeat(2000));
    // Declared over max_body_bytes: forwarded unrouted at once.
    let mut host = FakeHost::post(CHAT, &[], &big);
    let mut stream = Stream::new(1, Some(Arc::clone(&plugin)));
    assert_eq!(stream.on_request_headers(&mut host, false), Flow::Continue);
    assert_eq!(host.fail_open_count(FailOpen::TooLarge), 1);
    // Undeclared (chunked): held until its end, then forwarded unrouted.
    let mut host = FakeHost::post(CHAT, &[], &big);
    host.request_headers.retain(|(k, _)| k != "content-length");
    let mut stream = Stream::new(2, Some(Arc::clone(&plugin)));
    assert_eq!(stream.on_request_headers(&mut host, false), Flow::Pause);
    assert_eq!(stream.on_request_body(&mut host, 2000, false), Flow::Pause);
    assert_eq!(
        stream.on_request_body(&mut host, big.len(), true),
        Flow::Continue
    );
    assert_eq!(host.fail_open_count(FailOpen::TooLarge), 1);
    assert!(host.calls.is_empty());
    // Over the engines' limit: 413, whatever oversized_body says.
    let huge = chat_body(&"x".repeat(5000));
    let mut host = FakeHost::post(CHAT, &[], &huge);
    let mut stream = Stream::new(3, Some(Arc::clone(&plugin)));
    assert_eq!(stream.on_request_headers(&mut host, false), Flow::Pause);
    assert_eq!(
        stream.on_request_body(&mut host, huge.len(), true),
        Flow::Pause
    );
    assert_eq!(host.local_reply.as_ref().map(|r| r.status), Some(413));
    assert_eq!(host.count("kvroute.rejected_too_large"), 1);
    // oversized_body: reject.
    let strict = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "max_body_bytes": 1024,
                                         "oversized_body": "reject"}));
    let mut host = FakeHost::post(CHAT, &[], &big);
    let mut stream = Stream::new(4, Some(strict));
    assert_eq!(stream.on_request_headers(&mut host, false), Flow::Pause);
    assert_eq!(host.local_reply.as_ref().map(|r| r.status), Some(413));
}

#[test]
fn the_body_is_rewritten_for_kv_cache_reports() {
    let plugin =
        plugin_with_qwen3(json!({"models": {"qwen3": {}}, "inject_kv_cache_report_mode": true}));
    let body = chat_body("short");
    let mut host = FakeHost::post(CHAT, &[], &body);
    let mut stream = Stream::new(1, Some(plugin));
    send_request(&mut stream, &mut host);
    assert_eq!(host.request_body, body, "not before the route answer");
    let id = host.last_call().id;
    stream.on_call_reply(&mut host, id, &route_answer("10.0.0.1:8000"));
    let sent: Value = serde_json::from_slice(&host.request_body).expect("JSON");
    assert_eq!(sent["vllm_xargs"], json!({"kv_cache_report_mode": "full"}));
    assert_eq!(sent["model"], "qwen3");
    assert_eq!(
        host.request_header("content-length"),
        Some(host.request_body.len().to_string().as_str())
    );
    assert_eq!(host.count("kvroute.body_rewritten"), 1);
}

#[test]
fn siblings_of_a_burst_each_ask_with_the_same_keys_and_their_own_call_id() {
    let plugin = default_plugin();
    let body = chat_body(&long_system());
    let mut routes = Vec::new();
    for i in 0..3 {
        let mut host = FakeHost::post(CHAT, &[], &body);
        let mut stream = Stream::new(i, Some(Arc::clone(&plugin)));
        assert_eq!(send_request(&mut stream, &mut host), Flow::Pause);
        routes.push(host.last_call().json());
    }
    assert!(routes
        .iter()
        .all(|r| r["router_keys"] == routes[0]["router_keys"]));
    let mut ids: Vec<&str> = routes
        .iter()
        .map(|r| r["callout_id"].as_str().expect("callout_id"))
        .collect();
    ids.dedup();
    assert_eq!(
        ids.len(),
        3,
        "each sibling's call can be abandoned on its own"
    );
}

#[test]
fn tokenizer_fetches_retry_and_refuse_another_contract() {
    let mut host = FakeHost::new();
    let plugin = Plugin::configure(&host, br#"{"models":{"qwen3":{}}}"#, b"").expect("configure");
    plugin.on_tick(&mut host);
    let first = host.last_call().clone();
    assert!(plugin.on_call_reply(
        &mut host,
        first.id,
        &CallReply {
            status: Some(200),
            contract: Some("999".into()),
            body: qwen3_bundle_json()
        }
    ));
    assert_eq!(host.count("kvroute.tokenizer_load_failed"), 1);
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(_, m)| m.contains("contract")));
    host.calls.clear();
    plugin.on_tick(&mut host);
    assert!(host.calls.is_empty(), "backoff");
    host.advance_ms(600);
    plugin.on_tick(&mut host);
    let retry = host.last_call().clone();
    assert!(plugin.on_call_reply(
        &mut host,
        retry.id,
        &CallReply {
            status: Some(200),
            contract: None,
            body: qwen3_bundle_json()
        }
    ));
    assert_eq!(host.count("kvroute.tokenizer_loaded"), 1);
    assert!(
        !plugin.on_call_reply(&mut host, retry.id, &CallReply::default()),
        "answered once"
    );
    assert!(Plugin::configure(&host, br#"{"no_such_field":1}"#, b"").is_err());
}

/// Routes one chat request with `body` through a new stream; returns the stream.
fn routed(plugin: &Arc<Plugin>, host: &mut FakeHost, id: u64) -> Stream {
    let mut stream = Stream::new(id, Some(Arc::clone(plugin)));
    assert_eq!(send_request(&mut stream, host), Flow::Pause);
    let route = host.last_call().id;
    stream.on_call_reply(host, route, &route_answer("10.0.0.7:8000"));
    assert_eq!(host.request_header(DST_HEADER), Some("10.0.0.7:8000"));
    stream
}

fn agreement_reports(host: &FakeHost) -> Vec<Value> {
    host.detached_calls()
        .into_iter()
        .filter(|c| c.header(":path") == Some("/v1/models/qwen3/agreement"))
        .map(Call::json)
        .collect()
}

#[test]
fn the_online_check_asks_for_token_ids_strips_them_and_reports_a_mismatch() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "complete_hold_ms": 0,
        "token_check": {"sample_one_in": 1000, "first_requests": 2}}));
    let body = chat_body("short");
    let parsed = RequestBody::parse(&body, Endpoint::ChatCompletions).expect("json");
    let own = match plugin.lookup("qwen3", 0) {
        Lookup::Ready(m) => m
            .prepare(Endpoint::ChatCompletions, &parsed)
            .expect("prepared")
            .tokens
            .expect("one prompt"),
        other => panic!("qwen3 not ready: {other:?}"),
    };

    // 1. A streamed response carrying the engine's ids (the same as the filter's): they are
    // taken out of every chunk and the agreement reported.
    let mut host = FakeHost::post(CHAT, &[], &body);
    let mut stream = routed(&plugin, &mut host, 1);
    let sent: Value = serde_json::from_slice(&host.request_body).expect("rewritten body is JSON");
    assert_eq!(
        sent["return_token_ids"], true,
        "the engine is asked for the ids"
    );
    assert_eq!(
        host.request_header("content-length"),
        Some(host.request_body.len().to_string().as_str())
    );
    let first = json!({"choices": [{"index": 0, "delta": {"content": "KV"}, "token_ids": [42]}],
        "prompt_token_ids": own});
    let second = json!({"choices": [{"index": 0, "delta": {"content": "!"}, "token_ids": [43]}]});
    let sse = format!("data: {first}\n\ndata: {second}\n\ndata: [DONE]\n\n");
    let (a, b) = sse.as_bytes().split_at(25);
    let out = respond(&mut stream, &mut host, "text/event-stream", &[a, b]);
    let out = String::from_utf8(out).expect("utf8");
    assert!(!out.contains("token_ids"), "ids taken out: {out}");
    assert!(
        out.contains("\"KV\"") && out.ends_with("data: [DONE]\n\n"),
        "{out}"
    );
    assert_eq!(host.count("kvroute.token_check.agreed"), 1);
    let reports = agreement_reports(&host);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0]["check"]["own_tokens"], own.len());
    assert_eq!(reports[0]["check"]["first_difference"], Value::Null);

    // 2. A whole JSON body whose ids differ: held to its end, restored (the added fields null, as
    // vLLM writes them when not asked), the mismatch counted and reported.
    let mut host = FakeHost::post(CHAT, &[], &body);
    let mut stream = routed(&plugin, &mut host, 2);
    let mut wrong = own.clone();
    wrong[1] += 1;
    let answer = json!({"id": "c", "choices": [{"index": 0, "message": {"content": "hi"},
        "token_ids": [7, 8]}], "prompt_token_ids": wrong,
        "usage": {"prompt_tokens": own.len(), "prompt_tokens_details": {"cached_tokens": 16}}})
    .to_string();
    host.response_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "application/json".into()),
        ("content-length".into(), answer.len().to_string()),
    ];
    stream.on_response_headers(&mut host, false);
    assert_eq!(
        host.response_header("content-length"),
        None,
        "the body will change"
    );
    let (a, b) = answer.as_bytes().split_at(30);
    host.response_chunk = a.to_vec();
    assert_eq!(
        stream.on_response_body(&mut host, a.len(), false),
        Flow::Pause
    );
    host.response_chunk = answer.as_bytes().to_vec();
    assert_eq!(
        stream.on_response_body(&mut host, a.len() + b.len(), true),
        Flow::Continue
    );
    let out: Value = serde_json::from_slice(&host.response_chunk).expect("restored body");
    assert_eq!(out["prompt_token_ids"], Value::Null);
    assert_eq!(out["choices"][0]["token_ids"], Value::Null);
    assert_eq!(out["choices"][0]["message"]["content"], "hi");
    assert_eq!(host.count("kvroute.token_check.disagreed"), 1);
    let reports = agreement_reports(&host);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0]["check"]["first_difference"], 1);
    assert_eq!(reports[0]["check"]["endpoint"], "chat");
    stream.on_stream_end(&mut host);
    let complete = host
        .detached_calls()
        .into_iter()
        .find(|c| c.header(":path") == Some("/v1/complete"))
        .expect("completion reported")
        .json();
    assert_eq!(
        complete["cached_tokens"], 16,
        "usage read from the restored body"
    );

    // 3. The model now fails open until its tokenizer is reloaded.
    let mut host = FakeHost::post(CHAT, &[], &body);
    let mut stream = Stream::new(3, Some(Arc::clone(&plugin)));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Continue);
    assert_eq!(stream.fail_open_reason(), Some(FailOpen::TokenMismatch));
    assert_eq!(host.fail_open_count(FailOpen::TokenMismatch), 1);
    assert_eq!(host.request_body, body, "not rewritten");
}

/// A route answer with its own `decision_id`.
fn route_answer_for(decision_id: &str) -> CallReply {
    let mut answer = route_answer("10.0.0.7:8000");
    let mut body: Value = serde_json::from_slice(&answer.body).expect("json");
    body["decision_id"] = json!(decision_id);
    answer.body = body.to_string().into_bytes();
    answer
}

/// A route answer with its own `decision_id` allowing reports to be held `hold_ms`.
fn route_answer_holding(decision_id: &str, hold_ms: u64) -> CallReply {
    let mut answer = route_answer_for(decision_id);
    let mut body: Value = serde_json::from_slice(&answer.body).expect("json");
    body["report_hold_ms"] = json!(hold_ms);
    answer.body = body.to_string().into_bytes();
    answer
}

/// One request routed by `plugin` to a decision `decision_id`, answered and ended.
fn run_routed(plugin: &Arc<Plugin>, decision_id: &str) -> FakeHost {
    run_answered(plugin, &route_answer_for(decision_id))
}

/// One request routed by `plugin`, answered with `answer` and ended.
fn run_answered(plugin: &Arc<Plugin>, answer: &CallReply) -> FakeHost {
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(1, Some(Arc::clone(plugin)));
    assert_eq!(send_request(&mut stream, &mut host), Flow::Pause);
    let id = host.last_call().id;
    stream.on_call_reply(&mut host, id, answer);
    respond(&mut stream, &mut host, "text/event-stream", &[SSE_USAGE]);
    stream.on_stream_end(&mut host);
    host
}

/// The decision ids a route call carried.
fn carried_ids(route: &Value) -> Vec<String> {
    route["completed"]
        .as_array()
        .map(|reports| {
            reports
                .iter()
                .map(|r| r["decision_id"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn holding_plugin(extra: Value) -> Arc<Plugin> {
    let mut config = json!({"models": {"qwen3": {}}, "complete_hold_ms": 250});
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    plugin_with_qwen3(config)
}

#[test]
fn a_completion_report_rides_on_the_next_route_call() {
    let plugin = holding_plugin(json!({}));
    let first = run_routed(&plugin, "d-first");
    assert!(first.detached_calls().is_empty(), "held, not sent alone");
    assert_eq!(first.count("kvroute.complete_sent"), 0);

    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(2, Some(Arc::clone(&plugin)));
    send_request(&mut stream, &mut host);
    let route = host.last_call().clone();
    let r = route.json();
    assert_eq!(carried_ids(&r), ["d-first"]);
    assert_eq!(r["completed"][0]["cached_tokens"], 288, "the whole report");
    stream.on_call_reply(&mut host, route.id, &route_answer_for("d-second"));
    assert_eq!(host.count("kvroute.complete_sent"), 1, "delivered");
    assert_eq!(host.count("kvroute.complete_carried"), 1);
    // Carried once: the next call carries only what ended since.
    let third = run_routed(&plugin, "d-third");
    assert_eq!(carried_ids(&third.calls[0].json()), Vec::<String>::new());
}

#[test]
fn unless_configured_reports_are_held_as_long_as_the_indexer_allows() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}}));
    assert_eq!(
        plugin.report_hold_ms(),
        0,
        "nothing held before an answer says"
    );
    // An indexer alone (no other gateways to keep informed) allows 250 ms.
    let first = run_answered(&plugin, &route_answer_holding("d-1", 250));
    assert_eq!(plugin.report_hold_ms(), 250);
    assert!(first.detached_calls().is_empty(), "held, not sent alone");

    // The next route call carries it; its answer says nothing of holding (an indexer of a
    // fleet, or an older one): from then on each report goes at once.
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(2, Some(Arc::clone(&plugin)));
    send_request(&mut stream, &mut host);
    let route = host.last_call().clone();
    assert_eq!(carried_ids(&route.json()), ["d-1"]);
    stream.on_call_reply(&mut host, route.id, &route_answer_for("d-2"));
    assert_eq!(plugin.report_hold_ms(), 0);
    respond(&mut stream, &mut host, "text/event-stream", &[SSE_USAGE]);
    stream.on_stream_end(&mut host);
    let sent = host.detached_calls();
    assert_eq!(sent.len(), 1, "sent at once");
    assert_eq!(sent[0].json()["decision_id"], "d-2");

    // An answer cannot hold reports for longer than the indexer's own bound.
    run_answered(&plugin, &route_answer_holding("d-3", u64::MAX));
    assert_eq!(plugin.report_hold_ms(), 10_000);
}

#[test]
fn a_configured_hold_overrides_the_indexers() {
    let plugin = plugin_with_qwen3(json!({"models": {"qwen3": {}}, "complete_hold_ms": 0}));
    let host = run_answered(&plugin, &route_answer_holding("d-1", 250));
    assert_eq!(plugin.report_hold_ms(), 0);
    assert_eq!(
        host.detached_calls().len(),
        1,
        "sent at once, as configured"
    );
}

#[test]
fn a_report_no_route_call_took_goes_by_itself_after_the_hold_time() {
    let plugin = holding_plugin(json!({}));
    let mut host = run_routed(&plugin, "d-1");
    let before = host.calls.len();
    host.advance_ms(240);
    plugin.on_tick(&mut host);
    assert_eq!(host.calls.len(), before, "still held at 240 ms");
    host.advance_ms(10);
    plugin.on_tick(&mut host);
    let sent = host.last_call().clone();
    assert_eq!(sent.header(":path"), Some("/v1/complete"));
    assert_eq!(
        sent.json()["decision_id"],
        "d-1",
        "one report, as an object"
    );
    assert_eq!(host.count("kvroute.complete_sent"), 1);
    plugin.on_tick(&mut host);
    assert_eq!(host.calls.len(), before + 1, "sent once");
}

/// A waker that records every due time it is told.
fn recording_waker(plugin: &Plugin) -> Arc<Mutex<Vec<u64>>> {
    let told = Arc::new(Mutex::new(Vec::new()));
    let heard = Arc::clone(&told);
    assert!(plugin.set_tick_waker(Box::new(move |due| {
        heard.lock().expect("waker log").push(due);
    })));
    assert!(
        !plugin.set_tick_waker(Box::new(|_| {})),
        "set once, like the host's ticker"
    );
    told
}

#[test]
fn a_ticking_host_hears_when_a_held_report_falls_due() {
    let plugin = holding_plugin(json!({}));
    assert_eq!(
        plugin.next_tick_ms(),
        None,
        "nothing held and the tokenizer loaded: no tick is needed"
    );
    let told = recording_waker(&plugin);
    let first = run_routed(&plugin, "d-1");
    let due = first.now_millis() + 250;
    assert_eq!(
        plugin.next_tick_ms(),
        Some(due),
        "the held report's end of hold"
    );
    assert_eq!(told.lock().expect("log").last(), Some(&due), "told at once");

    // The next route call carries it; then only that request's own report is pending.
    let second = run_routed(&plugin, "d-2");
    assert_eq!(carried_ids(&second.calls[0].json()), ["d-1"]);
    let due = second.now_millis() + 250;
    assert_eq!(plugin.next_tick_ms(), Some(due));

    // Due: the tick sends it and nothing is pending any more.
    let mut host = FakeHost::new();
    host.now_ns.set(due * 1_000_000);
    plugin.on_tick(&mut host);
    assert_eq!(host.last_call().header(":path"), Some("/v1/complete"));
    assert_eq!(plugin.next_tick_ms(), None);
}

#[test]
fn a_ticking_host_hears_of_tokenizer_fetches_and_their_retries() {
    let mut host = FakeHost::new();
    let config = json!({"models": {"qwen3": {}}});
    let plugin = Plugin::configure(&host, config.to_string().as_bytes(), b"").expect("configure");
    assert_eq!(
        plugin.next_tick_ms(),
        Some(0),
        "the first fetch is due at once"
    );
    let told = recording_waker(&plugin);

    plugin.on_tick(&mut host);
    let fetch = host.last_call().clone();
    let lost_at = plugin.next_tick_ms().expect("a fetch in flight is watched");
    assert!(
        lost_at > host.now_millis() + plugin.cfg.tokenizer_timeout_ms,
        "a fetch in flight is due again only once it is lost"
    );

    let failed = CallReply {
        status: Some(500),
        contract: None,
        body: Vec::new(),
    };
    assert!(plugin.on_call_reply(&mut host, fetch.id, &failed));
    let retry = host.now_millis() + plugin.cfg.tokenizer_retry.initial_ms;
    assert_eq!(plugin.next_tick_ms(), Some(retry), "due again at its retry");
    assert_eq!(
        told.lock().expect("log").last(),
        Some(&retry),
        "and told so"
    );
}

#[test]
fn reports_a_failed_route_call_carried_are_held_again() {
    let plugin = holding_plugin(json!({}));
    run_routed(&plugin, "d-1");
    // The next route call carries d-1 and gets no answer from the indexer (a reset).
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(2, Some(Arc::clone(&plugin)));
    send_request(&mut stream, &mut host);
    let route = host.last_call().clone();
    assert_eq!(carried_ids(&route.json()), ["d-1"]);
    stream.on_call_reply(&mut host, route.id, &CallReply::default());
    assert_eq!(host.count("kvroute.complete_sent"), 0);
    stream.on_stream_end(&mut host);
    assert!(
        host.detached_calls().is_empty(),
        "its abandonment is held too"
    );
    // A client that leaves while its route call is pending gives back what the call carried.
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut leaving = Stream::new(3, Some(Arc::clone(&plugin)));
    send_request(&mut leaving, &mut host);
    assert_eq!(carried_ids(&host.last_call().json()), ["d-1", "?"]);
    leaving.on_stream_end(&mut host);
    // Both abandonments (the reset call's, the leaving client's) are held, behind d-1.
    let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
    let mut stream = Stream::new(4, Some(Arc::clone(&plugin)));
    send_request(&mut stream, &mut host);
    let r = host.last_call().json();
    let carried = r["completed"].as_array().expect("carried").clone();
    assert_eq!(carried.len(), 3, "{carried:?}");
    assert_eq!(carried[0]["decision_id"], "d-1", "the oldest first");
    assert!(carried[1..]
        .iter()
        .all(|c| c["abandoned"] == true && c["callout_id"].is_string()));
}

#[test]
fn a_full_queue_of_reports_is_sent_at_once_in_one_batch() {
    let plugin = holding_plugin(json!({"max_held_completions": 2}));
    // Two requests routed, then both end: nothing routed in between to carry the first.
    let mut running: Vec<(FakeHost, Stream)> = ["d-1", "d-2"]
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let mut host = FakeHost::post(CHAT, &[], &chat_body("short"));
            let mut stream = Stream::new(i as u64, Some(Arc::clone(&plugin)));
            send_request(&mut stream, &mut host);
            let call = host.last_call().id;
            stream.on_call_reply(&mut host, call, &route_answer_for(id));
            respond(&mut stream, &mut host, "text/event-stream", &[SSE_USAGE]);
            (host, stream)
        })
        .collect();
    let (host, stream) = &mut running[0];
    stream.on_stream_end(host);
    assert!(host.detached_calls().is_empty(), "one held");
    let (host, stream) = &mut running[1];
    stream.on_stream_end(host);
    let batch = host.detached_calls();
    assert_eq!(batch.len(), 1, "the second fills the queue");
    assert_eq!(batch[0].header(":path"), Some("/v1/complete"));
    let ids: Vec<Value> = batch[0]
        .json()
        .as_array()
        .expect("an array")
        .iter()
        .map(|r| r["decision_id"].clone())
        .collect();
    assert_eq!(ids, [json!("d-1"), json!("d-2")]);
    assert_eq!(host.count("kvroute.complete_sent"), 2);
}
