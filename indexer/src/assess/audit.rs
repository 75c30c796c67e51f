//! The prompt audit (`assess --audit`, off by default: it keeps prompt tokens in memory): from
//! the token ids of the engines' `BlockStored` events, finds request families whose prompts are
//! the same tokens at the same positions but sit in different hash chains because a short run
//! of tokens before them differs (a per-request timestamp or id early in the system prompt: every
//! block after it is computed again for every request). Reports where the prompts diverge, in
//! tokens, how long the differing run is and how much reuse it destroys; the decoded text around
//! it only when asked (`--show-text`). Nothing here is logged.

/// Decodes a model's token ids to text (for `--show-text`); `None` when it cannot.
pub type TextDecoder<'a> = dyn FnMut(&str, &[u32]) -> Option<String> + 'a;

use std::collections::HashMap;

use kvroute_core::events::{learned_block_size, BlockStored, Medium};
use serde::Serialize;

/// Blocks kept by default (at 16 tokens a block, about 25 MiB).
pub const DEFAULT_MAX_BLOCKS: usize = 262_144;

/// Fewest requests (distinct chains) that make a family worth reporting.
pub const MIN_FAMILY: usize = 3;

/// Longest differing run, in blocks, looked back over from a repeated block: beyond it the
/// prompts differ for too long to be "the same prompt but for a short run".
const MAX_RUN_BLOCKS: usize = 64;

/// Chains sampled per repeated block when locating the divergence.
const MAX_SAMPLED: usize = 64;

/// One stored block: its parent and its tokens.
#[derive(Debug, Clone)]
struct Block {
    parent: Option<u64>,
    tokens: Box<[u32]>,
}

/// What the audit keeps of one model's stored blocks (bounded).
#[derive(Debug, Default)]
struct ModelBlocks {
    block_size: usize,
    blocks: HashMap<u64, Block>,
}

/// Collects the blocks of `BlockStored` events (GPU) during an assess window.
#[derive(Debug)]
pub struct PromptAudit {
    max_blocks: usize,
    kept: usize,
    dropped: u64,
    models: HashMap<String, ModelBlocks>,
}

/// Where one family of prompts diverges.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// First token position (0-based, in the prompt) at which the family's prompts differ.
    pub position_tokens: u64,
    /// Tokens from there to the last differing one (the run that breaks the match).
    pub differing_tokens: u64,
    /// Families found diverging in this block (e.g. one per system prompt).
    pub families: u64,
    /// Requests (distinct chains) in those families.
    pub requests: u64,
    /// Tokens stored again only because of the divergence: identical tokens at identical
    /// positions that a prompt without the differing run would have reused.
    pub reuse_destroyed_tokens: u64,
    /// `reuse_destroyed_tokens` over all tokens stored in the window.
    pub reuse_destroyed_share: f64,
    /// With `--show-text`: the decoded text around the divergence, one line per sampled request
    /// (the shared text before it, then that request's differing run and what follows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<Vec<String>>,
}

/// One model's audit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditReport {
    /// Blocks examined.
    pub blocks: u64,
    /// Blocks not kept because the audit was full (`--audit-max-blocks`; over all models).
    pub blocks_dropped: u64,
    /// Divergences found, earliest first.
    pub divergences: Vec<Divergence>,
}

impl AuditReport {
    /// "N blocks examined", and how many were not kept when the memory bound was reached.
    pub fn examined(&self) -> String {
        match self.blocks_dropped {
            0 => format!("{} blocks examined", self.blocks),
            n => format!(
                "{} blocks examined, {n} not kept (--audit-max-blocks)",
                self.blocks
            ),
        }
    }
}

impl Divergence {
    /// The divergence's figures as the report's renderings show them: at token, differing
    /// tokens, requests, families, tokens stored again, share of stored (`"12.5 %"`).
    pub fn cells(&self) -> [String; 6] {
        [
            self.position_tokens.to_string(),
            self.differing_tokens.to_string(),
            self.requests.to_string(),
            self.families.to_string(),
            self.reuse_destroyed_tokens.to_string(),
            format!("{:.1} %", self.reuse_destroyed_share * 100.0),
        ]
    }
}

impl PromptAudit {
    /// An empty audit keeping at most `max_blocks` blocks over all models.
    pub fn new(max_blocks: usize) -> Self {
        Self {
            max_blocks,
            kept: 0,
            dropped: 0,
            models: HashMap::new(),
        }
    }

