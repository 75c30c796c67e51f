//! The filter <-> indexer HTTP contract, written once: the bodies of `POST /v1/route` and its
//! answer, `POST /v1/complete`, `GET /v1/models/{model}/tokenizer` and
//! `POST /v1/models/{model}/agreement`. The filter serialises
//! requests and parses answers with these types, the indexer does the opposite, and tests and the
//! benchmark use them too, so the two sides cannot drift apart.
//!
//! Versioning: both sides send [`CONTRACT_HEADER`] with their [`CONTRACT_VERSION`] on every
//! request and answer. A side that receives another version refuses the exchange (the indexer
//! answers 409, the filter fails open with `contract_mismatch`), and both say which versions met.
//! Readers ignore nothing silently: the indexer denies unknown request fields.

use serde::{Deserialize, Serialize};

use crate::hashing::ExtraKeyStyle;
/// Part of this contract (in `/v1/models/{model}/agreement`), defined beside the code that
/// computes it.
pub use crate::request::TokenizerDigest;
use crate::scoring::{CostTerms, Load, ReplicaRates};

/// Version of this contract. Raise it with any change an older peer would misread.
pub const CONTRACT_VERSION: u32 = 4;

/// [`CONTRACT_VERSION`] as a header value.
pub const CONTRACT_VERSION_STR: &str = "4";

/// The header that carries [`CONTRACT_VERSION`], on requests and answers.
pub const CONTRACT_HEADER: &str = "x-kvroute-contract";

/// Longest `callout_id` and `decision_id` either side accepts, in bytes.
pub const MAX_ID_BYTES: usize = 128;

/// Most completion reports one exchange carries (a `/v1/complete` batch, or a route call's
/// `completed`); the indexer refuses more.
pub const MAX_REPORTS_PER_CALL: usize = 1024;

/// What a received [`CONTRACT_HEADER`] value means for this side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContractCheck {
    /// The same version.
    Same,
    /// No header: a peer from before versioning (or a hand-written client).
    Unversioned,
    /// Another version (the peer's, `None` when the value is not a number).
    Other(Option<u32>),
}

/// Classifies a received [`CONTRACT_HEADER`] value.
pub fn check_contract(value: Option<&str>) -> ContractCheck {
    match value {
        None => ContractCheck::Unversioned,
        Some(v) => match v.trim().parse::<u32>() {
            Ok(n) if n == CONTRACT_VERSION => ContractCheck::Same,
            Ok(n) => ContractCheck::Other(Some(n)),
            Err(_) => ContractCheck::Other(None),
        },
    }
}

/// Body of `POST /v1/route`. A caller sends either the prompt's `token_ids` (the indexer computes
/// the router keys) or the `router_keys` it computed itself (the filter does).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    /// Served model name.
    pub model: String,
    /// The prompt's token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// Router keys of the prompt's full blocks, computed by the caller. Sent packed
    /// ([`crate::packed_keys`]); a JSON array of integers is read too.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::packed_keys::option"
    )]
    pub router_keys: Option<Vec<u64>>,
    /// Prompt length in tokens (with `router_keys`; default keys x block size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_tokens: Option<usize>,
    /// Block size the caller used for `router_keys` (checked against the model's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// LoRA adapter name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<String>,
    /// `cache_salt` of the request (with `token_ids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// The caller's request id: echoed and logged, never a key (see `decision_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The caller's id for this call, to abandon it through `/v1/complete` when its answer cannot
    /// be used (at most [`MAX_ID_BYTES`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callout_id: Option<String>,
    /// The request's output budget (`max_tokens`), for the in-flight deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Session key for the session policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Return every candidate's inputs and terms in the answer (`RouteAnswer::explain`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub explain: bool,
    /// Shadow mode: the caller will not send the request where the answer says (its own load
    /// balancer decides). The indexer records the decision without counting it as load on the
    /// chosen replica and learns where the request went from its completion report.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shadow: bool,
    /// The keys cover only the prompt's leading tokens (a chat with images, audio or video: up to
    /// its first media placeholder); `num_tokens` counts those. The rest is not predicted, and
    /// the hit reported at completion is not compared with the prediction.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partial: bool,
    /// Ends of the caller's earlier requests, held back to ride on this call instead of one
    /// `/v1/complete` exchange each (at most [`MAX_REPORTS_PER_CALL`]). The indexer applies them
    /// before it decides, whatever it then answers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub completed: Vec<CompleteReport>,
}

