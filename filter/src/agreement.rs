//! The agreement report (`POST /v1/models/{model}/agreement`): the digest of the tokenizer a
//! model loaded and, from an online check, whether the engine tokenised a prompt alike. Sent by
//! the plugin when a model loads and by a stream's online check when it concludes.

use std::time::Duration;

use kvroute_core::api::AgreementReport;

use crate::config::FilterConfig;
use crate::hlog;
use crate::metrics::Counter;
use crate::models::log_name;
use crate::protocol::{indexer_post_headers, percent_encode};
use crate::seam::{Callout, Host, HostResult};

/// Issues `POST /v1/models/{model}/agreement` with `send` (a stream's `dispatch_detached`, so the
/// report outlives the stream, or the plugin's `dispatch`).
pub fn send_report<H: Host + ?Sized>(
    host: &mut H,
    cfg: &FilterConfig,
    model: &str,
    report: &AgreementReport,
    send: impl FnOnce(&mut H, &Callout<'_>) -> HostResult<()>,
) {
    let Ok(body) = serde_json::to_vec(report) else {
        return;
    };
    let path = format!("/v1/models/{}/agreement", percent_encode(model));
    let headers = indexer_post_headers(cfg, &path);
    let call = Callout {
        cluster: &cfg.indexer_cluster,
        headers: &headers,
        body: Some(&body),
        timeout: Duration::from_millis(cfg.complete_timeout_ms),
    };
    if let Err(e) = send(host, &call) {
        host.increment(Counter::AgreementReportFailed.into());
        hlog!(
            host,
            Debug,
            "kvroute: agreement report of model {} not sent: {e}",
            log_name(model)
        );
    }
}
