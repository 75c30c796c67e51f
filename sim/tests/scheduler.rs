//! The scheduler and cost model: chunked prefill, max-num-seqs queueing, preemption, and TTFT
//! that grows with uncached prefill and with queueing (simulated clock, no sleeping).

use std::sync::Arc;

use kvroute_sim::latency::LatencyModel;
use kvroute_sim::scheduler::{Scheduler, SchedulerConfig};
use kvroute_sim::sequence::{SeqMeta, Sequence, SequenceSpec, TokenSource, ToyHasher};

const BS: usize = 16;

fn cfg(max_num_seqs: usize, max_batched: usize, blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: max_batched,
        num_gpu_blocks: blocks,
        block_size: BS,
        kv_cache_groups: vec![kvroute_core::hybrid::GroupKind::FullAttention],
        max_model_len: 1 << 20,
        hash_block_size: BS,
    }
}

fn seq(id: u64, prompt: Vec<u32>, max_tokens: usize, arrival_s: f64) -> Sequence {
    Sequence::new(
        SequenceSpec {
            id,
            prompt,
            max_tokens,
            meta: Arc::new(SeqMeta::default()),
            report_full: false,
            source: TokenSource::new(id, 1000),
            arrival_s,
        },
        BS,
        Arc::new(ToyHasher),
    )
}

fn prompt(base: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

/// Runs the scheduler on a simulated clock until idle; returns (id, ttft, e2e, cached) per
/// finished sequence and the number of steps.
fn run(
    s: &mut Scheduler,
    model: &LatencyModel,
    mut now: f64,
) -> (Vec<(u64, f64, f64, usize)>, usize) {
    let mut done = Vec::new();
    let mut steps = 0;
    while s.has_work() {
        let plan = s.schedule();
        assert!(!plan.is_empty(), "scheduler stalled");
        now += model.step_seconds(&plan.shape);
        steps += 1;
        let out = s.finish_step(plan, now);
        for f in out.finished {
            done.push((
                f.id,
                f.first_token_s.unwrap_or(now) - f.arrival_s,
                now - f.arrival_s,
                f.cached_tokens.unwrap_or(0),
            ));
        }
        assert!(steps < 100_000);
    }
    (done, steps)
}

#[test]
fn chunked_prefill_splits_long_prompts_by_the_token_budget() {
    let mut s = Scheduler::new(cfg(8, 512, 1000), false).unwrap();
    s.add(seq(1, prompt(0, 1300), 1, 0.0));
    let mut chunks = Vec::new();
    while s.has_work() {
        let plan = s.schedule();
        chunks.push(plan.shape.prefill_tokens);
        s.finish_step(plan, 0.0);
    }
    assert_eq!(chunks, vec![512, 512, 276]);
}

#[test]
fn decode_and_prefill_share_a_step() {
    let mut s = Scheduler::new(cfg(8, 512, 1000), false).unwrap();
    s.add(seq(1, prompt(0, 100), 10, 0.0));
    let p = s.schedule();
    s.finish_step(p, 0.0);
    s.add(seq(2, prompt(5000, 600), 1, 0.0));
    let p = s.schedule();
    // The running sequence decodes one token; the newcomer gets the rest of the budget.
    assert_eq!(p.shape.decode_seqs, 1);
    assert_eq!(p.shape.prefill_tokens, 511);
    s.finish_step(p, 0.0);
}

#[test]
fn max_num_seqs_queues_the_rest_fifo() {
    let mut s = Scheduler::new(cfg(2, 8192, 1000), false).unwrap();
    for i in 0..5 {
        s.add(seq(i, prompt(1000 * i as u32, 40), 4, 0.0));
    }
    let p = s.schedule();
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.num_waiting(), 3);
    s.finish_step(p, 0.0);
    let (done, _) = run(&mut s, &LatencyModel::default(), 0.0);
    let order: Vec<u64> = done.iter().map(|d| d.0).collect();
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
}

#[test]
fn ttft_grows_with_uncached_prefill() {
    let model = LatencyModel::default();
    let ttft_for = |len: usize| {
        let mut s = Scheduler::new(cfg(8, 8192, 4000), false).unwrap();
        s.add(seq(1, prompt(0, len), 1, 0.0));
        run(&mut s, &model, 0.0).0[0].1
    };
    let short = ttft_for(256);
    let long = ttft_for(8192);
    let longer = ttft_for(16384);
    assert!(short < long && long < longer, "{short} {long} {longer}");
    // ~30k tokens/s: 8k tokens take ~0.27 s of prefill.
    assert!((0.2..0.4).contains(&long), "{long}");
}

#[test]
fn a_prefix_hit_cuts_ttft_and_reports_cached_tokens() {
    let model = LatencyModel::default();
    let mut s = Scheduler::new(cfg(8, 8192, 4000), false).unwrap();
    let p = prompt(0, 8000);
    s.add(seq(1, p.clone(), 1, 0.0));
    let cold = run(&mut s, &model, 0.0).0[0];
    s.add(seq(2, p, 1, 100.0));
    let warm = run(&mut s, &model, 100.0).0[0];
    assert_eq!(cold.3, 0);
    assert_eq!(warm.3, (8000 - 1) / BS * BS);
    assert!(warm.1 < cold.1 / 5.0, "warm {} cold {}", warm.1, cold.1);
    let st = s.stats();
    assert_eq!(st.prefix_cache_queries, 16000);
    assert_eq!(st.prefix_cache_hits, warm.3 as u64);
}

