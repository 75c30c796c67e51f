//! `kvroute-sim`: a vLLM-compatible engine simulator. See docs/simulator.md.

use clap::Parser;
use kvroute_sim::cli::Cli;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    kvroute_sim::app::run(cli).await?;
    Ok(())
}
