//! OpenAI request bodies to the inputs of a chat template or a tokenizer, exactly as vLLM 0.33
//! (`vllm/renderers/chat_utils/chat_message.py`, `renderers/hf.py`, the chat request's
//! `build_chat_params`) and transformers' `apply_chat_template` prepare them.
//!
//! Chat messages: `content` given as a list of text parts becomes one string, the texts joined
//! with `"\n"` (templates that take string content, like Qwen3's); `null` content becomes `""`;
//! assistant `tool_calls[].function.arguments` sent as a JSON string is parsed into an object
//! (invalid JSON or a non-object becomes `{}`); an empty `tool_calls` list is dropped; the
//! deprecated `reasoning_content` becomes `reasoning`; keys whose value is `null` are removed and
//! the reasoning is aliased as `reasoning_content` and `thinking` (transformers).

use serde_json::{Map, Value};

use super::{ChatContentFormat, RequestError, TokenizerOptions};

/// Content part types whose payload is text.
const TEXT_PART_TYPES: [&str; 5] = ["text", "input_text", "output_text", "refusal", "thinking"];
/// Content part keys that carry media.
const MEDIA_PART_KEYS: [&str; 12] = [
    "image_url",
    "input_image",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
    "file",
    "image",
];
/// Stands in the rendered chat for the first media part's placeholder: the prompt is known up to
/// where it first appears. Private-use characters, so a chat template passes it through as text;
/// a client that writes it in its own text only moves the cut earlier, to a point where the
/// engine's prompt has the same text.
pub(crate) const MEDIA_MARK: &str = "\u{F8FF}kvroute:media\u{F8FF}";
/// The system-prompt attribution line that vLLM strips (its value changes per request).
const CLAUDE_CODE_BILLING_HEADER: &str = "x-anthropic-billing-header";
/// Names `apply_chat_template` consumes itself: they never reach the template.
const HF_CONSUMED_KWARGS: [&str; 8] = [
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "conversation",
];

/// A chat request prepared for rendering.
#[derive(Debug, Clone)]
pub(crate) struct ChatRequest<'a> {
    /// Raw `messages` (normalised later, once the template is chosen), borrowed from the body.
    pub(crate) messages: &'a [Value],
    /// Tools after vLLM's `ChatCompletionToolsParam` normalisation, or `None`.
    pub(crate) tools: Option<Value>,
    /// `documents`, or `None`.
    pub(crate) documents: Option<Value>,
    /// Whether to end with the assistant header.
    pub(crate) add_generation_prompt: bool,
    /// Whether to leave the final message open.
    pub(crate) continue_final_message: bool,
    /// Other template variables (`enable_thinking`, `reasoning_effort`, ...).
    pub(crate) kwargs: Map<String, Value>,
    /// A template sent with the request (only honoured when the options trust it).
    pub(crate) chat_template: Option<String>,
    /// Whether to add the tokenizer's special tokens on top of the template's (default false).
    pub(crate) add_special_tokens: bool,
}

fn is_unset(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("auto")
}

/// vLLM's `merge_kwargs`: `defaults | overrides` without override values `None` or `"auto"`.
fn merge_kwargs(
    mut defaults: Map<String, Value>,
    overrides: Map<String, Value>,
) -> Map<String, Value> {
    for (k, v) in overrides {
        if !is_unset(&v) {
            defaults.insert(k, v);
        }
    }
    defaults
}

fn opt_bool(body: &Value, key: &str, default: bool) -> Result<bool, RequestError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RequestError::InvalidField {
            field: key.into(),
            reason: "must be a boolean".into(),
        }),
    }
}