/// Prompt tokens the chosen replica holds, per medium.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchedTokens {
    /// On GPU.
    #[serde(default)]
    pub gpu: u64,
    /// In host memory.
    #[serde(default)]
    pub cpu: u64,
    /// On storage.
    #[serde(default)]
    pub storage: u64,
    /// Only predicted (a sibling request was just routed there).
    #[serde(default)]
    pub predicted: u64,
}

/// Longest hold of completion reports a route answer's `report_hold_ms` may ask for (ms).
pub const MAX_REPORT_HOLD_MS: u64 = 10_000;

/// Answer of `POST /v1/route`. Readers take missing fields other than `endpoint` as empty.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteAnswer {
    /// `IP:port` to send the request to.
    pub endpoint: String,
    /// Where to send it if `endpoint` cannot take it, best first (`IP:port`; the kv policies'
    /// runner-up): the filter lists them after `endpoint` in `x-kvroute-destinations`, which
    /// Envoy's `override_host` load balancing tries in order (docs/filter.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternates: Vec<String>,
    /// Replica name.
    #[serde(default)]
    pub replica: String,
    /// Tokens of the prompt the chosen replica holds.
    #[serde(default)]
    pub matched_tokens: MatchedTokens,
    /// Why (`prefix_hit`, `load`, `session`, ...).
    #[serde(default)]
    pub reason: String,
    /// The decision's id, made by the indexer: report the completion with it.
    #[serde(default)]
    pub decision_id: String,
    /// The caller's `request_id` (the decision id when none was given).
    #[serde(default)]
    pub request_id: String,
    /// Policy used.
    #[serde(default)]
    pub policy: String,
    /// Prompt blocks considered (usable hit blocks).
    #[serde(default)]
    pub prompt_blocks: u32,
    /// Cost of the chosen replica in seconds: predicted TTFT plus harm (kv policies).
    #[serde(default)]
    pub cost: f64,
    /// The time to first token predicted there, milliseconds (kv policies; 0 otherwise).
    #[serde(default)]
    pub predicted_ttft_ms: f64,
    /// Every candidate's inputs and terms, when the request asked for `explain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<CandidateExplain>>,
    /// How long the caller may hold its completion reports for a later route call to carry,
    /// ms: 0 when this indexer shares its decisions with other gateways' (`[peers]`: they would
    /// count a finished request as running meanwhile), else its `[inflight] report_hold_ms`.
    /// Absent (an older indexer): send each report at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report_hold_ms: Option<u64>,
}

/// One candidate of a decision, explained: what the model knew of it and what it predicted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateExplain {
    /// Replica name.
    pub replica: String,
    /// Whether it was chosen.
    pub chosen: bool,
    /// False when it could not be chosen (unhealthy, draining).
    pub eligible: bool,
    /// Tokens of the prompt it holds, per tier.
    pub matched_tokens: MatchedTokens,
    /// What was already asked of it.
    pub load: Load,
    /// Its rates (calibrated or prior).
    pub rates: ReplicaRates,
    /// The prediction, seconds (absent when not eligible or the policy does not predict).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terms: Option<CostTerms>,
}

/// One report of `POST /v1/complete` (whose body is one report, or a JSON array of them, see
/// [`parse_complete_reports`]): how a routed request ended (by `decision_id`), or the abandonment
/// of a route call whose answer never reached its request (by `callout_id`, `abandoned: true`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteReport {
    /// The route answer's `decision_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// The route request's `callout_id` (abandonments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callout_id: Option<String>,
    /// Time to first token the proxy saw, microseconds: from the request leaving for the replica
    /// to the first response body bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_us: Option<u64>,
    /// The request ended before its response did (client left, stream reset).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub abandoned: bool,
    /// Informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Informational: where the request went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The engine's `usage.prompt_tokens_details.cached_tokens`, when the response carried it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// `IP:port` the proxy really sent the request to (Envoy's `upstream.address`), when known.
    /// Sent for shadow decisions, where it differs from `endpoint` whenever the proxy's own
    /// balancer chose another replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
}

