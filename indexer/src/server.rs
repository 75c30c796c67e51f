//! `kvroute-indexer serve`: builds the state, restores the snapshot, starts one subscriber per
//! replica stream, the scraper and the snapshot writer, and serves the HTTP API until SIGINT or
//! SIGTERM (then writes a final snapshot).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;

use crate::config::Config;
use crate::policies::Policy;
use crate::scheduling::{self, ThreadClass};
use crate::state::AppState;
use crate::{api, load, lookup, peers, scrape, snapshot, subscriber};

/// Starts every background task and returns the state (used by `serve` and by tests).
pub fn start(config: Config, policy: Policy) -> anyhow::Result<Arc<AppState>> {
    start_on(config, policy, None)
}

/// [`start`], with the event streams on `streams` (else on the current runtime).
pub fn start_on(
    config: Config,
    policy: Policy,
    streams: Option<tokio::runtime::Handle>,
) -> anyhow::Result<Arc<AppState>> {
    let state = AppState::new(config, policy, streams)?;
    let restore = snapshot::load_and_reserve(&state);
    for m in &state.config.models {
        for r in &m.replicas {
            state
                .fleet
                .add(&m.name, r.clone())
                .with_context(|| format!("adding replica {}", r.name))?;
        }
    }
    snapshot::apply_restore(&state, restore);
    for r in state.fleet.all() {
        subscriber::spawn_replica(&state, &r);
    }
    tokio::spawn(scrape::run(state.clone()));
    tokio::spawn(snapshot::run(state.clone()));
    tokio::spawn(refresh_kv_release(state.clone()));
    peers::spawn(&state);
    Ok(state)
}

/// Recomputes the replicas' KV release curves and the blocks the index holds for each every
/// [`load::RELEASE_REFRESH`], so that no route decision pays for them.
async fn refresh_kv_release(state: Arc<AppState>) {
    let mut tick = tokio::time::interval(load::RELEASE_REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        state
            .load
            .refresh_releases(|r| lookup::replica_rates(&state, r).decode_step_s);
        lookup::refresh_held_blocks(&state);
    }
}

/// Runs the server until a shutdown signal, the event streams on `streams` (else on the current
/// runtime).
pub async fn serve(
    config: Config,
    policy: Policy,
    listen: Option<String>,
    streams: Option<tokio::runtime::Handle>,
) -> anyhow::Result<()> {
    let listen = listen.unwrap_or_else(|| config.listen.clone());
    let addr: SocketAddr = listen
        .parse()
        .with_context(|| format!("--listen {listen:?} is not IP:port"))?;
    let state = start_on(config, policy, streams)?;
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener
        .set_nonblocking(true)
        .context("setting the listener non-blocking")?;
    let local = listener.local_addr()?;
    tracing::info!(listen = %local, policy = policy.as_str(), replicas = state.fleet.all().len(), api_threads = state.config.api_threads, "kvroute-indexer serving");
    // Tests and scripts read this line to learn an ephemeral port.
    println!("listening on {local}");
    let api = api_runtime(
        state.config.api_threads,
        state.config.scheduling.api_class(),
    )?;
    let router = api::router(state.clone());
    let served = api
        .spawn(async move {
            // Registered with the API runtime's reactor: its connections are driven there.
            let listener = tokio::net::TcpListener::from_std(listener)?;
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown_signal())
                .await
        })
        .await;
    // In-flight handlers are done (graceful shutdown); nothing is left to wait for.
    api.shutdown_background();
    served
        .context("the HTTP server's task failed")?
        .context("HTTP server failed")?;
    if state.config.snapshot.is_some() {
        match snapshot::save(&state).await {
            Ok(()) => tracing::info!("final snapshot written"),
            Err(e) => tracing::warn!(error = %e, "final snapshot failed"),
        }
    }
    Ok(())
}

/// The HTTP API's runtime, on threads of its own (`kvroute-api`): the event streams' hundreds of
/// tasks run on the main runtime, and a route decision must not queue behind them.
/// Its threads are scheduled as `class` asks (`[scheduling]`).
fn api_runtime(
    threads: usize,
    class: Option<ThreadClass>,
) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    scheduling::on_thread_start(&mut builder, class, "api");
    builder
        .worker_threads(threads)
        .thread_name("kvroute-api")
        .enable_all()
        .build()
        .context("starting the HTTP API's runtime")
}

/// Ctrl-C or SIGTERM, logged.
async fn shutdown_signal() {
    kvroute_core::shutdown::signal().await;
    tracing::info!("shutting down");
}