/// Python truthiness of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Reads a `/v1/chat/completions` body.
pub(crate) fn chat_request<'a>(
    body: &'a Value,
    opts: &TokenizerOptions,
) -> Result<ChatRequest<'a>, RequestError> {
    let obj = body.as_object().ok_or(RequestError::NotAnObject)?;
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) => m.as_slice(),
        Some(_) => {
            return Err(RequestError::InvalidField {
                field: "messages".into(),
                reason: "must be a list".into(),
            })
        }
        None => return Err(RequestError::MissingField("messages")),
    };
    if messages.len() > opts.max_messages {
        return Err(RequestError::TooLarge {
            what: "messages",
            limit: opts.max_messages,
        });
    }
    let add_generation_prompt = opt_bool(body, "add_generation_prompt", true)?;
    let continue_final_message = opt_bool(body, "continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(RequestError::InvalidField {
            field: "continue_final_message".into(),
            reason: "cannot be true together with add_generation_prompt (which defaults to true)"
                .into(),
        });
    }
    let add_special_tokens = opt_bool(body, "add_special_tokens", false)?;

    let tool_choice_none = obj.get("tool_choice").and_then(Value::as_str) == Some("none");
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(_) if tool_choice_none && opts.exclude_tools_when_tool_choice_none => None,
        Some(Value::Array(tools)) => Some(Value::Array(
            tools.iter().map(normalise_tool).collect::<Result<_, _>>()?,
        )),
        Some(_) => {
            return Err(RequestError::InvalidField {
                field: "tools".into(),
                reason: "must be a list".into(),
            })
        }
    };

    let user_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(RequestError::InvalidField {
                field: "chat_template_kwargs".into(),
                reason: "must be an object".into(),
            })
        }
    };
    if user_kwargs.get("tokenize").is_some_and(truthy) {
        return Err(RequestError::InvalidField {
            field: "chat_template_kwargs".into(),
            reason: "\"tokenize\" is not accepted".into(),
        });
    }
    let body_template = match obj.get("chat_template") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(RequestError::InvalidField {
                field: "chat_template".into(),
                reason: "must be a string".into(),
            })
        }
    };
    let kwargs_template = user_kwargs.get("chat_template").filter(|v| !v.is_null());
    if !opts.trust_request_chat_template && (body_template.is_some() || kwargs_template.is_some()) {
        return Err(RequestError::UntrustedChatTemplate);
    }

    // vLLM: extras = {add_generation_prompt, continue_final_message, documents, reasoning_effort}
    // (+ enable_thinking when reasoning_effort is set and the user did not set it) override the
    // user's chat_template_kwargs, which override the server defaults and `tools`.
    let reasoning_effort = obj
        .get("reasoning_effort")
        .filter(|v| !v.is_null())
        .cloned();
    let mut extras = Map::new();
    extras.insert(
        "add_generation_prompt".into(),
        Value::Bool(add_generation_prompt),
    );
    extras.insert(
        "continue_final_message".into(),
        Value::Bool(continue_final_message),
    );
    extras.insert(
        "documents".into(),
        obj.get("documents").cloned().unwrap_or(Value::Null),
    );
    if let Some(effort) = &reasoning_effort {
        extras.insert("reasoning_effort".into(), effort.clone());
        if !user_kwargs.contains_key("enable_thinking") {
            extras.insert(
                "enable_thinking".into(),
                Value::Bool(effort.as_str() != Some("none")),
            );
        }
    }
    let overrides = merge_kwargs(user_kwargs, extras);
    let mut defaults = opts.default_chat_template_kwargs.clone();
    if let Some(t) = &tools {
        defaults.insert("tools".into(), t.clone());
    }
    let mut kwargs = merge_kwargs(defaults, overrides);

    let tools = kwargs.remove("tools").filter(|v| !v.is_null());
    let documents = kwargs.remove("documents").filter(|v| !v.is_null());
    let kw_template = kwargs.remove("chat_template");
    kwargs.remove("tokenize");
    let add_generation_prompt = kwargs
        .remove("add_generation_prompt")
        .is_some_and(|v| truthy(&v));
    let continue_final_message = kwargs
        .remove("continue_final_message")
        .is_some_and(|v| truthy(&v));
    if kwargs.contains_key("messages") {
        return Err(RequestError::InvalidField {
            field: "chat_template_kwargs".into(),
            reason: "\"messages\" cannot be passed as a template variable".into(),
        });
    }
    if kwargs.get("sanitize_control_tokens").is_some_and(truthy) {
        return Err(RequestError::Unsupported(
            "chat_template_kwargs.sanitize_control_tokens".into(),
        ));
    }
    kwargs.remove("sanitize_control_tokens");
    for name in HF_CONSUMED_KWARGS {
        kwargs.remove(name);
    }
    let chat_template =
        body_template.or_else(|| kw_template.and_then(|v| v.as_str().map(str::to_owned)));

    Ok(ChatRequest {
        messages,
        tools,
        documents,
        add_generation_prompt,
        continue_final_message,
        kwargs,
        chat_template,
        add_special_tokens,
    })
}

