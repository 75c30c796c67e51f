//! `kvroute-indexer assess`: follows every replica's KV events and metrics for a while **without
//! routing anything** (the fleet stays behind whatever balancer it has) and reports what its
//! traffic reuses, what it computes twice across replicas, what the engines recompute after
//! evicting, and whether prefix-aware routing would pay (see docs/assess.md).

pub mod audit;
pub mod html;
pub mod render;
pub mod report;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::config::Config;
use crate::membership::lock;
use crate::policies::Policy;
use crate::route::replica_rates;
use crate::state::AppState;

pub use report::{
    build, build_full, ModelReport, ReplicaReading, Report, Sample, ShadowReport, Thresholds,
    Verdict,
};

/// Reads every replica's counters now.
pub fn read_replicas(state: &AppState) -> Vec<ReplicaReading> {
    state
        .fleet
        .all()
        .iter()
        .map(|r| {
            let scraped = lock(&r.scraped).clone();
            let streams = r.streams();
            let sum = |f: fn(&crate::membership::StreamStats) -> &std::sync::atomic::AtomicU64| {
                streams
                    .iter()
                    .map(|s| f(&s.stats).load(Ordering::Relaxed))
                    .sum::<u64>()
            };
            ReplicaReading {
                replica: r.name.clone(),
                model: r.model.clone(),
                cache_hit_tokens: scraped.reuse.cache_hit_tokens,
                cache_query_tokens: scraped.reuse.cache_query_tokens,
                computed_tokens: scraped.totals.prefill_tokens,
                preemptions: scraped.reuse.preemptions,
                stored_blocks: sum(|s| &s.stored_blocks),
                duplicated_blocks: sum(|s| &s.duplicated_blocks),
                recomputed_blocks: sum(|s| &s.recomputed_blocks),
                fleet_repeat_blocks: sum(|s| &s.fleet_repeat_blocks),
                recompute_checked_blocks: sum(|s| &s.recompute_checked_blocks),
                recompute_fleet_lost_blocks: sum(|s| &s.recompute_fleet_lost_blocks),
                prefill_tokens_per_s: replica_rates(state, r).prefill_tokens_per_s,
            }
        })
        .collect()
}

/// The block size of every model (learned from events or configured).
fn block_sizes(state: &AppState) -> Vec<(String, u32)> {
    state
        .models
        .values()
        .map(|m| (m.name.clone(), m.block_size().unwrap_or(0)))
        .collect()
}

/// The prompt audit's settings (`assess --audit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditOptions {
    /// Blocks (with their tokens) kept at most, over all models.
    pub max_blocks: usize,
    /// Decode the text around each divergence into the report (`--show-text`).
    pub show_text: bool,
}

