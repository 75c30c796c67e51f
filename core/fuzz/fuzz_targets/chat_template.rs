//! Fuzzes chat-template inputs on the real Qwen3 template: structured conversations (every
//! role, string / parts / null / number content, tool calls with string or object arguments,
//! reasoning, tools, `add_generation_prompt`, `continue_final_message`, template kwargs) are
//! rendered and tokenised. Rendering never panics and is deterministic; what renders tokenises
//! to exactly the ids of the rendered text tokenised whole (the segment cache changes nothing).
//! Needs `KVROUTE_MODEL_DIR` (see docs/fuzzing.md).
#![no_main]

#[path = "common.rs"]
mod common;

use arbitrary::Arbitrary;
use kvroute_core::request::Endpoint;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

#[derive(Arbitrary, Debug)]
enum Role {
    System,
    User,
    Assistant,
    Tool,
    Developer,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Part {
    Text(String),
    Refusal(String),
    Image,
    Unknown(String),
}

#[derive(Arbitrary, Debug)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
    Null,
    Absent,
    Number(i64),
}

#[derive(Arbitrary, Debug)]
struct ToolCall {
    name: String,
    /// Sent as a JSON string when true (the OpenAI shape), as an object otherwise.
    as_string: bool,
    args: Vec<(String, String)>,
}

#[derive(Arbitrary, Debug)]
struct Message {
    role: Role,
    content: Content,
    tool_calls: Option<Vec<ToolCall>>,
    reasoning: Option<String>,
}

#[derive(Arbitrary, Debug)]
struct Conversation {
    messages: Vec<Message>,
    tools: Option<Vec<(String, String)>>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    enable_thinking: Option<bool>,
    kwargs: Vec<(String, String)>,
}

fn role(r: &Role) -> Value {
    match r {
        Role::System => json!("system"),
        Role::User => json!("user"),
        Role::Assistant => json!("assistant"),
        Role::Tool => json!("tool"),
        Role::Developer => json!("developer"),
        Role::Other(s) => json!(s),
    }
}

fn part(p: &Part) -> Value {
    match p {
        Part::Text(t) => json!({"type": "text", "text": t}),
        Part::Refusal(t) => json!({"type": "refusal", "refusal": t, "text": t}),
        Part::Image => json!({"type": "image_url", "image_url": {"url": "data:,"}}),
        Part::Unknown(t) => json!({"type": t}),
    }
}

fn body(c: &Conversation) -> Value {
    let messages: Vec<Value> = c
        .messages
        .iter()
        .take(16)
        .map(|m| {
            let mut o = Map::new();
            o.insert("role".into(), role(&m.role));
            match &m.content {
                Content::Text(t) => {
                    o.insert("content".into(), json!(t));
                }
                Content::Parts(p) => {
                    o.insert("content".into(), Value::Array(p.iter().map(part).collect()));
                }
                Content::Null => {
                    o.insert("content".into(), Value::Null);
                }
                Content::Absent => {}
                Content::Number(n) => {
                    o.insert("content".into(), json!(n));
                }
            }
            if let Some(calls) = &m.tool_calls {
                let calls: Vec<Value> = calls
                    .iter()
                    .map(|tc| {
                        let args: Map<String, Value> =
                            tc.args.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
                        let args = if tc.as_string {
                            json!(Value::Object(args).to_string())
                        } else {
                            Value::Object(args)
                        };
                        json!({"id": "call", "type": "function",
                            "function": {"name": tc.name, "arguments": args}})
                    })
                    .collect();
                o.insert("tool_calls".into(), Value::Array(calls));
            }
            if let Some(r) = &m.reasoning {
                o.insert("reasoning_content".into(), json!(r));
            }
            Value::Object(o)
        })
        .collect();
    let mut b = json!({"model": "qwen3", "messages": messages});
    if let Some(tools) = &c.tools {
        b["tools"] = tools
            .iter()
            .map(|(name, desc)| {
                json!({"type": "function", "function": {"name": name, "description": desc,
                    "parameters": {"type": "object", "properties": {}}}})
            })
            .collect();
    }
    if let Some(v) = c.add_generation_prompt {
        b["add_generation_prompt"] = json!(v);
    }
    if let Some(v) = c.continue_final_message {
        b["continue_final_message"] = json!(v);
    }
    let mut kwargs: Map<String, Value> = c
        .kwargs
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    if let Some(t) = c.enable_thinking {
        kwargs.insert("enable_thinking".into(), json!(t));
    }
    if !kwargs.is_empty() {
        b["chat_template_kwargs"] = Value::Object(kwargs);
    }
    b
}

fuzz_target!(|c: Conversation| {
    let tok = &*common::TOKENIZER;
    let b = body(&c);
    let rendered = tok.render_chat(&b);
    let again = tok.render_chat(&b);
    match (&rendered, &again) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "rendering is not deterministic"),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("rendering disagrees with itself: {rendered:?} / {again:?}"),
    }
    let ids = tok.tokenize_request(Endpoint::ChatCompletions, &b);
    match (rendered, ids) {
        (Ok(text), Ok(ids)) => {
            let whole = tok
                .encode_text_uncached(&text, false)
                .expect("whole text tokenises");
            let ids = match ids {
                kvroute_core::request::PromptTokens::Single(ids) => ids,
                other => panic!("a chat request gave {other:?}"),
            };
            assert_eq!(ids, whole, "the segment cache changed the ids");
        }
        (Err(_), Err(_)) => {}
        (r, i) => panic!("render and tokenise disagree: {r:?} / {i:?}"),
    }
});