/// vLLM's `ChatCompletionToolsParam(...).model_dump()`:
/// `{"type": "function", "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}`.
fn normalise_tool(tool: &Value) -> Result<Value, RequestError> {
    let invalid = |reason: &str| RequestError::InvalidField {
        field: "tools".into(),
        reason: reason.into(),
    };
    let tool = tool
        .as_object()
        .ok_or_else(|| invalid("each tool must be an object"))?;
    match tool.get("type") {
        None => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(_) => return Err(invalid("tool type must be \"function\"")),
    }
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("each tool needs a \"function\" object"))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("function.name must be a string"))?;
    let description = match function.get("description") {
        None | Some(Value::Null) => Value::Null,
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(_) => return Err(invalid("function.description must be a string")),
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => Value::Null,
        Some(Value::Object(p)) => Value::Object(p.clone()),
        Some(_) => return Err(invalid("function.parameters must be an object")),
    };
    let opt_bool_field = |v: Option<&Value>, what: &str| -> Result<Option<bool>, RequestError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(&format!("{what} must be a boolean"))),
        }
    };
    let strict = opt_bool_field(function.get("strict"), "function.strict")?;
    let tool_defer = opt_bool_field(tool.get("defer_loading"), "defer_loading")?;
    let fn_defer =
        opt_bool_field(function.get("defer_loading"), "function.defer_loading")?.or(tool_defer);

    let mut f = Map::new();
    f.insert("name".into(), Value::String(name.to_owned()));
    f.insert("description".into(), description);
    f.insert("parameters".into(), parameters);
    if let Some(s) = strict {
        f.insert("strict".into(), Value::Bool(s));
    }
    if let Some(d) = fn_defer {
        f.insert("defer_loading".into(), Value::Bool(d));
    }
    let mut out = Map::new();
    out.insert("type".into(), Value::String("function".into()));
    out.insert("function".into(), Value::Object(f));
    if let Some(d) = tool_defer {
        out.insert("defer_loading".into(), Value::Bool(d));
    }
    Ok(Value::Object(out))
}

/// Guesses whether a template reads `content` as a string or iterates over OpenAI-style parts
/// (vLLM inspects the template's AST; this looks for a loop over a message's content).
pub(crate) fn detect_content_format(template_source: &str) -> ChatContentFormat {
    let compact: String = template_source
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let loops_over_content = [
        "content']",
        "content\"]",
        ".content%}",
        ".content-%}",
        "content']-%}",
        "content\"]-%}",
    ]
    .iter()
    .any(|end| {
        compact.match_indices(end).any(|(i, _)| {
            compact[..i]
                .rfind("{%for")
                .or_else(|| compact[..i].rfind("{%-for"))
                .is_some_and(|f| {
                    let between = &compact[f..i];
                    between.contains("in") && !between.contains("%}")
                })
        })
    });
    if loops_over_content {
        ChatContentFormat::OpenAi
    } else {
        ChatContentFormat::String
    }
}

/// vLLM's message parsing and post-processing, then transformers' message normalisation.
pub(crate) fn normalise_messages(
    messages: &[Value],
    format: ChatContentFormat,
    template_source: &str,
) -> Result<Vec<Value>, RequestError> {
    let mut out = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        out.push(parse_message(index, message, format)?);
    }
    postprocess_tool_calls(&mut out)?;
    if out.iter().any(|m| role_of(m) == Some("developer"))
        && !(template_source.contains("\"developer\"") || template_source.contains("'developer'"))
    {
        out = developer_to_system(out);
    }
    Ok(out.into_iter().map(hf_normalise).collect())
}

fn role_of(m: &Value) -> Option<&str> {
    m.get("role").and_then(Value::as_str)
}

fn invalid_message(index: usize, reason: impl Into<String>) -> RequestError {
    RequestError::InvalidMessage {
        index,
        reason: reason.into(),
    }
}