/// Why a `POST /v1/complete` body was refused.
#[derive(Debug, thiserror::Error)]
pub enum CompleteBodyError {
    /// Not a report nor an array of reports.
    #[error("invalid JSON body: {0}")]
    Json(#[from] serde_json::Error),
    /// More than [`MAX_REPORTS_PER_CALL`] reports.
    #[error("{0} reports in one call, at most {MAX_REPORTS_PER_CALL} are accepted")]
    TooMany(usize),
}

/// Parses a `POST /v1/complete` body: one [`CompleteReport`] object, or a JSON array of at most
/// [`MAX_REPORTS_PER_CALL`] of them (a filter's held reports sent together).
pub fn parse_complete_reports(body: &[u8]) -> Result<Vec<CompleteReport>, CompleteBodyError> {
    let reports = if body.trim_ascii_start().starts_with(b"[") {
        serde_json::from_slice::<Vec<CompleteReport>>(body)?
    } else {
        vec![serde_json::from_slice::<CompleteReport>(body)?]
    };
    if reports.len() > MAX_REPORTS_PER_CALL {
        return Err(CompleteBodyError::TooMany(reports.len()));
    }
    Ok(reports)
}

/// Answer of `GET /v1/models/{model}/tokenizer`: what the filter needs to tokenise and key
/// requests exactly as the model's engines do.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerBundle {
    /// Served model name.
    #[serde(default)]
    pub model: String,
    /// The engines' `--block-size`, when known.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// The engines' `--max-model-len`, when configured (the filter's prompt cap).
    #[serde(default)]
    pub max_model_len: Option<u32>,
    /// How the engines hash LoRA / cache_salt extra keys (from their vLLM version).
    #[serde(default)]
    pub extra_key_style: Option<ExtraKeyStyle>,
    /// `tokenizer.json`, as text; in the compact form (with `bpe_tables`), the document with
    /// the BPE model's `vocab` and `merges` emptied. Readers also take the document inline as an
    /// object (the filter's offline VM-configuration entries).
    #[serde(deserialize_with = "json_document")]
    pub tokenizer_json: String,
    /// The effective `tokenizer_config.json`, as text: the file with `chat_template.jinja`,
    /// `chat_template.json` and `special_tokens_map.json` merged in (`ModelFiles`). Text or an
    /// inline object; absent reads as `{}`.
    #[serde(default = "empty_json_object", deserialize_with = "json_document")]
    pub tokenizer_config_json: String,
    /// The compact form's vocabulary and merges (`?form=compact`, for a BPE model the form
    /// covers): build with `ModelTokenizer::from_compact`. Absent: `tokenizer_json` is whole.
    /// Shared, so a server answers many fetches from one copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bpe_tables: Option<std::sync::Arc<crate::request::BpeTables>>,
}

/// The query parameter of `GET /v1/models/{model}/tokenizer` that asks for the compact form
/// (`?form=compact`). A client that does not ask gets the whole `tokenizer.json`, which every
/// filter release understands; an indexer that does not know the parameter ignores it and
/// sends the whole document, which a new filter loads too (with the larger parse peak).
pub const TOKENIZER_FORM_COMPACT: &str = "form=compact";

/// Largest block size a bundle may announce (vLLM's are 1 to a few hundred tokens).
pub const MAX_BUNDLE_BLOCK_SIZE: u32 = 4096;

