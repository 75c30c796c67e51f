//! Waiting for the signal that stops a server (Ctrl-C or SIGTERM), shared by the indexer and the
//! simulator. Behind the `shutdown` feature: it needs tokio, which the wasm filter does not have.

/// Resolves on Ctrl-C or, on Unix, SIGTERM (if SIGTERM cannot be watched, only Ctrl-C counts).
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
