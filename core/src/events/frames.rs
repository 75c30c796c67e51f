//! The ZeroMQ frame layouts of vLLM's KV event stream (`vllm/distributed/kv_events.py`): the live
//! PUB message, the replay request a DEALER sends to the engine's ROUTER, the replies and the
//! end-of-replay marker. Pure: frames in, frames out; sockets, identities and payload decoding are
//! the caller's. Generic over the frame type (`Vec<u8>`, `bytes::Bytes`, ...), so decoding borrows
//! the caller's frames and encoding builds its type.

/// The sequence number of the end-of-replay marker: eight `ff` bytes (vLLM writes -1).
pub const END_OF_REPLAY: u64 = u64::MAX;

/// A malformed message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The message has a frame count its layout does not allow.
    #[error("{what} with {count} frames")]
    FrameCount {
        /// Which layout ("live message", "replay reply", "replay request").
        what: &'static str,
        /// The frames it had.
        count: usize,
    },
    /// A sequence frame that is not 8 bytes.
    #[error("sequence frame is not 8 bytes ({0} bytes)")]
    SeqLength(usize),
}

/// One batch as carried by a live message or a replay reply, borrowed from its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchFrames<F> {
    /// The topic frame, when the layout has one.
    pub topic: Option<F>,
    /// The batch's sequence number.
    pub seq: u64,
    /// The msgpack payload (see [`super::decode_batch`]).
    pub payload: F,
}

/// A replay reply: a batch, or the end marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<F> {
    /// A buffered batch.
    Batch(BatchFrames<F>),
    /// The end-of-replay marker ([`END_OF_REPLAY`]).
    End,
}

/// The 8-byte big-endian frame of a sequence number.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Parses a sequence frame (8 bytes, big-endian).
pub fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let arr: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(arr))
}

fn seq_of<F: From<Vec<u8>>>(seq: u64) -> F {
    F::from(seq_frame(seq).to_vec())
}

fn empty<F: From<Vec<u8>>>() -> F {
    F::from(Vec::new())
}

/// A live PUB message: `[topic, seq, payload]`.
pub fn encode_live<F: From<Vec<u8>>>(topic: F, seq: u64, payload: F) -> Vec<F> {
    vec![topic, seq_of(seq), payload]
}

/// Reads a live message: `[topic, seq, payload]`, or `[seq, payload]` (a publisher without topic
/// frame).
pub fn decode_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<BatchFrames<&F>, FrameError> {
    let (topic, seq, payload) = match frames {
        [topic, seq, payload] => (Some(topic), seq, payload),
        [seq, payload] => (None, seq, payload),
        _ => {
            return Err(FrameError::FrameCount {
                what: "live message",
                count: frames.len(),
            })
        }
    };
    Ok(BatchFrames {
        topic,
        seq: parse_seq(seq.as_ref())?,
        payload,
    })
}

/// The replay request a DEALER sends: `[b"", start_seq]` (the engine replays every buffered
/// batch with seq >= `start`).
pub fn encode_replay_request<F: From<Vec<u8>>>(start: u64) -> Vec<F> {
    vec![empty(), seq_of(start)]
}

/// Reads a replay request as the ROUTER sees it after the peer identity: `[delimiter, start_seq]`.
/// The delimiter's content is not checked (vLLM does not either).
pub fn decode_replay_request<F: AsRef<[u8]>>(frames: &[F]) -> Result<u64, FrameError> {
    match frames {
        [_, start] => parse_seq(start.as_ref()),
        _ => Err(FrameError::FrameCount {
            what: "replay request",
            count: frames.len(),
        }),
    }
}

/// One replay reply as the ROUTER sends it after the peer identity: `[b"", topic, seq, payload]`
/// (vLLM >= 0.26), or `[b"", seq, payload]` when `topic` is `None` (<= 0.25).
pub fn encode_replay_reply<F: From<Vec<u8>>>(topic: Option<F>, seq: u64, payload: F) -> Vec<F> {
    let mut frames = vec![empty()];
    frames.extend(topic);
    frames.push(seq_of(seq));
    frames.push(payload);
    frames
}

/// The end-of-replay marker after the peer identity: `[b"", b"", ff*8, b""]`, or
/// `[b"", ff*8, b""]` for the topic-less layout.
pub fn encode_replay_end<F: From<Vec<u8>>>(with_topic: bool) -> Vec<F> {
    let mut frames = vec![empty()];
    if with_topic {
        frames.push(empty());
    }
    frames.push(seq_of(END_OF_REPLAY));
    frames.push(empty());
    frames
}

