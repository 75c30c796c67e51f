//! `kvroute-indexer`: the kvroute sidecar (`serve`) and two operator tools (`hash`, `tokenize`).

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_indexer::config::Config;
use kvroute_indexer::policies::Policy;
use kvroute_indexer::{cli, server};

/// mimalloc: faster than the system allocator for the index's many small allocations and
/// large random-access tables (`cargo bench -p kvroute-indexer --bench index`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .init();
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
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            rt.block_on(server::serve(cfg, policy, listen))
        }
        Command::Hash => {
            let out = cli::hash(&read_stdin()?)?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(())
        }
        Command::Tokenize { model_dir } => {
            let out = cli::tokenize(&model_dir, &read_stdin()?)?;
            println!("{}", serde_json::to_string(&out)?);
            Ok(())
        }
    }
}
