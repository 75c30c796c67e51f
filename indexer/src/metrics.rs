//! `/metrics` in Prometheus text format. All names start with `kvroute_indexer_`.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use std::sync::Arc;

use crate::membership::{lock, Replica};
use crate::state::AppState;

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Renders every metric.
pub fn render(state: &AppState) -> String {
    let mut out = String::with_capacity(8192);
    let m = &state.metrics;
    let p = "kvroute_indexer";

    // Per-stream counters.
    let replicas = state.fleet.all();
    type Getter = fn(&crate::membership::StreamStats) -> u64;
    let stream_counters: [(&str, &str, Getter); 19] = [
        ("event_batches_total", "Event batches applied.", |s| {
            s.batches.load(Ordering::Relaxed)
        }),
        ("events_total", "Events applied to the index.", |s| {
            s.events.load(Ordering::Relaxed)
        }),
        ("event_gaps_total", "Sequence gaps detected.", |s| {
            s.gaps.load(Ordering::Relaxed)
        }),
        ("replays_total", "Replays requested.", |s| {
            s.replays.load(Ordering::Relaxed)
        }),
        (
            "replay_failures_total",
            "Replays that failed (connect or read timeout, bad reply).",
            |s| s.replay_failures.load(Ordering::Relaxed),
        ),
        (
            "stream_resets_total",
            "Times a stream's entries were dropped (restart, uncoverable gap).",
            |s| s.resets.load(Ordering::Relaxed),
        ),
        (
            "event_decode_errors_total",
            "Undecodable event messages skipped.",
            |s| s.event_decode_errors.load(Ordering::Relaxed),
        ),
        (
            "event_duplicates_total",
            "Batches received twice (live and replay) and skipped.",
            |s| s.duplicates.load(Ordering::Relaxed),
        ),
        (
            "events_rejected_total",
            "Events the index refused (e.g. unknown parent).",
            |s| s.rejected_events.load(Ordering::Relaxed),
        ),
        ("stream_connects_total", "Event stream connections.", |s| {
            s.connects.load(Ordering::Relaxed)
        }),
        (
            "event_oversized_messages_total",
            "Peers (live, replay or bound socket) disconnected for announcing a message over events.max_message_bytes.",
            |s| s.oversized.load(Ordering::Relaxed),
        ),
        (
            "event_peers_refused_total",
            "Connections to a bound event socket refused by events.allowed_peers.",
            |s| s.refused_peers.load(Ordering::Relaxed),
        ),
        (
            "replays_too_large_total",
            "Replays abandoned for exceeding events.replay_max_batches or events.replay_max_bytes.",
            |s| s.replays_too_large.load(Ordering::Relaxed),
        ),
        (
            "blocks_stored_total",
            "New block holdings from the stream's events (re-announced hits and replayed history excluded).",
            |s| s.stored_blocks.load(Ordering::Relaxed),
        ),
        (
            "blocks_duplicated_total",
            "GPU blocks stored while another replica held them on GPU: prefill computed twice.",
            |s| s.duplicated_blocks.load(Ordering::Relaxed),
        ),
        (
            "blocks_recomputed_total",
            "GPU blocks stored again within reuse.recompute_window_s of their removal: recomputation after eviction.",
            |s| s.recomputed_blocks.load(Ordering::Relaxed),
        ),
        (
            "blocks_fleet_repeat_total",
            "GPU blocks stored while the model's fleet, seen as one cache of all its KV, still held them: prefill a prefix-aware router would have served from cache.",
            |s| s.fleet_repeat_blocks.load(Ordering::Relaxed),
        ),
        (
            "blocks_recompute_checked_total",
            "Recomputed GPU blocks the model's fleet cache followed (sample weights applied).",
            |s| s.recompute_checked_blocks.load(Ordering::Relaxed),
        ),
        (
            "blocks_recompute_fleet_lost_total",
            "Of blocks_recompute_checked_total, those the fleet as one cache had evicted too: recomputation only more KV avoids.",
            |s| s.recompute_fleet_lost_blocks.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, get) in stream_counters {
        let full = format!("{p}_{name}");
        header(&mut out, &full, "counter", help);
        for r in &replicas {
            for s in &r.streams() {
                let _ = writeln!(
                    out,
                    "{full}{{replica=\"{}\",model=\"{}\",rank=\"{}\"}} {}",
                    escape(&r.name),
                    escape(&r.model),
                    s.rank,
                    get(&s.stats)
                );
            }
        }
    }
    let gauge_stream =
        |out: &mut String,
         name: &str,
         help: &str,
         f: &dyn Fn(&crate::membership::StreamState) -> Option<f64>| {
            let full = format!("{p}_{name}");
            header(out, &full, "gauge", help);
            for r in &replicas {
                for s in &r.streams() {
                    if let Some(v) = f(&lock(&s.state)) {
                        let _ = writeln!(
                            out,
                            "{full}{{replica=\"{}\",model=\"{}\",rank=\"{}\"}} {v}",
                            escape(&r.name),
                            escape(&r.model),
                            s.rank
                        );
                    }
                }
            }
        };
    gauge_stream(
        &mut out,
        "stream_lag_seconds",
        "Receive time minus engine timestamp of the last batch.",
        &|s| s.lag_seconds,
    );
    gauge_stream(
        &mut out,
        "stream_last_seq",
        "Last applied sequence number.",
        &|s| s.last_seq.map(|v| v as f64),
    );
    gauge_stream(
        &mut out,
        "stream_connected",
        "1 when the stream is connected.",
        &|s| Some(if s.connected { 1.0 } else { 0.0 }),
    );
    gauge_stream(
        &mut out,
        "stream_silence_seconds",
        "Seconds since the last message.",
        &|s| s.last_message.map(|t| t.elapsed().as_secs_f64()),
    );

    // Per-replica gauges.
    let stale_after = state.stale_after();
    let entries_by_stream: std::collections::HashMap<u32, u64> =
        state.index.entries_by_stream().into_iter().collect();
    let full = format!("{p}_replica_index_entries");
    header(
        &mut out,
        &full,
        "gauge",
        "Blocks the index holds for the replica (all its ranks): what its engines cache.",
    );
    for r in &replicas {
        let entries: u64 = r
            .index_ids()
            .iter()
            .filter_map(|id| entries_by_stream.get(id))
            .sum();
        let _ = writeln!(
            out,
            "{full}{{replica=\"{}\",model=\"{}\"}} {entries}",
            escape(&r.name),
            escape(&r.model)
        );
    }
    let full = format!("{p}_replica_in_flight");
    header(
        &mut out,
        &full,
        "gauge",
        "Requests routed to the replica and not completed.",
    );
    for r in &replicas {
        let _ = writeln!(
            out,
            "{full}{{replica=\"{}\",model=\"{}\"}} {}",
            escape(&r.name),
            escape(&r.model),
            r.in_flight.load(Ordering::Relaxed)
        );
    }
    replica_rates(&mut out, state, &replicas, p);
    ttft_accuracy(&mut out, state, p);
    route_duration(&mut out, state, p);
    token_agreement(&mut out, state, p);
    let full = format!("{p}_replica_healthy");
    header(
        &mut out,
        &full,
        "gauge",
        "1 when the replica is routable (not draining, metrics reachable).",
    );
    for r in &replicas {
        let _ = writeln!(
            out,
            "{full}{{replica=\"{}\",model=\"{}\"}} {}",
            escape(&r.name),
            escape(&r.model),
            u8::from(r.healthy())
        );
    }
    let full = format!("{p}_replica_stale");
    header(
        &mut out,
        &full,
        "gauge",
        "1 when the replica's index entries may be out of date.",
    );
    for r in &replicas {
        let _ = writeln!(
            out,
            "{full}{{replica=\"{}\",model=\"{}\"}} {}",
            escape(&r.name),
            escape(&r.model),
            u8::from(r.stale(stale_after))
        );
    }
    let full = format!("{p}_replica_hash_mismatch");
    header(
        &mut out,
        &full,
        "gauge",
        "1 when the hash self-check failed for the replica.",
    );
    for r in &replicas {
        let _ = writeln!(
            out,
            "{full}{{replica=\"{}\",model=\"{}\"}} {}",
            escape(&r.name),
            escape(&r.model),
            u8::from(lock(&r.hash_mismatch).is_some())
        );
    }
    for (name, help, f) in [
        (
            "replica_waiting",
            "Scraped vllm:num_requests_waiting.",
            (|s: &crate::membership::ScrapedLoad| s.waiting)
                as fn(&crate::membership::ScrapedLoad) -> f64,
        ),
        (
            "replica_running",
            "Scraped vllm:num_requests_running.",
            |s| s.running,
        ),
        (
            "replica_kv_usage",
            "Scraped vllm:kv_cache_usage_perc (0..1).",
            |s| s.kv_usage,
        ),
    ] {
        let full = format!("{p}_{name}");
        header(&mut out, &full, "gauge", help);
        for r in &replicas {
            let v = f(&lock(&r.scraped));
            let _ = writeln!(
                out,
                "{full}{{replica=\"{}\",model=\"{}\"}} {v}",
                escape(&r.name),
                escape(&r.model)
            );
        }
    }

    // Index.
    let stats = state.index.stats();
    for (name, help, v) in [
        (
            "index_entries",
            "(block, stream) entries in the index.",
            stats.entries as f64,
        ),
        (
            "index_blocks",
            "Distinct blocks in the index.",
            stats.blocks as f64,
        ),
        (
            "index_bytes",
            "Bytes used by the index (its own accounting).",
            stats.bytes_estimate as f64,
        ),
        (
            "index_max_bytes",
            "Configured index budget.",
            state.config.index.max_bytes as f64,
        ),
        (
            "index_predicted_entries",
            "Predicted entries (sibling bursts) alive.",
            stats.predicted_entries as f64,
        ),
    ] {
        let full = format!("{p}_{name}");
        header(&mut out, &full, "gauge", help);
        let _ = writeln!(out, "{full} {v}");
    }
    let full = format!("{p}_index_evictions_total");
    header(
        &mut out,
        &full,
        "counter",
        "Entries evicted to stay within the memory budget.",
    );
    let _ = writeln!(out, "{full} {}", stats.evicted_entries_for_budget);
    let full = format!("{p}_index_hash_block_events_total");
    header(
        &mut out,
        &full,
        "counter",
        "BlockStored events of one hash block inside a block (--prefix-match-unit), skipped.",
    );
    let _ = writeln!(out, "{full} {}", stats.hash_block_events);

    // Decisions.
    let full = format!("{p}_decisions_total");
    header(&mut out, &full, "counter", "Routing decisions by reason.");
    for (reason, n) in lock(&m.decisions).iter() {
        let _ = writeln!(
            out,
            "{full}{{reason=\"{}\",policy=\"{}\"}} {n}",
            escape(reason),
            state.policy.as_str()
        );
    }
    shadow_metrics(&mut out, state);
    let full = format!("{p}_route_errors_total");
    header(
        &mut out,
        &full,
        "counter",
        "Route requests refused, by HTTP status.",
    );
    for (status, n) in lock(&m.route_errors).iter() {
        let _ = writeln!(out, "{full}{{status=\"{status}\"}} {n}");
    }
    let counters = [
        (
            "routed_total",
            "Route requests answered with a replica.",
            &m.routed,
        ),
        (
            "completions_total",
            "POST /v1/complete calls.",
            &m.completions,
        ),
        (
            "completions_unknown_total",
            "Completions for an unknown (ended, expired or never routed) decision id.",
            &m.completions_unknown,
        ),
        (
            "completions_abandoned_total",
            "Completions reporting an abandoned request (client left, stream reset).",
            &m.completions_abandoned,
        ),
        (
            "completions_missing_id_total",
            "Completions refused (400) for lacking decision_id (filters older than the indexer).",
            &m.completions_missing_id,
        ),
        (
            "decisions_expired_total",
            "Decisions released at their deadline without a completion.",
            &state.load.stats.expired,
        ),
        (
            "decisions_evicted_total",
            "Decisions dropped because [inflight] max_pending were remembered.",
            &state.load.stats.evicted,
        ),
        (
            "decisions_abandoned_total",
            "Decisions released by an abandon (callout_id) before their answer reached the request.",
            &state.load.stats.abandoned,
        ),
        (
            "decisions_abandoned_before_route_total",
            "Abandons that arrived before their route call (that route was not counted).",
            &state.load.stats.abandoned_before_route,
        ),
        (
            "decisions_remote_evicted_total",
            "Peers' decisions dropped because [peers] max_remote_pending were counted.",
            &state.load.stats.remote_evicted,
        ),
        (
            "predicted_hit_tokens_total",
            "Matched tokens at decision time, for completions that reported cached_tokens.",
            &m.predicted_hit_tokens,
        ),
        (
            "reported_hit_tokens_total",
            "cached_tokens reported by completions.",
            &m.reported_hit_tokens,
        ),
        (
            "hit_prediction_exact_total",
            "Completions whose cached_tokens equals the prediction.",
            &m.hit_exact,
        ),
        (
            "hit_prediction_under_total",
            "Completions with more cached tokens than predicted.",
            &m.hit_under_predicted,
        ),
        (
            "hit_prediction_over_total",
            "Completions with fewer cached tokens than predicted.",
            &m.hit_over_predicted,
        ),
        (
            "hit_prediction_partial_total",
            "Completions of decisions made on a partial prompt (a chat with media): not compared.",
            &m.hit_prediction_partial,
        ),
        (
            "partial_predictions_total",
            "Decisions made on a partial prompt: a chat with media, keyed up to its first placeholder.",
            &m.partial_predictions,
        ),
        ("hash_checks_total", "Hash self-checks run.", &m.hash_checks),
        (
            "hash_mismatches_total",
            "Hash self-check mismatches.",
            &m.hash_mismatches,
        ),
        (
            "engine_restarts_detected_total",
            "Engine restarts detected from process_start_time_seconds.",
            &m.restarts_detected,
        ),
        (
            "snapshots_written_total",
            "Snapshots written.",
            &m.snapshots_written,
        ),
        (
            "snapshot_failures_total",
            "Snapshot write failures.",
            &m.snapshot_failures,
        ),
        (
            "scrape_failures_total",
            "Failed /metrics scrapes of replicas.",
            &m.scrape_failures,
        ),
    ];
    for (name, help, c) in counters {
        let full = format!("{p}_{name}");
        header(&mut out, &full, "counter", help);
        let _ = writeln!(out, "{full} {}", c.load(Ordering::Relaxed));
    }
    let full = format!("{p}_pending_requests");
    header(
        &mut out,
        &full,
        "gauge",
        "Routed requests awaiting /v1/complete.",
    );
    let _ = writeln!(out, "{full} {}", state.load.len());
    let full = format!("{p}_snapshot_index_lock_seconds");
    header(
        &mut out,
        &full,
        "gauge",
        "How long the last snapshot held the index lock (routing waited meanwhile).",
    );
    let _ = writeln!(
        out,
        "{full} {}",
        state.metrics.snapshot_lock_us.load(Ordering::Relaxed) as f64 / 1e6
    );
    let full = format!("{p}_allocator_option");
    header(
        &mut out,
        &full,
        "gauge",
        "mimalloc options the binary sets before main (purge_delay in ms, arena_eager_commit 0 = commit on demand), as in effect.",
    );
    for (option, value) in crate::allocator::in_effect() {
        let _ = writeln!(out, "{full}{{option=\"{option}\"}} {value}");
    }
    let full = format!("{p}_event_thread_wakeups_total");
    header(
        &mut out,
        &full,
        "counter",
        "Wake-ups of the event streams' thread (scheduling.event_coalesce_ms; 0 when the streams share the main runtime): event_batches_total over this is the batches read per wake-up.",
    );
    let _ = writeln!(out, "{full} {}", crate::scheduling::event_wakeups());
    let full = format!("{p}_uptime_seconds");
    header(&mut out, &full, "gauge", "Seconds since start.");
    let _ = writeln!(out, "{full} {}", state.started.elapsed().as_secs_f64());
    if let Some(link) = &state.peers {
        crate::peers::render_metrics(&mut out, link, state.load.remote_len(), p);
    }
    out
}

/// The rates each replica is scored with (calibrated, or the priors).
fn replica_rates(out: &mut String, state: &AppState, replicas: &[Arc<Replica>], p: &str) {
    let rates: Vec<_> = replicas
        .iter()
        .map(|r| {
            let windows = lock(&r.calibration).as_ref().map_or(0, |c| c.windows());
            let rates = crate::route::replica_rates(state, r);
            (r, rates, windows)
        })
        .collect();
    type Get = fn(&kvroute_core::scoring::ReplicaRates, u64) -> f64;
    let series: [(&str, &str, Get); 3] = [
        (
            "replica_prefill_tokens_per_second",
            "Prefill throughput the replica is scored with (its metrics after its model's, else the prior).",
            |r, _| r.prefill_tokens_per_s,
        ),
        (
            "replica_decode_step_seconds",
            "Step time (inter-token latency) the replica is scored with.",
            |r, _| r.decode_step_s,
        ),
        (
            "replica_calibration_windows",
            "Metric windows that calibrated the replica since it (or the indexer) started.",
            |_, w| w as f64,
        ),
    ];
    for (name, help, get) in series {
        let full = format!("{p}_{name}");
        header(out, &full, "gauge", help);
        for (r, rates, windows) in &rates {
            let _ = writeln!(
                out,
                "{full}{{replica=\"{}\",model=\"{}\"}} {}",
                escape(&r.name),
                escape(&r.model),
                get(rates, *windows)
            );
        }
    }
}

/// Per model: whether the filter's tokenizer digest differs from the indexer's, the online
/// checks' outcomes, and whether the engine's tokens were found to differ.
fn token_agreement(out: &mut String, state: &AppState, p: &str) {
    let mut models: Vec<_> = state.models.values().collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    let rows: Vec<(String, crate::agreement::AgreementView)> = models
        .iter()
        .map(|m| (escape(&m.name), lock(&m.agreement).view()))
        .collect();
    let full = format!("{p}_tokenizer_digest_mismatch");
    header(
        out,
        &full,
        "gauge",
        "1 when the filter's tokenizer digest differs from the indexer's in this part.",
    );
    for (model, v) in &rows {
        for part in ["tokenizer", "template", "options"] {
            let on = v.digest_differs.contains(&part);
            let _ = writeln!(
                out,
                "{full}{{model=\"{model}\",part=\"{part}\"}} {}",
                u8::from(on)
            );
        }
    }
    let full = format!("{p}_token_checks_total");
    header(
        out,
        &full,
        "counter",
        "Online checks of the filter's prompt tokens against the engine's, by result.",
    );
    for (model, v) in &rows {
        let _ = writeln!(
            out,
            "{full}{{model=\"{model}\",result=\"agree\"}} {}",
            v.agreed
        );
        let _ = writeln!(
            out,
            "{full}{{model=\"{model}\",result=\"disagree\"}} {}",
            v.disagreed
        );
    }
    let full = format!("{p}_token_mismatch");
    header(
        out,
        &full,
        "gauge",
        "1 while the engine's prompt tokens are known to differ from the filter's (the model fails open).",
    );
    for (model, v) in &rows {
        let _ = writeln!(out, "{full}{{model=\"{model}\"}} {}", u8::from(v.mismatch));
    }
}

/// How long route decisions took inside the indexer.
fn route_duration(out: &mut String, state: &AppState, p: &str) {
    let full = format!("{p}_route_duration_seconds");
    header(
        out,
        &full,
        "histogram",
        "Time /v1/route took inside the indexer, from its received body to its decision (parsing included; refusals of a well-formed body included).",
    );
    let (counts, sum) = state.metrics.route_duration.cumulative();
    let bounds = crate::state::ROUTE_DURATION_BUCKETS
        .iter()
        .map(|b| b.to_string());
    for (le, c) in bounds.chain(["+Inf".to_string()]).zip(&counts) {
        let _ = writeln!(out, "{full}_bucket{{le=\"{le}\"}} {c}");
    }
    let _ = writeln!(out, "{full}_sum {sum}");
    let _ = writeln!(out, "{full}_count {}", counts.last().copied().unwrap_or(0));
}

/// Observed / predicted TTFT per replica, as a histogram of the ratio.
fn ttft_accuracy(out: &mut String, state: &AppState, p: &str) {
    let full = format!("{p}_ttft_observed_over_predicted");
    header(
        out,
        &full,
        "histogram",
        "Time to first token the proxy saw divided by the one predicted, per replica.",
    );
    for (replica, a) in lock(&state.metrics.ttft_accuracy).iter() {
        let r = escape(replica);
        let mut cumulative = 0;
        for (i, bound) in crate::state::TTFT_RATIO_BUCKETS.iter().enumerate() {
            cumulative += a.counts[i];
            let _ = writeln!(
                out,
                "{full}_bucket{{replica=\"{r}\",le=\"{bound}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "{full}_bucket{{replica=\"{r}\",le=\"+Inf\"}} {}",
            a.count()
        );
        let _ = writeln!(out, "{full}_count{{replica=\"{r}\"}} {}", a.count());
        let _ = writeln!(
            out,
            "{p}_ttft_observed_seconds_sum{{replica=\"{r}\"}} {}",
            a.observed_s
        );
        let _ = writeln!(
            out,
            "{p}_ttft_predicted_seconds_sum{{replica=\"{r}\"}} {}",
            a.predicted_s
        );
    }
}

/// The shadow-mode totals, per model (docs/assess.md "Shadow mode").
fn shadow_metrics(out: &mut String, state: &AppState) {
    type Get = fn(&crate::shadow::ShadowTotals) -> u64;
    let rows: [(&str, &str, Get); 11] = [
        ("shadow_decisions_total", "Shadow decisions: route requests answered without routing.", |t| t.decisions),
        ("shadow_completions_total", "Completed shadowed requests (abandoned ones excluded).", |t| t.completions),
        ("shadow_agreed_total", "Shadowed requests whose real upstream was the replica kvroute would have chosen.", |t| t.agreed),
        ("shadow_unknown_upstream_total", "Shadowed requests whose real upstream was not reported or not a known replica.", |t| t.unknown_upstream),
        ("shadow_prompt_tokens_total", "Prompt tokens of shadowed requests that reported cached_tokens.", |t| t.prompt_tokens),
        ("shadow_predicted_hit_tokens_total", "Tokens kvroute predicted cached on the replica it would have chosen.", |t| t.predicted_hit_tokens),
        ("shadow_actual_cached_tokens_total", "cached_tokens the engine that really served the request reported.", |t| t.actual_cached_tokens),
        ("shadow_would_save_tokens_total", "Sum of max(0, predicted - actual cached): prefill kvroute would have saved.", |t| t.would_save_tokens),
        ("shadow_would_save_within_session_tokens_total", "Of that, prefill the same session had asked for before (what session affinity alone recovers).", |t| t.would_save_within_session_tokens),
        ("shadow_retained_hit_tokens_total", "Tokens the fleet would still have held, every shadowed request routed by prefix (the fleet as one cache).", |t| t.retained_hit_tokens),
        ("shadow_would_save_retained_tokens_total", "Sum of max(0, retained - actual cached): prefill routing by prefix would save, with what it keeps cached.", |t| t.would_save_retained_tokens),
    ];
    let totals = state.shadow.totals();
    for (name, help, get) in rows {
        let full = format!("kvroute_indexer_{name}");
        header(out, &full, "counter", help);
        for (model, t) in &totals {
            let _ = writeln!(out, "{full}{{model=\"{}\"}} {}", escape(model), get(t));
        }
    }
}