    /// Records the GPU blocks of one `BlockStored` event of `model` (a malformed event, whose
    /// tokens do not fill its blocks, is skipped).
    pub fn observe(&mut self, model: &str, ev: &BlockStored) {
        if !matches!(ev.medium.unwrap_or_default(), Medium::Gpu) {
            return;
        }
        let bs = ev.block_size as usize;
        if bs == 0 || ev.token_ids.len() != ev.block_hashes.len() * bs {
            return;
        }
        let m = self.models.entry(model.to_string()).or_default();
        let known = u32::try_from(m.block_size).ok().filter(|&b| b > 0);
        match learned_block_size(known, ev.block_size) {
            // A larger multiple: what was kept were hash blocks (`--prefix-match-unit`).
            Some(b) if Some(b) != known && known.is_some() => {
                self.kept -= m.blocks.len().min(self.kept);
                m.blocks.clear();
                m.block_size = bs;
            }
            Some(b) if b == ev.block_size => m.block_size = bs,
            // A hash block inside a block, or a size that fits nothing.
            _ => return,
        }
        let mut parent = ev.parent_block_hash.as_ref().map(|h| h.as_u64());
        for (i, h) in ev.block_hashes.iter().enumerate() {
            let hash = h.as_u64();
            if let std::collections::hash_map::Entry::Vacant(slot) = m.blocks.entry(hash) {
                if self.kept >= self.max_blocks {
                    self.dropped += 1;
                } else if let Some(tokens) = ev.token_ids.get(i * bs..(i + 1) * bs) {
                    self.kept += 1;
                    slot.insert(Block {
                        parent,
                        tokens: tokens.into(),
                    });
                }
            }
            parent = Some(hash);
        }
    }

    /// The audit of every model seen; `decode` turns a model's tokens into text (only called
    /// with `--show-text`).
    pub fn report(&self, mut decode: Option<&mut TextDecoder<'_>>) -> HashMap<String, AuditReport> {
        self.models
            .iter()
            .map(|(name, m)| {
                let mut divergences = find(m);
                if let Some(decode) = decode.as_deref_mut() {
                    for d in &mut divergences {
                        d.0.text = Some(
                            d.1.iter()
                                .filter_map(|tokens| decode(name, tokens))
                                .collect(),
                        );
                    }
                }
                (
                    name.clone(),
                    AuditReport {
                        blocks: m.blocks.len() as u64,
                        blocks_dropped: self.dropped,
                        divergences: divergences.into_iter().map(|d| d.0).collect(),
                    },
                )
            })
            .collect()
    }
}

/// A 64-bit digest of a block's tokens alone (not its chain).
fn content_key(tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Every block's depth (blocks from the prompt's start); blocks whose chain reaches a block
/// not kept have none.
fn depths(m: &ModelBlocks) -> HashMap<u64, usize> {
    let mut out: HashMap<u64, usize> = HashMap::with_capacity(m.blocks.len());
    let mut orphans: std::collections::HashSet<u64> = std::collections::HashSet::new();
    for &start in m.blocks.keys() {
        if out.contains_key(&start) || orphans.contains(&start) {
            continue;
        }
        let mut path = vec![start];
        let base = loop {
            let Some(b) = path.last().and_then(|h| m.blocks.get(h)) else {
                break None;
            };
            match b.parent {
                None => break Some(0),
                Some(p) => {
                    if let Some(&d) = out.get(&p) {
                        break Some(d + 1);
                    }
                    if !m.blocks.contains_key(&p)
                        || orphans.contains(&p)
                        || path.len() > m.blocks.len()
                    {
                        break None;
                    }
                    path.push(p);
                }
            }
        };
        let Some(base) = base else {
            orphans.extend(path);
            continue;
        };
        // path[last] is at depth `base`, path[0] at base + len - 1.
        let len = path.len();
        for (i, h) in path.into_iter().enumerate() {
            out.insert(h, base + (len - 1 - i));
        }
    }
    out
}