fn parse_message(
    index: usize,
    message: &Value,
    format: ChatContentFormat,
) -> Result<Value, RequestError> {
    let msg = message
        .as_object()
        .ok_or_else(|| invalid_message(index, "must be an object"))?;
    let role = match msg.get("role") {
        Some(Value::String(r)) => r.clone(),
        Some(_) => return Err(invalid_message(index, "role must be a string")),
        None => return Err(invalid_message(index, "role is missing")),
    };
    // vLLM's request validator renames the deprecated field.
    let reasoning = match msg.get("reasoning").filter(|v| !v.is_null()) {
        Some(r) => Some(r.clone()),
        None => msg
            .get("reasoning_content")
            .filter(|v| !v.is_null())
            .cloned(),
    };
    let (mut texts, media_at) = match msg.get("content") {
        // Most messages: one string, which vLLM reads as one text part of that same text.
        Some(Value::String(s))
            if role != "system" || !s.starts_with(CLAUDE_CODE_BILLING_HEADER) =>
        {
            (vec![s.clone()], None)
        }
        content => content_texts(index, content, &role)?,
    };
    let content = match format {
        ChatContentFormat::OpenAi => {
            // The template renders the media part in place.
            if let Some(at) = media_at {
                texts.insert(at, MEDIA_MARK.to_owned());
            }
            Value::Array(
                texts
                    .into_iter()
                    .map(|t| serde_json::json!({"type": "text", "text": t}))
                    .collect(),
            )
        }
        _ => {
            // vLLM puts the media placeholders before the message's text, one per line.
            if media_at.is_some() {
                texts.insert(0, MEDIA_MARK.to_owned());
            }
            match <[String; 1]>::try_from(texts) {
                Ok([text]) => Value::String(text),
                Err(texts) => Value::String(texts.join("\n")),
            }
        }
    };

    let mut result = Map::new();
    result.insert("role".into(), Value::String(role.clone()));
    result.insert("content".into(), content);
    if role == "assistant" {
        match msg.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                result.insert("tool_calls".into(), Value::Array(calls.clone()));
            }
            Some(_) => return Err(invalid_message(index, "tool_calls must be a list")),
        }
        if let Some(r) = reasoning {
            if !r.is_string() {
                return Err(RequestError::Unsupported(
                    "non-string assistant reasoning".into(),
                ));
            }
            result.insert("reasoning".into(), r.clone());
            result.insert("reasoning_content".into(), r);
        }
    } else if role == "tool" {
        if let Some(id) = msg.get("tool_call_id") {
            result.insert("tool_call_id".into(), id.clone());
        }
        if let Some(Value::Array(items)) = result.get("content").cloned() {
            // OpenAI format: an all-text tool result becomes one string.
            let texts: Vec<&str> = items
                .iter()
                .filter_map(|i| i.get("text").and_then(Value::as_str))
                .collect();
            result.insert("content".into(), Value::String(texts.join("\n")));
        }
    }
    if let Some(Value::String(name)) = msg.get("name") {
        result.insert("name".into(), Value::String(name.clone()));
    }
    if let Some(Value::String(task)) = msg.get("task") {
        result.insert("task".into(), Value::String(task.clone()));
    }
    if role == "developer" {
        result.insert(
            "tools".into(),
            msg.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(Value::Object(result))
}

/// The texts of a message's `content` (string, list of parts or absent) in order, and where the
/// first media part was among them.
fn content_texts(
    index: usize,
    content: Option<&Value>,
    role: &str,
) -> Result<(Vec<String>, Option<usize>), RequestError> {
    let mut parts: Vec<Value> = match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![serde_json::json!({"type": "text", "text": s})],
        Some(Value::Array(parts)) => parts.clone(),
        Some(_) => {
            return Err(invalid_message(
                index,
                "content must be a string, a list or null",
            ))
        }
    };
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let mut texts = Vec::with_capacity(parts.len());
    let mut media_at = None;
    for p in &parts {
        match part(index, p)? {
            Part::Text(Some(text)) => texts.push(text),
            Part::Text(None) => {}
            Part::Media => {
                media_at.get_or_insert(texts.len());
            }
        }
    }
    Ok((texts, media_at))
}

