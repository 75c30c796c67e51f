//! `kvroute-indexer`: the kvroute sidecar (`serve`) and three operator tools (`assess`, `hash`,
//! `tokenize`).

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_indexer::config::Config;
use kvroute_indexer::policies::Policy;
use kvroute_indexer::scheduling::{self, ThreadClass};
use kvroute_indexer::{assess, server, tools};

// mimalloc, set up before `main` (src/allocator.rs).
kvroute_indexer::global_allocator!();

#[derive(Parser)]
#[command(
    name = "kvroute-indexer",
    version,
    about = "KV-cache-aware routing sidecar for vLLM fleets"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Subscribe to every replica's KV events and answer routing requests over HTTP.
    Serve {
        /// TOML configuration file (see docs/indexer.md).
        #[arg(long)]
        config: PathBuf,
        /// HTTP listen address (default: the config's `listen`, else 127.0.0.1:8190).
        #[arg(long)]
        listen: Option<String>,
        /// Routing policy: kv, round-robin, random, least-loaded, session, approx-prefix.
        #[arg(long, default_value = "kv")]
        policy: String,
        /// Only validate the configuration file and the policy, then exit (0 valid, 1 not).
        #[arg(long)]
        check_config: bool,
    },
    /// Follow every replica's KV events and metrics without routing anything, then report what
    /// the traffic reuses and whether prefix-aware routing would pay (docs/assess.md).
    Assess {
        /// TOML configuration file (the same as `serve`'s).
        #[arg(long)]
        config: PathBuf,
        /// How long to watch, e.g. `90s`, `10m`, `1h` (Ctrl-C reports early).
        #[arg(long, default_value = "10m", value_parser = parse_duration)]
        duration: std::time::Duration,
        /// Also write the report as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also write the report as one self-contained HTML page with plots to this file.
        #[arg(long)]
        html: Option<PathBuf>,
        /// Serve the indexer API on IP:port for filters in shadow mode (shadow route requests
        /// only; nothing is routed): adds what kvroute would have chosen and saved, split by
        /// session, to the report.
        #[arg(long)]
        listen: Option<String>,
        /// Audit prompts (off by default: it keeps the stored blocks' token ids in memory for the
        /// window): report where request families diverge early, e.g. a per-request timestamp
        /// at the start of the system prompt, and how much reuse that destroys.
        #[arg(long)]
        audit: bool,
        /// With --audit: put the decoded text around each divergence in the report (prompt
        /// content; never logged).
        #[arg(long, requires = "audit")]
        show_text: bool,
        /// With --audit: blocks (with their tokens) kept at most, over all models.
        #[arg(long, default_value_t = assess::audit::DEFAULT_MAX_BLOCKS, requires = "audit")]
        audit_max_blocks: usize,
    },
    /// Read a JSON object (algo, block_size, token_ids, seed, lora_name, lora_path, cache_salt,
    /// mm_features) on stdin; print vLLM's block hashes, wire values and kvroute's router keys.
    Hash,
    /// Read an OpenAI request body on stdin; print the engine's token ids.
    Tokenize {
        /// Directory with tokenizer.json and tokenizer_config.json.
        #[arg(long)]
        model_dir: PathBuf,
    },
}

/// `90`, `90s`, `10m`, `1h`.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and s, m or h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: the unit must be s, m or h")),
    };
    if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
        return Err(format!("{s:?}: must be a positive duration"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// The runtime of event intake, scrapes and snapshots, its threads scheduled as `class` asks.
fn runtime(class: Option<ThreadClass>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    scheduling::on_thread_start(&mut builder, class, "events");
    // Event streams yield after a burst counted from here (`scheduling::yield_if_awake_for`).
    builder.on_thread_unpark(scheduling::note_woke);
    builder
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

fn read_stdin() -> anyhow::Result<String> {
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .context("reading stdin")?;
    Ok(s)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.command {
        Command::Serve {
            config,
            listen,
            policy,
            check_config,
        } => {
            init_logging();
            let policy: Policy = policy.parse().map_err(|e: String| anyhow::anyhow!(e))?;
            let cfg = Config::load(&config)?;
            if check_config {
                let replicas: usize = cfg.models.iter().map(|m| m.replicas.len()).sum();
                println!(
                    "{}: OK ({} model(s), {replicas} replica(s))",
                    config.display(),
                    cfg.models.len()
                );
                return Ok(());
            }
            let class = cfg.scheduling.background_class();
            let streams = match cfg.scheduling.event_coalesce() {
                Some(pause) => Some(
                    scheduling::coalescing_runtime(class, pause)
                        .context("starting the event streams' runtime")?,
                ),
                None => None,
            };
            let handle = streams.as_ref().map(|rt| rt.handle().clone());
            let served = runtime(class)?.block_on(server::serve(cfg, policy, listen, handle));
            // The subscribers block in their sockets: do not wait for them.
            if let Some(rt) = streams {
                rt.shutdown_background();
            }
            served
        }
        Command::Assess {
            config,
            duration,
            json,
            html,
            listen,
            audit,
            show_text,
            audit_max_blocks,
        } => {
            init_logging();
            let cfg = Config::load(&config)?;
            let stop = async {
                let _ = tokio::signal::ctrl_c().await;
            };
            let rt = runtime(cfg.scheduling.background_class())?;
            let audit = audit.then_some(assess::AuditOptions {
                max_blocks: audit_max_blocks,
                show_text,
            });
            let report = rt.block_on(assess::run(cfg, duration, listen, audit, stop))?;
            // The subscribers block in their sockets: do not wait for them.
            rt.shutdown_timeout(std::time::Duration::from_millis(500));
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report)?;
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = html {
                std::fs::write(&path, assess::html::page(&report))
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            print!("{}", assess::render::text(&report));
            Ok(())
        }
        Command::Hash => {
            let out = tools::hash(&read_stdin()?)?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(())
        }
        Command::Tokenize { model_dir } => {
            let out = tools::tokenize(&model_dir, &read_stdin()?)?;
            println!("{}", serde_json::to_string(&out)?);
            Ok(())
        }
    }
}
