//! The operator's view (issue 17): every PromQL expression of the Grafana dashboard
//! (`deploy/grafana/kvroute-dashboard.json`) and of the alert rules
//! (`deploy/prometheus/kvroute-alerts.yml`) parses with a real PromQL parser (`promql-parser`), and
//! every metric it selects is one that running processes export: Envoy with the real filter
//! (`/stats/prometheus`), the real indexer (`/metrics`) and a `kvroute-sim` replica (vLLM's names).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use promql_parser::label::MatchOp;
use promql_parser::parser::{self, Expr, VectorSelector};
use serde_json::{json, Value};

/// Grafana's interval variables, replaced by a duration before parsing.
const GRAFANA_VARIABLES: [&str; 3] = ["$__rate_interval", "$__interval", "$__range"];

/// (where, expression) of every dashboard target.
fn dashboard_exprs() -> Vec<(String, String)> {
    let path = workspace().join("deploy/grafana/kvroute-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("read the dashboard");
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    let mut walk = vec![&dash["panels"]];
    while let Some(panels) = walk.pop() {
        for p in panels.as_array().into_iter().flatten() {
            walk.push(&p["panels"]);
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"].as_str().expect("every target has an expr");
                out.push((
                    format!("panel {:?} {}", p["title"], t["refId"]),
                    expr.to_string(),
                ));
            }
        }
    }
    out
}

/// (alert, expression) of every rule; each `- alert:` has exactly one one-line `expr:`.
fn rule_exprs() -> Vec<(String, String)> {
    let path = workspace().join("deploy/prometheus/kvroute-alerts.yml");
    let text = std::fs::read_to_string(&path).expect("read the alert rules");
    let mut out: Vec<(String, String)> = Vec::new();
    let mut alert = None;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert:") {
            assert!(alert.is_none(), "{alert:?} has no expr");
            alert = Some(name.trim().to_string());
        } else if let Some(expr) = line.strip_prefix("expr:") {
            let name = alert.take().expect("an expr belongs to an alert");
            out.push((format!("alert {name}"), expr.trim().to_string()));
        }
    }
    assert!(alert.is_none(), "{alert:?} has no expr");
    out
}

