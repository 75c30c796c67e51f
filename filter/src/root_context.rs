//! The per-VM root context: configuration, metrics, and getting each model's tokenizer into this
//! VM (from the indexer at start and on first use, retried with backoff on the tick; or from the
//! VM configuration for offline set-ups).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use serde_json::Value;

use crate::config::{FilterConfig, TokenizerSource};
use crate::engine::LoadedModel;
use crate::hlog;
use crate::host::{self, Buffer, Map};
use crate::http_context::KvRouteHttp;
use crate::metrics::{Counter, Metrics};
use crate::models::{log_name, ModelRegistry, RegistryPolicy};
use crate::online_check::send_report;
use crate::protocol::{parse_status, parse_tokenizer_bundle, TokenizerBundle};

/// How often the root context looks for tokenizer fetches to (re)start.
const TICK: Duration = Duration::from_millis(200);

/// State shared by the root context and every HTTP context of one VM.
pub struct Shared {
    /// Validated configuration.
    pub cfg: FilterConfig,
    /// Metric ids.
    pub metrics: Metrics,
    /// Models and their tokenizers.
    pub models: RefCell<ModelRegistry<LoadedModel>>,
    /// The root context id (owner of callouts that must outlive a stream).
    pub root_id: u32,
}

/// The root context.
pub struct KvRouteRoot {
    id: u32,
    shared: Option<Rc<Shared>>,
    vm_config: Vec<u8>,
    /// Tokenizer fetch token -> model name.
    fetches: HashMap<u32, String>,
}

impl KvRouteRoot {
    /// A root context with no configuration yet.
    pub fn new(id: u32) -> Self {
        Self {
            id,
            shared: None,
            vm_config: Vec::new(),
            fetches: HashMap::new(),
        }
    }