/// The divergences of one model, each with sampled chains' tokens from the block before the
/// divergence to the first repeated block (for the text).
fn find(m: &ModelBlocks) -> Vec<(Divergence, Vec<Vec<u32>>)> {
    let bs = m.block_size;
    let depth = depths(m);
    // Identical tokens at the same depth under different chains.
    let mut same: HashMap<(usize, u64), Vec<u64>> = HashMap::new();
    for (&h, &d) in &depth {
        if let Some(b) = m.blocks.get(&h) {
            same.entry((d, content_key(&b.tokens))).or_default().push(h);
        }
    }
    for hs in same.values_mut() {
        hs.sort_unstable();
    }
    let groups: Vec<&Vec<u64>> = same.values().filter(|hs| hs.len() >= 2).collect();
    let repeated: HashMap<u64, usize> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, hs)| hs.iter().map(move |&h| (h, g)))
        .collect();
    // Group index -> its family's first group (the one right after the differing run).
    let mut by_depth: Vec<(usize, usize)> = groups
        .iter()
        .enumerate()
        .map(|(g, hs)| (depth[&hs[0]], g))
        .collect();
    by_depth.sort_unstable();
    let mut family_of: Vec<usize> = (0..groups.len()).collect();
    let mut starts: HashMap<usize, FamilyStart> = HashMap::new();
    for &(d, g) in &by_depth {
        let members = groups[g];
        let parents: Vec<Option<usize>> = members
            .iter()
            .map(|h| {
                let p = m.blocks.get(h)?.parent?;
                repeated.get(&p).copied()
            })
            .collect();
        let continues = parents.first().copied().flatten().filter(|pg| {
            parents.iter().all(|q| *q == Some(*pg)) && groups[*pg].len() >= members.len()
        });
        let destroyed = ((members.len() - 1) * bs) as u64;
        if let Some(pg) = continues {
            let f = family_of[pg];
            family_of[g] = f;
            if let Some(s) = starts.get_mut(&f) {
                s.destroyed += destroyed;
            }
            continue;
        }
        if members.len() < MIN_FAMILY {
            continue;
        }
        if let Some(mut found) = locate(m, members, d) {
            found.destroyed = destroyed;
            starts.insert(g, found);
        }
    }
    let stored = (m.blocks.len() * bs) as f64;
    // Merge the families that diverge in the same block.
    let mut merged: HashMap<usize, (Divergence, Vec<Vec<u32>>)> = HashMap::new();
    for f in starts.into_values() {
        let (first, last) = (f.first, f.last);
        let e = merged.entry(f.block).or_insert_with(|| {
            (
                Divergence {
                    position_tokens: first as u64,
                    differing_tokens: 0,
                    families: 0,
                    requests: 0,
                    reuse_destroyed_tokens: 0,
                    reuse_destroyed_share: 0.0,
                    text: None,
                },
                f.text.clone(),
            )
        });
        let d = &mut e.0;
        d.position_tokens = d.position_tokens.min(first as u64);
        d.differing_tokens = d
            .differing_tokens
            .max((last + 1).saturating_sub(first) as u64);
        d.families += 1;
        d.requests += f.requests as u64;
        d.reuse_destroyed_tokens += f.destroyed;
        d.reuse_destroyed_share = if stored > 0.0 {
            d.reuse_destroyed_tokens as f64 / stored
        } else {
            0.0
        };
    }
    let mut out: Vec<(Divergence, Vec<Vec<u32>>)> = merged.into_values().collect();
    out.sort_by_key(|d| d.0.position_tokens);
    out
}

/// Where one family's prompts diverge.
struct FamilyStart {
    /// The first block (depth) in which they differ.
    block: usize,
    /// First and last differing token positions.
    first: usize,
    last: usize,
    /// Requests (distinct chains) in the family.
    requests: usize,
    /// Tokens stored again because of the divergence (summed over the family's blocks).
    destroyed: u64,
    /// A few chains' tokens from one block before the divergence through the first shared one.
    text: Vec<Vec<u32>>,
}

