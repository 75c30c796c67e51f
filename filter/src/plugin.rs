//! The filter's per-plugin state and logic, host-independent: the validated configuration and
//! each model's tokenizer, fetched from the indexer at start and on first use (retried with
//! backoff on the host's tick) or taken from the VM configuration for offline set-ups.
//!
//! One [`Plugin`] serves every stream of its host instance: one per Wasm VM in the proxy-wasm
//! build; it is `Sync`, so a native build can share one per process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use kvroute_core::api::{
    check_contract, AgreementReport, CompleteReport, ContractCheck, TokenizerBundle,
    CONTRACT_HEADER, CONTRACT_VERSION_STR, MAX_REPORT_HOLD_MS, TOKENIZER_FORM_COMPACT,
};
use serde_json::Value;

use crate::agreement::send_report;
use crate::completions::{send_reports, HeldReports};
use crate::config::{ConfigError, FilterConfig, TokenizerSource};
use crate::hlog;
use crate::loaded_model::LoadedModel;
use crate::metrics::Counter;
use crate::models::{log_name, Lookup, ModelRegistry, RegistryPolicy};
use crate::protocol::percent_encode;
use crate::seam::{CallId, CallReply, Callout, Host};

/// How often the host should call [`Plugin::on_tick`] while it has work due (tokenizer fetches,
/// completion reports held past `complete_hold_ms`); [`crate::tick_plan`] says when.
pub const TICK: Duration = Duration::from_millis(50);

/// Why a plugin configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The plugin configuration is invalid.
    #[error("invalid plugin configuration: {0}")]
    Config(#[from] ConfigError),
    /// A `tokenizer_source: vm_config` model cannot be loaded.
    #[error("invalid offline tokenizer set-up: {0}")]
    Offline(String),
}

/// State shared by every stream of one host instance.
pub struct Plugin {
    /// Validated configuration.
    pub cfg: FilterConfig,
    models: Mutex<ModelRegistry<LoadedModel>>,
    /// Tokenizer fetches in flight: callout -> model name.
    fetches: Mutex<HashMap<CallId, String>>,
    /// Completion reports waiting to ride on the next route call.
    held: Mutex<HeldReports>,
    /// The hold the indexer's last route answer allowed (ms; 0 until one says).
    indexer_hold_ms: AtomicU64,
    /// Told the time (host ms) from which [`Plugin::on_tick`] has new work, by a host that ticks
    /// only when [`Plugin::next_tick_ms`] says ([`crate::tick_plan`]).
    tick_waker: OnceLock<TickWaker>,
}