    fn start_due_fetches(&mut self) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let due = shared.models.borrow_mut().due_fetches(host::now_millis());
        for model in due {
            let source = shared
                .cfg
                .models
                .get(&model)
                .map(|m| m.tokenizer_source)
                .unwrap_or_default();
            if source == TokenizerSource::VmConfig {
                // Loaded at configure time; nothing to fetch (a failure there refused the plugin).
                continue;
            }
            let path = format!("/v1/models/{}/tokenizer", percent_encode(&model));
            let headers = vec![
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", shared.cfg.indexer_authority.as_str()),
                ("accept", "application/json"),
                (
                    kvroute_core::api::CONTRACT_HEADER,
                    kvroute_core::api::CONTRACT_VERSION_STR,
                ),
            ];
            match host::dispatch_http_call(
                &shared.cfg.indexer_cluster,
                headers,
                None,
                Duration::from_millis(shared.cfg.tokenizer_timeout_ms),
            ) {
                Ok(token) => {
                    hlog!(
                        Debug,
                        "kvroute: fetching tokenizer of model {}",
                        log_name(&model)
                    );
                    self.fetches.insert(token, model);
                }
                Err(e) => {
                    let backoff = shared
                        .models
                        .borrow_mut()
                        .failed(&model, host::now_millis());
                    shared.metrics.inc(Counter::TokenizerLoadFailed);
                    hlog!(
                        Warn,
                        "kvroute: cannot fetch tokenizer of {} from cluster {:?} ({e}); retry in {backoff} ms",
                        log_name(&model),
                        shared.cfg.indexer_cluster
                    );
                }
            }
        }
    }

    fn load_vm_config_models(&self, shared: &Shared) -> Result<(), String> {
        let offline: Vec<&String> = shared
            .cfg
            .models
            .iter()
            .filter(|(_, m)| m.tokenizer_source == TokenizerSource::VmConfig)
            .map(|(n, _)| n)
            .collect();
        if offline.is_empty() {
            return Ok(());
        }
        let doc: Value = serde_json::from_slice(&self.vm_config).map_err(|e| {
            format!(
                "models with tokenizer_source vm_config need a JSON vm_config.configuration: {e}"
            )
        })?;
        for name in offline {
            let entry = doc.get("models").and_then(|m| m.get(name)).ok_or_else(|| {
                format!(
                    "vm_config.configuration has no models.{name} for tokenizer_source vm_config"
                )
            })?;
            let bundle =
                parse_tokenizer_bundle(entry).map_err(|e| format!("models.{name}: {e}"))?;
            let loaded =
                LoadedModel::from_bundle(&bundle, shared.cfg.models.get(name), &shared.cfg)
                    .map_err(|e| format!("models.{name}: tokenizer does not load: {e}"))?;
            if !shared.models.borrow_mut().loaded(name, loaded) {
                return Err(format!("models.{name}: no free model slot"));
            }
            shared.metrics.inc(Counter::TokenizerLoaded);
        }
        Ok(())
    }

    fn on_tokenizer_answer(&mut self, model: String, num_headers: usize, body_size: usize) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let now = host::now_millis();
        let status = if num_headers == 0 {
            None
        } else {
            parse_status(
                host::get_header(Map::CallResponseHeaders, ":status")
                    .ok()
                    .flatten()
                    .as_deref(),
            )
        };
        let contract = if num_headers == 0 {
            None
        } else {
            host::get_header(Map::CallResponseHeaders, kvroute_core::api::CONTRACT_HEADER)
                .ok()
                .flatten()
        };
        let other_contract = matches!(
            kvroute_core::api::check_contract(contract.as_deref()),
            kvroute_core::api::ContractCheck::Other(_)
        );
        let outcome: Result<TokenizerBundle, String> = match status {
            // Another release of the indexer: loud, and retried (an upgrade may be under way).
            Some(409) | Some(200) if other_contract || status == Some(409) => Err(format!(
                "the indexer speaks kvroute contract {:?}, this filter {}: run a filter and an \
                 indexer of the same release",
                contract.as_deref().unwrap_or("(refused ours)"),
                kvroute_core::api::CONTRACT_VERSION
            )),
            Some(200) => host::get_buffer(Buffer::CallResponseBody, 0, body_size)
                .map_err(|e| format!("cannot read the answer: {e}"))
                .and_then(|b| {
                    serde_json::from_slice::<Value>(&b).map_err(|e| format!("not JSON: {e}"))
                })
                .and_then(|v| parse_tokenizer_bundle(&v)),
            // 404, or any refusal of the name itself (414 URI too long, 400): a negative answer,
            // cached; not a failure to retry.
            Some(s) if (400..500).contains(&s) && s != 408 && s != 429 => {
                shared.models.borrow_mut().unknown(&model, now);
                if shared.cfg.models.contains_key(&model) {
                    hlog!(
                        Warn,
                        "kvroute: the indexer does not know model {} (HTTP {s}); its requests fail open",
                        log_name(&model)
                    );
                } else {
                    hlog!(
                        Debug,
                        "kvroute: the indexer does not know model {} (HTTP {s})",
                        log_name(&model)
                    );
                }
                return;
            }
            Some(s) => Err(format!("indexer answered HTTP {s}")),
            None => Err("no answer (reset or timeout)".to_string()),
        };
        let loaded = outcome.and_then(|bundle| {
            LoadedModel::from_bundle(&bundle, shared.cfg.models.get(&model), &shared.cfg)
        });
        match loaded {
            Ok(m) => {
                let (block_size, cap) = (m.block_size, m.max_prompt_tokens);
                let digest = m.digest().clone();
                if shared.models.borrow_mut().loaded(&model, m) {
                    let report = kvroute_core::api::AgreementReport {
                        digest,
                        check: None,
                    };
                    send_report(&shared, &model, &report, None);
                    hlog!(
                        Info,
                        "kvroute: tokenizer of model {} ready (block size {block_size}, max prompt tokens {cap})",
                        log_name(&model)
                    );
                    shared.metrics.inc(Counter::TokenizerLoaded);
                } else {
                    hlog!(
                        Warn,
                        "kvroute: model {} not kept: all max_models slots are taken",
                        log_name(&model)
                    );
                }
            }
            Err(e) => {
                let backoff = shared.models.borrow_mut().failed(&model, now);
                shared.metrics.inc(Counter::TokenizerLoadFailed);
                hlog!(
                    Warn,
                    "kvroute: tokenizer of model {} not loaded: {e}; retry in {backoff} ms",
                    log_name(&model)
                );
            }
        }
    }
}

