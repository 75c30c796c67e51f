//! Whether the filter tokenises a model as the indexer and the engines do: the filter's
//! [`TokenizerDigest`] against the indexer's own, and the verdict of the filter's online checks
//! against the engine (`POST /v1/models/{model}/agreement`). Shown on `/readyz` and `/metrics`.

use kvroute_core::api::{AgreementReport, TokenCheck, TokenizerDigest};

/// What changed with one report, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgreementEvent {
    /// The filter's digest differs from the indexer's in these parts.
    DigestMismatch(Vec<&'static str>),
    /// The filter's digest now equals the indexer's.
    DigestAgrees,
    /// An online check found the engine's tokens differ from the filter's.
    TokensDisagree(TokenCheck),
    /// A filter with another tokenizer than the one that disagreed reported: the mismatch is over.
    MismatchCleared,
}

/// A copy of the numbers `/metrics` shows.
#[derive(Debug, Clone, Default)]
pub struct AgreementView {
    /// Parts of the filter's digest that differ from the indexer's.
    pub digest_differs: Vec<&'static str>,
    /// Online checks that agreed.
    pub agreed: u64,
    /// Online checks that disagreed.
    pub disagreed: u64,
    /// A token mismatch stands.
    pub mismatch: bool,
}

/// One model's agreement state.
#[derive(Debug, Default)]
pub struct Agreement {
    /// The indexer's digest of the model (computed once, from `model_dir`).
    pub own: Option<TokenizerDigest>,
    /// The last digest a filter reported.
    pub filter: Option<TokenizerDigest>,
    /// Online checks whose tokens agreed.
    pub checks_agreed: u64,
    /// Online checks whose tokens differed.
    pub checks_disagreed: u64,
    /// The filter tokenizer whose tokens differed from the engine's, and the first such check.
    pub mismatch: Option<(TokenizerDigest, TokenCheck)>,
}

impl Agreement {
    /// Takes a filter's report; `own` is the indexer's digest when it has one (no `model_dir`:
    /// none, and only the online checks count).
    pub fn record(
        &mut self,
        own: Option<&TokenizerDigest>,
        report: &AgreementReport,
    ) -> Vec<AgreementEvent> {
        let mut events = Vec::new();
        if let Some(own) = own {
            let before = self
                .filter
                .as_ref()
                .map(|f| own.differences(f))
                .unwrap_or_default();
            let now = own.differences(&report.digest);
            if now != before || self.own.is_none() {
                events.push(if now.is_empty() {
                    AgreementEvent::DigestAgrees
                } else {
                    AgreementEvent::DigestMismatch(now)
                });
            }
            self.own = Some(own.clone());
        }
        self.filter = Some(report.digest.clone());
        if self
            .mismatch
            .as_ref()
            .is_some_and(|(bad, _)| *bad != report.digest)
        {
            self.mismatch = None;
            events.push(AgreementEvent::MismatchCleared);
        }
        if let Some(check) = &report.check {
            if check.agrees() {
                self.checks_agreed += 1;
            } else {
                self.checks_disagreed += 1;
                if self.mismatch.is_none() {
                    self.mismatch = Some((report.digest.clone(), check.clone()));
                    events.push(AgreementEvent::TokensDisagree(check.clone()));
                }
            }
        }
        events
    }

    /// The filter's digest differs from the indexer's.
    pub fn digest_mismatch(&self) -> Option<Vec<&'static str>> {
        match (&self.own, &self.filter) {
            (Some(own), Some(filter)) => Some(own.differences(filter)).filter(|d| !d.is_empty()),
            _ => None,
        }
    }

    /// The numbers `/metrics` shows.
    pub fn view(&self) -> AgreementView {
        AgreementView {
            digest_differs: self.digest_mismatch().unwrap_or_default(),
            agreed: self.checks_agreed,
            disagreed: self.checks_disagreed,
            mismatch: self.mismatch.is_some(),
        }
    }

    /// `/readyz` problems of this model.
    pub fn problems(&self, model: &str) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(parts) = self.digest_mismatch() {
            out.push(format!(
                "model {model}: the filter's tokenizer differs from the indexer's ({})",
                parts.join(", ")
            ));
        }
        if let Some((_, check)) = &self.mismatch {
            out.push(format!(
                "model {model}: token mismatch with the engine ({} request: {} tokens here, {} at \
                 the engine, first difference at {}); not routed by prefix until fixed",
                check.endpoint,
                check.own_tokens,
                check.engine_tokens,
                check
                    .first_difference
                    .map(|p| p.to_string())
                    .unwrap_or_default()
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(template: &str) -> TokenizerDigest {
        TokenizerDigest {
            tokenizer: "t".into(),
            template: template.into(),
            options: "o".into(),
        }
    }

    fn report(template: &str, check: Option<TokenCheck>) -> AgreementReport {
        AgreementReport {
            digest: digest(template),
            check,
        }
    }

    #[test]
    fn digests_are_compared_and_named() {
        let mut a = Agreement::default();
        let own = digest("right");
        let ev = a.record(Some(&own), &report("wrong", None));
        assert_eq!(ev, vec![AgreementEvent::DigestMismatch(vec!["template"])]);
        assert!(a.problems("m")[0].contains("differs from the indexer's (template)"));
        assert!(
            a.record(Some(&own), &report("wrong", None)).is_empty(),
            "said once"
        );
        let ev = a.record(Some(&own), &report("right", None));
        assert_eq!(ev, vec![AgreementEvent::DigestAgrees]);
        assert!(a.problems("m").is_empty());
    }

    #[test]
    fn a_disagreeing_check_sticks_until_another_tokenizer_reports() {
        let mut a = Agreement::default();
        let bad = TokenCheck::compare("chat", &[1, 2, 3], &[1, 2, 4]);
        let ev = a.record(None, &report("x", Some(bad)));
        assert!(matches!(ev[0], AgreementEvent::TokensDisagree(_)));
        let good = TokenCheck::compare("completions", &[1], &[1]);
        a.record(None, &report("x", Some(good.clone())));
        assert_eq!((a.checks_agreed, a.checks_disagreed), (1, 1));
        let p = a.problems("m").join(";");
        assert!(
            p.contains("token mismatch") && p.contains("first difference at 2"),
            "{p}"
        );
        let ev = a.record(None, &report("fixed", Some(good)));
        assert_eq!(ev, vec![AgreementEvent::MismatchCleared]);
        assert!(a.problems("m").is_empty());
    }
}
