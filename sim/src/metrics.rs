//! Prometheus metrics with vLLM's names, labels (`model_name`, `engine`) and bucket bounds
//! (vllm/v1/metrics/loggers.py and buckets.py, 0.33.0).

use std::fmt::Write as _;

/// vLLM's `TIME_TO_FIRST_TOKEN_BUCKETS`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `REQUEST_LATENCY_BUCKETS`.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with these upper bounds.
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
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
}

/// One engine's metrics, updated by the engine loop.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running`.
    pub running: usize,
    /// `vllm:num_requests_waiting`.
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc` (fraction).
    pub kv_usage: f64,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
    /// `vllm:request_success_total{finished_reason="length"}`.
    pub requests_finished: u64,
    /// `vllm:time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// `vllm:e2e_request_latency_seconds`.
    pub e2e: Histogram,
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
        EngineMetrics {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            requests_finished: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            steps: 0,
            event_batches: 0,
            events: 0,
            event_batches_dropped: 0,
            cached_blocks: 0,
        }
    }
}

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

/// Renders every engine's metrics in Prometheus text format.
pub fn render(model_name: &str, engines: &[EngineMetrics], process_start_s: f64) -> String {
    let mut out = String::new();
    let model = esc(model_name);
    let labels = |i: usize| format!("engine=\"{i}\",model_name=\"{model}\"");

    let scalar = |out: &mut String,
                  name: &str,
                  kind: &str,
                  help: &str,
                  f: &dyn Fn(&EngineMetrics) -> f64,
                  extra: &str| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let sample = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.to_string()
        };
        for (i, e) in engines.iter().enumerate() {
            let _ = writeln!(out, "{sample}{{{}{extra}}} {}", labels(i), fmt_f(f(e)));
        }
    };
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
    hist(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &|e| &e.ttft,
    );
    hist(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &|e| &e.e2e,
    );

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
}