/// One content part as the template will see it.
enum Part {
    /// Text (`None`: a text part without text).
    Text(Option<String>),
    /// An image, audio or video: the engine's placeholder goes here, then tokens kvroute cannot
    /// reproduce (their count depends on the media).
    Media,
}

/// One content part.
fn part(index: usize, part: &Value) -> Result<Part, RequestError> {
    part_text(index, part).map(Part::Text).or_else(|e| match e {
        RequestError::Unsupported(_) if is_media(part) => Ok(Part::Media),
        other => Err(other),
    })
}

/// Whether `part` carries media (by its type, or by a media key for a part without type).
fn is_media(part: &Value) -> bool {
    let Some(obj) = part.as_object() else {
        return false;
    };
    match obj.get("type").and_then(Value::as_str) {
        Some(t) => MEDIA_PART_KEYS.contains(&t),
        None => MEDIA_PART_KEYS.iter().any(|k| obj.contains_key(*k)),
    }
}

/// The text of one content part, `None` for a text part without text.
fn part_text(index: usize, part: &Value) -> Result<Option<String>, RequestError> {
    let obj = match part {
        Value::String(s) => return Ok(Some(s.clone())),
        Value::Object(o) => o,
        _ => {
            return Err(invalid_message(
                index,
                "content parts must be strings or objects",
            ))
        }
    };
    let uuid_set = obj.get("uuid").is_some_and(|v| !v.is_null());
    let part_type = obj.get("type").filter(|v| !v.is_null());
    if part_type.is_none() || uuid_set {
        if MEDIA_PART_KEYS.iter().any(|k| obj.contains_key(*k)) {
            return Err(RequestError::Unsupported("multimodal content parts".into()));
        }
        if obj.contains_key("tool_reference") {
            return Ok(obj.get("name").and_then(Value::as_str).map(str::to_owned));
        }
        return Err(invalid_message(index, "a content part has no \"type\""));
    }
    let part_type = part_type
        .and_then(Value::as_str)
        .ok_or_else(|| invalid_message(index, "a content part's type must be a string"))?;
    if TEXT_PART_TYPES.contains(&part_type) {
        let field = match part_type {
            "refusal" => "refusal",
            "thinking" => "thinking",
            _ => "text",
        };
        return match obj.get(field) {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            None | Some(Value::Null) if part_type == "text" || part_type == "refusal" => Ok(None),
            _ => Err(invalid_message(
                index,
                format!("a \"{part_type}\" part needs a string \"{field}\""),
            )),
        };
    }
    if part_type == "tool_reference" {
        return Ok(obj.get("name").and_then(Value::as_str).map(str::to_owned));
    }
    if MEDIA_PART_KEYS.contains(&part_type) {
        return Err(RequestError::Unsupported(format!(
            "content parts of type \"{part_type}\""
        )));
    }
    Err(invalid_message(
        index,
        format!("unsupported content part type {}", shown_type(part_type)),
    ))
}

/// A client's part `type` for an error message: only its length (the value is the client's and
/// error messages reach logs; prompts never do).
fn shown_type(part_type: &str) -> String {
    format!("(a {}-byte type name)", part_type.len())
}

/// Drops Claude Code's per-request attribution line from system text parts (vLLM does).
fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let text = match &part {
            Value::String(s) => Some(s.as_str()),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("text") => {
                o.get("text").and_then(Value::as_str)
            }
            _ => None,
        };
        let Some(text) = text.filter(|t| t.starts_with(CLAUDE_CODE_BILLING_HEADER)) else {
            out.push(part);
            continue;
        };
        let rest = text.split_once('\n').map(|(_, r)| r).unwrap_or("");
        if rest.is_empty() {
            continue;
        }
        let rest = rest.to_owned();
        out.push(match part {
            Value::Object(mut o) => {
                o.insert("text".into(), Value::String(rest));
                Value::Object(o)
            }
            _ => Value::String(rest),
        });
    }
    out
}

