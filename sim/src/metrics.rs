//! Prometheus metrics with vLLM's names, labels (`model_name`, `engine`), bucket bounds and
//! recording moments (vllm/v1/metrics/loggers.py, stats.py and buckets.py, 0.33.0). Every time is
//! on the simulated clock (model seconds, what a real vLLM on the modelled GPU would report),
//! never wall time, whatever `--time-scale` is.

use std::fmt::Write as _;
use std::sync::Arc;

/// vLLM's `TIME_TO_FIRST_TOKEN_BUCKETS` (buckets.py).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `REQUEST_LATENCY_BUCKETS` (buckets.py): e2e, queue, inference, prefill, decode.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's `INTER_TOKEN_LATENCY_BUCKETS` (buckets.py): inter-token latency and per-request TPOT.
pub const INTER_TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's `ITERATION_TOKENS_BUCKETS` (buckets.py; fixed in 0.33, not derived from
/// `--max-num-batched-tokens` as some older releases did).
pub const ITERATION_TOKENS_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// vLLM's `REQUEST_NUM_PREEMPTIONS_BUCKETS` (buckets.py).
pub const REQUEST_NUM_PREEMPTIONS_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];

/// vLLM's `build_1_2_5_buckets(max_value)` (buckets.py), the `request_tokens` family
/// (`max_value` = max_model_len): 1, 2, 5, 10, 20, 50, ... up to `max_value`.
pub fn build_1_2_5_buckets(max_value: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale: u64 = 1;
    loop {
        for m in [1u64, 2, 5] {
            let v = m.saturating_mul(scale);
            if v > max_value as u64 {
                return out;
            }
            out.push(v as f64);
        }
        scale = scale.saturating_mul(10);
    }
}

/// A cumulative histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Arc<[f64]>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with these upper bounds.
    pub fn new(bounds: &[f64]) -> Self {
        Histogram {
            bounds: bounds.into(),
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Upper bounds (without `+Inf`).
    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }
}

/// A finished request as vLLM's `FinishedRequestStats` (stats.py), simulated seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FinishedRequest {
    /// Arrival -> last token.
    pub e2e_s: f64,
    /// Queued -> first scheduled.
    pub queued_s: f64,
    /// First scheduled -> first token (preemptions included).
    pub prefill_s: f64,
    /// First token -> last token.
    pub decode_s: f64,
    /// First scheduled -> last token.
    pub inference_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens.
    pub generation_tokens: usize,
    /// Prefix-cache hit at first admission, tokens.
    pub cached_tokens: usize,
    /// Times preempted.
    pub preemptions: u32,
}

impl FinishedRequest {
    /// vLLM's `mean_time_per_output_token`: decode time / (outputs - 1), 0 for one output.
    pub fn mean_time_per_output_token(&self) -> f64 {
        if self.generation_tokens > 1 {
            self.decode_s / (self.generation_tokens - 1) as f64
        } else {
            0.0
        }
    }
}

