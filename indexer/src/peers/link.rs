//! The two connections to the peers' Redis/Valkey: one publishing this indexer's queued messages,
//! one subscribed to the channel. Each reconnects with exponential backoff when the server is
//! down or a command fails or times out; neither is ever awaited by a routing decision.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use redis::aio::{MultiplexedConnection, PubSub};
use redis::{AsyncConnectionConfig, ConnectionAddr, IntoConnectionInfo};
use tokio::time::timeout;

use super::{PeerLink, PeersSection};
use crate::state::AppState;

/// How often an idle subscription is pinged to notice a dead server.
const PING_EVERY: Duration = Duration::from_secs(5);

/// Starts the publisher and the subscriber (no-op without `[peers]`).
pub fn spawn(state: &Arc<AppState>) {
    let Some(link) = &state.peers else {
        return;
    };
    let client = match client(&link.cfg) {
        Ok(c) => c,
        Err(e) => {
            link.stats.error(format!("redis client: {e}"));
            tracing::error!(error = %e, "peers: cannot build the Redis client; not sharing");
            return;
        }
    };
    tracing::info!(redis = %link.cfg.redis, channel = %link.cfg.channel, origin = format!("{:016x}", link.origin), "peers: sharing decisions");
    tokio::spawn(publisher(state.clone(), client.clone()));
    tokio::spawn(subscriber(state.clone(), client));
}

fn client(cfg: &PeersSection) -> redis::RedisResult<redis::Client> {
    let (host, port) = cfg
        .redis
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        .ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "peers.redis is not host:port",
            ))
        })?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let info = ConnectionAddr::Tcp(host.to_string(), port).into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &cfg.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = cfg.password() {
        settings = settings.set_password(password);
    }
    redis::Client::open(info.set_redis_settings(settings))
}

/// Exponential backoff between reconnects.
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(cfg: &PeersSection) -> Self {
        let initial = Duration::from_millis(cfg.retry_initial_ms);
        Self {
            initial,
            max: Duration::from_millis(cfg.retry_max_ms),
            next: initial,
        }
    }

    fn reset(&mut self) {
        self.next = self.initial;
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }
}

async fn connect(link: &PeerLink, client: &redis::Client) -> Result<MultiplexedConnection, String> {
    let t = Duration::from_millis(link.cfg.timeout_ms);
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(t))
        .set_response_timeout(Some(t));
    match timeout(
        t * 2,
        client.get_multiplexed_async_connection_with_config(&cfg),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("connect timed out".into()),
    }
}

/// Publishes queued messages while connected; drops (and counts) what queued while it was not.
async fn publisher(state: Arc<AppState>, client: redis::Client) {
    let Some(link) = &state.peers else {
        return;
    };
    let Some(mut rx) = link.take_rx() else {
        return;
    };
    let stats = &link.stats;
    let t = Duration::from_millis(link.cfg.timeout_ms);
    let mut backoff = Backoff::new(&link.cfg);
    loop {
        match connect(link, &client).await {
            Ok(mut conn) => {
                stats.publisher_up.store(true, Ordering::Relaxed);
                backoff.reset();
                tracing::info!(redis = %link.cfg.redis, "peers: publishing");
                loop {
                    let Some(bytes) = rx.recv().await else {
                        return;
                    };
                    let sent = timeout(
                        t,
                        redis::cmd("PUBLISH")
                            .arg(&link.cfg.channel)
                            .arg(bytes)
                            .query_async::<i64>(&mut conn),
                    )
                    .await;
                    match sent {
                        Ok(Ok(_)) => {
                            stats.published.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Err(e)) => {
                            stats.dropped_disconnected.fetch_add(1, Ordering::Relaxed);
                            stats.error(format!("publish: {e}"));
                            break;
                        }
                        Err(_) => {
                            stats.dropped_disconnected.fetch_add(1, Ordering::Relaxed);
                            stats.error("publish timed out".into());
                            break;
                        }
                    }
                }
                stats.publisher_up.store(false, Ordering::Relaxed);
                tracing::warn!(redis = %link.cfg.redis, "peers: publishing connection lost; routing on local decisions");
            }
            Err(e) => {
                stats.error(format!("connect: {e}"));
                tracing::debug!(error = %e, "peers: publisher cannot connect");
            }
        }
        while rx.try_recv().is_ok() {
            stats.dropped_disconnected.fetch_add(1, Ordering::Relaxed);
        }
        backoff.wait().await;
    }
}

async fn subscribe(link: &PeerLink, client: &redis::Client) -> Result<PubSub, String> {
    let t = Duration::from_millis(link.cfg.timeout_ms);
    let mut pubsub = match timeout(t * 2, client.get_async_pubsub()).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("connect timed out".into()),
    };
    match timeout(t, pubsub.subscribe(&link.cfg.channel)).await {
        Ok(Ok(())) => Ok(pubsub),
        Ok(Err(e)) => Err(format!("subscribe: {e}")),
        Err(_) => Err("subscribe timed out".into()),
    }
}

/// Applies peers' messages while subscribed; pings an idle subscription.
async fn subscriber(state: Arc<AppState>, client: redis::Client) {
    let Some(link) = &state.peers else {
        return;
    };
    let stats = &link.stats;
    let t = Duration::from_millis(link.cfg.timeout_ms);
    let mut backoff = Backoff::new(&link.cfg);
    loop {
        match subscribe(link, &client).await {
            Ok(pubsub) => {
                stats.subscriber_up.store(true, Ordering::Relaxed);
                backoff.reset();
                tracing::info!(redis = %link.cfg.redis, "peers: subscribed");
                let (mut sink, mut stream) = pubsub.split();
                let mut ping = tokio::time::interval(PING_EVERY);
                ping.tick().await;
                loop {
                    tokio::select! {
                        msg = stream.next() => match msg {
                            Some(msg) => super::apply_message(&state, msg.get_payload_bytes()),
                            None => {
                                stats.error("subscription closed".into());
                                break;
                            }
                        },
                        _ = ping.tick() => {
                            if !matches!(timeout(t, sink.ping::<redis::Value>()).await, Ok(Ok(_))) {
                                stats.error("ping failed".into());
                                break;
                            }
                        }
                    }
                }
                stats.subscriber_up.store(false, Ordering::Relaxed);
                tracing::warn!(redis = %link.cfg.redis, "peers: subscription lost; routing on local decisions");
            }
            Err(e) => {
                stats.error(format!("subscribe: {e}"));
                tracing::debug!(error = %e, "peers: subscriber cannot connect");
            }
        }
        backoff.wait().await;
    }
}