/// Why a tokenizer bundle was refused by its reader.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// The body is not JSON.
    #[error("not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object.
    #[error("tokenizer answer is not a JSON object")]
    NotObject,
    /// An object whose members do not fit the contract (missing `tokenizer_json`, an unknown
    /// `extra_key_style`, a wrong type).
    #[error("tokenizer answer: {0}")]
    Members(String),
    /// A number outside what any engine runs with.
    #[error("tokenizer answer: {field} {value} is out of range 1..={max}")]
    OutOfRange {
        /// The member.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted.
        max: u64,
    },
}

/// `"{}"`, the reading of an absent `tokenizer_config_json`.
fn empty_json_object() -> String {
    "{}".to_owned()
}

/// A JSON document carried as text, or inline as an object (serialised back to text). Text is
/// taken as it is, without building a tree of it.
fn json_document<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct Doc;
    impl<'de> serde::de::Visitor<'de> for Doc {
        type Value = String;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON document as a string or an object")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
            Ok(v.to_owned())
        }
        fn visit_string<E: serde::de::Error>(self, v: String) -> Result<String, E> {
            Ok(v)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<String, A::Error> {
            let doc =
                serde_json::Map::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
            serde_json::to_string(&doc).map_err(serde::de::Error::custom)
        }
    }
    d.deserialize_any(Doc)
}

impl TokenizerBundle {
    /// Reads a bundle from the body of `GET /v1/models/{model}/tokenizer` (straight from the
    /// bytes: the compact form's tables land in their vectors without a JSON tree in between),
    /// then checks its numbers ([`Self::checked`]).
    pub fn parse(body: &[u8]) -> Result<Self, BundleError> {
        match serde_json::from_slice::<Self>(body) {
            Ok(b) => b.checked(),
            // Tell "not an object" and "not JSON" apart from a member error.
            Err(e) => Err(
                match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                    Err(e) => BundleError::NotJson(e.to_string()),
                    Ok(_) if !body.trim_ascii_start().starts_with(b"{") => BundleError::NotObject,
                    Ok(_) => BundleError::Members(e.to_string()),
                },
            ),
        }
    }

    /// Reads a bundle given as a JSON value (the filter's offline VM-configuration entries).
    pub fn from_value(v: &serde_json::Value) -> Result<Self, BundleError> {
        if !v.is_object() {
            return Err(BundleError::NotObject);
        }
        Self::deserialize(v)
            .map_err(|e| BundleError::Members(e.to_string()))?
            .checked()
    }

    /// The bundle when its block size and context length are ones an engine can run with.
    pub fn checked(self) -> Result<Self, BundleError> {
        let range = |field, value: Option<u32>, max: u64| match value {
            Some(v) if v == 0 || u64::from(v) > max => Err(BundleError::OutOfRange {
                field,
                value: v.into(),
                max,
            }),
            _ => Ok(()),
        };
        range("block_size", self.block_size, MAX_BUNDLE_BLOCK_SIZE.into())?;
        range(
            "max_model_len",
            self.max_model_len,
            crate::request::MAX_SANE_MODEL_MAX_LENGTH as u64,
        )?;
        Ok(self)
    }

    /// The bundle of `model`'s files, in the compact form when `compact` and the form covers
    /// the tokenizer (else whole). Other fields are left at their defaults.
    pub fn from_files(
        model: &str,
        files: crate::request::ModelFiles,
        compact: bool,
    ) -> Result<Self, crate::request::RequestError> {
        let text = |bytes: Vec<u8>, name: &str| {
            String::from_utf8(bytes).map_err(|_| {
                crate::request::RequestError::ModelFiles(format!(
                    "{name} of model {model:?} is not UTF-8"
                ))
            })
        };
        let split = if compact {
            crate::request::compact_tokenizer_json(&files.tokenizer_json)?
        } else {
            None
        };
        let (tokenizer_json, bpe_tables) = match split {
            Some(c) => (c.tokenizer_json, Some(std::sync::Arc::new(c.tables))),
            None => (files.tokenizer_json, None),
        };
        Ok(Self {
            model: model.to_owned(),
            tokenizer_json: text(tokenizer_json, "tokenizer.json")?,
            tokenizer_config_json: text(files.tokenizer_config_json, "tokenizer_config.json")?,
            bpe_tables,
            ..Self::default()
        })
    }
}

