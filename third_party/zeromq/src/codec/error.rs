use thiserror::Error;

/// Represents an error when encoding/decoding raw byte buffers and frames
#[non_exhaustive]
#[derive(Error, Debug)]
pub enum CodecError {
    #[error("{0}")]
    Command(&'static str),
    #[error("{0}")]
    Greeting(&'static str),
    #[error("{0}")]
    Mechanism(&'static str),
    #[error("{0}")]
    Decode(&'static str),
    /// A peer announced a frame or message larger than [`SocketOptions::max_message_size`]
    /// (checked before anything is allocated for it). The peer is disconnected.
    ///
    /// [`SocketOptions::max_message_size`]: crate::SocketOptions::max_message_size
    #[error("message of at least {size} bytes exceeds the maximum message size of {max} bytes")]
    MessageTooLarge {
        /// Bytes announced so far: the frame's length plus the earlier frames of its message.
        size: u64,
        /// The configured maximum.
        max: usize,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(&'static str),
}

pub(crate) type CodecResult<T> = Result<T, CodecError>;
