//! Fuzzes the request path on the real Qwen3 tokenizer: the first byte picks the endpoint
//! (even: chat, odd: completions), the rest is the body. Any input must parse or be `NotJson`,
//! tokenise or be refused, never panic; what tokenises must tokenise to the same ids again (the
//! segment cache warm), agree with the capped call, and give one router key per full block;
//! `RequestBody::parse` (the filter's parse, with its token-id fast path) must give the same
//! body, ids and errors as the `Value` path.
//! Needs `KVROUTE_MODEL_DIR` (see docs/fuzzing.md).
#![no_main]

#[path = "common.rs"]
mod common;

use kvroute_core::hashing::ExtraKeyStyle;
use kvroute_core::request::{
    parse_body, request_extras, Endpoint, RequestBody, RequestError, MAX_PROMPT_BYTES_PER_TOKEN,
};
use kvroute_core::router_key::request_keys;
use libfuzzer_sys::fuzz_target;

/// A cap that keeps each run short and exercises the capped path.
const CAP: usize = 2048;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let endpoint = if selector & 1 == 0 {
        Endpoint::ChatCompletions
    } else {
        Endpoint::Completions
    };
    let parsed = RequestBody::parse(bytes, endpoint);
    let body = match parse_body(bytes) {
        Ok(b) => b,
        Err(e) => {
            assert!(matches!(e, RequestError::NotJson(_)), "{e:?}");
            assert!(matches!(parsed, Err(RequestError::NotJson(_))), "{parsed:?}");
            return;
        }
    };
    let tok = &*common::TOKENIZER;
    let capped = tok.tokenize_request_capped(endpoint, &body, CAP);
    match &parsed {
        Ok(p) => {
            assert_eq!(p.to_value(), body, "RequestBody changed the body");
            assert_eq!(
                tok.tokenize_body_capped(endpoint, p, CAP)
                    .map_err(|e| e.to_string()),
                capped.as_ref().map(Clone::clone).map_err(|e| e.to_string()),
                "RequestBody's ids differ from the Value path's"
            );
        }
        Err(e) => assert!(
            matches!(e, RequestError::NotAnObject) && !body.is_object(),
            "{e:?}"
        ),
    }
    let first = tok.tokenize_request(endpoint, &body);
    let again = tok.tokenize_request(endpoint, &body);
    let tokens = match (first, again) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b, "the same body tokenised twice gave different ids");
            a
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string());
            assert!(
                capped.is_err(),
                "capped accepted what uncapped refused: {a}"
            );
            return;
        }
        (a, b) => panic!("runs disagree: {a:?} / {b:?}"),
    };
    let longest = tokens.prompts().iter().map(|p| p.len()).max().unwrap_or(0);
    match capped {
        Ok(t) => assert_eq!(t, tokens, "the cap changed the ids"),
        Err(RequestError::PromptTooLong { .. }) => {
            // Refused by size alone above cap x 16 bytes of rendered text, else only when
            // it has more tokens than the cap.
            let text_bytes = match endpoint {
                Endpoint::ChatCompletions => tok.render_chat(&body).map_or(0, |t| t.len()),
                Endpoint::Completions => bytes.len(),
            };
            assert!(
                longest > CAP || text_bytes > CAP * MAX_PROMPT_BYTES_PER_TOKEN,
                "{longest} tokens and {text_bytes} bytes refused by cap {CAP}"
            );
        }
        Err(e) => panic!("the capped call failed where the uncapped one worked: {e:?}"),
    }
    let extras = request_extras(&body, &|name| (name == "sql-lora").then(|| "/a".to_owned()));
    for ids in tokens.prompts() {
        for bs in [1, 16] {
            let keys = request_keys(ids, bs, &extras, ExtraKeyStyle::Tagged);
            assert_eq!(keys.len(), ids.len() / bs);
        }
    }
});