/// One online check of a routed request against its engine: the filter asked the engine for the
/// prompt's token ids (vLLM's `return_token_ids`) and compared them with its own. Counts and a
/// position only; never the tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenCheck {
    /// `chat` or `completions`.
    pub endpoint: String,
    /// Prompt tokens the filter computed.
    pub own_tokens: u64,
    /// Prompt tokens the engine reported.
    pub engine_tokens: u64,
    /// First position where they differ (`None`: identical).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_difference: Option<u64>,
}

impl TokenCheck {
    /// Compares the filter's ids with the engine's.
    pub fn compare(endpoint: &str, own: &[u32], engine: &[u32]) -> Self {
        let first_difference = own
            .iter()
            .zip(engine)
            .position(|(a, b)| a != b)
            .or_else(|| (own.len() != engine.len()).then(|| own.len().min(engine.len())))
            .map(|p| p as u64);
        Self {
            endpoint: endpoint.to_string(),
            own_tokens: own.len() as u64,
            engine_tokens: engine.len() as u64,
            first_difference,
        }
    }

    /// The engine saw the same tokens.
    pub fn agrees(&self) -> bool {
        self.first_difference.is_none()
    }
}

/// Body of `POST /v1/models/{model}/agreement`: the filter's digest of what it loaded for the
/// model (sent once per load), with the outcome of an online check when it has one. The indexer
/// compares the digest with its own and keeps the checks' verdict; both show on `/readyz`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgreementReport {
    /// The filter's digest of the model's tokenizer.
    pub digest: TokenizerDigest,
    /// An online check's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<TokenCheck>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_versions_are_told_apart() {
        assert_eq!(CONTRACT_VERSION_STR, CONTRACT_VERSION.to_string());
        assert_eq!(
            check_contract(Some(&CONTRACT_VERSION.to_string())),
            ContractCheck::Same
        );
        assert_eq!(check_contract(None), ContractCheck::Unversioned);
        assert_eq!(check_contract(Some("999")), ContractCheck::Other(Some(999)));
        assert_eq!(check_contract(Some("v1")), ContractCheck::Other(None));
    }

    #[test]
    fn route_requests_round_trip_and_unknown_fields_are_refused() {
        let req = RouteRequest {
            model: "m".into(),
            router_keys: Some(vec![1, u64::MAX]),
            num_tokens: Some(33),
            callout_id: Some("c1".into()),
            ..RouteRequest::default()
        };
        let text = serde_json::to_string(&req).expect("serialise");
        assert!(!text.contains("token_ids"), "{text}");
        assert_eq!(
            serde_json::from_str::<RouteRequest>(&text).expect("parse"),
            req
        );
        assert!(serde_json::from_str::<RouteRequest>(r#"{"model":"m","tokens":[1]}"#).is_err());
    }

    #[test]
    fn bundles_carry_the_key_style_by_name() {
        let bundle = TokenizerBundle {
            extra_key_style: Some(ExtraKeyStyle::Plain),
            tokenizer_json: "{}".into(),
            tokenizer_config_json: "{}".into(),
            ..TokenizerBundle::default()
        };
        let v = serde_json::to_value(&bundle).expect("serialise");
        assert_eq!(v["extra_key_style"], "plain");
        let back: TokenizerBundle = serde_json::from_value(v).expect("parse");
        assert_eq!(back.extra_key_style, Some(ExtraKeyStyle::Plain));
    }

    #[test]
    fn bundles_take_documents_as_text_or_objects_and_refuse_odd_numbers() {
        let b = TokenizerBundle::from_value(&serde_json::json!({
            "model": "qwen3", "block_size": 16, "extra": "ignored",
            "tokenizer_json": "{\"a\":1}", "tokenizer_config_json": {"chat_template": "x"}
        }))
        .expect("bundle");
        assert_eq!(b.tokenizer_json, r#"{"a":1}"#);
        assert_eq!(b.tokenizer_config_json, r#"{"chat_template":"x"}"#);
        assert_eq!(b.block_size, Some(16));
        let bare = TokenizerBundle::parse(br#"{"tokenizer_json": "{}"}"#).expect("bundle");
        assert_eq!(bare.tokenizer_config_json, "{}");
        for (body, want) in [
            (&br#"{"block_size": 16}"#[..], "tokenizer_json"),
            (br#"[1]"#, "not a JSON object"),
            (b"{", "not JSON"),
            (
                br#"{"tokenizer_json": "{}", "extra_key_style": "odd"}"#,
                "odd",
            ),
            (
                br#"{"tokenizer_json": "{}", "block_size": 0}"#,
                "block_size 0 is out of range",
            ),
            (
                br#"{"tokenizer_json": "{}", "block_size": 5000}"#,
                "block_size 5000",
            ),
            (
                br#"{"tokenizer_json": "{}", "max_model_len": 0}"#,
                "max_model_len 0",
            ),
        ] {
            let e = TokenizerBundle::parse(body).expect_err(want).to_string();
            assert!(e.contains(want), "{e} (want {want})");
        }
    }

    #[test]
    fn token_checks_find_the_first_difference() {
        assert!(TokenCheck::compare("chat", &[1, 2, 3], &[1, 2, 3]).agrees());
        let c = TokenCheck::compare("chat", &[1, 2, 3], &[1, 9, 3]);
        assert_eq!((c.first_difference, c.own_tokens), (Some(1), 3));
        let shorter = TokenCheck::compare("completions", &[1, 2], &[1, 2, 3]);
        assert_eq!(shorter.first_difference, Some(2));
        assert_eq!(shorter.engine_tokens, 3);
        let a = TokenizerDigest {
            tokenizer: "a".into(),
            template: "t".into(),
            options: "o".into(),
        };
        let b = TokenizerDigest {
            template: "u".into(),
            ..a.clone()
        };
        assert_eq!(a.differences(&b), vec!["template"]);
        assert!(a.differences(&a).is_empty());
    }

    #[test]
    fn answers_with_only_an_endpoint_parse() {
        let a: RouteAnswer = serde_json::from_str(r#"{"endpoint":"127.0.0.1:1"}"#).expect("parse");
        assert_eq!(a.endpoint, "127.0.0.1:1");
        assert!(a.decision_id.is_empty());
    }

    #[test]
    fn complete_bodies_are_one_report_or_an_array_of_them() {
        let one = parse_complete_reports(br#"{"decision_id":"d1","cached_tokens":16}"#)
            .expect("one report");
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].decision_id.as_deref(), Some("d1"));
        let many = parse_complete_reports(
            br#" [{"decision_id":"d1"},{"callout_id":"c2","abandoned":true}]"#,
        )
        .expect("an array");
        assert_eq!(many.len(), 2);
        assert!(many[1].abandoned);
        assert!(parse_complete_reports(b"[]").expect("empty").is_empty());
        assert!(matches!(
            parse_complete_reports(br#"[{"decision_id":"d1","surprise":1}]"#),
            Err(CompleteBodyError::Json(_))
        ));
        let too_many = format!("[{}]", vec!["{}"; MAX_REPORTS_PER_CALL + 1].join(","));
        assert!(matches!(
            parse_complete_reports(too_many.as_bytes()),
            Err(CompleteBodyError::TooMany(n)) if n == MAX_REPORTS_PER_CALL + 1
        ));
    }

    #[test]
    fn route_requests_carry_held_reports_only_when_there_are_some() {
        let bare = RouteRequest {
            model: "m".into(),
            ..RouteRequest::default()
        };
        assert!(!serde_json::to_string(&bare)
            .expect("json")
            .contains("completed"));
        let carrying = RouteRequest {
            completed: vec![CompleteReport {
                decision_id: Some("d1".into()),
                ..CompleteReport::default()
            }],
            ..bare
        };
        let back: RouteRequest =
            serde_json::from_slice(&serde_json::to_vec(&carrying).expect("json")).expect("parse");
        assert_eq!(back, carrying);
    }
}
