//! Pure wire logic: the indexer's JSON API and the request body rewrite. No host calls here, so
//! all of it is unit-tested natively (the response `usage` scan is [`crate::usage`]).

use std::net::SocketAddr;

use kvroute_core::api::{
    check_contract, CompleteReport, ContractCheck, RouteAnswer as WireAnswer, CONTRACT_HEADER,
    CONTRACT_VERSION_STR,
};
use kvroute_core::request::RequestBody;
use serde_json::Value;

use crate::config::FilterConfig;

/// Why a request was not routed (each is one `fail_open.<reason>` counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailOpen {
    /// The indexer could not be reached (connection refused, reset, cluster missing, 502/503).
    IndexerUnavailable,
    /// The indexer did not answer within `route_timeout_ms`.
    IndexerTimeout,
    /// The indexer answered with another error status.
    IndexerError,
    /// The indexer answered 200 with something that is not a usable route.
    BadAnswer,
    /// The indexer (or the configuration) does not know the model.
    UnknownModel,
    /// The body is not a JSON object.
    NotJson,
    /// The body has no string `model`.
    NoModel,
    /// The body is larger than `max_body_bytes`.
    TooLarge,
    /// The model's tokenizer is still loading (or failed to load).
    TokenizerNotReady,
    /// The prompt could not be rendered or tokenised.
    TokenizeError,
    /// The prompt is longer than the model's `max_prompt_tokens` (the engine refuses it too).
    PromptTooLong,
    /// The indexer speaks another version of the filter-indexer contract.
    ContractMismatch,
    /// A host call failed.
    HostcallError,
    /// An online check found that the engine tokenises this model's prompts otherwise (the model
    /// is not routed by prefix until its tokenizer is fixed and reloaded).
    TokenMismatch,
}

impl FailOpen {
    /// Every reason, for metric definition.
    pub const ALL: [FailOpen; 14] = [
        FailOpen::IndexerUnavailable,
        FailOpen::IndexerTimeout,
        FailOpen::IndexerError,
        FailOpen::BadAnswer,
        FailOpen::UnknownModel,
        FailOpen::NotJson,
        FailOpen::NoModel,
        FailOpen::TooLarge,
        FailOpen::TokenizerNotReady,
        FailOpen::TokenizeError,
        FailOpen::PromptTooLong,
        FailOpen::ContractMismatch,
        FailOpen::HostcallError,
        FailOpen::TokenMismatch,
    ];

    /// Metric suffix and debug-header value.
    pub fn as_str(self) -> &'static str {
        match self {
            FailOpen::IndexerUnavailable => "indexer_unavailable",
            FailOpen::IndexerTimeout => "indexer_timeout",
            FailOpen::IndexerError => "indexer_error",
            FailOpen::BadAnswer => "bad_answer",
            FailOpen::UnknownModel => "unknown_model",
            FailOpen::NotJson => "not_json",
            FailOpen::NoModel => "no_model",
            FailOpen::TooLarge => "too_large",
            FailOpen::TokenizerNotReady => "tokenizer_not_ready",
            FailOpen::TokenizeError => "tokenize_error",
            FailOpen::PromptTooLong => "prompt_too_long",
            FailOpen::ContractMismatch => "contract_mismatch",
            FailOpen::HostcallError => "hostcall_error",
            FailOpen::TokenMismatch => "token_mismatch",
        }
    }
}

pub use kvroute_core::api::RouteRequest;