/// Walks the chains of `members` (identical blocks at depth `d`) back to their last common
/// block and locates where they differ (`destroyed` is left to the caller).
fn locate(m: &ModelBlocks, members: &[u64], d: usize) -> Option<FamilyStart> {
    let bs = m.block_size;
    let sampled: Vec<u64> = members.iter().copied().take(MAX_SAMPLED).collect();
    // chains[i][k]: member i's ancestor k blocks above depth d (k = 0 is the member).
    let mut chains: Vec<Vec<u64>> = sampled.iter().map(|&h| vec![h]).collect();
    let mut common: Option<usize> = None; // depth of the last common block
    for k in 1..=d.min(MAX_RUN_BLOCKS) {
        let mut next = Vec::with_capacity(chains.len());
        for c in &chains {
            let last = *c.last()?;
            next.push(m.blocks.get(&last)?.parent?);
        }
        for (c, p) in chains.iter_mut().zip(&next) {
            c.push(*p);
        }
        if next.iter().all(|p| *p == next[0]) {
            common = Some(d - k);
            break;
        }
    }
    let run_start = match common {
        Some(c) => c + 1,
        None if d <= MAX_RUN_BLOCKS => 0,
        None => return None,
    };
    // Tokens of each sampled chain from run_start to d - 1 (the differing run).
    let tokens_of = |c: &Vec<u64>, from: usize| -> Option<Vec<u32>> {
        let mut t = Vec::new();
        for depth in from..=d {
            let h = c[d - depth];
            t.extend_from_slice(&m.blocks.get(&h)?.tokens);
        }
        Some(t)
    };
    let runs: Vec<Vec<u32>> = chains
        .iter()
        .map(|c| tokens_of(c, run_start))
        .collect::<Option<_>>()?;
    let reference = &runs[0];
    let mut first = usize::MAX;
    let mut last = 0usize;
    for r in &runs[1..] {
        for (i, (a, b)) in reference.iter().zip(r).enumerate() {
            if a != b {
                first = first.min(i);
                last = last.max(i);
            }
        }
    }
    if first == usize::MAX {
        // Same tokens, different hashes: something beside the tokens (a salt, a LoRA) differs.
        first = 0;
        last = 0;
    }
    let base = run_start * bs;
    // For the text: one block of shared context before the run, when there is one.
    let context_from = common.unwrap_or(run_start);
    let text: Vec<Vec<u32>> = chains
        .iter()
        .take(3)
        .filter_map(|c| {
            if common.is_some() {
                let mut t = m.blocks.get(&c[d - context_from])?.tokens.to_vec();
                t.extend(tokens_of(c, run_start)?);
                Some(t)
            } else {
                tokens_of(c, run_start)
            }
        })
        .collect();
    Some(FamilyStart {
        block: run_start,
        first: base + first,
        last: base + last,
        requests: members.len(),
        destroyed: 0,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::events::WireBlockHash;

    /// Stores `tokens` as one chain of 4-token blocks with hashes chained from the tokens.
    fn store(audit: &mut PromptAudit, tokens: &[u32]) {
        let mut parent: Option<u64> = None;
        let mut hashes = Vec::new();
        for b in tokens.chunks_exact(4) {
            let h = content_key(b) ^ parent.unwrap_or(7).rotate_left(17).wrapping_mul(31);
            hashes.push(WireBlockHash::Int(h));
            parent = Some(h);
        }
        let ev = BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: tokens[..hashes.len() * 4].to_vec(),
            block_size: 4,
            ..BlockStored::default()
        };
        audit.observe("m", &ev);
    }

    fn prompt(stamp: u32, question: u32) -> Vec<u32> {
        // 2 constant tokens, a 2-token stamp, 20 constant tokens, then 8 of the question.
        let mut t = vec![1, 2, stamp, stamp + 1];
        t.extend(100..120);
        t.extend((0..8).map(|i| 1000 * question + i));
        t
    }

    #[test]
    fn a_per_request_stamp_is_found_where_it_is() {
        let mut audit = PromptAudit::new(10_000);
        for r in 0..5 {
            store(&mut audit, &prompt(50 + 2 * r, r));
        }
        let report = audit.report(None);
        let m = &report["m"];
        assert_eq!(m.divergences.len(), 1, "{m:?}");
        let d = &m.divergences[0];
        assert_eq!(d.position_tokens, 2);
        assert_eq!(d.differing_tokens, 2);
        assert_eq!(d.requests, 5);
        assert_eq!(d.families, 1);
        // 5 blocks of 4 after the stamp's block are identical in all 5 prompts: 4 copies extra.
        assert_eq!(d.reuse_destroyed_tokens, 4 * 5 * 4);
        assert!(d.text.is_none(), "no text unless asked");
    }

    #[test]
    fn hash_block_events_before_or_among_the_blocks_change_nothing() {
        let hash_block = |tokens: &[u32]| BlockStored {
            block_hashes: vec![WireBlockHash::Int(content_key(tokens))],
            token_ids: tokens.to_vec(),
            block_size: 2,
            ..BlockStored::default()
        };
        let mut audit = PromptAudit::new(10_000);
        audit.observe("m", &hash_block(&[1, 2]));
        for r in 0..5 {
            store(&mut audit, &prompt(50 + 2 * r, r));
            audit.observe("m", &hash_block(&[9, r]));
        }
        let report = audit.report(None);
        let d = &report["m"].divergences;
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].position_tokens, 2);
        assert_eq!(d[0].reuse_destroyed_tokens, 4 * 5 * 4);
    }

    #[test]
    fn clean_prompts_and_one_off_differences_report_nothing() {
        let mut audit = PromptAudit::new(10_000);
        for r in 0..5 {
            store(&mut audit, &prompt(50, r));
        }
        // Two prompts only differing early: under the family size.
        let mut other = PromptAudit::new(10_000);
        store(&mut other, &prompt(60, 1));
        store(&mut other, &prompt(70, 1));
        for a in [audit, other] {
            assert!(a.report(None)["m"].divergences.is_empty());
        }
    }

    #[test]
    fn the_text_is_decoded_only_when_asked_and_memory_is_bounded() {
        let mut audit = PromptAudit::new(10_000);
        for r in 0..4 {
            store(&mut audit, &prompt(50 + 2 * r, r));
        }
        let mut decode = |_: &str, t: &[u32]| Some(format!("{:?}", &t[..4]));
        let report = audit.report(Some(&mut decode));
        let text = report["m"].divergences[0].text.as_ref().expect("text");
        assert_eq!(text.len(), 3);
        assert!(text.iter().all(|t| t.starts_with("[1, 2, 5")), "{text:?}");
        let mut small = PromptAudit::new(3);
        store(&mut small, &prompt(50, 0));
        let r = &small.report(None)["m"];
        assert_eq!((r.blocks, r.blocks_dropped), (3, 5));
    }
}