#[test]
fn ttft_grows_with_queueing() {
    let model = LatencyModel::default();
    let mut s = Scheduler::new(cfg(1, 8192, 4000), false).unwrap();
    for i in 0..4 {
        s.add(seq(i, prompt(10_000 * i as u32, 2000), 20, 0.0));
    }
    let (done, _) = run(&mut s, &model, 0.0);
    let ttfts: Vec<f64> = done.iter().map(|d| d.1).collect();
    for w in ttfts.windows(2) {
        assert!(w[1] > w[0] + 0.05, "{ttfts:?}");
    }
}

#[test]
fn preemption_when_kv_runs_out_recomputes_and_counts() {
    // 1 null + 10 usable blocks of 16 = 160 tokens. Two sequences of 64-token prompts that each
    // grow to 64 + 60 tokens cannot both finish without preempting one.
    let mut s = Scheduler::new(cfg(8, 8192, 11), false).unwrap();
    s.add(seq(1, prompt(0, 64), 60, 0.0));
    s.add(seq(2, prompt(1000, 64), 60, 0.0));
    let (done, _) = run(&mut s, &LatencyModel::default(), 0.0);
    assert_eq!(done.len(), 2);
    assert!(s.stats().preemptions >= 1);
    // Preempted sequences do not count again as prefix-cache queries.
    assert_eq!(s.stats().prefix_cache_queries, 128);
    assert_eq!(s.kv().pool().num_free(), 10);
}

#[test]
fn requests_that_do_not_fit_wait_for_blocks() {
    // 10 usable blocks; a 120-token prompt needs 8: the second must wait for the first to end.
    let mut s = Scheduler::new(cfg(8, 8192, 11), false).unwrap();
    s.add(seq(1, prompt(0, 120), 4, 0.0));
    s.add(seq(2, prompt(1000, 120), 4, 0.0));
    let p = s.schedule();
    assert_eq!(s.num_running(), 1);
    assert_eq!(s.num_waiting(), 1);
    s.finish_step(p, 0.0);
    let (done, _) = run(&mut s, &LatencyModel::default(), 0.0);
    assert_eq!(done.len(), 2);
    assert_eq!(s.stats().preemptions, 0);
}

#[test]
fn abort_frees_blocks() {
    let mut s = Scheduler::new(cfg(8, 8192, 100), false).unwrap();
    s.add(seq(1, prompt(0, 100), 50, 0.0));
    let p = s.schedule();
    s.finish_step(p, 0.0);
    assert!(s.kv_usage() > 0.0);
    assert!(s.abort(1));
    assert_eq!(s.kv_usage(), 0.0);
    assert!(!s.has_work());
}

#[test]
fn phase_timestamps_survive_preemption_as_in_vllm() {
    // The preemption scenario above, stamped like the engine loop does: scheduled at the start
    // of the first step that schedules a sequence (never moved by re-admission), one first token
    // per sequence, and inter-token gaps that add up to first -> last token.
    let model = LatencyModel::default();
    let mut s = Scheduler::new(cfg(8, 8192, 11), false).unwrap();
    s.add(seq(1, prompt(0, 64), 60, 0.0));
    s.add(seq(2, prompt(1000, 64), 60, 0.0));
    let mut now = 0.0;
    let (mut prefills, mut itl_sum, mut max_itl) = (0, 0.0f64, 0.0f64);
    let mut done = Vec::new();
    let mut step_times = Vec::new();
    while s.has_work() {
        let plan = s.schedule();
        s.mark_scheduled(&plan, now);
        let dt = model.step_seconds(&plan.shape);
        step_times.push(dt);
        now += dt;
        let out = s.finish_step(plan, now);
        for t in &out.sampled {
            assert_eq!(t.first, t.itl_s.is_none());
            if let Some(itl) = t.itl_s {
                itl_sum += itl;
                max_itl = max_itl.max(itl);
            }
        }
        prefills += out.prefills_done.len();
        done.extend(out.finished);
    }
    assert!(s.stats().preemptions >= 1);
    assert_eq!(
        prefills, 2,
        "one first token per sequence, preemption or not"
    );
    let mut decode_sum = 0.0;
    for f in &done {
        let (first, last) = (f.first_token_s.unwrap(), f.last_token_s.unwrap());
        assert_eq!(
            f.scheduled_s,
            Some(0.0),
            "seq {}: re-admission moved it",
            f.id
        );
        // Both 64-token prompts are prefilled in the first step.
        assert_eq!(first, step_times[0]);
        decode_sum += last - first;
    }
    assert!(
        (itl_sum - decode_sum).abs() < 1e-9,
        "{itl_sum} vs {decode_sum}"
    );
    // The preempted sequence's recompute shows up as one long gap.
    let longest_step = step_times.iter().cloned().fold(0.0, f64::max);
    assert!(max_itl > longest_step, "{max_itl} vs {longest_step}");
}
