//! The assess HTML report opened in a real headless Chromium (Debian's `chromium`, installed by
//! `cargo xtask setup`; `KVROUTE_CHROMIUM` names another binary): the page loads with no network,
//! its title is right and its three plots are in the DOM with their marks.

use std::collections::BTreeMap;
use std::process::Command;

use kvroute_indexer::assess::{build_full, html, ReplicaReading, Sample, Thresholds};

fn reading(replica: &str, queries: f64, hits: f64, dup: u64, recomputed: u64) -> ReplicaReading {
    ReplicaReading {
        replica: replica.into(),
        model: "qwen3".into(),
        cache_query_tokens: queries,
        cache_hit_tokens: hits,
        computed_tokens: queries - hits,
        duplicated_blocks: dup,
        recomputed_blocks: recomputed,
        prefill_tokens_per_s: 10_000.0,
        ..ReplicaReading::default()
    }
}

#[test]
fn the_html_report_renders_its_plots_in_headless_chromium() {
    let bin = std::env::var("KVROUTE_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let found = Command::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "NOT RUN (not a pass): no headless browser: `{bin} --version` failed. Run `cargo xtask \
         setup` (it installs Debian's chromium with apt-get) or set KVROUTE_CHROMIUM"
    );
    // Ten intervals of two replicas: duplicated prefill and recomputation growing.
    let samples: Vec<Sample> = (0..=10u64)
        .map(|i| Sample {
            t_s: i as f64 * 6.0,
            readings: vec![
                reading("r0", 1_000.0 * i as f64, 600.0 * i as f64, 0, i * i),
                reading("r1", 1_000.0 * i as f64, 100.0 * i as f64, 5 * i * i, 0),
            ],
        })
        .collect();
    let (start, end) = (&samples[0].readings, &samples[10].readings);
    let report = build_full(
        start,
        end,
        &[("qwen3".into(), 16)],
        60.0,
        Thresholds::default(),
        &BTreeMap::new(),
        &samples,
    );
    let page = html::page(&report);
    for external in ["<script", "src=", "href=", "@import"] {
        assert!(!page.contains(external), "self-contained: {external}");
    }

    let dir = std::env::temp_dir().join(format!("kvroute-assess-html-{}", std::process::id()));
    let profile = dir.join("profile");
    std::fs::create_dir_all(&profile).expect("temp dir");
    let file = dir.join("assess.html");
    std::fs::write(&file, &page).expect("write page");
    let out = Command::new(&bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", file.display()))
        .output()
        .expect("run chromium");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(dom.contains("<title>kvroute assess</title>"), "{dom}");
    for id in ["duplicated-prefill", "hit-rate", "thrash"] {
        assert!(
            dom.contains(&format!("<svg id=\"{id}\"")),
            "plot {id} missing: {dom}"
        );
    }
    assert_eq!(
        dom.matches("<rect class=\"bar\"").count(),
        2,
        "one bar per replica"
    );
    assert_eq!(
        dom.matches("<path class=\"series\"").count(),
        3,
        "duplicated prefill, and thrash's two series (recomputed, beyond the fleet's KV)"
    );
    assert!(dom.contains(" L"), "the lines have points: {dom}");
}