/// Reads a replay reply as a DEALER receives it: either layout of [`encode_replay_reply`] or
/// [`encode_replay_end`]. A leading empty delimiter is dropped when at least 3 frames came;
/// then `[topic, seq, payload]` or `[seq, payload]`.
pub fn decode_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply<&F>, FrameError> {
    let rest = match frames {
        [first, rest @ ..] if rest.len() >= 2 && first.as_ref().is_empty() => rest,
        _ => frames,
    };
    let (topic, seq, payload) = match rest {
        [topic, seq, payload] => (Some(topic), seq, payload),
        [seq, payload] => (None, seq, payload),
        _ => {
            return Err(FrameError::FrameCount {
                what: "replay reply",
                count: rest.len(),
            })
        }
    };
    let seq = parse_seq(seq.as_ref())?;
    if seq == END_OF_REPLAY {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch(BatchFrames {
        topic,
        seq,
        payload,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    type Frames = Vec<Vec<u8>>;

    fn f(parts: &[&[u8]]) -> Frames {
        parts.iter().map(|p| p.to_vec()).collect()
    }

    #[test]
    fn live_layout_is_topic_seq_payload() {
        let frames: Frames = encode_live(b"kv".to_vec(), 258, b"pl".to_vec());
        assert_eq!(frames, f(&[b"kv", &[0, 0, 0, 0, 0, 0, 1, 2], b"pl"]));
        let live = decode_live(&frames).expect("decodes");
        assert_eq!(live.topic.map(|t| &t[..]), Some(&b"kv"[..]));
        assert_eq!((live.seq, &live.payload[..]), (258, &b"pl"[..]));
        let bare = decode_live(&frames[1..]).expect("topic-less");
        assert_eq!((bare.topic, bare.seq), (None, 258));
    }

    #[test]
    fn malformed_live_messages_are_typed_errors() {
        for n in [0, 1, 4] {
            let frames = vec![seq_frame(1).to_vec(); n];
            assert_eq!(
                decode_live(&frames),
                Err(FrameError::FrameCount {
                    what: "live message",
                    count: n
                })
            );
        }
        let short = f(&[b"kv", &[0, 1], b"pl"]);
        assert_eq!(decode_live(&short), Err(FrameError::SeqLength(2)));
        let long = f(&[&[0; 9], b"pl"]);
        assert_eq!(decode_live(&long), Err(FrameError::SeqLength(9)));
    }

    #[test]
    fn replay_request_is_delimiter_and_start() {
        let frames: Frames = encode_replay_request(7);
        assert_eq!(frames, f(&[b"", &[0, 0, 0, 0, 0, 0, 0, 7]]));
        assert_eq!(decode_replay_request(&frames), Ok(7));
        assert_eq!(
            decode_replay_request(&frames[1..]),
            Err(FrameError::FrameCount {
                what: "replay request",
                count: 1
            })
        );
        assert_eq!(
            decode_replay_request(&f(&[b"", &[7]])),
            Err(FrameError::SeqLength(1))
        );
    }

    #[test]
    fn replay_replies_in_both_layouts() {
        let with: Frames = encode_replay_reply(Some(b"kv".to_vec()), 3, b"pl".to_vec());
        assert_eq!(with, f(&[b"", b"kv", &seq_frame(3), b"pl"]));
        let without: Frames = encode_replay_reply(None, 3, b"pl".to_vec());
        assert_eq!(without, f(&[b"", &seq_frame(3), b"pl"]));
        for frames in [&with, &without] {
            match decode_replay_reply(frames) {
                Ok(ReplayReply::Batch(b)) => assert_eq!((b.seq, &b.payload[..]), (3, &b"pl"[..])),
                other => panic!("{other:?}"),
            }
        }
        // A reply whose first frame is not empty keeps it (as the topic).
        let no_delim = f(&[b"kv", &seq_frame(4), b"pl"]);
        assert!(matches!(
            decode_replay_reply(&no_delim),
            Ok(ReplayReply::Batch(BatchFrames { seq: 4, topic: Some(t), .. })) if &t[..] == b"kv"
        ));
    }

    #[test]
    fn end_marker_in_both_layouts() {
        let with: Frames = encode_replay_end(true);
        assert_eq!(with, f(&[b"", b"", &[0xff; 8], b""]));
        let without: Frames = encode_replay_end(false);
        assert_eq!(without, f(&[b"", &[0xff; 8], b""]));
        assert_eq!(decode_replay_reply(&with), Ok(ReplayReply::End));
        assert_eq!(decode_replay_reply(&without), Ok(ReplayReply::End));
    }

    #[test]
    fn malformed_replay_replies_are_typed_errors() {
        assert_eq!(
            decode_replay_reply(&f(&[b"", b"kv", &seq_frame(1), b"pl", b"x"])),
            Err(FrameError::FrameCount {
                what: "replay reply",
                count: 4
            })
        );
        assert_eq!(
            decode_replay_reply(&f(&[b""])),
            Err(FrameError::FrameCount {
                what: "replay reply",
                count: 1
            })
        );
        assert_eq!(
            decode_replay_reply(&f(&[b"", &[1, 2, 3], b"pl"])),
            Err(FrameError::SeqLength(3))
        );
    }
}
