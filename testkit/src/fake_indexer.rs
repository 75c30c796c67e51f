//! A programmable fake of the indexer's HTTP API (for the filter's fail-open cases) that serves
//! the real tokenizer: each route answer is chosen by the test ([`RouteMode`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_core::api::{RouteAnswer, RouteRequest, CONTRACT_HEADER, CONTRACT_VERSION_STR};
use serde_json::Value;

use crate::fake_server::{Reply, Request, TestServer};
use crate::paths::model_dir;

/// The model's tokenizer files as the indexer serves them (the whole `tokenizer.json`).
pub fn tokenizer_answer(model: &str, block_size: usize) -> Value {
    tokenizer_answer_in_form(model, block_size, false)
}

/// [`tokenizer_answer`], in the compact form when `compact` (the indexer's `?form=compact`).
pub fn tokenizer_answer_in_form(model: &str, block_size: usize, compact: bool) -> Value {
    let files = kvroute_core::request::ModelFiles::from_dir(model_dir()).expect("model files");
    let bundle = kvroute_core::api::TokenizerBundle {
        block_size: u32::try_from(block_size).ok(),
        ..kvroute_core::api::TokenizerBundle::from_files(model, files, compact).expect("bundle")
    };
    serde_json::to_value(bundle).expect("bundle serialises")
}

/// What the fake indexer answers to `POST /v1/route`.
#[derive(Clone, Debug)]
pub enum RouteMode {
    /// `{"endpoint": <addr>}`.
    To(String),
    /// `{"endpoint": <first>, "alternates": [<the rest>]}`.
    Ranked(Vec<String>),
    /// Sleep this long, then route to the address.
    Slow(Duration, String),
    /// This status with a JSON error body.
    Status(u16),
    /// 200 with a non-JSON body.
    Garbage,
    /// 200 with an endpoint that is not IP:port.
    BadEndpoint,
}

/// What the fake indexer answers to `GET /v1/models/{m}/tokenizer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerMode {
    Serve,
    Unavailable,
}

pub struct FakeIndexer {
    pub server: TestServer,
    pub route: Arc<Mutex<RouteMode>>,
    pub tokenizer: Arc<Mutex<TokenizerMode>>,
    /// The `report_hold_ms` of its route answers (`None`, the default: not said, as an indexer
    /// of a fleet or an older one; the real indexer alone says 250).
    pub report_hold_ms: Arc<Mutex<Option<u64>>>,
}

impl FakeIndexer {
    /// Knows only `model`; every other model is 404 on both endpoints.
    pub fn start(model: &'static str, route: RouteMode, tokenizer: TokenizerMode) -> FakeIndexer {
        let whole = Arc::new(tokenizer_answer(model, 16).to_string().into_bytes());
        let compact = Arc::new(
            tokenizer_answer_in_form(model, 16, true)
                .to_string()
                .into_bytes(),
        );
        let route = Arc::new(Mutex::new(route));
        let tokenizer = Arc::new(Mutex::new(tokenizer));
        let report_hold_ms = Arc::new(Mutex::new(None));
        let (r2, t2, h2) = (route.clone(), tokenizer.clone(), report_hold_ms.clone());
        let respond = move |req: &Request| {
            let prefix = "/v1/models/";
            if req.method == "GET" && req.path.starts_with(prefix) {
                let (path, query) = req.path.split_once('?').unwrap_or((&req.path, ""));
                let name = path[prefix.len()..].trim_end_matches("/tokenizer");
                let answer = if query.split('&').any(|p| p == "form=compact") {
                    &compact
                } else {
                    &whole
                };
                if name != model {
                    return Reply::json(404, &serde_json::json!({"error": "unknown model"}));
                }
                return match *t2.lock().expect("lock") {
                    TokenizerMode::Serve => Reply {
                        status: 200,
                        content_type: "application/json",
                        body: answer.as_ref().clone(),
                        delay: Duration::ZERO,
                        headers: Vec::new(),
                    },
                    TokenizerMode::Unavailable => Reply::text(503, "warming up"),
                };
            }
            if req.path == "/v1/complete" {
                return Reply::text(204, "");
            }
            if req.path == "/v1/route" {
                // The real contract types: a body the indexer would refuse is refused here too.
                let body = match serde_json::from_slice::<RouteRequest>(&req.body) {
                    Ok(b) => b,
                    Err(e) => {
                        return Reply::json(400, &serde_json::json!({"error": e.to_string()}))
                    }
                };
                if body.model != model {
                    return Reply::json(404, &serde_json::json!({"error": "unknown model"}));
                }
                let to = |endpoint: &str| RouteAnswer {
                    endpoint: endpoint.to_string(),
                    report_hold_ms: *h2.lock().expect("lock"),
                    ..RouteAnswer::default()
                };
                let mode = r2.lock().expect("lock").clone();
                return match mode {
                    RouteMode::To(ep) => Reply::json(
                        200,
                        &RouteAnswer {
                            replica: "fake".into(),
                            reason: "test".into(),
                            ..to(&ep)
                        },
                    ),
                    RouteMode::Ranked(ranked) => Reply::json(
                        200,
                        &RouteAnswer {
                            alternates: ranked.iter().skip(1).cloned().collect(),
                            ..to(ranked.first().map_or("", String::as_str))
                        },
                    ),
                    RouteMode::Slow(d, ep) => Reply {
                        delay: d,
                        ..Reply::json(200, &to(&ep))
                    },
                    RouteMode::Status(s) => {
                        Reply::json(s, &serde_json::json!({"error": "injected"}))
                    }
                    RouteMode::Garbage => Reply::text(200, "<html>surprise</html>"),
                    RouteMode::BadEndpoint => Reply::json(200, &to("replica-0.svc:8000")),
                };
            }
            Reply::text(404, "no such path")
        };
        // Like the real indexer, every answer names the contract it speaks.
        let server = TestServer::start(move |req| {
            let mut reply = respond(req);
            reply
                .headers
                .push((CONTRACT_HEADER, CONTRACT_VERSION_STR.to_string()));
            reply
        });
        FakeIndexer {
            server,
            route,
            tokenizer,
            report_hold_ms,
        }
    }

    /// Sets the `report_hold_ms` its route answers carry.
    pub fn set_report_hold_ms(&self, hold_ms: Option<u64>) {
        *self.report_hold_ms.lock().expect("lock") = hold_ms;
    }

    pub fn set_route(&self, m: RouteMode) {
        *self.route.lock().expect("lock") = m;
    }

    pub fn set_tokenizer(&self, m: TokenizerMode) {
        *self.tokenizer.lock().expect("lock") = m;
    }

    /// `POST /v1/route` bodies received so far.
    pub fn route_calls(&self) -> Vec<Value> {
        self.server
            .requests
            .lock()
            .expect("lock")
            .iter()
            .filter(|r| r.path == "/v1/route")
            .map(|r| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
            .collect()
    }

    /// Completion reports received so far: sent alone or in a `/v1/complete` batch, or carried
    /// by a route call (`completed`), in arrival order.
    pub fn completions(&self) -> Vec<Value> {
        let requests = self.server.requests.lock().expect("lock");
        let mut reports = Vec::new();
        for r in requests.iter() {
            let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            match (r.path.as_str(), body) {
                ("/v1/complete", Value::Array(batch)) => reports.extend(batch),
                ("/v1/complete", one) => reports.push(one),
                ("/v1/route", mut route) => {
                    if let Some(Value::Array(carried)) = route.get_mut("completed").map(Value::take)
                    {
                        reports.extend(carried);
                    }
                }
                _ => {}
            }
        }
        reports
    }
}