/// One engine's metrics, updated by the engine loop.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    /// KV blocks of the engine and tokens per block (`vllm:cache_config_info`; 0 = not exported).
    pub cache_blocks: (usize, usize),
    /// `vllm:num_requests_running`.
    pub running: usize,
    /// `vllm:num_requests_waiting`.
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc` (fraction).
    pub kv_usage: f64,
    /// `vllm:prefix_cache_queries_total` (tokens, at admission).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total` (tokens, at admission); also
    /// `vllm:prompt_tokens_cached_by_source_total{source="device"}`.
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// `vllm:prompt_tokens_total` (at the first token).
    pub prompt_tokens: u64,
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}` (at the first token).
    pub prompt_tokens_computed: u64,
    /// `vllm:prompt_tokens_cached_total` and `..._by_source_total{source="local_cache_hit"}`
    /// (at the first token).
    pub prompt_tokens_cached: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
    /// `vllm:request_success_total{finished_reason="length"}`.
    pub requests_finished: u64,
    /// `vllm:time_to_first_token_seconds` (at the first token).
    pub ttft: Histogram,
    /// `vllm:inter_token_latency_seconds` (every later token).
    pub itl: Histogram,
    /// `vllm:iteration_tokens_total` (every step that outputs a token).
    pub iteration_tokens: Histogram,
    /// `vllm:e2e_request_latency_seconds` (this and the rest at finish).
    pub e2e: Histogram,
    /// `vllm:request_queue_time_seconds`.
    pub queue_time: Histogram,
    /// `vllm:request_prefill_time_seconds`.
    pub prefill_time: Histogram,
    /// `vllm:request_decode_time_seconds`.
    pub decode_time: Histogram,
    /// `vllm:request_inference_time_seconds`.
    pub inference_time: Histogram,
    /// `vllm:request_time_per_output_token_seconds`.
    pub tpot: Histogram,
    /// `vllm:request_prompt_tokens`.
    pub request_prompt_tokens: Histogram,
    /// `vllm:request_generation_tokens`.
    pub request_generation_tokens: Histogram,
    /// `vllm:request_prefill_kv_computed_tokens`.
    pub prefill_kv_computed: Histogram,
    /// `vllm:request_num_preemptions`.
    pub request_preemptions: Histogram,
    /// Scheduler steps run.
    pub steps: u64,
    /// Event batches handed to the publisher.
    pub event_batches: u64,
    /// Events in those batches.
    pub events: u64,
    /// Event batches dropped because the publisher queue was full.
    pub event_batches_dropped: u64,
    /// Distinct block hashes in the prefix cache now (what a router's index should hold).
    pub cached_blocks: usize,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self::new(40_960)
    }
}

impl EngineMetrics {
    /// Empty metrics; token-count histograms get vLLM's 1-2-5 buckets up to `max_model_len`.
    pub fn new(max_model_len: usize) -> Self {
        let tokens = build_1_2_5_buckets(max_model_len);
        EngineMetrics {
            cache_blocks: (0, 0),
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            prompt_tokens: 0,
            prompt_tokens_computed: 0,
            prompt_tokens_cached: 0,
            generation_tokens: 0,
            requests_finished: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(INTER_TOKEN_LATENCY_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_TOKENS_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inference_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            tpot: Histogram::new(INTER_TOKEN_LATENCY_BUCKETS),
            request_prompt_tokens: Histogram::new(&tokens),
            request_generation_tokens: Histogram::new(&tokens),
            prefill_kv_computed: Histogram::new(&tokens),
            request_preemptions: Histogram::new(REQUEST_NUM_PREEMPTIONS_BUCKETS),
            steps: 0,
            event_batches: 0,
            events: 0,
            event_batches_dropped: 0,
            cached_blocks: 0,
        }
    }

    /// A request's first token (vLLM's `is_prefilling` output): TTFT and the prompt counters.
    pub fn record_first_token(&mut self, ttft_s: f64, prompt_tokens: usize, cached_tokens: usize) {
        let cached = cached_tokens.min(prompt_tokens);
        self.ttft.observe(ttft_s);
        self.prompt_tokens += prompt_tokens as u64;
        self.prompt_tokens_computed += (prompt_tokens - cached) as u64;
        self.prompt_tokens_cached += cached as u64;
    }

    /// A finished request (vLLM's `finished_requests` loop in `PrometheusStatLogger.record`).
    pub fn record_finished(&mut self, r: &FinishedRequest) {
        self.requests_finished += 1;
        self.e2e.observe(r.e2e_s);
        self.queue_time.observe(r.queued_s);
        self.prefill_time.observe(r.prefill_s);
        self.inference_time.observe(r.inference_s);
        self.decode_time.observe(r.decode_s);
        self.request_preemptions.observe(f64::from(r.preemptions));
        let computed = r.prompt_tokens - r.cached_tokens.min(r.prompt_tokens);
        self.prefill_kv_computed.observe(computed as f64);
        self.request_prompt_tokens.observe(r.prompt_tokens as f64);
        self.request_generation_tokens
            .observe(r.generation_tokens as f64);
        self.tpot.observe(r.mean_time_per_output_token());
    }
}

/// Reads one sample value off an engine's metrics.
type Value = dyn Fn(&EngineMetrics) -> f64;
/// Picks one histogram of an engine's metrics.
type Pick = dyn Fn(&EngineMetrics) -> &Histogram;

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn fmt_f(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Appends the server's generation attempts (every completions request as it arrived, before
/// parsing) and the ones failed on purpose (`POST /admin/fail`).
pub fn render_attempts(out: &mut String, model_name: &str, received: u64, injected: u64) {
    let model = esc(model_name);
    for (name, help, v) in [
        (
            "kvroute_sim:generate_attempts",
            "Completions and chat completions requests received (each retry counts).",
            received,
        ),
        (
            "kvroute_sim:injected_failures",
            "Requests answered with an error by POST /admin/fail.",
            injected,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name}_total{{model_name=\"{model}\"}} {v}.0");
    }
}

/// Renders every engine's metrics in Prometheus text format.
pub fn render(model_name: &str, engines: &[EngineMetrics], process_start_s: f64) -> String {
    let mut out = String::new();
    let model = esc(model_name);
    let labels = |i: usize| format!("engine=\"{i}\",model_name=\"{model}\"");

    // One metric family: a sample per engine per `extra` label set.
    let family =
        |out: &mut String, name: &str, kind: &str, help: &str, series: &[(&str, &Value)]| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let sample = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            for (i, e) in engines.iter().enumerate() {
                for (extra, f) in series {
                    let _ = writeln!(out, "{sample}{{{}{extra}}} {}", labels(i), fmt_f(f(e)));
                }
            }
        };
    let scalar = |out: &mut String, name: &str, kind: &str, help: &str, f: &Value, extra: &str| {
        family(out, name, kind, help, &[(extra, f)])
    };
    // vLLM's `vllm:cache_config_info`: one sample of 1 whose labels are the cache config.
    if engines.iter().any(|e| e.cache_blocks.0 > 0) {
        let name = "vllm:cache_config_info";
        let _ = writeln!(
            out,
            "# HELP {name} Information of the LLMEngine CacheConfig"
        );
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (i, e) in engines.iter().enumerate() {
            let (blocks, block_size) = e.cache_blocks;
            let _ = writeln!(
                out,
                "{name}{{block_size=\"{block_size}\",enable_prefix_caching=\"True\",{},num_gpu_blocks=\"{blocks}\"}} 1.0",
                labels(i)
            );
        }
    }
    scalar(
        &mut out,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|e| e.running as f64,
        "",
    );
    scalar(
        &mut out,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|e| e.waiting as f64,
        "",
    );
    scalar(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|e| e.kv_usage,
        "",
    );
    scalar(
        &mut out,
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|e| e.prefix_cache_queries as f64,
        "",
    );
    scalar(
        &mut out,
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|e| e.prefix_cache_hits as f64,
        "",
    );
    scalar(
        &mut out,
        "vllm:num_preemptions",
        "counter",
        "Cumulative number of preemption from the engine.",
        &|e| e.preemptions as f64,
        "",
    );
    scalar(
        &mut out,
        "vllm:prompt_tokens",
        "counter",
        "Number of prefill tokens processed.",
        &|e| e.prompt_tokens as f64,
        "",
    );
    family(
        &mut out,
        "vllm:prompt_tokens_by_source",
        "counter",
        "Number of prompt tokens by source.",
        &[
            (",source=\"local_compute\"", &|e| {
                e.prompt_tokens_computed as f64
            }),
            (",source=\"local_cache_hit\"", &|e| {
                e.prompt_tokens_cached as f64
            }),
            (",source=\"external_kv_transfer\"", &|_| 0.0),
        ],
    );
    scalar(
        &mut out,
        "vllm:prompt_tokens_cached",
        "counter",
        "Number of cached prompt tokens (local + external).",
        &|e| e.prompt_tokens_cached as f64,
        "",
    );
    family(
        &mut out,
        "vllm:prompt_tokens_cached_by_source",
        "counter",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host \
         (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or \
         external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + \
         vllm:external_prefix_cache_hits.",
        &[
            (",source=\"device\"", &|e| e.prefix_cache_hits as f64),
            (",source=\"host\"", &|_| 0.0),
            (",source=\"p2p\"", &|_| 0.0),
            (",source=\"disk\"", &|_| 0.0),
            (",source=\"external_unspecified\"", &|_| 0.0),
        ],
    );
    scalar(
        &mut out,
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
        &|e| e.generation_tokens as f64,
        "",
    );
    scalar(
        &mut out,
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        &|e| e.requests_finished as f64,
        ",finished_reason=\"length\"",
    );
    scalar(
        &mut out,
        "kvroute_sim:steps",
        "counter",
        "Simulated scheduler steps.",
        &|e| e.steps as f64,
        "",
    );
    scalar(
        &mut out,
        "kvroute_sim:kv_event_batches",
        "counter",
        "KV event batches handed to the publisher.",
        &|e| e.event_batches as f64,
        "",
    );
    scalar(
        &mut out,
        "kvroute_sim:kv_events",
        "counter",
        "KV events handed to the publisher.",
        &|e| e.events as f64,
        "",
    );
    scalar(
        &mut out,
        "kvroute_sim:cached_blocks",
        "gauge",
        "Distinct block hashes in the prefix cache (the blocks a KV event subscriber should know).",
        &|e| e.cached_blocks as f64,
        "",
    );
    scalar(
        &mut out,
        "kvroute_sim:kv_event_batches_dropped",
        "counter",
        "KV event batches dropped because the publisher queue was full.",
        &|e| e.event_batches_dropped as f64,
        "",
    );

    let hist =
        |out: &mut String, name: &str, help: &str, f: &dyn Fn(&EngineMetrics) -> &Histogram| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
            for (i, e) in engines.iter().enumerate() {
                let h = f(e);
                let mut cum = 0u64;
                for (b, c) in h.bounds.iter().zip(&h.counts) {
                    cum += c;
                    let _ = writeln!(
                        out,
                        "{name}_bucket{{{},le=\"{}\"}} {}",
                        labels(i),
                        fmt_f(*b),
                        fmt_f(cum as f64)
                    );
                }
                let _ = writeln!(
                    out,
                    "{name}_bucket{{{},le=\"+Inf\"}} {}",
                    labels(i),
                    fmt_f(h.count as f64)
                );
                let _ = writeln!(
                    out,
                    "{name}_count{{{}}} {}",
                    labels(i),
                    fmt_f(h.count as f64)
                );
                let _ = writeln!(out, "{name}_sum{{{}}} {}", labels(i), fmt_f(h.sum));
            }
        };
    let histograms: [(&str, &str, &Pick); 13] = [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &|e| &e.ttft,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &|e| &e.e2e,
        ),
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &|e| &e.request_prompt_tokens,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &|e| &e.request_generation_tokens,
        ),
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &|e| &e.iteration_tokens,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &|e| &e.itl,
        ),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &|e| &e.tpot,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &|e| &e.queue_time,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &|e| &e.inference_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &|e| &e.prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &|e| &e.decode_time,
        ),
        (
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            &|e| &e.request_preemptions,
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &|e| &e.prefill_kv_computed,
        ),
    ];
    for (name, help, f) in histograms {
        hist(&mut out, name, help, f);
    }

    let _ = writeln!(
        out,
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds."
    );
    let _ = writeln!(out, "# TYPE process_start_time_seconds gauge");
    let _ = writeln!(out, "process_start_time_seconds {}", fmt_f(process_start_s));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_labels_and_buckets() {
        let mut e = EngineMetrics {
            prefix_cache_hits: 32,
            ..Default::default()
        };
        e.ttft.observe(0.03);
        let text = render("qwen3", &[e, EngineMetrics::default()], 1.5);
        assert!(
            text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"qwen3\"} 32.0")
        );
        assert!(text.contains("vllm:num_requests_waiting{engine=\"1\",model_name=\"qwen3\"} 0.0"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"qwen3\",le=\"0.04\"} 1.0"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"qwen3\",le=\"0.02\"} 0.0"));
        assert!(text.contains("process_start_time_seconds 1.5"));
    }

    #[test]
    fn one_two_five_buckets_as_vllm() {
        // vLLM's docstring example.
        assert_eq!(
            build_1_2_5_buckets(100),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(build_1_2_5_buckets(40_960).last(), Some(&20_000.0));
        assert!(build_1_2_5_buckets(0).is_empty());
    }

    #[test]
    fn first_token_and_finish_feed_the_calibration_series() {
        let mut e = EngineMetrics::new(1000);
        e.record_first_token(0.2, 300, 96);
        e.record_finished(&FinishedRequest {
            e2e_s: 1.2,
            queued_s: 0.05,
            prefill_s: 0.15,
            decode_s: 1.0,
            inference_s: 1.15,
            prompt_tokens: 300,
            generation_tokens: 11,
            cached_tokens: 96,
            preemptions: 0,
        });
        assert_eq!(
            (
                e.prompt_tokens,
                e.prompt_tokens_computed,
                e.prompt_tokens_cached
            ),
            (300, 204, 96)
        );
        assert_eq!(e.prefill_kv_computed.sum(), 204.0);
        assert!((e.tpot.sum() - 0.1).abs() < 1e-12);
        assert_eq!(e.request_prompt_tokens.bounds().last(), Some(&1000.0));
        let text = render("m", &[e], 0.0);
        let l = "engine=\"0\",model_name=\"m\"";
        for line in [
            format!("vllm:prompt_tokens_by_source_total{{{l},source=\"local_compute\"}} 204.0"),
            format!("vllm:prompt_tokens_by_source_total{{{l},source=\"local_cache_hit\"}} 96.0"),
            format!("vllm:prompt_tokens_cached_total{{{l}}} 96.0"),
            format!("vllm:request_prefill_time_seconds_bucket{{{l},le=\"0.3\"}} 1.0"),
            format!("vllm:request_decode_time_seconds_bucket{{{l},le=\"0.8\"}} 0.0"),
            format!("vllm:request_num_preemptions_bucket{{{l},le=\"1.0\"}} 1.0"),
            format!("vllm:request_prompt_tokens_bucket{{{l},le=\"500.0\"}} 1.0"),
            "# TYPE vllm:iteration_tokens_total histogram".to_string(),
        ] {
            assert!(text.contains(&line), "missing {line}");
        }
    }
}