/// vLLM's `_postprocess_messages`.
fn postprocess_tool_calls(messages: &mut [Value]) -> Result<(), RequestError> {
    for (index, message) in messages.iter_mut().enumerate() {
        if role_of(message) != Some("assistant") {
            continue;
        }
        let Some(obj) = message.as_object_mut() else {
            continue;
        };
        let empty = matches!(obj.get("tool_calls"), Some(Value::Array(c)) if c.is_empty());
        if empty {
            obj.shift_remove("tool_calls");
            continue;
        }
        let Some(Value::Array(calls)) = obj.get_mut("tool_calls") else {
            continue;
        };
        for call in calls.iter_mut() {
            let call = call
                .as_object_mut()
                .ok_or_else(|| invalid_message(index, "tool_calls entries must be objects"))?;
            let is_function = match call.get("type") {
                None => true,
                Some(t) => t.as_str() == Some("function"),
            };
            let function =
                match call.get_mut("function") {
                    Some(Value::Object(f)) if is_function => f,
                    _ => return Err(invalid_message(
                        index,
                        "only tool_calls of type \"function\" with a function object are supported",
                    )),
                };
            let parsed = match function.get("arguments") {
                Some(args) if truthy(args) => match args {
                    Value::Object(_) => args.clone(),
                    Value::String(s) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => Value::Object(Map::new()),
                    },
                    _ => Value::Object(Map::new()),
                },
                _ => Value::Object(Map::new()),
            };
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(())
}

/// vLLM's `_convert_developer_to_system` + `_consolidate_system_messages`, for templates that do
/// not know the `developer` role.
fn developer_to_system(messages: Vec<Value>) -> Vec<Value> {
    let converted: Vec<Value> = messages
        .into_iter()
        .map(|mut m| {
            if role_of(&m) == Some("developer") {
                if let Some(o) = m.as_object_mut() {
                    o.insert("role".into(), Value::String("system".into()));
                    o.shift_remove("tools");
                }
            }
            m
        })
        .collect();
    let mut system_contents = Vec::new();
    let mut others = Vec::new();
    let mut needs = false;
    for (i, m) in converted.iter().enumerate() {
        if role_of(m) == Some("system") {
            if i > 0 || !system_contents.is_empty() {
                needs = true;
            }
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| match p {
                        Value::String(s) => Some(s.clone()),
                        Value::Object(o) => {
                            o.get("text").and_then(Value::as_str).map(str::to_owned)
                        }
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            if !content.is_empty() {
                system_contents.push(content);
            }
        } else {
            others.push(m.clone());
        }
    }
    if !needs {
        return converted;
    }
    let mut out =
        vec![serde_json::json!({"role": "system", "content": system_contents.join("\n\n")})];
    out.extend(others);
    out
}

/// transformers: drop keys whose value is `None`, then alias the reasoning as
/// `{"thinking": r, **message, "reasoning_content": r}`.
fn hf_normalise(message: Value) -> Value {
    let Value::Object(mut obj) = message else {
        return message;
    };
    obj.retain(|_, v| !v.is_null());
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| obj.get(*k).filter(|v| !v.is_null()).cloned());
    let Some(reasoning) = reasoning else {
        return Value::Object(obj);
    };
    let mut out = Map::new();
    out.insert("thinking".into(), reasoning.clone());
    for (k, v) in obj {
        out.insert(k, v);
    }
    out.insert("reasoning_content".into(), reasoning);
    Value::Object(out)
}

/// A `/v1/completions` prompt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CompletionPrompt {
    /// One text prompt.
    Text(String),
    /// One prompt given as token ids.
    Ids(Vec<u32>),
    /// Several prompts, each text or ids.
    Batch(Vec<CompletionPrompt>),
}

fn token_ids(items: &[Value]) -> Option<Result<Vec<u32>, RequestError>> {
    if !items.iter().all(Value::is_number) {
        return None;
    }
    Some(
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| RequestError::InvalidField {
                        field: "prompt".into(),
                        reason: "token ids must be integers in 0..2^32".into(),
                    })
            })
            .collect(),
    )
}

/// Reads `add_special_tokens` (default true) from a `/v1/completions` body.
pub(crate) fn completion_add_special_tokens(body: &Value) -> Result<bool, RequestError> {
    opt_bool(body, "add_special_tokens", true)
}