/// Minimal percent-encoding for a model name in a URL path segment.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Context for KvRouteRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(model) = self.fetches.remove(&token_id) {
            self.on_tokenizer_answer(model, num_headers, body_size);
        }
        // Other tokens are `/v1/complete` reports issued on the root's behalf: nothing to do.
    }
}

impl RootContext for KvRouteRoot {
    fn on_vm_start(&mut self, vm_configuration_size: usize) -> bool {
        if vm_configuration_size > 0 {
            match host::get_buffer(Buffer::VmConfiguration, 0, vm_configuration_size) {
                Ok(b) => self.vm_config = b,
                Err(e) => hlog!(Warn, "kvroute: cannot read the VM configuration: {e}"),
            }
        }
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let raw = if plugin_configuration_size == 0 {
            Vec::new()
        } else {
            match host::get_buffer(Buffer::PluginConfiguration, 0, plugin_configuration_size) {
                Ok(b) => b,
                Err(e) => {
                    hlog!(Error, "kvroute: cannot read the plugin configuration: {e}");
                    return false;
                }
            }
        };
        let cfg = match FilterConfig::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                hlog!(Error, "kvroute: invalid plugin configuration: {e}");
                return false;
            }
        };
        let (metrics, failed) = Metrics::define();
        if !failed.is_empty() {
            hlog!(Warn, "kvroute: metrics not defined: {}", failed.join(", "));
        }
        let policy = RegistryPolicy {
            discover: cfg.discover_models,
            max_models: cfg.max_models,
            max_probes: cfg.max_models,
            max_negative: cfg.unknown_model_cache_entries,
            max_name_bytes: cfg.max_model_name_bytes,
            initial_backoff_ms: cfg.tokenizer_retry.initial_ms,
            max_backoff_ms: cfg.tokenizer_retry.max_ms,
            unknown_ttl_ms: cfg.unknown_model_retry_ms,
            loading_timeout_ms: cfg.tokenizer_timeout_ms.saturating_add(5_000),
        };
        let configured: Vec<String> = cfg
            .models
            .iter()
            .filter(|(_, m)| m.tokenizer_source == TokenizerSource::Indexer)
            .map(|(n, _)| n.clone())
            .collect();
        let shared = Shared {
            models: RefCell::new(ModelRegistry::new(policy, configured)),
            cfg,
            metrics,
            root_id: self.id,
        };
        if let Err(e) = self.load_vm_config_models(&shared) {
            hlog!(Error, "kvroute: invalid offline tokenizer set-up: {e}");
            return false;
        }
        self.shared = Some(Rc::new(shared));
        if let Err(e) = host::set_tick_period(TICK) {
            hlog!(
                Warn,
                "kvroute: cannot set the tick period ({e}); tokenizer fetches will not be retried"
            );
        }
        self.start_due_fetches();
        true
    }

    fn on_tick(&mut self) {
        self.start_due_fetches();
        if let Some(shared) = &self.shared {
            shared.metrics.record_vm_memory();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(KvRouteHttp::new(context_id, self.shared.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_path_safe() {
        assert_eq!(percent_encode("Qwen/Qwen3-0.6B"), "Qwen%2FQwen3-0.6B");
        assert_eq!(percent_encode("a b?"), "a%20b%3F");
    }
}
