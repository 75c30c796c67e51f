//! The `kvroute-indexer` binary: `hash` against vLLM's golden vectors, config errors, and a
//! kill -9 / restart of `serve` under a running publisher (snapshot + replay).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-indexer");

fn golden() -> Value {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/golden_hashes.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn run_hash(input: &Value) -> Value {
    let mut child = Command::new(BIN)
        .arg("hash")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "hash failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn hash_cli_matches_vllm_golden_vectors() {
    let g = golden();
    let cases = g["cases"].as_array().unwrap();
    let wanted = [
        "sha256_bs16_40_partial_last",
        "sha256_bs16_lora_and_salt",
        "sha256_cbor_bs64_130",
        "sha256_cbor_bs16_two_mm_items_in_block0",
        "xxhash_cbor_bs64_seed_0_lora_salt",
        "sha256_bs16_1000",
    ];
    let mut checked = 0;
    for case in cases
        .iter()
        .filter(|c| wanted.contains(&c["name"].as_str().unwrap()))
    {
        let out = run_hash(&case["input"]);
        let exp = &case["output"];
        assert_eq!(
            out["block_hashes_hex"], exp["block_hashes_hex"],
            "{}",
            case["name"]
        );
        assert_eq!(
            out["wire_block_hashes_u64"], exp["wire_block_hashes_u64"],
            "{}",
            case["name"]
        );
        assert_eq!(
            out["none_hash_hex"], exp["none_hash_hex"],
            "{}",
            case["name"]
        );
        checked += 1;
    }
    assert_eq!(checked, wanted.len());
}

#[test]
fn hash_cli_refuses_unreproducible_setups() {
    let mut child = Command::new(BIN)
        .arg("hash")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(
            json!({"algo": "xxhash", "block_size": 16, "token_ids": [1]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .to_lowercase()
        .contains("seed"));
}

fn serve_with_config(text: &str) -> std::process::Output {
    let path = std::env::temp_dir().join(format!(
        "kvroute-badcfg-{}-{}.toml",
        std::process::id(),
        text.len()
    ));
    std::fs::write(&path, text).unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    out
}

#[test]
fn config_errors_name_the_field() {
    let cases = [
        ("[[models]]\nname = \"m\"\n[[models.replicas]]\nname = \"r0\"\nhttp = \"localhost\"\n", "models[0].replicas[0].http"),
        ("[[models]]\nname = \"m\"\n[models.hash]\nalgo = \"md5\"\n", "models[0].hash.algo"),
        ("[[models]]\nname = \"m\"\n[models.hash]\nalgo = \"xxhash\"\n", "models[0].hash.seed"),
        ("[index]\nmax_bytes = 10\n[[models]]\nname = \"m\"\n", "index.max_bytes"),
        ("[[models]]\nname = \"m\"\nblok_size = 16\n", "blok_size"),
        ("[[models]]\nname = \"m\"\n[[models.replicas]]\nname = \"r0\"\nhttp = \"127.0.0.1:1\"\nevents = [\"127.0.0.1:5557\"]\n", "models[0].replicas[0].events[0]"),
    ];
    for (text, field) in cases {
        let out = serve_with_config(text);
        assert!(!out.status.success(), "{field}: should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(field),
            "error for {field} does not name it: {err}"
        );
    }
}

struct Indexer {
    child: Child,
    base: String,
}

impl Indexer {
    fn start(config: &std::path::Path) -> Indexer {
        Self::start_with(config, |_| {})
    }

    /// As [`Indexer::start`], with `setup` adjusting the command (its environment) first.
    fn start_with(config: &std::path::Path, setup: impl FnOnce(&mut Command)) -> Indexer {
        let mut cmd = Command::new(BIN);
        setup(&mut cmd);
        let mut child = cmd
            .args(["serve", "--config"])
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected: {line:?}"))
            .to_string();
        Indexer {
            child,
            base: format!("http://{addr}"),
        }
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn lookup(c: &reqwest::Client, base: &str, tokens: &[u32]) -> u64 {
    let v: Value = c
        .post(format!("{base}/debug/lookup"))
        .json(&json!({"model": "m", "token_ids": tokens}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["replicas"][0]["blocks"]["gpu"].as_u64().unwrap()
}

async fn stream_info(c: &reqwest::Client, base: &str) -> Value {
    let v: Value = c
        .get(format!("{base}/debug/replicas"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["replicas"][0]["streams"][0].clone()
}

async fn wait_http<F: Fn(&Value) -> bool>(c: &reqwest::Client, base: &str, f: F) -> Value {
    let start = std::time::Instant::now();
    loop {
        if let Ok(r) = c.get(format!("{base}/debug/replicas")).send().await {
            if let Ok(v) = r.json::<Value>().await {
                let s = v["replicas"][0]["streams"][0].clone();
                if f(&s) {
                    return s;
                }
                if start.elapsed() > Duration::from_secs(15) {
                    panic!("condition not reached: {s}");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Snapshots the indexer has written (`snapshots_written_total`).
async fn snapshots_written(c: &reqwest::Client, base: &str) -> f64 {
    kvroute_core::prometheus::sum(
        &metrics_text(c, base).await,
        "kvroute_indexer_snapshots_written_total",
    )
    .unwrap_or(0.0)
}

/// The allocator options `/metrics` reports, by name.
async fn allocator_options(c: &reqwest::Client, base: &str) -> Vec<(String, i64)> {
    metrics_text(c, base)
        .await
        .lines()
        .filter_map(|l| l.strip_prefix("kvroute_indexer_allocator_option{option=\""))
        .filter_map(|l| {
            let (name, rest) = l.split_once("\"} ")?;
            Some((name.to_string(), rest.trim().parse().ok()?))
        })
        .collect()
}

/// The shipped binary sets its allocator up before `main` (a 10 ms purge delay and arenas
/// committed on demand: docs/operations.md, "Sizing"); mimalloc's own environment still wins.
#[tokio::test]
async fn the_binary_sets_its_allocator_up_before_main_and_the_environment_wins() {
    let dir = std::env::temp_dir().join(format!("kvroute-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg_path = dir.join("indexer.toml");
    std::fs::write(&cfg_path, config_text(&[], "")).unwrap();
    let c = reqwest::Client::new();
    let quiet = |cmd: &mut Command| {
        cmd.env_remove("MIMALLOC_PURGE_DELAY")
            .env_remove("MIMALLOC_ARENA_EAGER_COMMIT");
    };
    let ix = Indexer::start_with(&cfg_path, quiet);
    assert_eq!(
        allocator_options(&c, &ix.base).await,
        [
            ("arena_eager_commit".to_string(), 0),
            ("purge_delay".to_string(), 10)
        ],
        "mimalloc's defaults (2 and 1000) would mean the pre-main set-up did not run"
    );
    drop(ix);
    let ix = Indexer::start_with(&cfg_path, |cmd| {
        quiet(cmd);
        cmd.env("MIMALLOC_PURGE_DELAY", "250");
    });
    assert_eq!(
        allocator_options(&c, &ix.base).await,
        [
            ("arena_eager_commit".to_string(), 0),
            ("purge_delay".to_string(), 250)
        ]
    );
    drop(ix);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_and_restart_resumes_from_snapshot_and_replay() {
    let mut p = Publisher::start(0, 0).await;
    let dir = std::env::temp_dir().join(format!("kvroute-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.join("index.snap");
    let cfg = config_text(
        &[("r0", free_port(), p.pub_port, p.replay_port, false)],
        &format!(
            "[snapshot]\npath = \"{}\"\ninterval_ms = 100\n",
            snap.display()
        ),
    );
    let cfg_path = dir.join("indexer.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let c = reqwest::Client::new();

    let ix = Indexer::start(&cfg_path);
    wait_http(&c, &ix.base, |s| s["connected"] == true).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (i * 1000..i * 1000 + 4 * (i + 1) + 1).collect())
        .collect();
    for (i, pr) in prompts.iter().enumerate().take(5) {
        let n = i + 1;
        let hashes: Vec<u64> = (0..n as u64).map(|b| 10_000 * (i as u64 + 1) + b).collect();
        p.publish(vec![stored(&hashes, None, &pr[..4 * n], 4)])
            .await;
    }
    let last = p.next_seq - 1;
    wait_http(&c, &ix.base, |s| s["last_seq"] == json!(last)).await;
    let mut before = Vec::new();
    for pr in &prompts {
        before.push(lookup(&c, &ix.base, pr).await);
    }
    assert_eq!(before, vec![1, 2, 3, 4, 5, 0]);
    // Let a snapshot capture everything (two more written: the first may have begun before the
    // last batch was applied), then kill -9.
    let written = snapshots_written(&c, &ix.base).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while snapshots_written(&c, &ix.base).await < written + 2.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no snapshot written within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    drop(ix);
    assert!(snap.exists(), "snapshot written");

    // While the indexer is down the engine keeps going; its replay buffer has rotated so that
    // only the batches from the last one the indexer saw are left: the older state can only
    // come back from the snapshot.
    p.publish(vec![stored(
        &[60_000, 60_001, 60_002, 60_003, 60_004, 60_005],
        None,
        &prompts[5][..24],
        4,
    )])
    .await;
    p.publish(vec![removed(&[50_004])]).await;
    p.forget_before(last);

    let ix = Indexer::start(&cfg_path);
    let s = wait_http(&c, &ix.base, |s| {
        s["connected"] == true && s["last_seq"] == json!(last + 2)
    })
    .await;
    let mut after = Vec::new();
    for pr in &prompts {
        after.push(lookup(&c, &ix.base, pr).await);
    }
    assert_eq!(
        after,
        vec![1, 2, 3, 4, 4, 6],
        "snapshot + replay reproduce the engine's state"
    );
    assert_eq!(s["resets"], 0, "{s}");
    assert!(s["replays"].as_u64().unwrap() >= 1);

    // Live events keep flowing after the restart.
    p.publish(vec![removed(&[10_000])]).await;
    wait_http(&c, &ix.base, |s| s["last_seq"] == json!(last + 3)).await;
    assert_eq!(lookup(&c, &ix.base, &prompts[0]).await, 0);
    let _ = stream_info(&c, &ix.base).await;
    drop(ix);
    let _ = std::fs::remove_dir_all(&dir);
}