/// Reads `prompt` and `add_special_tokens` (default true) from a `/v1/completions` body.
pub(crate) fn completion_prompt(
    body: &Value,
    opts: &TokenizerOptions,
) -> Result<(CompletionPrompt, bool), RequestError> {
    let obj = body.as_object().ok_or(RequestError::NotAnObject)?;
    let add_special_tokens = completion_add_special_tokens(body)?;
    let invalid = || RequestError::InvalidField {
        field: "prompt".into(),
        reason: "must be a string, a list of token ids, or a list of strings or token-id lists"
            .into(),
    };
    let prompt = match obj.get("prompt") {
        None | Some(Value::Null) => {
            if obj.get("prompt_embeds").is_some_and(|v| !v.is_null()) {
                return Err(RequestError::Unsupported("prompt_embeds".into()));
            }
            return Err(RequestError::MissingField("prompt"));
        }
        Some(Value::String(s)) => CompletionPrompt::Text(s.clone()),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(RequestError::InvalidField {
                    field: "prompt".into(),
                    reason: "must not be an empty list".into(),
                });
            }
            if let Some(ids) = token_ids(items) {
                CompletionPrompt::Ids(ids?)
            } else {
                if items.len() > opts.max_batch_prompts {
                    return Err(RequestError::TooLarge {
                        what: "prompts in a batch",
                        limit: opts.max_batch_prompts,
                    });
                }
                let all_strings = items.iter().all(Value::is_string);
                let all_lists = items.iter().all(Value::is_array);
                if !all_strings && !all_lists {
                    return Err(invalid());
                }
                let mut batch = Vec::with_capacity(items.len());
                for item in items {
                    batch.push(match item {
                        Value::String(s) => CompletionPrompt::Text(s.clone()),
                        Value::Array(ids) => match token_ids(ids) {
                            Some(ids) => CompletionPrompt::Ids(ids?),
                            None => return Err(invalid()),
                        },
                        _ => return Err(invalid()),
                    });
                }
                CompletionPrompt::Batch(batch)
            }
        }
        Some(_) => return Err(invalid()),
    };
    Ok((prompt, add_special_tokens))
}

#[cfg(test)]
mod tests {

    use super::*;
    use serde_json::json;

    #[test]
    fn an_unknown_part_type_is_not_echoed() {
        let secret = "PromptMarker42";
        let shown = shown_type(secret);
        assert!(!shown.contains(secret), "{shown}");
        assert_eq!(shown, "(a 14-byte type name)");
    }

    fn opts() -> TokenizerOptions {
        TokenizerOptions::default()
    }