/// The parts of a `/v1/route` answer the filter uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteAnswer {
    /// `IP:port` of the chosen replica (validated).
    pub endpoint: String,
    /// Where the request may go if `endpoint` cannot take it, best first (validated `IP:port`s
    /// other than `endpoint`, at most [`MAX_ALTERNATES`]).
    pub alternates: Vec<String>,
    /// Replica name, for debug headers.
    pub replica: Option<String>,
    /// Decision reason, for debug headers.
    pub reason: Option<String>,
    /// Matched GPU tokens, for debug headers.
    pub matched_gpu_tokens: Option<u64>,
    /// The indexer's key for this decision, echoed in `/v1/complete` (`None` from an indexer that
    /// predates it, or when longer than [`MAX_DECISION_ID_BYTES`]).
    pub decision_id: Option<String>,
    /// How long completion reports may be held for a later route call to carry (ms; `None`
    /// from an indexer that does not say: send each at once).
    pub report_hold_ms: Option<u64>,
}

/// Most alternates kept from a route answer.
pub const MAX_ALTERNATES: usize = 3;

/// Longest `decision_id` kept from a route answer.
pub const MAX_DECISION_ID_BYTES: usize = kvroute_core::api::MAX_ID_BYTES;

/// Classifies a `/v1/route` callout outcome. `status` is the `:status` of the answer (`None` when
/// Envoy delivered no headers, i.e. a reset or overflow), `contract` its
/// [`kvroute_core::api::CONTRACT_HEADER`], `elapsed_ms`/`timeout_ms` tell a timeout from another
/// failure.
pub fn parse_route_answer(
    status: Option<u16>,
    contract: Option<&str>,
    body: &[u8],
    elapsed_ms: u64,
    timeout_ms: u64,
) -> Result<RouteAnswer, FailOpen> {
    let status = match status {
        None if elapsed_ms >= timeout_ms => return Err(FailOpen::IndexerTimeout),
        None => return Err(FailOpen::IndexerUnavailable),
        Some(s) => s,
    };
    if matches!(check_contract(contract), ContractCheck::Other(_)) {
        return Err(FailOpen::ContractMismatch);
    }
    match status {
        200 => {}
        404 => return Err(FailOpen::UnknownModel),
        // The indexer refuses another contract version before routing.
        409 => return Err(FailOpen::ContractMismatch),
        // Envoy's own reply when the callout's deadline passed.
        504 => return Err(FailOpen::IndexerTimeout),
        502 | 503 => return Err(FailOpen::IndexerUnavailable),
        _ => return Err(FailOpen::IndexerError),
    }
    let raw: WireAnswer = serde_json::from_slice(body).map_err(|_| FailOpen::BadAnswer)?;
    let endpoint = raw.endpoint.trim();
    // ORIGINAL_DST needs a literal IP:port; anything else would make Envoy answer 503.
    if endpoint.parse::<SocketAddr>().is_err() {
        return Err(FailOpen::BadAnswer);
    }
    let some = |s: String| Some(s).filter(|s| !s.is_empty());
    // An alternate that is not a literal IP:port is dropped, not fatal: the choice still stands.
    let mut alternates: Vec<String> = Vec::new();
    for alt in raw.alternates.iter().map(|a| a.trim()) {
        let usable = alt.parse::<SocketAddr>().is_ok()
            && alt != endpoint
            && !alternates.iter().any(|a| a == alt);
        if usable && alternates.len() < MAX_ALTERNATES {
            alternates.push(alt.to_string());
        }
    }
    Ok(RouteAnswer {
        endpoint: endpoint.to_string(),
        alternates,
        replica: some(raw.replica),
        reason: some(raw.reason),
        matched_gpu_tokens: Some(raw.matched_tokens.gpu),
        decision_id: some(raw.decision_id).filter(|d| d.len() <= MAX_DECISION_ID_BYTES),
        report_hold_ms: raw.report_hold_ms,
    })
}

/// Minimal percent-encoding for a model name in a URL path segment.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Headers of a JSON `POST` to the indexer at `path`, announcing this contract.
pub fn indexer_post_headers<'a>(cfg: &'a FilterConfig, path: &'a str) -> [(&'a str, &'a str); 5] {
    [
        (":method", "POST"),
        (":path", path),
        (":authority", cfg.indexer_authority.as_str()),
        ("content-type", "application/json"),
        (CONTRACT_HEADER, CONTRACT_VERSION_STR),
    ]
}