/// Follows the fleet for `duration` (or until `stop` resolves) and reports. Writes no snapshot.
/// With `listen`, serves the indexer's API there for filters in shadow mode (route requests
/// that are not shadow are refused, so nothing is routed) and decides with the `kv` policy;
/// otherwise serves nothing. With `audit`, keeps the stored blocks' tokens for the prompt audit.
/// Prints one line to stdout when the window starts (scripts and tests wait for it), after
/// `listening on ADDR` when serving.
pub async fn run(
    mut config: Config,
    duration: Duration,
    listen: Option<String>,
    audit: Option<AuditOptions>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Report> {
    anyhow::ensure!(
        config.scrape_interval_ms > 0,
        "assess reads the engines' metrics: scrape_interval_ms must be > 0"
    );
    // Never overwrite a serving indexer's snapshot.
    config.snapshot = None;
    let interval = Duration::from_millis(config.scrape_interval_ms);
    let policy = if listen.is_some() {
        Policy::Kv
    } else {
        Policy::RoundRobin
    };
    let state = crate::server::start(config, policy).context("starting")?;
    if let Some(a) = audit {
        let _ = state
            .audit
            .set(std::sync::Mutex::new(audit::PromptAudit::new(a.max_blocks)));
    }
    if let Some(listen) = listen {
        let addr: std::net::SocketAddr = listen
            .parse()
            .with_context(|| format!("--listen {listen:?} is not IP:port"))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        state.shadow_only.store(true, Ordering::Relaxed);
        println!("listening on {}", listener.local_addr()?);
        let app = crate::api::router(state.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "assess API server failed");
            }
        });
    }
    wait_first_scrape(&state, interval * 3 + Duration::from_secs(2)).await;
    state
        .reuse_counted_from_ms
        .store(crate::state::unix_ms(), Ordering::Relaxed);
    let start = read_replicas(&state);
    let started = Instant::now();
    let mut samples = vec![Sample {
        t_s: 0.0,
        readings: start.clone(),
    }];
    println!(
        "assess: watching {} replica(s) for {:.0} s",
        start.len(),
        duration.as_secs_f64()
    );
    // About 60 points per window for the plots, never faster than the scrapes.
    let every = (duration / 60)
        .max(interval)
        .max(Duration::from_millis(500));
    let deadline = tokio::time::sleep(duration);
    tokio::pin!(deadline);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut deadline => break,
            _ = &mut stop => {
                tracing::info!("stopped early; reporting the window so far");
                break;
            }
            _ = tokio::time::sleep(every) => samples.push(Sample {
                t_s: started.elapsed().as_secs_f64(),
                readings: read_replicas(&state),
            }),
        }
    }
    // One more scrape so the engines' counters cover the whole window.
    tokio::time::sleep(interval + Duration::from_millis(100)).await;
    let end = read_replicas(&state);
    let window_s = started.elapsed().as_secs_f64();
    samples.push(Sample {
        t_s: window_s,
        readings: end.clone(),
    });
    let mut report = build_full(
        &start,
        &end,
        &block_sizes(&state),
        window_s,
        Thresholds::default(),
        &state.shadow.totals(),
        &samples,
    );
    if let (Some(a), Some(collected)) = (audit, state.audit.get()) {
        let mut decoders = Decoders::new(&state);
        let mut decode = |model: &str, tokens: &[u32]| decoders.decode(model, tokens);
        let decode: Option<&mut audit::TextDecoder<'_>> =
            if a.show_text { Some(&mut decode) } else { None };
        let mut audits = lock(collected).report(decode);
        for m in &mut report.models {
            m.audit = Some(audits.remove(&m.model).unwrap_or(audit::AuditReport {
                blocks: 0,
                blocks_dropped: 0,
                divergences: Vec::new(),
            }));
        }
    }
    Ok(report)
}

/// Each model's tokenizer, loaded on first use, for `--show-text`.
struct Decoders<'a> {
    state: &'a AppState,
    loaded: std::collections::HashMap<String, Option<kvroute_core::request::ModelTokenizer>>,
}

impl<'a> Decoders<'a> {
    fn new(state: &'a AppState) -> Self {
        Self {
            state,
            loaded: std::collections::HashMap::new(),
        }
    }

    /// `tokens` as text (`None`: the model has no loadable tokenizer).
    fn decode(&mut self, model: &str, tokens: &[u32]) -> Option<String> {
        let state = self.state;
        let tok = self.loaded.entry(model.to_string()).or_insert_with(|| {
            let dir = state
                .models
                .get(model)?
                .tokenizers
                .model_dir()?
                .to_path_buf();
            let files = kvroute_core::request::ModelFiles::from_dir(&dir).ok()?;
            kvroute_core::request::ModelTokenizer::from_files_compacted(
                &files,
                kvroute_core::request::TokenizerOptions::default(),
            )
            .ok()
        });
        tok.as_ref()?.decode(tokens).ok()
    }
}

/// Waits until every replica was scraped once (or `timeout`).
async fn wait_first_scrape(state: &Arc<AppState>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if state
            .fleet
            .all()
            .iter()
            .all(|r| lock(&r.scraped).last_ok.is_some())
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::warn!("not every replica answered its first scrape; their counters start at zero");
}
