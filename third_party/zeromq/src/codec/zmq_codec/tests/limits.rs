use super::*;

const MAX_READ_CHUNK_SIZE: usize = 64 * 1024;

fn codec_with_max(max: Option<usize>) -> ZmqCodec {
    let mut options = SocketOptions::default();
    if let Some(max) = max {
        options.max_message_size(max);
    }
    let mut codec = ZmqCodec::with_options(&options);
    codec.state = DecoderState::FrameHeader;
    codec.waiting_for = 1;
    codec
}

fn long_header(flags: u8, len: u64) -> BytesMut {
    let mut header = BytesMut::from(&[flags | 0b0000_0010][..]);
    header.extend_from_slice(&len.to_be_bytes());
    header
}

#[test]
fn an_announced_frame_over_the_maximum_is_refused_before_reserving() {
    let mut codec = codec_with_max(Some(1024 * 1024));
    let mut input = long_header(0, 1 << 62);
    let capacity = input.capacity();
    let error = codec.decode(&mut input).unwrap_err();
    assert!(
        matches!(error, CodecError::MessageTooLarge { size, max } if size == 1 << 62 && max == 1024 * 1024),
        "{error:?}"
    );
    assert!(input.capacity() <= capacity);
}

#[test]
fn a_frame_of_exactly_the_maximum_is_accepted() {
    let mut codec = codec_with_max(Some(300));
    let mut input = long_header(0, 300);
    input.extend_from_slice(&[7; 300]);
    let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
        panic!("expected a message");
    };
    assert_eq!(message.get(0).unwrap().len(), 300);
}

#[test]
fn the_frames_of_one_message_count_together() {
    let mut codec = codec_with_max(Some(1000));
    // 600 bytes with MORE, then a frame announcing 401: 1001 in total.
    let mut input = long_header(0b0000_0001, 600);
    input.extend_from_slice(&[1; 600]);
    input.extend_from_slice(&long_header(0, 401));
    let error = codec.decode(&mut input).unwrap_err();
    assert!(
        matches!(error, CodecError::MessageTooLarge { size: 1001, max: 1000 }),
        "{error:?}"
    );
}

#[test]
fn the_total_starts_again_with_each_message() {
    let mut codec = codec_with_max(Some(1000));
    let mut input = BytesMut::new();
    for _ in 0..3 {
        input.extend_from_slice(&long_header(0b0000_0001, 500));
        input.extend_from_slice(&[1; 500]);
        input.extend_from_slice(&long_header(0, 500));
        input.extend_from_slice(&[2; 500]);
    }
    for _ in 0..3 {
        let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
            panic!("expected a message");
        };
        assert_eq!(message.len(), 2);
    }
}

#[test]
fn a_command_frame_over_the_maximum_is_refused() {
    let mut codec = codec_with_max(Some(1000));
    let mut input = long_header(0b0000_0100, 1001);
    let error = codec.decode(&mut input).unwrap_err();
    assert!(
        matches!(error, CodecError::MessageTooLarge { size: 1001, max: 1000 }),
        "{error:?}"
    );
}

#[test]
fn without_a_maximum_an_announced_length_is_not_reserved_before_it_arrives() {
    // Announcing 4 EiB used to reserve it up front and abort the process.
    let mut codec = codec_with_max(None);
    let mut input = long_header(0, 1 << 62);
    assert!(codec.decode(&mut input).unwrap().is_none());
    assert!(input.capacity() <= 2 * MAX_READ_CHUNK_SIZE + 16);
    // The reservation grows with the bytes received, a couple of read chunks ahead.
    input.resize(5 * MAX_READ_CHUNK_SIZE, 7);
    assert!(codec.decode(&mut input).unwrap().is_none());
    assert!(input.capacity() >= 7 * MAX_READ_CHUNK_SIZE);
    assert!(input.capacity() <= 14 * MAX_READ_CHUNK_SIZE);
}

#[test]
fn a_large_frame_still_decodes_when_it_arrives_in_read_chunks() {
    let frame_len = 10 * MAX_READ_CHUNK_SIZE + 3;
    let mut codec = codec_with_max(Some(frame_len));
    let mut input = long_header(0, frame_len as u64);
    assert!(codec.decode(&mut input).unwrap().is_none());
    let mut sent = 0;
    let message = loop {
        let n = MAX_READ_CHUNK_SIZE.min(frame_len - sent);
        input.extend_from_slice(&vec![9; n]);
        sent += n;
        if let Some(message) = codec.decode(&mut input).unwrap() {
            break message;
        }
    };
    let Message::Message(message) = message else {
        panic!("expected a message");
    };
    assert_eq!(message.get(0).unwrap().len(), frame_len);
    assert!(message.get(0).unwrap().iter().all(|&b| b == 9));
}