/// Parses a status header value.
pub fn parse_status(value: Option<&str>) -> Option<u16> {
    value.and_then(|v| v.trim().parse().ok())
}

/// How a routed request ended, for `POST /v1/complete`.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The route answer's `decision_id` (`None`: an older indexer, keyed by `request_id`).
    pub decision_id: Option<&'a str>,
    /// The request id sent with the route call.
    pub request_id: &'a str,
    /// The replica it was sent to.
    pub endpoint: &'a str,
    /// The engine's `cached_tokens`, if the response carried it.
    pub cached_tokens: Option<u64>,
    /// Time to first token of a streamed response, microseconds.
    pub ttft_us: Option<u64>,
    /// The stream ended before its response did (client left, reset).
    pub abandoned: bool,
    /// Where the proxy really sent it (`upstream.address`), when known.
    pub upstream: Option<&'a str>,
}

/// The completion report of a routed request. Without a `decision_id` it carries only
/// `request_id`, `endpoint` and `cached_tokens`, which indexers from before decision ids accept.
pub fn complete_report(c: &Completion<'_>) -> CompleteReport {
    let keyed = c.decision_id.is_some();
    CompleteReport {
        decision_id: c.decision_id.map(str::to_string),
        callout_id: None,
        ttft_us: c.ttft_us.filter(|_| keyed),
        abandoned: c.abandoned && keyed,
        request_id: Some(c.request_id.to_string()),
        endpoint: Some(c.endpoint.to_string()),
        cached_tokens: c.cached_tokens,
        upstream: c.upstream.filter(|_| keyed).map(str::to_string),
    }
}

/// The report abandoning a route call whose answer never reached the request (the client left
/// while it was pending, or the call failed after the indexer may have counted it): the indexer
/// releases that decision, or does not count it when it arrives later.
pub fn abandon_report(callout_id: &str, request_id: &str) -> CompleteReport {
    CompleteReport {
        callout_id: Some(callout_id.to_string()),
        request_id: Some(request_id.to_string()),
        abandoned: true,
        ..CompleteReport::default()
    }
}

/// A route call id unique per VM: the VM's start time (ns) and a sequence number.
pub fn callout_id(vm_seed: u64, seq: u64) -> String {
    format!("c{vm_seed:x}-{seq:x}")
}

/// The request's output budget: `max_completion_tokens`, else `max_tokens`, when a number.
pub fn max_tokens_of(body: &Value) -> Option<u64> {
    body.get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64))
}

/// True when a route call that produced no usable answer may still have been counted by the
/// indexer (no answer at all, Envoy's timeout, or a 200 the filter could not use): such a call is
/// abandoned. An error status from the indexer (4xx, 500-503) counted nothing.
pub fn route_may_be_counted(status: Option<u16>) -> bool {
    !matches!(status, Some(400..=503))
}