    #[test]
    fn parts_join_and_tool_calls_parse() {
        let msgs = vec![
            json!({"role": "system", "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": null}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [2]}"}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": "[1]"}}
            ]}),
            json!({"role": "assistant", "content": "x", "tool_calls": []}),
            json!({"role": "assistant", "content": "y", "reasoning_content": "r"}),
        ];
        let out = normalise_messages(&msgs, ChatContentFormat::String, "").expect("valid");
        assert_eq!(out[0], json!({"role": "system", "content": "a\nb"}));
        assert_eq!(out[1]["content"], json!(""));
        assert_eq!(
            serde_json::to_string(&out[1]["tool_calls"][0]["function"]["arguments"]).expect("json"),
            r#"{"z":1,"a":[2]}"#
        );
        assert_eq!(out[1]["tool_calls"][1]["function"]["arguments"], json!({}));
        assert_eq!(out[1]["tool_calls"][2]["function"]["arguments"], json!({}));
        assert_eq!(out[2], json!({"role": "assistant", "content": "x"}));
        assert_eq!(
            out[3]
                .as_object()
                .map(|o| o.keys().cloned().collect::<Vec<_>>()),
            Some(vec![
                "thinking".into(),
                "role".into(),
                "content".into(),
                "reasoning".into(),
                "reasoning_content".into()
            ])
        );
    }

    #[test]
    fn string_content_is_read_as_its_one_text_part() {
        // The string fast path must give what the same text as a one-part list gives.
        let billing = format!("{CLAUDE_CODE_BILLING_HEADER}: x\nkept");
        for role in ["system", "user", "assistant", "tool", "developer"] {
            for text in ["plain", "", billing.as_str(), CLAUDE_CODE_BILLING_HEADER] {
                for format in [ChatContentFormat::String, ChatContentFormat::OpenAi] {
                    let as_string = json!({"role": role, "content": text, "name": "n"});
                    let as_part = json!({"role": role, "content": [{"type": "text", "text": text}], "name": "n"});
                    assert_eq!(
                        normalise_messages(&[as_string], format, "").expect("valid"),
                        normalise_messages(&[as_part], format, "").expect("valid"),
                        "{role} {text:?} {format:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(normalise_messages(&[json!("hi")], ChatContentFormat::String, "").is_err());
        assert!(
            normalise_messages(&[json!({"content": "hi"})], ChatContentFormat::String, "").is_err()
        );
        assert!(normalise_messages(
            &[json!({"role": "user", "content": 3})],
            ChatContentFormat::String,
            ""
        )
        .is_err());
        // Media: the mark stands for the placeholder, before the text in string content (as
        // vLLM places it), in place in OpenAI content.
        let img = json!({"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "here"}
        ]});
        let string = normalise_messages(std::slice::from_ref(&img), ChatContentFormat::String, "")
            .expect("media parts are accepted");
        assert_eq!(
            string[0]["content"],
            format!("{MEDIA_MARK}\nlook\nhere").as_str()
        );
        let parts = normalise_messages(&[img], ChatContentFormat::OpenAi, "").expect("openai");
        let texts: Vec<&str> = parts[0]["content"]
            .as_array()
            .expect("parts")
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect();
        assert_eq!(texts, ["look", MEDIA_MARK, "here"]);
        // A part without type that carries media, too.
        let untyped = json!({"role": "user", "content": [{"image_url": {"url": "x"}}]});
        assert!(normalise_messages(&[untyped], ChatContentFormat::String, "").is_ok());
        assert!(matches!(
            chat_request(&json!({"model": "m"}), &opts()),
            Err(RequestError::MissingField("messages"))
        ));
        assert!(matches!(
            chat_request(&json!({"messages": [], "chat_template": "x"}), &opts()),
            Err(RequestError::UntrustedChatTemplate)
        ));
        assert!(chat_request(
            &json!({"messages": [], "continue_final_message": true}),
            &opts()
        )
        .is_err());
    }

    #[test]
    fn kwargs_merge_like_vllm() {
        let body = json!({"messages": [], "reasoning_effort": "low",
            "chat_template_kwargs": {"foo": 1, "bar": "auto", "add_generation_prompt": false}});
        let r = chat_request(&body, &opts()).expect("valid");
        assert!(
            r.add_generation_prompt,
            "top-level value overrides the kwargs"
        );
        assert_eq!(r.kwargs.get("enable_thinking"), Some(&json!(true)));
        assert_eq!(r.kwargs.get("foo"), Some(&json!(1)));
        assert!(!r.kwargs.contains_key("bar"), "\"auto\" is unset");
        let body = json!({"messages": [], "tools": [{"function": {"name": "f"}}]});
        let r = chat_request(&body, &opts()).expect("valid");
        assert_eq!(
            r.tools,
            Some(
                json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}])
            )
        );
    }

    #[test]
    fn completion_prompt_shapes() {
        let p = |b: Value| completion_prompt(&b, &opts());
        assert_eq!(
            p(json!({"prompt": "hi"})).expect("ok"),
            (CompletionPrompt::Text("hi".into()), true)
        );
        assert_eq!(
            p(json!({"prompt": [1, 2], "add_special_tokens": false})).expect("ok"),
            (CompletionPrompt::Ids(vec![1, 2]), false)
        );
        assert_eq!(
            p(json!({"prompt": [[1], [2, 3]]})).expect("ok").0,
            CompletionPrompt::Batch(vec![
                CompletionPrompt::Ids(vec![1]),
                CompletionPrompt::Ids(vec![2, 3])
            ])
        );
        assert!(p(json!({"prompt": [1, "a"]})).is_err());
        assert!(p(json!({"prompt": [-1]})).is_err());
        assert!(p(json!({"prompt": []})).is_err());
        assert!(p(json!({})).is_err());
        assert!(p(json!({"prompt": 5})).is_err());
    }

    #[test]
    fn content_format_detection() {
        assert_eq!(
            detect_content_format("{{ message.content }}"),
            ChatContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
            ),
            ChatContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{%- for c in message.content %}{{ c }}{% endfor %}"),
            ChatContentFormat::OpenAi
        );
    }
}