/// Every vector selector of `expr` (matrix selectors' too).
fn selectors<'a>(expr: &'a Expr, out: &mut Vec<&'a VectorSelector>) {
    match expr {
        Expr::Aggregate(a) => {
            selectors(&a.expr, out);
            if let Some(p) = &a.param {
                selectors(p, out);
            }
        }
        Expr::Unary(u) => selectors(&u.expr, out),
        Expr::Binary(b) => {
            selectors(&b.lhs, out);
            selectors(&b.rhs, out);
        }
        Expr::Paren(p) => selectors(&p.expr, out),
        Expr::Subquery(s) => selectors(&s.expr, out),
        Expr::VectorSelector(v) => out.push(v),
        Expr::MatrixSelector(m) => out.push(&m.vs),
        Expr::Call(c) => c.args.args.iter().for_each(|a| selectors(a, out)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// The metric names `selector` can select among `exported` (empty: none).
fn selected(selector: &VectorSelector, exported: &BTreeSet<String>) -> Vec<String> {
    let by_name: Vec<_> = selector
        .matchers
        .matchers
        .iter()
        .filter(|m| m.name == "__name__")
        .collect();
    exported
        .iter()
        .filter(|n| {
            selector
                .name
                .as_deref()
                .is_none_or(|want| want == n.as_str())
        })
        .filter(|n| by_name.iter().all(|m| m.is_match(n)))
        .cloned()
        .collect()
}

/// The names a Prometheus text exposition exports: its samples', and those of every declared
/// family (`# TYPE`), which a counter with no label set yet (`route_errors_total{status}`) has
/// without samples.
fn names(text: &str) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (words.next(), words.next(), words.next(), words.next())
        {
            let suffixes: &[&str] = match kind {
                "counter" if !name.ends_with("_total") => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            out.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        }
    }
    out
}

/// Checks `exprs`; returns one line per problem.
fn problems(exprs: &[(String, String)], exported: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for (place, raw) in exprs {
        let expr = GRAFANA_VARIABLES
            .iter()
            .fold(raw.clone(), |e, v| e.replace(v, "5m"));
        let ast = match parser::parse(&expr) {
            Ok(ast) => ast,
            Err(e) => {
                out.push(format!("{place}: does not parse: {e}: {raw}"));
                continue;
            }
        };
        let mut found = Vec::new();
        selectors(&ast, &mut found);
        if found.is_empty() {
            out.push(format!("{place}: selects no metric: {raw}"));
        }
        for s in found {
            if selected(s, exported).is_empty() {
                out.push(format!(
                    "{place}: {s} matches no metric kvroute or the replicas export"
                ));
            }
        }
    }
    out
}

#[test]
fn dashboard_and_alert_queries_parse_and_name_only_exported_metrics() {
    // A live stack: one replica, the indexer, Envoy with the filter; two requests so that the
    // per-request series (histograms, calibration, predictions) exist.
    let dir = scratch("dashboard-queries");
    let plan = Sim::plan("r0");
    let mut indexer = Indexer::start(std::slice::from_ref(&plan), &dir);
    let sim = Sim::start(&plan, &dir);
    indexer.wait_ready();
    let envoy = Envoy::start(
        "envoy",
        &EnvoyOptions::new(
            indexer.port,
            vec![sim.addr()],
            json!({"route_timeout_ms": 2000, "models": {"qwen3": {}}}),
        ),
        &dir,
    );
    envoy.wait_tokenizers(1);
    for i in 0..2 {
        let body = json!({"model": "qwen3", "max_tokens": 4, "stream": i == 1,
            "messages": [{"role": "user", "content": filler(7, 300)}]});
        let r = post_json(envoy.port, "/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    wait_for("completion reports", Duration::from_secs(10), || {
        envoy.kv("complete_sent") >= 2
    });

    let mut exported = BTreeSet::new();
    for (what, port, path) in [
        ("Envoy with the filter", envoy.admin, "/stats/prometheus"),
        ("the indexer", indexer.port, "/metrics"),
        ("a replica", sim.port, "/metrics"),
    ] {
        let r = http(port, "GET", path, &[], b"");
        assert_eq!(r.status, 200, "{what}: {}", r.text());
        let got = names(&r.text());
        assert!(got.len() > 10, "{what} exports {got:?}");
        exported.extend(got);
    }
    for must in [
        "kvroute_requests",
        "kvroute_fail_open_indexer_timeout",
        "kvroute_indexer_decisions_total",
        "vllm:prefix_cache_hits_total",
    ] {
        assert!(exported.contains(must), "{must} not scraped: {exported:?}");
    }

    let dashboard = dashboard_exprs();
    let rules = rule_exprs();
    assert!(
        dashboard.len() >= 40,
        "{} dashboard queries",
        dashboard.len()
    );
    assert!(rules.len() >= 15, "{} alert rules", rules.len());
    let all: Vec<_> = dashboard.into_iter().chain(rules).collect();
    let found = problems(&all, &exported);
    assert!(found.is_empty(), "{}", found.join("\n"));

    // The check can fail: a misspelt name, a regex matching nothing, and a syntax error.
    let broken = [
        (
            "typo".to_string(),
            "rate(vllm:prefix_cache_hit_total[5m])".to_string(),
        ),
        (
            "regex".to_string(),
            r#"sum({__name__=~"kvroute_failopen_.+"})"#.to_string(),
        ),
        (
            "syntax".to_string(),
            "sum(rate(kvroute_requests[5m])".to_string(),
        ),
    ];
    let found = problems(&broken, &exported);
    assert_eq!(found.len(), 3, "{found:?}");
}

#[test]
fn matching_follows_names_and_name_regexes() {
    let exported: BTreeSet<String> = ["kvroute_fail_open_bad_answer", "kvroute_requests"]
        .into_iter()
        .map(String::from)
        .collect();
    let pick = |q: &str| {
        let ast = parser::parse(q).expect("parses");
        let mut found = Vec::new();
        selectors(&ast, &mut found);
        found
            .iter()
            .map(|s| selected(s, &exported))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        pick(r#"{__name__=~"kvroute_fail_open_.+"} / kvroute_requests"#),
        vec![
            vec!["kvroute_fail_open_bad_answer".to_string()],
            vec!["kvroute_requests".to_string()]
        ]
    );
    assert_eq!(pick("kvroute_missing"), vec![Vec::<String>::new()]);
    assert!(matches!(
        parser::parse(r#"x{a=~"b"}"#).map(|e| match e {
            Expr::VectorSelector(v) => v
                .matchers
                .matchers
                .iter()
                .any(|m| matches!(m.op, MatchOp::Re(_))),
            _ => false,
        }),
        Ok(true)
    ));
    assert_eq!(
        names("# HELP x y\nx_total{a=\"1\"} 2\ny 3\n# TYPE z_total counter\n# TYPE h histogram\n"),
        ["h_bucket", "h_count", "h_sum", "x_total", "y", "z_total"]
            .into_iter()
            .map(String::from)
            .collect()
    );
}