/// Adds `"vllm_xargs": {"kv_cache_report_mode": "full"}` to a JSON object body, keeping any other
/// `vllm_xargs`. Returns `None` when the body is left as is (not an object, or `vllm_xargs` is
/// present but not an object, or the mode is already set).
pub fn inject_kv_cache_report_mode(raw: &[u8], parsed: &RequestBody) -> Option<Vec<u8>> {
    let obj = parsed.fields().as_object()?;
    match obj.get("vllm_xargs") {
        None => {
            // Fast path: splice before the closing brace, keeping the client's bytes.
            let end = raw.iter().rposition(|b| !b.is_ascii_whitespace())?;
            if raw[end] != b'}' {
                return None;
            }
            let mut out = Vec::with_capacity(raw.len() + 48);
            out.extend_from_slice(&raw[..end]);
            if !obj.is_empty() || parsed.prompt_ids().is_some() {
                out.push(b',');
            }
            out.extend_from_slice(br#""vllm_xargs":{"kv_cache_report_mode":"full"}}"#);
            Some(out)
        }
        Some(Value::Object(x)) => {
            if x.get("kv_cache_report_mode").and_then(Value::as_str) == Some("full") {
                return None;
            }
            let mut copy = parsed.to_value();
            let xargs = copy.get_mut("vllm_xargs")?.as_object_mut()?;
            xargs.insert("kv_cache_report_mode".into(), Value::from("full"));
            serde_json::to_vec(&copy).ok()
        }
        Some(_) => None,
    }
}

/// A request id for correlation: the client's/Envoy's `x-request-id` when sane, else generated.
pub fn request_id(header: Option<&str>, context_id: u64, now_nanos: u64) -> String {
    match header {
        Some(h)
            if !h.is_empty()
                && h.len() <= 128
                && h.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\') =>
        {
            h.to_string()
        }
        _ => format!("kvr-{now_nanos:x}-{context_id:x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_path_safe() {
        assert_eq!(percent_encode("Qwen/Qwen3-0.6B"), "Qwen%2FQwen3-0.6B");
        assert_eq!(percent_encode("a b?"), "a%20b%3F");
    }
    use serde_json::json;

    #[test]
    fn route_answers_are_classified() {
        let ok = br#"{"endpoint":"127.0.0.1:8001","replica":"r0","matched_tokens":{"gpu":48,"cpu":0,"storage":0},"reason":"prefix_hit"}"#;
        let a = parse_route_answer(Some(200), None, ok, 3, 100).unwrap();
        assert_eq!(a.endpoint, "127.0.0.1:8001");
        assert_eq!(a.decision_id, None, "an indexer without decision ids");
        let with_id = br#"{"endpoint":"127.0.0.1:8001","decision_id":"1a2b-7"}"#;
        let a2 = parse_route_answer(Some(200), None, with_id, 3, 100).unwrap();
        assert_eq!(a2.decision_id.as_deref(), Some("1a2b-7"));
        let long = format!(
            r#"{{"endpoint":"127.0.0.1:8001","decision_id":"{}"}}"#,
            "x".repeat(129)
        );
        let a3 = parse_route_answer(Some(200), None, long.as_bytes(), 3, 100).unwrap();
        assert_eq!(a3.decision_id, None, "an absurd id is not echoed");
        assert!(a.alternates.is_empty(), "an indexer without alternates");
        let many = br#"{"endpoint":"127.0.0.1:8001","alternates":["127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004","127.0.0.1:8005"]}"#;
        let a4 = parse_route_answer(Some(200), None, many, 3, 100).unwrap();
        assert_eq!(
            a4.alternates,
            ["127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"],
            "at most MAX_ALTERNATES, in the indexer's order"
        );
        assert_eq!(a.replica.as_deref(), Some("r0"));
        assert_eq!(a.matched_gpu_tokens, Some(48));
        assert_eq!(
            parse_route_answer(Some(404), None, b"", 1, 100),
            Err(FailOpen::UnknownModel)
        );
        assert_eq!(
            parse_route_answer(Some(503), None, b"no healthy upstream", 1, 100),
            Err(FailOpen::IndexerUnavailable)
        );
        assert_eq!(
            parse_route_answer(Some(504), None, b"", 100, 100),
            Err(FailOpen::IndexerTimeout)
        );
        assert_eq!(
            parse_route_answer(None, None, b"", 100, 100),
            Err(FailOpen::IndexerTimeout)
        );
        assert_eq!(
            parse_route_answer(None, None, b"", 2, 100),
            Err(FailOpen::IndexerUnavailable)
        );
        assert_eq!(
            parse_route_answer(Some(500), None, b"", 2, 100),
            Err(FailOpen::IndexerError)
        );
        assert_eq!(
            parse_route_answer(Some(200), None, b"garbage", 2, 100),
            Err(FailOpen::BadAnswer)
        );
        assert_eq!(
            parse_route_answer(Some(200), None, br#"{"endpoint":"replica-0:8001"}"#, 2, 100),
            Err(FailOpen::BadAnswer)
        );
        assert_eq!(
            parse_route_answer(Some(200), None, br#"{"endpoint":42}"#, 2, 100),
            Err(FailOpen::BadAnswer)
        );
        assert!(
            parse_route_answer(Some(200), None, br#"{"endpoint":"[::1]:9000"}"#, 2, 100).is_ok()
        );
    }

    #[test]
    fn another_contract_version_fails_open_loudly() {
        let ok = br#"{"endpoint":"10.0.0.1:8000","decision_id":"d1"}"#;
        assert!(parse_route_answer(
            Some(200),
            Some(kvroute_core::api::CONTRACT_VERSION_STR),
            ok,
            3,
            100
        )
        .is_ok());
        assert!(parse_route_answer(Some(200), None, ok, 3, 100).is_ok());
        assert_eq!(
            parse_route_answer(Some(200), Some("999"), ok, 3, 100),
            Err(FailOpen::ContractMismatch)
        );
        assert_eq!(
            parse_route_answer(Some(409), Some("999"), b"{}", 3, 100),
            Err(FailOpen::ContractMismatch)
        );
        assert_eq!(
            parse_route_answer(Some(409), None, b"{}", 3, 100),
            Err(FailOpen::ContractMismatch)
        );
    }

    #[test]
    fn status_header_parses() {
        assert_eq!(parse_status(Some("200")), Some(200));
        assert_eq!(parse_status(Some("x")), None);
        assert_eq!(parse_status(None), None);
    }

    #[test]
    fn route_request_serialises_u64_keys_exactly_and_packed() {
        let r = RouteRequest {
            model: "m".into(),
            router_keys: Some(vec![u64::MAX, 1]),
            num_tokens: Some(33),
            block_size: Some(16),
            request_id: Some("id".into()),
            callout_id: Some("c1-2".into()),
            ..RouteRequest::default()
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"model":"m","router_keys":"//////////8BAAAAAAAAAA==","num_tokens":33,"block_size":16,"request_id":"id","callout_id":"c1-2"}"#
        );
        let with_session = RouteRequest {
            session: Some("user-42".into()),
            ..r
        };
        let s = serde_json::to_string(&with_session).unwrap();
        assert!(
            s.ends_with(r#""request_id":"id","callout_id":"c1-2","session":"user-42"}"#),
            "{s}"
        );
        let with_max = RouteRequest {
            max_tokens: Some(64),
            ..with_session
        };
        let s = serde_json::to_string(&with_max).unwrap();
        assert!(s.contains(r#""max_tokens":64"#), "{s}");
    }

    #[test]
    fn injection_splices_when_there_are_no_xargs() {
        let raw = br#"{"model":"m","prompt":"hi"}  "#;
        let v = RequestBody::from_value(serde_json::from_slice(raw).unwrap());
        let out = inject_kv_cache_report_mode(raw, &v).unwrap();
        let back: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(back["vllm_xargs"], json!({"kv_cache_report_mode": "full"}));
        assert_eq!(back["prompt"], "hi");
        let raw = b"{}";
        let v = RequestBody::from_value(serde_json::from_slice(raw).unwrap());
        let out = inject_kv_cache_report_mode(raw, &v).unwrap();
        assert_eq!(out, br#"{"vllm_xargs":{"kv_cache_report_mode":"full"}}"#);
    }

    #[test]
    fn injection_keeps_a_prompt_of_token_ids() {
        use kvroute_core::request::Endpoint;
        for raw in [
            &br#"{"prompt":[1,2]}"#[..],
            br#"{"prompt":[1,2],"vllm_xargs":{"a":1}}"#,
        ] {
            let v = RequestBody::parse(raw, Endpoint::Completions).unwrap();
            assert!(v.prompt_ids().is_some());
            let back: Value =
                serde_json::from_slice(&inject_kv_cache_report_mode(raw, &v).unwrap()).unwrap();
            assert_eq!(back["prompt"], json!([1, 2]));
            assert_eq!(back["vllm_xargs"]["kv_cache_report_mode"], "full");
        }
    }

    #[test]
    fn injection_keeps_other_xargs_and_leaves_odd_bodies_alone() {
        let raw = br#"{"model":"m","vllm_xargs":{"a":1}}"#;
        let v = RequestBody::from_value(serde_json::from_slice(raw).unwrap());
        let back: Value =
            serde_json::from_slice(&inject_kv_cache_report_mode(raw, &v).unwrap()).unwrap();
        assert_eq!(
            back["vllm_xargs"],
            json!({"a": 1, "kv_cache_report_mode": "full"})
        );
        let raw = br#"{"vllm_xargs":{"kv_cache_report_mode":"full"}}"#;
        let v = RequestBody::from_value(serde_json::from_slice(raw).unwrap());
        assert!(inject_kv_cache_report_mode(raw, &v).is_none());
        let raw = br#"{"vllm_xargs":"x"}"#;
        let v = RequestBody::from_value(serde_json::from_slice(raw).unwrap());
        assert!(inject_kv_cache_report_mode(raw, &v).is_none());
        let raw = b"[1]";
        let v = RequestBody::from_value(serde_json::from_slice(raw).unwrap());
        assert!(inject_kv_cache_report_mode(raw, &v).is_none());
    }

    #[test]
    fn request_ids_are_sanitised() {
        assert_eq!(request_id(Some("abc-1"), 1, 2), "abc-1");
        assert_eq!(request_id(Some("a\"b"), 1, 255), "kvr-ff-1");
        assert_eq!(request_id(None, 16, 1), "kvr-1-10");
    }

    #[test]
    fn completion_reports_have_the_contract_fields() {
        let legacy = Completion {
            decision_id: None,
            request_id: "r",
            endpoint: "127.0.0.1:1",
            cached_tokens: None,
            ttft_us: None,
            abandoned: true,
            upstream: None,
        };
        let v: Value = serde_json::to_value(complete_report(&legacy)).unwrap();
        assert_eq!(
            v,
            json!({"request_id":"r","endpoint":"127.0.0.1:1"}),
            "an older indexer gets the body it knows"
        );
        let keyed = Completion {
            decision_id: Some("ab-1"),
            cached_tokens: Some(16),
            ttft_us: Some(250_000),
            ..legacy
        };
        let v: Value = serde_json::to_value(complete_report(&keyed)).unwrap();
        assert_eq!(
            v,
            json!({"decision_id":"ab-1","request_id":"r","endpoint":"127.0.0.1:1",
                   "cached_tokens":16,"ttft_us":250000,"abandoned":true})
        );
        let v: Value = serde_json::to_value(abandon_report("c1-2", "r")).unwrap();
        assert_eq!(
            v,
            json!({"callout_id":"c1-2","request_id":"r","abandoned":true})
        );
    }

    #[test]
    fn route_failures_that_may_have_been_counted() {
        assert!(route_may_be_counted(None), "reset or timeout");
        assert!(route_may_be_counted(Some(504)), "Envoy's timeout");
        assert!(route_may_be_counted(Some(200)), "an unusable 200");
        for s in [400, 404, 413, 500, 502, 503] {
            assert!(!route_may_be_counted(Some(s)), "{s}");
        }
        assert_eq!(max_tokens_of(&json!({"max_tokens": 7})), Some(7));
        assert_eq!(
            max_tokens_of(&json!({"max_tokens": 7, "max_completion_tokens": 9})),
            Some(9)
        );
        assert_eq!(max_tokens_of(&json!({"max_tokens": "x"})), None);
        assert_ne!(callout_id(1, 2), callout_id(1, 3));
    }
}
