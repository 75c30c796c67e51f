//! Wires the simulator together: model files, hasher, engines (one per data-parallel rank) with
//! their publishers, the HTTP server, and a clean shutdown on SIGTERM / Ctrl-C.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_core::events::WireLayout;
use kvroute_core::hashing::{BlockHasher, HashAlgo, HashConfig, HashError};
use kvroute_core::request::{ModelFiles, ModelTokenizer, TokenizerOptions};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::cli::{parse_lora_modules, Cli, CliError};
use crate::engine::{self, EngineConfig, SimClock};
use crate::events;
use crate::latency::Speed;
use crate::scheduler::SchedulerConfig;
use crate::server::{self, AppState};

/// Start-up failures.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Bad flags.
    #[error(transparent)]
    Cli(#[from] CliError),
    /// Model files missing or unreadable.
    #[error("model dir {dir}: {reason}")]
    Model {
        /// The directory.
        dir: String,
        /// Why.
        reason: String,
    },
    /// Hash configuration.
    #[error("hash config: {0}")]
    Hash(#[from] HashError),
    /// Event publisher.
    #[error(transparent)]
    Events(#[from] events::EventsError),
    /// Engine set-up.
    #[error("engine: {0}")]
    Engine(#[from] crate::block_pool::PoolError),
    /// HTTP listener.
    #[error("listen on {addr}: {reason}")]
    Listen {
        /// Address.
        addr: String,
        /// Why.
        reason: String,
    },
}

/// vLLM with xxhash* and no PYTHONHASHSEED picks a random NONE_HASH seed per process; so do we.
fn hash_config(cli: &Cli) -> Result<HashConfig, AppError> {
    let algo: HashAlgo = cli.prefix_caching_hash_algo.parse().map_err(|_| {
        CliError::Invalid(format!(
            "--prefix-caching-hash-algo: unknown {:?} (sha256, sha256_cbor, xxhash, xxhash_cbor)",
            cli.prefix_caching_hash_algo
        ))
    })?;
    let seed = std::env::var("PYTHONHASHSEED")
        .ok()
        .filter(|s| !s.is_empty());
    let cfg = HashConfig::new(algo, seed);
    if cfg.none_hash_seed().is_ok() {
        return Ok(cfg);
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let random = format!("{:x}", nanos ^ (u128::from(std::process::id()) << 64));
    tracing::warn!(
        algo = %algo,
        "no PYTHONHASHSEED: using a random per-process hash seed, as vLLM does; routers cannot reproduce these hashes"
    );
    Ok(HashConfig::new(algo, Some(random)))
}

/// Runs the simulator until SIGTERM / Ctrl-C. Prints `kvroute-sim listening on http://ADDR` on
/// stdout once the server accepts connections.
pub async fn run(cli: Cli) -> Result<(), AppError> {
    cli.validate()?;
    let model_err = |reason: String| AppError::Model {
        dir: cli.model_dir.display().to_string(),
        reason,
    };
    let files = ModelFiles::from_dir(&cli.model_dir).map_err(|e| model_err(e.to_string()))?;
    let tokenizer = ModelTokenizer::from_files(&files, TokenizerOptions::default())
        .map_err(|e| model_err(e.to_string()))?;
    let hasher = Arc::new(BlockHasher::new(&hash_config(&cli)?)?);
    let loras = parse_lora_modules(&cli.lora_modules)?;
    let layout = WireLayout::for_engine_version(&cli.wire_format).ok_or_else(|| {
        CliError::Invalid(format!("--wire-format: unknown {:?}", cli.wire_format))
    })?;
    let events_cfg = cli.events_config()?;
    let kv_cache_groups = cli.kv_cache_groups()?;
    let hash_block_size = cli.hash_block_size(kv_cache_groups.len())?;
    // Every group takes blocks for every token (sliding groups free theirs only as the window
    // moves on), so a prompt fits when all groups' blocks do.
    let usable_tokens = (cli.num_gpu_blocks - 1) / kv_cache_groups.len().max(1) * cli.block_size;
    let max_model_len = cli.max_model_len.min(usable_tokens);

    let clock = SimClock::new(cli.time_scale);
    let speed =
        Arc::new(Speed::new(cli.speed).map_err(|e| CliError::Invalid(format!("--speed: {e}")))?);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut engines = Vec::new();
    let mut engine_tasks = Vec::new();
    let mut publishers = Vec::new();
    let mut sources = serde_json::Map::new();
    for rank in 0..cli.data_parallel_size {
        let sink = match &events_cfg {
            Some(c) if c.publishes() => {
                let rc = c.for_rank(rank)?;
                let p = events::start(rc, layout, rank as i64, &cli.host).await?;
                let mut v = serde_json::to_value(&p.config).unwrap_or(Value::Null);
                v["enable_kv_cache_events"] = Value::Bool(true);
                sources.insert(rank.to_string(), v);
                let sink = p.sink.clone();
                publishers.push(p);
                Some(sink)
            }
            _ => None,
        };
        let (handle, task) = engine::spawn(
            EngineConfig {
                rank,
                scheduler: SchedulerConfig {
                    max_num_seqs: cli.max_num_seqs,
                    max_num_batched_tokens: cli.max_num_batched_tokens,
                    num_gpu_blocks: cli.num_gpu_blocks,
                    block_size: cli.block_size,
                    kv_cache_groups: kv_cache_groups.clone(),
                    max_model_len,
                    hash_block_size,
                },
                latency: cli.latency_model(),
                speed: speed.clone(),
                max_model_len,
                clock,
                events: sink,
                vocab: cli.output_vocab_size,
            },
            shutdown_rx.clone(),
        )?;
        engines.push(handle);
        engine_tasks.push(task);
    }

    let served = cli.served_names();
    let state = Arc::new(AppState {
        served_names: served.clone(),
        tokenizer: Arc::new(tokenizer),
        hasher,
        engines,
        loras: loras
            .into_iter()
            .map(|l| (l.name.clone(), l))
            .collect::<HashMap<_, _>>(),
        block_size: cli.block_size,
        hash_block_size,
        max_model_len,
        default_max_tokens: cli.default_max_tokens,
        seed: cli.seed,
        kv_event_sources: Value::Object(sources),
        version: cli.vllm_version.clone(),
        port: cli.port,
        start_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
        counter: AtomicU64::new(0),
        faults: crate::faults::Faults::default(),
        latency: cli.latency_model(),
        speed,
        max_num_batched_tokens: cli.max_num_batched_tokens,
        time_scale: cli.time_scale,
    });
    let app = server::router(state, cli.max_body_bytes);
    let addr = format!("{}:{}", cli.host, cli.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| AppError::Listen {
            addr: addr.clone(),
            reason: e.to_string(),
        })?;
    let local: SocketAddr = listener.local_addr().map_err(|e| AppError::Listen {
        addr: addr.clone(),
        reason: e.to_string(),
    })?;
    tracing::info!(
        %local,
        model = %served[0],
        dp = cli.data_parallel_size,
        blocks = cli.num_gpu_blocks,
        block_size = cli.block_size,
        time_scale = cli.time_scale,
        speed = cli.speed,
        latency = ?json!(cli.latency_model()),
        "kvroute-sim ready"
    );
    println!("kvroute-sim listening on http://{local}");

    let serve = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(kvroute_core::shutdown::signal());
    if let Err(e) = serve.await {
        tracing::error!(error = %e, "http server error");
    }
    tracing::info!("shutting down");
    let _ = shutdown_tx.send(true);
    for t in engine_tasks {
        let _ = t.await;
    }
    for p in publishers {
        p.join().await;
    }
    Ok(())
}