/// A host's way to hear that [`Plugin::on_tick`] has work from the given time (host ms).
pub type TickWaker = Box<dyn Fn(u64) + Send + Sync>;

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Plugin {
    /// Validates the plugin configuration and loads the models whose tokenizer is in the VM
    /// configuration (`vm_config`, a JSON document; may be empty when none is offline). Call
    /// [`Plugin::on_tick`] right after, then as [`crate::tick_plan`] says.
    pub fn configure(
        host: &impl Host,
        plugin_config: &[u8],
        vm_config: &[u8],
    ) -> Result<Self, PluginError> {
        let cfg = FilterConfig::parse(plugin_config)?;
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
        let plugin = Self {
            models: Mutex::new(ModelRegistry::new(policy, configured)),
            held: Mutex::new(HeldReports::new(cfg.max_held_completions)),
            indexer_hold_ms: AtomicU64::new(0),
            tick_waker: OnceLock::new(),
            cfg,
            fetches: Mutex::new(HashMap::new()),
        };
        plugin
            .load_vm_config_models(host, vm_config)
            .map_err(PluginError::Offline)?;
        Ok(plugin)
    }

    fn models(&self) -> MutexGuard<'_, ModelRegistry<LoadedModel>> {
        // The registry is consistent after every call; a panic elsewhere does not spoil it.
        self.models.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fetches(&self) -> MutexGuard<'_, HashMap<CallId, String>> {
        self.fetches.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn held(&self) -> MutexGuard<'_, HeldReports> {
        // Every method leaves the queue consistent.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long a completion report may be held now (ms): `complete_hold_ms` when configured,
    /// else what the indexer's last route answer allowed.
    pub fn report_hold_ms(&self) -> u64 {
        self.cfg
            .complete_hold_ms
            .unwrap_or_else(|| self.indexer_hold_ms.load(Ordering::Relaxed))
    }

    /// Records the hold a route answer allowed (`None`: an indexer that says nothing, so reports
    /// go at once), at most [`MAX_REPORT_HOLD_MS`].
    pub fn note_indexer_hold(&self, hold_ms: Option<u64>) {
        let hold = hold_ms.unwrap_or(0).min(MAX_REPORT_HOLD_MS);
        let was = self.indexer_hold_ms.swap(hold, Ordering::Relaxed);
        if hold < was {
            // What is held may be due sooner than the ticking host planned.
            let due = self.held().due_at_ms(self.report_hold_ms());
            self.wake_ticker(due);
        }
    }

    /// Lets a host tick only when there is work ([`Plugin::next_tick_ms`]): `wake` is told each
    /// time work is added, with the time it is due. Set once; false if a waker was set already.
    pub fn set_tick_waker(&self, wake: TickWaker) -> bool {
        self.tick_waker.set(wake).is_ok()
    }

    /// The host time (ms) from which [`Plugin::on_tick`] has something to do (the oldest held
    /// report's end of hold, the earliest tokenizer fetch due), `None` while nothing is pending.
    pub fn next_tick_ms(&self) -> Option<u64> {
        let held = self.held().due_at_ms(self.report_hold_ms());
        let fetch = self.models().next_fetch_ms();
        held.into_iter().chain(fetch).min()
    }

    fn wake_ticker(&self, due_ms: Option<u64>) {
        if let (Some(wake), Some(due)) = (self.tick_waker.get(), due_ms) {
            wake(due);
        }
    }

    /// Takes a request's end report: held for the next route call, or returned with everything
    /// held when it must go now (no hold allowed, or the queue is full).
    pub fn report_end(&self, report: CompleteReport, now_ms: u64) -> Option<Vec<CompleteReport>> {
        let hold_ms = self.report_hold_ms();
        if hold_ms == 0 {
            let mut due = self.held().take();
            due.push(report);
            return Some(due);
        }
        let (full, due_ms) = {
            let mut held = self.held();
            let full = held.hold(report, now_ms);
            (full, held.due_at_ms(hold_ms))
        };
        self.wake_ticker(due_ms);
        full
    }

    /// The held reports, for a route call to carry.
    pub fn take_held(&self) -> Vec<CompleteReport> {
        self.held().take()
    }

    /// Reports a route call may not have delivered, held again; returns everything held when it
    /// must go now (the queue is full).
    pub fn give_back(
        &self,
        reports: Vec<CompleteReport>,
        now_ms: u64,
    ) -> Option<Vec<CompleteReport>> {
        if reports.is_empty() {
            return None;
        }
        let (full, due_ms) = {
            let mut held = self.held();
            let full = held.give_back(reports, now_ms);
            (full, held.due_at_ms(self.report_hold_ms()))
        };
        self.wake_ticker(due_ms);
        full
    }

    /// Can `model` be routed now? Asking for an unknown model schedules its fetch.
    pub fn lookup(&self, model: &str, now_ms: u64) -> Lookup<LoadedModel> {
        let found = self.models().lookup(model, now_ms);
        if matches!(found, Lookup::NotReady) {
            // Maybe a fetch it just wanted (due at once).
            let due = self.models().next_fetch_ms();
            self.wake_ticker(due);
        }
        found
    }

    /// Sends the completion reports held too long, and starts the tokenizer fetches that are due.
    pub fn on_tick(&self, host: &mut impl Host) {
        // Also when holding was just turned off: what is still held goes now.
        let overdue = self
            .held()
            .take_due(host.now_millis(), self.report_hold_ms());
        send_reports(host, &self.cfg, &overdue, |h, call| {
            h.dispatch(call).map(|_| ())
        });
        let due = self.models().due_fetches(host.now_millis());
        for model in due {
            let source = self
                .cfg
                .models
                .get(&model)
                .map(|m| m.tokenizer_source)
                .unwrap_or_default();
            if source == TokenizerSource::VmConfig {
                // Loaded at configure time; nothing to fetch (a failure there refused the plugin).
                continue;
            }
            // The compact form (an indexer that does not know the parameter sends the whole
            // document, which loads too).
            let path = format!(
                "/v1/models/{}/tokenizer?{TOKENIZER_FORM_COMPACT}",
                percent_encode(&model)
            );
            let headers = [
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", self.cfg.indexer_authority.as_str()),
                ("accept", "application/json"),
                (CONTRACT_HEADER, CONTRACT_VERSION_STR),
            ];
            let call = Callout {
                cluster: &self.cfg.indexer_cluster,
                headers: &headers,
                body: None,
                timeout: Duration::from_millis(self.cfg.tokenizer_timeout_ms),
            };
            match host.dispatch(&call) {
                Ok(id) => {
                    hlog!(
                        host,
                        Debug,
                        "kvroute: fetching tokenizer of model {}",
                        log_name(&model)
                    );
                    self.fetches().insert(id, model);
                }
                Err(e) => {
                    let backoff = self.models().failed(&model, host.now_millis());
                    host.increment(Counter::TokenizerLoadFailed.into());
                    hlog!(
                        host,
                        Warn,
                        "kvroute: cannot fetch tokenizer of {} from cluster {:?} ({e}); retry in {backoff} ms",
                        log_name(&model),
                        self.cfg.indexer_cluster
                    );
                }
            }
        }
    }

    /// Takes a callout answer; returns false when `id` is not one of the plugin's fetches (the
    /// answer to a report, which needs nothing). A tokenizer that loads is reported to the
    /// indexer (`POST /v1/models/{model}/agreement`, its digest).
    pub fn on_call_reply(&self, host: &mut impl Host, id: CallId, reply: &CallReply) -> bool {
        let Some(model) = self.fetches().remove(&id) else {
            return false;
        };
        self.on_tokenizer_reply(host, model, reply);
        // A failed fetch's retry is due later.
        let due = self.models().next_fetch_ms();
        self.wake_ticker(due);
        true
    }

    fn on_tokenizer_reply(&self, host: &mut impl Host, model: String, reply: &CallReply) {
        let now = host.now_millis();
        let other_contract = matches!(
            check_contract(reply.contract.as_deref()),
            ContractCheck::Other(_)
        );
        let outcome: Result<TokenizerBundle, String> = match reply.status {
            // Another release of the indexer: loud, and retried (an upgrade may be under way).
            Some(409) | Some(200) if other_contract || reply.status == Some(409) => Err(format!(
                "the indexer speaks kvroute contract {:?}, this filter {}: run a filter and an \
                 indexer of the same release",
                reply.contract.as_deref().unwrap_or("(refused ours)"),
                kvroute_core::api::CONTRACT_VERSION
            )),
            Some(200) => TokenizerBundle::parse(&reply.body).map_err(|e| e.to_string()),
            // 404, or any refusal of the name itself (414 URI too long, 400): a negative answer,
            // cached; not a failure to retry.
            Some(s) if (400..500).contains(&s) && s != 408 && s != 429 => {
                self.models().unknown(&model, now);
                if self.cfg.models.contains_key(&model) {
                    hlog!(
                        host,
                        Warn,
                        "kvroute: the indexer does not know model {} (HTTP {s}); its requests fail open",
                        log_name(&model)
                    );
                } else {
                    hlog!(
                        host,
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
        let loaded = outcome
            .and_then(|bundle| LoadedModel::load(bundle, self.cfg.models.get(&model), &self.cfg));
        match loaded {
            Ok(m) => {
                let (block_size, cap) = (m.block_size, m.max_prompt_tokens);
                let digest = m.digest().clone();
                if self.models().loaded(&model, m) {
                    // The indexer compares this digest with its own tokenizer's.
                    let report = AgreementReport {
                        digest,
                        check: None,
                    };
                    send_report(host, &self.cfg, &model, &report, |h, call| {
                        h.dispatch(call).map(|_| ())
                    });
                    hlog!(
                        host,
                        Info,
                        "kvroute: tokenizer of model {} ready (block size {block_size}, max prompt tokens {cap})",
                        log_name(&model)
                    );
                    host.increment(Counter::TokenizerLoaded.into());
                } else {
                    hlog!(
                        host,
                        Warn,
                        "kvroute: model {} not kept: all max_models slots are taken",
                        log_name(&model)
                    );
                }
            }
            Err(e) => {
                let backoff = self.models().failed(&model, now);
                host.increment(Counter::TokenizerLoadFailed.into());
                hlog!(
                    host,
                    Warn,
                    "kvroute: tokenizer of model {} not loaded: {e}; retry in {backoff} ms",
                    log_name(&model)
                );
            }
        }
    }

    fn load_vm_config_models(&self, host: &impl Host, vm_config: &[u8]) -> Result<(), String> {
        let offline: Vec<&String> = self
            .cfg
            .models
            .iter()
            .filter(|(_, m)| m.tokenizer_source == TokenizerSource::VmConfig)
            .map(|(n, _)| n)
            .collect();
        if offline.is_empty() {
            return Ok(());
        }
        let doc: Value = serde_json::from_slice(vm_config).map_err(|e| {
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
                TokenizerBundle::from_value(entry).map_err(|e| format!("models.{name}: {e}"))?;
            let loaded = LoadedModel::load(bundle, self.cfg.models.get(name), &self.cfg)
                .map_err(|e| format!("models.{name}: tokenizer does not load: {e}"))?;
            if !self.models().loaded(name, loaded) {
                return Err(format!("models.{name}: no free model slot"));
            }
            host.increment(Counter::TokenizerLoaded.into());
        }
        Ok(())
    }
}
