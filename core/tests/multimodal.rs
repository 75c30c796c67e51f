//! Chats with images on the real Qwen3 tokenizer and chat template: the prompt is known up to the
//! first media placeholder, and those tokens are exactly the engine's (vLLM renders the same chat
//! with the model's placeholder text where kvroute cuts).

use kvroute_core::request::{Endpoint, ModelFiles, ModelTokenizer, PromptTokens, TokenizerOptions};
use serde_json::{json, Value};

fn tokenizer() -> ModelTokenizer {
    let dir = kvroute_testkit::paths::model_dir();
    let read = |f: &str| std::fs::read(dir.join(f)).expect("model file");
    let files = ModelFiles {
        tokenizer_json: read("tokenizer.json"),
        tokenizer_config_json: read("tokenizer_config.json"),
    };
    ModelTokenizer::from_files(&files, TokenizerOptions::default()).expect("Qwen3 loads")
}

/// Qwen's image placeholder: what vLLM's processor puts in a string-content message for an image
/// (before the message's text, one line each), later expanded into the image's tokens.
const PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

const SYSTEM: &str = "You are a careful assistant who describes pictures in detail. \
                      Answer in full sentences and mention colours, shapes and any text you see.";

fn conversation(last_user: Value) -> Value {
    json!({"model": "qwen3", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello, I will send you a few photos of my garden today."},
        {"role": "assistant", "content": "Sure, send them and I will describe each one."},
        {"role": "user", "content": last_user}
    ]})
}

#[test]
fn a_chat_with_an_image_is_known_up_to_its_placeholder_exactly() {
    let tk = tokenizer();
    let with_image = conversation(json!([
        {"type": "text", "text": "What is in this one?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    ]));
    let PromptTokens::Partial(known) = tk
        .tokenize_request(Endpoint::ChatCompletions, &with_image)
        .expect("a chat with an image is prepared")
    else {
        panic!("expected a partial prompt");
    };
    // What the engine tokenises: the placeholder first in the message's content, then the text.
    let engine = conversation(json!(format!("{PLACEHOLDER}\nWhat is in this one?")));
    let PromptTokens::Single(full) = tk
        .tokenize_request(Endpoint::ChatCompletions, &engine)
        .expect("text chat")
    else {
        panic!("expected one prompt");
    };
    let vision_start = tk.token_to_id("<|vision_start|>").expect("Qwen has it");
    let at = full
        .iter()
        .position(|&t| t == vision_start)
        .expect("the placeholder is in the engine's prompt");
    assert_eq!(
        known.as_slice(),
        &full[..known.len()],
        "a prefix of the engine's tokens"
    );
    assert_eq!(
        known.len() + 1,
        at,
        "everything before the placeholder but its last token"
    );
    assert!(
        known.len() > 64,
        "the earlier turns are known: {} tokens",
        known.len()
    );
}

#[test]
fn the_first_media_part_cuts_even_in_an_earlier_turn_and_text_chats_are_whole() {
    let tk = tokenizer();
    let mut body = conversation(json!("And this one?"));
    body["messages"][1]["content"] = json!([
        {"type": "text", "text": "First photo:"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    ]);
    let Ok(PromptTokens::Partial(known)) = tk.tokenize_request(Endpoint::ChatCompletions, &body)
    else {
        panic!("expected a partial prompt");
    };
    let PromptTokens::Single(system_only) = tk
        .tokenize_request(
            Endpoint::ChatCompletions,
            &json!({"model": "qwen3", "messages": [{"role": "system", "content": SYSTEM}],
                    "add_generation_prompt": false}),
        )
        .expect("system")
    else {
        panic!("expected one prompt");
    };
    // The system turn and the user turn's header, nothing of its content.
    assert_eq!(&known[..system_only.len()], system_only.as_slice());
    assert!(known.len() < system_only.len() + 8, "{}", known.len());
    // Without media the same chat is a whole prompt.
    assert!(matches!(
        tk.tokenize_request(Endpoint::ChatCompletions, &conversation(json!("Hi"))),
        Ok(PromptTokens::Single(_))
    ));
}
