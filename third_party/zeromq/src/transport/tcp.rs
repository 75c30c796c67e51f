use std::sync::Arc;

#[cfg(feature = "tokio-runtime")]
use tokio::net::{TcpListener, TcpStream};

#[cfg(any(feature = "async-std-runtime", feature = "async-dispatcher-runtime"))]
use async_std::net::{TcpListener, TcpStream};

use super::make_framed;
use super::AcceptStopHandle;
use crate::async_rt;
use crate::codec::FramedIo;
use crate::endpoint::{Endpoint, Host, Port};
use crate::task_handle::TaskHandle;
use crate::ZmqResult;

use futures::{select, FutureExt};

#[cfg(feature = "tokio-runtime")]
const TCP_SOCKET_BUFFER_SIZE: usize = 4 * 1024 * 1024;

pub(crate) async fn connect(
    host: &Host,
    port: Port,
    options: Arc<crate::SocketOptions>,
) -> ZmqResult<(FramedIo, Endpoint)> {
    let raw_socket = TcpStream::connect((host.to_string().as_str(), port)).await?;
    // For some reason set_nodelay doesn't work on windows. See
    // https://github.com/zeromq/zmq.rs/issues/148 for details
    #[cfg(not(windows))]
    raw_socket.set_nodelay(true)?;
    tune_socket_buffers(&raw_socket);
    let peer_addr = raw_socket.peer_addr()?;

    Ok((
        make_framed(raw_socket, options),
        Endpoint::from_tcp_addr(peer_addr),
    ))
}

pub(crate) async fn begin_accept<T>(
    host: Host,
    port: Port,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind((host.to_string().as_str(), port)).await?;
    let resolved_addr = listener.local_addr()?;
    debug_assert_ne!(resolved_addr.port(), 0);
    let endpoint = Endpoint::Tcp(host, resolved_addr.port());
    begin_accept_bound(listener, endpoint, options, cback).await
}

pub(crate) async fn begin_accept_listener<T>(
    listener: std::net::TcpListener,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let resolved_addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;

    #[cfg(feature = "tokio-runtime")]
    let listener = TcpListener::from_std(listener)?;
    #[cfg(any(feature = "async-std-runtime", feature = "async-dispatcher-runtime"))]
    let listener = TcpListener::from(listener);

    begin_accept_bound(
        listener,
        Endpoint::from_tcp_addr(resolved_addr),
        options,
        cback,
    )
    .await
}

async fn begin_accept_bound<T>(
    listener: TcpListener,
    endpoint: Endpoint,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let (stop_channel, stop_callback) = futures::channel::oneshot::channel::<()>();
    let task_handle = async_rt::task::spawn(async move {
        let mut stop_callback = stop_callback.fuse();
        loop {
            select! {
                incoming = listener.accept().fuse() => {
                    if let Ok((_, remote_addr)) = &incoming {
                        if !options.accepts(*remote_addr) {
                            // Dropping the stream closes it before any handshake.
                            log::debug!("accept filter refused a connection from {remote_addr}");
                            continue;
                        }
                    }
                    let maybe_accepted: Result<_, _> = incoming
                        .and_then(|(raw_socket, remote_addr)| {
                            raw_socket
                                .set_nodelay(true)
                                .map(|_| {
                                    tune_socket_buffers(&raw_socket);
                                    (raw_socket, remote_addr)
                                })
                        })
                        .map(|(raw_socket, remote_addr)| {
                            (
                                make_framed(raw_socket, Arc::clone(&options)),
                                Endpoint::from_tcp_addr(remote_addr),
                            )
                        })
                        .map_err(|err| err.into());
                    async_rt::task::spawn(cback(maybe_accepted));
                }
                _ = stop_callback => {
                    break
                }
            }
        }
        Ok(())
    });
    Ok((
        endpoint,
        AcceptStopHandle(TaskHandle::new(stop_channel, task_handle)),
    ))
}

#[cfg(feature = "tokio-runtime")]
fn tune_socket_buffers(raw_socket: &TcpStream) {
    let socket = socket2::SockRef::from(raw_socket);
    if let Err(error) = socket.set_recv_buffer_size(TCP_SOCKET_BUFFER_SIZE) {
        log::debug!("failed to set TCP receive buffer size: {error}");
    }
    if let Err(error) = socket.set_send_buffer_size(TCP_SOCKET_BUFFER_SIZE) {
        log::debug!("failed to set TCP send buffer size: {error}");
    }
}

#[cfg(not(feature = "tokio-runtime"))]
fn tune_socket_buffers(_raw_socket: &TcpStream) {}

#[cfg(all(test, feature = "tokio-runtime"))]
mod tests {
    use crate::{CodecError, Socket, SocketOptions, SocketRecv, SubSocket, ZmqError};

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const GREETING_AND_READY: &[u8] = &[
        0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0, b'N', b'U', b'L', b'L', 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // greeting, NULL mechanism
        0x04, 25, 5, b'R', b'E', b'A', b'D', b'Y', 11, b'S', b'o', b'c', b'k', b'e', b't', b'-',
        b'T', b'y', b'p', b'e', 0, 0, 0, 3, b'P', b'U', b'B', // READY, Socket-Type PUB
    ];

    async fn bound_sub(options: SocketOptions) -> (SubSocket, u16) {
        let mut socket = SubSocket::with_options(options);
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap();
        let crate::Endpoint::Tcp(_, port) = endpoint else {
            panic!("not tcp");
        };
        (socket, port)
    }

    #[crate::async_rt::test]
    async fn accept_filter_closes_refused_peers_before_the_handshake() {
        let seen = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&seen);
        let mut options = SocketOptions::default();
        options.accept_filter(Arc::new(move |peer| {
            counter.fetch_add(1, Ordering::Relaxed);
            peer.ip() != std::net::Ipv4Addr::LOCALHOST
        }));
        let (_socket, port) = bound_sub(options).await;
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let _ = stream.write_all(GREETING_AND_READY).await;
        let mut buffer = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
            .await
            .expect("refused connection stays open");
        assert_eq!(read.unwrap_or(0), 0, "a refused peer received a greeting");
        assert_eq!(seen.load(Ordering::Relaxed), 1);
    }

    #[crate::async_rt::test]
    async fn accept_filter_admits_allowed_peers() {
        let mut options = SocketOptions::default();
        options.accept_filter(Arc::new(|peer| peer.ip().is_loopback()));
        let (_socket, port) = bound_sub(options).await;
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut greeting = [0u8; 64];
        tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut greeting))
            .await
            .expect("no greeting")
            .unwrap();
        assert_eq!((greeting[0], greeting[9]), (0xff, 0x7f));
    }

    #[crate::async_rt::test]
    async fn max_message_size_disconnects_a_peer_announcing_a_huge_frame() {
        let mut options = SocketOptions::default();
        options.max_message_size(1024 * 1024);
        let (mut socket, port) = bound_sub(options).await;
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        stream.write_all(GREETING_AND_READY).await.unwrap();
        // A message frame header announcing 2^62 bytes, none of which follow.
        let mut header = vec![0x02];
        header.extend_from_slice(&(1u64 << 62).to_be_bytes());
        stream.write_all(&header).await.unwrap();
        let result = tokio::time::timeout(Duration::from_secs(10), socket.recv())
            .await
            .expect("recv hung");
        assert!(
            matches!(
                result,
                Err(ZmqError::Codec(CodecError::MessageTooLarge { size, max: 1_048_576 }))
                    if size == 1 << 62
            ),
            "{result:?}"
        );
    }
}
