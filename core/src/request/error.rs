//! Why a request could not be turned into tokens.

/// Why a request could not be turned into tokens. Messages never contain prompt text.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is not valid JSON.
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an object.
    #[error("request body must be a JSON object")]
    NotAnObject,
    /// A required field is absent.
    #[error("request body has no \"{0}\"")]
    MissingField(&'static str),
    /// A field has the wrong shape.
    #[error("invalid \"{field}\": {reason}")]
    InvalidField {
        /// The field's name.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A chat message has the wrong shape.
    #[error("invalid message {index}: {reason}")]
    InvalidMessage {
        /// Position in `messages`.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The request exceeds a configured bound.
    #[error("too many {what} (limit {limit})")]
    TooLarge {
        /// What was counted.
        what: &'static str,
        /// The configured limit.
        limit: usize,
    },
    /// The prompt is longer than the token cap (the model's context): the engine refuses it.
    #[error("the prompt is longer than {limit} tokens")]
    PromptTooLong {
        /// The cap.
        limit: usize,
    },
    /// Valid for vLLM, but kvroute cannot reproduce its tokens (e.g. images).
    #[error("unsupported by kvroute: {0}")]
    Unsupported(String),
    /// The request carries its own chat template and the options do not trust request templates
    /// (vLLM's default without `--trust-request-chat-template`).
    #[error("the request carries a chat template but request chat templates are not trusted")]
    UntrustedChatTemplate,
    /// The model has no chat template.
    #[error("the model has no chat template (tokenizer_config.json has no \"chat_template\")")]
    NoChatTemplate,
    /// The chat template failed to compile or render (including `raise_exception`).
    #[error("chat template error: {0}")]
    Template(String),
    /// The tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The model files are missing or malformed.
    #[error("model files: {0}")]
    ModelFiles(String),
}
